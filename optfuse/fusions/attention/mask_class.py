"""Attention masks: what an additive mask tensor *is* (none, causal, padding, window, block, bias).

The fused op takes an additive bias and a ``causal`` flag, so the attention rules need to know
what the exported mask computes. Exporters write the same mask in many ways (TorchScript:
Range/Unsqueeze/LessOrEqual/Expand/Where chains; dynamo: vmap'd GatherND index arithmetic; old
transformers: ``(1 - mask) * finfo.min``; static-shape exports: a folded constant), so the mask is
classified by what it evaluates to, not by how it is spelled:

- a **constant** mask is classified from its value;
- a mask whose value depends only on **shapes** (causal masks built from ``Range(seq_len)``) is
  evaluated at a few sequence lengths;
- a mask whose inputs carry a **past** (decode graphs: a ``past_key_values`` input [B, H, past, D],
  or an ``attention_mask`` whose length is not the query length) is evaluated at (Sq, past) pairs
  with Sq = 1 and Sq > 1, every input's dims consistent with that pair (query dims Sq, cache dims
  past, the mask's key axis past + Sq), and classified with Sk = past + Sq (see `dim_roles`);
- a mask whose value depends on **one mask-like graph input** (``attention_mask``, [batch, seq]) is
  evaluated with that input all ones (the *base* mask) and with right-padded, left-padded and random
  0/1 rows over all Sk keys (at each padding probe shape: Sq = 1 and Sq > 1 when there is a past),
  and accepted as "base + key padding" only if every probe equals
  ``where(attention_mask[b, j], base, F)`` for one fill value F;
- anything else (a bias computed from hidden states, several inputs, ...) is ``dynamic``.

A causal or sliding-window mask that reads a constant buffer of n x n (GPT-Neo's
``bias[:, :, Sk - Sq:Sk, :Sk]``) must have that pattern at every size up to n (`_sweep_buffer`),
not only at the probe sizes; otherwise it is ``block`` (a size where it differs) or ``dynamic``
(n past MAX_PROBE_SEQ). Where a padded key is masked by the base as well, its value may differ
from the padding's fill (finfo.min + finfo.min = -inf): only where the base allows the key must
the padding write one fill.

Probes run the mask's own subgraph in onnxruntime (nodes that feed it only through Shape/Size get
zero-filled stand-ins for large weights; optfuse nodes already in it run their reference
functions). Classes of the base mask over the last two axes (allowed = 0, masked <= -1e30 or -inf):

    none            every entry 0
    causal          allowed iff j <= i + (Sk - Sq)  (the op's causal flag)
    sliding_window  causal and j > i + (Sk - Sq) - w
    block           any other 0 / masked structure
    bias            finite non-zero values (position biases such as T5's)

plus ``+padding`` when the mask input adds key padding. ``unknown`` when a probe could not run.

(One module past 500 lines: the value classes, the subgraph extraction and the probes are one
analysis sharing the private region and probe-shape types.)
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ... import DOMAIN
from ...ir.query import const_value

log = logging.getLogger(__name__)

#: An additive value at or below this masks a score: it absorbs any finite fp32 score.
MASKED = -1e30


def masked_below(dtype) -> float:
    """The masking threshold for a dtype: fp16 masks use finfo(float16).min = -65504."""
    return -3.0e4 if np.dtype(dtype) == np.float16 else MASKED
#: Probe sizes (sequence lengths) and the probe batch.
PROBE_SEQ = (5, 12)
PROBE_BATCH = 3
#: Probe (Sq, past) pairs of masks whose inputs carry a past: decode, chunked prefill, a long chunk.
PROBE_PAST = ((1, 11), (5, 7), (12, 3))
#: Of those, the pairs the key-padding probes run at (one query; several queries).
PADDING_PAST = ((1, 11), (5, 7))
#: The past of the extra wide probe (sliding windows) when the mask has one.
WIDE_PAST = 2
#: Largest extra probe made to rule out a sliding window wider than PROBE_SEQ.
MAX_PROBE_SEQ = 4100
#: Subgraphs larger than this are not probed (class "unknown").
MAX_PROBE_NODES = 4000
#: Constants above this size that only feed shapes are replaced by zero-filled stand-ins.
STANDIN_BYTES = 1 << 20

_SHAPE_OPS = {"Shape", "Size"}
_CACHE_NAME = re.compile(r"past|cache|key_values", re.IGNORECASE)
# ops whose scalar integer constants may be window sizes / offsets
_ARITH = {"Add", "Sub", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Equal", "Max", "Min", "Mod", "Div"}


@dataclass
class MaskClass:
    """What a mask evaluates to.

    base: none | causal | sliding_window | block | bias | dynamic | unknown
    padding: the mask input adds key padding (``where(mask[b, j], base, fill)``)
    window: the sliding window width (keys i - w < j <= i), when base is sliding_window
    source: the graph input the padding comes from
    fully_masked_rows: the base mask has rows with no allowed key
    """

    base: str
    padding: bool = False
    window: int | None = None
    source: str | None = None
    fully_masked_rows: bool = False
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        if self.padding:
            return "padding" if self.base == "none" else self.base + "+padding"
        return self.base


# ------------------------------------------------------------------------------------------------
# Classification of values
# ------------------------------------------------------------------------------------------------
def classify_base(a: np.ndarray) -> MaskClass:
    """Class of a mask value (additive, broadcast over leading axes) over its last two axes."""
    a = np.asarray(a)
    if a.ndim < 2:
        a = a.reshape((1,) * (2 - a.ndim) + a.shape)
    if a.size == 0:
        return MaskClass("none")
    allowed = a == 0
    if not np.all(allowed | _is_masked(a)):
        return MaskClass("bias")
    sq, sk = a.shape[-2:]
    planes = allowed.reshape(-1, sq, sk)
    al = planes[0]
    if not all(np.array_equal(al, p) for p in planes[1:]):
        return MaskClass("block", fully_masked_rows=bool((~planes).all(-1).any()))
    dead = bool((~al).all(-1).any())
    if al.all():
        return MaskClass("none")
    if np.array_equal(al, _allowed_keys(sq, sk)):
        return MaskClass("causal")
    w = int(al.sum(-1).max())
    if 0 < w and np.array_equal(al, _allowed_keys(sq, sk, w)):
        return MaskClass("sliding_window", window=w)
    return MaskClass("block", fully_masked_rows=dead)


def _allowed_keys(sq: int, sk: int, window: int | None = None) -> np.ndarray:
    """[sq, sk] keys a causal mask (query i at position i + Sk - Sq sees j <= it) allows; with
    ``window``, the sliding window's (and j > that position - window)."""
    i = np.arange(sq)[:, None] + (sk - sq)
    j = np.arange(sk)[None, :]
    return (j <= i) & (j > i - window) if window else j <= i


def _merge_sizes(classes: Sequence[MaskClass]) -> MaskClass:
    """One class from the probes at several sequence lengths (they must agree)."""
    names = {(c.base, c.window) for c in classes}
    if len(names) == 1:
        c = classes[0]
        return MaskClass(c.base, window=c.window, fully_masked_rows=any(x.fully_masked_rows for x in classes))
    bases = {c.base for c in classes}
    if bases <= {"causal", "sliding_window"}:
        # a window wider than the small probes looks causal there
        w = {c.window for c in classes if c.base == "sliding_window"}
        if len(w) == 1:
            return MaskClass("sliding_window", window=w.pop())
    if "bias" in bases:
        return MaskClass("bias")
    return MaskClass("block", fully_masked_rows=any(c.fully_masked_rows for c in classes))


def _merge_probes(values: Sequence[np.ndarray]) -> MaskClass:
    """One class from the base mask at every probe shape.

    A one-row probe (Sq = 1) cannot tell causal from none (its one query sees every key), so the
    probes with several query rows decide the class and each one-row probe must agree with it:
    its row is the class's last row (`_last_row_allowed`); a disagreement merges the two.
    """
    classes = [classify_base(v) for v in values]
    one_row = [np.ndim(v) < 2 or np.shape(v)[-2] == 1 for v in values]
    rows = [c for c, one in zip(classes, one_row) if not one]
    if not rows or len(rows) == len(classes):
        return _merge_sizes(classes)
    merged = _merge_sizes(rows)
    for c, v, one in zip(classes, values, one_row):
        if not one:
            continue
        expected = _last_row_allowed(merged, np.shape(v)[-1])
        agrees = c.base != "bias" and (expected is None or np.array_equal(np.asarray(v) == 0,
                                                                           np.broadcast_to(expected, np.shape(v))))
        if not agrees:
            return _merge_sizes([merged, c])
    return merged


def _last_row_allowed(cls: MaskClass, sk: int) -> np.ndarray | None:
    """The keys the last query row of a mask of this class allows (None: the class does not say)."""
    if cls.base in ("none", "causal"):
        return np.ones(sk, dtype=bool)
    if cls.base == "sliding_window" and cls.window:
        return _allowed_keys(1, sk, cls.window)[0]
    return None


# ------------------------------------------------------------------------------------------------
# Subgraph extraction and probing
# ------------------------------------------------------------------------------------------------
@dataclass
class _Region:
    nodes: list[gs.Node]  # topological order
    inputs: list[gs.Variable]  # graph inputs the subgraph reads
    value_inputs: list[gs.Variable]  # graph inputs whose *values* matter
    shape_only: set[int]  # ids of nodes reached only through Shape/Size
    int_constants: list[int]  # scalar integer constants feeding arithmetic in the value region
    buffer_size: int = 0  # largest min(last two dims) of a >= 2-D constant read by value (a mask buffer)


def _region(graph: gs.Graph, sources: Sequence[gs.Tensor], order: dict[int, int]) -> _Region | str:
    graph_inputs = {id(t) for t in graph.inputs}
    all_nodes: dict[int, gs.Node] = {}
    value_nodes: set[int] = set()
    inputs: dict[int, gs.Variable] = {}
    value_inputs: dict[int, gs.Variable] = {}
    # (tensor, reached by value?)
    stack: list[tuple[gs.Tensor, bool]] = [(t, True) for t in sources if not isinstance(t, gs.Constant)]
    seen: set[tuple[int, bool]] = set()
    while stack:
        t, by_value = stack.pop()
        key = (id(t), by_value)
        if key in seen or isinstance(t, gs.Constant):
            continue
        seen.add(key)
        if not t.inputs:
            if id(t) in graph_inputs:
                inputs[id(t)] = t
                if by_value:
                    value_inputs[id(t)] = t
            elif t.name:
                return f"mask tensor {t.name!r} has no producer and is not a graph input"
            continue
        node = t.inputs[0]
        if any(isinstance(v, gs.Graph) for v in node.attrs.values()):
            return f"mask is computed inside a {node.op} subgraph"
        all_nodes[id(node)] = node
        if len(all_nodes) > MAX_PROBE_NODES:
            return f"mask subgraph has more than {MAX_PROBE_NODES} nodes"
        if by_value:
            value_nodes.add(id(node))
        child_value = by_value and node.op not in _SHAPE_OPS
        for x in node.inputs:
            if x.name:
                stack.append((x, child_value))
    nodes = sorted(all_nodes.values(), key=lambda n: order.get(id(n), 1 << 60))
    ints: list[int] = []
    buffer = 0
    for n in nodes:
        if id(n) not in value_nodes:
            continue
        for x in n.inputs:
            v = const_value(x)
            if v is None:
                continue
            if n.op in _ARITH and v.size == 1 and np.issubdtype(v.dtype, np.integer):
                ints.append(int(v.reshape(())))
            if v.ndim >= 2 and min(v.shape[-2:]) > 1:
                buffer = max(buffer, int(min(v.shape[-2:])))
    shape_only = {id(n) for n in nodes if id(n) not in value_nodes}
    return _Region(nodes, list(inputs.values()), list(value_inputs.values()), shape_only, ints, buffer)


def _probe_model(graph: gs.Graph, region: _Region, outputs: Sequence[gs.Tensor]) -> onnx.ModelProto:
    """A standalone model computing `outputs` from the region.

    Big constants read only by shape-only nodes (e.g. the embedding table behind ``Shape(embeds)``)
    become ``ConstantOfShape`` zeros: their values cannot matter there.
    """
    from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter

    node_protos = []
    consts: dict[str, gs.Constant] = {}
    value_users: set[str] = set()
    for n in region.nodes:
        if id(n) in region.shape_only and _big_gather(n):
            node_protos.extend(_gather_standin(n))  # only its output's shape matters
            continue
        node_protos.append(OnnxExporter.export_node(n))
        for x in n.inputs:
            if isinstance(x, gs.Constant):
                consts[x.name] = x
                if id(n) not in region.shape_only:
                    value_users.add(x.name)
    inits, stubs = [], []
    for name, c in consts.items():
        if name not in value_users and c.values.nbytes > STANDIN_BYTES:
            zero = onnx.numpy_helper.from_array(np.zeros((1,), dtype=c.values.dtype), "value")
            shape = onnx.numpy_helper.from_array(np.array(c.shape, dtype=np.int64), f"{name}__shape")
            inits.append(shape)
            stubs.append(onnx.helper.make_node("ConstantOfShape", [shape.name], [name], value=zero,
                                               name=f"{name}__standin"))
        else:
            inits.append(OnnxExporter.export_tensor_proto(c))
    ins = [OnnxExporter.export_value_info_proto(t, do_type_check=False) for t in region.inputs]
    outs = [onnx.helper.make_tensor_value_info(t.name, _onnx_dtype(t), None) for t in outputs]
    g = onnx.helper.make_graph(stubs + node_protos, "mask_probe", ins, outs, inits)
    opsets = [onnx.helper.make_opsetid("", graph.opset)]
    for d in graph.import_domains or []:
        if d.domain not in ("", "ai.onnx") and d.domain != DOMAIN:
            opsets.append(onnx.helper.make_opsetid(d.domain, d.version))
    model = onnx.helper.make_model(g, opset_imports=opsets)
    model.ir_version = 9
    if any(n.domain == DOMAIN for n in model.graph.node):
        from ...rewrite import add_functions

        add_functions(model)
    return model


def _big_gather(n: gs.Node) -> bool:
    return (n.op == "Gather" and isinstance(n.inputs[0], gs.Constant) and n.inputs[0].values.nbytes > STANDIN_BYTES
            and len(n.outputs) == 1)


def _gather_standin(n: gs.Node) -> list[onnx.NodeProto]:
    """Zeros shaped like Gather(table, idx)'s output, without the table (e.g. a 128k-row embedding)."""
    table, idx, out = n.inputs[0], n.inputs[1], n.outputs[0]
    axis = int(n.attrs.get("axis", 0)) % len(table.shape)
    pre = np.array(table.shape[:axis], np.int64)
    post = np.array(table.shape[axis + 1:], np.int64)
    base = f"{out.name}__standin"
    mk = onnx.helper.make_node
    return [
        mk("Shape", [idx.name], [f"{base}_idx"]),
        mk("Constant", [], [f"{base}_pre"], value=onnx.numpy_helper.from_array(pre, f"{base}_pre")),
        mk("Constant", [], [f"{base}_post"], value=onnx.numpy_helper.from_array(post, f"{base}_post")),
        mk("Concat", [f"{base}_pre", f"{base}_idx", f"{base}_post"], [f"{base}_shape"], axis=0),
        mk("ConstantOfShape", [f"{base}_shape"], [out.name],
           value=onnx.numpy_helper.from_array(np.zeros((1,), dtype=table.values.dtype), "value")),
    ]


def _onnx_dtype(t: gs.Tensor) -> int:
    if isinstance(t.dtype, int):
        return t.dtype
    if t.dtype is None:
        return onnx.TensorProto.FLOAT
    return onnx.helper.np_dtype_to_tensor_dtype(np.dtype(t.dtype))


def _session(model: onnx.ModelProto):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _run(model: onnx.ModelProto, feeds_list: Sequence[dict[str, np.ndarray]]) -> list[list[np.ndarray]]:
    sess = _session(model)
    return [sess.run(None, f) for f in feeds_list]


def _np_dtype(t: gs.Tensor):
    dt = t.dtype
    if isinstance(dt, int):
        return onnx.helper.tensor_dtype_to_np_dtype(dt)
    return np.dtype(dt)


@dataclass(frozen=True)
class ProbeShape:
    """The sizes one probe feeds: batch, query length Sq and past (cached keys); Sk = past + Sq."""

    batch: int
    query: int
    past: int = 0

    @property
    def keys(self) -> int:
        return self.past + self.query


def dim_roles(inputs: Sequence[gs.Variable], mask_input: gs.Variable | None) -> dict[str, str]:
    """Symbolic dim name -> ``batch`` | ``query`` | ``past`` | ``keys``: which probe size it takes.

    batch: a leading dim; past: the sequence dim (axis 2) of a 4-D input ([B, H, past, D], a KV
    cache) that no 2-D input has (when such dims of several inputs differ, those whose input or dim
    name says past / cache, e.g. ``past_key_values.0.key``); keys: the mask input's last dim when no
    other input has it; query: any other. A past or keys dim with no other sequence dim beside it
    cannot be told from the query length and is a query dim (Sk = Sq).
    """
    roles: dict[str, str] = {}
    for t in inputs:
        if t.shape and isinstance(t.shape[0], str):
            roles[t.shape[0]] = "batch"
    two_d = {d for t in inputs if t.shape and len(t.shape) == 2 for d in t.shape if isinstance(d, str)}
    cache_dims: dict[str, bool] = {}  # 4-D sequence dim -> named like a cache
    for t in inputs:
        d = t.shape[2] if t.shape and len(t.shape) == 4 else None
        if isinstance(d, str) and d not in roles and d not in two_d:
            cache_dims[d] = cache_dims.get(d, False) or bool(_CACHE_NAME.search(f"{t.name} {d}"))
    named = [d for d, by_name in cache_dims.items() if by_name]
    for d in named or cache_dims:
        roles[d] = "past"
    for t in inputs:
        for d in t.shape or ():
            if isinstance(d, str) and d not in roles and t is not mask_input:
                roles[d] = "query"
    key = mask_input.shape[-1] if mask_input is not None and mask_input.shape else None
    if isinstance(key, str) and key not in roles:
        roles[key] = "keys"
    for d in (mask_input.shape or ()) if mask_input is not None else ():
        if isinstance(d, str) and d not in roles:
            roles[d] = "query"
    sequence = [d for d, r in roles.items() if r != "batch"]
    if len(sequence) == 1:
        roles[sequence[0]] = "query"
    return roles


def _feeds(region: _Region, roles: dict[str, str], shape: ProbeShape, mask_input: gs.Variable | None,
           mask_rows: np.ndarray | None) -> dict[str, np.ndarray]:
    """One probe's inputs: every symbolic dim at its role's size, the mask input all ones (or
    `mask_rows`), the rest zeros."""
    size = {"batch": shape.batch, "query": shape.query, "past": shape.past, "keys": shape.keys}
    feeds = {}
    for t in region.inputs:
        if t.shape is None:
            raise ValueError(f"input {t.name!r} has no shape")
        dims = [int(d) if isinstance(d, (int, np.integer)) and d >= 0 else size[roles.get(d, "query")]
                for d in t.shape]
        dt = _np_dtype(t)
        if t is mask_input and mask_rows is not None:
            feeds[t.name] = mask_rows.astype(dt).reshape(dims)
        elif t is mask_input:
            feeds[t.name] = np.ones(dims, dtype=dt)
        else:
            feeds[t.name] = np.zeros(dims, dtype=dt)
    return feeds


def _probe_shapes(roles: dict[str, str]) -> list[ProbeShape]:
    """The base-mask probes: (Sq, past) pairs when a dim takes the past, else sequence lengths."""
    if any(r in ("past", "keys") for r in roles.values()):
        return [ProbeShape(PROBE_BATCH, q, p) for q, p in PROBE_PAST]
    return [ProbeShape(PROBE_BATCH, s) for s in PROBE_SEQ]


def _padding_shapes(roles: dict[str, str]) -> list[ProbeShape]:
    if any(r in ("past", "keys") for r in roles.values()):
        return [ProbeShape(PROBE_BATCH, q, p) for q, p in PADDING_PAST]
    return [ProbeShape(PROBE_BATCH, PROBE_SEQ[-1])]


def _mask_patterns(batch: int, seq: int) -> list[np.ndarray]:
    """Right-padded, left-padded and random 0/1 rows (one row of each kind all ones)."""
    lens = np.array([seq, max(1, seq // 2), 1][:batch] + [seq] * max(0, batch - 3))
    j = np.arange(seq)[None, :]
    right = (j < lens[:, None]).astype(np.int64)
    left = right[:, ::-1].copy()
    rng = np.random.default_rng(0)
    rand = (rng.random((batch, seq)) < 0.6).astype(np.int64)
    rand[0] = 1
    zero = right.copy()
    zero[-1] = 0  # a row with no key at all
    return [right, left, rand, zero]


class MaskAnalyzer:
    """Classifies mask expressions of one graph; results are cached per expression."""

    def __init__(self, graph: gs.Graph):
        self.graph = graph
        self.order = {id(n): i for i, n in enumerate(graph.nodes)}
        self.cache: dict[Any, MaskClass] = {}

    def classify(self, sources: Sequence[gs.Tensor | np.ndarray], combine: Callable[[list[np.ndarray]], np.ndarray],
                 key: Any) -> MaskClass:
        """Class of ``combine(values of sources)`` (see the module doc)."""
        if key in self.cache:
            return self.cache[key]
        try:
            result = self._classify(sources, combine)
        except Exception as exc:  # a probe that cannot run leaves the mask as it is (exact)
            log.debug("mask probe failed: %s", exc)
            result = MaskClass("unknown", detail={"error": str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__})
        self.cache[key] = result
        return result

    def _classify(self, sources, combine) -> MaskClass:
        values = [const_value(s) if isinstance(s, gs.Tensor) else np.asarray(s) for s in sources]
        live = [s for s, v in zip(sources, values) if v is None]
        if not live:
            return classify_base(combine(values))
        region = _region(self.graph, live, self.order)
        if isinstance(region, str):
            return MaskClass("unknown", detail={"error": region})
        if len(region.value_inputs) > 1 or any(not _mask_like(t) for t in region.value_inputs):
            names = ", ".join(t.name for t in region.value_inputs)
            return MaskClass("dynamic", detail={"depends_on": names})
        model = _probe_model(self.graph, region, live)
        mask_input = region.value_inputs[0] if region.value_inputs else None

        def evaluate(outs: list[np.ndarray]) -> np.ndarray:
            it = iter(outs)
            return combine([v if v is not None else next(it) for v in values])

        roles = dim_roles(region.inputs, mask_input)
        # base mask at a few sizes (mask input all ones)
        shapes = _probe_shapes(roles)
        past = WIDE_PAST if shapes[0].past else 0
        big = [c + 2 for c in region.int_constants if PROBE_SEQ[-1] - 2 < c + 2 <= MAX_PROBE_SEQ]
        if big:
            shapes.append(ProbeShape(1, max(big), past))
        outs = _run(model, [_feeds(region, roles, sh, mask_input, None) for sh in shapes])
        bases = {sh: evaluate(o) for sh, o in zip(shapes, outs)}
        base = _merge_probes(list(bases.values()))
        if region.buffer_size and base.base in ("causal", "sliding_window"):
            unproven = _sweep_buffer(model, region, roles, mask_input, base, evaluate)
            if unproven is not None:
                return unproven
        if mask_input is None:
            return base
        # key padding on top of the base mask, at every padding probe shape
        fill = None
        for sh in _padding_shapes(roles):
            b0 = bases[sh] if sh in bases else evaluate(_run(model, [_feeds(region, roles, sh, mask_input, None)])[0])
            found = _padding_fill(model, region, roles, sh, mask_input, b0, evaluate, fill)
            if isinstance(found, MaskClass):
                return found if found.base != "keep" else MaskClass(base.base, detail=found.detail)
            fill = found
        padding = fill is not None
        return MaskClass(base.base, padding=padding, window=base.window, source=mask_input.name,
                         fully_masked_rows=base.fully_masked_rows)


def _sweep_shapes(roles: dict[str, str], n: int) -> list[ProbeShape]:
    """Every size a mask buffer of n rows is sliced to: Sq = Sk = 1..n, or, when a dim takes the
    past, Sk = 2..n at one query (past Sk - 1) and at Sk - WIDE_PAST queries (past WIDE_PAST)."""
    if any(r in ("past", "keys") for r in roles.values()):
        return [ProbeShape(1, 1, k - 1) for k in range(2, n + 1)] + \
            [ProbeShape(1, k - WIDE_PAST, WIDE_PAST) for k in range(WIDE_PAST + 1, n + 1)]
    return [ProbeShape(1, s) for s in range(1, n + 1)]


def _sweep_buffer(model: onnx.ModelProto, region: _Region, roles: dict[str, str], mask_input: gs.Variable | None,
                  base: MaskClass, evaluate) -> MaskClass | None:
    """None when the base mask has ``base``'s pattern at every size its constant buffer is sliced
    to; else the class saying why not.

    A mask sliced out of a constant buffer (GPT-Neo's ``bias[:, :, Sk - Sq:Sk, :Sk]``, [1, 1, n, n])
    is whatever the buffer holds at each size: the probe sizes see the window only where they cut
    the buffer, so the window must hold at every size up to n (beyond it the slice is short and the
    model cannot run). One session, one size at a time (sum of Sk^2 values, never held together).
    """
    n = region.buffer_size
    if n > MAX_PROBE_SEQ:
        return MaskClass("dynamic", detail={"buffer": f"mask buffer of {n} rows: sizes past {MAX_PROBE_SEQ} "
                                                      f"are not probed"})
    sess = _session(model)
    for sh in _sweep_shapes(roles, n):
        got = evaluate(sess.run(None, _feeds(region, roles, sh, mask_input, None)))
        if not _has_pattern(base, np.asarray(got)):
            return MaskClass("block", detail={"buffer": f"mask buffer of {n} rows is not {base.name} at "
                                                        f"Sq = {sh.query}, Sk = {sh.keys}"})
    return None


def _has_pattern(cls: MaskClass, a: np.ndarray) -> bool:
    """The additive mask ``a`` allows exactly the keys of a causal / sliding_window class (every
    plane) and masks the others."""
    if a.ndim < 2:
        a = a.reshape((1,) * (2 - a.ndim) + a.shape)
    sq, sk = a.shape[-2:]
    want = _allowed_keys(sq, sk, cls.window if cls.base == "sliding_window" else None)
    allowed = a == 0
    return bool((allowed | _is_masked(a)).all()) and np.array_equal(allowed, np.broadcast_to(want, allowed.shape))


def _padding_fill(model: onnx.ModelProto, region: _Region, roles: dict[str, str], shape: ProbeShape,
                  mask_input: gs.Variable, b0: np.ndarray, evaluate, fill):
    """The fill value of the padding probes at one shape (None: the mask input masks nothing), or
    the MaskClass saying why the mask is not ``where(mask[b, j], base, fill)`` (base "keep": the
    base class stands, without padding).

    Where the base masks a padded key as well, any masked value stands: a padding mask added to a
    base that masks (GPT-Neo: a masked_fill by its causal / window buffer, plus HF's causal + padding
    mask) is -inf there (finfo.min + finfo.min) and finfo.min where only the padding masks. Where the
    base allows the key, the padding writes the one fill."""
    sk = shape.keys
    patterns = _mask_patterns(shape.batch, sk)
    outs = _run(model, [_feeds(region, roles, shape, mask_input, p) for p in patterns])
    dynamic = MaskClass("dynamic", detail={"depends_on": mask_input.name})
    for p, o in zip(patterns, outs):
        got = evaluate(o)
        if got.ndim < 2 or got.shape[-1] != sk:
            return MaskClass("keep", detail={"padding": "mask input does not index the key axis"})
        keep = _key_mask(p, got)
        if keep is None:
            return dynamic
        dropped = np.broadcast_to(~keep, got.shape)
        base = np.broadcast_to(b0, got.shape)
        open_ = ~_is_masked(base)
        if (dropped & open_).any():
            vals = np.unique(got[dropped & open_])
            if len(vals) != 1 or not _is_masked(vals[0]) or (fill is not None and not _same(fill, vals[0])):
                return dynamic
            fill = vals[0]
        if not _is_masked(got[dropped & ~open_]).all():
            return dynamic
        if not np.array_equal(np.where(dropped, 0, base), np.where(dropped, 0, got)):
            return dynamic
    return fill


def _is_masked(a):
    a = np.asarray(a)
    return (a <= masked_below(a.dtype)) | np.isneginf(a)


def _same(a, b) -> bool:
    return bool(a == b or (np.isnan(a) and np.isnan(b)))


def _mask_like(t: gs.Variable) -> bool:
    """A [batch, seq] integer/bool/float input (an attention / padding mask)."""
    return t.shape is not None and len(t.shape) == 2


def _key_mask(rows: np.ndarray, got: np.ndarray) -> np.ndarray | None:
    """rows [B, Sk] as a boolean array broadcastable to `got` ([B, ..., Sq, Sk])."""
    b, sk = rows.shape
    if got.shape[-1] != sk or (got.ndim >= 3 and got.shape[0] not in (b,)):
        return None
    return (rows != 0).reshape((b,) + (1,) * (got.ndim - 2) + (sk,))
