"""A small declarative pattern language over onnx-graphsurgeon graphs.

Patterns are written like the math they match and are matched upward from one output tensor:

    x = Var("x")
    mean = op.ReduceMean(x, axes=Capture("axes"))
    d = op.Sub(x, mean)
    var = op.ReduceMean(AnyOf(op.Pow(d, Const(2.0)), op.Mul(d, d)))
    y = op.Div(d, op.Sqrt(op.Add(var, Const(name="eps"))))

- ``Var(name)`` binds any tensor; a name used twice must bind the same tensor.
- ``Const(value=None, name=None, where=None)`` binds a constant (gs.Constant or a Constant node's
  output); ``value`` compares numerically, ``where`` is a predicate on the NumPy value.
- ``op.X(*inputs, capture=None, out=None, **attrs)`` matches a node of type X; ``capture`` binds
  the node, ``out`` binds the output tensor it was reached through. Attribute patterns are literals
  (compared numerically), callables (predicates) or ``Capture(name)``. Attributes that newer opsets
  pass as inputs (ReduceMean axes, Unsqueeze axes, ...) are read from either place. Commutative ops
  (Add, Mul, Max, Min) match both input orders.
- ``AnyOf(p1, p2, ...)`` tries alternatives in order; ``maybe_cast(p)`` is ``AnyOf(op.Cast(p), p)``.

Matching never mutates the graph. ``match(pattern, tensor)`` yields every ``Match`` (bindings plus
the nodes covered), so a rule's check can pick the first alternative that is safe to fuse.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from ..ir.query import ATTR_INPUTS, const_value, node_attr  # noqa: F401  (part of the pattern API)

COMMUTATIVE = {"Add", "Mul", "Max", "Min", "Sum", "Equal", "And", "Or"}

# --------------------------------------------------------------------------------------------
# Match state
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Match:
    """Result of matching: named bindings plus the nodes the pattern covered (root last)."""

    bindings: dict[str, Any]
    nodes: tuple[gs.Node, ...]
    root: gs.Tensor

    def __getitem__(self, name: str) -> Any:
        return self.bindings[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.bindings.get(name, default)

    def __contains__(self, name: str) -> bool:
        return name in self.bindings


@dataclass
class _State:
    bindings: dict[str, Any] = field(default_factory=dict)
    nodes: list[gs.Node] = field(default_factory=list)

    def fork(self) -> _State:
        return _State(dict(self.bindings), list(self.nodes))

    def bind(self, name: str, value: Any) -> bool:
        if name in self.bindings:
            old = self.bindings[name]
            if isinstance(value, np.ndarray) or isinstance(old, np.ndarray):
                return np.array_equal(np.asarray(old), np.asarray(value))
            return old is value or old == value
        self.bindings[name] = value
        return True


# --------------------------------------------------------------------------------------------
# Pattern nodes
# --------------------------------------------------------------------------------------------
class Pattern:
    def match(self, tensor: gs.Tensor, state: _State) -> Iterator[_State]:
        raise NotImplementedError

    def root_ops(self) -> set[str] | None:
        """Op types the root can be (None: any)."""
        return None


@dataclass(frozen=True)
class Var(Pattern):
    name: str
    where: Callable[[gs.Tensor], bool] | None = None

    def match(self, tensor, state):
        if self.where is not None and not self.where(tensor):
            return
        s = state.fork()
        if s.bind(self.name, tensor):
            yield s


@dataclass(frozen=True)
class Capture:
    """Binds an attribute value by name (used inside op attribute patterns)."""

    name: str


@dataclass(frozen=True)
class Const(Pattern):
    value: Any = None
    name: str | None = None
    where: Callable[[np.ndarray], bool] | None = None
    rtol: float = 1e-6

    def match(self, tensor, state):
        val = const_value(tensor)
        if val is None:
            return
        if self.value is not None:
            want = np.asarray(self.value, dtype=np.float64)
            try:
                if not np.allclose(val.astype(np.float64), want, rtol=self.rtol, atol=0):
                    return
            except (TypeError, ValueError):
                return
        if self.where is not None and not self.where(val):
            return
        s = state.fork()
        if self.name is not None:
            if not s.bind(self.name, val) or not s.bind(self.name + ".tensor", tensor):
                return
        if len(tensor.inputs) == 1:  # a Constant node belongs to the match
            s.nodes.append(tensor.inputs[0])
        yield s


@dataclass(frozen=True)
class AnyOf(Pattern):
    alternatives: tuple[Pattern, ...]

    def __init__(self, *alternatives: Pattern):
        object.__setattr__(self, "alternatives", tuple(alternatives))

    def match(self, tensor, state):
        for alt in self.alternatives:
            yield from alt.match(tensor, state)

    def root_ops(self):
        ops: set[str] = set()
        for alt in self.alternatives:
            r = alt.root_ops()
            if r is None:
                return None
            ops |= r
        return ops


@dataclass(frozen=True)
class OpPattern(Pattern):
    op_type: str
    inputs: tuple[Pattern, ...]
    attrs: tuple[tuple[str, Any], ...] = ()
    capture: str | None = None
    output_index: int = 0
    out: str | None = None

    def root_ops(self):
        return {self.op_type}

    def match(self, tensor, state):
        if isinstance(tensor, gs.Constant) or len(tensor.inputs) != 1:
            return
        node = tensor.inputs[0]
        if node.op != self.op_type:
            return
        if self.output_index >= len(node.outputs) or node.outputs[self.output_index] is not tensor:
            return
        node_state = state.fork()
        if not any(n is node for n in state.nodes):  # Mul(d, d) reaches d's producer twice
            node_state.nodes.append(node)
        if not self._match_attrs(node, node_state):
            return
        if self.capture and not node_state.bind(self.capture, node):
            return
        if self.out and not node_state.bind(self.out, tensor):
            return
        data_inputs = _data_inputs(node)
        if len(data_inputs) != len(self.inputs):
            return
        orders = [data_inputs]
        if self.op_type in COMMUTATIVE and len(data_inputs) == 2:
            orders.append(data_inputs[::-1])
        for order in orders:
            yield from _match_inputs(self.inputs, order, node_state)

    def _match_attrs(self, node: gs.Node, state: _State) -> bool:
        for name, want in self.attrs:
            have = node_attr(node, name)
            if isinstance(want, Capture):
                if have is None or not state.bind(want.name, have):
                    return False
            elif callable(want):
                if not want(have):
                    return False
            elif have is None or not _equal(have, want):
                return False
        return True


def _match_inputs(patterns, tensors, state) -> Iterator[_State]:
    if not patterns:
        yield state
        return
    for s in patterns[0].match(tensors[0], state):
        yield from _match_inputs(patterns[1:], tensors[1:], s)


def _data_inputs(node: gs.Node) -> list[gs.Tensor]:
    """Inputs without the attribute-like ones (e.g. ReduceMean's axes in opset 18)."""
    moved = ATTR_INPUTS.get(node.op, {})
    skip = set(moved.values())
    return [t for i, t in enumerate(node.inputs) if i not in skip]


def _equal(have: Any, want: Any) -> bool:
    try:
        return bool(np.array_equal(np.asarray(have), np.asarray(want)))
    except Exception:
        return have == want


class _OpBuilder:
    """`op.ReduceMean(x, axes=-1)` builds an OpPattern."""

    def __getattr__(self, op_type: str) -> Callable[..., OpPattern]:
        if op_type.startswith("_"):
            raise AttributeError(op_type)

        def make(*inputs: Pattern, capture: str | None = None, output_index: int = 0, out: str | None = None,
                 **attrs: Any) -> OpPattern:
            return OpPattern(op_type, tuple(inputs), tuple(sorted(attrs.items())), capture, output_index, out)

        return make


op = _OpBuilder()


def maybe_cast(p: Pattern, capture: str | None = None) -> Pattern:
    """`p`, or `Cast(p)` (exporters insert fp32 Casts around normalizations)."""
    return AnyOf(op.Cast(p, capture=capture), p)


def match(pattern: Pattern, tensor: gs.Tensor) -> Iterator[Match]:
    """Every way `pattern` matches the subgraph producing `tensor`."""
    for s in pattern.match(tensor, _State()):
        yield Match(dict(s.bindings), tuple(reversed(_unique(s.nodes))), tensor)


def _unique(nodes: list[gs.Node]) -> list[gs.Node]:
    seen: set[int] = set()
    out = []
    for n in nodes:
        if id(n) not in seen:
            seen.add(id(n))
            out.append(n)
    return out
