"""The Triton GEMM kernel under the Triton interpreter (CPU), against the float64 reference.

TRITON_INTERPRET must be set before triton is imported, so the cases run in one child process
started with it; each test checks its case's result. Small tiles (16 x 16 x 16, GROUP_M 2) make
small problems cover several row groups, a partial last group, and M / N / K tails (M = 37 or 70,
N = 40, K = 56: none a multiple of 16); a few cases run the epilogue in column halves (32-wide tiles). bf16 is left to the GPU tests: the interpreter's tl.dot on
bf16 operands is wrong (Triton 3.9). FP8 (float8e4m3fn, ``tl.float8e4nv``) runs in the interpreter on
CPU tensors (Triton 3.9): both ops, per-channel and single weight scales, y in fp32 / fp16, values
saturated at +-448 (headroom 0.5), with a K tile of 32 (the FP8 MMA's K).
"""

from __future__ import annotations

import pytest

from optfuse.kernels.testing import interpreter_results, run_interpreter_cases

# id -> (op, A's leading dims, N, K, dtype, activation, bias, residual, residual_position, alpha, config)
_TAIL = ((37,), 40, 56)  # M, N, K: none a multiple of the 16-wide tiles
_ACTS = ("none", "relu", "gelu_erf", "gelu_tanh", "quick_gelu", "silu", "sigmoid", "tanh", "relu2")
CASES: dict[str, tuple] = {}
for _act in _ACTS:  # every activation, with a bias and a full residual after it; fp32 tells gelu_erf
    for _dt in ("float16", "float32"):  # from gelu_tanh (they differ by < 1e-3, within fp16's bound)
        CASES[f"act_{_act}_{_dt}"] = ("GemmEpilogue", *_TAIL, _dt, _act, "vector", "full", "after_activation", 1.0, None)
CASES.update({
    "fp32_ieee_tanh_res_before": ("GemmEpilogue", (2, 19), 24, 48, "float32", "tanh", "vector", "full",
                                  "before_activation", 1.0, None),
    "res_before_gelu": ("GemmEpilogue", *_TAIL, "float16", "gelu_erf", "vector", "full", "before_activation", 1.0, None),
    "no_bias_no_residual": ("GemmEpilogue", *_TAIL, "float16", "relu", "none", "none", "after_activation", 1.0, None),
    # relu2 as Nemotron's FFN up (no bias, no residual), before a residual, and with alpha in column halves
    "relu2_no_bias_no_residual": ("GemmEpilogue", (3, 13), 40, 56, "float16", "relu2", "none", "none",
                                  "after_activation", 1.0, None),
    "relu2_res_before_fp32": ("GemmEpilogue", *_TAIL, "float32", "relu2", "vector", "full", "before_activation",
                              1.0, None),
    "relu2_alpha_split": ("GemmEpilogue", *_TAIL, "float16", "relu2", "scalar", "none", "after_activation", 0.5,
                          (16, 32, 16, 2, 1, 1, "triton", True)),
    "scalar_bias_scalar_residual": ("GemmEpilogue", *_TAIL, "float32", "silu", "scalar", "scalar",
                                    "after_activation", 1.0, None),
    "scalar_residual_before": ("GemmEpilogue", *_TAIL, "float16", "sigmoid", "none", "scalar",
                               "before_activation", 1.0, None),
    "residual_no_bias": ("GemmEpilogue", (2, 35), 40, 56, "float16", "none", "none", "full", "after_activation", 1.0, None),
    "alpha": ("GemmEpilogue", *_TAIL, "float32", "quick_gelu", "vector", "none", "after_activation", 0.125, None),
    "even_k_groups": ("GemmEpilogue", (70,), 48, 48, "float16", "gelu_tanh", "vector", "full", "after_activation",
                      1.0, None),
    "k_below_block_k": ("GemmEpilogue", (21,), 24, 24, "float16", "gelu_erf", "vector", "none", "after_activation",
                        1.0, (16, 32, 32, 2, 1, 1)),
    # the epilogue in two column halves (tiles of 32 columns: N = 40 ends inside the second half)
    "split_epilogue": ("GemmEpilogue", *_TAIL, "float16", "gelu_erf", "vector", "full", "after_activation", 1.0,
                       (16, 32, 16, 2, 1, 1, "triton", True)),
    "split_epilogue_fp32_before": ("GemmEpilogue", (45,), 72, 24, "float32", "silu", "scalar", "full",
                                   "before_activation", 2.0, (32, 64, 16, 2, 1, 1, "triton", True)),
    "split_epilogue_gated": ("GatedGemm", *_TAIL, "float16", "silu", "none", "none", "after_activation", 1.0,
                             (16, 32, 16, 2, 1, 1, "triton", True)),
    "gated_silu": ("GatedGemm", (3, 13), 40, 56, "float16", "silu", "none", "none", "after_activation", 1.0, None),
    "gated_gelu_erf": ("GatedGemm", (70,), 24, 48, "float32", "gelu_erf", "none", "none", "after_activation", 1.0, None),
    "gated_gelu_tanh": ("GatedGemm", *_TAIL, "float16", "gelu_tanh", "none", "none", "after_activation", 1.0, None),
})
SMALL = (16, 16, 16, 2, 1, 1)  # block_m, block_n, block_k, group_m, num_warps, num_stages
SMALL_FP8 = (16, 16, 32, 2, 1, 1)
_FP8 = "float8e4m3fn"
# FP8 cases: (..., config, output_dtype, w_scale, headroom)
CASES.update({
    "fp8_gelu_bias_residual_f32": ("GemmEpilogue", *_TAIL, _FP8, "gelu_erf", "vector", "full", "after_activation", 1.0,
                                   SMALL_FP8, "float32", "vector", 1.0),
    "fp8_saturated_f16": ("GemmEpilogue", (45,), 40, 64, _FP8, "silu", "scalar", "full", "before_activation", 0.5,
                          SMALL_FP8, "float16", "vector", 0.5),
    "fp8_one_weight_scale": ("GemmEpilogue", *_TAIL, _FP8, "none", "none", "none", "after_activation", 1.0,
                             SMALL_FP8, "float32", "scalar", 1.0),
    "fp8_relu2_f16": ("GemmEpilogue", *_TAIL, _FP8, "relu2", "vector", "full", "after_activation", 1.0,
                      SMALL_FP8, "float16", "vector", 1.0),
    "fp8_k_tail_split": ("GemmEpilogue", (37,), 40, 40, _FP8, "tanh", "vector", "none", "after_activation", 1.0,
                         (16, 32, 32, 2, 1, 1, "triton", True), "float32", "vector", 1.0),
    "fp8_gated_silu": ("GatedGemm", *_TAIL, _FP8, "silu", "none", "none", "after_activation", 1.0,
                       SMALL_FP8, "float32", "vector", 0.5),
    "fp8_gated_split_f16": ("GatedGemm", (3, 13), 40, 64, _FP8, "gelu_tanh", "none", "none", "after_activation", 1.0,
                            (16, 32, 32, 2, 1, 1, "triton", True), "float16", "scalar", 1.0),
    # a non-FP8 y of another dtype than A's (fp16 in, fp32 out)
    "f16_to_f32": ("GemmEpilogue", *_TAIL, "float16", "gelu_erf", "vector", "full", "after_activation", 1.0, None,
                   "float32", "vector", 1.0),
})


def _run_case(op, lead, n, k, dtype, act, bias, residual, position, alpha, config, output_dtype="like_input",
              w_scale="vector", headroom=1.0):
    import torch

    from optfuse.kernels.registry import plugin_module

    T = plugin_module("gemm", "testing")
    L = plugin_module("gemm", "launch")
    case = T.Case(op, lead, n, k, dtype, act, bias, residual, position, alpha, output_dtype, w_scale)
    ins = T.case_inputs(case, generator=torch.Generator().manual_seed(0), headroom=headroom)
    if headroom < 1:  # the case reaches the E4M3 range edge: some values saturated to +-448
        assert (ins[0].float().abs() == T.FP8_MAX).any()
    src, params = T.case_sources(case, config=L.GemmConfig(*(config or SMALL)))
    out = torch.full((*lead, n), float("nan"), dtype=getattr(torch, case.y_dtype))
    T.run_triton(src, params, ins, [out], interpret=True)
    T.check_close(out, T.reference_of(case, ins), T.tolerance_key(case), src.name)


@pytest.fixture(scope="module")
def results():
    return interpreter_results(__file__)


@pytest.mark.parametrize("case", list(CASES))
def test_interpreter_matches_reference(results, case):
    assert results.get(case) == "ok", results.get(case, "not run")


def test_the_check_catches_a_wrong_activation():
    """The comparison these cases rely on tells the activations apart on the inputs they use (in
    fp32: at fp16 gelu_erf and gelu_tanh agree within the bound), relu2 from relu too."""
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    from optfuse.kernels.registry import plugin_module

    T = plugin_module("gemm", "testing")
    R = plugin_module("gemm", "reference")
    for act, other in [*zip(_ACTS, _ACTS[1:] + _ACTS[:1]), ("relu2", "relu")]:
        case = T.Case("GemmEpilogue", *_TAIL, "float32", act, "vector", "full")
        ins = T.case_inputs(case, generator=torch.Generator().manual_seed(0))
        x = [T.to_numpy64(t) for t in ins]
        wrong = R.gemm_epilogue64(x[0], x[1], x[2], x[3], other)
        with pytest.raises(AssertionError):
            T.check_close(np.asarray(wrong, np.float32), T.reference_of(case, ins), "float32", f"{act} as {other}")


def test_the_check_catches_a_wrong_fp8_scale():
    """On the FP8 cases' inputs the comparison tells a missing or per-tensor-only weight scale from
    the per-channel one, and a missing A scale."""
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    from optfuse.kernels.registry import plugin_module

    T = plugin_module("gemm", "testing")
    R = plugin_module("gemm", "reference")
    case = T.Case("GemmEpilogue", *_TAIL, "float8e4m3fn", "gelu_erf", "vector", "full", output_dtype="float32")
    ins = T.case_inputs(case, generator=torch.Generator().manual_seed(0))
    x = [T.to_numpy64(t) for t in ins]
    ref = T.reference_of(case, ins)
    for a_scale, w_scale in ((x[4], None), (None, x[5]), (x[4], x[5].mean())):
        wrong = R.gemm_epilogue64(x[0], x[1], x[2], x[3], "gelu_erf", a_scale=a_scale, w_scale=w_scale)
        with pytest.raises(AssertionError):
            T.check_close(np.asarray(wrong, np.float32), ref, T.tolerance_key(case), "wrong scale")


if __name__ == "__main__":
    run_interpreter_cases(CASES, _run_case)
