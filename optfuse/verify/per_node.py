"""Per-node comparison: original vs candidate at every tensor both graphs compute, node by node.

The plain verify compares graph outputs only; this compares the intermediate tensors too, so a
failed candidate says where its error comes from. Both models run in onnxruntime through
polygraphy's runners on the same feeds as :func:`optfuse.verify.verify` (same input plan, same seed).

Which tensors are compared: every float tensor the candidate computes that stands for a tensor of
the original (:func:`tensor_map`), that is

- a tensor of the same name (a fused node takes over the outputs of the nodes it replaced, and
  reads the tensors they read: these are the boundaries between fused regions);
- the output of a node whose name both graphs have, by position (the precision stage renames the
  outputs of the nodes it keeps in FP32);
- either side of a Cast the original lacks (the precision stage's), standing for the tensor on its
  other side.

Bounded memory: the tensors are exposed in chunks of ``chunk_size``, in the candidate's topological
order. Per chunk, each model runs one segment (:class:`_Segments`, its own onnxruntime session):
the nodes that chunk needs and no earlier segment ran, fed with the tensors earlier segments
computed that later nodes still read (the live set). Every node runs once over all chunks, and
only the per-tensor error statistics are kept. Peak memory is one chunk's tensors plus the live
set (for every feed) and one session, not every intermediate of the model. A tensor crossing a
segment boundary is rounded to its type; within a session onnxruntime's CPU provider can compute a
chain of FP16 nodes in FP32, so an FP16 candidate's errors may differ slightly between chunk sizes.

Per node (fused or not): the error at its inputs (the largest max-abs error over the compared
tensors it reads; graph inputs and constants count 0), at its outputs, and the growth, out - in.
A fused node's record carries its rule id and the original nodes it replaced, read from its
``metadata_props`` (``optfuse.rule``, ``optfuse.replaced``; written by the fuse stage), or from its
name ``optfuse/<rule>/<n>`` when the metadata is absent. :func:`attribute` ranks these records.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx.external_data_helper import ExternalDataInfo, uses_external_data

from .. import DOMAIN
from ..errors import InputError, VerificationError
from ..ir.shapes import infer_shapes
from .compare import (Feeds, ModelSource, _check_candidate_inputs, _first_line, _load_graph, _plans_and_feeds,
                      _prepare_polygraphy, _runnable, precision_of)
from .padding import at_positions, named_shapes, padded_positions, padded_query_inputs
from .options import DEFAULT_ITERATIONS, VerifyOptions

#: Extra graph outputs per run (both models run once per chunk).
DEFAULT_CHUNK_SIZE = 64
#: The largest finite FP16 value: an FP32 value beyond it overflows to inf in FP16.
FP16_MAX = 65504.0
#: Values this large in the original are mask sentinels (finfo(float32).min / max), not data; the
#: candidate keeps their meaning with any value at least this large of the same sign (the FP16
#: conversion clamps such constants to -1e4).
SENTINEL, SATURATED = 1e38, 1e4
#: Metadata keys of a fused node (written by ``fusions.fuse_model``).
RULE_KEY, REPLACED_KEY = "optfuse.rule", "optfuse.replaced"
#: Names the BF16 emulation (verify.emulate) gives its rounding nodes and the renamed outputs they round.
_BF16_ROUND, _FP32_SUFFIX = "/bf16_round/", "/fp32"
_NOT_COMPARED_OPS = {"Constant", "Shape", "Size", "ConstantOfShape"}


@dataclass
class TensorError:
    """One compared tensor over every feed: errors, the original's range and what overflowed."""

    name: str  # in the original
    candidate: str  # in the candidate (differs when precision renamed or cast it)
    max_abs: float
    max_rel: float
    ref_min: float  # finite range of the original (FP32) values
    ref_max: float
    over_fp16: int  # original values with |x| > 65504 (an FP16 tensor cannot hold them)
    nonfinite: int  # candidate inf/nan where the original is finite
    dtype: str  # the candidate's dtype

    @property
    def overflow(self) -> bool:
        return self.nonfinite > 0 or (self.over_fp16 > 0 and self.dtype == "float16")

    def range_text(self) -> str:
        text = f"tensor {self.name}: original range [{self.ref_min:.4g}, {self.ref_max:.4g}]"
        if self.over_fp16:
            text += f", {self.over_fp16} value(s) |x| > {FP16_MAX:g} (FP16 max)"
        if self.nonfinite:
            text += f"; candidate ({self.dtype}) has {self.nonfinite} inf/nan there"
        return text


@dataclass
class NodeError:
    """One candidate node: the error at its inputs and outputs and what it adds."""

    node: str
    op: str
    kind: str  # fused_node | cast (added by precision) | keep_fp32 (kept FP32 in a low-precision model) | node
    depth: int  # topological index in the candidate graph
    inputs: list[str]  # compared tensors it reads (candidate names)
    outputs: list[str]  # compared tensors it writes (candidate names)
    err_in: float
    err_out: float
    rule: str = ""
    replaced: list[str] = field(default_factory=list)

    @property
    def growth(self) -> float:
        if np.isinf(self.err_out):
            return 0.0 if np.isinf(self.err_in) else float("inf")
        return self.err_out - self.err_in


@dataclass
class PerNodeResult:
    tensors: dict[str, TensorError]  # by candidate name
    nodes: list[NodeError]  # candidate order
    mode: str  # the candidate's precision
    iterations: int
    seed: int
    chunks: int
    chunk_size: int
    original: str = ""
    candidate: str = ""
    #: what the comparison left out (verify's padded queries, padding.padded_positions); "" when nothing
    left_out: str = ""

    @property
    def fused(self) -> list[NodeError]:
        return [n for n in self.nodes if n.kind == "fused_node"]


def compare_per_node(original: ModelSource, candidate: ModelSource, options: VerifyOptions | None = None,
                     iterations: int = DEFAULT_ITERATIONS, seed: int = 0, feeds: Feeds | None = None,
                     chunk_size: int = DEFAULT_CHUNK_SIZE,
                     on_chunk: Callable[[int, int], None] | None = None) -> PerNodeResult:
    """Compare every tensor the two models share (module doc), `chunk_size` tensors per run.

    Models given as paths run from their files (weights stay there); in-memory models whose
    weights are on disk must be given as paths. `on_chunk(i, n)` is called before chunk i of n."""
    if chunk_size < 1:
        raise InputError(f"chunk size must be >= 1, got {chunk_size}")
    ref_model = original if isinstance(original, onnx.ModelProto) else _load_graph(original)
    cand_model = candidate if isinstance(candidate, onnx.ModelProto) else _load_graph(candidate)
    plans, feeds = _plans_and_feeds(ref_model, options, iterations, seed, feeds)
    _check_candidate_inputs(plans, cand_model)
    mode = precision_of(cand_model)
    runnable, _ = _runnable(candidate, cand_model)
    if isinstance(runnable, onnx.ModelProto):
        cand_model = runnable
    mapping = tensor_map(ref_model, cand_model)
    names = list(mapping)  # candidate order
    chunks = [names[i:i + chunk_size] for i in range(0, len(names), chunk_size)]
    _prepare_polygraphy()
    tensors: dict[str, TensorError] = {}
    views = padded_query_inputs(cand_model)  # positions the fused attention is not exact at: as verify leaves out
    shapes = named_shapes(infer_shapes(ref_model)) if views else {}
    narrowed = 0
    ref_targets = [t for chunk in chunks for t in dict.fromkeys(mapping[c] for c in chunk)]
    with _Segments("original", original, ref_model, ref_targets) as ref_src, \
            _Segments("candidate", candidate, cand_model, list(mapping)) as cand_src:
        ref_src.start(feeds)
        cand_src.start(feeds)
        for i, chunk in enumerate(chunks):
            if on_chunk is not None:
                on_chunk(i, len(chunks))
            ref = ref_src.run(list(dict.fromkeys(mapping[c] for c in chunk)))
            got = cand_src.run(chunk)
            for c in chunk:
                if mapping[c] not in ref or c not in got:
                    continue
                r, g = ref[mapping[c]], got[c]
                keep, _, axis = padded_positions(shapes, mapping[c], views, feeds, r, g, by_size=True)
                narrow = keep is not None and not all(k.all() for k in keep)
                if narrow:
                    r = [at_positions(x, k, axis) for x, k in zip(r, keep)]
                    g = [at_positions(x, k, axis) for x, k in zip(g, keep)]
                err = tensor_error(mapping[c], c, r, g)
                if err is not None:
                    tensors[c] = err
                    narrowed += narrow
            del ref, got
    nodes = node_errors(cand_model, mapping, tensors, mode, {n.name for n in ref_model.graph.node})
    left_out = (f"padded queries that see no real key of {' or '.join(sorted(views))} left out of {narrowed} "
                "tensors indexed by its [batch, sequence], as verify leaves them out" if narrowed else "")
    return PerNodeResult(tensors, nodes, mode, len(feeds), seed, len(chunks), chunk_size,
                         _label(original), _label(candidate), left_out)


# ------------------------------------------------------------------------------------------------
# Which tensors stand for which
# ------------------------------------------------------------------------------------------------
def tensor_map(original: onnx.ModelProto, candidate: onnx.ModelProto) -> dict[str, str]:
    """Candidate tensor -> the original tensor it stands for, in the candidate's node order (module doc)."""
    produced = _produced(original)
    orig_nodes = {n.name: n for n in original.graph.node if n.name}
    cand_casts = {n.output[0]: n for n in candidate.graph.node if n.op_type == "Cast" and n.name not in orig_nodes}
    out: dict[str, str] = {}
    for node in candidate.graph.node:
        if node.op_type in _NOT_COMPARED_OPS or _casts_to(node, onnx.TensorProto.BFLOAT16):
            continue  # (NumPy holds no BF16 array: the BF16 emulation's rounding step is not fetched)
        twin = orig_nodes.get(node.name)
        for j, t in enumerate(node.output):
            if not t:
                continue
            if t in produced:
                out[t] = t
            elif twin is not None and j < len(twin.output) and twin.output[j] in produced \
                    and twin.op_type == node.op_type:
                out[t] = twin.output[j]
    # a precision Cast: each side stands for the tensor on its other side (chains resolve in order)
    cand_produced = _produced(candidate)
    bf16 = {n.output[0] for n in candidate.graph.node if _casts_to(n, onnx.TensorProto.BFLOAT16)}
    for _ in range(2):
        for t, cast in cand_casts.items():
            src = cast.input[0]
            if t in bf16 or src in bf16:
                continue
            if t in out and src not in out and src in cand_produced:
                out[src] = out[t]
            elif src in out and t not in out:
                out[t] = out[src]
    order = {t: i for i, n in enumerate(candidate.graph.node) for t in n.output}
    return dict(sorted(out.items(), key=lambda kv: order.get(kv[0], -1)))


def _casts_to(node: onnx.NodeProto, dtype: int) -> bool:
    return node.op_type == "Cast" and any(a.name == "to" and a.i == dtype for a in node.attribute)


def _produced(model: onnx.ModelProto) -> set[str]:
    return {t for n in model.graph.node if n.op_type not in _NOT_COMPARED_OPS for t in n.output if t}


# ------------------------------------------------------------------------------------------------
# Errors per tensor and per node
# ------------------------------------------------------------------------------------------------
def tensor_error(name: str, candidate: str, ref: Sequence[np.ndarray], got: Sequence[np.ndarray]) -> TensorError | None:
    """Max abs / max rel error over every feed (inf where the candidate is inf/nan and the original
    finite); None for a tensor that is not floating point or whose shape differs.

    A mask sentinel (|x| >= 1e38, e.g. finfo(float32).min added to masked attention scores) that the
    candidate holds as a value of at least 1e4 (or inf) of the same sign means the same thing: it is
    left out of the errors, the range and the overflow count."""
    max_abs = max_rel = 0.0
    lo, hi = np.inf, -np.inf
    over = nonfinite = 0
    dtype = ""
    for r, g in zip(ref, got):
        r, g = np.asarray(r), np.asarray(g)
        if r.dtype.kind != "f" or g.dtype.kind != "f" or r.shape != g.shape:
            return None
        dtype = g.dtype.name
        r64, g64 = r.astype(np.float64), g.astype(np.float64)
        with np.errstate(invalid="ignore"):
            sentinel = (np.abs(r64) >= SENTINEL) & (np.sign(g64) == np.sign(r64)) & (np.abs(g64) >= SATURATED)
        finite = np.isfinite(r64) & ~sentinel
        bad = finite & ~np.isfinite(g64)
        nonfinite += int(bad.sum())
        if finite.any():
            lo, hi = min(lo, float(r64[finite].min())), max(hi, float(r64[finite].max()))
        over += int((np.abs(r64[finite]) > FP16_MAX).sum())
        both = finite & np.isfinite(g64)
        if both.any():
            diff = np.abs(r64[both] - g64[both])
            max_abs = max(max_abs, float(diff.max()))
            max_rel = max(max_rel, float((diff / np.maximum(np.abs(r64[both]), 1e-30)).max()))
    if nonfinite:
        max_abs = max_rel = float("inf")
    if lo > hi:
        lo = hi = float("nan")
    return TensorError(name, candidate, max_abs, max_rel, lo, hi, over, nonfinite, dtype)


def node_errors(candidate: onnx.ModelProto, mapping: dict[str, str], tensors: dict[str, TensorError], mode: str,
                original_nodes: set[str]) -> list[NodeError]:
    """A record per candidate node that writes a compared tensor (a fused node also by the nodes it
    added after itself, ``<node>/..._after_<k>``, which give back what it computed). `original_nodes`:
    the original's node names (a Cast the original lacks is the precision stage's)."""
    zero = {i.name for i in candidate.graph.input} | {i.name for i in candidate.graph.initializer}
    known = {c: tensors[c] for c in mapping if c in tensors}
    after: dict[str, list[str]] = {}
    for n in candidate.graph.node:
        if n.name.startswith("optfuse/") and n.name.count("/") >= 3:
            after.setdefault(n.name.rsplit("/", 1)[0], []).extend(t for t in n.output if t in known)
    records = []
    for depth, node in enumerate(candidate.graph.node):
        if (node.domain != DOMAIN and node.name.startswith("optfuse/")) or _BF16_ROUND in node.name:
            continue  # added by a fusion (before or after it) or by the BF16 emulation: counted with its node
        outs = [t for t in node.output if t in known]
        outs += [t[:-len(_FP32_SUFFIX)] for t in node.output  # the BF16-rounded value the emulation gives on
                 if t.endswith(_FP32_SUFFIX) and t[:-len(_FP32_SUFFIX)] in known]
        if node.domain == DOMAIN:
            outs += after.get(node.name, [])
        if not outs:
            continue
        ins = list(dict.fromkeys(t for t in node.input if t in known))
        err_in = max([known[t].max_abs for t in ins] + [0.0 for t in node.input if t in zero], default=0.0)
        err_out = max(known[t].max_abs for t in outs)
        rec = NodeError(node.name, node.op_type, _kind(node, outs, known, mode, original_nodes), depth,
                        ins, list(dict.fromkeys(outs)), err_in, err_out)
        if node.domain == DOMAIN:
            rec.rule, rec.replaced = fused_node_facts(node)
        records.append(rec)
    return records


def _kind(node: onnx.NodeProto, outs: list[str], known: dict[str, TensorError], mode: str,
          original_nodes: set[str]) -> str:
    if node.domain == DOMAIN:
        return "fused_node"
    if node.op_type == "Cast" and node.name not in original_nodes and not node.name.startswith("optfuse/"):
        return "cast"
    if mode == "bf16":  # run emulated: a BF16 output was renamed <name>/fp32 and rounded into <name>
        from .emulate import _VALUE_PRESERVING

        kept = not any(t.endswith(_FP32_SUFFIX) for t in node.output) and node.op_type not in _VALUE_PRESERVING
    else:
        kept = mode != "fp32" and all(known[t].dtype == "float32" for t in outs)
    if kept and node.op_type != "Cast":
        return "keep_fp32"
    return "node"


def fused_node_facts(node: onnx.NodeProto) -> tuple[str, list[str]]:
    """(rule id, replaced original node names) of a fused node: its metadata, else its name."""
    meta = {p.key: p.value for p in node.metadata_props}
    rule = meta.get(RULE_KEY) or (node.name.split("/")[1] if node.name.count("/") >= 2 else "")
    try:
        replaced = list(json.loads(meta.get(REPLACED_KEY, "[]")))
    except ValueError:
        replaced = []
    return rule, replaced


# ------------------------------------------------------------------------------------------------
# Running a model with some of its tensors as outputs
# ------------------------------------------------------------------------------------------------
class _Segments:
    """A model run one segment at a time: each call computes some of its tensors, running only the
    nodes no earlier call ran, fed with the tensors earlier calls left that later nodes still read
    (the live set). Every node runs once over all calls.

    A model whose weights are in external files is written (graph only) into a scratch folder
    beside links to those files, so onnxruntime reads the weights from where they are."""

    def __init__(self, label: str, src: ModelSource, model: onnx.ModelProto, targets: Iterable[str]):
        self.label, self.model = label, model
        self.base = Path(src).parent if isinstance(src, (str, os.PathLike)) else None
        self._tmp: tempfile.TemporaryDirectory | None = None
        g = model.graph
        self.producer = {t: n for n in g.node for t in n.output if t}
        self.readers: dict[str, list[int]] = {}
        for n in g.node:
            for t in {*n.input, *_subgraph_reads(n)} - {""}:
                self.readers.setdefault(t, []).append(id(n))
        self.constants = {i.name for i in g.initializer}
        self.typed = {v.name: v for v in [*g.value_info, *g.output]}
        self.pending = Counter(targets)  # target -> the calls still to ask for it
        self.done: set[int] = set()
        self.live: dict[str, list[np.ndarray]] = {}

    def __enter__(self) -> _Segments:
        locations = {ExternalDataInfo(t).location for t in self.model.graph.initializer if uses_external_data(t)}
        if locations:
            if self.base is None:
                raise InputError(f"the {self.label} model keeps weights in external files: give it as a path")
            self._tmp = tempfile.TemporaryDirectory(prefix="optfuse-per-node-")
            for loc in locations:
                link = Path(self._tmp.name) / loc
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to((self.base / loc).resolve())
        return self

    def __exit__(self, *exc) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()

    def start(self, feeds: Feeds) -> None:
        self.live = {i.name: [f[i.name] for f in feeds] for i in self.model.graph.input if i.name in feeds[0]}

    def run(self, targets: Sequence[str]) -> dict[str, list[np.ndarray]]:
        """Every feed's value of each of `targets`."""
        nodes = self._nodes_for(targets)
        self.done.update(id(n) for n in nodes)
        made = {t for n in nodes for t in n.output if t}
        reads = [t for n in nodes for t in [*n.input, *_subgraph_reads(n)] if t in self.live and t not in made]
        keep = [t for t in made if t in self.pending or any(r not in self.done for r in self.readers.get(t, ()))]
        outputs = list(dict.fromkeys([*(t for t in targets if t in made), *keep]))
        if nodes:
            values = self._infer(nodes, list(dict.fromkeys(reads)), outputs)
            self.live.update((t, values[t]) for t in keep)
        else:
            values = {}
        found = {t: values[t] if t in values else self.live[t] for t in targets if t in values or t in self.live}
        for t in set(targets):
            self.pending[t] -= 1
            if self.pending[t] <= 0:
                del self.pending[t]
        self.live = {t: v for t, v in self.live.items()
                     if t in self.pending or any(r not in self.done for r in self.readers.get(t, ()))}
        return found

    def _nodes_for(self, targets: Sequence[str]) -> list[onnx.NodeProto]:
        keep: set[int] = set()
        seen: set[str] = set()
        stack = list(targets)
        while stack:
            t = stack.pop()
            if t in seen or t in self.live or t in self.constants:
                continue
            seen.add(t)
            node = self.producer.get(t)
            if node is not None and id(node) not in keep and id(node) not in self.done:
                keep.add(id(node))
                stack.extend(i for i in [*node.input, *_subgraph_reads(node)] if i)
        return [n for n in self.model.graph.node if id(n) in keep]

    def _infer(self, nodes: list[onnx.NodeProto], inputs: list[str], outputs: list[str]) -> dict[str, list[np.ndarray]]:
        from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx

        g = self.model.graph
        needed = {t for n in nodes for t in [*n.input, *_subgraph_reads(n)]}
        graph = onnx.helper.make_graph(
            nodes, g.name, [_value_info(t, self.live[t]) for t in inputs],
            [self.typed[t] if t in self.typed else onnx.ValueInfoProto(name=t) for t in outputs],
            [i for i in g.initializer if i.name in needed],
            value_info=[v for v in g.value_info if v.name in needed and v.name not in set(outputs)])
        sub = onnx.helper.make_model(graph, opset_imports=list(self.model.opset_import),
                                     ir_version=self.model.ir_version)
        sub.functions.extend(self.model.functions)
        src: str | bytes = sub.SerializeToString()
        if self._tmp is not None:
            path = Path(self._tmp.name) / "segment.onnx"
            path.write_bytes(src)
            src = str(path)
        n_feeds = len(next(iter(self.live.values()))) if self.live else 1
        try:
            session = SessionFromOnnx(src, providers=["cpu"])()
            with OnnxrtRunner(session, name=self.label) as runner:
                runs = [runner.infer({t: self.live[t][i] for t in inputs}) for i in range(n_feeds)]
        except Exception as exc:
            raise VerificationError(f"onnxruntime could not run a segment of the {self.label} model: "
                                    f"{_first_line(exc)}") from None
        return {t: [r[t] for r in runs] for t in outputs}


def _value_info(name: str, values: list[np.ndarray]) -> onnx.ValueInfoProto:
    """A graph input typed like its values (a dim that differs between feeds left symbolic)."""
    shapes = {v.shape for v in values}
    dims = [d if all(s[k] == d for s in shapes) else None for k, d in enumerate(values[0].shape)]
    return onnx.helper.make_tensor_value_info(name, onnx.helper.np_dtype_to_tensor_dtype(values[0].dtype), dims)


def _subgraph_reads(node: onnx.NodeProto) -> list[str]:
    """Names a node's subgraphs (If/Loop/Scan bodies) read from the outer graph."""
    names: list[str] = []
    for a in node.attribute:
        for sg in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
            names.extend(i for n in sg.node for i in n.input if i)
            for n in sg.node:
                names.extend(_subgraph_reads(n))
    return names


def _label(src: ModelSource) -> str:
    return str(src) if isinstance(src, (str, os.PathLike)) else "<in memory>"


# ------------------------------------------------------------------------------------------------
# Attribution
# ------------------------------------------------------------------------------------------------
@dataclass
class Offender:
    """One ranked source of error: a fused node, a precision Cast, a node kept in FP32, or (in a
    reduced-precision candidate) an unfused node computing in that precision."""

    kind: str  # fused_node | cast | keep_fp32 | node
    name: str
    growth: float
    detail: str
    depth: int = 0
    overflow: list[str] = field(default_factory=list)  # tensors this node made overflow (candidate names)


def attribute(result: PerNodeResult) -> list[Offender]:
    """Fused nodes and precision decisions ranked by the error they add (growth), largest first; a
    node whose output overflows FP16 (inf/nan where the original is finite) ranks first, with the
    tensor and its original range in the detail. Unfused nodes count only in a reduced-precision
    candidate (in FP32 they compute what the original computes)."""
    items = []
    for n in result.nodes:
        if n.kind == "node" and result.mode == "fp32":
            continue
        inputs_bad = any(result.tensors[t].overflow for t in n.inputs)
        overflowed = [] if inputs_bad else [t for t in n.outputs if result.tensors[t].overflow]
        parts = [f"max abs error {_num_text(n.err_in)} at its inputs -> {_num_text(n.err_out)} at its outputs"]
        if n.kind == "fused_node":
            parts.insert(0, f"{n.op} ({n.rule}) replacing {len(n.replaced)} node(s)"
                         + (f": {', '.join(n.replaced[:4])}{' ...' if len(n.replaced) > 4 else ''}" if n.replaced else ""))
        elif n.kind == "cast":
            parts.insert(0, f"precision Cast of {', '.join(result.tensors[t].name for t in n.outputs)}")
        elif n.kind == "keep_fp32":
            parts.insert(0, f"{n.op} kept in FP32")
        else:
            parts.insert(0, f"{n.op} in {result.mode}")
        parts += [result.tensors[t].range_text() for t in overflowed]
        items.append(Offender(n.kind, n.node, n.growth, "; ".join(parts), n.depth, overflowed))
    return sorted(items, key=lambda o: (not o.overflow, -o.growth if not np.isnan(o.growth) else 0.0, o.depth))


def _num_text(x: float) -> str:
    return f"{x:.3g}" if np.isfinite(x) else str(x)
