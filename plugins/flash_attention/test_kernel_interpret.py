"""The Triton kernel under the Triton interpreter (CPU), against the float64 reference.

TRITON_INTERPRET must be set before triton is imported (triton.language's own @jit helpers such
as tl.cdiv are decided at import), so the cases run in one child process started with it; each
test checks its case's result. Small tiles (16 x 16) make short sequences cover several blocks,
partial blocks and the causal band. bf16 is left to the GPU tests: the interpreter's tl.dot on
bf16 operands is wrong (Triton 3.9).
"""

from __future__ import annotations

import pytest

from optfuse.kernels.testing import interpreter_results, run_interpreter_cases

# id -> (B, H, Hkv, Sq, Sk, D, causal, bias_shape, dtype, extra)
CASES = {
    "gqa_odd_lengths": (1, 2, 1, 37, 29, 32, 0, None, "float16", {}),
    "causal_sk_lt_sq_dead_rows": (1, 2, 1, 37, 29, 32, 1, None, "float16", {}),
    "causal_key_padding": (1, 2, 2, 20, 45, 64, 1, (1, 1, 1, 45), "float16", {}),
    "full_bias_d80_padded": (2, 4, 2, 33, 17, 80, 0, (2, 4, 33, 17), "float16", {}),
    "row_bias_fp32": (1, 3, 3, 19, 23, 32, 0, (19, 1), "float32", {}),
    "scalar_bias": (1, 2, 1, 19, 23, 32, 1, (), "float16", {}),
    "fp32_d96_causal": (1, 2, 1, 31, 17, 96, 1, None, "float32", {}),
    "masked_rows": (1, 2, 1, 19, 23, 32, 0, (1, 2, 19, 23), "float32", {"poison": "rows"}),
    "masked_rows_causal": (1, 2, 1, 19, 23, 32, 1, (1, 2, 19, 23), "float32", {"poison": "rows"}),
    "scalar_bias_minus_inf": (1, 2, 2, 9, 11, 32, 0, (), "float16", {"poison": "all"}),
    "negative_scale": (1, 2, 1, 21, 21, 32, 1, None, "float16", {"scale": -0.2}),
    "rising_row_max": (1, 2, 1, 37, 53, 32, 0, None, "float16", {"spread": True}),
    "rising_row_max_causal": (1, 2, 2, 45, 67, 64, 1, (), "float16", {"spread": True}),
    # windows (causal within w keys, two-sided, Sk != Sq), soft-capping
    "sliding_window_causal": (1, 2, 1, 70, 70, 32, 1, None, "float16", {"window": (20, -1)}),
    "sliding_window_sk_gt_sq": (1, 2, 2, 29, 61, 32, 1, (), "float16", {"window": (7, -1)}),
    "window_two_sided": (1, 2, 1, 53, 53, 32, 0, None, "float32", {"window": (9, 4)}),
    "window_one_key": (1, 2, 1, 40, 40, 32, 1, None, "float32", {"window": (0, -1)}),
    "softcap_causal": (1, 2, 1, 37, 37, 32, 1, None, "float16", {"softcap": 2.0, "scale": 0.9}),
    "softcap_window_fp32": (1, 2, 1, 41, 41, 32, 1, None, "float32", {"softcap": 1.5, "window": (10, -1)}),
    # key padding: blocks before the first and after the last unmasked key are skipped
    "keypad_right": (3, 2, 1, 45, 70, 32, 0, (3, 1, 1, 70), "float32", {"keypad": "right"}),
    "keypad_left_causal": (3, 2, 2, 60, 60, 32, 1, (3, 1, 1, 60), "float32", {"keypad": "left"}),
    "keypad_window": (3, 2, 1, 64, 64, 32, 1, (3, 1, 1, 64), "float32", {"keypad": "right", "window": (12, -1)}),
    "keypad_dead_batch": (2, 2, 1, 33, 50, 32, 0, (2, 1, 1, 50), "float32", {"keypad": "dead"}),
    "keypad_fp16_bias": (2, 2, 1, 33, 50, 32, 0, (2, 1, 1, 50), "float16", {"keypad": "right"}),
    # block layouts (128-blocks; shared or per head; empty query blocks; causal on top)
    "layout_shared": (1, 2, 1, 300, 280, 32, 0, None, "float16", {"layout": (0.5, 1)}),
    "layout_heads_causal": (1, 2, 2, 260, 260, 32, 1, (), "float16", {"layout": (0.6, 2)}),
    "layout_keypad": (2, 2, 1, 200, 270, 32, 0, (2, 1, 1, 270), "float32", {"layout": (0.7, 1), "keypad": "right"}),
}



def _run_case(B, H, Hkv, Sq, Sk, D, causal, bias_shape, dtype, extra):
    import torch

    from optfuse.kernels.registry import plugin_module

    T = plugin_module("flash_attention", "testing")
    L = plugin_module("flash_attention", "launch")
    gen = torch.Generator().manual_seed(0)
    q, k, v, bias = T.random_inputs(B, H, Hkv, Sq, Sk, D, dtype, bias_shape, generator=gen)
    if extra.get("poison") == "rows":
        bias[..., 3, :] = float("-inf")                   # every score -inf -> 0
        bias[..., 5, :] = torch.finfo(torch.float32).min  # HF mask -> uniform average of v
        bias[..., 7, ::2] = float("-inf")                 # partly masked: a normal softmax
    elif extra.get("poison") == "all":
        bias.fill_(float("-inf"))
    if "keypad" in extra:
        T.key_padding(bias, extra["keypad"])
    attrs, layout = T.sparse_attrs(H, Hkv, D, causal, Sq, Sk, extra, extra.get("scale"))
    if extra.get("spread"):  # growing key norms: the row max keeps rising, every block rescales
        k.mul_(torch.linspace(0.5, 8.0, Sk).reshape(1, 1, Sk, 1).to(k.dtype))
    cfg = L.FAConfig(16, 16, 1, 1)
    src, params = T.case_sources(dtype, [q.shape, k.shape, v.shape, None if bias is None else bias.shape],
                                 attrs, config=cfg, layout=layout)
    out = torch.full_like(q, float("nan"))
    ins = [q, k, v] + ([bias] if bias is not None else [])
    if layout is not None:
        ins += [torch.from_numpy(layout[0]), torch.from_numpy(layout[1])]
    T.run_triton(src, params, ins, [out], interpret=True)
    ref = T.reference_of(q, k, v, bias, attrs, layout=layout)
    T.check_close(out, ref, dtype, src.name)
    if extra.get("poison") == "rows":
        assert (out[..., 3, :] == 0).all(), "an all -inf row must give 0"
    if extra.get("poison") == "all":
        assert (out == 0).all(), "a -inf scalar bias masks everything"


@pytest.fixture(scope="module")
def results():
    return interpreter_results(__file__)


@pytest.mark.parametrize("case", list(CASES))
def test_interpreter_matches_reference(results, case):
    assert results.get(case) == "ok", results.get(case, "not run")


if __name__ == "__main__":
    run_interpreter_cases(CASES, _run_case)
