"""Fusion rules: pattern -> check (a reason when unsafe, else the bindings) -> rewrite (what to emit).

Rules are stateless: `check` returns either the reason a match may not be fused or a typed
bindings object (what the rewrite needs: tensors, attribute values, the attention plan), and
`rewrite` builds the fused node from the match and those bindings alone. A rule never mutates the
graph. `optfuse.rewrite` plans matches for a family of rules and then applies the accepted ones in
one batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
import onnx_graphsurgeon as gs

from ..ir.static import StaticEval
from .core import Match, Pattern

B = TypeVar("B")  # a family's bindings type
F = TypeVar("F")  # a family's graph analysis type


@dataclass(eq=False)
class NewTensor:
    """A tensor a rewrite adds: the output of one new standard-ONNX node (e.g. a Transpose that puts
    k back in [B, H, S, D] layout, or a Slice that keeps one row of a mask).

    Planning never mutates the graph, so a rule describes the node and `apply_plan` creates it.
    inputs: existing tensors, NumPy arrays (new constants), other NewTensors or None (absent).
    dtype/shape: of the output (shape may hold symbolic dims; used by the HBM estimate).
    The same NewTensor object used by several rewrites of one plan becomes one node.
    """

    op: str
    inputs: list[Any]
    attrs: dict[str, Any] = field(default_factory=dict)
    dtype: Any = None
    shape: list[Any] | None = None
    name: str = ""


@dataclass(eq=False)
class FusedOutput:
    """An input of an `After` node: output `index` of the fused node."""

    index: int = 0


@dataclass(eq=False)
class After:
    """A standard node a rewrite adds after the fused node, writing existing tensors it takes over:
    the Split that gives a packed GEMM's original projections back, the Reshape that followed a 2-D
    GEMM. inputs: `FusedOutput`s, existing tensors or NumPy arrays (new constants)."""

    op: str
    inputs: list[Any]
    outputs: list[gs.Tensor]
    attrs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Rewrite:
    """The fused node a rule wants: op name, ordered inputs, outputs taken over, attributes.

    inputs: existing tensors, NumPy arrays (become new constants), NewTensors (computed by a new
      node that apply_plan adds) or None (absent optional input).
    outputs: existing tensors the fused node will produce (consumers keep reading them), or None
      for a new tensor (nobody reads it, or an `After` node does).
    info: extra facts for the report (e.g. the attention mask class).
    after: standard nodes that read the fused node's outputs and write existing tensors.
    keep: nodes of the match that stay for readers outside it (input-side preparation, such as a
      head split another product also reads); the fused node does not read their outputs.
    """

    op: str
    inputs: list[gs.Tensor | np.ndarray | NewTensor | None]
    outputs: list[gs.Tensor | None]
    attrs: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    after: list[After] = field(default_factory=list)
    keep: list[gs.Node] = field(default_factory=list)


@dataclass(frozen=True)
class FusionOptions:
    """The recipe's fusion switches that change how a family rewrites (names match the recipe's
    ``fusions`` section)."""

    #: causal+padding attention masks passed whole with causal=0 (exact for every row)
    attention_full_mask: bool = False
    #: rule ids that do not run (recipe ``fusions.disabled_rules``)
    disabled_rules: frozenset[str] = frozenset()
    #: original node names or globs: a match that takes one of them is not fused (``fusions.skip_nodes``)
    skip_nodes: tuple[str, ...] = ()


class GraphFacts:
    """A cache of facts about the graph one family pass plans over, each a pure function of that graph:
    static values and dims (`static`) and per-family analyses (`of`), such as attention's mask
    classes and the one mask-row tensor all its layers share (so one Slice node serves every fused
    node). It is not check-to-rewrite state: nothing in it is keyed by a match.

    Each Context makes its own (`fuse_graph` makes one Context per family pass); the graph must not
    change while it is in use.
    """

    def __init__(self, graph: gs.Graph) -> None:
        self.graph = graph
        self.static = StaticEval()
        self._analyses: dict[type, Any] = {}

    def of(self, kind: Callable[[gs.Graph], F]) -> F:
        """The analysis `kind(graph)` (a class taking the graph), made on first use."""
        if kind not in self._analyses:
            self._analyses[kind] = kind(self.graph)
        return self._analyses[kind]


@dataclass
class Context:
    """What rules may consult: the graph, the fusion options, probe shapes and the graph facts cache."""

    graph: gs.Graph
    options: FusionOptions = field(default_factory=FusionOptions)
    # Shapes of the original graph's tensors with the inputs' symbolic dims set to distinct
    # primes (see ir.shapes.probe_dims): equal here means equal for every input size.
    probe_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    facts: GraphFacts = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.facts = GraphFacts(self.graph)

    def same_shape(self, a: gs.Tensor, b: gs.Tensor) -> bool:
        """Whether two tensors always have the same shape (symbolically, else by probe shapes)."""
        if a.shape is not None and b.shape is not None and list(a.shape) == list(b.shape):
            return True
        pa, pb = self.probe_shapes.get(a.name), self.probe_shapes.get(b.name)
        return pa is not None and pa == pb


@dataclass(frozen=True)
class FusionRule(Generic[B]):
    """One exporter variant of a fusion family.

    id: `<family>.<variant>`, stable: used in recipes, reports and node names.
    target: the optfuse op it produces (a spec name).
    check: the reason (str) the match may not be fused, else the bindings its rewrite needs.
    rewrite: builds the fused node from the match and the bindings check returned (called only then).
    """

    id: str
    target: str
    pattern: Pattern
    check: Callable[[Match, Context], str | B]
    rewrite: Callable[[Match, B], Rewrite]
    doc: str = ""

    @property
    def family(self) -> str:
        return self.id.split(".", 1)[0]
