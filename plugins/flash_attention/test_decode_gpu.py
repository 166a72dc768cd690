"""The split-KV decode plan (kernel_decode.py: splits and the last split's combine, or the direct
kernel) through optfuse.kernels.launcher on a GPU, against the float64 NumPy reference: Sq = 1..16 over caches up to 64k keys, odd lengths,
GQA / MQA / MHA, key padding, windows, soft-capping. Fresh random inputs every run (the seed is
printed); the output is poisoned with NaN and every workspace byte with 0xFF (an fp32 NaN) before
each launch, so an unwritten output or a partial the combine reads unwritten fails; the plan runs
twice on one state, which must be zero again after each launch (the last split program resets its
arrival counter).

    python -m pytest plugins/flash_attention/test_decode_gpu.py -m gpu
"""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from optfuse.kernels.registry import plugin_module  # noqa: E402

T = plugin_module("flash_attention", "testing")
L = plugin_module("flash_attention", "launch")

pytestmark = pytest.mark.gpu

# (B, H, Hkv, Sq, Sk, D, causal, bias_shape, dtype, extra); extra: keypad (right / left / dead /
# holes), window (left, right), softcap. bias_shape "keypad" = [B, 1, 1, Sk].
CASES = [
    (1, 32, 8, 1, 65536, 128, 1, None, "bfloat16", {}),
    (1, 32, 8, 16, 65537, 128, 1, None, "float16", {}),
    (1, 32, 8, 4, 40001, 128, 1, "keypad", "bfloat16", {"keypad": "left"}),
    (4, 32, 8, 1, 8191, 128, 1, "keypad", "bfloat16", {"keypad": "right"}),
    (3, 8, 1, 7, 4097, 64, 1, "keypad", "float16", {"keypad": "dead"}),
    (2, 8, 2, 1, 5000, 128, 1, "keypad", "bfloat16", {"keypad": "holes"}),
    (2, 8, 2, 2, 3001, 128, 0, (1, 1, 1, 3001), "float16", {"keypad": "right"}),
    (2, 16, 2, 3, 33333, 128, 1, (), "bfloat16", {}),
    (2, 4, 4, 16, 1025, 64, 1, None, "float32", {}),
    (1, 32, 8, 16, 4097, 128, 1, "keypad", "float32", {"keypad": "left"}),  # fp32: 4 row blocks of 16
    (2, 8, 2, 3, 3000, 256, 0, None, "float32", {}),
    (1, 8, 1, 16, 20001, 256, 1, None, "bfloat16", {}),
    (2, 8, 2, 5, 3000, 80, 0, None, "float16", {}),
    (64, 32, 8, 1, 4096, 128, 1, None, "bfloat16", {}),
    (8, 32, 8, 1, 16385, 64, 1, "keypad", "float16", {"keypad": "left"}),
    (1, 32, 8, 1, 40000, 128, 1, None, "bfloat16", {"window": (4095, -1)}),
    (1, 16, 8, 2, 9000, 128, 1, None, "bfloat16", {"softcap": 50.0}),
    (1, 16, 16, 16, 700, 128, 1, None, "float16", {"window": (100, 3)}),
    # batches large enough for one split: the direct kernel (o written by the split kernel)
    (256, 32, 8, 1, 1024, 128, 1, None, "bfloat16", {}),
    (64, 32, 8, 4, 1500, 64, 1, "keypad", "float16", {"keypad": "left"}),
    (160, 16, 2, 2, 1999, 128, 0, None, "bfloat16", {"window": (700, 20)}),
    (16, 32, 8, 1, 16384, 128, 1, None, "bfloat16", {}),
]
# every Sq from 1 to 16 at one shape (GQA 32/8, odd Sk, causal offset)
CASES += [(2, 32, 8, sq, 3001, 128, 1, None, "bfloat16", {}) for sq in range(1, 17)]


@pytest.fixture(scope="module")
def seed():
    s = int.from_bytes(os.urandom(4), "little")
    print(f"\nflash_attention decode gpu tests: seed {s}")
    return s


def _case_id(c):
    extra = ",".join(f"{k}={v}" for k, v in c[9].items()).replace(" ", "")
    return "-".join(map(str, c[:9])).replace(" ", "") + ("-" + extra if extra else "")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_decode_plan_matches_reference(case, seed):
    from optfuse.kernels.launcher import launch_plan

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    B, H, Hkv, Sq, Sk, D, causal, bias_shape, dtype, extra = case
    if bias_shape == "keypad":
        bias_shape = (B, 1, 1, Sk)
    gen = torch.Generator().manual_seed(seed + hash(case[:9]) % 1000)
    q, k, v, bias = T.random_inputs(B, H, Hkv, Sq, Sk, D, dtype, bias_shape, generator=gen)
    if "keypad" in extra:
        T.key_padding(bias, extra["keypad"])
    attrs, _ = T.sparse_attrs(H, Hkv, D, causal, Sq, Sk, extra)
    from optfuse.kernels.target import detect_arch

    # this device's plan, as the plugin runs it
    shapes = [q.shape, k.shape, v.shape, None if bias is None else bias.shape]
    plan = T.case_plan(dtype, shapes, attrs, arch=detect_arch())
    assert plan is not None, "launch.py must pick the decode plan for these shapes"
    T.build_plan(plan)
    dev = [t.cuda() if t is not None else None for t in (q, k, v, bias)]
    out = torch.empty_like(dev[0])
    workspace = T.new_workspace(plan, "cuda")
    state = T.new_state(plan, "cuda")
    ref = T.reference_of(q, k, v, bias, attrs)
    stream = torch.cuda.current_stream().cuda_stream
    for _ in range(2):  # twice: a race or a read of unwritten memory shows as a changing result
        out.fill_(float("nan"))
        workspace.fill_(255)
        launch_plan(plan, dev, [out], workspace, stream, state=state, sync=True)
        T.check_close(out, ref, dtype, plan.steps[0].source.name)
        assert not state.any(), "the plan leaves its state zero"
    if causal and Sk < Sq:
        assert (out[:, :, : Sq - Sk, :] == 0).all()
    assert np.isfinite(out.float().cpu().numpy()).all()
