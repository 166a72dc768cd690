"""AOT compiles of the GEMM kernels through optfuse.kernels (CPU only, no GPU needed): the Triton
kernel for sm_80, sm_89 and sm_90 with its default configs (FP8 for sm_89 and sm_90: FP8 tensor-core
MMAs in the PTX), the CUDA sm_90 kernel (NVRTC) with each of its variants, parameters in QDP order, the FP8 form on
E4M3 wgmma with no spills (cuobjdump)."""

import re

import pytest

pytest.importorskip("triton")

from optfuse.kernels import KernelCache  # noqa: E402
from optfuse.kernels.registry import plugin_module  # noqa: E402
from optfuse.kernels.testing import cubin_usage, cuobjdump  # noqa: E402

L = plugin_module("gemm", "launch")
T = plugin_module("gemm", "testing")
L9 = plugin_module("gemm", "launch_sm90")


@pytest.mark.parametrize("arch,case", [
    (90, T.Case("GemmEpilogue", (-1,), 3072, 768, "float16", "gelu_erf", "vector", "none")),
    (90, T.Case("GatedGemm", (-1,), 11008, 4096, "bfloat16", "silu")),
    (90, T.Case("GemmEpilogue", (-1,), 768, 3072, "float32", "none", "vector", "full")),
    (89, T.Case("GemmEpilogue", (-1,), 1000, 1000, "bfloat16", "gelu_tanh", "scalar", "full", "before_activation")),
    (89, T.Case("GatedGemm", (-1,), 2048, 1024, "float16", "gelu_tanh")),
    (80, T.Case("GemmEpilogue", (-1,), 4096, 4096, "float16", "silu", "none", "scalar")),
    (80, T.Case("GemmEpilogue", (-1,), 24, 40, "float32", "tanh", "none", "none", alpha=0.5)),
    (90, T.Case("GemmEpilogue", (-1,), 3072, 768, "float8e4m3fn", "gelu_erf", "vector", "full", output_dtype="bfloat16")),
    (90, T.Case("GatedGemm", (-1,), 11008, 4096, "float8e4m3fn", "silu", output_dtype="float16")),
    (89, T.Case("GemmEpilogue", (-1,), 1000, 1000, "float8e4m3fn", "gelu_tanh", "scalar", "full", "before_activation",
                output_dtype="float16", w_scale="scalar")),
    (89, T.Case("GatedGemm", (-1,), 2048, 1024, "float8e4m3fn", "gelu_erf", output_dtype="float32")),
], ids=lambda x: x.id() if hasattr(x, "id") else f"sm{x}")
def test_aot_compile(tmp_path, arch, case):
    static = T.case_static(case, arch)
    triton_cfg = next(c for c in L.candidate_configs(case.op, case.dtype, case.n, case.k, arch, static) if c.impl == "triton")
    src = L.kernel_config(case.op, case.dtype, case.attrs, static, config=triton_cfg)
    art = KernelCache(tmp_path).build(src, arch)
    n_in = src.n_inputs
    assert (art.n_inputs, art.n_extra, art.n_outputs) == (n_in, 1, 1)
    assert art.cubin and art.arch == arch
    assert art.threads == src.num_warps * 32
    assert 0 < art.shared_mem <= L.SMEM_LIMIT[arch]
    # QDP order: the present inputs, M, y, then Triton's scratch pointers
    entry = re.search(r"\.entry\s+" + re.escape(art.name) + r"\s*\((.*?)\)", art.ptx, re.S).group(1)
    params = re.findall(r"\.param\s+\.(\w+)", entry)
    assert params[:n_in] == ["u64"] * n_in
    assert params[n_in] == "u32"
    assert params[n_in + 1] == "u64"
    assert len(params) == n_in + 1 + 1 + art.n_scratch
    if case.dtype != "float32":
        assert ("wgmma" in art.ptx) == (arch == 90)  # Hopper: warpgroup MMA; sm_80 / sm_89: mma.sync
        assert arch == 90 or "mma.sync" in art.ptx
    if case.fp8:  # the FP8 tensor cores: E4M3 operands in the MMA itself
        mma = r"wgmma\.mma_async\S*\.e4m3\.e4m3" if arch == 90 else r"mma\.sync\S*\.e4m3\.e4m3"
        assert re.search(mma, art.ptx), src.name
    assert KernelCache(tmp_path).build(src, arch).key == art.key  # a second build is a cache hit


@pytest.mark.parametrize("op,inputs,attrs", [
    ("GemmEpilogue", [(3072,), ("B", "S", 3072)], {"activation": "none", "residual_position": "after_activation"}),
    ("GatedGemm", [(3072, 768)], {"activation": "silu"}),
])
def test_qdp_aot_kernel_with_symbolic_shapes(tmp_path, monkeypatch, op, inputs, attrs):
    """The body of the generated aot_impl: symbolic leading dims, N and K static, the QDP PTX."""
    from optfuse.kernels.testing import SymDim, sym_cdiv
    from optfuse.trt.qdp import TensorInfo, aot_kernel

    monkeypatch.setenv("OPTFUSE_CACHE", str(tmp_path))
    B, S = SymDim("B"), SymDim("S")

    def info(shape):
        dims = [{"B": B, "S": S}.get(d, d) for d in shape]
        return TensorInfo("float16", dims, [d if isinstance(d, int) else -1 for d in dims])

    a, w = info(("B", "S", 768)), info((3072, 768))
    for arch in (89, 90):
        ak = aot_kernel(op, [a, w, *map(info, inputs)], attrs, 0, arch=arch, cdiv=sym_cdiv)
        if arch == 90:  # the CUDA kernel: a persistent grid, one CTA per SM
            assert "cuda_sm90" in ak.artifact.metadata["source"] and ak.launch.grid[0] == 132
            continue
        cfg = L.choose_config(op, "float16", 3072, 768, arch)
        assert repr(ak.launch.grid[0]) == f"(cdiv((B*S),{cfg.block_m})*{3072 // cfg.block_n})"
    assert repr(ak.extra_args[0]) == "(B*S)"
    assert ak.artifact.n_inputs == 2 + len(inputs) and ak.artifact.n_scratch == 0
    assert ak.launch.block[0] == ak.artifact.threads


@pytest.mark.parametrize("arch", [80, 89, 90])
@pytest.mark.parametrize("op,dtype", [("GemmEpilogue", "float16"), ("GatedGemm", "bfloat16"),
                                      ("GemmEpilogue", "float32"), ("GatedGemm", "float32"),
                                      ("GemmEpilogue", "float8e4m3fn"), ("GatedGemm", "float8e4m3fn")])
def test_default_configs_spill_no_register(tmp_path, op, dtype, arch):
    """The Triton kernel's default config on each arch with the largest epilogue (GELU erf, a bias
    vector and a full residual for GemmEpilogue; FP8: per-channel scales, y bf16) keeps everything in
    registers (ptxas -v: no spill; the sm_90 CUDA kernel's NVRTC PTX is newer than Triton's ptxas reads)."""
    if dtype == "float32" and arch != 90:
        pytest.skip("the fp32 configs do not depend on the arch")
    if dtype == "float8e4m3fn" and arch < L.FP8_MIN_ARCH:
        pytest.skip("no FP8 tensor cores below sm_89")
    out = {"output_dtype": "bfloat16"} if dtype == "float8e4m3fn" else {}
    case = T.Case(op, (-1,), 4096, 4096, dtype, "gelu_erf", *(("vector", "full") if op == "GemmEpilogue" else ()), **out)
    static = T.case_static(case, arch)
    triton_cfg = next(c for c in L.candidate_configs(op, dtype, 4096, 4096, arch, static, "gelu_erf") if c.impl == "triton")
    chosen = L.choose_config(op, dtype, 4096, 4096, arch, static, "gelu_erf", case.y_dtype)
    if dtype == "float8e4m3fn":  # FP8 runs this config on sm_89, the CUDA kernel on sm_90
        assert chosen.impl == "cuda_sm90" if arch == 90 else chosen == triton_cfg
    src = L.kernel_config(op, dtype, case.attrs, static, config=triton_cfg)
    usage = T.ptxas_usage(KernelCache(tmp_path).build(src, arch))
    assert usage["spill_stores"] == usage["spill_loads"] == 0, (src.name, usage)


SM90_CASES = [
    T.Case("GemmEpilogue", (-1,), 3072, 768, "float16", "gelu_erf", "vector", "none"),
    T.Case("GemmEpilogue", (-1,), 1024, 4096, "bfloat16", "none", "vector", "full"),
    T.Case("GemmEpilogue", (-1,), 896, 1000, "float16", "silu", "scalar", "scalar", "before_activation", 0.5),
    T.Case("GatedGemm", (-1,), 11008, 4096, "bfloat16", "silu"),
    T.Case("GemmEpilogue", (-1,), 1024, 768, "bfloat16", "relu2", "none", "none"),  # ACTIVATION 8, every schedule
]


#: The FP8 form (IN_FP8, cooperative schedule): bias + GELU with a TMA residual, one-value weight
#: scales with an fp16 y, GatedGemm.
SM90_FP8_CASES = [
    T.Case("GemmEpilogue", (-1,), 3072, 768, "float8e4m3fn", "gelu_erf", "vector", "full", output_dtype="bfloat16"),
    T.Case("GemmEpilogue", (-1,), 4096, 4096, "float8e4m3fn", "silu", "scalar", "none", output_dtype="float16",
           w_scale="scalar"),
    T.Case("GatedGemm", (-1,), 11008, 4096, "float8e4m3fn", "silu", output_dtype="bfloat16"),
    T.Case("GemmEpilogue", (-1,), 3072, 768, "float8e4m3fn", "relu2", "vector", "none", output_dtype="float16"),
]


@pytest.mark.parametrize("case", SM90_CASES + SM90_FP8_CASES, ids=lambda c: c.id())
def test_sm90_cuda_compiles_every_variant(tmp_path, case):
    """Each config of the CUDA sm_90 kernel (every schedule that takes the instance) builds for sm_90a
    (NVRTC) with wgmma and setmaxnreg, inputs in QDP order, and fits the shared memory it asks for.
    FP8: only m64n128k32 E4M3 wgmma (QGMMA in SASS, no 16-bit HGMMA), and the accumulator, the 64 x
    128 partial and the rest fit the consumers' registers (no stack, no local memory)."""
    fp8 = case.dtype == "float8e4m3fn"
    static = T.case_static(case, 90)
    cfgs = [c for c in L.candidate_configs(case.op, case.dtype, case.n, case.k, 90, static, case.activation,
                                           case.y_dtype) if c.impl in L.SM90_SCHEDULES]
    assert cfgs and L.choose_config(case.op, case.dtype, case.n, case.k, 90, static, case.activation,
                                    case.y_dtype) == cfgs[0]
    assert not fp8 or {c.impl for c in cfgs} == {"cuda_sm90"}
    for cfg in cfgs:
        src = L.kernel_config(case.op, case.dtype, case.attrs, static, config=cfg)
        art = KernelCache(tmp_path).build(src, 90)
        assert art.arch_suffix == "a" and art.threads == 384 and art.cubin
        assert "wgmma.mma_async" in art.ptx and "setmaxnreg" in art.ptx
        entry = re.search(r"\.entry\s+" + re.escape(art.name) + r"\s*\((.*?)\)", art.ptx, re.S).group(1)
        assert re.findall(r"\.param\s+\.(\w+)", entry) == ["u64"] * src.n_inputs + ["u32", "u64"]
        dtypes = case.dtypes() if fp8 else [case.dtype] * len(case.shapes())
        params = L.launch_params(case.op, case.shapes(), dtypes, case.attrs, static_shape=static, config=cfg)
        assert params.block == (384, 1, 1) and params.shared_mem <= 227 * 1024
        if fp8:
            assert set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.[\w.]+", art.ptx)) == {
                "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"}
            tool = cuobjdump()
            if tool:
                res, sass = cubin_usage(tool, art, tmp_path)
                assert "STACK:0" in res and "LOCAL:0" in res, (src.name, res)
                assert "QGMMA.64x128x32.F32.E4M3.E4M3" in sass and "HGMMA" not in sass


def test_sm90_cuda_declines_what_it_cannot_run():
    """Other archs, fp32, N with no room for the tensor maps: the Triton kernel."""
    for case, arch in [(SM90_CASES[0], 89), (T.Case("GemmEpilogue", (-1,), 3072, 768, "float32", "none", "vector", "none"), 90),
                       (T.Case("GemmEpilogue", (-1,), 1088, 768, "float16", "none", "vector", "full"), 90),
                       (T.Case("GemmEpilogue", (-1,), 776, 768, "float16", "none", "vector", "none"), 90)]:
        assert L.choose_config(case.op, case.dtype, case.n, case.k, arch, T.case_static(case, arch), case.activation).impl == "triton"


def test_sm90_schedule_choice():
    """Ping-pong for plain short-K projections (BERT's QKV); the epilogue warps where the epilogue
    has an activation and no full residual; cooperative for a full residual (by TMA), GatedGemm and
    long-K plain projections (the H200 table)."""
    def impl(case):
        return L.choose_config(case.op, case.dtype, case.n, case.k, 90, T.case_static(case, 90), case.activation).impl
    assert impl(T.Case("GemmEpilogue", (-1,), 2304, 768, "float16", "none", "vector", "none")) == "cuda_sm90_pingpong"
    assert impl(T.Case("GemmEpilogue", (-1,), 3072, 768, "float16", "gelu_erf", "vector", "none")) == "cuda_sm90_epilogue_wg"
    assert impl(T.Case("GemmEpilogue", (-1,), 4096, 1024, "bfloat16", "silu", "scalar", "scalar")) == "cuda_sm90_epilogue_wg"
    assert impl(T.Case("GemmEpilogue", (-1,), 4096, 1024, "float16", "gelu_erf", "vector", "full")) == "cuda_sm90"
    assert impl(T.Case("GemmEpilogue", (-1,), 768, 3072, "float16", "none", "vector", "full")) == "cuda_sm90"
    assert impl(T.Case("GemmEpilogue", (-1,), 12288, 4096, "bfloat16", "none", "none", "none")) == "cuda_sm90"
    assert impl(T.Case("GatedGemm", (-1,), 11008, 4096, "float16", "silu")) == "cuda_sm90"


@pytest.mark.parametrize("op", ["GemmEpilogue", "GatedGemm"])
def test_qdp_aot_kernel_fp8(tmp_path, monkeypatch, op):
    """The aot_impl body for FP8: symbolic leading dims, the scales among the inputs in spec order
    (QDP), the Triton kernel on sm_89, the CUDA one on sm_90 (N = 3072: it takes the instance),
    refused on sm_80."""
    from optfuse.kernels.testing import SymDim, sym_cdiv
    from optfuse.trt.qdp import TensorInfo, aot_kernel

    monkeypatch.setenv("OPTFUSE_CACHE", str(tmp_path))
    B, S = SymDim("B"), SymDim("S")
    a = TensorInfo("float8e4m3fn", [B, S, 768], [-1, -1, 768])
    w = TensorInfo("float8e4m3fn", [3072, 768])
    sa, sw = TensorInfo("float32", []), TensorInfo("float32", [3072])
    if op == "GemmEpilogue":
        infos = [a, w, TensorInfo("bfloat16", [3072]), TensorInfo("bfloat16", [B, S, 3072]), sa, sw]
    else:
        infos = [a, w, w, sa, sw, sw]
    attrs = {"activation": "silu", "output_dtype": "bfloat16"}
    for arch in (89, 90):
        ak = aot_kernel(op, infos, attrs, 0, arch=arch, cdiv=sym_cdiv)
        name = ak.artifact.metadata["source_name"]
        assert ("/cuda_sm90_" if arch == 90 else "/triton_") in name and "float8e4m3fn-to-bfloat16" in name
        assert ak.artifact.n_inputs == 6 and repr(ak.extra_args[0]) == "(B*S)"
        cfg = L.choose_config(op, "float8e4m3fn", 3072, 768, arch, out_dtype="bfloat16")
        assert cfg.impl == ("cuda_sm90" if arch == 90 else "triton") and cfg.block_k == 128
        if arch == 90:  # persistent: one CTA per SM
            assert ak.launch.grid[0] == 132
        else:
            assert repr(ak.launch.grid[0]) == f"(cdiv((B*S),{cfg.block_m})*{3072 // cfg.block_n})"
    with pytest.raises(ValueError, match="sm_89 or later"):
        aot_kernel(op, infos, attrs, 0, arch=80, cdiv=sym_cdiv)


def _plan(case):
    return L.launch_plan(case.op, case.shapes(), case.dtypes(), case.attrs, static_shape=T.case_static(case, 90))


def shape_of(case):
    """(kernel, splits, steps) of the run-time plan at 132 SMs; None where the plan runs the static
    choice's schedule (with host-encoded tensor maps) or there is no plan (no sm_90 kernel)."""
    plan = _plan(case)
    if plan is None:
        return None
    meta = plan.steps[0].source.meta
    static = L.choose_config(case.op, case.dtype, case.n, case.k, 90, T.case_static(case, 90), case.activation,
                             case.y_dtype)
    if len(plan.steps) == 1 and (meta["kernel"], meta["stages"]) == (static.impl, static.num_stages):
        return None
    return meta["kernel"], meta["split_k"], len(plan.steps)


def test_small_m_plan_choice():
    """At run time, in 128 x 128 tiles: at most half a tile per CTA, pingpong with K split into the
    largest divisor of the k-blocks that keeps units <= 132 and >= 8 k-blocks each; otherwise, with
    an activation, narrow tiles up to a tile per CTA (three with K <= 1024, where a 16-bit GELU runs
    pingpong past one tile a CTA); without one, pingpong
    up to a tile per CTA and at 2-3 waves of tiles; larger M, GatedGemm, FP8 and other archs keep
    the one kernel (None) or take 128 x 192 tiles (test_wave_plan_choice)."""
    C = T.Case
    assert shape_of(C("GemmEpilogue", (512,), 768, 3072, "float16", "none", "vector", "full")) == ("cuda_sm90_pingpong", 4, 2)
    assert shape_of(C("GemmEpilogue", (512,), 1024, 4096, "float16", "none", "vector", "full")) == ("cuda_sm90_pingpong", 4, 2)
    assert shape_of(C("GemmEpilogue", (1,), 768, 3072, "bfloat16", "none", "none", "none")) == ("cuda_sm90_pingpong", 6, 2)
    # 128 tiles: one a CTA
    assert shape_of(C("GemmEpilogue", (512,), 4096, 1024, "float16", "gelu_erf", "vector", "none")) == ("cuda_sm90_narrow", 1, 1)
    assert shape_of(C("GemmEpilogue", (512,), 4096, 11008, "float16", "none", "none", "full")) == ("cuda_sm90_pingpong", 1, 1)
    # K = 768: 12 k-blocks, no split keeps 8 a unit
    assert shape_of(C("GemmEpilogue", (64,), 3072, 768, "float16", "gelu_tanh", "vector", "none")) == ("cuda_sm90_narrow", 1, 1)
    assert shape_of(C("GemmEpilogue", (512,), 2304, 768, "float16", "none", "vector", "none")) is None  # pingpong, static
    # K = 256 is shorter than pingpong's ring
    assert shape_of(C("GemmEpilogue", (512,), 2048, 256, "float16", "none", "vector", "full")) == ("cuda_sm90_narrow", 1, 1)
    # with an activation and K <= 1024, up to 3 tiles a CTA: 2048 rows (384 tiles; at 1024 rows 128 x
    # 192 tiles fill the waves better: test_wave_plan_choice), not 4096 (768) nor K = 3072; past one
    # tile a CTA a 16-bit GELU (fp16's f16x2 epilogue, bf16's f16x2 gate) runs pingpong, other activations
    # narrow tiles
    assert shape_of(C("GemmEpilogue", (2048,), 3072, 768, "bfloat16", "gelu_erf", "vector", "none")) == \
        ("cuda_sm90_pingpong", 1, 1)
    assert shape_of(C("GemmEpilogue", (1024,), 4096, 1024, "bfloat16", "gelu_tanh", "vector", "none")) == \
        ("cuda_sm90_pingpong", 1, 1)
    assert shape_of(C("GemmEpilogue", (2048,), 3072, 768, "bfloat16", "silu", "vector", "none")) == \
        ("cuda_sm90_narrow", 1, 1)
    assert shape_of(C("GemmEpilogue", (2048,), 3072, 768, "float16", "silu", "vector", "none")) == \
        ("cuda_sm90_narrow", 1, 1)
    assert shape_of(C("GemmEpilogue", (2048,), 3072, 768, "float16", "gelu_erf", "vector", "none")) == \
        ("cuda_sm90_pingpong", 1, 1)
    assert shape_of(C("GemmEpilogue", (1024,), 4096, 1024, "float16", "gelu_tanh", "vector", "none")) == \
        ("cuda_sm90_pingpong", 1, 1)  # BERT-large FFN up: 256 tiles; 128 x 192 tiles' waves weigh more
    assert shape_of(C("GemmEpilogue", (4096,), 3072, 768, "float16", "gelu_erf", "vector", "none")) is None
    # K = 3072: no narrow tiles; 96 tiles of 128 x 256 take 128 x 192 tiles (test_wave_plan_choice)
    assert shape_of(C("GemmEpilogue", (1024,), 3072, 3072, "float16", "gelu_erf", "vector", "none")) == \
        ("cuda_sm90_n192", 1, 1)
    # without one, past a tile a CTA: the static choice, except pingpong at 2-3 waves (LLaMA-7B QKV,
    # M = 512: 384 tiles of 128 x 128, 192 of 128 x 256)
    assert shape_of(C("GemmEpilogue", (512,), 12288, 4096, "float16", "none", "none", "none")) == ("cuda_sm90_pingpong", 1, 1)
    assert shape_of(C("GemmEpilogue", (1024,), 12288, 4096, "float16", "none", "none", "none")) is None
    assert shape_of(C("GemmEpilogue", (1024,), 4096, 11008, "float16", "none", "none", "full")) is None
    assert shape_of(C("GemmEpilogue", (4096,), 1024, 4096, "float16", "none", "vector", "full")) is None
    assert shape_of(C("GemmEpilogue", (32768,), 3072, 768, "float16", "gelu_erf", "vector", "none")) is None
    # N = 1184: the cooperative kernel takes it (a 160-column last tile), neither 128 x 128 schedule does;
    # 128 x 192 tiles do where the maps come from the host (28 tiles: 0.75 against 20 of 128 x 256)
    case = C("GemmEpilogue", (512,), 1184, 768, "float16", "gelu_erf", "vector", "none")
    assert L.choose_config(case.op, case.dtype, case.n, case.k, 90, T.case_static(case, 90), case.activation).impl \
        in L.SM90_SCHEDULES
    assert shape_of(case) == ("cuda_sm90_n192", 1, 1)
    assert shape_of(C("GatedGemm", (64,), 11008, 4096, "float16", "silu")) is None
    assert shape_of(C("GemmEpilogue", (64,), 768, 3072, "float8e4m3fn", "none", "vector", "full",
                      output_dtype="bfloat16")) is None
    case = C("GemmEpilogue", (64,), 768, 3072, "float16", "none", "vector", "full")
    assert L.launch_plan(case.op, case.shapes(), case.dtypes(), case.attrs, static_shape=T.case_static(case, 89)) is None


def test_gpu_plan_cases_name_their_plans():
    """Each of test_kernel_gpu's PLAN_CASES names the plan kind the rules give it at 132 SMs, so that a rule
    change which moves a case to another schedule shows on CPU, not first on the device."""
    gpu = plugin_module("gemm", "test_kernel_gpu")
    kinds = {case.id(): T.plan_kind(T.case_plan(case, 90)) for case, _ in gpu.PLAN_CASES}
    assert kinds == {case.id(): kind for case, kind in gpu.PLAN_CASES}


def test_large_m_plan_choice():
    """Plain projections (ping-pong statically) take the epilogue-warp schedule from PLAIN_WIDE_MIN_WAVES
    waves of 128 x 256 tiles on, 16-bit GatedGemm from GATED_EPILOGUE_WG_MIN_ROWS rows; other static
    choices, FP8 and smaller M keep theirs."""
    C = T.Case
    wide = ("cuda_sm90_epilogue_wg", 1, 1)
    waves = L9.PLAIN_WIDE_MIN_WAVES
    for n, k in ((2304, 768), (3072, 1024)):
        col_tiles = -(-n // 256)
        first = -(-waves * 132 // col_tiles) * 128  # the first M (in 128-row blocks) with that many waves
        assert shape_of(C("GemmEpilogue", (first,), n, k, "float16", "none", "vector", "none")) == wide
        assert shape_of(C("GemmEpilogue", (2, first // 2), n, k, "bfloat16", "none", "none", "none")) == wide
        assert shape_of(C("GemmEpilogue", (first - 128,), n, k, "float16", "none", "vector", "none")) is None
    # BERT-base QKV at M = 32768: 2304 tiles (17.5 waves); at 4096 ping-pong stays
    assert shape_of(C("GemmEpilogue", (32768,), 2304, 768, "float16", "none", "vector", "none")) == wide
    assert shape_of(C("GemmEpilogue", (4096,), 2304, 768, "float16", "none", "vector", "none")) is None
    # not plain: an activation (epilogue warps statically), a residual, K > 2048
    assert shape_of(C("GemmEpilogue", (65536,), 3072, 768, "float16", "gelu_erf", "vector", "none")) is None
    assert shape_of(C("GemmEpilogue", (65536,), 1024, 1024, "float16", "none", "vector", "full")) is None
    assert shape_of(C("GemmEpilogue", (65536,), 12288, 4096, "float16", "none", "none", "none")) is None
    # GatedGemm: by rows (LLaMA-7B / 13B gate / up), in any batch layout; FP8 keeps the cooperative schedule
    rows = L9.GATED_EPILOGUE_WG_MIN_ROWS
    assert shape_of(C("GatedGemm", (rows,), 11008, 4096, "float16", "silu")) == wide
    assert shape_of(C("GatedGemm", (4, rows // 4), 13824, 5120, "bfloat16", "silu")) == wide
    assert shape_of(C("GatedGemm", (2, rows), 2816, 1024, "bfloat16", "gelu_tanh")) == wide
    assert shape_of(C("GatedGemm", (rows - 1,), 11008, 4096, "float16", "silu")) is None
    assert shape_of(C("GatedGemm", (4096,), 13824, 5120, "bfloat16", "silu")) is None
    assert shape_of(C("GatedGemm", (rows,), 11008, 4096, "float8e4m3fn", "silu", output_dtype="bfloat16")) is None
    # the plan's kernel and launch are the epilogue-warp config's (which test_kernel_gpu runs at every M),
    # with host-encoded tensor maps
    case = C("GemmEpilogue", (9472,), 2304, 520, "bfloat16", "none", "vector", "none")
    step, = _plan(case).steps
    cfg = next(c for c in L.candidate_configs(case.op, case.dtype, case.n, case.k, 90, T.case_static(case, 90),
                                              case.activation) if c.impl == "cuda_sm90_epilogue_wg")
    src, params = T.case_sources(case, config=cfg, arch=90)
    assert step.source.meta["host_maps"] and step.source.defines == {**src.defines, "HOST_MAPS": "1"}
    assert (src.name + "_hostmaps", params) == (step.source.name, step.params)


def test_split_k_plan_buffers_and_workspace():
    """Split-K: the GEMM reads the op's present inputs and writes the workspace's partial planes
    (splits x M x N fp32, within workspace_bytes' bound for any M); the reduce reads them, bias and
    residual, and writes y; the reduce grid covers every 8-column chunk."""
    case = T.Case("GemmEpilogue", (3, 67), 1024, 4096, "bfloat16", "gelu_erf", "none", "full")
    plan = _plan(case)
    gemm, red = plan.steps
    assert [(b.kind, b.index) for b in gemm.inputs] == [("input", 0), ("input", 1), ("input", 3)]
    assert [(b.kind, b.index) for b in gemm.outputs] == [("workspace", 0)]
    assert [(b.kind, b.index) for b in red.inputs] == [("workspace", 0), ("input", 3)]
    assert [(b.kind, b.index) for b in red.outputs] == [("output", 0)]
    splits = gemm.source.meta["split_k"]
    assert plan.workspace_bytes == splits * 201 * 1024 * 4
    bound = L.workspace_bytes(case.op, case.shapes(), case.shapes(), case.dtypes(), case.attrs)
    for m in (1, 77, 201, 512, 1000, 2000):
        c = T.Case("GemmEpilogue", (m,), 1024, 4096, "bfloat16", "gelu_erf", "none", "full")
        p = _plan(c)
        assert p is None or p.workspace_bytes <= bound
    assert red.params.grid[0] * red.params.block[0] >= 201 * 1024 // 8
    assert red.params.extra_args == [201] and gemm.params.extra_args == [201]


@pytest.mark.parametrize("case,reduce_inputs", [
    (T.Case("GemmEpilogue", (300,), 768, 3072, "float16", "silu", "vector", "full", "before_activation"), 3),
    (T.Case("GemmEpilogue", (300,), 768, 3072, "bfloat16", "relu2", "vector", "none"), 2),
], ids=lambda x: x.id() if hasattr(x, "id") else str(x))
def test_split_k_plan_compiles(tmp_path, case, reduce_inputs):
    """Both steps of a split-K plan build for sm_90a (NVRTC): the GEMM with wgmma, its QDP-order
    parameters and then its two tensor maps (128-byte, 64-byte aligned), the reduce with the partials, the
    present epilogue inputs, M and y."""
    plan = _plan(case)
    for step, maps in zip(plan.steps, (2, 0)):
        art = KernelCache(tmp_path).build(step.source, 90)
        assert art.arch_suffix == "a" and art.cubin and art.name == step.source.entry
        assert len(art.tensor_maps) == len(step.source.tensor_maps) == maps
        entry = re.search(r"\.entry\s+" + re.escape(art.name) + r"\s*\((.*?)\)", art.ptx, re.S).group(1)
        assert re.findall(r"\.param\s+(?:\.align 64 )?\.(\w+)", entry) == \
            ["u64"] * step.source.n_inputs + ["u32", "u64"] + ["b8"] * maps
        assert len(re.findall(r"\.param \.align 64 \.b8 \w+\[128\]", entry)) == maps
    gemm_ptx = KernelCache(tmp_path).build(plan.steps[0].source, 90).ptx
    assert "wgmma.mma_async" in gemm_ptx
    assert plan.steps[1].source.n_inputs == reduce_inputs


def test_wave_plan_choice():
    """128 x 192 tiles where their waves take at most 0.85 of those of the static choice or of an
    unsplit small-M plan (in 128 x 256 tiles' work: tiles of the busiest CTA x width / 256), N
    taking them; split-K plans stay."""
    C = T.Case
    n192 = ("cuda_sm90_n192", 1, 1)
    # BERT-base FFN down, M = 4096: 96 tiles of 128 x 256 (1.0) against 128 of 128 x 192 (0.75)
    assert shape_of(C("GemmEpilogue", (4096,), 768, 3072, "float16", "none", "vector", "full")) == n192
    assert shape_of(C("GemmEpilogue", (2, 2000), 768, 3072, "bfloat16", "none", "vector", "full")) == n192
    # ... with an activation and K > 1024 (no narrow tiles): the epilogue-warp schedule's waves
    assert shape_of(C("GemmEpilogue", (4000,), 768, 3072, "float16", "gelu_tanh", "scalar", "none")) == n192
    # BERT-base QKV, M = 1024: pingpong's 144 tiles (two on 12 CTAs: 1.0) against 96 (0.75)
    assert shape_of(C("GemmEpilogue", (1024,), 2304, 768, "float16", "none", "vector", "none")) == n192
    # BERT-base FFN up, M = 1024: 192 narrow tiles (two on 60 CTAs: 1.0) against 128 (0.75); not at
    # 512 rows (96 narrow tiles: 0.5 against 0.75) nor at 2048 (1.5 both)
    assert shape_of(C("GemmEpilogue", (1024,), 3072, 768, "float16", "gelu_erf", "vector", "none")) == n192
    assert shape_of(C("GemmEpilogue", (512,), 3072, 768, "float16", "gelu_erf", "vector", "none"))[0] == \
        "cuda_sm90_narrow"
    # split-K at M = 512 (0.5 tiles a CTA) stays
    assert shape_of(C("GemmEpilogue", (512,), 768, 3072, "float16", "none", "vector", "full"))[1] == 4
    # equal costs keep the static choice: N = 768 at M = 16384 (384 / 512 tiles: 3.0 both),
    # BERT-base FFN up at 4096 (384 / 512), LLaMA-7B QKV at 1024 (384 / 512)
    assert shape_of(C("GemmEpilogue", (16384,), 768, 3072, "float16", "none", "vector", "full")) is None
    assert shape_of(C("GemmEpilogue", (4096,), 3072, 768, "float16", "gelu_erf", "vector", "none")) is None
    assert shape_of(C("GemmEpilogue", (1024,), 12288, 4096, "float16", "none", "none", "none")) is None
    # N = 4096: 22 column tiles of 192 (1.5) against 16 of 256 (1.0) at M = 1024
    assert shape_of(C("GemmEpilogue", (1024,), 4096, 11008, "float16", "none", "none", "full")) is None
    # N = 1024 with a TMA residual: the last 64-column tile is too narrow for three tensor maps built on
    # the device, not for a plan's host-encoded ones (120 tiles of 128 x 192: 0.75 against 80 of 128 x 256)
    case = C("GemmEpilogue", (2560,), 1024, 4096, "float16", "none", "vector", "full")
    static = T.case_static(case, 90)
    assert L9.takes(case.op, case.dtype, case.n, static, 90, L9.TILE_192, case.k) is not None
    assert L9.takes(case.op, case.dtype, case.n, static, 90, L9.TILE_192, case.k, host_maps=True) is None
    assert shape_of(case) == n192
    # LLaMA-13B FFN down at M = 512: 108 tiles of 128 x 192 (a 128-column last one) against 80 of 128 x 256
    assert shape_of(C("GemmEpilogue", (512,), 5120, 13824, "float16", "none", "none", "full")) == n192
    # GatedGemm and FP8 stay on their static kernel
    assert shape_of(C("GatedGemm", (4096,), 768, 3072, "float16", "silu")) is None
    assert shape_of(C("GemmEpilogue", (4096,), 768, 3072, "float8e4m3fn", "none", "vector", "full",
                      output_dtype="bfloat16")) is None
    assert L9.wave_cost(L9.TILE_192, 4096, 768, 132) == 0.75
    assert L9.wave_cost("cuda_sm90_pingpong", 1024, 2304, 132) == 1.0
