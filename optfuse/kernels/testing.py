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
    onnxruntime (CPU)."""
    import onnx
    import onnxruntime as ort
    from onnx import helper

    names = list(function.input)
    node = helper.make_node(
        function.name, names, list(function.output), domain=function.domain,
        plugin_namespace="optfuse", plugin_version="1", **attrs,
    )
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
