"""The split-KV decode kernel (kernel_decode.py: splits, and the combine by each row block's last
split, as launch.py's plan runs it) under the Triton interpreter (CPU), against the float64
reference.

Like test_kernel_interpret.py, the cases run in one child process started with TRITON_INTERPRET=1.
Small tiles (64-key splits of 16-key blocks, the combine 2 rows x 4 splits a step) make short caches
cover several splits, partial blocks, empty splits and several combine steps; each plan runs
twice on one state, which must be zero after each run (the arrival counters reset); a cache of one
split (Sk <= 64 here, or a case's own ``split_keys``) runs the direct kernel, which writes o
itself; the ``dispatch`` cases run the plan launch.py picks, with its default config. The workspace starts as NaN
(every byte 0xFF) and the output as NaN, so a partial or an output left unwritten fails. bf16 is
left to the GPU tests (the interpreter's bf16 dot is wrong).
"""

from __future__ import annotations

import pytest

from optfuse.kernels.testing import interpreter_results, run_interpreter_cases

# id -> (B, H, Hkv, Sq, Sk, D, causal, bias_shape, dtype, extra)
CASES = {
    # GQA 8/2, Sq = 1: one key, a partial split, a scalar bias
    "gqa_sq1_sk1": (1, 8, 2, 1, 1, 64, 1, None, "float16", {}),
    "gqa_sq1_sk37_scalar_bias": (2, 8, 2, 1, 37, 64, 1, (), "float16", {}),
    "gqa_sq4_sk300_keypad_dead_batch": (3, 8, 2, 4, 300, 64, 1, (3, 1, 1, 300), "float32", {"keypad": "dead"}),
    "gqa_sq1_sk1025_d128_keypad_left": (2, 8, 2, 1, 1025, 128, 1, (2, 1, 1, 1025), "float16", {"keypad": "left"}),
    "gqa_sq16_sk37_fp32": (1, 8, 2, 16, 37, 64, 1, None, "float32", {}),
    # MQA 8/1: 8 * 16 = 128 packed rows, two row blocks of 64
    "mqa_sq16_sk1025": (1, 8, 1, 16, 1025, 64, 1, None, "float16", {}),
    "mqa_sq4_sk300_d128": (2, 8, 1, 4, 300, 128, 1, (2, 1, 1, 300), "float16", {"keypad": "right"}),
    "mqa_sq1_sk1": (2, 8, 1, 1, 1, 128, 0, None, "float32", {}),
    # MHA 4/4
    "mha_sq16_sk300_keypad": (2, 4, 4, 16, 300, 128, 1, (2, 1, 1, 300), "float16", {"keypad": "right"}),
    "mha_sq4_sk37_full_fp32": (1, 4, 4, 4, 37, 128, 0, None, "float32", {}),
    "mha_sq1_sk1025_batch_bias": (2, 4, 4, 1, 1025, 64, 0, (1, 1, 1, 1025), "float16", {"keypad": "right"}),
    # causal offset: Sk < Sq leaves the first Sq - Sk rows with no key (-> 0)
    "causal_sk_lt_sq": (1, 8, 2, 16, 1, 64, 1, None, "float32", {}),
    "causal_sk_lt_sq_mqa": (1, 8, 1, 16, 9, 64, 1, None, "float16", {}),
    # padded head dim, windows, soft-cap, row maxima that rise across splits, a -inf scalar bias
    "d80_padded": (1, 4, 2, 2, 300, 80, 1, None, "float16", {}),
    "window_causal": (1, 8, 1, 4, 1025, 64, 1, None, "float16", {"window": (100, -1)}),
    "window_two_sided": (1, 4, 4, 16, 300, 64, 0, None, "float32", {"window": (40, 5)}),
    "softcap": (1, 8, 2, 4, 300, 64, 1, None, "float32", {"softcap": 2.0, "scale": 0.9}),
    "rising_row_max": (1, 8, 2, 1, 1025, 64, 0, None, "float16", {"spread": True}),
    "negative_scale": (1, 8, 2, 4, 300, 64, 1, None, "float16", {"scale": -0.2}),
    "scalar_bias_minus_inf": (1, 8, 2, 1, 300, 64, 0, (), "float16", {"poison": "all"}),
    # launch.py's own plan and default config (256-key splits, 64-key blocks)
    "dispatch_gqa_keypad": (2, 8, 2, 1, 1025, 64, 1, (2, 1, 1, 1025), "float16", {"keypad": "dead", "dispatch": True}),
    "dispatch_mqa_sq7": (1, 8, 1, 7, 600, 128, 1, None, "float32", {"dispatch": True}),
    # the direct kernel over many key blocks: masked edges, key padding, windows, two row blocks
    "direct_gqa_sq4_sk300_keypad": (2, 8, 2, 4, 300, 64, 1, (2, 1, 1, 300), "float16",
                                    {"keypad": "left", "split_keys": 512}),
    "direct_mqa_sq16_sk300_window": (1, 8, 1, 16, 300, 64, 1, None, "float32",
                                     {"window": (100, -1), "split_keys": 512}),
    "direct_dead_batch": (3, 8, 2, 1, 300, 128, 0, (3, 1, 1, 300), "float32", {"keypad": "dead", "split_keys": 512}),
}


def _run_case(B, H, Hkv, Sq, Sk, D, causal, bias_shape, dtype, extra):
    import torch

    from optfuse.kernels.registry import plugin_module

    T = plugin_module("flash_attention", "testing")
    L = plugin_module("flash_attention", "launch")
    gen = torch.Generator().manual_seed(Sq * 1000 + Sk)
    q, k, v, bias = T.random_inputs(B, H, Hkv, Sq, Sk, D, dtype, bias_shape, generator=gen)
    if "keypad" in extra:
        T.key_padding(bias, extra["keypad"])
    if extra.get("poison") == "all":
        bias.fill_(float("-inf"))
    if extra.get("spread"):  # growing key norms: the row max keeps rising, split after split
        k.mul_(torch.linspace(0.5, 8.0, Sk).reshape(1, 1, Sk, 1).to(k.dtype))
    attrs, _ = T.sparse_attrs(H, Hkv, D, causal, Sq, Sk, extra, extra.get("scale"))
    shapes = [q.shape, k.shape, v.shape, None if bias is None else bias.shape]
    if extra.get("dispatch"):
        plan = T.case_plan(dtype, shapes, attrs)
        assert plan is not None, "launch.py must pick the decode plan here"
    else:
        cfg = L.DecodeConfig(split_keys=extra.get("split_keys", 64), block_n=16, num_warps=1, num_stages=1,
                             combine_rows=2, combine_splits=4)
        plan = T.forced_decode_plan(dtype, shapes, attrs, decode=cfg)
    one_split = Sk <= plan.steps[0].source.meta["config"]["split_keys"]
    assert [s.source.entry for s in plan.steps] == ["_decode_split_kernel"]
    assert plan.steps[0].source.meta["kernel"] == ("decode_direct" if one_split else "decode_split")
    ref = T.reference_of(q, k, v, bias, attrs)
    state = T.new_state(plan)
    for launch in range(2):  # the same state twice: the counters the first launch used are zero again
        out = torch.full_like(q, float("nan"))
        T.run_plan_triton(plan, [q, k, v, bias], [out], interpret=True, state=state)
        T.check_close(out, ref, dtype, f"{plan.steps[0].source.name} (launch {launch + 1})")
        assert not state.any(), "the plan leaves its state zero"
    if causal and Sk < Sq and "window" not in extra:
        assert (out[:, :, : Sq - Sk, :] == 0).all(), "rows that see no key give 0"
    if extra.get("poison") == "all":
        assert (out == 0).all(), "a -inf scalar bias masks everything"


@pytest.fixture(scope="module")
def results():
    return interpreter_results(__file__)


@pytest.mark.parametrize("case", list(CASES))
def test_decode_interpreter_matches_reference(results, case):
    assert results.get(case) == "ok", results.get(case, "not run")


if __name__ == "__main__":
    run_interpreter_cases(CASES, _run_case)
