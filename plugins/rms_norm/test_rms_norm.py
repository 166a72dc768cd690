"""RMSNorm / SkipRMSNorm: NumPy reference, ONNX function in onnxruntime, launch params and
NVRTC AOT for every target (CPU); the compiled artifacts through the launcher against float64
(``-m gpu``)."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from optfuse.kernels import KernelCache
from optfuse.kernels.nvrtc import compile_cuda
from optfuse.kernels.registry import plugin_module
from optfuse.kernels.testing import (
    SymDim, candidate_artifacts, check_e4m3, check_error, check_onnx_function, check_ulps, e4m3_round64, gpu_run,
    max_abs_err, np_dtype, run_onnx_function, sym_cdiv,
)

launch = plugin_module("rms_norm", "launch")
reference = plugin_module("rms_norm", "reference")

OPS = ("RMSNorm", "SkipRMSNorm")
DTYPES = ("float32", "float16", "bfloat16")
N_OUT = {"RMSNorm": 1, "SkipRMSNorm": 2}


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def make_inputs(op, dtype, rows, hidden, rng, magnitude=None):
    """Random inputs; with ``magnitude``, x (and skip) uniform so that |x (+ skip)| <= magnitude."""
    dt = np_dtype(dtype)
    x = (rng.standard_normal((rows, hidden)) + 0.3).astype(dt)
    skip = rng.standard_normal((rows, hidden)).astype(dt)
    if magnitude:
        half = magnitude if op == "RMSNorm" else magnitude / 2
        x = rng.uniform(-half, half, (rows, hidden)).astype(dt)
        skip = rng.uniform(-half, half, (rows, hidden)).astype(dt)
    gamma = (1.0 + 0.5 * rng.standard_normal(hidden)).astype(dt)
    return [x, skip, gamma] if op == "SkipRMSNorm" else [x, gamma]


# ---------------------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("op", OPS)
def test_reference_formula(op):
    rng = np.random.default_rng(0)
    ins = make_inputs(op, "float32", 4, 37, rng)
    outs = reference.reference(op, ins, {"epsilon": 1e-3})
    x = ins[0].astype(np.float64) + (ins[1].astype(np.float64) if op == "SkipRMSNorm" else 0)
    want = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-3) * ins[-1].astype(np.float64)
    np.testing.assert_allclose(outs[0], want, rtol=1e-5, atol=1e-6)
    if op == "SkipRMSNorm":
        np.testing.assert_array_equal(outs[1], ins[0] + ins[1])


@pytest.mark.parametrize("opset", [14, 15, 17, 18])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("op", OPS)
def test_onnx_function_runs_in_onnxruntime(op, dtype, opset):
    rng = np.random.default_rng(2)
    check_onnx_function(reference, op, make_inputs(op, dtype, 5, 771, rng), dtype, opset)


def test_onnx_function_fp16_large_inputs():
    """The function computes in fp32: fp16 inputs near 6e4 give finite outputs in onnxruntime."""
    rng = np.random.default_rng(3)
    ins = make_inputs("RMSNorm", "float16", 3, 512, rng, magnitude=6e4)
    (y,) = run_onnx_function(reference.onnx_function("RMSNorm"), ins, {"epsilon": 1e-6})
    (w,) = reference.reference("RMSNorm", ins, {"epsilon": 1e-6})
    assert max_abs_err(y, w) <= 1e-2


@pytest.mark.parametrize("hidden", [33, 768, 8192])
@pytest.mark.parametrize("op", OPS)
def test_launch_params_symbolic(op, hidden):
    shapes = [[SymDim("B"), SymDim("S"), hidden]]
    p = launch.launch_params(op, shapes, ["bfloat16"], {}, cdiv=sym_cdiv, static_shape={"hidden": hidden})
    cfg = launch.choose_config("bfloat16", hidden)
    assert repr(p.grid[0]) == f"cdiv((B*S),{cfg.rpb})"
    assert repr(p.extra_args[0]) == "(B*S)"
    assert p.block == (cfg.threads, 1, 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [1, 2, 32, 33, 100, 768, 771, 1024, 4096, 5000, 8192, 16383, 16384])
def test_choose_config(dtype, hidden):
    c = launch.choose_config(dtype, hidden)
    item = {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]
    assert c.vec in (1, 16 // item) and hidden % c.vec == 0
    assert c.threads % 32 == 0 and c.threads <= 1024
    nv = hidden // c.vec
    vpt = -(-nv // c.tpr)
    assert vpt * c.tpr >= nv and vpt <= 16
    assert c.tpr <= 32 and (c.tpr & (c.tpr - 1)) == 0 or c.rpb == 1 and c.tpr % 32 == 0
    assert c.rows_per_block == c.rpb


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [1, 32, 33, 100, 768, 771, 1024, 2048, 4096, 5000, 8192, 16383, 16384])
@pytest.mark.parametrize("op", OPS)
def test_candidate_configs(op, dtype, hidden):
    """The default is one of the candidates (so the GPU candidate test covers it); all valid."""
    cands = launch.candidate_configs(dtype, hidden, op)
    assert cands[0] == launch.choose_config(dtype, hidden, op) and len(set(cands)) == len(cands)
    for c in cands:
        nv = hidden // c.vec
        assert hidden % c.vec == 0 and c.threads % 32 == 0 and c.threads <= 1024 and c.rows_per_block == c.rpb
        assert c.tpr <= 32 and (c.tpr & (c.tpr - 1)) == 0 or c.rpb == 1 and c.tpr % 32 == 0
        assert -(-nv // c.tpr) <= 16


def test_kernel_config_defines():
    src = launch.kernel_config("SkipRMSNorm", "bfloat16", {"epsilon": 1e-5}, {"hidden": 4096})
    assert src.defines["OPTFUSE_DTYPE"] == "2" and src.defines["HIDDEN"] == "4096"
    assert src.defines["EPS"] == "9.99999975e-06f" and src.pointer_align == 16  # 1e-5 at float32
    cfg = launch.choose_config("bfloat16", 4096, "SkipRMSNorm")
    assert src.defines["RPB"] == str(cfg.rpb) and src.defines["RELOAD"] == str(cfg.reload)
    assert src.name == f"rms_norm/SkipRMSNorm/bfloat16/h4096/eps1e-05/vec8_{cfg.tpr}threads_per_row_1rows"
    assert launch.kernel_config("RMSNorm", "float16", {}, {"hidden": 771}).pointer_align == 2


@pytest.mark.parametrize("arch", [80, 86, 89, 90])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_aot_compile(op, dtype, arch):
    if arch in (86, 89) and dtype != "float16":
        pytest.skip("sm_86/sm_89 checked with fp16 only")
    for hidden in (771, 4096) if arch in (80, 90) else (4096,):
        src = launch.kernel_config(op, dtype, {}, {"hidden": hidden})
        art = compile_cuda(src, arch)
        assert art.cubin and art.cubin[:4] == b"\x7fELF"
        assert re.search(rf"\.entry {art.name}\(", art.ptx) and art.name == src.entry
        assert f".target sm_{arch}" in art.ptx and art.n_scratch == 0 and art.threads == src.threads
        if hidden == 4096:  # 16-byte accesses: x (and skip) evict_last, gamma read-only, y (and sum)
            assert "ld.global.L1::evict_last.L2::cache_hint.v4" in art.ptx and "ld.global.nc.v4" in art.ptx
            assert re.search(r"st\.global(\.cs)?\.v4", art.ptx)


def test_nvrtc_needs_no_toolkit_headers(monkeypatch):
    """The kernel includes no CUDA header: it builds with the nvrtc wheel alone."""
    import optfuse.kernels.nvrtc as nv

    monkeypatch.setattr(nv, "cuda_include_dirs", lambda: ())
    art = nv.compile_cuda(launch.kernel_config("RMSNorm", "float16", {}, {"hidden": 768}), 90)
    assert art.cubin


# ---------------------------------------------------------------------------------------- GPU
GPU_HIDDEN = (1, 32, 33, 768, 771, 1024, 5000, 8192, 16383, 16384)
GPU_CASES = [(op, dt, h) for op in OPS for dt in DTYPES for h in GPU_HIDDEN]


@pytest.fixture(scope="module")
def gpu_artifacts(cuda_torch):
    srcs = {(op, dt, h): launch.kernel_config(op, dt, {"epsilon": 1e-6}, {"hidden": h}) for op, dt, h in GPU_CASES}
    for op in OPS:
        srcs[(op, "float16", 4096, 1e-5)] = launch.kernel_config(op, "float16", {"epsilon": 1e-5}, {"hidden": 4096})
    arts = KernelCache().build_many(list(srcs.values()))
    return dict(zip(srcs, arts))


def _torch(torch, a):
    if a.dtype == np_dtype("bfloat16"):
        return torch.from_numpy(a.view(np.uint16).astype(np.int16)).view(torch.bfloat16).cuda()
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def _np(t):
    import torch

    t = t.cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16).view(np_dtype("bfloat16"))
    return t.numpy()


def _gpu_case(torch, art, op, dtype, rows, hidden, eps, rng, magnitude=None, prefer=None, what="", config=None):
    _gpu_configs(torch, [(config, art)], op, dtype, rows, hidden, eps, rng, magnitude, prefer, what)


def _gpu_configs(torch, runs, op, dtype, rows, hidden, eps, rng, magnitude=None, prefer=None, what=""):
    """One random input set; each ``(config, artifact)`` of ``runs`` (config None: the default)
    launched on it into NaN-poisoned outputs and checked against float64."""
    ins = make_inputs(op, dtype, rows, hidden, rng, magnitude)
    attrs = {"epsilon": eps}
    ref = reference.reference(op, ins, attrs)
    x = ref[1] if op == "SkipRMSNorm" else ins[0]
    ref64 = reference.rms_norm64(x, ins[-1], eps)
    tx = _torch(torch, x)
    base = _np(torch.nn.functional.rms_norm(tx, (hidden,), _torch(torch, ins[-1]), eps))
    base_err = max_abs_err(base, ref64)
    for cfg, art in runs:
        params = launch.launch_params(op, [a.shape for a in ins], [dtype], attrs, config=cfg)
        outs = gpu_run(art, params, ins, [((rows, hidden), ins[0].dtype)] * N_OUT[op], prefer=prefer)
        tag = f"{op} {dtype} h={hidden} rows={rows} {cfg or 'default'}"
        check_error(outs[0], ref64, base_err, dtype, f"{tag} y ({what})")
        if op == "SkipRMSNorm":
            check_ulps(outs[1], ref[1], dtype, 1.0, f"{tag} sum ({what})")


@pytest.mark.gpu
@pytest.mark.parametrize("op,dtype,hidden", GPU_CASES)
def test_gpu_matches_fp64(cuda_torch, gpu_artifacts, op, dtype, hidden):
    seed = _seed()
    rng = np.random.default_rng(seed)
    for rows in (1, int(rng.integers(2, 700))):
        _gpu_case(cuda_torch, gpu_artifacts[(op, dtype, hidden)], op, dtype, rows, hidden, 1e-6, rng, what=f"rows={rows} seed={seed}")


@pytest.fixture(scope="module")
def gpu_candidate_artifacts(cuda_torch):
    return candidate_artifacts(launch, GPU_CASES, {"epsilon": 1e-6})


@pytest.mark.gpu
@pytest.mark.parametrize("op,dtype,hidden", GPU_CASES)
def test_gpu_candidate_configs(cuda_torch, gpu_candidate_artifacts, op, dtype, hidden):
    """Every config the benchmark sweep may pick as the default (launch.candidate_configs)."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    for rows in (1, int(rng.integers(2, 300))):
        _gpu_configs(cuda_torch, gpu_candidate_artifacts[(op, dtype, hidden)], op, dtype, rows, hidden, 1e-6, rng,
                     what=f"seed={seed}")


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_gpu_fp16_overflow(cuda_torch, gpu_artifacts, op):
    """|x| up to 6e4 in fp16: sum(x^2) overflows fp16 by far; statistics in fp32 must not."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    _gpu_case(cuda_torch, gpu_artifacts[(op, "float16", 4096, 1e-5)], op, "float16", 300, 4096, 1e-5, rng, magnitude=6e4, what=f"seed={seed}")


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_gpu_ptx_path(cuda_torch, gpu_artifacts, op):
    seed = _seed()
    rng = np.random.default_rng(seed)
    for hidden in (771, 8192):
        _gpu_case(cuda_torch, gpu_artifacts[(op, "bfloat16", hidden)], op, "bfloat16", 99, hidden, 1e-6, rng, prefer="ptx", what=f"ptx seed={seed}")


@pytest.mark.gpu
def test_gpu_misaligned_pointer_rejected(cuda_torch, gpu_artifacts):
    from optfuse.kernels import device
    from optfuse.kernels.launcher import launch as do_launch

    art = gpu_artifacts[("RMSNorm", "float16", 768)]
    buf = device.empty((4 * 768 + 8,), np.float16)
    try:
        params = launch.launch_params("RMSNorm", [(4, 768)], ["float16"], {})
        with pytest.raises(ValueError, match="aligned"):
            do_launch(art, params, [buf.ptr + 2, buf.ptr], [buf.ptr], 0)
    finally:
        buf.free()


@pytest.mark.gpu
def test_gpu_prebuilt_artifacts(cuda_torch):
    """Artifacts compiled on a CPU-only machine (``$OPTFUSE_PREBUILT``) run here, cubin and PTX."""
    root = os.environ.get("OPTFUSE_PREBUILT")
    if not root:
        pytest.skip("OPTFUSE_PREBUILT not set")
    from optfuse.kernels.artifact import KernelArtifact
    from optfuse.kernels.launcher import current_device_arch

    n = 0
    seed = _seed()
    rng = np.random.default_rng(seed)
    for path, meta in KernelCache(root).entries():
        md = meta["metadata"]
        if md.get("op") not in OPS or meta["arch"] != current_device_arch():
            continue
        art = KernelArtifact.load(path)
        cfg = launch.RMSConfig(**md["config"])  # the layout it was built with
        for prefer in ("cubin", "ptx"):
            _gpu_case(cuda_torch, art, md["op"], md["dtype"], 257, md["hidden"], md["epsilon"], rng, prefer=prefer,
                      what=f"prebuilt {md['compiler']} {prefer} seed={seed}", config=cfg)
        n += 1
    assert n > 0


# ------------------------------------------------------------------------------- FP8 output (CPU)
def _y64(op, ins, eps):
    """The float64 RMSNorm of ``ins`` (x, [skip], gamma[, y_scale]) as the reference forms it."""
    operands = ins[:N_OUT[op] + 1]
    s = reference.reference(op, operands, {"epsilon": eps})[1] if op == "SkipRMSNorm" else ins[0]
    return reference.rms_norm64(s, operands[-1], eps)


def _y_scale(ins, op, eps, headroom=0.5):
    """A y_scale mapping ``headroom`` x max |y| to 448: the largest outputs saturate."""
    amax = float(np.abs(_y64(op, ins, eps)).max())
    return np.array([max(amax * headroom / 448.0, 1e-6)], np.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_reference_fp8_output_against_fp64(op, dtype):
    """With y_scale, y = E4M3(norm / y_scale) of the float64 norm (round to nearest even, saturated
    at +-448; a row holding a NaN is NaN); sum unchanged in x's dtype."""
    rng = np.random.default_rng(3)
    ins = make_inputs(op, dtype, 6, 300, rng)
    ys = _y_scale(ins, op, 1e-6)
    ins[0][5, 7] = np.nan
    outs = reference.reference(op, [*ins, ys], {"epsilon": 1e-6})
    assert outs[0].dtype.name == "float8_e4m3fn"
    got, want = outs[0].astype(np.float64), e4m3_round64(_y64(op, ins, 1e-6) / np.float64(ys[0]))
    assert np.isnan(got[5]).all() and not np.isnan(got[:5]).any()
    np.testing.assert_array_equal(got[:5], want[:5])
    assert np.abs(got[:5]).max() == 448
    if op == "SkipRMSNorm":
        np.testing.assert_array_equal(outs[1].astype(np.float64), reference.reference(op, ins, {})[1].astype(np.float64))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("op", OPS)
def test_onnx_function_fp8_variant(op, dtype):
    """The ``fp8`` variant (opset 19) in onnxruntime within one E4M3 ulp of the reference on under
    1 % of the elements (float32 against float64 statistics); SkipRMSNorm at fp16: onnxruntime runs
    the fp16 Add in float32 and normalizes the unrounded sum (see the LayerNorm test), compared with
    that. Refused below opset 19."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from optfuse.functions import quantize_e4m3

    rng = np.random.default_rng(4)
    ins = make_inputs(op, dtype, 5, 771, rng)
    ins.append(_y_scale(ins, op, 1e-6))
    assert reference.function_overload(op, [f"i{k}" for k in range(len(ins))]) == "fp8"
    fn = reference.onnx_function(op, opset=19, overload="fp8")
    names = list(fn.input)
    node = helper.make_node(op, names, list(fn.output), domain=fn.domain, plugin_namespace="optfuse",
                            plugin_version="1", epsilon=1e-6)
    node.overload = "fp8"
    vi = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape)) for n, a in zip(names, ins)]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT8E4M3FN, list(ins[0].shape))]
    if op == "SkipRMSNorm":
        outs.append(helper.make_tensor_value_info("sum", helper.np_dtype_to_tensor_dtype(ins[0].dtype), list(ins[0].shape)))
    model = helper.make_model(helper.make_graph([node], "g", vi, outs), functions=[fn],
                              opset_imports=[helper.make_opsetid("", 19), helper.make_opsetid("optfuse", 1)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, dict(zip(names, ins)))
    want = reference.reference(op, ins, {"epsilon": 1e-6})
    y = want[0]
    if op == "SkipRMSNorm" and dtype != "float32":
        y = quantize_e4m3(reference.rms_norm64(ins[0].astype(np.float64) + ins[1].astype(np.float64), ins[2], 1e-6), ins[-1])
    check_e4m3(got[0], y, f"{op} {dtype} fp8 function")
    if op == "SkipRMSNorm":
        np.testing.assert_array_equal(got[1], want[1])
    with pytest.raises(ValueError, match="opset >= 19"):
        reference.onnx_function(op, opset=18, overload="fp8")


@pytest.mark.parametrize("op", OPS)
def test_fp8_kernel_config(op):
    """y_scale present: the FP8 entry of the same layout, one input more; below sm_89 refused."""
    n = launch._N_IO[op][0]
    for hidden in (33, 768, 8192):
        plain = launch.kernel_config(op, "float16", {}, {"hidden": hidden})
        src = launch.kernel_config(op, "float16", {}, {"hidden": hidden, "y_scale": [1], "arch": 90})
        assert src.n_inputs == n + 1 == plain.n_inputs + 1 and src.entry == launch._FP8_ENTRY[op]
        assert src.defines == {**plain.defines, "OPTFUSE_FP8_OUT": "1"} and src.name != plain.name
    with pytest.raises(ValueError, match=r"sm_89 or later \(target sm_80\)"):
        launch.kernel_config(op, "float16", {}, {"hidden": 768, "y_scale": [1], "arch": 80})


@pytest.mark.parametrize("arch", [89, 90])
@pytest.mark.parametrize("op", OPS)
def test_aot_compile_fp8(op, arch):
    """The FP8 variant compiles (NVRTC) for sm_89 / sm_90 at every access width (16-byte fp16 /
    fp32 accesses, scalar bf16 at 771) and every layout (sub-warp, warp, block per row, RELOAD), and
    converts with cvt.rn.satfinite.e4m3x2.f32 after an IEEE division."""
    for dtype, hidden in (("float16", 33), ("float16", 768), ("float32", 96), ("bfloat16", 771), ("float16", 8192)):
        src = launch.kernel_config(op, dtype, {}, {"hidden": hidden, "y_scale": [1], "arch": arch})
        art = compile_cuda(src, arch)
        assert art.cubin[:4] == b"\x7fELF" and re.search(rf"\.entry {src.entry}\(", art.ptx)
        assert "cvt.rn.satfinite.e4m3x2.f32" in art.ptx and "div.rn.f32" in art.ptx


# ------------------------------------------------------------------------------- FP8 output (GPU)
GPU_FP8_CASES = [(op, dt, h) for op in OPS for dt in DTYPES for h in (1, 33, 768, 771, 1024, 5000, 8192, 16384)]


@pytest.fixture(scope="module")
def gpu_fp8_artifacts(cuda_torch):
    from optfuse.kernels.launcher import current_device_arch

    arch = current_device_arch()
    if int(arch) < launch.FP8_MIN_ARCH:
        pytest.skip(f"FP8 output needs sm_{launch.FP8_MIN_ARCH}+ (this GPU: sm_{arch})")
    srcs = {c: launch.kernel_config(c[0], c[1], {"epsilon": 1e-6}, {"hidden": c[2], "y_scale": [1], "arch": arch})
            for c in GPU_FP8_CASES}
    return dict(zip(srcs, KernelCache().build_many(list(srcs.values()))))


@pytest.mark.gpu
@pytest.mark.parametrize("op,dtype,hidden", GPU_FP8_CASES)
def test_gpu_fp8_output(cuda_torch, gpu_fp8_artifacts, op, dtype, hidden):
    """The FP8 variant (every layout class) on random rows into NaN-poisoned outputs: y within one
    E4M3 ulp of E4M3(float64 norm / y_scale), at most 1 % (or 2 elements) off at all (FP32 statistics against
    float64 move a rounding only next to a boundary); saturated values exactly +-448; sum as before."""
    import ml_dtypes

    seed = _seed()
    rng = np.random.default_rng(seed)
    for rows in (1, int(rng.integers(2, 400))):
        ins = make_inputs(op, dtype, rows, hidden, rng)
        ins.append(_y_scale(ins, op, 1e-6))
        params = launch.launch_params(op, [a.shape for a in ins], [dtype], {"epsilon": 1e-6})
        like = [((rows, hidden), np.dtype(ml_dtypes.float8_e4m3fn))] + [((rows, hidden), ins[0].dtype)] * (op == "SkipRMSNorm")
        outs = gpu_run(gpu_fp8_artifacts[(op, dtype, hidden)], params, ins, like)
        want = e4m3_round64(_y64(op, ins, 1e-6) / np.float64(ins[-1][0]))
        what = f"{op} {dtype} h={hidden} rows={rows} seed={seed}"
        check_e4m3(outs[0], want, what, max_off_fraction=max(0.01, 2 / want.size))
        if rows > 1 and hidden > 1:
            assert (np.abs(want) == 448).any(), what
        if op == "SkipRMSNorm":
            check_ulps(outs[1], reference.reference(op, ins[:-1], {"epsilon": 1e-6})[1], dtype, 1.0, f"{what} sum")
