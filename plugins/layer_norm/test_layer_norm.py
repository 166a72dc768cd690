"""LayerNorm / SkipLayerNorm: NumPy reference, ONNX function in onnxruntime, launch params,
Triton kernels under the interpreter and AOT for every target (CPU); the compiled artifacts
through the launcher against float64 (``-m gpu``)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from optfuse.kernels.util import as_float32
from optfuse.kernels import KernelCache
from optfuse.kernels.registry import plugin_module
from optfuse.kernels.testing import (
    SymDim, candidate_artifacts, check_e4m3, check_error, check_onnx_function, check_ulps, e4m3_round64, gpu_run,
    max_abs_err, np_dtype, sym_cdiv,
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
    # epsilon at float32, the value the ONNX attribute holds (optfuse.kernels.util.as_float32)
    assert a.constexprs["EPS"] == as_float32(1e-5) and b.constexprs["EPS"] == as_float32(1e-6)
    assert a.spec_dict() != b.spec_dict()
    # the CUDA warp kernel (the default at 768) specializes the same way, through -D
    wa = launch.kernel_config("LayerNorm", "float16", {"epsilon": 1e-5}, {"hidden": 768})
    wb = launch.kernel_config("LayerNorm", "float16", {"epsilon": 1e-6}, {"hidden": 768})
    assert wa.lang == "cuda" and wa.defines["EPS"] == "9.99999975e-06f" and wb.defines["EPS"] == "9.99999997e-07f"
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


# ------------------------------------------------------------------------------- FP8 output (CPU)
def _y_scale(ins, op, eps, headroom=0.5):
    """A y_scale mapping ``headroom`` x max |y| to 448: the largest outputs (above 448 / headroom)
    saturate."""
    s = reference.reference(op, ins, {"epsilon": eps})[1] if op == "SkipLayerNorm" else ins[0]
    amax = float(np.abs(reference.layer_norm64(s, ins[-2], ins[-1], eps)).max())
    return np.array([max(amax * headroom / 448.0, 1e-6)], np.float32)


def _y64(op, ins, eps):
    s = reference.reference(op, ins[:-1], {"epsilon": eps})[1] if op == "SkipLayerNorm" else ins[0]
    return reference.layer_norm64(s, ins[-3], ins[-2], eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_reference_fp8_output_against_fp64(op, dtype):
    """With y_scale, y = E4M3(norm / y_scale) of the float64 norm (round to nearest even, saturated
    at +-448; NaN stays NaN: a row holding a NaN is NaN); sum unchanged in x's dtype."""
    rng = np.random.default_rng(3)
    ins = make_inputs(op, dtype, 6, 300, rng)
    ys = _y_scale(ins, op, 1e-5)
    ins[0][5, 7] = np.nan
    outs = reference.reference(op, [*ins, ys], {"epsilon": 1e-5})
    assert outs[0].dtype.name == "float8_e4m3fn" and outs[0].shape == ins[0].shape
    want = e4m3_round64(_y64(op, [*ins, ys], 1e-5) / np.float64(ys[0]))
    got = outs[0].astype(np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(got[5]).all() and not np.isnan(got[:5]).any()
    np.testing.assert_array_equal(got[:5], want[:5])
    assert (np.abs(got[:5]) == 448).sum() > 0 and np.abs(got[:5]).max() == 448  # saturated, never beyond
    if op == "SkipLayerNorm":
        plain = reference.reference(op, ins, {"epsilon": 1e-5})
        np.testing.assert_array_equal(outs[1].astype(np.float64), plain[1].astype(np.float64))
        assert outs[1].dtype == ins[0].dtype


def test_fp8_saturation_and_rounding_edges():
    """Values at and beyond 448 saturate (464, the midpoint to the next binade, included), ties
    round to even, tiny values to the subnormals or zero."""
    from optfuse.functions import quantize_e4m3

    v = np.array([448.0, 449.0, 464.0, 1e6, -1e6, -480.0, 1.0625, 1.1875, 2.0**-10, 3 * 2.0**-11, np.nan])
    got = quantize_e4m3(v, np.array([1.0], np.float32)).astype(np.float64)
    np.testing.assert_array_equal(got[:-1], [448, 448, 448, 448, -448, -448, 1.0, 1.25, 0.0, 2.0**-9])
    assert np.isnan(got[-1])
    np.testing.assert_array_equal(got[:-1], e4m3_round64(v[:-1]))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("op", OPS)
def test_onnx_function_fp8_variant(op, dtype):
    """The ``fp8`` function variant (opset 19) in onnxruntime: the reference's E4M3 bits within one
    E4M3 ulp, on well under 1 % of the elements (onnxruntime's float32 statistics against float64
    move a rounding only next to a boundary), sum in x's dtype; below opset 19 it is refused.
    onnxruntime (CPU, no fp16 Add kernel) runs the body's fp16 Add in float32 and hands the
    following Cast to float32 the unrounded sum: for SkipLayerNorm at fp16 it normalizes x + skip
    unrounded (the sum output is rounded), so that is what it is compared with there; the kernels
    normalize the rounded sum, as the reference does."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    rng = np.random.default_rng(4)
    ins = make_inputs(op, dtype, 5, 771, rng)
    ins.append(_y_scale(ins, op, 1e-5))
    assert reference.function_overload(op, [f"i{k}" for k in range(len(ins))]) == "fp8"
    assert reference.function_overload(op, [f"i{k}" for k in range(len(ins) - 1)]) == ""
    fn = reference.onnx_function(op, opset=19, overload="fp8")
    names = list(fn.input)
    node = helper.make_node(op, names, list(fn.output), domain=fn.domain, plugin_namespace="optfuse",
                            plugin_version="1", epsilon=1e-5)
    node.overload = "fp8"
    vi = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape)) for n, a in zip(names, ins)]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT8E4M3FN, list(ins[0].shape))]
    if op == "SkipLayerNorm":
        outs.append(helper.make_tensor_value_info("sum", helper.np_dtype_to_tensor_dtype(ins[0].dtype), list(ins[0].shape)))
    model = helper.make_model(helper.make_graph([node], "g", vi, outs), functions=[fn],
                              opset_imports=[helper.make_opsetid("", 19), helper.make_opsetid("optfuse", 1)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, dict(zip(names, ins)))
    want = reference.reference(op, ins, {"epsilon": 1e-5})
    y = want[0]
    if op == "SkipLayerNorm" and dtype != "float32":  # onnxruntime normalizes the unrounded sum
        from optfuse.functions import quantize_e4m3

        s = ins[0].astype(np.float64) + ins[1].astype(np.float64)
        y = quantize_e4m3(reference.layer_norm64(s, ins[2], ins[3], 1e-5), ins[-1])
    check_e4m3(got[0], y, f"{op} {dtype} fp8 function")
    if op == "SkipLayerNorm":
        np.testing.assert_array_equal(got[1], want[1])
    with pytest.raises(ValueError, match="opset >= 19"):
        reference.onnx_function(op, opset=18, overload="fp8")


@pytest.mark.parametrize("op", OPS)
def test_fp8_kernel_config(op):
    """y_scale present (static_shape, as the TensorRT glue gives it): the FP8 entry of the kernel the
    op would use anyway, one input more, y as bytes; targets below sm_89 refused, naming the target."""
    n = len(launch._INPUTS[op])
    for hidden, lang in ((768, "cuda"), (4096, "triton")):
        plain = launch.kernel_config(op, "float16", {}, {"hidden": hidden})
        src = launch.kernel_config(op, "float16", {}, {"hidden": hidden, "y_scale": [1], "arch": 90})
        assert plain.lang == src.lang == lang and src.n_inputs == n + 1 == plain.n_inputs + 1
        assert src.name != plain.name and "float16_to_float8e4m3fn" in src.name
        assert src.entry == (launch._WARP_FP8_ENTRY if lang == "cuda" else launch._FP8_ENTRY)[op]
        if lang == "cuda":
            assert src.defines["OPTFUSE_FP8_OUT"] == "1" and "OPTFUSE_FP8_OUT" not in plain.defines
        else:
            assert src.signature["YS"] == "*fp32" and src.signature["Y"] == "*u8"
            assert list(src.signature).index("YS") == n and list(src.signature)[n + 1] == "rows"
    for arch in (80, 86):
        with pytest.raises(ValueError, match=f"sm_89 or later \\(target sm_{arch}\\)"):
            launch.kernel_config(op, "float16", {}, {"hidden": 768, "y_scale": [1], "arch": arch})
    assert launch.kernel_config(op, "bfloat16", {}, {"hidden": 768, "y_scale": [1], "arch": 89}).n_inputs == n + 1


@pytest.mark.parametrize("op,dtype,hidden", [(op, dt, h) for op in OPS for dt, h in (("float16", 771), ("float32", 33))])
def test_triton_interpreter_fp8(op, dtype, hidden):
    """The FP8 Triton kernel under TRITON_INTERPRET=1. The interpreter takes the fp8e4nv cast but
    rounds it its own way (Triton 3.x: a result rounding up into the next binade comes out half as
    large, ties go away from zero, NaN and values over 448 come out finite and wrong); the kernel's
    clamp keeps |y| <= 448, so the check is exact on every element whose E4M3 value is not a power
    of two, not saturated and not NaN, and the sum output is exact. The exact bits on the GPU:
    test_gpu_fp8_output."""
    pytest.importorskip("torch")
    from optfuse.kernels.testing import run_interpreted

    rng = np.random.default_rng(5)
    rows = 7
    ins = make_inputs(op, dtype, rows, hidden, rng)
    ins.append(_y_scale(ins, op, 1e-5))
    cfg = launch.triton_config(dtype, hidden, op)
    src = launch.kernel_config(op, dtype, {"epsilon": 1e-5}, {"hidden": hidden, "y_scale": [1]}, config=cfg)
    params = launch.launch_params(op, [a.shape for a in ins], [dtype], {}, config=cfg)
    outs = [np.full((rows, hidden), 0x7F, np.uint8)] + [np.full((rows, hidden), np.nan, ins[0].dtype)] * (op == "SkipLayerNorm")
    run_interpreted(src, params, ins, outs)
    want = reference.reference(op, ins, {"epsilon": 1e-5})
    w = want[0].astype(np.float64)
    m, e = np.frexp(np.abs(w))
    exact = ~((m == 0.5) | (np.abs(w) == 448) | np.isnan(w))
    assert exact.mean() > 0.8
    got = outs[0].view(want[0].dtype).astype(np.float64)
    check_e4m3(outs[0][exact], want[0][exact], f"interp {op} {dtype}", max_ulps=1, max_off_fraction=0.01)
    assert np.abs(got).max() <= 448
    if op == "SkipLayerNorm":
        np.testing.assert_array_equal(outs[1], want[1])


@pytest.mark.parametrize("arch", [89, 90])
@pytest.mark.parametrize("op", OPS)
def test_aot_compile_fp8(op, arch, tmp_path):
    """The FP8 variants compile for sm_89 / sm_90 (Triton at 4096 and 771 bf16, the CUDA warp
    kernel at 768 fp16 and 96 fp32) and convert with cvt.rn.satfinite.e4m3x2.f32 after an IEEE
    division."""
    cases = [("float16", 4096, None), ("bfloat16", 771, None), ("float16", 768, launch.warp_config("float16", 768)),
             ("float32", 96, launch.warp_config("float32", 96))]
    srcs = [launch.kernel_config(op, dt, {}, {"hidden": h, "y_scale": [1], "arch": arch}, config=c) for dt, h, c in cases]
    for src, art in zip(srcs, KernelCache(tmp_path).build_many(srcs, arch, isolate=True)):
        assert art.cubin[:4] == b"\x7fELF" and f".entry {src.entry}(" in art.ptx and art.arch == arch
        assert "cvt.rn.satfinite.e4m3x2.f32" in art.ptx and "div.rn.f32" in art.ptx


# ------------------------------------------------------------------------------- FP8 output (GPU)
GPU_FP8_CASES = [(op, dt, h) for op in OPS for dt in DTYPES for h in (33, 768, 771, 1000, 1024, 5000, 8192, 16384)]


@pytest.fixture(scope="module")
def gpu_fp8_artifacts(cuda_torch):
    from optfuse.kernels.launcher import current_device_arch

    arch = current_device_arch()
    if int(arch) < launch.FP8_MIN_ARCH:
        pytest.skip(f"FP8 output needs sm_{launch.FP8_MIN_ARCH}+ (this GPU: sm_{arch})")
    srcs = {c: launch.kernel_config(c[0], c[1], {"epsilon": 1e-5}, {"hidden": c[2], "y_scale": [1], "arch": arch})
            for c in GPU_FP8_CASES}
    return dict(zip(srcs, KernelCache().build_many(list(srcs.values()))))


@pytest.mark.gpu
@pytest.mark.parametrize("op,dtype,hidden", GPU_FP8_CASES)
def test_gpu_fp8_output(cuda_torch, gpu_fp8_artifacts, op, dtype, hidden):
    """The FP8 variant (every kernel class: the Triton tiles, the CUDA warp kernel at 768 / 1000 /
    1024) on random rows into NaN-poisoned outputs: y within one E4M3 ulp of E4M3(float64 norm /
    y_scale), at most 1 % of elements (or 2) off at all (the kernel's FP32 statistics differ from float64
    by a few FP32 ulps, which moves an E4M3 rounding only that close to a rounding boundary);
    saturated values (a y_scale putting the largest |y| at 2 x 448) exactly +-448; sum as before."""
    import ml_dtypes

    seed = _seed()
    rng = np.random.default_rng(seed)
    for rows in (1, int(rng.integers(2, 400))):
        ins = make_inputs(op, dtype, rows, hidden, rng)
        ins.append(_y_scale(ins, op, 1e-5))
        params = launch.launch_params(op, [a.shape for a in ins], [dtype], {"epsilon": 1e-5})
        like = [((rows, hidden), np.dtype(ml_dtypes.float8_e4m3fn))] + [((rows, hidden), ins[0].dtype)] * (op == "SkipLayerNorm")
        outs = gpu_run(gpu_fp8_artifacts[(op, dtype, hidden)], params, ins, like)
        want = e4m3_round64(_y64(op, ins, 1e-5) / np.float64(ins[-1][0]))
        what = f"{op} {dtype} h={hidden} rows={rows} seed={seed}"
        check_e4m3(outs[0], want, what, max_off_fraction=max(0.01, 2 / want.size))
        if rows > 1:
            assert (np.abs(want) == 448).any(), what
        if op == "SkipLayerNorm":
            check_ulps(outs[1], reference.reference(op, ins, {"epsilon": 1e-5})[1], dtype, 1.0, f"{what} sum")
