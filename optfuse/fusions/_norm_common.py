"""Checks and parameter handling shared by the normalization families."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from ..ir.query import const_value, dtype_name, rank, static_dim
from ..pattern import Match, Rewrite
from ..spec import get_spec

_NP = {"float32": np.float32, "float16": np.float16}


def check_input(op: str, x: gs.Tensor) -> str | None:
    """The fused op can take `x`: known floating dtype the kernel supports, static hidden size within limits."""
    spec = get_spec(op)
    dt = dtype_name(x)
    if dt is None:
        return f"dtype of {x.name!r} is unknown"
    if dt not in spec.inputs[0].dtypes:
        return f"dtype {dt} of {x.name!r} is not supported by {op} (supports {', '.join(spec.inputs[0].dtypes)})"
    hidden = static_dim(x, -1)
    if hidden is None:
        return f"hidden size (last dim of {x.name!r}) is not static"
    lo, hi = spec.limits.get("min_hidden", 1), spec.limits.get("max_hidden", 1 << 30)
    if not lo <= hidden <= hi:
        return f"hidden size {hidden} is outside the kernel contract [{lo}, {hi}]"
    return None


def check_last_axis(axes, x: gs.Tensor) -> str | None:
    """Reductions must be over the last axis only (what the kernels normalize over)."""
    r = rank(x)
    if axes is None:
        return "reduction axes are not constant"
    axes = [int(a) for a in np.atleast_1d(np.asarray(axes))]
    if r is None:
        return "rank of the normalized tensor is unknown" if axes != [-1] else None
    if [a % r for a in axes] != [r - 1]:
        return f"normalizes over axes {axes}, not the last axis of a rank-{r} tensor"
    return None


def check_same_dtype(x: gs.Tensor, out: gs.Tensor) -> str | None:
    if dtype_name(x) != dtype_name(out):
        return f"output dtype {dtype_name(out)} differs from input dtype {dtype_name(x)}"
    return None


def check_eps(eps) -> str | None:
    e = np.asarray(eps)
    if e.size != 1:
        return f"epsilon is not a scalar (shape {e.shape})"
    if not np.isfinite(e).all() or float(e) < 0:
        return f"epsilon {float(e)} is not a finite non-negative number"
    return None


def param(t: gs.Tensor | None, hidden: int, dtype: str, fill: float, what: str) -> tuple[gs.Tensor | np.ndarray | None, str | None]:
    """An affine parameter as a [hidden] tensor of `dtype`: constants are reshaped/cast, absent ones filled.

    Returns (value, reason); reason is set when the parameter cannot be expressed as a [hidden] vector.
    """
    np_dtype = _np_dtype(dtype)
    if t is None:
        return np.full((hidden,), fill, dtype=np_dtype), None
    val = const_value(t)
    if val is not None:
        if val.size == 1:
            return np.full((hidden,), val.reshape(()), dtype=np_dtype), None
        if val.size != hidden or (val.ndim > 1 and val.shape[-1] != hidden):
            return None, f"{what} of shape {list(val.shape)} does not broadcast as a [{hidden}] vector"
        return val.reshape(hidden).astype(np_dtype), None
    if t.shape is None or list(t.shape) != [hidden]:
        return None, f"{what} {t.name!r} is not a [{hidden}] tensor (shape {t.shape})"
    if dtype_name(t) != dtype:
        return None, f"{what} {t.name!r} has dtype {dtype_name(t)}, not {dtype}"
    return t, None


def _np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes  # onnx depends on it

        return ml_dtypes.bfloat16
    return _NP.get(name, np.float32)


@dataclass(frozen=True)
class NormBindings:
    """What a norm rule's check hands its rewrite: the normalized input, its affine parameters as
    [hidden] vectors (gamma, and beta for LayerNorm; a tensor or a new constant each), epsilon."""

    x: gs.Tensor
    params: tuple[gs.Tensor | np.ndarray, ...]
    epsilon: float


def bind(m: Match, x: gs.Tensor, params: tuple[tuple[str, float], ...], eps) -> str | NormBindings:
    """The bindings of a norm match, or the reason an affine parameter cannot be a [hidden] vector.

    params: (binding name, fill when absent) per parameter, in the op's input order.
    """
    hidden, dt = static_dim(x, -1), dtype_name(x)
    values = []
    for key, fill in params:
        value, why = param(m.get(key), hidden, dt, fill, key)
        if why:
            return why
        values.append(value)
    return NormBindings(x, tuple(values), float(eps))


def norm_rewrite(op: str):
    """The rewrite of a norm rule: `op(x, *params)` with the match's epsilon, taking over its output."""

    def rewrite(m: Match, b: NormBindings) -> Rewrite:
        return Rewrite(op, [b.x, *b.params], [m.root], {"epsilon": b.epsilon})

    return rewrite
