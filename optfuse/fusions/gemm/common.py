"""What every GEMM rule shares: the spec facts (dtypes, K/N limits, activation choices), the weight
and bias as the ops take them ([N, K] and [N] constants of A's dtype), and the rejection helper."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from ...ir.weights import DerivedValues
from ...ir.query import const_value, dtype_name, node_attr, rank
from ...spec import get_spec, plugin_module

EPILOGUE = "GemmEpilogue"
GATED = "GatedGemm"


class Reject(Exception):
    """A check's reason not to fuse (the rule's check returns it as a string)."""


def need(cond: bool, reason: str) -> None:
    if not cond:
        raise Reject(reason)


def choices(op: str, attr: str) -> tuple[str, ...]:
    return get_spec(op).attr(attr).choices


def np_dtype(dt: str):
    if dt == "bfloat16":
        import ml_dtypes  # onnx depends on it

        return ml_dtypes.bfloat16
    return np.dtype(dt)


@dataclass(frozen=True)
class Weight:
    """A GEMM's constant weight as the ops take it: ``w`` [N, K] in A's dtype, alpha, and the bias
    a Gemm's C gives (beta folded in; None when it has no C)."""

    w: np.ndarray | DerivedValues  # computed on export when its source is a weight on disk
    alpha: float
    gemm_bias: np.ndarray | None

    @property
    def n(self) -> int:
        return int(self.w.shape[0])

    @property
    def k(self) -> int:
        return int(self.w.shape[1])


def check_a(op_name: str, a: gs.Tensor, out: gs.Tensor) -> str:
    """A's dtype is one of the op's and the output keeps it; returns the dtype."""
    spec = get_spec(op_name)
    dt = dtype_name(a)
    need(dt is not None, f"dtype of A {a.name!r} is unknown")
    need(dt in spec.inputs[0].dtypes, f"dtype {dt} of A {a.name!r} is not supported by {op_name} "
                                      f"(supports {', '.join(spec.inputs[0].dtypes)})")
    need(dtype_name(out) in (None, dt), f"output dtype {dtype_name(out)} differs from A's {dt}")
    return dt


def weight(node: gs.Node, w: gs.Tensor, a: gs.Tensor, dt: str, c: gs.Tensor | None = None) -> Weight:
    """The [N, K] weight of a MatMul(A, W [K, N]) or a Gemm(A, W, C) (transA 0; transB 0 or 1)."""
    value = const_value(w)
    need(value is not None, f"{node.op} {node.name!r}: the weight {w.name!r} is not a constant "
                            "(a product of two activations, e.g. attention's Q.K^T or P.V)")
    need(value.ndim == 2, f"{node.op} {node.name!r}: the weight is {value.ndim}-D, not a [K, N] matrix")
    need(np.issubdtype(value.dtype, np.floating) or dtype_name(w) == "bfloat16",
         f"{node.op} {node.name!r}: the weight has dtype {value.dtype}")
    alpha, bias = 1.0, None
    if node.op == "Gemm":
        need(not node_attr(node, "transA"), f"Gemm {node.name!r} has transA=1")
        need(rank(a) in (2, None), f"Gemm {node.name!r}: A is not 2-D")
        alpha = float(node_attr(node, "alpha") if node_attr(node, "alpha") is not None else 1.0)
        nk = value if node_attr(node, "transB") else value.T
        if c is not None:
            beta = float(node_attr(node, "beta") if node_attr(node, "beta") is not None else 1.0)
            cv = const_value(c)
            need(cv is not None, f"Gemm {node.name!r}: C {c.name!r} is not a constant")
            bias = beta * vector(cv, nk.shape[0], f"Gemm {node.name!r}: C")
    else:
        need(rank(a) is None or rank(a) >= 2, f"MatMul {node.name!r}: A is 1-D")
        nk = value.T
    disk = getattr(w.values if isinstance(w, gs.Constant) else None, "_optfuse_disk", None)
    if disk is not None:  # a weight on disk: derived when written, and the constant left unmapped
        w._values = disk
        return Weight(DerivedValues([(disk, nk is not value)], np_dtype(dt)), alpha, bias)
    return Weight(np.ascontiguousarray(nk.astype(np_dtype(dt))), alpha, bias)


def vector(value: np.ndarray, n: int, what: str) -> np.ndarray:
    """A bias constant as an [N] float64 vector (a scalar broadcasts; [1, .., N] loses its ones)."""
    v = np.asarray(value, np.float64)
    if v.size == 1:
        return np.full((n,), float(v.reshape(())))
    need(v.shape[-1] == n and v.size == n, f"{what} of shape {list(v.shape)} is not a [{n}] vector")
    return v.reshape(n)


def check_limits(op_name: str, k: int, n: int, what: str = "") -> None:
    """K and N against the spec's k_multiple, n_multiple and max_k."""
    lim = get_spec(op_name).limits
    km, nm, max_k = lim.get("k_multiple", 1), lim.get("n_multiple", 1), lim.get("max_k", 1 << 62)
    pre = f"{what}: " if what else ""
    need(k % km == 0, f"{pre}K = {k} is not a multiple of {km} ({op_name} k_multiple)")
    need(n % nm == 0, f"{pre}N = {n} is not a multiple of {nm} ({op_name} n_multiple)")
    need(k <= max_k, f"{pre}K = {k} is over {op_name}'s max_k {max_k}")


def absent(name: str, dt: str) -> np.ndarray:
    """The scalar an absent optional input (bias, residual) reaches the op as: the value the
    reference's ``ABSENT_INPUTS`` gives it, in A's dtype (the ONNX function needs every input)."""
    values = plugin_module(get_spec(EPILOGUE).folder, "reference").ABSENT_INPUTS
    return np.asarray(values[name], np_dtype(dt)).reshape(())
