"""Stages `match` and `rewrite`: plan the fusions of each family, then apply the plan.

Planning walks the graph for every rule of a family, keeps the first safe match per anchor, and
records every rejected candidate with its reason. Applying only mutates: each accepted match
becomes one node in domain `optfuse` that takes over the match's outputs (checked against the op's
spec first), and a single cleanup/toposort removes what became dead. Sizing what a fusion saves is
the estimate stage's (`optfuse.estimate`), from what `Accepted` records.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from . import DOMAIN
from .ir.query import outside_uses
from .ir.weights import export_graph
from .pattern import Context, FusedOutput, FusionRule, NewTensor, Rewrite, match
from .spec import get_spec, plugin_module

if TYPE_CHECKING:
    from .spec import OpSpec


@dataclass
class Accepted:
    """One fusion: the rule, the op, the original nodes it replaced and the node it became.

    replaced_io: per replaced node (aligned with `nodes`), the names of the tensors it read and wrote,
      taken before the graph changed; added_nodes: the standard nodes apply_plan added for it (a node
      shared by several fusions is listed by the first). The traffic estimate reads both.
    """

    rule: str
    op: str
    nodes: list[str]
    rewrite: Rewrite = field(repr=False)
    node_name: str = ""
    replaced_io: list[tuple[str, ...]] = field(default_factory=list, repr=False)
    added_nodes: list[str] = field(default_factory=list)


@dataclass
class Rejected:
    rule: str
    op: str
    nodes: list[str]
    reason: str


@dataclass
class FusionResult:
    """What one fuse run accepted and rejected.

    original: the sanitized graph before any rewrite (a copy; the estimate sizes replaced tensors in it);
    dims: the analysis dims the run was given (the estimate's default);
    summary: per family that defines ``summary(graph)``, its counts before and after its pass
      (the GEMM family: {"gemms": {"before": 12, "after": 8}}).
    """

    accepted: list[Accepted] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    original: gs.Graph | None = field(default=None, repr=False)
    dims: dict[str, int] = field(default_factory=dict)
    summary: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for a in self.accepted:
            out[a.op] = out.get(a.op, 0) + 1
        return out


def _node_names(nodes: Sequence[gs.Node]) -> list[str]:
    return [n.name or n.op for n in nodes if n.op != "Constant"]


def _node_io(nodes: Sequence[gs.Node]) -> list[tuple[str, ...]]:
    """Per node of `_node_names`, the named tensors it reads and writes (a tensor read twice, twice)."""
    return [tuple(t.name for t in [*n.inputs, *n.outputs] if t.name) for n in nodes if n.op != "Constant"]


def _leak_reason(m_nodes: Sequence[gs.Node], rw: Rewrite, graph: gs.Graph) -> str | None:
    """An intermediate that something outside the match reads cannot disappear.

    A reader that only feeds the match itself (e.g. the Shape -> Concat chain that computes a
    matched Reshape's target from a matched tensor) dies with the match and does not count.
    """
    kept = {id(t) for t in [*rw.outputs, *(o for a in rw.after for o in a.outputs)] if t is not None}
    inside = {id(n) for n in m_nodes}
    reads = _rewrite_reads(rw)
    memo: dict[int, bool] = {}
    staying = {id(n) for n in rw.keep}
    for node in m_nodes:
        if id(node) in staying:
            continue
        for t in node.outputs:
            if id(t) in kept:
                continue
            uses = outside_uses(t, m_nodes, graph)
            if not uses:
                continue
            is_output = any(o is t for o in graph.outputs)
            outside = [c for c in t.outputs if id(c) not in inside]
            if not is_output and all(_dies_with(c, inside, graph, reads, memo) for c in outside):
                continue
            return f"intermediate {t.name!r} is also used by {', '.join(uses)}"
    return None


def _rewrite_reads(rw: Rewrite) -> set[int]:
    """Ids of the existing tensors the fused node (and the nodes it adds) will read."""
    out: set[int] = set()
    stack = [*rw.inputs, *(x for a in rw.after for x in a.inputs)]
    while stack:
        x = stack.pop()
        if isinstance(x, NewTensor):
            stack.extend(x.inputs)
        elif isinstance(x, gs.Tensor):
            out.add(id(x))
    return out


def _dies_with(node: gs.Node, inside: set[int], graph: gs.Graph, reads: set[int], memo: dict[int, bool],
               depth: int = 8) -> bool:
    """`node` only feeds the match (transitively), so removing the match leaves it dead."""
    if id(node) in memo:
        return memo[id(node)]
    memo[id(node)] = False  # cycle guard
    ok = depth > 0 and all(
        id(o) not in reads and not any(g is o for g in graph.outputs)
        and all(id(c) in inside or _dies_with(c, inside, graph, reads, memo, depth - 1) for c in o.outputs)
        for o in node.outputs)
    memo[id(node)] = ok
    return ok


def _try_rule(rule: FusionRule, out: gs.Tensor, ctx: Context, claimed: set[int]):
    """First safe match of `rule` at `out`: (match, rewrite, None), or (first match, None, reason)."""
    first_reject = None
    for m in match(rule.pattern, out):
        if any(id(n) in claimed for n in m.nodes):
            continue  # part of an already planned fusion: not a candidate of its own
        skipped = _skipped_node(m.nodes, ctx.options.skip_nodes)
        checked = f"node {skipped!r} is listed in fusions.skip_nodes" if skipped else rule.check(m, ctx)
        if isinstance(checked, str):
            reason = checked
        else:
            rw = rule.rewrite(m, checked)
            reason = _leak_reason(m.nodes, rw, ctx.graph)
        if reason is None:
            return m, rw, None
        if first_reject is None:  # the first alternative is the most complete one: report its reason
            first_reject = (m, None, reason)
    return first_reject


def _skipped_node(nodes: Sequence[gs.Node], patterns: Sequence[str]) -> str | None:
    """The first of `nodes` a ``fusions.skip_nodes`` pattern names (a name or a glob), else None."""
    import fnmatch

    if not patterns:
        return None
    for n in nodes:
        if n.name and any(n.name == p or fnmatch.fnmatchcase(n.name, p) for p in patterns):
            return n.name
    return None


def plan_family(graph: gs.Graph, rules: Sequence[FusionRule], ctx: Context) -> FusionResult:
    """Match `rules` (in priority order) over `graph` without mutating it."""
    claimed: set[int] = set()
    result = FusionResult()
    pending: list[tuple[set[int], Rejected]] = []
    for rule in rules:
        root_ops = rule.pattern.root_ops()
        for node in list(graph.nodes):
            if (root_ops is not None and node.op not in root_ops) or id(node) in claimed:
                continue
            for out in node.outputs:
                found = _try_rule(rule, out, ctx, claimed)
                if found is None:
                    continue
                m, rw, reason = found
                if reason is None:
                    claimed.update(id(n) for n in m.nodes)
                    staying = {id(n) for n in rw.keep}
                    replaced = [n for n in m.nodes if id(n) not in staying]
                    result.accepted.append(Accepted(rule.id, rw.op, _node_names(replaced), rw,
                                                    replaced_io=_node_io(replaced)))
                    break
                pending.append(({id(n) for n in m.nodes},
                                Rejected(rule.id, rule.target, _node_names(m.nodes), reason)))
    # Report a rejection only where no accepted match took those nodes over, and once per
    # subgraph: a smaller variant of the same candidate (e.g. without its affine tail) is not news.
    reported: list[set[int]] = []
    for ids, rej in sorted(pending, key=lambda p: -len(p[0])):
        if ids & claimed or any(ids <= r for r in reported):
            continue
        reported.append(ids)
        result.rejected.append(rej)
    return result


def _materialize(x: NewTensor, name: str, graph: gs.Graph, made: dict[int, gs.Tensor],
                 new_nodes: list[gs.Node]) -> gs.Tensor:
    """The tensor of a NewTensor: its node is created once per plan (shared NewTensors stay shared)."""
    if id(x) in made:
        return made[id(x)]
    # the NewTensors it reads first, so its name's index comes after theirs (a nested NewTensor of
    # the same name, such as a mask's Where inside its Add, must not get the same tensor name)
    made_inputs = {j: _materialize(a, name, graph, made, new_nodes) for j, a in enumerate(x.inputs)
                   if isinstance(a, NewTensor)}
    base = f"{name}/{x.name or x.op.lower()}_{len(made)}"
    inputs: list[gs.Tensor] = []
    for j, a in enumerate(x.inputs):
        if a is None:
            inputs.append(gs.Variable.empty())
        elif isinstance(a, NewTensor):
            inputs.append(made_inputs[j])
        elif isinstance(a, np.ndarray):
            inputs.append(gs.Constant(f"{base}/in{j}", np.ascontiguousarray(a)))
        else:
            inputs.append(a)
    out = gs.Variable(base, dtype=x.dtype, shape=x.shape)
    node = gs.Node(op=x.op, name=base, attrs=dict(x.attrs), inputs=inputs, outputs=[out])
    graph.nodes.append(node)
    new_nodes.append(node)
    made[id(x)] = out
    return out


def apply_plan(graph: gs.Graph, result: FusionResult, start_index: int = 0) -> None:
    """Replace every accepted match by one optfuse node (the only mutating step).

    Each rewrite is checked against its op's spec first (`check_rewrite`). NewTensor inputs become
    new standard nodes, recorded in `Accepted.added_nodes` of the first fusion that uses them, and
    so do the rewrite's `After` nodes (they read the fused node's outputs).
    """
    if not result.accepted:
        return  # graph unchanged
    made: dict[int, gs.Tensor] = {}
    for i, acc in enumerate(result.accepted, start=start_index):
        rw = acc.rewrite
        spec = get_spec(rw.op)
        check_rewrite(rw, spec, acc.rule)
        name = f"optfuse/{acc.rule}/{i}"
        new_nodes: list[gs.Node] = []
        inputs: list[gs.Tensor] = []
        for j, x in enumerate(rw.inputs):
            if x is None:
                inputs.append(gs.Variable.empty())
            elif isinstance(x, np.ndarray):
                inputs.append(gs.Constant(f"{name}/{spec.inputs[j].name}", np.ascontiguousarray(x)))
            elif isinstance(x, gs.ir.tensor.LazyValues):  # a derived weight, computed on export (ir.weights)
                inputs.append(gs.Constant(f"{name}/{spec.inputs[j].name}", x))
            elif isinstance(x, NewTensor):
                inputs.append(_materialize(x, name, graph, made, new_nodes))
            else:
                inputs.append(x)
        while inputs and not inputs[-1].name:  # trailing absent optional inputs are just omitted
            inputs.pop()
        outputs: list[gs.Tensor] = []
        for j, t in enumerate(rw.outputs):
            if t is None:
                t = _new_output(spec, j, rw, inputs, name)
            else:
                t.inputs.clear()  # detach from the producer being replaced
            outputs.append(t)
        attrs = dict(rw.attrs)
        attrs["plugin_namespace"] = DOMAIN
        attrs["plugin_version"] = spec.plugin_version
        node = gs.Node(op=rw.op, name=name, domain=DOMAIN, attrs=attrs, inputs=inputs, outputs=outputs)
        graph.nodes.append(node)
        for k, after in enumerate(rw.after):
            new_nodes.append(_after_node(after, outputs, f"{name}/{after.op.lower()}_after_{k}", graph))
        acc.node_name = name
        acc.added_nodes = [n.name for n in new_nodes]
    graph.cleanup(remove_unused_graph_inputs=False).toposort()


def _new_output(spec: OpSpec, j: int, rw: Rewrite, inputs: list[gs.Tensor], name: str) -> gs.Variable:
    """A fused node's output that no existing tensor stands for: shaped by the spec's rule when the
    inputs' shapes are known, else like the first output (or input)."""
    like = rw.outputs[0] if rw.outputs[0] is not None else inputs[0]
    shapes = [t.shape for t in inputs] + [None] * (len(spec.inputs) - len(inputs))
    shape = like.shape
    try:
        shape = spec.output_shape(j, shapes)
    except (TypeError, ValueError, IndexError):
        pass
    return gs.Variable(f"{name}/{spec.outputs[j].name}", dtype=like.dtype, shape=shape)


def _after_node(after, fused_outputs: list[gs.Tensor], name: str, graph: gs.Graph) -> gs.Node:
    """The standard node of an `After`: it reads the fused node's outputs and takes over its own."""
    inputs: list[gs.Tensor] = []
    for j, x in enumerate(after.inputs):
        if isinstance(x, FusedOutput):
            inputs.append(fused_outputs[x.index])
        elif isinstance(x, np.ndarray):
            inputs.append(gs.Constant(f"{name}/in{j}", np.ascontiguousarray(x)))
        else:
            inputs.append(x)
    for t in after.outputs:
        t.inputs.clear()  # detach from the producer being replaced
    node = gs.Node(op=after.op, name=name, attrs=dict(after.attrs), inputs=inputs, outputs=list(after.outputs))
    graph.nodes.append(node)
    return node


# Python types each spec attribute type accepts (bool is an int to Python, not to the spec).
_ATTR_TYPES = {"float": (float, np.floating), "int": (int, np.integer), "string": (str,)}


def check_rewrite(rw: Rewrite, spec: OpSpec, rule: str) -> None:
    """A rewrite fits its op's spec: input count within [required, total] with every required input
    present, at most the spec's outputs, only spec attributes, every attribute without a default
    given, each value of the spec's type (and among its choices, where it lists them). A violation is a bug in the rule: ValueError naming the
    op, the rule and the field."""

    def fail(what: str) -> None:
        raise ValueError(f"rule {rule} writes an invalid {spec.op} node: {what}")

    if len(rw.inputs) > len(spec.inputs):
        fail(f"{len(rw.inputs)} inputs, the spec has {len(spec.inputs)}")
    for j, ts in enumerate(spec.inputs):
        if not ts.optional and (j >= len(rw.inputs) or rw.inputs[j] is None):
            fail(f"required input {ts.name!r} (#{j}) is missing")
    if not 1 <= len(rw.outputs) <= len(spec.outputs):
        fail(f"{len(rw.outputs)} outputs, the spec has {len(spec.outputs)}")
    names = {a.name for a in spec.attributes}
    for key, value in rw.attrs.items():
        if key not in names:
            fail(f"attribute {key!r} is not in the spec (attributes: {sorted(names)})")
        if not _fits(value, spec.attr(key).type):
            fail(f"attribute {key!r} = {value!r} is not of type {spec.attr(key).type}")
        if spec.attr(key).choices and value not in spec.attr(key).choices:
            fail(f"attribute {key!r} = {value!r} is not one of {', '.join(spec.attr(key).choices)}")
    for a in spec.attributes:
        if a.default is None and a.name not in rw.attrs:
            fail(f"attribute {a.name!r} has no default and is missing")


def _fits(value, type_: str) -> bool:
    if type_ in ("floats", "ints"):
        return isinstance(value, (list, tuple)) and all(_fits(v, type_[:-1]) for v in value)
    return isinstance(value, _ATTR_TYPES[type_]) and not isinstance(value, (bool, np.bool_))


def add_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """Embed the reference ONNX function of every optfuse op used (replacing the optfuse functions
    the model holds), so onnxruntime runs the model. A plugin whose reference defines
    ``function_overload(op, inputs, attrs)`` has one function per variant (GEMM: FP8, output dtype):
    each node gets its variant's ONNX ``overload`` (IR >= 10)."""
    # a function body is read with the model's default opset (ReduceMean's axes moved in opset 18)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
    used: set[tuple[str, str]] = set()
    for n in model.graph.node:
        if n.domain != DOMAIN:
            continue
        pick = getattr(plugin_module(get_spec(n.op_type).folder, "reference"), "function_overload", None)
        if pick is not None:
            n.overload = pick(n.op_type, list(n.input), {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute})
        used.add((n.op_type, n.overload))
    # made afresh from the nodes: a function that went through onnx-graphsurgeon lost its overload
    stale = [f for f in model.functions if f.domain == DOMAIN]
    for f in stale:
        model.functions.remove(f)
    for op, overload in sorted(used):
        reference = plugin_module(get_spec(op).folder, "reference")
        fn = reference.onnx_function(op, opset=opset, **({"overload": overload} if overload else {}))
        model.functions.append(fn)
    if any(overload for _, overload in used):
        model.ir_version = max(model.ir_version, 10)  # function overloads
    if used and not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, 1))
    return model


def inferable_model(graph: gs.Graph) -> onnx.ModelProto:
    """`graph` as a ModelProto shape inference can follow (optfuse nodes through their reference
    functions); the graph itself is left as it is."""
    return add_functions(export_graph(graph.copy(), do_type_check=False))
