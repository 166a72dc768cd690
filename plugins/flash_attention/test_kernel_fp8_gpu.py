"""The FP8 form of FlashAttention (E4M3 q, k, v; float32 scales; v as [B, Hkv, D, Skv]) as AOT
artifacts launched through optfuse.kernels.launcher on a GPU (sm_89 / sm_90), against the float64
reference of the dequantized math. Fresh random inputs every run (the seed is printed); outputs are
poisoned with NaN before each launch and v's padding keys hold NaN, so unwritten outputs and reads
past Sk fail. Error bounds: testing.FP8_REL_L2 / fp8_max_abs_bound (E4M3 probabilities dominate).

Run on the device machine: ``python -m pytest plugins/flash_attention -m gpu``.
"""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from optfuse.kernels.registry import plugin_module  # noqa: E402

T = plugin_module("flash_attention", "testing")
L = plugin_module("flash_attention", "launch")

pytestmark = pytest.mark.gpu

# (B, H, Hkv, Sq, Sk, D, causal, bias_shape, out_dtype, extra): Sq and Sk off the 64/128 tiles
# and (mostly) off 16, so v's rows carry padding keys; extra: margin (< 1: the top of each tensor
# saturates to +-448), magnitude (values scaled: scales far from 1), keypad, window, softcap.
CASES = [
    (2, 8, 2, 300, 517, 128, 0, None, "bfloat16", {}),
    (2, 8, 2, 517, 300, 128, 1, None, "bfloat16", {}),          # Sk < Sq: dead rows -> 0
    (1, 4, 4, 1000, 1000, 128, 1, None, "float16", {}),
    (2, 8, 8, 1024, 1024, 128, 0, (), "bfloat16", {}),          # scalar bias (the rewrite's 0)
    (1, 4, 2, 4100, 4100, 128, 1, None, "bfloat16", {}),
    (3, 6, 3, 257, 383, 64, 0, (3, 1, 1, 383), "float16", {"keypad": "right"}),
    (2, 4, 1, 129, 700, 64, 1, (2, 1, 1, 700), "bfloat16", {"keypad": "left"}),
    (2, 4, 4, 200, 190, 64, 0, (2, 4, 200, 190), "float32", {}),  # full bias
    (1, 4, 2, 2000, 2000, 64, 1, None, "bfloat16", {}),
    (2, 4, 4, 64, 1500, 64, 0, None, "bfloat16", {}),
    (1, 2, 2, 333, 333, 32, 1, None, "float16", {}),
    (2, 2, 2, 150, 260, 80, 0, None, "bfloat16", {}),           # padded head dims
    (1, 2, 2, 190, 310, 256, 0, (), "bfloat16", {}),
    (1, 4, 2, 1500, 1500, 128, 1, None, "bfloat16", {"window": (127, -1)}),
    (1, 4, 2, 777, 777, 64, 1, None, "float16", {"softcap": 30.0}),
    # scales at the E4M3 range edges
    (2, 4, 2, 700, 700, 128, 0, None, "bfloat16", {"margin": 0.25}),     # saturation to +-448
    (2, 4, 2, 700, 700, 64, 1, None, "float16", {"magnitude": 1e-4}),    # scales ~ 1e-6
    (2, 4, 2, 700, 700, 128, 1, None, "float32", {"magnitude": 3e4}),    # scales ~ 300
    (1, 8, 8, 4096, 4096, 128, 0, None, "bfloat16", {}),                 # the benchmark's shape class
    # sm_90's CUDA kernel (D = 128, no bias / scalar): fewer keys than a block, a 2-row query
    (2, 4, 2, 129, 45, 128, 0, None, "bfloat16", {}),
    (3, 2, 1, 2, 1000, 128, 1, (), "float16", {}),
]


@pytest.fixture(scope="module")
def seed():
    s = int.from_bytes(os.urandom(4), "little")
    print(f"\nflash_attention fp8 gpu tests: seed {s}")
    return s


def _device_arch():
    from optfuse.kernels.target import detect_arch

    return detect_arch()


def _case_id(c):
    extra = ",".join(f"{k}={v}" for k, v in c[9].items()).replace(" ", "")
    return "-".join(map(str, c[:9])).replace(" ", "") + ("-" + extra if extra else "")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_fp8_artifact_matches_reference(case, seed):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if _device_arch() < 89:
        pytest.skip("FP8 needs sm_89 or newer")
    check_fp8_case(case, seed, arch=_device_arch())


@pytest.mark.parametrize("config", [L.FAConfig(128, 128, 8, 3), L.FAConfig(64, 64, 4, 3), L.FAConfig(128, 64, 8, 4)],
                         ids=lambda c: f"{c.block_m}x{c.block_n}_{c.num_warps}w_{c.num_stages}s")
def test_fp8_sweep_configs(config, seed):
    """The configs a tuning sweep tries (candidate_configs) on one ragged causal and one
    non-causal case."""
    if not torch.cuda.is_available() or _device_arch() < 89:
        pytest.skip("needs an sm_89+ device")
    for case in [(2, 4, 2, 517, 1031, 128, 1, None, "bfloat16", {}), (2, 4, 2, 300, 300, 64, 0, (), "float16", {})]:
        check_fp8_case(case, seed, arch=_device_arch(), config=config)


#: The CUDA kernel's FP8 options beside its default (launch.candidate_configs: what a sweep times)
SM90_VARIANTS = {"cp.async": {"tma": False}, "2stages": {"stages": 2}, "4stages": {"stages": 4}}
SM90_VARIANT_CASES = [(2, 8, 2, 517, 1031, 128, 1, None, "bfloat16", {}), (2, 4, 4, 300, 300, 128, 0, (), "float16", {})]


@pytest.mark.parametrize("variant", list(SM90_VARIANTS))
def test_fp8_sm90_variants(variant, seed):
    """The CUDA kernel's FP8 path with its other load mode and ring depths, on a ragged causal and a
    non-causal case."""
    if not torch.cuda.is_available() or _device_arch() != 90:
        pytest.skip("needs an sm_90 device")
    for case in SM90_VARIANT_CASES:
        check_fp8_case(case, seed, arch=90, config=L.sm90_config(128, case[6], fp8=True, **SM90_VARIANTS[variant]))


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_fp8_launch_plan(case, seed):
    """What the classic plugin runs on sm_90 (launch_plan through the launcher): the CUDA kernel's
    HOST_MAPS build where the FP8 path takes the case (V^T's map: Sk keys as columns, rows Skv apart,
    so the NaN padding keys never load)."""
    if not torch.cuda.is_available() or _device_arch() != 90:
        pytest.skip("needs an sm_90 device")
    check_fp8_case(case, seed, arch=90, plan=True)


def check_fp8_case(case, seed, arch=None, config=None, plan=False):
    from optfuse.kernels import launch
    from optfuse.kernels.launcher import launch_plan

    B, H, Hkv, Sq, Sk, D, causal, bias_shape, out_dtype, extra = case
    gen = torch.Generator().manual_seed(seed + hash(case[:9]) % 1000)
    q, k, v, bias = T.random_inputs(B, H, Hkv, Sq, Sk, D, "float32", bias_shape, generator=gen)
    if bias is not None:
        bias = bias.to(torch.bfloat16 if out_dtype == "bfloat16" else torch.float16)
    if "keypad" in extra:
        T.key_padding(bias, extra["keypad"])
    mag = extra.get("magnitude", 1.0)
    q8, k8, vt8, scales = T.fp8_inputs(q * mag, k * mag, v * mag, margin=extra.get("margin", 1.0))
    attrs, _ = T.sparse_attrs(H, Hkv, D, causal, Sq, Sk, extra, D ** -0.5 / mag ** 2)
    attrs["output_dtype"] = out_dtype
    shapes = [q8.shape, k8.shape, vt8.shape, None if bias is None else bias.shape]
    bias_dtype = None if bias is None else str(bias.dtype)
    if plan:
        plan = T.case_plan(L.FP8, shapes, attrs, arch=arch, bias_dtype=bias_dtype)
        if plan is None:
            pytest.skip("no plan: the Triton kernel's FP8 branch takes this case")
        (step,) = plan.steps
        assert step.source.defines["HOST_MAPS"] == "1", step.source.name
        src = step.source
        T.build_plan(plan, arch)
    else:
        src, params = T.case_sources(L.FP8, shapes, attrs, config=config, arch=arch, bias_dtype=bias_dtype)
        art = T.get_artifact(src, arch)
    assert src.meta["dtype"] == L.FP8, src.name
    dev_bias = bias.cuda() if bias is not None else None
    ins = [t.cuda() for t in (q8, k8, vt8)] + ([dev_bias] if bias is not None else []) + [s.cuda() for s in scales]
    out = torch.full(q8.shape, float("nan"), dtype=getattr(torch, out_dtype), device="cuda")
    ref = T.fp8_reference_of(q8, k8, vt8, bias, scales, attrs)
    v_absmax = float(vt8[..., :Sk].float().abs().max() * scales[2])
    for _ in range(2):  # twice: a race or a read of unwritten memory shows as a changing result
        out.fill_(float("nan"))
        stream = torch.cuda.current_stream().cuda_stream
        if plan:  # the op's inputs in spec order: q, k, v, bias (or None), the scales
            launch_plan(plan, ins[:3] + [dev_bias] + ins[-3:], [out], 0, stream, sync=True)
        else:
            launch(art, params, ins, [out], stream, sync=True)
        T.check_close_fp8(out, ref, v_absmax, Sk, out_dtype, src.name)
    if causal and Sk < Sq:
        assert (out[:, :, : Sq - Sk, :] == 0).all()
    assert np.isfinite(out.float().cpu().numpy()).all()
