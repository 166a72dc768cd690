"""Fusion rules: pattern -> check (a reason when unsafe) -> rewrite (what to emit).

A rule never mutates the graph. `optfuse.rewrite` plans matches for a family of rules and then
applies the accepted ones in one batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from .core import Match, Pattern


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


@dataclass
class Rewrite:
    """The fused node a rule wants: op name, ordered inputs, outputs taken over, attributes.

    inputs: existing tensors, NumPy arrays (become new constants), NewTensors (computed by a new
      node that apply_plan adds) or None (absent optional input).
    outputs: existing tensors the fused node will produce (consumers keep reading them), or None
      for an output nobody reads.
    info: extra facts for the report (e.g. the attention mask class).
    """

    op: str
    inputs: list[gs.Tensor | np.ndarray | NewTensor | None]
    outputs: list[gs.Tensor | None]
    attrs: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FusionOptions:
    """The recipe's fusion switches that change how a family rewrites (names match the recipe's
    ``fusions`` section)."""

    #: causal+padding attention masks passed whole with causal=0 (exact for every row)
    attention_full_mask: bool = False


@dataclass
class Context:
    """What rules may consult: the graph, symbolic-dim values, options."""

    graph: gs.Graph
    dims: dict[str, int] = field(default_factory=dict)
    options: FusionOptions = field(default_factory=FusionOptions)
    # Shapes of the original graph's tensors with the inputs' symbolic dims set to distinct
    # primes (see ir.query.probe_dims): equal here means equal for every input size.
    probe_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def same_shape(self, a: gs.Tensor, b: gs.Tensor) -> bool:
        """Whether two tensors always have the same shape (symbolically, else by probe shapes)."""
        if a.shape is not None and b.shape is not None and list(a.shape) == list(b.shape):
            return True
        pa, pb = self.probe_shapes.get(a.name), self.probe_shapes.get(b.name)
        return pa is not None and pa == pb

    def limits(self, op: str) -> dict[str, Any]:
        from ..spec import get_spec

        return get_spec(op).limits


@dataclass(frozen=True)
class FusionRule:
    """One exporter variant of a fusion family.

    id: `<family>.<variant>`, stable: used in recipes, reports and node names.
    target: the optfuse op it produces (a spec name).
    check: returns None when the match may be fused, else the reason it may not.
    rewrite: builds the fused node from the bindings (called only after check passed).
    """

    id: str
    target: str
    pattern: Pattern
    check: Callable[[Match, Context], str | None]
    rewrite: Callable[[Match, Context], Rewrite]
    doc: str = ""

    @property
    def family(self) -> str:
        return self.id.split(".", 1)[0]
