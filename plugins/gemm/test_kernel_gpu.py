"""GEMM AOT artifacts launched through optfuse.kernels.launcher on a GPU, against the float64
reference (reference.py). Fresh random inputs every run (the seed is printed); outputs are poisoned
with NaN before each of two launches, so an unwritten element or a race fails.

Run on the device machine: ``python -m pytest plugins/gemm -m gpu``. With ``$OPTFUSE_GEMM_PREBUILT``
pointing at a KernelCache root built elsewhere (``scripts/bench_gemm.py --build DIR``), those
artifacts are used; otherwise they are compiled with the local Triton.

Kernel sources: every test runs once per entry of KERNEL_SOURCES (a ``GemmConfig.impl``) on each
case that source's candidate configs cover; a new kernel (the sm_90 CUDA one) joins by adding its
impl name there.

FP8 (float8e4m3fn, sm_89 and later; the Triton kernel): the reference is the float64 product of the
same FP8 values times the scales (the dequantized math); inputs are quantized by the test with
saturation, per-tensor A and per-channel (or single) weight scales; ``extra={"headroom": 0.5}``
cases saturate the largest values at +-448 (the E4M3 range edge).
"""

import os
import zlib

import pytest

torch = pytest.importorskip("torch")

from optfuse.kernels.registry import plugin_module  # noqa: E402

T = plugin_module("gemm", "testing")
L = plugin_module("gemm", "launch")

pytestmark = pytest.mark.gpu

#: The kernel sources under test (GemmConfig.impl values).
KERNEL_SOURCES = ["cuda_sm90_pingpong", "cuda_sm90", "cuda_sm90_epilogue_wg", "cuda_sm90_narrow", "cuda_sm90_n192",
                  "triton"]

C = T.Case
_ACTS = ("none", "relu", "gelu_erf", "gelu_tanh", "quick_gelu", "silu", "sigmoid", "tanh", "relu2")
# M, N, K chosen so that none is a multiple of the tiles (M: 128; N: 64..256; K: 32 / 64).
CASES = [
    *[C("GemmEpilogue", (3, 201), 1000, 776, "float16", a, "vector", "full") for a in _ACTS],
    *[C("GemmEpilogue", (603,), 1000, 776, "float32", a, "vector", "full") for a in ("gelu_erf", "gelu_tanh")],
    C("GemmEpilogue", (2, 333), 1032, 1544, "bfloat16", "gelu_tanh", "vector", "full", "before_activation"),
    C("GemmEpilogue", (2, 333), 1032, 1544, "bfloat16", "silu", "scalar", "scalar"),
    C("GemmEpilogue", (1000,), 776, 1000, "bfloat16", "relu", "none", "none"),
    C("GemmEpilogue", (1000,), 776, 1000, "float16", "none", "none", "full", "before_activation"),
    C("GemmEpilogue", (777,), 520, 4104, "float16", "gelu_erf", "vector", "full", "before_activation"),
    C("GemmEpilogue", (1,), 3072, 768, "float16", "gelu_erf", "vector", "none"),       # one row
    C("GemmEpilogue", (7,), 4096, 1024, "bfloat16", "none", "vector", "full"),
    C("GemmEpilogue", (2, 1050), 3072, 768, "float16", "gelu_erf", "vector", "none"),  # BERT-base FFN up
    C("GemmEpilogue", (4, 129), 768, 3072, "bfloat16", "none", "vector", "full"),      # FFN down + residual
    # several tiles per CTA, an odd number of row blocks (a cluster's second tile past M)
    C("GemmEpilogue", (8000,), 2048, 512, "float16", "gelu_erf", "vector", "full"),
    C("GemmEpilogue", (2, 4000), 1024, 520, "bfloat16", "none", "none", "none"),
    C("GemmEpilogue", (301,), 264, 136, "float32", "tanh", "scalar", "full", "before_activation", 0.5),
    C("GemmEpilogue", (301,), 264, 136, "float16", "quick_gelu", "vector", "none", alpha=0.125),
    # relu2 where the sm_90 CUDA kernel takes it (N a multiple of 32; the _ACTS cases above are
    # Triton's only): Persimmon's FFN up (bias), Nemotron's (no bias), before a TMA residual
    C("GemmEpilogue", (2, 1050), 3072, 768, "float16", "relu2", "vector", "none"),
    C("GemmEpilogue", (1000,), 1024, 776, "bfloat16", "relu2", "none", "none"),
    C("GemmEpilogue", (4, 129), 1024, 1544, "float16", "relu2", "scalar", "full", "before_activation"),
    C("GatedGemm", (3, 201), 1000, 776, "float16", "silu"),
    C("GatedGemm", (1000,), 1032, 1544, "bfloat16", "gelu_erf"),
    C("GatedGemm", (333,), 1000, 776, "float32", "gelu_tanh"),
    C("GatedGemm", (1031,), 2752, 1024, "bfloat16", "silu"),                           # LLaMA-like, 1/4 scale
    C("GatedGemm", (5,), 11008, 4096, "float16", "silu"),                              # LLaMA-7B, few rows
    C("GemmEpilogue", (1000,), 776, 1000, "float16", "gelu_erf", "vector", "full", output_dtype="float32"),
    # every activation where the 128 x 128 schedules take it (N a multiple of 128): narrow tiles'
    # short (FTZ) activation forms
    *[C("GemmEpilogue", (3, 67), 1024, 776, "bfloat16", a, "vector", "full") for a in _ACTS],
    # 128 x 192 tiles' last column tile 128 wide (N = 2048), and several tiles a CTA
    C("GemmEpilogue", (2, 1500), 2048, 776, "float16", "gelu_erf", "vector", "none"),
    C("GemmEpilogue", (5000,), 768, 1544, "bfloat16", "none", "scalar", "full", "before_activation"),
    # fp16 on the epilogue warps with more tiles than 132 CTAs (they take every tile of a CTA but its last):
    # GELU tanh in f16x2 (GELU erf above) with a scalar bias and a residual before it; QuickGELU, SiLU and
    # GatedGemm, which keep fp32, with a scalar residual
    C("GemmEpilogue", (3, 3000), 1152, 520, "float16", "gelu_tanh", "scalar", "full", "before_activation"),
    C("GemmEpilogue", (20000,), 384, 136, "float16", "quick_gelu", "vector", "scalar", alpha=0.125),
    C("GemmEpilogue", (9000,), 1024, 776, "float16", "silu", "vector", "none"),
    C("GatedGemm", (2000,), 2816, 1024, "float16", "silu"),
    C("GatedGemm", (4000,), 1024, 776, "float16", "gelu_tanh"),
]
_FP8 = "float8e4m3fn"
_EDGE = {"headroom": 0.5}  # the largest values saturated at +-448
FP8_CASES = [
    *[C("GemmEpilogue", (3, 201), 1000, 776, _FP8, a, "vector", "full", output_dtype="bfloat16") for a in _ACTS],
    C("GemmEpilogue", (2, 333), 1032, 1544, _FP8, "gelu_tanh", "vector", "full", "before_activation",
      output_dtype="float16"),
    C("GemmEpilogue", (2, 333), 1032, 1544, _FP8, "silu", "scalar", "scalar", output_dtype="bfloat16", w_scale="scalar"),
    C("GemmEpilogue", (1000,), 776, 1000, _FP8, "relu", "none", "none", output_dtype="float32"),
    C("GemmEpilogue", (777,), 520, 4104, _FP8, "gelu_erf", "vector", "full", "before_activation",
      output_dtype="bfloat16", extra=_EDGE),
    C("GemmEpilogue", (1,), 3072, 768, _FP8, "gelu_erf", "vector", "none", output_dtype="bfloat16"),   # one row
    C("GemmEpilogue", (2, 1050), 3072, 768, _FP8, "gelu_erf", "vector", "none", output_dtype="bfloat16"),
    C("GemmEpilogue", (4, 129), 768, 3072, _FP8, "none", "vector", "full", output_dtype="bfloat16", extra=_EDGE),
    C("GemmEpilogue", (301,), 264, 136, _FP8, "quick_gelu", "vector", "none", alpha=0.125, output_dtype="float16"),
    C("GatedGemm", (3, 201), 1000, 776, _FP8, "silu", output_dtype="bfloat16"),
    C("GatedGemm", (333,), 1000, 776, _FP8, "gelu_tanh", output_dtype="float32", w_scale="scalar"),
    C("GatedGemm", (1031,), 2752, 1024, _FP8, "gelu_erf", output_dtype="float16", extra=_EDGE),
    C("GatedGemm", (5,), 11008, 4096, _FP8, "silu", output_dtype="bfloat16"),                 # LLaMA-7B, few rows
    # the sm_90 CUDA kernel's FP8 path (N a multiple of 32): one-value weight scales, a scalar bias
    C("GemmEpilogue", (2, 1050), 3072, 768, _FP8, "silu", "scalar", "full", output_dtype="float16", w_scale="scalar"),
    C("GatedGemm", (1031,), 2752, 1024, _FP8, "silu", output_dtype="bfloat16", w_scale="scalar"),
    C("GemmEpilogue", (2, 1050), 3072, 768, _FP8, "relu2", "vector", "none", output_dtype="bfloat16"),
]
CASES += FP8_CASES
#: launch_plan's plans, whose GEMM takes host-encoded tensor maps: shapes whose M leaves the statically
#: chosen kernel's tiles on few SMs (narrow tiles or the pingpong kernel instead, or K split: the partial
#: planes then the reduce kernel), other tile widths, and the static choice's schedule with each kind of
#: map (a TMA residual, the gated weights' pair, FP8); (case, testing.plan_kind of its plan).
PLAN_CASES = [
    (C("GemmEpilogue", (512,), 768, 3072, "float16", "none", "vector", "full"), "pingpong split-K x4"),  # BERT-base FFN down
    (C("GemmEpilogue", (3, 67), 1024, 4096, "bfloat16", "gelu_erf", "vector", "full", "before_activation"),
     "pingpong split-K x8"),
    (C("GemmEpilogue", (300,), 768, 3072, "float16", "silu", "scalar", "scalar"), "pingpong split-K x6"),
    (C("GemmEpilogue", (1,), 768, 3072, "bfloat16", "none", "none", "none", alpha=0.5), "pingpong split-K x6"),  # one row
    (C("GemmEpilogue", (77,), 1024, 4096, "float16", "quick_gelu", "none", "full"), "pingpong split-K x8"),
    (C("GemmEpilogue", (512,), 4096, 1024, "float16", "gelu_erf", "vector", "none"), "narrow"),
    (C("GemmEpilogue", (333,), 4096, 11008, "bfloat16", "none", "none", "full"), "pingpong"),
    (C("GemmEpilogue", (300,), 2048, 256, "bfloat16", "none", "vector", "full"), "narrow"),      # K < pingpong's ring
    (C("GemmEpilogue", (300,), 12288, 520, "bfloat16", "none", "vector", "full"), "pingpong"),   # 2-3 waves
    (C("GemmEpilogue", (2, 100), 2304, 768, "bfloat16", "gelu_tanh", "vector", "full", "before_activation"), "narrow"),
    (C("GemmEpilogue", (2, 700), 3072, 768, "float16", "silu", "scalar", "none"), "narrow"),    # 2 tiles a CTA
    # an fp16 GELU past one tile a CTA: pingpong unsplit (a residual after it; 288 tiles)
    (C("GemmEpilogue", (2, 520), 4096, 1024, "float16", "gelu_tanh", "vector", "full"), "pingpong"),
    # ... and a bf16 one (its gate on f16x2 pairs), a residual before it (384 tiles)
    (C("GemmEpilogue", (2, 1000), 3072, 768, "bfloat16", "gelu_erf", "vector", "full", "before_activation"),
     "pingpong"),
    (C("GemmEpilogue", (300,), 768, 3072, "float16", "relu2", "vector", "none"), "pingpong split-K x6"),  # relu2 in the reduce
    # the reduce's epilogue in fp16: GELU erf in f16x2 with a residual after it, SiLU (fp32) with one before
    (C("GemmEpilogue", (300,), 768, 3072, "float16", "gelu_erf", "vector", "full"), "pingpong split-K x6"),
    (C("GemmEpilogue", (2, 150), 1024, 4096, "float16", "silu", "scalar", "full", "before_activation"), "pingpong split-K x4"),
    # 128 x 192 tiles where they fill the waves better (BERT-base FFN down and QKV shapes)
    (C("GemmEpilogue", (2, 2000), 768, 3072, "bfloat16", "none", "vector", "full"), "n192"),
    (C("GemmEpilogue", (4000,), 768, 3072, "float16", "gelu_tanh", "scalar", "none"), "n192"),
    (C("GemmEpilogue", (1000,), 2304, 768, "float16", "none", "vector", "none"), "n192"),
    # plain projections at large M: the epilogue-warp schedule's wide tiles (PLAIN_WIDE_MIN_WAVES)
    (C("GemmEpilogue", (9472,), 2304, 520, "bfloat16", "none", "vector", "none"), "epilogue_wg"),
    # GatedGemm at large M (GATED_EPILOGUE_WG_MIN_ROWS): the epilogue-warp schedule, the weights' pair map, a K tail
    (C("GatedGemm", (2, 12300), 1152, 776, "bfloat16", "silu"), "epilogue_wg"),
    # the static choice's schedule
    (C("GemmEpilogue", (4096,), 1024, 1024, "float16", "none", "vector", "full"), "cooperative"),
    # 128 x 192 tiles with a TMA residual and a partial last column tile (64 / 128 of 192 columns)
    (C("GemmEpilogue", (2560,), 1024, 1024, "float16", "none", "vector", "full"), "n192"),
    (C("GemmEpilogue", (512,), 5120, 1024, "bfloat16", "none", "none", "full"), "n192"),
    (C("GemmEpilogue", (512,), 1184, 768, "float16", "gelu_erf", "vector", "none"), "n192"),  # a 32-column last tile
    (C("GemmEpilogue", (2, 2100), 3072, 768, "bfloat16", "gelu_erf", "vector", "none"), "epilogue_wg"),
    (C("GemmEpilogue", (4096,), 2304, 768, "float16", "none", "vector", "none"), "pingpong"),
    (C("GatedGemm", (1031,), 2816, 1024, "bfloat16", "silu"), "cooperative"),
    (C("GemmEpilogue", (2, 1050), 3072, 768, _FP8, "silu", "scalar", "full", output_dtype="float16", w_scale="scalar"),
     "cooperative"),
    (C("GatedGemm", (1031,), 2816, 1024, _FP8, "silu", output_dtype="bfloat16", w_scale="scalar"), "cooperative"),
]
#: GatedGemm whose W_up lies below W_gate (test_gated_weights_in_either_order)
GATED_SWAP_CASE = C("GatedGemm", (1031,), 2816, 1024, "bfloat16", "silu")
#: The cases every candidate config runs on (one per op and dtype class).
CONFIG_CASES = [
    C("GemmEpilogue", (2, 333), 1032, 1544, "bfloat16", "gelu_tanh", "vector", "full", "before_activation"),
    C("GemmEpilogue", (603,), 1000, 776, "float32", "gelu_erf", "vector", "full"),
    C("GatedGemm", (3, 201), 1000, 776, "float16", "silu"),
    C("GatedGemm", (333,), 1000, 776, "float32", "gelu_tanh"),
    C("GemmEpilogue", (2, 333), 1032, 1544, _FP8, "gelu_tanh", "vector", "full", "before_activation",
      output_dtype="bfloat16", extra=_EDGE),
    C("GatedGemm", (3, 201), 1000, 776, _FP8, "silu", output_dtype="float16"),
]


@pytest.fixture(scope="module")
def seed():
    s = int.from_bytes(os.urandom(4), "little")
    print(f"\ngemm gpu tests: seed {s}")
    return s


def _device_arch():
    from optfuse.kernels.target import detect_arch

    return detect_arch()


def _runs_on(case, arch) -> bool:
    """FP8 needs FP8 tensor cores (sm_89 and later; arch None: unknown, built anyway)."""
    return not case.fp8 or arch is None or int(arch) >= L.FP8_MIN_ARCH


def configs_of(impl: str, case, arch) -> list:
    """The candidate configs of kernel source ``impl`` for a case on ``arch`` (none for FP8 below sm_89)."""
    if not _runs_on(case, arch):
        return []
    static = T.case_static(case, arch)
    return [c for c in L.candidate_configs(case.op, case.dtype, case.n, case.k, arch, static, case.activation,
                                           case.y_dtype) if c.impl == impl]


def gpu_test_sources(arch=None) -> list:
    """Every KernelSource these tests launch on ``arch`` (what bench_gemm.py --build prebuilds)."""
    out = {}
    for impl in KERNEL_SOURCES:
        for case in CASES + NAN_CASES:
            cfgs = configs_of(impl, case, arch)
            if cfgs:
                src = T.case_sources(case, config=cfgs[0], arch=arch)[0]
                out[src.name] = src
        for case in CONFIG_CASES:
            for cfg in configs_of(impl, case, arch):
                src = T.case_sources(case, config=cfg, arch=arch)[0]
                out[src.name] = src
    for case, _ in PLAN_CASES:
        plan = T.case_plan(case, arch if arch is not None else 90)
        for step in plan.steps if plan is not None else ():
            out[step.source.name] = step.source
    src = T.case_sources(GATED_SWAP_CASE, arch=arch if arch is not None else 90)[0]  # its plan is a PLAN_CASE's
    out[src.name] = src
    return list(out.values())


_REFERENCES: dict = {}


def _check(case, config, seed, arch):
    from optfuse.kernels import launch

    gen = torch.Generator().manual_seed((seed + zlib.crc32(case.id().encode())) % (2 ** 31))
    ins = T.case_inputs(case, generator=gen, headroom=case.extra.get("headroom", 1.0))
    if case.extra.get("headroom", 1.0) < 1:
        assert (ins[0].float().abs() == T.FP8_MAX).any(), "the case should reach the E4M3 range edge"
    src, params = T.case_sources(case, config=config, arch=arch)
    art = T.get_artifact(src, arch)
    ref = T.reference_of(case, ins)
    dev = [t.cuda() for t in ins if t is not None]
    out = torch.empty((*case.lead, case.n), dtype=getattr(torch, case.y_dtype), device="cuda")
    for _ in range(2):  # twice: a race or a read of unwritten memory shows as a changing result
        out.fill_(float("nan"))
        launch(art, params, dev, [out], torch.cuda.current_stream().cuda_stream, sync=True)
        T.check_close(out, ref, T.tolerance_key(case), src.name)


@pytest.mark.parametrize("impl", KERNEL_SOURCES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id())
def test_artifact_matches_reference(case, impl, seed, cuda_torch):
    arch = _device_arch()
    cfgs = configs_of(impl, case, arch)
    if not cfgs:
        pytest.skip(f"kernel source {impl!r} does not take this case on sm_{arch}")
    _check(case, cfgs[0], seed, arch)


@pytest.mark.parametrize("impl", KERNEL_SOURCES)
@pytest.mark.parametrize("case", CONFIG_CASES, ids=lambda c: c.id())
def test_every_candidate_config(case, impl, seed, cuda_torch):
    arch = _device_arch()
    cfgs = configs_of(impl, case, arch)
    if not cfgs:
        pytest.skip(f"kernel source {impl!r} does not take this case on sm_{arch}")
    failures = []
    for cfg in cfgs:
        try:
            _check(case, cfg, seed, arch)
        except AssertionError as e:
            failures.append(f"{L.config_name(cfg)}: {e}")
    assert not failures, "\n".join(failures)


#: fp16 GELU (the f16x2 epilogue) and bf16 GELU (the f16x2 gate) with more tiles than CTAs: both epilogue
#: warps and consumers write tiles
NAN_CASES = [C("GemmEpilogue", (2, 1050), 3072, 768, dtype, "gelu_erf", "vector", "none")
             for dtype in ("float16", "bfloat16")]


@pytest.mark.parametrize("case", NAN_CASES, ids=lambda c: c.dtype)
@pytest.mark.parametrize("impl", ["cuda_sm90_epilogue_wg", "cuda_sm90", "cuda_sm90_narrow", "triton"])
def test_nan_rows_stay_nan(impl, case, seed, cuda_torch):
    """A NaN in a row of A makes that row of y all NaN (no epilogue turns it into a number: the f16x2 GELU's
    -65504 floor is a max that keeps NaN, and the bf16 gate's saturating conversion keeps it), and the other
    rows match the reference."""
    import numpy as np

    from optfuse.kernels import launch

    arch = _device_arch()
    cfgs = configs_of(impl, case, arch)
    if not cfgs:
        pytest.skip(f"kernel source {impl!r} does not take this case on sm_{arch}")
    gen = torch.Generator().manual_seed((seed + zlib.crc32(case.id().encode())) % (2 ** 31))
    ins = T.case_inputs(case, generator=gen)
    rows = [0, 1000, 2 * 1050 - 1]  # flattened rows: the first, a middle and the last row tile
    a = ins[0].reshape(-1, case.k)
    a[rows, 7] = float("nan")
    ref = T.reference_of(case, ins).reshape(-1, case.n)
    src, params = T.case_sources(case, config=cfgs[0], arch=arch)
    art = T.get_artifact(src, arch)
    out = torch.full((*case.lead, case.n), 0.0, dtype=getattr(torch, case.dtype), device="cuda")
    launch(art, params, [t.cuda() for t in ins if t is not None], [out], torch.cuda.current_stream().cuda_stream,
           sync=True)
    y = out.reshape(-1, case.n).double().cpu().numpy()
    assert np.isnan(y[rows]).all(), f"{src.name}: {int((~np.isnan(y[rows])).sum())} outputs of the NaN rows are numbers"
    keep = np.setdiff1d(np.arange(y.shape[0]), rows)
    T.check_close(y[keep], ref[keep], T.tolerance_key(case), src.name)


def test_default_choice_is_tested(cuda_torch):
    """The config kernel_config picks on this device is the first of its source's candidates, so
    test_artifact_matches_reference runs what a plugin runs."""
    arch = _device_arch()
    for case in CASES:
        if not _runs_on(case, arch):
            continue
        chosen = L.choose_config(case.op, case.dtype, case.n, case.k, arch, T.case_static(case, arch), case.activation,
                                 case.y_dtype)
        assert chosen.impl in KERNEL_SOURCES, f"{case.id()}: picks {chosen.impl!r}, not under test"
        assert configs_of(chosen.impl, case, arch)[0] == chosen


@pytest.mark.parametrize("case,kind", PLAN_CASES, ids=lambda x: x.id() if hasattr(x, "id") else x.replace(" ", "_"))
def test_small_m_plan_matches_reference(case, kind, seed, cuda_torch):
    """launch_plan's plan (what the classic plugin runs at this M, ``kind`` as testing.plan_kind
    says it) against the float64 reference; output and workspace poisoned (0xFF: fp32 NaN) before
    each of two runs."""
    from optfuse.kernels.launcher import launch_plan

    arch = _device_arch()
    if arch is None or int(arch) != 90:
        pytest.skip(f"the sm_90 kernel's plans (device sm_{arch})")
    plan = T.case_plan(case, arch)
    assert T.plan_kind(plan) == kind
    assert len(plan.steps) == (2 if "split-K" in kind else 1)
    T.build_plan(plan, arch)
    gen = torch.Generator().manual_seed((seed + zlib.crc32(case.id().encode())) % (2 ** 31))
    ins = T.case_inputs(case, generator=gen)
    ref = T.reference_of(case, ins)
    dev = [t.cuda() if t is not None else None for t in ins]
    out = torch.empty((*case.lead, case.n), dtype=getattr(torch, case.y_dtype), device="cuda")
    workspace = T.new_workspace(plan, "cuda")
    for _ in range(2):
        out.fill_(float("nan"))
        workspace.fill_(255)
        launch_plan(plan, dev, [out], workspace, torch.cuda.current_stream().cuda_stream, sync=True)
        T.check_close(out, ref, T.tolerance_key(case), plan.steps[0].source.name)


def test_gated_weights_in_either_order(seed, cuda_torch):
    """GatedGemm's gate and up weights are one pair tensor map from the lower address: with W_up stored
    below W_gate in one buffer, the plan (host-encoded maps) and the static kernel (maps built on the device)
    still take the gate from W_gate."""
    from optfuse.kernels import launch
    from optfuse.kernels.launcher import launch_plan

    arch = _device_arch()
    if arch is None or int(arch) != 90:
        pytest.skip(f"the sm_90 kernel (device sm_{arch})")
    case = GATED_SWAP_CASE
    gen = torch.Generator().manual_seed((seed + zlib.crc32(case.id().encode())) % (2 ** 31))
    ins = T.case_inputs(case, generator=gen)
    ref = T.reference_of(case, ins)
    both = torch.stack([ins[2], ins[1]]).cuda()  # [W_up, W_gate]
    dev = [ins[0].cuda(), both[1], both[0]]
    assert dev[2].data_ptr() < dev[1].data_ptr()
    plan = T.build_plan(T.case_plan(case, arch), arch)
    src, params = T.case_sources(case, arch=arch)
    art = T.get_artifact(src, arch)
    stream = torch.cuda.current_stream().cuda_stream
    for what, run in (("plan", lambda o: launch_plan(plan, dev, [o], T.new_workspace(plan, "cuda"), stream, sync=True)),
                      ("static", lambda o: launch(art, params, dev, [o], stream, sync=True))):
        out = torch.full((*case.lead, case.n), float("nan"), dtype=torch.bfloat16, device="cuda")
        run(out)
        T.check_close(out, ref, T.tolerance_key(case), f"{what}: {src.name}")
