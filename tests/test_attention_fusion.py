"""Attention fusion (optfuse::FlashAttention): hand-built graphs for every variant and boundary,
and real HF models exported by both torch exporters with SDPA and eager attention."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import graphs
from optfuse.estimate import estimate_traffic
from optfuse.fusions import fuse_model
from optfuse.pattern import FusionOptions

OP = "FlashAttention"
F32 = TensorProto.FLOAT
FMIN = float(np.finfo(np.float32).min)


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def _session(model):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _run(model, feeds):
    sess = _session(model)
    names = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in feeds.items() if k in names})


def _max_abs(a_list, b_list) -> float:
    return max(float(np.abs(a - b).max()) for a, b in zip(a_list, b_list))


def _ops(model):
    return [n.op_type for n in model.graph.node]


def _attrs(node):
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _fa(result):
    return [a for a in result.accepted if a.op == OP]


def _rejections(result):
    return [r.reason for r in result.rejected if r.op == OP]


# ------------------------------------------------------------------------------------------------
# hand-built graphs
# ------------------------------------------------------------------------------------------------
def attention_graph(*, H=4, Hkv=None, D=32, S: int | None = None, k_layout="bhsd", scale="mul", mask=None,
                    nan_guard=False, dropout=None, probs_output=False, scores_use=None, opset=17, window=3,
                    position_bias=None):
    """One attention block as an exporter writes it; S=None keeps the sequence symbolic ("s").

    k_layout: bhsd (Transpose(0,1,3,2) of k), bshd (head split straight to k^T, perm 0,2,3,1),
              dynamo (Reshape/Transpose(0,2,1)/Reshape), raw (k^T is a graph input).
    scale: mul | div | qk_sqrt (sqrt on q and k^T) | none | input (a graph input).
    mask: None | bias_input | padding_min | padding_1e4 | range_causal | range_causal_padding |
          range_window | range_window_padding | where_causal | where_causal_weak | where_window | where_block | where_input | where_input_weak |
          where_inverted.
    position_bias: None | before_fill | after_fill: a per-head [1, H, 1, S] graph input (ALiBi) added to
          the scores before a ``where_*`` mask's Where (MPT) or after it.
    """
    Hkv = Hkv or H
    s = S if S is not None else "s"
    b = graphs.Builder(opset)
    inputs = [graphs.io("q", ["b", H, s, D])]
    q = "q"
    # --- k^T -------------------------------------------------------------------------------------
    if k_layout == "bshd":
        inputs.append(graphs.io("k_bshd", ["b", s, Hkv, D]))
        kt = b.node("Transpose", "k_bshd", perm=[0, 2, 3, 1])
    elif k_layout == "raw":
        inputs.append(graphs.io("k_t", ["b", Hkv, D, s]))
        kt = "k_t"
    else:
        inputs.append(graphs.io("k", ["b", Hkv, s, D]))
        k = _repeat_kv(b, "k", Hkv, H, D) if Hkv != H else "k"
        if k_layout == "bhsd":
            kt = b.node("Transpose", k, perm=[0, 1, 3, 2])
        else:  # dynamo SDPA: [B*H, S, D] -> [B*H, D, S] -> [B, H, D, S]
            sh = b.node("Shape", k)
            bsz = b.node("Slice", sh, b.const([0], dtype=np.int64), b.const([1], dtype=np.int64))
            seq = b.node("Slice", sh, b.const([2], dtype=np.int64), b.const([3], dtype=np.int64))
            flat = b.node("Reshape", k, b.node("Concat", b.const([-1], dtype=np.int64), seq,
                                               b.const([D], dtype=np.int64), axis=0))
            ft = b.node("Transpose", flat, perm=[0, 2, 1])
            kt = b.node("Reshape", ft, b.node("Concat", bsz, b.const([H], dtype=np.int64),
                                              b.const([D], dtype=np.int64), seq, axis=0))
    inputs.append(graphs.io("v", ["b", Hkv, s, D]))
    v = _repeat_kv(b, "v", Hkv, H, D) if Hkv != H else "v"
    # --- scores ----------------------------------------------------------------------------------
    c = 1.0 / np.sqrt(D)
    if scale == "qk_sqrt":
        q = b.node("Mul", q, b.const(np.sqrt(c)))
        kt = b.node("Mul", kt, b.const(np.sqrt(c)))
    scores = b.node("MatMul", q, kt)
    if scale == "mul":
        scores = b.node("Mul", scores, b.const(c))
    elif scale == "div":
        scores = b.node("Div", scores, b.const(np.sqrt(D)))
    elif scale == "input":
        inputs.append(graphs.io("scale", []))
        scores = b.node("Mul", scores, "scale")
    raw_scores = scores
    # --- mask ------------------------------------------------------------------------------------
    if mask == "bias_input":
        inputs.append(graphs.io("bias", ["b", 1, 1, s]))
        scores = b.node("Add", scores, "bias")
    elif mask in ("padding_min", "padding_1e4"):
        inputs.append(graphs.io("attention_mask", ["b", s], TensorProto.INT64))
        m = b.node("Cast", "attention_mask", to=F32)
        inv = b.node("Sub", b.const(1.0), m)
        ext = b.node("Mul", inv, b.const(FMIN if mask == "padding_min" else -1e4))
        ext = b.node("Unsqueeze", ext, b.const([1, 2], dtype=np.int64))
        scores = b.node("Add", scores, ext)
    elif mask in ("range_causal", "range_causal_padding", "range_window", "range_window_padding"):
        seq = b.node("Squeeze", b.node("Slice", b.node("Shape", "q"), b.const([2], dtype=np.int64),
                                       b.const([3], dtype=np.int64)), b.const([0], dtype=np.int64))
        r = b.node("Range", b.const(0, dtype=np.int64), seq, b.const(1, dtype=np.int64))
        rows = b.node("Unsqueeze", r, b.const([1], dtype=np.int64))
        cols = b.node("Unsqueeze", r, b.const([0], dtype=np.int64))
        allowed = b.node("LessOrEqual", cols, rows)
        if "window" in mask:  # Mistral: j > i - window
            allowed = b.node("And", allowed, b.node("Greater", cols, b.node("Sub", rows, b.const(window, dtype=np.int64))))
        if mask.endswith("padding"):
            inputs.append(graphs.io("attention_mask", ["b", s], TensorProto.INT64))
            pad = b.node("Unsqueeze", b.node("Cast", "attention_mask", to=TensorProto.BOOL),
                         b.const([1, 2], dtype=np.int64))
            allowed = b.node("And", allowed, pad)
        bias = b.node("Where", allowed, b.const(0.0), b.const(FMIN))
        scores = b.node("Add", scores, bias)
    elif mask and mask.startswith("where"):
        n = S or 8
        i, j = np.arange(n)[:, None], np.arange(n)[None, :]
        fill = -1e4 if mask.endswith("weak") else FMIN
        if mask in ("where_causal", "where_causal_weak", "where_inverted"):
            keep = j <= i
        elif mask == "where_window":
            keep = (j <= i) & (j > i - window)
        elif mask == "where_block":
            keep = (i // 4) == (j // 4)
        if mask.startswith("where_input"):
            inputs.append(graphs.io("cond", ["b", 1, s, s], TensorProto.BOOL))
            cond = "cond"
        else:
            cond = b.const(keep.reshape(1, 1, n, n), dtype=np.bool_)
        if position_bias:
            inputs.append(graphs.io("pos_bias", [1, H, 1, s]))
        if position_bias == "before_fill":
            scores = b.node("Add", scores, "pos_bias")
        if mask == "where_inverted":
            cond = b.const(~keep.reshape(1, 1, n, n), dtype=np.bool_)
            scores = b.node("Where", cond, b.const(fill), scores)
        else:
            scores = b.node("Where", cond, scores, b.const(fill))
        if position_bias == "after_fill":
            scores = b.node("Add", scores, "pos_bias")
    # --- softmax and PV --------------------------------------------------------------------------
    probs = b.node("Softmax", scores, axis=-1)
    sm_out = probs
    if nan_guard:
        probs = b.node("Where", b.node("IsNaN", probs), b.const([0.0]), probs)
    if dropout == "eval":
        probs = b.node("Dropout", probs)
    elif dropout == "train":
        probs = b.node("Dropout", probs, b.const(0.1), b.const(True, dtype=np.bool_))
    b.node("MatMul", probs, v, out="y")
    outputs = [graphs.io("y", ["b", H, s, D])]
    if probs_output:
        outputs.append(graphs.io(sm_out, None))
    if scores_use == "output":
        outputs.append(graphs.io(raw_scores, None))
    elif scores_use == "node":
        outputs.append(graphs.io(b.node("ReduceMax", raw_scores, axes=[-1], keepdims=0), None))
    return b.model(inputs, outputs)


def _repeat_kv(b, x, Hkv, H, D):
    g = H // Hkv
    u = b.node("Unsqueeze", x, b.const([2], dtype=np.int64))
    e = b.node("Expand", u, b.const([1, Hkv, g, 1, D], dtype=np.int64))
    return b.node("Reshape", e, b.const([0, H, -1, D], dtype=np.int64))


def _feeds(model, S=8, B=2, seed=0):
    rng = np.random.default_rng(seed)
    feeds = {}
    for vi in model.graph.input:
        dims = [d.dim_value if d.dim_value else (S if d.dim_param == "s" else B) for d in vi.type.tensor_type.shape.dim]
        et = vi.type.tensor_type.elem_type
        if vi.name == "attention_mask":
            m = np.ones(dims, np.int64)
            m[1:, S // 2:] = 0  # right padded
            feeds[vi.name] = m
        elif vi.name == "cond":
            c = rng.random(dims) < 0.7
            c[..., 0] = True  # every row keeps a key
            feeds[vi.name] = c
        elif vi.name == "scale":
            feeds[vi.name] = np.array(0.2, np.float32)
        elif et == TensorProto.BOOL:
            feeds[vi.name] = rng.random(dims) < 0.5
        elif vi.name == "bias":
            feeds[vi.name] = np.where(rng.random(dims) < 0.3, FMIN, 0).astype(np.float32)
        else:
            feeds[vi.name] = rng.standard_normal(dims).astype(np.float32)
    return feeds


def _fuse_and_compare(model, S=8, **kw):
    fused, res = fuse_model(model, **kw)
    onnx.checker.check_model(fused)
    feeds = _feeds(model, S=S)
    err = _max_abs(_run(model, feeds), _run(fused, feeds))
    return fused, res, err


# ------------------------------------------------------------------------------------------------
# hand-built: variants that must fuse
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k_layout", ["bhsd", "bshd", "dynamo", "raw"])
@pytest.mark.parametrize("scale", ["mul", "div", "qk_sqrt", "none"])
def test_layouts_and_scales(k_layout, scale):
    model = attention_graph(k_layout=k_layout, scale=scale)
    fused, res, err = _fuse_and_compare(model)
    assert res.counts() == {OP: 1}, _rejections(res)
    assert "Softmax" not in _ops(fused) and _ops(fused).count(OP) == 1
    node = next(n for n in fused.graph.node if n.op_type == OP)
    a = _attrs(node)
    want = 1.0 if scale == "none" else 1.0 / np.sqrt(32)
    assert a["scale"] == pytest.approx(want, rel=1e-6)
    assert (a["num_heads"], a["num_kv_heads"], a["causal"]) == (4, 4, 0)
    assert node.domain == "optfuse" and len(node.input) == 4
    assert _fa(res)[0].rewrite.info["mask_class"] == "none"
    assert err <= 1e-4


@pytest.mark.parametrize("k_layout", ["bhsd", "dynamo"])
def test_grouped_query_attention_takes_unrepeated_kv(k_layout):
    model = attention_graph(H=8, Hkv=2, k_layout=k_layout)
    fused, res, err = _fuse_and_compare(model)
    assert res.counts() == {OP: 1}, _rejections(res)
    node = next(n for n in fused.graph.node if n.op_type == OP)
    assert (_attrs(node)["num_heads"], _attrs(node)["num_kv_heads"]) == (8, 2)
    assert list(node.input[1:3]) == ["k", "v"]
    assert "Expand" not in _ops(fused)
    assert err <= 1e-4


@pytest.mark.parametrize("mask,cls,causal", [
    ("bias_input", "dynamic", 0),
    ("padding_min", "padding", 0),
    ("padding_1e4", "dynamic", 0),
    ("range_causal", "causal", 1),
    ("range_causal_padding", "causal+padding", 1),
    ("range_window", "sliding_window", 1),
    ("range_window_padding", "sliding_window+padding", 1),
])
def test_additive_masks(mask, cls, causal):
    model = attention_graph(mask=mask, S=None)
    fused, res, err = _fuse_and_compare(model)
    assert res.counts() == {OP: 1}, _rejections(res)
    acc = _fa(res)[0]
    assert acc.rewrite.info["mask_class"] == cls
    assert acc.rewrite.attrs["causal"] == causal
    if cls in ("padding", "causal+padding", "sliding_window+padding"):
        assert acc.rewrite.info["mask_source"] == "attention_mask"
    if cls in ("causal", "sliding_window"):  # the mask is not read at all
        assert "Range" not in _ops(fused)
    if cls.startswith("sliding_window"):  # window 3: keys i - 3 < j <= i
        assert acc.rewrite.attrs["window_left"] == 2 and acc.rewrite.info["window"] == 3
    if cls == "sliding_window+padding":
        # right padding at S // 2 = 4 with window 3: padded queries 6, 7 see only padded keys
        # (the documented exception); every real token is exact, and the whole mask is exact everywhere
        feeds = _feeds(model)
        real = feeds["attention_mask"].astype(bool)[:, None, :, None]
        got, want = _run(fused, feeds)[0], _run(model, feeds)[0]
        assert np.abs(np.where(real, got - want, 0)).max() <= 1e-4
        full, res_full, err_full = _fuse_and_compare(model, options=FusionOptions(attention_full_mask=True))
        assert _fa(res_full)[0].rewrite.attrs == {k: v for k, v in acc.rewrite.attrs.items() if k != "window_left"} | {"causal": 0}
        assert err_full <= 1e-4
        return
    assert err <= 1e-4


@pytest.mark.parametrize("mask,cls,causal", [
    ("where_causal", "causal", 1),
    ("where_causal_weak", "causal", 1),
    ("where_inverted", "causal", 1),
    ("where_window", "sliding_window", 1),
    ("where_block", "block", 0),
    ("where_input", "dynamic", 0),
])
def test_masked_fill(mask, cls, causal):
    model = attention_graph(S=8, mask=mask)
    fused, res, err = _fuse_and_compare(model)
    assert res.counts() == {OP: 1}, _rejections(res)
    acc = _fa(res)[0]
    assert acc.rule == "attention.masked_fill"
    assert acc.rewrite.info["mask_class"] == cls
    assert acc.rewrite.attrs["causal"] == causal
    if cls == "sliding_window":
        assert acc.rewrite.info["window"] == 3 and acc.rewrite.attrs["window_left"] == 2
    assert err <= 1e-4


@pytest.mark.parametrize("position_bias", ["before_fill", "after_fill"])
@pytest.mark.parametrize("mask", ["where_causal", "where_input"])
def test_masked_fill_with_position_bias(mask, position_bias):
    """A per-head position bias added before the masked_fill (MPT's ALiBi) or after it: one fused
    node whose bias holds both; the mask's new Where and Add nodes are distinct tensors."""
    model = attention_graph(S=8, mask=mask, position_bias=position_bias)
    fused, res, err = _fuse_and_compare(model)
    assert res.counts() == {OP: 1}, _rejections(res)
    acc = _fa(res)[0]
    assert acc.rule == "attention.masked_fill"
    node = next(n for n in fused.graph.node if n.op_type == OP)
    assert {"Where", "Add"} <= {n.op_type for n in fused.graph.node}, _ops(fused)
    assert len(set(node.input)) == len(node.input) == 4
    assert err <= 1e-4


def test_sdpa_nan_guard_and_eval_dropout_are_absorbed():
    for kw in (dict(nan_guard=True), dict(dropout="eval")):
        model = attention_graph(mask="padding_min", **kw)
        fused, res, err = _fuse_and_compare(model)
        assert res.counts() == {OP: 1}, _rejections(res)
        assert not {"IsNaN", "Dropout", "Softmax"} & set(_ops(fused))
        assert err <= 1e-4


def test_mask_row_is_shared_by_all_layers():
    """Two blocks reading one mask: one Slice of its last row serves both fused nodes."""
    b = graphs.Builder(17)
    seq = b.node("Squeeze", b.node("Slice", b.node("Shape", "x"), b.const([2], dtype=np.int64),
                                   b.const([3], dtype=np.int64)), b.const([0], dtype=np.int64))
    r = b.node("Range", b.const(0, dtype=np.int64), seq, b.const(1, dtype=np.int64))
    allowed = b.node("And", b.node("LessOrEqual", b.node("Unsqueeze", r, b.const([0], dtype=np.int64)),
                                   b.node("Unsqueeze", r, b.const([1], dtype=np.int64))),
                     b.node("Unsqueeze", b.node("Cast", "attention_mask", to=TensorProto.BOOL),
                            b.const([1, 2], dtype=np.int64)))
    bias = b.node("Where", allowed, b.const(0.0), b.const(FMIN))
    x = "x"
    for _ in range(2):
        kt = b.node("Transpose", x, perm=[0, 1, 3, 2])
        s = b.node("Add", b.node("Mul", b.node("MatMul", x, kt), b.const(0.125)), bias)
        x = b.node("MatMul", b.node("Softmax", s, axis=-1), x)
    b.nodes[-1].output[0] = "y"
    model = b.model([graphs.io("x", ["b", 2, "s", 32]), graphs.io("attention_mask", ["b", "s"], TensorProto.INT64)],
                    [graphs.io("y", ["b", 2, "s", 32])])
    fused, res = fuse_model(model, dims={"b": 2, "s": 16})
    assert res.counts() == {OP: 2}
    assert _ops(fused).count("Slice") == 2  # the graph's own Slice + one mask row
    assert {a.rewrite.info["mask_class"] for a in _fa(res)} == {"causal+padding"}
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 2, 8, 32)).astype(np.float32),
             "attention_mask": np.array([[1] * 8, [1] * 5 + [0] * 3], np.int64)}
    assert _max_abs(_run(model, feeds), _run(fused, feeds)) <= 1e-4


def test_rules_are_stateless():
    """check returns the plan (the bindings) or a reason, rewrite builds the node from the plan alone:
    checking a match twice gives equal plans, and within one Context the graph facts cache hands
    both the same mask-row tensor (what makes one Slice serve every layer)."""
    from optfuse.fusions.attention import RULES
    from optfuse.fusions.attention.common import AttentionPlan
    from optfuse.ir import sanitize
    from optfuse.pattern import Context, NewTensor, match

    g = sanitize(attention_graph(mask="range_causal_padding", S=None))
    rule = next(r for r in RULES if r.id == "attention.additive")
    root = next(n for n in g.nodes if n.op == "MatMul" and n.inputs[0].inputs and n.inputs[0].inputs[0].op == "Softmax")
    m = next(match(rule.pattern, root.outputs[0]))
    ctx = Context(g)
    first, again, fresh = rule.check(m, ctx), rule.check(m, ctx), rule.check(m, Context(g))
    assert isinstance(first, AttentionPlan) and first.info["mask_class"] == "causal+padding"
    assert first.attrs == again.attrs == fresh.attrs and first.info == again.info == fresh.info
    assert isinstance(first.inputs[3], NewTensor) and first.inputs[3].op == "Slice"
    assert again.inputs[3] is first.inputs[3] and fresh.inputs[3] is not first.inputs[3]
    rw = rule.rewrite(m, first)
    assert rw.op == OP and rw.attrs == first.attrs and all(a is b for a, b in zip(rw.inputs, first.inputs))
    assert rw.outputs == [m.root]


def test_onnx_attention_op():
    """ONNX Attention (opset 23): 4-D GQA inputs, bool mask, is_causal."""
    b = graphs.Builder(23)
    b.node("Attention", "q", "k", "v", "mask", out="y", is_causal=1)
    model = b.model([graphs.io("q", ["b", 4, "s", 32]), graphs.io("k", ["b", 2, "s", 32]),
                     graphs.io("v", ["b", 2, "s", 32]), graphs.io("mask", ["b", 1, "s", "s"], TensorProto.BOOL)],
                    [graphs.io("y", ["b", 4, "s", 32])])
    model.ir_version = 10
    fused, res = fuse_model(model)
    assert res.counts() == {OP: 1}, _rejections(res)
    acc = _fa(res)[0]
    assert acc.rule == "attention.onnx"
    assert acc.rewrite.attrs == {"scale": pytest.approx(1 / np.sqrt(32)), "causal": 1, "num_heads": 4, "num_kv_heads": 2}
    assert acc.rewrite.info["mask_class"] == "causal+dynamic"
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in
             (("q", (2, 4, 8, 32)), ("k", (2, 2, 8, 32)), ("v", (2, 2, 8, 32)))}
    feeds["mask"] = np.ones((2, 1, 8, 8), bool)
    feeds["mask"][1, ..., 5:] = False
    assert _max_abs(_run(model, feeds), _run(fused, feeds)) <= 1e-4


def batched_graph(*, H=2, D=32, alibi=True, mask="additive", merge_heads=False):
    """BLOOM / DeBERTa-v2 style: bmm over [B*H, S, D], scores reshaped to [B, H, S, S] around Softmax.

    mask: additive (+ [B, 1, S, S] bias) | masked_fill (Where(Not(cond), min, scores), DeBERTa).
    merge_heads: BLOOM's TorchScript _merge_heads: batch and sequence read from the 3-D output's
    Shape, the output [B, S, H * D].
    """
    b = graphs.Builder(17)
    seq = b.node("Slice", b.node("Shape", "q"), b.const([2], dtype=np.int64), b.const([3], dtype=np.int64))
    q3 = b.node("Reshape", "q", b.node("Concat", b.const([-1], dtype=np.int64), seq, b.const([D], dtype=np.int64), axis=0))
    k3 = b.node("Reshape", "k", b.node("Concat", b.const([-1], dtype=np.int64), seq, b.const([D], dtype=np.int64), axis=0))
    v3 = b.node("Reshape", "v", b.node("Concat", b.const([-1], dtype=np.int64), seq, b.const([D], dtype=np.int64), axis=0))
    # TorchScript style scale: k^T / sqrt(q.size(-1))
    dim = b.node("Cast", b.node("Gather", b.node("Shape", "q"), b.const(3, dtype=np.int64)), to=F32)
    kt3 = b.node("Div", b.node("Transpose", k3, perm=[0, 2, 1]), b.node("Sqrt", dim))
    s3 = b.node("MatMul", q3, kt3)
    inputs = [graphs.io("q", ["b", H, "s", D]), graphs.io("k", ["b", H, "s", D]), graphs.io("v", ["b", H, "s", D])]
    if alibi:
        inputs.append(graphs.io("alibi", ["bh", 1, "s"]))
        s3 = b.node("Add", s3, "alibi")
    s4 = b.node("Reshape", s3, b.node("Concat", b.const([-1, H], dtype=np.int64), seq, seq, axis=0))
    if mask == "additive":
        inputs.append(graphs.io("bias", ["b", 1, "s", "s"]))
        logits = b.node("Add", s4, "bias")
    else:
        inputs.append(graphs.io("cond", ["b", 1, "s", "s"], TensorProto.BOOL))
        logits = b.node("Where", b.node("Not", "cond"), b.const(FMIN), s4)
    p = b.node("Softmax", logits, axis=-1)
    p3 = b.node("Reshape", p, b.node("Concat", b.const([-1], dtype=np.int64), seq, seq, axis=0))
    o3 = b.node("MatMul", p3, v3)
    if merge_heads:
        shape = b.node("Shape", o3)
        bsz = b.node("Div", b.node("Gather", shape, b.const([0], dtype=np.int64)), b.const([H], dtype=np.int64))
        sq = b.node("Gather", b.node("Shape", o3), b.const([1], dtype=np.int64))
        o4 = b.node("Reshape", o3, b.node("Concat", bsz, b.const([H], dtype=np.int64), sq, b.const([D], dtype=np.int64),
                                          axis=0))
        b.node("Reshape", b.node("Transpose", o4, perm=[0, 2, 1, 3]),
               b.node("Concat", bsz, sq, b.const([H * D], dtype=np.int64), axis=0), out="y")
        return b.model(inputs, [graphs.io("y", ["b", "s", H * D])])
    b.node("Reshape", o3, b.node("Concat", b.const([-1, H], dtype=np.int64), seq, b.const([D], dtype=np.int64), axis=0),
           out="y")
    return b.model(inputs, [graphs.io("y", ["b", H, "s", D])])


@pytest.mark.parametrize("alibi,mask,merge_heads", [(True, "additive", False), (False, "masked_fill", False),
                                                   (True, "masked_fill", False), (True, "additive", True)])
def test_batched_heads_3d(alibi, mask, merge_heads):
    model = batched_graph(alibi=alibi, mask=mask, merge_heads=merge_heads)
    fused, res = fuse_model(model)
    assert res.counts() == {OP: 1}, _rejections(res)
    assert "MatMul" not in _ops(fused)
    # the 3-D output whose Shape BLOOM's _merge_heads reads stays, as the fused output reshaped
    assert ("kept_3d_output" in _fa(res)[0].rewrite.info) == merge_heads
    acc = _fa(res)[0]
    assert acc.rule == "attention.batched"
    assert acc.rewrite.attrs["scale"] == pytest.approx(32 ** -0.5, rel=1e-6)
    assert (acc.rewrite.attrs["num_heads"], acc.rewrite.attrs["num_kv_heads"]) == (2, 2)
    assert "Softmax" not in _ops(fused)
    rng = np.random.default_rng(0)
    B, S = 2, 7
    feeds = {n: rng.standard_normal((B, 2, S, 32)).astype(np.float32) for n in ("q", "k", "v")}
    feeds["alibi"] = rng.standard_normal((B * 2, 1, S)).astype(np.float32)
    feeds["bias"] = np.where(rng.random((B, 1, S, S)) < 0.3, FMIN, 0).astype(np.float32)
    feeds["cond"] = rng.random((B, 1, S, S)) < 0.7
    assert _max_abs(_run(model, feeds), _run(fused, feeds)) <= 1e-4


def test_unrecognized_attention_is_reported_with_its_scores():
    b = graphs.Builder(17)
    s = b.node("Sub", b.node("MatMul", "q", b.node("Transpose", "k", perm=[0, 1, 3, 2])), "bias")
    b.node("MatMul", b.node("Softmax", s, axis=-1), "v", out="y")
    model = b.model([graphs.io(n, ["b", 2, "s", 32]) for n in ("q", "k", "v")] + [graphs.io("bias", ["b", 1, "s", "s"])],
                    [graphs.io("y", ["b", 2, "s", 32])])
    _, res = fuse_model(model)
    assert OP not in res.counts()
    (reason,) = _rejections(res)
    assert "not recognised as attention" in reason and "Sub <- MatMul" in reason


# ------------------------------------------------------------------------------------------------
# hand-built: what must not fuse, and why
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,reason", [
    (dict(probs_output=True), "graph output (output_attentions)"),
    (dict(scores_use="output"), "graph output"),
    (dict(scores_use="node"), "is also used by node"),
    (dict(scale="input"), "non-constant"),
    (dict(dropout="train"), "dropout"),
    (dict(D=16), "head dim 16 is not supported"),
    (dict(S=8, mask="where_input_weak"), "masked_fill value"),
])
def test_not_fused_with_reason(kw, reason):
    model = attention_graph(**kw)
    fused, res = fuse_model(model)
    assert OP not in res.counts()
    assert "Softmax" in _ops(fused)
    reasons = _rejections(res)
    assert any(reason in r for r in reasons), reasons


# ------------------------------------------------------------------------------------------------
# exported HF models
# ------------------------------------------------------------------------------------------------
FAMILIES = ["bert", "gpt2", "vit", "llama", "t5"]  # the tiny defaults have head dim 32
MASK_CLASS = {"bert": "padding", "gpt2": "causal+padding", "vit": "none", "llama": "causal+padding",
              "t5": "bias+padding"}
CASES = [(f, e, a) for f in FAMILIES for e in ("torchscript", "dynamo") for a in ("sdpa", "eager")]
DIMS = {"batch": 3, "sequence": 12}


@pytest.mark.slow
@pytest.mark.parametrize("family,exporter,attn", CASES)
def test_exported_model_attention_fused(fused_export, family, exporter, attn):
    from optfuse.models import make_inputs

    em, model, fused, res = fused_export(family, exporter, attn)
    n = em.counts["attention"]
    fa = _fa(res)
    assert len(fa) == n, _rejections(res)
    assert _ops(fused).count(OP) == n and "Softmax" not in _ops(fused)
    meta = em.meta
    for a in fa:
        assert a.rewrite.info["mask_class"] == MASK_CLASS[family]
        assert a.rewrite.attrs["num_heads"] == meta["num_heads"]
        assert a.rewrite.attrs["num_kv_heads"] == meta["num_kv_heads"]
        assert a.rewrite.attrs["causal"] == int(meta["causal"])
        assert a.rewrite.attrs["scale"] == pytest.approx(1.0 if family == "t5" else meta["head_dim"] ** -0.5, rel=1e-5)
    for seed in range(2):  # right-padded masks (make_inputs pads rows 1..)
        feeds = make_inputs(em.inputs, DIMS, seed=seed)
        assert _max_abs(_run(model, feeds), _run(fused, feeds)) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("family,exporter,attn", [c for c in CASES if c[0] in ("bert", "gpt2")])
def test_hbm_estimate_drops_the_score_traffic(fused_export, family, exporter, attn):
    em, _, fused, res = fused_export(family, exporter, attn)
    B, S, H = 2, 16, em.meta["num_heads"]
    nxn = B * H * S * S * 4  # one fp32 [B, H, S, S] tensor
    saved = estimate_traffic(fused, res).saved_bytes
    for a in _fa(res):
        # scores written, scaled, masked, softmaxed, read: at least 6 passes over an NxN tensor
        assert saved[a.node_name] is not None and saved[a.node_name] >= 6 * nxn


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_causal_padding_rows_with_no_key(fused_export, family):
    """Left padding / empty mask rows: exact at every real token by default, everywhere with
    attention_full_mask (which passes the whole mask)."""
    em, model, fused, _ = fused_export(family, "dynamo", "eager")
    _, _, full, res_full = fused_export(family, "dynamo", "eager", attention_full_mask=True)
    assert {a.rewrite.attrs["causal"] for a in _fa(res_full)} == {0}
    from optfuse.models import make_inputs

    feeds = make_inputs(em.inputs, {"batch": 3, "sequence": 9}, seed=0)
    mask = np.array([[1] * 9, [0] * 4 + [1] * 5, [0] * 9], np.int64)  # full, left padded, empty
    feeds["attention_mask"] = mask
    ref = _run(model, feeds)[0]
    got = _run(fused, feeds)[0]
    assert np.abs(ref - got)[mask.astype(bool)].max() <= 1e-4
    assert _max_abs([ref], _run(full, feeds)) <= 1e-4


@pytest.mark.slow
def test_exported_onnx_attention_op(exported_model):
    """torch's dynamo exporter at opset 23 writes ONNX Attention for SDPA."""
    from optfuse.models import make_inputs

    em = exported_model("bert", "dynamo", "sdpa", 23)
    model = onnx.load(str(em.path))
    fused, res = fuse_model(model)
    assert [a.rule for a in _fa(res)] == ["attention.onnx"] * em.counts["attention"], _rejections(res)
    assert {a.rewrite.info["mask_class"] for a in _fa(res)} == {"padding"}
    assert "Attention" not in _ops(fused)
    feeds = make_inputs(em.inputs, DIMS, seed=0)
    assert _max_abs(_run(model, feeds), _run(fused, feeds)) <= 1e-4
