"""launch.py of the GEMM plugin on the CPU: static shape facts, limits, configs, symbolic launch
parameters, prebuilt specializations."""

from __future__ import annotations

import pytest

from optfuse.kernels.registry import plugin_module
from optfuse.kernels.testing import SymDim, sym_cdiv
from optfuse.spec import get_spec
from optfuse.trt import glue

L = plugin_module("gemm", "launch")
T = plugin_module("gemm", "testing")


@pytest.mark.parametrize("bias,want", [(None, "none"), ([], "scalar"), ([1], "scalar"), ([3072], "vector"),
                                       ([1, 3072], "vector")])
def test_bias_mode(bias, want):
    assert L.static_shape("GemmEpilogue", [[-1, -1, 768], [3072, 768], bias, None])["bias_mode"] == want


@pytest.mark.parametrize("residual,want", [(None, "none"), ([], "scalar"), ([1, 1, 1], "scalar"),
                                           ([-1, -1, 3072], "full"), ([4, 7, 3072], "full")])
def test_residual_mode(residual, want):
    assert L.static_shape("GemmEpilogue", [[-1, -1, 768], [3072, 768], None, residual])["residual_mode"] == want


@pytest.mark.parametrize("bias,residual", [([768], None), ([2, 3072], None), (None, [-1, 1, 3072]),
                                           (None, [7, 3072]), (None, [3072])])
def test_unsupported_broadcasts_are_rejected(bias, residual):
    with pytest.raises(ValueError):
        L.static_shape("GemmEpilogue", [[-1, 7, 768], [3072, 768], bias, residual])


def test_gated_weights_must_match():
    assert L.static_shape("GatedGemm", [[-1, 768], [3072, 768], [3072, 768]]) == {"K": 768, "N": 3072}
    with pytest.raises(ValueError):
        L.static_shape("GatedGemm", [[-1, 768], [3072, 768], [3064, 768]])


def test_glue_uses_this_static_shape():
    spec = get_spec("GemmEpilogue")
    static = glue.static_shape(spec, [[-1, 768], [3072, 768], [3072], [-1, 3072]],
                               ["float16", "float16", "float32", "float16"])
    assert static == {"K": 768, "N": 3072, "bias_mode": "vector", "residual_mode": "full",
                      "bias_dtype": "float32", "residual_dtype": "float16"}
    src = L.kernel_config("GemmEpilogue", "float16", {}, static)
    assert src.signature == {"A": "*fp16", "W": "*fp16", "Bias": "*fp32", "Residual": "*fp16", "M": "i32",
                             "Y": "*fp16"}


@pytest.mark.parametrize("n,k", [(3072, 764), (3068, 768), (3072, 65544), (0, 768), (3072, -1)])
def test_limits(n, k):
    with pytest.raises(ValueError):
        L.kernel_config("GemmEpilogue", "float16", {}, {"N": n, "K": k})


def test_bad_attributes_and_dtypes():
    static = {"N": 64, "K": 64}
    for attrs in ({"activation": "gelu"}, {"residual_position": "middle"}):
        with pytest.raises(ValueError):
            L.kernel_config("GemmEpilogue", "float16", attrs, static)
    for act in ("relu", "relu2"):  # not gated choices
        with pytest.raises(ValueError):
            L.kernel_config("GatedGemm", "float16", {"activation": act}, static)
    with pytest.raises(ValueError):
        L.kernel_config("GemmEpilogue", "int32", {}, static)


def test_sm90_activation_codes_are_the_spec_order_and_the_headers():
    """The CUDA kernel's ACTIVATION code is the index in GemmEpilogue's choices: a new activation is
    appended (ids never move), and the list in sm90/epilogue.cuh names the same codes."""
    import re
    from pathlib import Path

    S = plugin_module("gemm", "launch_sm90")
    codes = tuple(S.ACTIVATION_CODES)
    assert codes == ("none", "relu", "gelu_erf", "gelu_tanh", "quick_gelu", "silu", "sigmoid", "tanh", "relu2")
    header = (Path(L.__file__).parent / "sm90" / "epilogue.cuh").read_text()
    listed = re.search(r"// ACTIVATION: (.*?)\(the order", header, re.S).group(1)
    named = dict((int(i), n) for i, n in re.findall(r"(\d+) (\w+)", listed.replace("//", "")))
    assert named == dict(enumerate(codes))
    for i in range(1, len(codes)):
        assert f"#elif ACTIVATION == {i}\n" in header
    src = L.kernel_config("GemmEpilogue", "float16", {"activation": "relu2"},
                          {"N": 3072, "K": 768, "bias_mode": "vector", "residual_mode": "none", "arch": 90})
    assert src.defines["ACTIVATION"] == "8" and "/relu2_bias-vector_res-none/" in src.name


def test_sm90_gelu_erf_form_within_its_stated_bound():
    """sm90/epilogue.cuh's GELU erf (x sigmoid of a fitted odd polynomial, x^2 clamped at 36), run
    here in fp32 with the header's own coefficients, against the float64 GELU: within the 2.6e-5 its
    comment states for every x, and exact in the limits (x for large x, 0 for large -x)."""
    import re
    from pathlib import Path

    import math

    import numpy as np

    header = (Path(L.__file__).parent / "sm90" / "epilogue.cuh").read_text()
    block = header[header.index("#elif ACTIVATION == 2\n"):header.index("#elif ACTIVATION == 3\n")]
    assert "|error| <=\n    // 2.6e-5" in block
    clamp = float(re.search(r"fminf\(x \* x, ([\d.]+)f\)", block).group(1))
    c2, c1, c0 = (np.float32(v) for v in re.search(
        r"fmaf\(fmaf\(([-\d.e]+)f, x2, ([-\d.e]+)f\), x2, ([-\d.e]+)f\)", block).groups())
    x = np.concatenate([np.linspace(-12, 12, 480001), [-1e4, -60.0, 60.0, 1e4]]).astype(np.float32)
    x2 = np.minimum(x * x, np.float32(clamp))
    with np.errstate(over="ignore"):
        y = x * (np.float32(1) / (np.float32(1) + np.exp2(x * ((c2 * x2 + c1) * x2 + c0))))
    xd = x.astype(np.float64)
    ref = 0.5 * xd * (1 + np.vectorize(math.erf)(xd / math.sqrt(2)))
    assert np.abs(y - ref).max() <= 2.6e-5
    assert y[-1] == x[-1] and y[-2] == x[-2] and y[-3] == 0 and y[-4] == 0


def _sm90_gelu_h2_emulation():
    """sm90/epilogue.cuh's header text and an emulation of its f16x2 GELU pieces with the header's own
    fp16 constants (each operation rounded to fp16, tanh correctly rounded: the emulation's assumption
    about tanh.approx.f16x2): ``(header, r, z_of, floor, half)``, r rounding to fp16, z_of(x, activation)
    gelu_z_h2, floor / half activate_h2's constants."""
    import re
    from pathlib import Path

    import numpy as np

    header = (Path(L.__file__).parent / "sm90" / "epilogue.cuh").read_text()
    body = header[header.index("u32 activate_h2(u32 x)"):header.index("u32 epilogue_h2(")]
    z_body = header[header.index("u32 gelu_z_h2(u32 x)"):header.index("u32 activate_h2(u32 x)")]

    def consts(text):
        return [np.array([int(b, 16)], np.uint16).view(np.float16).astype(np.float64)[0]
                for b in re.findall(r"H2\(0x([0-9A-F]{4})u\)", text)]

    def block(a):
        rest = z_body[z_body.index(f"ACTIVATION == {a}\n"):]
        return consts(rest[:rest.index("#e", 1)])

    def r(v):  # rounded to fp16 (past 65504: inf, as the hardware rounds)
        with np.errstate(over="ignore"):
            return np.asarray(v, np.float64).astype(np.float16).astype(np.float64)

    def z_of(x, a):
        if a == 2:
            clamp, z4, z2, z0 = block(2)
            x2 = np.minimum(r(x * x), clamp)
            return r(x * r(r(z4 * x2 + z2) * x2 + z0))
        k1, k0 = block(3)
        return r(x * r(k1 * r(x * x) + k0))

    assert "h2_max_nan(x, H2(0xFBFFu))" in body and "max.NaN.f16x2" in header  # a NaN stays NaN, as np.maximum keeps it
    floor, half = consts(body)
    return header, r, z_of, floor, half


def _gelu64(a):
    import math

    import numpy as np

    if a == 2:
        erf = np.vectorize(math.erf)
        return lambda x: 0.5 * x * (1 + erf(x / math.sqrt(2)))
    return lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def test_sm90_half2_gelu_within_its_stated_bound():
    """sm90/epilogue.cuh's fp16 GELUs (0.5 x (1 + tanh(z)) in f16x2, HALF2_EPILOGUE), emulated
    (_sm90_gelu_h2_emulation) against the float64 functions: within the ulps its comment states, the
    limits at +-65504 and -inf exact (0 below, x above), NaN kept."""
    import numpy as np

    header, r, z_of, floor, half = _sm90_gelu_h2_emulation()
    assert "at most 0.76 of fp16's ulp of max(|y|, 1); below x = -2" in " ".join(
        line.removeprefix("// ") for line in header.splitlines())

    def activate_h2(x, a):
        x = np.maximum(r(x), floor)
        hx = r(x * half)
        return r(hx * r(np.tanh(z_of(x, a))) + hx)

    x = r(np.linspace(-16, 16, 400001))
    limits = np.array([-65504.0, 65504.0, -np.inf])
    for a in (2, 3):
        with np.errstate(over="ignore"):
            ref = _gelu64(a)(x)
        ulp = np.spacing(r(np.maximum(np.abs(ref), 1)).astype(np.float16)).astype(np.float64)
        assert (np.abs(activate_h2(x, a) - ref) / ulp).max() <= 0.76, a
        assert activate_h2(limits, a).tolist() == [0.0, 65504.0, 0.0], a
        assert np.isnan(activate_h2(np.array([np.nan]), a)).all(), a


def test_sm90_bf16_gelu_gate_within_its_stated_bound():
    """The bf16 GELUs (GATE_F16X2_EPILOGUE: the gate 0.5 (1 + tanh(z)) on f16x2 pairs, y = x g in fp32),
    emulated: before y's rounding within the fraction of bf16's ulp of max(|y|, 1) the header states;
    past fp16's range x saturates for the gate (y = x above, 0 below), and a NaN stays NaN."""
    import re

    import numpy as np

    header, r, z_of, _, half = _sm90_gelu_h2_emulation()
    text = " ".join(line.removeprefix("// ") for line in header.splitlines())
    bound = float(re.search(r"at most ([\d.]+) of bf16's ulp of max\(\|y\|, 1\)", text).group(1))
    body = header[header.index("void activate_pair(float& v0"):]
    assert "cvt.rn.satfinite.f16x2.f32" in body and "h2_fma(H2(0x3800u), h2_tanh(gelu_z_h2(x)), H2(0x3800u))" in body

    def activate_pair(x, a):  # x: float32 values
        xs = r(np.clip(x, -65504, 65504))  # satfinite (a NaN stays NaN)
        g = r(half * r(np.tanh(z_of(xs, a))) + half)
        return (x * g).astype(np.float32).astype(np.float64)

    x = np.linspace(-16, 16, 800001).astype(np.float32).astype(np.float64)
    for a in (2, 3):
        ref = _gelu64(a)(x)
        ulp = 2.0 ** -7 * 2.0 ** np.floor(np.log2(np.maximum(np.abs(ref), 1)))  # bf16's spacing at max(|y|, 1)
        assert (np.abs(activate_pair(x, a) - ref) / ulp).max() <= bound, a
        big = activate_pair(np.array([-1e6, 1e6, 3e38]), a)
        assert big[0] == 0 and big[1] == 1e6 and big[2] == np.float32(3e38), a
        assert np.isnan(activate_pair(np.array([np.nan]), a)).all(), a


def test_argument_order_is_qdp():
    """Present inputs in spec order, M, y; absent ones are None constexprs."""
    cases = [
        (T.Case("GemmEpilogue", (5,), 64, 64, "float16", bias="vector", residual="full"), ["A", "W", "Bias", "Residual"]),
        (T.Case("GemmEpilogue", (5,), 64, 64, "float16", residual="full"), ["A", "W", "Residual"]),
        (T.Case("GemmEpilogue", (5,), 64, 64, "float16", bias="scalar"), ["A", "W", "Bias"]),
        (T.Case("GemmEpilogue", (5,), 64, 64, "float16"), ["A", "W"]),
        (T.Case("GatedGemm", (5,), 64, 64, "bfloat16", "silu"), ["A", "W", "W_up"]),
    ]
    for case, inputs in cases:
        src, params = T.case_sources(case)
        assert list(src.signature) == inputs + ["M", "Y"], case.id()
        assert (src.n_inputs, src.n_extra, src.n_outputs) == (len(inputs), 1, 1)
        absent = {"W_up", "Bias", "Residual"} - set(inputs)
        assert all(src.constexprs[p] is None for p in absent)
        assert params.extra_args == [5]


def test_residual_position_only_matters_with_a_residual():
    static = {"N": 64, "K": 64, "bias_mode": "vector", "residual_mode": "none"}
    a = L.kernel_config("GemmEpilogue", "float16", {"residual_position": "before_activation"}, static)
    b = L.kernel_config("GemmEpilogue", "float16", {}, static)
    assert a.name == b.name and a.constexprs == b.constexprs
    full = dict(static, residual_mode="full")
    a = L.kernel_config("GemmEpilogue", "float16", {"residual_position": "before_activation"}, full)
    b = L.kernel_config("GemmEpilogue", "float16", {}, full)
    assert a.constexprs["RESIDUAL_BEFORE"] and not b.constexprs["RESIDUAL_BEFORE"] and a.name != b.name


def test_launch_params_are_shape_expressions():
    """Only * and cdiv over the dynamic dims (QDP's symbolic shapes); N's tile count is a number."""
    b, s = SymDim("B"), SymDim("S")
    for arch in (89, 90):
        static = {"N": 3072, "K": 768, "bias_mode": "vector", "residual_mode": "full", "arch": arch}
        p = L.launch_params("GemmEpilogue", [[b, s, 768], [3072, 768], [3072], [b, s, 3072]], ["float16"] * 4, {},
                            cdiv=sym_cdiv, static_shape=static)
        cfg = L.choose_config("GemmEpilogue", "float16", 3072, 768, arch, static, "none")
        assert repr(p.extra_args[0]) == "(B*S)"
        assert p.block == (cfg.num_warps * 32, 1, 1)
        if cfg.impl == "cuda_sm90":  # persistent: one CTA per SM whatever M is
            assert arch == 90 and p.grid == (132, 1, 1)
        else:
            assert repr(p.grid[0]) == f"(cdiv((B*S),{cfg.block_m})*{3072 // cfg.block_n})"


@pytest.mark.parametrize("m", [1, 127, 128, 129, 4096])
def test_grid_covers_every_tile(m):
    cfg = L.GemmConfig(128, 256, 64, 8, 8, 3)
    p = L.launch_params("GemmEpilogue", [[m, 1000], [1000, 1000]], ["float16"] * 2, {}, config=cfg,
                        static_shape={"N": 1000, "K": 1000})
    assert p.grid[0] == -(-m // 128) * -(-1000 // 256)


@pytest.mark.parametrize("arch", [None, 80, 86, 89, 90])
@pytest.mark.parametrize("op,dtype", [("GemmEpilogue", "float16"), ("GemmEpilogue", "float32"),
                                      ("GatedGemm", "bfloat16"), ("GatedGemm", "float32")])
def test_configs_fit_the_arch(op, dtype, arch):
    for n, k in ((3072, 768), (24, 16), (11008, 4096)):
        cands = L.candidate_configs(op, dtype, n, k, arch)
        assert cands[0] == L.choose_config(op, dtype, n, k, arch)
        assert len(cands) == len(set(cands)) >= 2
        limit = L.SMEM_LIMIT.get(arch, L.PORTABLE_SMEM) if arch else L.PORTABLE_SMEM
        for c in cands:
            assert L.shared_mem_estimate(op, dtype, c) <= limit, (c, arch)
            assert c.block_n <= max(16, 1 << (n - 1).bit_length()) and c.block_k >= 16


def test_unknown_impl_is_rejected():
    cfg = L.GemmConfig(128, 128, 32, 8, 4, 3, impl="nonexistent")
    with pytest.raises(ValueError):
        L.kernel_config("GemmEpilogue", "float16", {}, {"N": 64, "K": 64}, config=cfg)


def test_prebuild_sources():
    srcs = L.prebuild_sources()
    n_acts = sum(len(acts) for *_, acts in L.PREBUILD_SHAPES)
    # one per dtype; FP8 once per y dtype of PREBUILD_FP8_OUTPUTS
    assert len(srcs) == n_acts * (len(L.DTYPES) - 1 + len(L.PREBUILD_FP8_OUTPUTS))
    fp8 = [s for s in srcs if s.meta["dtype"] == "float8e4m3fn"]
    assert {s.meta["out_dtype"] for s in fp8} == set(L.PREBUILD_FP8_OUTPUTS)
    assert all(s.signature["A"] == "*fp8e4nv" and "AScale" in s.signature for s in fp8)
    assert not any("float8" in s.name for s in L.prebuild_sources(arch=80))  # no FP8 tensor cores
    assert any("float8e4m3fn-to-bfloat16" in s.name for s in L.prebuild_sources(arch=89))
    assert len({s.name for s in srcs}) == len(srcs)
    assert {s.meta["op"] for s in srcs} == set(L.OPS)
    assert {s.meta["activation"] for s in srcs} >= {"none", "gelu_erf", "gelu_tanh", "silu"}
    names90 = {s.name for s in L.prebuild_sources(arch=90)}
    assert any("128x256x64" in n for n in names90)


# -- FP8 (spec v2) ----------------------------------------------------------------------------------
FP8 = "float8e4m3fn"


def _fp8_static(op="GemmEpilogue", w_scale=(3072,), arch=90):
    if op == "GemmEpilogue":
        shapes = [[-1, 768], [3072, 768], [3072], None, [], list(w_scale)]
        dtypes = [FP8, FP8, "bfloat16", None, "float32", "float32"]
    else:
        shapes = [[-1, 768], [3072, 768], [3072, 768], [1], list(w_scale), [3072]]
        dtypes = [FP8] * 3 + ["float32"] * 3
    return {**L.static_shape(op, shapes, dtypes), "arch": arch}


def test_fp8_static_shape_facts():
    assert _fp8_static()["w_scale_mode"] == "vector" and _fp8_static(w_scale=(1,))["w_scale_mode"] == "scalar"
    gated = _fp8_static("GatedGemm", w_scale=())
    assert (gated["w_scale_mode"], gated["w_up_scale_mode"]) == ("scalar", "vector")
    a, w = [-1, 768], [3072, 768]
    for shapes, dtypes, why in [
        ([a, w, None, None, [], None], [FP8, FP8, None, None, "float32", None], "w_scale must be present"),
        ([a, w, None, None, None, [3072]], [FP8, FP8, None, None, None, "float32"], "a_scale must be present"),
        ([a, w, None, None, [], [3072]], ["float16"] * 2 + [None, None, "float32", "float32"], "absent without FP8"),
        ([a, w, None, None, [], [3072]], [FP8, "float16", None, None, "float32", "float32"], "must all be FP8 or none"),
        ([a, w, None, None, [2], [3072]], [FP8, FP8, None, None, "float32", "float32"], "a_scale of shape"),
        ([a, w, None, None, [], [768]], [FP8, FP8, None, None, "float32", "float32"], "w_scale of shape"),
    ]:
        with pytest.raises(ValueError, match=why):
            L.static_shape("GemmEpilogue", shapes, dtypes)


def test_fp8_kernel_source():
    """FP8 runs the sm_90 CUDA kernel's cooperative schedule on sm_90 where it takes the instance
    (y fp16 / bf16), else the Triton kernel, with the scales after the other inputs (spec order) and
    y of output_dtype; refused below sm_89 and without an output_dtype."""
    attrs = {"activation": "gelu_erf", "output_dtype": "bfloat16"}
    cuda = L.kernel_config("GemmEpilogue", FP8, attrs, _fp8_static())
    assert cuda.lang == "cuda" and cuda.meta["kernel"] == "cuda_sm90" and cuda.n_inputs == 5  # A, W, bias, the scales
    assert cuda.defines["IN_FP8"] == "1" and cuda.defines["W_SCALE_MODE"] == "2" and cuda.defines["OPTFUSE_DTYPE"] == "2"
    assert L.kernel_config("GemmEpilogue", FP8, {**attrs, "output_dtype": "float32"}, _fp8_static()).lang == "triton"
    src = L.kernel_config("GemmEpilogue", FP8, attrs, _fp8_static(arch=89))
    assert src.lang == "triton" and list(src.signature) == ["A", "W", "Bias", "AScale", "WScale", "M", "Y"]
    assert src.signature["A"] == "*fp8e4nv" and src.signature["Y"] == "*bf16" and src.signature["AScale"] == "*fp32"
    assert src.constexprs["W_SCALE"] == 2 and src.constexprs["Residual"] is None and src.n_inputs == 5
    # the partial sums go into the FP32 accumulator every K block (sm_90's FP8 wgmma keeps fewer bits)
    assert src.constexprs["FP8_ACC"] == min(L.FP8_IMPRECISE_ACC, src.constexprs["BLOCK_K"]) == 128
    assert L.kernel_config("GemmEpilogue", "float16", {}, {"N": 64, "K": 64}).constexprs["FP8_ACC"] is None
    assert "/float8e4m3fn-to-bfloat16/" in src.name and "_wscale-vector/" in src.name
    with pytest.raises(ValueError, match=r"sm_89 or later \(target sm_86\)"):
        L.kernel_config("GemmEpilogue", FP8, attrs, _fp8_static(arch=86))
    with pytest.raises(ValueError, match="would be float8e4m3fn"):
        L.kernel_config("GemmEpilogue", FP8, {"activation": "none"}, _fp8_static())
    with pytest.raises(ValueError, match="scales come exactly with FP8"):
        L.kernel_config("GemmEpilogue", "float16", attrs, _fp8_static())
    gated = L.kernel_config("GatedGemm", FP8, {"output_dtype": "float16"}, _fp8_static("GatedGemm", arch=89))
    assert list(gated.signature) == ["A", "W", "W_up", "AScale", "WScale", "WUpScale", "M", "Y"]
    assert (gated.constexprs["W_SCALE"], gated.constexprs["W_UP_SCALE"]) == (2, 2) and gated.signature["Y"] == "*fp16"
    p = L.launch_params("GemmEpilogue", [[SymDim("M"), 768], [3072, 768], [3072], None, [], [3072]],
                        [FP8, FP8, "bfloat16", None, "float32", "float32"], attrs, cdiv=sym_cdiv,
                        static_shape=_fp8_static(arch=89))
    cfg = L.choose_config("GemmEpilogue", FP8, 3072, 768, 89, _fp8_static(arch=89), "gelu_erf", "bfloat16")
    assert repr(p.grid[0]) == f"(cdiv(M,{cfg.block_m})*{3072 // cfg.block_n})" and p.block[0] == cfg.num_warps * 32


def test_fp8_configs_fit_the_arch():
    for arch in (89, 90, None):
        for op in L.OPS:
            cands = L.candidate_configs(op, FP8, 4096, 4096, arch)
            assert cands[0].impl == "triton" and cands[0].block_k == 128
            limit = L.SMEM_LIMIT.get(arch, L.PORTABLE_SMEM) if arch else L.PORTABLE_SMEM
            assert all(L.shared_mem_estimate(op, FP8, c) <= limit and c.block_k >= 32 for c in cands)
    assert L.candidate_configs("GemmEpilogue", FP8, 24, 16)[0].block_k == 32  # the FP8 MMA's K at least


def test_other_output_dtype_runs_the_triton_kernel_on_sm90():
    """The CUDA sm_90 kernel writes y in A's dtype: an fp16 GEMM with output_dtype float32 runs the Triton kernel."""
    case = T.Case("GemmEpilogue", (-1,), 3072, 768, "float16", "gelu_erf", "vector", "none")
    assert L.kernel_config(case.op, "float16", case.attrs, T.case_static(case, 90)).lang == "cuda"
    case32 = T.Case("GemmEpilogue", (-1,), 3072, 768, "float16", "gelu_erf", "vector", "none", output_dtype="float32")
    src = L.kernel_config(case32.op, "float16", case32.attrs, T.case_static(case32, 90))
    assert src.lang == "triton" and src.signature["Y"] == "*fp32" and src.signature["Bias"] == "*fp32"


# -- the classic plugin at run time: the small-M plans through enqueue (plugins/conftest.py stubs) --
def test_classic_plugin_runs_split_k_at_small_m(stub_cuda, classic_plugin):
    """BERT-base FFN down + residual: the workspace of the profile is the split-K bound; at M = 512
    enqueue launches the split-K GEMM into the workspace, then the reduce into y; at M = 32768 the
    one kernel, no workspace."""
    import types

    plugin = classic_plugin("GemmEpilogue", {"activation": "none", "residual_position": "after_activation"})
    f16 = types.SimpleNamespace(name="HALF")

    def dyn(lo, hi):
        return types.SimpleNamespace(min=lo, max=hi, desc=types.SimpleNamespace(type=f16))

    profile = [dyn([1, 3072], [32768, 3072]), dyn([768, 3072], [768, 3072]), dyn([768], [768]),
               dyn([1, 768], [32768, 768])]
    assert plugin.get_workspace_size(profile, []) == L.launch_sm90.split_k_workspace({}) == 132 * 65536

    def descs(m):
        return [types.SimpleNamespace(dims=d, type=f16) for d in ([m, 3072], [768, 3072], [768], [m, 768])]

    ptrs = [0x1000, 0x2000, 0x3000, 0x4000]
    plugin.enqueue(descs(512), [], ptrs, [0x9000], 0x200000, 5)
    assert [c[0] for c in stub_cuda] == ["gemm_sm90", "gemm_sm90_splitk_reduce"]
    (_, gemm_params, gemm_in, gemm_out), (_, red_params, red_in, red_out) = stub_cuda
    assert gemm_in == ptrs and gemm_out == [0x200000] and gemm_params.extra_args == [512]
    assert red_in == [0x200000, 0x3000, 0x4000] and red_out == [0x9000]
    stub_cuda.clear()
    plugin.enqueue(descs(32768), [], ptrs, [0x9000], 0, 5)
    assert [c[0] for c in stub_cuda] == ["gemm_sm90"] and stub_cuda[0][2:] == (ptrs, [0x9000])


def test_runtime_plan_kernels_are_prebuilt():
    """Every kernel a run-time plan of a PREBUILD_SHAPES instance launches (sm_90, 16-bit; M from one
    row to 32k) is in prebuild_sources(90), by name and by specialization: `optfuse kernels build`
    leaves nothing for the classic plugin to compile at its first enqueue. The M values reach
    every plan kind."""
    pre = {s.name: s for s in L.prebuild_sources(arch=90)}
    assert len(pre) == len(L.prebuild_sources(arch=90))  # no name twice
    kinds = set()
    for op, n, k, bias, residual, acts in L.PREBUILD_SHAPES:
        if op != "GemmEpilogue":
            continue
        for dtype in ("float16", "bfloat16"):
            for act in acts:
                for m in (1, 77, 300, 512, 1000, 1024, 2048, 4000, 4096, 8192, 32768):
                    case = T.Case(op, (m,), n, k, dtype, act, bias, residual)
                    plan = T.case_plan(case, 90)
                    kinds.add(T.plan_kind(plan))
                    for step in plan.steps if plan is not None else ():
                        assert step.source.name in pre, (case.id(), step.source.name)
                        assert pre[step.source.name].spec_dict() == step.source.spec_dict(), step.source.name
    assert {"narrow", "pingpong", "n192", "cooperative", "epilogue_wg"} <= kinds and any(k and "split-K" in k for k in kinds)
    # other targets have no plans
    assert not any(s.meta.get("kernel") == "splitk_reduce" for s in L.prebuild_sources(arch=89))
