"""Helpers for kernel tests (NumPy + onnx/onnxruntime only; torch stays in the tests).

The accuracy rule of optfuse kernels: the error of a kernel against a float64 reference is at
most twice the error of the framework's own implementation at the same precision, plus a small
absolute tolerance (:data:`ATOL`); NaN never passes.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

#: Small absolute tolerance per I/O dtype (about one unit in the last place at 1.0).
ATOL = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 8e-3}
EPS = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}


def np_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def max_abs_err(out: Any, ref: Any) -> float:
    """max |out - ref| in float64; inf when ``out`` holds NaN/inf where ``ref`` is finite."""
    a = np.asarray(out).astype(np.float64)
    b = np.asarray(ref).astype(np.float64)
    if a.shape != b.shape:
        raise AssertionError(f"shape {a.shape} != reference shape {b.shape}")
    if not np.isfinite(a).all():
        return float("inf")
    return float(np.abs(a - b).max()) if a.size else 0.0


def check_error(out: Any, ref64: Any, baseline_err: float, dtype: str, what: str = "") -> float:
    """Assert ``max|out - ref64| <= 2 * baseline_err + ATOL[dtype]``; return the error."""
    err = max_abs_err(out, ref64)
    base = baseline_err if np.isfinite(baseline_err) else 0.0
    tol = 2.0 * base + ATOL[dtype]
    if not err <= tol:
        n_bad = int((~np.isfinite(np.asarray(out).astype(np.float64))).sum())
        raise AssertionError(
            f"{what}: max abs error {err:.3g} > tolerance {tol:.3g} (2 x framework error {baseline_err:.3g} + "
            f"atol {ATOL[dtype]:g}); non-finite outputs: {n_bad}"
        )
    return err


def check_ulps(out: Any, ref: Any, dtype: str, ulps: float = 1.0, what: str = "") -> None:
    """Assert every element is within ``ulps`` units in the last place of ``ref`` (relative)."""
    a = np.asarray(out).astype(np.float64)
    b = np.asarray(ref).astype(np.float64)
    bad = ~(np.abs(a - b) <= ulps * EPS[dtype] * np.abs(b) + 1e-30) | ~np.isfinite(a)
    if bad.any():
        i = np.argwhere(bad)[0]
        raise AssertionError(f"{what}: {int(bad.sum())} elements off by more than {ulps} ulp, e.g. at {tuple(i)}: {a[tuple(i)]} vs {b[tuple(i)]}")


def run_onnx_function(function, inputs: Sequence[np.ndarray], attrs: dict, opset: int = 17) -> list[np.ndarray]:
    """Run a one-node model whose node is ``function`` (carried in ``model.functions``) in
    onnxruntime (CPU); ``inputs`` and ``attrs`` are the node's (plugin namespace / version from the
    function's defaults unless ``attrs`` sets them)."""
    import onnx
    import onnxruntime as ort
    from onnx import helper

    names = list(function.input)[:len(inputs)]  # trailing optional inputs (a norm's y_scale) left out
    # what a fused node carries: the plugin namespace / version the function declares (its spec's)
    plugin = {a.name: a.s.decode() for a in function.attribute_proto if a.name in ("plugin_namespace", "plugin_version")}
    node = helper.make_node(function.name, names, list(function.output), domain=function.domain, **{**plugin, **attrs})
    def vi(name, arr):
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(arr.dtype), list(arr.shape))

    outs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(inputs[0].dtype), list(inputs[0].shape)) for n in function.output]
    graph = helper.make_graph([node], "g", [vi(n, a) for n, a in zip(names, inputs)], outs)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(function.domain, 1)], functions=[function]
    )
    model.ir_version = min(model.ir_version, 10)
    onnx.checker.check_model(model, full_check=True)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, dict(zip(names, inputs)))


def gpu_run(artifact, params, inputs: Sequence[np.ndarray | None], out_like: Sequence[tuple], *, prefer: str | None = None) -> list[np.ndarray]:
    """Copy ``inputs`` to the GPU, launch ``artifact`` through :func:`optfuse.kernels.launcher.launch`
    into outputs poisoned with NaN (``out_like``: ``(shape, numpy dtype)`` each), return them."""
    from . import device
    from .launcher import launch

    bufs = []
    try:
        ins = [None if a is None else device.to_device(a) for a in inputs]
        bufs += [b for b in ins if b is not None]
        outs = []
        for shape, dt in out_like:
            outs.append(device.to_device(np.full(shape, np.nan, dtype=dt)))
        bufs += outs
        launch(artifact, params, ins, outs, 0, prefer=prefer, sync=True)
        return [device.to_host(o) for o in outs]
    finally:
        for b in bufs:
            b.free()


# -- Triton interpreter runs (CPU) ------------------------------------------------------------
# Triton's interpreter patches triton.language while it runs and does not fully restore it: a
# real compile in the same process afterwards fails. So interpreted runs happen in one spawned
# child process, kept for the session.
_interp_pool = None


def _interp_child(src, grid, extra, inputs, outputs):
    import os

    os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from .triton_aot import load_module

    def to_torch(a):
        if a is None:
            return None
        if a.dtype == np_dtype("bfloat16"):
            return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
        return torch.from_numpy(a.copy())

    def to_np(t, like):
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(like.dtype)
        return t.numpy()

    fn = getattr(load_module(src.path, interpret=True), src.entry)
    touts = [to_torch(o) for o in outputs]
    fn[grid](*[to_torch(a) for a in inputs], *extra, *touts, **src.constexprs, num_warps=src.num_warps)
    return [to_np(t, o) for t, o in zip(touts, outputs)]


def run_interpreted(src, params, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray]) -> None:
    """Run the Triton kernel ``src`` under ``TRITON_INTERPRET=1`` on the CPU with the AOT launch's
    grid and argument order; NumPy arrays in, ``outputs`` overwritten with the results."""
    import concurrent.futures as cf
    import multiprocessing

    global _interp_pool
    if _interp_pool is None:
        import atexit

        _interp_pool = cf.ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        # shut the child down before interpreter teardown (else a weakref callback fails at exit)
        atexit.register(_interp_pool.shutdown)
    grid = tuple(int(g) for g in params.grid)
    extra = [int(a) for a in params.extra_args]
    res = _interp_pool.submit(_interp_child, src, grid, extra, list(inputs), list(outputs)).result()
    for o, r in zip(outputs, res):
        o[...] = r


def check_onnx_function(reference, op: str, inputs, dtype: str, opset: int, attrs: dict | None = None) -> None:
    """A plugin's ONNX function (what onnxruntime runs in fused models) agrees with its NumPy
    reference: same outputs, same dtypes, within fp32 / fp16 rounding."""
    spec = reference.SPECS[op]  # the plugin's own specs (no import of optfuse.spec from the kernel layer)
    attrs = {"epsilon": 1e-4} if attrs is None else attrs  # not the default: the node's value must reach the body
    fn = reference.onnx_function(op, opset=opset, dtype=dtype)
    assert fn.domain == spec.domain and fn.name == op
    assert {a.name for a in fn.attribute_proto} >= {*spec.defaults(), "plugin_namespace", "plugin_version"}
    got = run_onnx_function(fn, inputs, attrs, opset=opset)
    want = reference.reference(op, inputs, attrs)
    assert len(got) == len(want)
    tol = {"float32": 1e-4, "float16": 1e-2}[dtype]
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        assert max_abs_err(g, w) <= tol


def candidate_artifacts(launch, cases, attrs: dict) -> dict:
    """``{(op, dtype, hidden): [(config, artifact), ...]}``: every config of ``launch.candidate_configs``
    (what a benchmark sweep may pick as the default) compiled for each norm-plugin case."""
    from .cache import KernelCache

    keys = [(op, dt, h, c) for op, dt, h in cases for c in launch.candidate_configs(dt, h, op)]
    srcs = [launch.kernel_config(op, dt, attrs, {"hidden": h}, config=c) for op, dt, h, c in keys]
    out: dict = {}
    for (op, dt, h, c), art in zip(keys, KernelCache().build_many(srcs)):
        out.setdefault((op, dt, h), []).append((c, art))
    return out


class SymDim:
    """A symbolic dimension for tests of ``launch_params``: it records the expression the launch
    code builds (``.e``, also its repr) and allows only what TensorRT QDP shape expressions have
    here, ``+ - *`` (and :func:`sym_cdiv`); anything else -- ``//``, ``/``, ``%``, ``int()``,
    truth values, comparisons -- fails the test."""

    def __init__(self, e: str):
        self.e = e

    @staticmethod
    def _s(o: Any) -> str:
        return o.e if isinstance(o, SymDim) else repr(o)

    def __add__(self, o):
        return SymDim(f"({self.e}+{SymDim._s(o)})")

    def __radd__(self, o):
        return SymDim(f"({SymDim._s(o)}+{self.e})")

    def __sub__(self, o):
        return SymDim(f"({self.e}-{SymDim._s(o)})")

    def __mul__(self, o):
        return SymDim(f"({self.e}*{SymDim._s(o)})")

    def __rmul__(self, o):
        return SymDim(f"({SymDim._s(o)}*{self.e})")

    def __repr__(self) -> str:
        return self.e


def _not_a_shape_expression(*_):
    raise AssertionError("launch_params used an operation TensorRT shape expressions do not have")


for _name in ("__floordiv__", "__rfloordiv__", "__truediv__", "__mod__", "__int__", "__index__", "__bool__",
              "__lt__", "__gt__", "__eq__"):
    setattr(SymDim, _name, _not_a_shape_expression)


def sym_cdiv(a: Any, b: Any) -> SymDim:
    """``cdiv`` for :class:`SymDim` (TensorRT's ``trtp.cdiv``)."""
    return SymDim(f"cdiv({SymDim._s(a)},{SymDim._s(b)})")


# -- Triton interpreter cases in one child process ----------------------------------------------
# TRITON_INTERPRET must be set before triton is imported, so an interpreter test module runs its
# cases as a script in a child started with it: `interpreter_results(__file__)` in the module's
# fixture, `run_interpreter_cases(CASES, run_case)` under its `if __name__ == "__main__":`.
def interpreter_results(test_file: str, timeout: float = 1200) -> dict[str, str]:
    """Run `test_file` as a script with TRITON_INTERPRET=1 (the project root on its path) and
    return its cases' results: name -> "ok" or the failure's traceback."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, TRITON_INTERPRET="1")
    root = str(Path(test_file).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, test_file], env=env, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"interpreter child failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])


def run_interpreter_cases(cases: dict[str, tuple], run_case) -> None:
    """The child's side: `run_case(*args)` for every case, then one JSON line of the results."""
    import json
    import os
    import traceback
    import warnings

    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    warnings.filterwarnings("ignore")
    out = {}
    for name, args in cases.items():
        try:
            run_case(*args)
            out[name] = "ok"
        except Exception:  # reported per case by the parent
            out[name] = traceback.format_exc(limit=3)[-2000:]
    print(json.dumps(out))


# -- E4M3 (float8e4m3fn) outputs --------------------------------------------------------------
def e4m3_grid() -> np.ndarray:
    """The 127 non-negative finite E4M3 values in bit order (bits 0x00..0x7e: 0x7f is NaN)."""
    b = np.arange(0x7F)
    exp, man = b >> 3, b & 7
    return np.where(exp == 0, man * 2.0**-9, (1 + man / 8.0) * 2.0 ** (exp - 7.0))


def e4m3_round64(v: Any) -> np.ndarray:
    """float64 values rounded to E4M3 directly (no float32 step): nearest, ties to the even bit
    pattern, saturated to +-448, NaN kept; as float64. Independent of ml_dtypes, for tests."""
    v = np.asarray(v, np.float64)
    grid = e4m3_grid()
    a = np.minimum(np.abs(v), grid[-1])
    hi = np.clip(np.searchsorted(grid, np.nan_to_num(a), side="left"), 0, len(grid) - 1)
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = np.abs(a - grid[lo]), np.abs(grid[hi] - a)
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    return np.where(np.isnan(v), np.nan, np.copysign(grid[pick], v))


def e4m3_ordinal(bits: Any) -> np.ndarray:
    """E4M3 bit patterns (uint8 or ml_dtypes float8_e4m3fn) as integers in value order (+0 and -0
    both 0): neighbouring values differ by one."""
    b = np.ascontiguousarray(bits).view(np.uint8).astype(np.int16)
    return np.where(b & 0x80, -(b & 0x7F), b & 0x7F)


def check_e4m3(out: Any, ref: Any, what: str = "", max_ulps: int = 1, max_off_fraction: float = 0.01) -> None:
    """``out`` (E4M3 bits) against ``ref`` (E4M3 values): NaN exactly where ``ref`` is NaN, every
    other element within ``max_ulps`` E4M3 units in the last place, at most ``max_off_fraction`` of
    them off at all, and every saturated reference value (+-448) exact."""
    import ml_dtypes

    got = np.ascontiguousarray(out).view(np.uint8)
    want = np.asarray(ref).astype(ml_dtypes.float8_e4m3fn)
    gnan, wnan = np.isnan(got.view(ml_dtypes.float8_e4m3fn).astype(np.float32)), np.isnan(want.astype(np.float32))
    if (gnan != wnan).any():
        raise AssertionError(f"{what}: {int((gnan & ~wnan).sum())} NaN outputs where the reference is finite, "
                             f"{int((~gnan & wnan).sum())} finite where it is NaN")
    diff = np.abs(e4m3_ordinal(got) - e4m3_ordinal(want))[~wnan]
    off = float((diff > 0).mean()) if diff.size else 0.0
    sat = (np.abs(want.astype(np.float32)) == 448.0) & ~wnan
    if diff.size and (diff.max() > max_ulps or off > max_off_fraction):
        raise AssertionError(f"{what}: E4M3 outputs up to {int(diff.max())} ulp off (max {max_ulps}), "
                             f"{off:.2%} off at all (max {max_off_fraction:.2%})")
    if (got[sat] != want.view(np.uint8)[sat]).any():
        raise AssertionError(f"{what}: saturated (+-448) outputs differ")


def cuobjdump() -> str | None:
    """The cuobjdump on PATH, else the one Triton ships, else None (no CUDA tools here)."""
    import shutil
    from pathlib import Path

    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton
    except ImportError:
        return None
    p = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(p) if p.exists() else None


def cubin_usage(tool: str, art, tmp_dir) -> tuple[str, str]:
    """cuobjdump's resource usage (``REG:.. STACK:.. LOCAL:..``) and SASS of an artifact's cubin."""
    import subprocess
    from pathlib import Path

    cubin = Path(tmp_dir) / f"{art.name.replace('/', '_')}.cubin"
    cubin.write_bytes(art.cubin)
    res = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    return res, sass
