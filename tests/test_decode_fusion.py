"""Attention over a KV cache (decode, chunked prefill): the mask probes with a past, hand-built
decode graphs, and LLaMA-GQA / GPT-2 exported with past_key_values by both torch exporters (SDPA and eager attention);
the GQA / MQA head split of LLaMA with and without a cache."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto

import graphs
from optfuse.estimate import estimate_traffic
from optfuse.fusions import fuse_model
from optfuse.fusions.attention.mask_class import _merge_probes, dim_roles

OP = "FlashAttention"
FMIN = float(np.finfo(np.float32).min)
I64 = TensorProto.INT64


_run = graphs.run


def _fa(result):
    return [a for a in result.accepted if a.op == OP]


def _rejections(result):
    return [r.reason for r in result.rejected if r.op == OP]


def _left_padded(lengths, total):
    return (np.arange(total)[None, :] >= total - np.asarray(lengths)[:, None]).astype(np.int64)


# ------------------------------------------------------------------------------------------------
# the probe machinery
# ------------------------------------------------------------------------------------------------
def _var(name, shape, dtype=np.float32):
    return gs.Variable(name, dtype=dtype, shape=shape)


def test_dim_roles():
    ids = _var("input_ids", ["batch", "sequence"], np.int64)
    mask = _var("attention_mask", ["batch", "total"], np.int64)
    past = _var("past_key_values.0.key", ["batch", 2, "past", 32])
    assert dim_roles([ids, mask, past], mask) == {"batch": "batch", "sequence": "query", "past": "past", "total": "keys"}
    # an attention_mask longer than the queries, without a cache input
    assert dim_roles([ids, mask], mask) == {"batch": "batch", "sequence": "query", "total": "keys"}
    # one sequence dim: Sk = Sq (prefill graphs, as before)
    assert dim_roles([_var("attention_mask", ["b", "s"], np.int64)], None) == {"b": "batch", "s": "query"}
    q = _var("q", ["b", 4, "s", 32])
    assert dim_roles([q], None) == {"b": "batch", "s": "query"}
    # q [B, H, S, D] next to a cache: the cache is the input named like one
    assert dim_roles([q, _var("k_past", ["b", 2, "p", 32])], None) == {"b": "batch", "p": "past", "s": "query"}


def _causal(sq, sk, window=None):
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    keep = j <= i + (sk - sq)
    if window:
        keep &= j > i + (sk - sq) - window
    return np.where(keep, 0.0, FMIN).astype(np.float32)


def test_one_row_probes_follow_the_multi_row_class():
    """Sq = 1 sees every key under a causal mask (it looks like none): the probes with several
    query rows decide, the one-row probe must agree."""
    assert _merge_probes([_causal(1, 12), _causal(5, 12), _causal(12, 15)]).name == "causal"
    got = _merge_probes([_causal(1, 12, 4), _causal(5, 12, 4), _causal(12, 15, 4)])
    assert (got.base, got.window) == ("sliding_window", 4)
    # a one-row probe that masks a key the class allows: not causal
    row = _causal(1, 12)
    row[0, 3] = FMIN
    assert _merge_probes([row, _causal(5, 12), _causal(12, 15)]).base == "block"
    # only one-row probes: classified as they are
    assert _merge_probes([np.zeros((1, 12), np.float32)] * 2).base == "none"


# ------------------------------------------------------------------------------------------------
# hand-built decode graphs: the cache concatenated in the graph, the mask built from the past length
# ------------------------------------------------------------------------------------------------
def decode_graph(*, H=4, Hkv=2, D=32, mask="causal_padding", window=3, kv_dim=None, repeat=None):
    """One attention block over a cache, as TorchScript writes HF's: k = Concat(past_key, k_new),
    rows = Range(past, past + Sq), cols = Range(0, past + Sq), allowed = cols <= rows [window]
    [and attention_mask over past + Sq]. mask: causal | causal_padding | window | window_padding |
    causal_new_padding (the mask's padding applied to the new tokens' keys only).
    kv_dim: the KV-head dim the cache and k/v inputs declare (default Hkv; a name makes it symbolic).
    repeat: the repeat_kv (default constant targets; ``"shape"``: targets built from Shape, as dynamo writes them)."""
    b = graphs.Builder(17)
    hd = Hkv if kv_dim is None else kv_dim
    inputs = [graphs.io("q", ["b", H, "s", D]), graphs.io("past_key", ["b", hd, "p", D]),
              graphs.io("past_value", ["b", hd, "p", D]), graphs.io("k_new", ["b", hd, "s", D]),
              graphs.io("v_new", ["b", hd, "s", D])]
    k = b.node("Concat", "past_key", "k_new", axis=2, out="present_key")
    v = b.node("Concat", "past_value", "v_new", axis=2, out="present_value")
    rep = _repeat_kv_from_shape if repeat == "shape" else _repeat_kv
    k, v = (rep(b, x, Hkv, H, D) for x in (k, v))
    scores = b.node("Mul", b.node("MatMul", "q", b.node("Transpose", k, perm=[0, 1, 3, 2])), b.const(D ** -0.5))

    def dim(x, axis):
        return b.node("Squeeze", b.node("Slice", b.node("Shape", x), b.const([axis], dtype=np.int64),
                                        b.const([axis + 1], dtype=np.int64)), b.const([0], dtype=np.int64))

    past, total = dim("past_key", 2), b.node("Add", dim("past_key", 2), dim("q", 2))
    one = b.const(1, dtype=np.int64)
    rows = b.node("Unsqueeze", b.node("Range", past, total, one), b.const([1], dtype=np.int64))
    cols = b.node("Unsqueeze", b.node("Range", b.const(0, dtype=np.int64), total, one), b.const([0], dtype=np.int64))
    allowed = b.node("LessOrEqual", cols, rows)
    if mask.startswith("window"):
        allowed = b.node("And", allowed, b.node("Greater", cols, b.node("Sub", rows, b.const(window, dtype=np.int64))))
    if mask.endswith("padding"):
        inputs.append(graphs.io("attention_mask", ["b", "t"], I64))
        pad = b.node("Cast", "attention_mask", to=TensorProto.BOOL)
        if mask == "causal_new_padding":  # ones over the past, the mask's last Sq columns after them
            new = b.node("Slice", pad, b.node("Neg", b.node("Unsqueeze", dim("q", 2), b.const([0], dtype=np.int64))),
                         b.const([1 << 40], dtype=np.int64), b.const([1], dtype=np.int64))
            bp = b.node("Concat", b.node("Slice", b.node("Shape", "q"), b.const([0], dtype=np.int64),
                                         b.const([1], dtype=np.int64)),
                        b.node("Unsqueeze", past, b.const([0], dtype=np.int64)), axis=0)
            ones = b.node("ConstantOfShape", bp, value=onnx.numpy_helper.from_array(np.array([True])))
            pad = b.node("Concat", ones, new, axis=1)
        pad = b.node("Unsqueeze", pad, b.const([1, 2], dtype=np.int64))
        allowed = b.node("And", allowed, pad)
    scores = b.node("Add", scores, b.node("Where", allowed, b.const(0.0), b.const(FMIN)))
    b.node("MatMul", b.node("Softmax", scores, axis=-1), v, out="y")
    outputs = [graphs.io("y", ["b", H, "s", D]), graphs.io("present_key", None), graphs.io("present_value", None)]
    return b.model(inputs, outputs)


def _repeat_kv(b, x, Hkv, H, D):
    u = b.node("Unsqueeze", x, b.const([2], dtype=np.int64))
    e = b.node("Expand", u, b.const([1, Hkv, H // Hkv, 1, D], dtype=np.int64))
    return b.node("Reshape", e, b.const([0, H, -1, D], dtype=np.int64))


def _repeat_kv_from_shape(b, x, Hkv, H, D):
    """repeat_kv with targets [B, Hkv, G, S, D] and [B, H, S, D] read from Shape(x) where x has the dim."""
    i64 = lambda v: b.const(v, dtype=np.int64)  # noqa: E731

    def dims(start, end):
        return b.node("Slice", b.node("Shape", x), i64([start]), i64([end]))

    u = b.node("Unsqueeze", x, i64([2]))
    e = b.node("Expand", u, b.node("Concat", dims(0, 2), i64([H // Hkv]), dims(2, 4), axis=0))
    return b.node("Reshape", e, b.node("Concat", dims(0, 1), i64([H]), dims(2, 4), axis=0))


def _decode_feeds(sq, past, lengths=None, H=4, Hkv=2, D=32, seed=0):
    rng = np.random.default_rng(seed)
    B = 3 if lengths is None else len(lengths)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    feeds = {"q": r(B, H, sq, D), "past_key": r(B, Hkv, past, D), "past_value": r(B, Hkv, past, D),
             "k_new": r(B, Hkv, sq, D), "v_new": r(B, Hkv, sq, D)}
    feeds["attention_mask"] = _left_padded(lengths or [past + sq] * B, past + sq)
    return feeds


@pytest.mark.parametrize("mask,cls,causal", [("causal", "causal", 1), ("causal_padding", "causal+padding", 1),
                                             ("window", "sliding_window", 1),
                                             ("window_padding", "sliding_window+padding", 1)])
def test_decode_graph_mask_class(mask, cls, causal):
    model = decode_graph(mask=mask)
    fused, res = fuse_model(model)
    fa = _fa(res)
    assert len(fa) == 1, _rejections(res)
    info, attrs = fa[0].rewrite.info, fa[0].rewrite.attrs
    assert info["mask_class"] == cls and attrs["causal"] == causal
    assert attrs["num_heads"] == 4 and attrs["num_kv_heads"] == 2
    if "window" in mask:
        assert info["window"] == 3
    for sq, past in ((1, 9), (7, 9), (16, 0)):  # decode, chunked prefill, prefill (Sk = Sq)
        lengths = [past + sq, past + sq - 2, max(1, past - 3)]  # the last row: padding inside the chunk
        feeds = _decode_feeds(sq, past, lengths)
        ref, got = _run(model, feeds), _run(fused, feeds)
        real = feeds["attention_mask"][:, None, past:, None].astype(bool)  # [B, 1, Sq, 1] real queries
        diff = np.abs(ref[0] - got[0])
        assert (diff[np.broadcast_to(real, diff.shape)].max() if "padding" in mask else diff.max()) <= 1e-4
        assert all(np.array_equal(a, c) for a, c in zip(ref[1:], got[1:]))


@pytest.mark.parametrize("Hkv", [2, 1])
@pytest.mark.parametrize("repeat", [None, "shape"])
def test_kv_heads_from_the_repeat_when_the_cache_dim_is_symbolic(Hkv, repeat):
    """A cache whose KV-head dim is a name ("kv_heads"): the head split is read from repeat_kv
    (the Expand's group size G, the Reshape's H: Hkv = H / G), not left at H."""
    model = decode_graph(Hkv=Hkv, kv_dim="kv_heads", repeat=repeat)
    fused, res = fuse_model(model)
    (a,) = _fa(res)
    assert (a.rewrite.attrs["num_heads"], a.rewrite.attrs["num_kv_heads"]) == (4, Hkv), a.rewrite.info
    assert "Expand" not in [n.op_type for n in fused.graph.node]
    for sq, past in ((1, 9), (7, 9)):
        feeds = _decode_feeds(sq, past, Hkv=Hkv)
        assert all(np.abs(r - g).max() <= 1e-4 for r, g in zip(_run(model, feeds), _run(fused, feeds)))


def _dynamo_kt(b, k, D):
    """dynamo's SDPA kᵀ: Reshape(Transpose(Reshape(k, [-1, Shape(k)[-2], D]), [0, 2, 1]),
    [Shape(k)[:-2], D, Shape(k)[-2]])."""
    i64 = lambda v: b.const(v, dtype=np.int64)  # noqa: E731
    seq = b.node("Slice", b.node("Shape", k), i64([-2]), i64([-1]))
    lead = b.node("Slice", b.node("Shape", k), i64([-(1 << 62)]), i64([-2]))
    flat = b.node("Reshape", k, b.node("Concat", i64([-1]), seq, i64([D]), axis=0))
    return b.node("Reshape", b.node("Transpose", flat, perm=[0, 2, 1]), b.node("Concat", lead, i64([D]), seq, axis=0))


def test_gqa_through_dynamo_kt_when_shapes_say_nothing():
    """K/V [B, Hkv, S, D] out of an op ONNX cannot infer (a contrib op whose stored shape is all
    ``unk__N``), repeated with Shape-built targets, k transposed the way dynamo writes SDPA's kᵀ:
    data propagation names the kᵀ chain's dims after k's (its fresh ``unk__N``), so the chain is
    proven, the head split found (num_kv_heads = 2, both repeat_kv absorbed) and the result matches."""
    H, Hkv, D = 4, 2, 32
    b = graphs.Builder(17)
    kv = [b.node("FastGelu", x, domain="com.microsoft", out=f"{x}_kv") for x in ("k_in", "v_in")]
    k, v = (_repeat_kv_from_shape(b, x, Hkv, H, D) for x in kv)
    scores = b.node("Mul", b.node("MatMul", "q", _dynamo_kt(b, k, D)), b.const(D ** -0.5))
    b.node("MatMul", b.node("Softmax", scores, axis=-1), v, out="y")
    model = b.model([graphs.io("q", ["b", H, "s", D]), graphs.io("k_in", ["b", Hkv, "s", D]),
                     graphs.io("v_in", ["b", Hkv, "s", D])], [graphs.io("y", ["b", H, "s", D])])
    model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    for name in kv:  # as a tool that ran ONNX's inference stored them
        model.graph.value_info.append(onnx.helper.make_tensor_value_info(
            name, TensorProto.FLOAT, [f"unk__{i}" for i in range(4)]))
    fused, res = fuse_model(model)
    (a,) = _fa(res)
    assert (a.rewrite.attrs["num_heads"], a.rewrite.attrs["num_kv_heads"]) == (H, Hkv), a.rewrite.info
    assert [t.name for t in a.rewrite.inputs[1:3]] == kv
    assert "Expand" not in [n.op_type for n in fused.graph.node]
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal(s).astype(np.float32)
             for n, s in (("q", (2, H, 5, D)), ("k_in", (2, Hkv, 5, D)), ("v_in", (2, Hkv, 5, D)))}
    assert np.abs(_run(model, feeds)[0] - _run(fused, feeds)[0]).max() <= 1e-4


def test_padding_probes_cover_the_cached_keys():
    """A mask input that pads only the new tokens' keys (the past's part ignored) is not key
    padding over all Sk keys: left-padded probe rows mask cached keys, the graph does not."""
    _, res = fuse_model(decode_graph(mask="causal_new_padding"))
    (a,) = _fa(res)
    assert a.rewrite.info["mask_class"] == "dynamic", a.rewrite.info
    assert a.rewrite.attrs["causal"] == 0


# ------------------------------------------------------------------------------------------------
# exported HF decoders with past_key_values
# ------------------------------------------------------------------------------------------------
DECODE_CASES = [(f, e, a) for f in ("llama", "gpt2") for e in ("torchscript", "dynamo") for a in ("sdpa", "eager")]
SHAPES = [(1, 9), (7, 9)]  # (Sq, past): decode, chunked prefill


@pytest.fixture(scope="session")
def fused_decode(exported_model):
    memo = {}

    def get(family, exporter, attn="sdpa"):
        key = (family, exporter, attn)
        if key not in memo:
            from optfuse.models import decode_dims

            em = exported_model(family, exporter, attn, past=True)
            model = onnx.load(str(em.path))
            fused, res = fuse_model(model, dims=decode_dims(1, 64))
            memo[key] = (em, model, fused, res)
        return memo[key]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("family,exporter,attn", DECODE_CASES)
def test_decode_export_fuses_with_causal_padding(fused_decode, family, exporter, attn):
    em, model, fused, res = fused_decode(family, exporter, attn)
    assert em.past and em.meta["kv_cache"]
    assert [i.name for i in em.inputs][:3] == ["input_ids", "attention_mask", "past_key_values.0.key"]
    fa = _fa(res)
    assert len(fa) == em.counts["attention"], _rejections(res)
    assert [n.op_type for n in fused.graph.node].count(OP) == em.counts["attention"]
    assert "Softmax" not in [n.op_type for n in fused.graph.node]
    for a in fa:
        assert a.rewrite.info["mask_class"] == "causal+padding", a.rewrite.info
        assert a.rewrite.attrs["causal"] == 1
        assert a.rewrite.attrs["num_heads"] == em.meta["num_heads"]
        assert a.rewrite.attrs["num_kv_heads"] == em.meta["num_kv_heads"]
    if family == "llama":
        assert em.meta["num_kv_heads"] < em.meta["num_heads"]  # GQA: the op takes the cache un-repeated


@pytest.mark.slow
@pytest.mark.parametrize("family,exporter,attn", DECODE_CASES)
def test_decode_export_matches(fused_decode, family, exporter, attn):
    """Sq = 1 and Sq = 7 over a past of 9: all ones, left padding within the past (every query is
    a real token: exact everywhere), and left padding into the new tokens (exact at real tokens)."""
    from optfuse.models import decode_dims, left_padded_mask

    em, model, fused, _ = fused_decode(family, exporter, attn)
    feeds, outs = em.sample()
    ref = _run(model, feeds)
    assert max(float(np.abs(r - outs[o.name]).max()) for r, o in zip(ref, em.outputs)) <= 1e-4  # the export
    for sq, past in SHAPES:
        total = past + sq
        feeds = em.make_inputs(decode_dims(sq, past, 4), seed=sq)
        for lengths in ([total] * 4, [total, total - 3, total - 8, sq], [total, total - 2, sq - 1 or 1, 1]):
            feeds["attention_mask"] = left_padded_mask(lengths, total)
            ref, got = _run(model, feeds), _run(fused, feeds)
            mask = feeds["attention_mask"].astype(bool)
            assert np.abs(ref[0] - got[0])[mask[:, past:]].max() <= 1e-4, (sq, lengths)  # real query tokens
            for a, b in zip(ref[1:], got[1:]):  # the cache [B, Hkv, Sk, D] at real positions
                assert np.abs(a - b).transpose(0, 2, 1, 3)[mask].max() <= 1e-4, (sq, lengths)
            if all(n >= sq for n in lengths):  # no padded query row: every output exact
                assert max(float(np.abs(a - b).max()) for a, b in zip(ref, got)) <= 1e-4, (sq, lengths)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_verify_leaves_out_padded_new_tokens(fused_decode, family):
    """Left padding that reaches the new tokens (dynamo exports, whose fused nodes' outputs name the query
    dim): verify maps the [batch, sequence] outputs onto the last positions of the [batch, total_sequence]
    mask, leaves out the new tokens that see no real key and passes; without the node metadata it fails."""
    from optfuse.models import decode_dims, left_padded_mask
    from optfuse.verify import padded_query_inputs, verify
    from optfuse.verify.padding import PADDED_QUERIES_KEY

    em, model, fused, _ = fused_decode(family, "dynamo")
    assert {v[2] for v in padded_query_inputs(fused)["attention_mask"]} == {"sequence"}
    sq, past = 7, 9
    feeds = em.make_inputs(decode_dims(sq, past, 4), seed=5)
    feeds["attention_mask"] = left_padded_mask([past + sq, past + sq - 3, 5, 1], past + sq)  # rows 2, 3 pad new tokens
    result = verify(model, fused, feeds=[feeds])
    assert result.passed and result.left_out.startswith("not compared: last_hidden_state at 8 of 28 positions"), \
        result.left_out
    stripped = graphs.without_metadata(fused, PADDED_QUERIES_KEY)
    assert not verify(model, stripped, feeds=[feeds]).passed


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fp16", "fp8"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_decode_export_converts(exported_model, tmp_path, family, mode):
    """convert of a decode export (no recipe; the shapes of a decode step: 1 new token over a past of 16): the
    present KV cache is a graph output that the fused attention also reads, and stays FP32 at the output while
    the attention reads the reduced-precision value; the candidate passes the onnxruntime check."""
    from optfuse.pipeline import Overrides, convert

    em = exported_model(family, "dynamo", "sdpa", past=True)
    cache = next(i for i in em.inputs if i.name == "past_key_values.0.key")
    shapes = {"input_ids": (2, 1), "attention_mask": (2, 17), cache.name: (2, cache.shape[1], 16, cache.shape[3])}
    res = convert(em.path, None, tmp_path / "out", skip_build=True,
                  overrides=Overrides(shapes={k: (v, v, v) for k, v in shapes.items()}, precision=mode))
    assert res.passed, [(s.name, s.state, s.detail) for s in res.steps]
    cand = onnx.load(str(next((tmp_path / "out").glob(f"*.{mode}.onnx"))), load_external_data=False)
    outs = {o.name: o.type.tensor_type.elem_type for o in cand.graph.output}
    assert all(t == TensorProto.FLOAT for t in outs.values())
    assert not [i for n in cand.graph.node if n.op_type == OP for i in n.input if i in outs]


@pytest.mark.slow
@pytest.mark.parametrize("family,exporter", [("llama", "torchscript"), ("gpt2", "dynamo")])
def test_decode_export_torch_reference(fused_decode, family, exporter):
    """The record's torch_outputs rebuilds the decode model (the fused graph against torch)."""
    from optfuse.models import decode_dims, left_padded_mask

    em, _, fused, _ = fused_decode(family, exporter)
    feeds = em.make_inputs(decode_dims(1, 12, 2), seed=3)
    feeds["attention_mask"] = left_padded_mask([13, 9], 13)
    want = em.torch_outputs(feeds)
    got = _run(fused, feeds)
    assert list(want) == [o.name for o in em.outputs]
    assert max(float(np.abs(want[o.name] - g).max()) for o, g in zip(em.outputs, got)) <= 1e-4


def _check_cache_reads(em, fused, res, dims):
    """Each attention node moves K and V at Sk = past + Sq keys and the KV heads (not Sq, not the
    query heads), q and the output at Sq, and the key-padding row [B, 1, 1, Sk] (fp32) it reads;
    the node that owns the row's Slice (shared by all layers) also its read of the mask
    [B, 1, Sq, Sk], its write of the row and its three int64 parameters."""
    est = estimate_traffic(fused, res, dims)
    B, Sq, Sk, D = dims["batch"], dims["sequence"], dims["total_sequence"], em.meta["head_dim"]
    H, Hkv = em.meta["num_heads"], em.meta["num_kv_heads"]
    kv = 2 * B * Hkv * Sk * D * 4
    q_out = 2 * B * H * Sq * D * 4
    row = B * Sk * 4
    for a in _fa(res):
        moved = est.moved_bytes[a.node_name]
        assert moved is not None, a.node_name
        slice_ = B * Sq * Sk * 4 + row + 3 * 8 if a.added_nodes else 0
        assert moved == kv + q_out + row + slice_, (moved, kv, q_out, row, slice_)
        assert est.saved_bytes[a.node_name] is not None and est.saved_bytes[a.node_name] > 0


@pytest.mark.slow
@pytest.mark.parametrize("sq", [1, 7])
@pytest.mark.parametrize("family,exporter", [(f, e) for f in ("llama", "gpt2") for e in ("torchscript", "dynamo")])
def test_decode_hbm_estimate_counts_the_cache_reads(fused_decode, family, exporter, sq):
    """Decode (Sq = 1) and chunked prefill (Sq = 7) over a past of 64."""
    from optfuse.models import decode_dims

    em, _, fused, res = fused_decode(family, exporter)
    _check_cache_reads(em, fused, res, decode_dims(sq, 64))


@pytest.mark.slow
@pytest.mark.parametrize("family,exporter", [(f, e) for f in ("llama", "gpt2") for e in ("torchscript", "dynamo")])
def test_decode_export_passes_verify(fused_decode, family, exporter):
    """optfuse.verify at consistent decode dims (its generated masks are right-padded)."""
    from optfuse.models import decode_dims
    from optfuse.verify import VerifyOptions, verify

    _, model, fused, _ = fused_decode(family, exporter)
    for sq in (1, 7):
        result = verify(model, fused, VerifyOptions(dims=decode_dims(sq, 9)), iterations=2)
        assert result.passed, [(o.name, o.max_abs) for o in result.failed]
        assert len(result.outputs) == 1 + 2 * 2  # last_hidden_state and the two layers' present k / v


# ------------------------------------------------------------------------------------------------
# the GQA / MQA head split of exported LLaMA, with and without a cache, over stale value_info
# ------------------------------------------------------------------------------------------------
GQA_CASES = [(e, p, hkv) for e in ("torchscript", "dynamo") for p in (False, True) for hkv in (2, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("stale", [False, True], ids=["as_exported", "stale_value_info"])
@pytest.mark.parametrize("exporter,past,hkv", GQA_CASES)
def test_gqa_head_split_is_read_from_the_graph(exported_model, exporter, past, hkv, stale):
    """LLaMA with 4 query heads over 2 (GQA) or 1 (MQA) KV heads: every block fuses with
    num_kv_heads = Hkv and takes K/V before repeat_kv (its Expand / Reshape leave the graph), also
    when the model was saved after a plain ONNX shape inference (``unk__N`` dims in value_info,
    which ONNX keeps over the dims data propagation finds), and matches the original."""
    from optfuse.models import decode_dims

    em = exported_model("llama", exporter, "sdpa", past=past, num_key_value_heads=hkv)
    assert (em.meta["num_heads"], em.meta["num_kv_heads"]) == (4, hkv)
    model = onnx.load(str(em.path))
    if stale:
        model = onnx.shape_inference.infer_shapes(model)
        assert any(d.dim_param.startswith("unk__") for vi in model.graph.value_info
                   for d in vi.type.tensor_type.shape.dim)
    fused, res = fuse_model(model, dims=decode_dims(1, 64) if past else None)
    fa = _fa(res)
    assert len(fa) == em.counts["attention"], _rejections(res)
    for a in fa:
        assert (a.rewrite.attrs["num_heads"], a.rewrite.attrs["num_kv_heads"]) == (4, hkv), a.rewrite.info
        assert a.rewrite.info["mask_class"] == "causal+padding"
    expands = [[n.op_type for n in m.graph.node].count("Expand") for m in (model, fused)]
    assert expands[0] - expands[1] == 2 * len(fa), expands  # K's and V's repeat_kv, per block
    dims = decode_dims(7, 9, 2) if past else {"batch": 2, "sequence": 7}
    feeds = em.make_inputs(dims, seed=hkv)
    feeds["attention_mask"] = np.ones_like(feeds["attention_mask"])
    ref, got = _run(model, feeds), _run(fused, feeds)
    assert max(float(np.abs(r - g).max()) for r, g in zip(ref, got)) <= 1e-4
    if past:  # the estimate reads the cache at Hkv heads
        _check_cache_reads(em, fused, res, decode_dims(1, 64))
