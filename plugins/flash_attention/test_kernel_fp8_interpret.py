"""The FP8 form of the Triton kernel under the Triton interpreter (CPU), against the float64
reference of the dequantized math (testing.check_close_fp8's bounds).

The interpreter runs E4M3 dots exactly (products of E4M3 values summed in fp32), but its fp32 ->
E4M3 rounding is wrong where rounding up crosses a power of two (Triton 3.9: 124.8 -> 64), which
doubles the error of p @ v; the child replaces that conversion with the GPU's (round to nearest
even, saturating: testing.exact_fp8_rounding_in_interpreter). Small tiles (16 x 16) make
short sequences cover several blocks, partial blocks and the causal band; Sk not a multiple of 16
leaves padding keys in v (NaN: a read would show).
"""

from __future__ import annotations

import pytest

from optfuse.kernels.testing import interpreter_results, run_interpreter_cases

# id -> (B, H, Hkv, Sq, Sk, D, causal, bias_shape, out_dtype, extra)
CASES = {
    "gqa_odd_lengths": (1, 2, 1, 37, 29, 32, 0, None, "float32", {}),
    "full_blocks_hot_path": (1, 2, 2, 64, 64, 32, 0, None, "float16", {}),
    "causal_sk_lt_sq_dead_rows": (1, 2, 1, 37, 29, 32, 1, None, "float32", {}),
    "causal_sk_gt_sq_d64": (1, 2, 2, 20, 45, 64, 1, None, "float16", {}),
    "d80_padded_head_dim": (1, 2, 1, 33, 17, 80, 0, None, "float32", {}),
    "scalar_bias_causal": (1, 2, 1, 19, 23, 32, 1, (), "float32", {}),
    "key_padding_fp16_bias": (2, 2, 1, 33, 50, 32, 0, (2, 1, 1, 50), "float16", {"keypad": "right"}),
    "full_bias": (2, 2, 1, 17, 21, 32, 0, (2, 2, 17, 21), "float32", {}),
    "rising_row_max": (1, 2, 1, 37, 53, 32, 0, None, "float32", {"spread": True}),
    "window_softcap": (1, 2, 1, 41, 41, 32, 1, None, "float32", {"window": (10, -1), "softcap": 1.5}),
    "negative_scale": (1, 2, 1, 21, 21, 32, 1, None, "float32", {"scale": -0.2}),
    # scales at the E4M3 range edges: saturation to +-448 (margin 0.5: the top half of every
    # tensor's values clip), tiny and huge values (scales 1e-6 and 1e3 per unit)
    "saturated_values": (1, 2, 1, 40, 40, 32, 0, None, "float32", {"margin": 0.5}),
    "tiny_values": (1, 2, 1, 40, 40, 32, 1, None, "float32", {"magnitude": 1e-4}),
    "huge_values": (1, 2, 1, 40, 40, 32, 0, None, "float32", {"magnitude": 3e4}),
}


def _run_case(B, H, Hkv, Sq, Sk, D, causal, bias_shape, out_dtype, extra):
    import torch

    from optfuse.kernels.registry import plugin_module

    T = plugin_module("flash_attention", "testing")
    L = plugin_module("flash_attention", "launch")
    gen = torch.Generator().manual_seed(0)
    q, k, v, bias = T.random_inputs(B, H, Hkv, Sq, Sk, D, "float32", bias_shape, generator=gen)
    if "keypad" in extra:
        bias = bias.to(torch.float16)
        T.key_padding(bias, extra["keypad"])
    if extra.get("spread"):  # growing key norms: the row max keeps rising, every block rescales
        k.mul_(torch.linspace(0.5, 8.0, Sk).reshape(1, 1, Sk, 1))
    mag = extra.get("magnitude", 1.0)
    q8, k8, vt8, scales = T.fp8_inputs(q * mag, k * mag, v * mag, margin=extra.get("margin", 1.0))
    attrs, _ = T.sparse_attrs(H, Hkv, D, causal, Sq, Sk, extra, extra.get("scale", D ** -0.5 / mag ** 2))
    attrs["output_dtype"] = out_dtype
    cfg = L.FAConfig(16, 16, 1, 1)
    src, params = T.case_sources(L.FP8, [q8.shape, k8.shape, vt8.shape, None if bias is None else bias.shape],
                                 attrs, config=cfg, bias_dtype=None if bias is None else str(bias.dtype))
    assert src.signature["V"] == "*fp8e4nv" and src.signature["Out"] == "*" + {"float32": "fp32", "float16": "fp16"}[out_dtype]
    out = torch.full(q8.shape, float("nan"), dtype=getattr(torch, out_dtype))
    ins = [q8, k8, vt8] + ([bias] if bias is not None else []) + scales
    T.run_triton(src, params, ins, [out], interpret=True)
    ref = T.fp8_reference_of(q8, k8, vt8, bias, scales, attrs)
    v_absmax = float(vt8[..., :Sk].float().abs().max() * scales[2])
    T.check_close_fp8(out, ref, v_absmax, Sk, out_dtype, src.name)
    if causal and Sk < Sq:
        assert (out[..., : Sq - Sk, :] == 0).all(), "rows that see no key must give 0"


@pytest.fixture(scope="module")
def results():
    return interpreter_results(__file__)


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_interpreter_matches_reference(results, case):
    assert results.get(case) == "ok", results.get(case, "not run")


if __name__ == "__main__":
    from optfuse.kernels.registry import plugin_module

    plugin_module("flash_attention", "testing").exact_fp8_rounding_in_interpreter()
    run_interpreter_cases(CASES, _run_case)
