"""LayerNorm / SkipLayerNorm: NumPy reference, ONNX function in onnxruntime, launch params,
Triton kernels under the interpreter and AOT for every target (CPU); the compiled artifacts
through the launcher against float64 (``-m gpu``)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from optfuse.kernels import KernelCache
from optfuse.kernels.registry import plugin_module
from optfuse.kernels.testing import (
    SymDim, candidate_artifacts, check_error, check_onnx_function, check_ulps, gpu_run, max_abs_err, np_dtype, sym_cdiv,
)

launch = plugin_module("layer_norm", "launch")
reference = plugin_module("layer_norm", "reference")

OPS = ("LayerNorm", "SkipLayerNorm")
DTYPES = ("float32", "float16", "bfloat16")


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def make_inputs(op, dtype, rows, hidden, rng, magnitude=None):
    """Random inputs; with ``magnitude``, x (and skip) uniform so that |x (+ skip)| <= magnitude."""
    dt = np_dtype(dtype)
    x = (rng.standard_normal((rows, hidden)) + 0.5).astype(dt)
    skip = rng.standard_normal((rows, hidden)).astype(dt)
    if magnitude:
        half = magnitude if op == "LayerNorm" else magnitude / 2
        x = rng.uniform(-half, half, (rows, hidden)).astype(dt)
        skip = rng.uniform(-half, half, (rows, hidden)).astype(dt)
    gamma = (1.0 + 0.5 * rng.standard_normal(hidden)).astype(dt)
    beta = (0.5 * rng.standard_normal(hidden)).astype(dt)
    if op == "SkipLayerNorm":
        return [x, skip, gamma, beta]
    return [x, gamma, beta]


# ---------------------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("op", OPS)
def test_reference_formula(op):
    rng = np.random.default_rng(0)
    ins = make_inputs(op, "float32", 4, 37, rng)
    outs = reference.reference(op, ins, {"epsilon": 1e-3})
    x = ins[0].astype(np.float64) + (ins[1].astype(np.float64) if op == "SkipLayerNorm" else 0)
    g, b = ins[-2].astype(np.float64), ins[-1].astype(np.float64)
    want = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-3) * g + b
    np.testing.assert_allclose(outs[0], want, rtol=1e-5, atol=1e-5)
    assert outs[0].dtype == np.float32
    if op == "SkipLayerNorm":
        np.testing.assert_array_equal(outs[1], (ins[0] + ins[1]))


def test_reference_fp16_no_overflow():
    rng = np.random.default_rng(1)
    x = rng.uniform(-6e4, 6e4, (3, 4096)).astype(np.float16)
    g, b = np.ones(4096, np.float16), np.zeros(4096, np.float16)
    (y,) = reference.reference("LayerNorm", [x, g, b], {})
    assert np.isfinite(y.astype(np.float32)).all()


@pytest.mark.parametrize("opset", [14, 15, 17, 18])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("op", OPS)
def test_onnx_function_runs_in_onnxruntime(op, dtype, opset):
    rng = np.random.default_rng(2)
    check_onnx_function(reference, op, make_inputs(op, dtype, 5, 771, rng), dtype, opset)


@pytest.mark.parametrize("op", OPS)
def test_launch_params_symbolic(op):
    shapes = [[SymDim("B"), SymDim("S"), 768]] + [[768]] * (len(launch._INPUTS[op]) - 1)
    p = launch.launch_params(op, shapes, ["float16"], {"epsilon": 1e-5}, cdiv=sym_cdiv, static_shape={"hidden": 768})
    cfg = launch.choose_config("float16", 768, op)
    rows_per_program, threads = ((cfg.rpb, cfg.threads) if isinstance(cfg, launch.LNWarpConfig)
                                 else (cfg.block_m, cfg.num_warps * 32))
    assert repr(p.grid[0]) == f"cdiv((B*S),{rows_per_program})"
    assert repr(p.extra_args[0]) == "(B*S)"
    assert p.block == (threads, 1, 1)
    # concrete ints work the same way
    q = launch.launch_params(op, [[4, 5, 768]], ["float16"], {})
    assert q.grid == (-(-20 // rows_per_program), 1, 1) and q.extra_args == [20]


def test_kernel_config_specializes():
    tri = launch.triton_config("float16", 768)
    a = launch.kernel_config("LayerNorm", "float16", {"epsilon": 1e-5}, {"hidden": 768}, config=tri)
    b = launch.kernel_config("LayerNorm", "float16", {"epsilon": 1e-6}, {"hidden": 768}, config=tri)
    assert a.constexprs["EPS"] == 1e-5 and b.constexprs["EPS"] == 1e-6
    assert a.spec_dict() != b.spec_dict()
    # the CUDA warp kernel (the default at 768) specializes the same way, through -D
    wa = launch.kernel_config("LayerNorm", "float16", {"epsilon": 1e-5}, {"hidden": 768})
    wb = launch.kernel_config("LayerNorm", "float16", {"epsilon": 1e-6}, {"hidden": 768})
    assert wa.lang == "cuda" and wa.defines["EPS"] == "1e-05f" and wb.defines["EPS"] == "1e-06f"
    assert wa.spec_dict() != wb.spec_dict()
    assert list(a.signature) == ["X", "W", "B", "rows", "Y"]
    s = launch.kernel_config("SkipLayerNorm", "bfloat16", {}, {"hidden": 33})
    assert list(s.signature) == ["X", "SKIP", "W", "B", "rows", "Y", "S"]
    assert s.pointer_align == 2 and a.pointer_align == 16
    with pytest.raises(ValueError):
        launch.kernel_config("LayerNorm", "float16", {}, {"hidden": 16385})


def _torch_cpu(a):
    import torch

    if a.dtype == np_dtype("bfloat16"):
        return torch.from_numpy(a.view(np.uint16).astype(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def _to_np(t, dtype):
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16).view(np_dtype("bfloat16"))
    return t.numpy()


def _torch_baseline(torch, op, tins, eps):
    F = torch.nn.functional
    h = tins[0].shape[-1]
    if op == "LayerNorm":
        x, g, b = tins
        return [F.layer_norm(x, (h,), g, b, eps)]
    x, k, g, b = tins
    s = x + k
    return [F.layer_norm(s, (h,), g, b, eps), s]


@pytest.mark.parametrize(
    "op,dtype,hidden,scale",
    [(op, dt, h, 1.0) for op in OPS for dt in ("float32", "float16") for h in (33, 771)]
    + [("LayerNorm", "float16", 1024, 6e4), ("SkipLayerNorm", "float16", 1000, 6e4), ("LayerNorm", "bfloat16", 96, 1.0)],
)
def test_triton_interpreter(op, dtype, hidden, scale):
    """The Triton kernel under TRITON_INTERPRET=1 with the AOT launch's grid and argument order."""
    torch = pytest.importorskip("torch")
    from optfuse.kernels.testing import run_interpreted

    seed = _seed()
    rng = np.random.default_rng(seed)
    rows = int(rng.integers(1, 10))
    ins = make_inputs(op, dtype, rows, hidden, rng, magnitude=scale if scale > 1 else None)
    attrs = {"epsilon": 1e-5}
    cfg = launch.triton_config(dtype, hidden, op)  # (the default at some widths is the CUDA kernel)
    src = launch.kernel_config(op, dtype, attrs, {"hidden": hidden}, config=cfg)
    params = launch.launch_params(op, [a.shape for a in ins], [dtype], attrs, config=cfg)
    outs = [np.full((rows, hidden), np.nan, dtype=ins[0].dtype) for _ in launch._OUTPUTS[op]]
    run_interpreted(src, params, ins, outs)
    tins = [_torch_cpu(a) for a in ins]
    _compare(torch, op, dtype, ins, outs, attrs, _torch_baseline(torch, op, tins, 1e-5), f"interp seed={seed}", interp=True)


def _bf16_rtz(a):
    """float64 -> bfloat16 by truncation, the rounding of Triton's interpreter."""
    bits = np.asarray(a, np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
    return bits.view(np.float32)


def _compare(torch, op, dtype, ins, outs, attrs, base_outs, what, interp=False):
    eps = float(attrs["epsilon"])
    if op == "LayerNorm":
        ref64 = [reference.layer_norm64(ins[0], ins[1], ins[2], eps)]
    else:
        s = reference.reference(op, ins, attrs)[1]
        ref64 = [reference.layer_norm64(s, ins[2], ins[3], eps), s]
    base = [_to_np(t.cpu(), dtype) for t in base_outs]
    base_err = max_abs_err(base[0], ref64[0])
    if interp and dtype == "bfloat16":  # the interpreter rounds fp32 -> bf16 toward zero
        base_err = max(base_err, max_abs_err(_bf16_rtz(ref64[0]), ref64[0]))
    check_error(outs[0], ref64[0], base_err, dtype, f"{op} {dtype} y ({what})")
    if op == "SkipLayerNorm":
        check_ulps(outs[1], ref64[1], dtype, 1.0, f"{op} {dtype} sum ({what})")


@pytest.mark.parametrize("arch", [80, 86, 89, 90])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_aot_compile(op, dtype, arch, tmp_path):
    if arch in (86, 89) and dtype != "float16":
        pytest.skip("sm_86/sm_89 checked with fp16 only")
    src = launch.kernel_config(op, dtype, {}, {"hidden": 771 if dtype == "float32" else 4096})
    # compiled in a child process: interpreter tests (ours or another plugin's) may have run here
    (art,) = KernelCache(tmp_path).build_many([src], arch, isolate=True)
    assert art.cubin and art.cubin[:4] == b"\x7fELF"
    assert f".entry {art.name}(" in art.ptx and art.name == src.entry
    assert art.n_scratch == 2  # Triton >= 3.3 appends global + profile scratch pointers
    assert art.threads == src.num_warps * 32 and art.arch == arch
    assert ".version 8.7" in art.ptx  # loadable by drivers >= CUDA 12.8


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("dtype,hidden", [("float16", 768), ("bfloat16", 1000), ("float32", 96)])
@pytest.mark.parametrize("op", OPS)
def test_aot_compile_warp_kernel(op, dtype, hidden, arch, tmp_path):
    """The CUDA warp-per-row kernel (kernel_warp.cu) for full and partly filled lane groups."""
    cfg = launch.warp_config(dtype, hidden)
    src = launch.kernel_config(op, dtype, {}, {"hidden": hidden}, config=cfg)
    assert src.lang == "cuda" and src.entry == launch._WARP_ENTRY[op]
    (art,) = KernelCache(tmp_path).build_many([src], arch, isolate=True)
    assert art.cubin[:4] == b"\x7fELF" and f".entry {src.entry}(" in art.ptx
    assert art.n_scratch == 0 and art.threads == 32 * cfg.rpb and art.arch == arch


def test_warp_kernel_limits():
    assert launch.warp_config("float16", 768) == launch.LNWarpConfig(3, 2)
    assert launch.choose_config("float16", 768, "SkipLayerNorm") == launch.LNWarpConfig(3, 2)
    assert launch.choose_config("bfloat16", 1024, "LayerNorm") == launch.LNWarpConfig(4, 2)
    assert isinstance(launch.choose_config("bfloat16", 1024, "SkipLayerNorm"), launch.LNConfig)
    assert isinstance(launch.choose_config("float16", 4096, "LayerNorm"), launch.LNConfig)
    assert launch.warp_config("bfloat16", 1000).vpt == 4  # 125 accesses: the last lane group partly filled
    for dtype, hidden in (("float16", 771), ("float16", 1032), ("float32", 768)):
        assert not launch.warp_kernel_fits(dtype, hidden)
        with pytest.raises(ValueError, match="16-byte accesses"):
            launch.warp_config(dtype, hidden)
    with pytest.raises(ValueError, match="does not cover"):
        launch.kernel_config("LayerNorm", "float16", {}, {"hidden": 768}, config=launch.LNWarpConfig(4, 2))
    shapes = [[SymDim("B"), SymDim("S"), 768]]
    p = launch.launch_params("LayerNorm", shapes, ["float16"], {}, cdiv=sym_cdiv, static_shape={"hidden": 768},
                             config=launch.LNWarpConfig(3, 4))
    assert repr(p.grid[0]) == "cdiv((B*S),4)" and p.block == (128, 1, 1) and p.shared_mem == 0
    assert repr(p.extra_args[0]) == "(B*S)"


def test_cache_roundtrip(tmp_path, monkeypatch):
    cache = KernelCache(tmp_path)
    src = launch.kernel_config("LayerNorm", "float16", {}, {"hidden": 768}, config=launch.triton_config("float16", 768))
    (art,) = cache.build_many([src], "sm_90", isolate=True)
    assert art.key and (tmp_path / "sm_90").is_dir()
    # a fresh cache object finds it on disk without compiling
    import optfuse.kernels.cache as cache_mod

    monkeypatch.setattr(cache_mod, "compile_source", lambda *a: (_ for _ in ()).throw(AssertionError("recompiled")))
    again = KernelCache(tmp_path).build(src, 90)
    assert again.cubin == art.cubin and again.ptx == art.ptx and again.n_scratch == 2
    assert KernelCache(tmp_path).get(src, 80) is None
    assert [m["name"] for _, m in KernelCache(tmp_path).entries()] == ["layer_norm_fwd"]


# ---------------------------------------------------------------------------------------- GPU
GPU_HIDDEN = (32, 33, 768, 771, 1024, 5000, 8192, 16384)
GPU_CASES = [(op, dt, h) for op in OPS for dt in DTYPES for h in GPU_HIDDEN]


@pytest.fixture(scope="module")
def gpu_artifacts(cuda_torch):
    """Compile every GPU case up front (in parallel) with this machine's Triton."""
    srcs = {(op, dt, h): launch.kernel_config(op, dt, {"epsilon": 1e-5}, {"hidden": h}) for op, dt, h in GPU_CASES}
    for op in OPS:  # the overflow case: the Triton kernel (4096) and the CUDA warp kernel (768)
        for h in (4096, 768):
            srcs[(op, "float16", h, 1e-6)] = launch.kernel_config(op, "float16", {"epsilon": 1e-6}, {"hidden": h})
    arts = KernelCache().build_many(list(srcs.values()))
    return dict(zip(srcs, arts))


def _gpu_case(torch, art, op, dtype, rows, hidden, eps, rng, scale=1.0, prefer=None, what="", config=None):
    ins = make_inputs(op, dtype, rows, hidden, rng, magnitude=scale if scale > 1 else None)
    attrs = {"epsilon": eps}
    params = launch.launch_params(op, [a.shape for a in ins], [dtype], attrs, config=config)
    outs = gpu_run(art, params, ins, [((rows, hidden), ins[0].dtype)] * len(launch._OUTPUTS[op]), prefer=prefer)
    tins = [_torch_cpu(a).cuda() for a in ins]
    _compare(torch, op, dtype, ins, outs, attrs, _torch_baseline(torch, op, tins, eps), what)


@pytest.mark.gpu
@pytest.mark.parametrize("op,dtype,hidden", GPU_CASES)
def test_gpu_matches_fp64(cuda_torch, gpu_artifacts, op, dtype, hidden):
    seed = _seed()
    rng = np.random.default_rng(seed)
    for rows in (1, int(rng.integers(2, 600))):
        _gpu_case(cuda_torch, gpu_artifacts[(op, dtype, hidden)], op, dtype, rows, hidden, 1e-5, rng, what=f"rows={rows} seed={seed}")


GPU_CANDIDATE_CASES = [(op, dt, h) for op in OPS for dt in DTYPES for h in (33, 96, 768, 771, 1000, 1024, 5000, 8192)]


@pytest.fixture(scope="module")
def gpu_candidate_artifacts(cuda_torch):
    return candidate_artifacts(launch, GPU_CANDIDATE_CASES, {"epsilon": 1e-5})


@pytest.mark.gpu
@pytest.mark.parametrize("op,dtype,hidden", GPU_CANDIDATE_CASES)
def test_gpu_candidate_configs(cuda_torch, gpu_candidate_artifacts, op, dtype, hidden):
    """Every config the benchmark sweep may pick as the default (launch.candidate_configs):
    1 row and a count that leaves the last program partly empty."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    for rows in (1, int(rng.integers(2, 300))):
        for cfg, art in gpu_candidate_artifacts[(op, dtype, hidden)]:
            _gpu_case(cuda_torch, art, op, dtype, rows, hidden, 1e-5, rng, config=cfg,
                      what=f"rows={rows} {cfg} seed={seed}")


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_gpu_fp16_overflow(cuda_torch, gpu_artifacts, op):
    """|x| up to 6e4 in fp16: sum(x^2) overflows fp16 by far; statistics in fp32 must not."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    _gpu_case(cuda_torch, gpu_artifacts[(op, "float16", 4096, 1e-6)], op, "float16", 300, 4096, 1e-6, rng, scale=6e4, what=f"seed={seed}")


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_gpu_fp16_overflow_warp_kernel(cuda_torch, gpu_artifacts, op):
    """The same overflow case through the CUDA warp-per-row kernel (hidden 768's default)."""
    assert isinstance(launch.choose_config("float16", 768, op), launch.LNWarpConfig)
    seed = _seed()
    rng = np.random.default_rng(seed)
    _gpu_case(cuda_torch, gpu_artifacts[(op, "float16", 768, 1e-6)], op, "float16", 300, 768, 1e-6, rng, scale=6e4,
              what=f"warp seed={seed}")


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [771, 768])  # the Triton kernel; the CUDA warp kernel (NVRTC's PTX)
@pytest.mark.parametrize("op", OPS)
def test_gpu_ptx_path(cuda_torch, gpu_artifacts, op, hidden):
    """The PTX of the same compile, JIT-compiled by the driver (what a QDP engine embeds), gives
    the same results."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    _gpu_case(cuda_torch, gpu_artifacts[(op, "float16", hidden)], op, "float16", 100, hidden, 1e-5, rng, prefer="ptx",
              what=f"ptx seed={seed}")


@pytest.mark.gpu
def test_gpu_prebuilt_artifacts(cuda_torch):
    """Artifacts compiled on a CPU-only machine (``$OPTFUSE_PREBUILT``: a cache root built by
    ``optfuse kernels build --target sm_90``) load and compute correctly here, cubin and PTX."""
    root = os.environ.get("OPTFUSE_PREBUILT")
    if not root:
        pytest.skip("OPTFUSE_PREBUILT not set")
    from optfuse.kernels.launcher import current_device_arch

    n = 0
    seed = _seed()
    rng = np.random.default_rng(seed)
    for path, meta in KernelCache(root).entries():
        md = meta["metadata"]
        if md.get("op") not in OPS or meta["arch"] != current_device_arch():
            continue
        from optfuse.kernels.artifact import KernelArtifact

        art = KernelArtifact.load(path)
        for prefer in ("cubin", "ptx"):
            _gpu_case(cuda_torch, art, md["op"], md["dtype"], 257, md["hidden"], md["epsilon"], rng, prefer=prefer,
                      what=f"prebuilt {md['compiler']} {prefer} seed={seed}")
        n += 1
    assert n > 0, f"no prebuilt LayerNorm artifacts for this GPU under {root}"
