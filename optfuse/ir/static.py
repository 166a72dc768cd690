"""Static evaluation: the values of small tensors computed from constants and shapes, and the static
size of a dim that shape inference left symbolic.

TorchScript exports write scales as ``1 / sqrt(q.size(-1))`` and head splits as
``view(b, s, -1, d)`` with the target built from ``Shape``; ONNX shape inference then leaves the
head count symbolic. `StaticEval` folds such chains (Shape, Gather, Slice, Concat, Squeeze,
Unsqueeze, Reshape, Cast and scalar arithmetic) and follows a dim through layout, elementwise and
MatMul producers (a Reshape's dim by its target, or by cancelling the symbols both sides share).

One `StaticEval` memoises per graph: use it while the graph does not change (a planning pass).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from .query import const_value, node_attr, rank, static_dim

#: Placeholder for a dim Shape cannot tell (value(partial=True) keeps it, others reject it).
UNKNOWN_DIM = -(1 << 62)

_FOLD = {
    "Cast": lambda x, a: x.astype(_cast_np(a.get("to"))),
    "Sqrt": lambda x, a: np.sqrt(x), "Reciprocal": lambda x, a: 1.0 / x, "Neg": lambda x, a: -x,
    "Mul": lambda x, y, a: x * y, "Div": lambda x, y, a: (x // y if np.issubdtype(np.asarray(x).dtype, np.integer)
                                                         else x / y),
    "Add": lambda x, y, a: x + y, "Sub": lambda x, y, a: x - y, "Pow": lambda x, y, a: np.power(x, y),
}

_ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Pow", "Where", "Neg", "Cast", "CastLike", "Relu", "Sigmoid", "Tanh", "Erf",
                "Exp", "Sqrt", "Reciprocal", "Abs", "Identity", "Max", "Min", "Gelu", "Softmax", "IsNaN", "Not",
                "And", "Or", "Equal", "Less", "Greater", "Dropout", "Clip", "Sin", "Cos", "Tril", "Trilu"}
_FIRST_INPUT = {"Cast", "Dropout", "RotaryEmbedding", "Clip", "Trilu", "Softmax", "LayerNormalization",
                "RMSNormalization", "Identity"}


def _cast_np(to):
    import onnx

    return onnx.helper.tensor_dtype_to_np_dtype(int(to))


class StaticEval:
    """Static values and dims of one graph's tensors, memoised by tensor (entries keep their tensor
    alive, so an id is never reused while the memo holds it)."""

    def __init__(self) -> None:
        self._values: dict[tuple[int, int], tuple[gs.Tensor, np.ndarray | None]] = {}
        self._dims: dict[tuple[int, int, int], tuple[gs.Tensor, int | None]] = {}

    # -------------------------------------------------------------------------------------------
    # values
    # -------------------------------------------------------------------------------------------
    def value(self, t: gs.Tensor, depth: int = 12, partial: bool = False) -> np.ndarray | None:
        """The value of a small tensor that only depends on constants and static dims (a scale written
        as ``1 / sqrt(q.size(-1))`` by TorchScript, a Reshape target built from Shape), else None.

        partial: shape vectors may hold UNKNOWN_DIM where a dim is not static.
        """
        out = self._partial(t, depth)
        if out is not None and not partial and np.issubdtype(out.dtype, np.integer) and (out == UNKNOWN_DIM).any():
            return None
        return out

    def _partial(self, t: gs.Tensor, depth: int) -> np.ndarray | None:
        key = (id(t), depth)
        hit = self._values.get(key)
        if hit is None:
            hit = self._values[key] = (t, self._value(t, depth))
        return hit[1]

    def _value(self, t: gs.Tensor, depth: int) -> np.ndarray | None:
        v = const_value(t)
        if v is not None or depth <= 0 or len(t.inputs) != 1:
            return v
        node = t.inputs[0]
        try:
            if node.op == "Shape":
                out = self._shape_value(node)
            else:
                vals = [self._partial(x, depth - 1) for x in node.inputs if x.name]
                if any(x is None for x in vals):
                    return None
                out = _fold(node, vals, t)
        except Exception:  # noqa: BLE001 - anything odd is just "not static"
            return None
        return None if out is None else np.asarray(out)

    def _shape_value(self, node: gs.Node) -> np.ndarray | None:
        x = node.inputs[0]
        r = rank(x)
        if r is None:
            return None
        start, end = int(node.attrs.get("start", 0)), node.attrs.get("end")
        start = start % r if start < 0 else min(start, r)
        end = r if end is None else (int(end) % r if int(end) < 0 else min(int(end), r))
        dims = [self.dim(x, i) for i in range(start, end)]
        return np.array([UNKNOWN_DIM if d is None else d for d in dims], np.int64)

    # -------------------------------------------------------------------------------------------
    # dims
    # -------------------------------------------------------------------------------------------
    def dim(self, t: gs.Tensor, axis: int, depth: int = 16) -> int | None:
        """Static size of `t` along `axis`, looking through producers when shape inference left it symbolic."""
        key = (id(t), axis, depth)
        hit = self._dims.get(key)
        if hit is None:
            hit = self._dims[key] = (t, self._dim(t, axis, depth))
        return hit[1]

    def same_dim(self, a: gs.Tensor, ai: int, b: gs.Tensor, bi: int) -> bool | None:
        """True/False when the dims are provably equal/different, None when unknown."""
        da = a.shape[ai] if a.shape is not None and -len(a.shape) <= ai < len(a.shape) else None
        db = b.shape[bi] if b.shape is not None and -len(b.shape) <= bi < len(b.shape) else None
        sa, sb = self.dim(a, ai), self.dim(b, bi)
        if sa is not None and sb is not None:
            return sa == sb
        if isinstance(da, str) and isinstance(db, str) and da == db:
            return True
        return None

    def _dim(self, t: gs.Tensor, axis: int, depth: int) -> int | None:
        r = rank(t)
        if r is None or not -r <= axis < r:
            return None
        axis %= r
        d = static_dim(t, axis)
        if d is not None:
            return d
        if isinstance(t, gs.Constant):
            return int(t.shape[axis])
        if depth <= 0 or len(t.inputs) != 1:
            return None
        node = t.inputs[0]
        ins = [x for x in node.inputs if x.name]
        nop = node.op
        if nop == "Transpose":
            perm = node.attrs.get("perm")
            perm = list(range(r))[::-1] if perm is None else list(perm)
            return self.dim(node.inputs[0], perm[axis], depth - 1)
        if nop in _FIRST_INPUT or node.domain not in ("", "ai.onnx", None):
            # shape-preserving in their first input (norms, rotary embeddings, optfuse norm nodes)
            return self.dim(ins[0], axis, depth - 1) if ins and rank(ins[0]) == r else None
        if nop in _ELEMENTWISE:
            return self._broadcast_dim(ins, r, axis, depth)
        if nop == "Concat":
            cax = int(node.attrs.get("axis", 0)) % r
            if cax != axis:
                return self._broadcast_dim(ins, r, axis, depth)
            parts = [self.dim(x, axis, depth - 1) for x in ins]
            return sum(parts) if all(p is not None for p in parts) else None
        if nop in ("Unsqueeze", "Squeeze"):
            return self._squeeze_dim(node, r, axis, depth)
        if nop == "Expand":
            return self._expand_dim(node, r, axis, depth)
        if nop == "MatMul":
            if axis == r - 1:
                return self.dim(node.inputs[1], -1, depth - 1)
            if axis == r - 2:
                return self.dim(node.inputs[0], -2, depth - 1)
            return self._broadcast_dim(ins, r, axis, depth)
        if nop == "Reshape":
            return self._reshape_dim(node, t, axis, depth)
        if nop in ("Slice", "Split"):
            return self._slice_dim(node, t, r, axis, depth)
        return None

    def _squeeze_dim(self, node: gs.Node, r: int, axis: int, depth: int) -> int | None:
        axes = node_attr(node, "axes")
        if node.op == "Unsqueeze":
            if axes is None:
                return None
            axes = sorted(int(a) % r for a in np.atleast_1d(axes))
            if axis in axes:
                return 1
            return self.dim(node.inputs[0], axis - sum(a < axis for a in axes), depth - 1)
        ri = rank(node.inputs[0])
        if ri is None or axes is None:
            return None
        axes = {int(a) % ri for a in np.atleast_1d(axes)}
        kept = [i for i in range(ri) if i not in axes]
        return self.dim(node.inputs[0], kept[axis], depth - 1) if axis < len(kept) else None

    def _expand_dim(self, node: gs.Node, r: int, axis: int, depth: int) -> int | None:
        x = node.inputs[0]
        rx = rank(x)
        d = self.dim(x, axis - (r - rx), depth - 1) if rx is not None and axis - (r - rx) >= 0 else 1
        if d is not None and d != 1:
            return d
        shape = const_value(node.inputs[1])
        if shape is not None and len(shape) == r and int(shape[axis]) > 1:
            return int(shape[axis])
        return d if shape is not None and len(shape) == r and int(shape[axis]) in (0, 1) else None

    def _slice_dim(self, node: gs.Node, t: gs.Tensor, r: int, axis: int, depth: int) -> int | None:
        x = node.inputs[0]
        if rank(x) != r:
            return None
        if node.op == "Split":
            sax = int(node.attrs.get("axis", 0)) % r
            return self.dim(x, axis, depth - 1) if sax != axis else self._split_size(node, t, axis, depth)
        axes = const_value(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3].name else np.arange(
            len(const_value(node.inputs[1]) if const_value(node.inputs[1]) is not None else []))
        if axes is None or len(axes) == 0:
            return None
        axes = [int(a) % r for a in np.atleast_1d(axes)]
        if axis not in axes:
            return self.dim(x, axis, depth - 1)
        return self._sliced_size(node, axes.index(axis), self.dim(x, axis, depth - 1))

    @staticmethod
    def _sliced_size(node: gs.Node, i: int, d: int | None) -> int | None:
        """The length of entry ``i`` of a Slice's constant starts / ends / steps over a static dim ``d``."""
        if d is None or len(node.inputs) < 3:
            return None
        vals = [const_value(x) if x.name else None for x in node.inputs[1:3]]
        steps = const_value(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4].name else np.ones(1, np.int64)
        if any(v is None for v in vals) or steps is None:
            return None
        start, end = (int(np.atleast_1d(v)[i]) for v in vals)
        step = int(np.atleast_1d(steps)[i if np.size(steps) > 1 else 0])
        return len(range(*slice(start, end, step).indices(d))) if step else None

    def _split_size(self, node: gs.Node, t: gs.Tensor, axis: int, depth: int) -> int | None:
        """The size of output `t` of a Split along its axis: its entry of the constant sizes (the
        ``split`` input, opset 13+, or attribute), else an equal share of a static input dim."""
        i = next((k for k, o in enumerate(node.outputs) if o is t), None)
        given = len(node.inputs) > 1 and node.inputs[1].name  # the sizes input (opset 13+), else the attribute
        sizes = const_value(node.inputs[1]) if given else node_attr(node, "split")
        if i is None or (given and sizes is None):  # computed sizes: unknown
            return None
        if sizes is not None:
            sizes = np.atleast_1d(np.asarray(sizes)).reshape(-1)
            return int(sizes[i]) if len(sizes) == len(node.outputs) else None
        whole = self.dim(node.inputs[0], axis, depth - 1)
        n = len(node.outputs)
        return whole // n if whole is not None and whole % n == 0 else None

    def _broadcast_dim(self, ins, r, axis, depth) -> int | None:
        found = []
        for x in ins:
            rx = rank(x)
            if rx is None:
                return None
            ax = axis - (r - rx)
            if ax < 0:
                found.append(1)
                continue
            d = self.dim(x, ax, depth - 1)
            if d is not None and d != 1:
                return d
            found.append(d)
        return 1 if found and all(f == 1 for f in found) else None

    def _reshape_dim(self, node: gs.Node, t: gs.Tensor, axis: int, depth: int) -> int | None:
        x, shape_t = node.inputs[0], node.inputs[1]
        r = rank(t)
        entries = self.shape_entries(shape_t, r)
        allowzero = int(node.attrs.get("allowzero", 0))
        if entries is not None and entries[axis] is not None:
            v = entries[axis]
            if v > 0:
                return v
            if v == 0 and not allowzero:
                return self.dim(x, axis, depth - 1)
        # element count is preserved: cancel the symbolic dims both sides share, divide the static ones
        if x.shape is None or t.shape is None:
            return None
        in_syms: Counter = Counter()
        in_static = 1
        for i, d in enumerate(x.shape):
            if isinstance(d, (int, np.integer)) and d >= 0:
                in_static *= int(d)
                continue
            s = self.dim(x, i, depth - 1)
            if s is not None:
                in_static *= s
            elif isinstance(d, str):
                in_syms[d] += 1
            else:
                return None
        out_syms: Counter = Counter()
        out_static = 1
        for i, d in enumerate(t.shape):
            if i == axis:
                continue
            if isinstance(d, (int, np.integer)) and d >= 0:
                out_static *= int(d)
            elif entries is not None and entries[i] is not None and entries[i] > 0:
                out_static *= entries[i]
            elif isinstance(d, str):
                out_syms[d] += 1
            else:
                return None
        if in_syms != out_syms or out_static == 0 or in_static % out_static:
            return None
        return in_static // out_static

    def shape_entries(self, shape_t: gs.Tensor, r: int | None) -> list[int | None] | None:
        """A Reshape target as known ints (None for a computed entry), or None if even its length is unknown."""
        v = const_value(shape_t)
        if v is not None:
            return [int(x) for x in v.reshape(-1)]
        sv = self.value(shape_t, partial=True)
        if sv is not None and sv.ndim == 1:
            out_sv = [None if int(x) == UNKNOWN_DIM else int(x) for x in sv]
            return out_sv if r is None or len(out_sv) == r else None
        if len(shape_t.inputs) == 1 and shape_t.inputs[0].op == "Concat":
            out: list[int | None] = []
            for p in shape_t.inputs[0].inputs:
                pv = self.value(p, partial=True)
                if pv is not None:
                    out.extend(None if int(x) == UNKNOWN_DIM else int(x) for x in pv.reshape(-1))
                elif p.shape is not None and len(p.shape) == 1 and static_dim(p, 0) is not None:
                    out.extend([None] * static_dim(p, 0))
                else:
                    return None
            return out if r is None or len(out) == r else None
        return None


def _fold(node: gs.Node, vals: list[Any], t: gs.Tensor) -> Any:
    """One node of a static chain, evaluated with NumPy on its inputs' values (None: not foldable)."""
    if node.op == "Gather":
        return np.take(vals[0], vals[1], axis=int(node.attrs.get("axis", 0)))
    if node.op == "Slice":
        starts, ends = vals[1], vals[2]
        axes = vals[3] if len(vals) > 3 else np.arange(len(starts))
        steps = vals[4] if len(vals) > 4 else np.ones(len(starts), np.int64)
        idx = [slice(None)] * vals[0].ndim
        for a, b, e, st in zip(axes, starts, ends, steps):
            idx[int(a)] = slice(int(b), int(e), int(st))
        return vals[0][tuple(idx)]
    if node.op == "Concat":
        return np.concatenate([np.atleast_1d(x) for x in vals], axis=int(node.attrs.get("axis", 0)))
    if node.op in ("Squeeze", "Unsqueeze", "Reshape", "Identity", "Flatten"):
        x = vals[0]
        if node.op == "Squeeze":
            return x.reshape(()) if x.size == 1 and rank(t) == 0 else np.squeeze(x)
        if node.op == "Unsqueeze":
            return x.reshape((1,) + x.shape) if x.ndim == 0 else (x.reshape(-1) if rank(t) == 1 else None)
        return x.reshape(-1) if rank(t) == 1 else (x.reshape(()) if rank(t) == 0 else None)
    if node.op in _FOLD and len(vals) in (1, 2):
        if any((np.asarray(x) == UNKNOWN_DIM).any() for x in vals if np.issubdtype(np.asarray(x).dtype, np.integer)):
            return None
        return _FOLD[node.op](*vals, node.attrs)
    return None


def static_value(t: gs.Tensor) -> np.ndarray | None:
    """`StaticEval().value(t)` without a shared memo (for pattern predicates, which see no context)."""
    return StaticEval().value(t)
