"""Sparse attention fusion: masks -> kernel parameters (windows, soft-cap, block layouts).

Hand-built graphs (constant block masks -> BlockSparseAttention with the expected BSR layout,
Gemma 2's soft-cap) and exported HF families with sliding windows (Mistral, Qwen2, Gemma 2), BERT
with left- and right-padded batches, and the families whose sparse attention is not a mask
(Longformer, BigBird: reported as not fused), and DeBERTa's disentangled attention (input-side
nodes that other products read stay). One module past 500 lines: the exported cases reuse the
hand-built graphs' helpers and checks.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto

import graphs
from optfuse.fusions import fuse_model
from optfuse.kernels.registry import plugin_module
from optfuse.pattern import FusionOptions

R = plugin_module("flash_attention", "reference")
FA, BSA = "FlashAttention", "BlockSparseAttention"
F32 = TensorProto.FLOAT
FMIN = float(np.finfo(np.float32).min)


_run = graphs.run


def _attention(ops, res):
    return [a for a in res.accepted if a.op in ops]


def _rejections(res):
    return [r.reason for r in res.rejected if r.op == FA]


def _initializer(model, name):
    return next(onnx.numpy_helper.to_array(t) for t in model.graph.initializer if t.name == name)


def _node(model, op):
    return [n for n in model.graph.node if n.op_type == op]


# ------------------------------------------------------------------------------------------------
# hand-built graphs
# ------------------------------------------------------------------------------------------------
def masked_attention(keep: np.ndarray, *, H=2, D=32, softcap=None, softcap_form="div", layers=1):
    """``layers`` attention blocks over q, k, v [1, H, S, D] with the constant additive mask
    where(keep, 0, finfo.min) (keep [S, S] or [H, S, S]); softcap: c * tanh(s / c) before the mask."""
    S = keep.shape[-1]
    b = graphs.Builder(17)
    mask = np.where(keep, 0.0, FMIN).astype(np.float32)
    mask_name = b.const(mask.reshape((1,) * (4 - mask.ndim) + mask.shape))
    x = "q"
    for _ in range(layers):
        s = b.node("Mul", b.node("MatMul", x, b.node("Transpose", "k", perm=[0, 1, 3, 2])), b.const(D ** -0.5))
        if softcap is not None:
            c_in, c_out = softcap if isinstance(softcap, tuple) else (softcap, softcap)
            inner = b.node("Div", s, b.const(c_in)) if softcap_form == "div" else b.node("Mul", s, b.const(1.0 / c_in))
            s = b.node("Mul", b.node("Tanh", inner), b.const(c_out))
        x = b.node("MatMul", b.node("Softmax", b.node("Add", s, mask_name), axis=-1), "v")
    b.node("Identity", x, out="y")
    io = [graphs.io(n, [1, H, S, D]) for n in ("q", "k", "v")]
    return b.model(io, [graphs.io("y", [1, H, S, D])])


def _feeds(H, S, D=32, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return {n: (scale * rng.standard_normal((1, H, S, D))).astype(np.float32) for n in ("q", "k", "v")}


def _local_global(S=512, window=128, n_global=16):
    """Local blocks of ``window`` tokens plus global tokens 0..n_global-1 (Longformer-style as a mask)."""
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    return ((i // window) == (j // window)) | (i < n_global) | (j < n_global)


def _blocks(offsets, indices):
    return [[list(indices[h, offsets[h, m]:offsets[h, m + 1]]) for m in range(offsets.shape[1] - 1)]
            for h in range(offsets.shape[0])]


def test_local_global_block_mask_becomes_block_sparse():
    keep = _local_global()
    model = masked_attention(keep, layers=2)
    fused, res = fuse_model(model)
    acc = _attention((FA, BSA), res)
    assert [a.op for a in acc] == [BSA, BSA], _rejections(res)
    node = _node(fused, BSA)[0]
    offsets, indices = (_initializer(fused, node.input[i]) for i in (4, 5))
    assert offsets.dtype == indices.dtype == np.int32
    # query block 0 holds the global queries (every key block); the others see key block 0
    # (the global keys) and their own block
    assert _blocks(offsets, indices) == [[[0, 1, 2, 3], [0, 1], [0, 2], [0, 3]]]
    a = acc[0].rewrite
    assert a.attrs["causal"] == 0 and a.attrs["block_size"] == 128
    assert a.info["mask_class"] == "block" and a.info["block_density"] == pytest.approx(10 / 16)
    assert a.info["partial_blocks_masked_by_bias"] is True  # key block 0 holds 16 visible keys of 128
    assert onnx.numpy_helper.to_array(next(t for t in fused.graph.initializer if t.name == node.input[3])).ndim == 4
    # both layers read one pair of layout initializers
    assert len({tuple(n.input[4:]) for n in _node(fused, BSA)}) == 1
    feeds = _feeds(2, 512)
    assert np.abs(_run(model, feeds)[0] - _run(fused, feeds)[0]).max() <= 1e-5
    # attention_full_mask keeps FlashAttention with the whole mask
    _, res_full = fuse_model(model, options=FusionOptions(attention_full_mask=True))
    assert {a.op for a in _attention((FA, BSA), res_full)} == {FA}


def test_block_aligned_causal_layout_needs_no_bias():
    """Strided block-causal layout (Phi-3-small-like: local blocks + every 2nd block, causal):
    the listed blocks with causal = 1 are exactly the mask, so the bias is the scalar zero."""
    S, blk = 512, 128
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    bi, bj = i // blk, j // blk
    keep = (j <= i) & ((bi - bj <= 1) | (bj % 2 == 0))
    model = masked_attention(keep)
    fused, res = fuse_model(model)
    (acc,) = _attention((FA, BSA), res)
    assert acc.op == BSA and acc.rewrite.attrs["causal"] == 1
    assert acc.rewrite.info["partial_blocks_masked_by_bias"] is False
    node = _node(fused, BSA)[0]
    bias = next(t for t in fused.graph.initializer if t.name == node.input[3])
    assert onnx.numpy_helper.to_array(bias).size == 1 and not onnx.numpy_helper.to_array(bias).any()  # a zero
    offsets, indices = (_initializer(fused, node.input[n]) for n in (4, 5))
    assert _blocks(offsets, indices) == [[[0], [0, 1], [0, 1, 2], [0, 2, 3]]]
    feeds = _feeds(2, S, seed=1)
    assert np.abs(_run(model, feeds)[0] - _run(fused, feeds)[0]).max() <= 1e-5


def test_layout_per_head_when_heads_differ():
    S, H = 384, 2
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    keep = np.stack([(i // 128) == (j // 128), (i // 128) == ((j // 128 + 1) % 3)])
    model = masked_attention(keep, H=H)
    fused, res = fuse_model(model)
    (acc,) = _attention((FA, BSA), res)
    assert acc.op == BSA and acc.rewrite.info["layout_heads"] == 2
    node = _node(fused, BSA)[0]
    offsets, indices = (_initializer(fused, node.input[n]) for n in (4, 5))
    assert _blocks(offsets, indices) == [[[0], [1], [2]], [[2], [0], [1]]]
    assert acc.rewrite.info["partial_blocks_masked_by_bias"] is False
    feeds = _feeds(H, S, seed=2)
    assert np.abs(_run(model, feeds)[0] - _run(fused, feeds)[0]).max() <= 1e-5


def test_dense_or_dead_row_block_masks_stay_flash_attention():
    # a block mask inside one 128-block lists every block: nothing to skip
    i, j = np.arange(64)[:, None], np.arange(64)[None, :]
    _, res = fuse_model(masked_attention((i // 8) == (j // 8)))
    assert [a.op for a in _attention((FA, BSA), res)] == [FA]
    # a query row with no visible key: the unfused graph averages it over every key, so the mask
    # stays whole under FlashAttention (exact)
    keep = _local_global(S=256, n_global=0)
    keep[5] = False
    model = masked_attention(keep)
    fused, res = fuse_model(model)
    assert [a.op for a in _attention((FA, BSA), res)] == [FA]
    feeds = _feeds(2, 256)
    assert np.abs(_run(model, feeds)[0] - _run(fused, feeds)[0]).max() <= 1e-5


@pytest.mark.parametrize("form", ["div", "mul"])
def test_softcap_is_folded(form):
    keep = np.tril(np.ones((16, 16), bool))
    model = masked_attention(keep, softcap=5.0, softcap_form=form)
    fused, res = fuse_model(model)
    (acc,) = _attention((FA,), res)
    assert acc.rewrite.attrs["softcap"] == pytest.approx(5.0)
    assert acc.rewrite.attrs["causal"] == 1 and acc.rewrite.info["mask_class"] == "causal"
    assert "Tanh" not in [n.op_type for n in fused.graph.node]
    feeds = _feeds(2, 16, scale=4.0)  # scores beyond the cap
    assert np.abs(_run(model, feeds)[0] - _run(fused, feeds)[0]).max() <= 1e-5


def test_tanh_that_is_not_a_softcap_is_rejected():
    model = masked_attention(np.ones((16, 16), bool), softcap=(3.0, 5.0))
    _, res = fuse_model(model)
    assert not _attention((FA, BSA), res)
    assert any("not a soft-cap" in r for r in _rejections(res)), _rejections(res)


def test_sparsity_estimate_matches_brute_force():
    from optfuse.estimate import attention_sparsity

    for sq, sk, causal, wl, wr in ((1000, 1000, 1, 299, -1), (300, 700, 1, 100, -1), (500, 500, 0, 60, 60),
                                   (256, 256, 1, -1, -1)):
        got = attention_sparsity(2, 3, sq, sk, 64, 2, causal=causal, window_left=wl, window_right=wr)
        vis = R.visible(sq, sk, bool(causal), wl, wr)
        mb, nb = -(-sq // 128), -(-sk // 128)
        pad = np.zeros((mb * 128, nb * 128), bool)
        pad[:sq, :sk] = vis
        tiles = pad.reshape(mb, 128, nb, 128).any(axis=(1, 3))
        assert got["block_density"] == pytest.approx(tiles.mean(), abs=1e-6)
        assert got["visible_fraction"] == pytest.approx(vis.mean(), abs=1e-6)
        scores = sum(min(128, sq - m * 128) * min(128, sk - n * 128) for m, n in zip(*np.nonzero(tiles)))
        assert got["score_flops"] == 4 * 64 * scores * 6
        assert got["flops_removed"] == pytest.approx(1 - scores / (sq * sk), abs=1e-6)
        kv = sum(min(128, sk - n * 128) for _, n in zip(*np.nonzero(tiles)))
        assert got["kv_reads_removed"] == pytest.approx(1 - kv / (mb * sk), abs=1e-6)
    # the case: window 1024 at S = 16k, causal: ~1/16 of the dense tiles
    w = attention_sparsity(1, 8, 16384, 16384, 128, 2, causal=1, window_left=1023)
    assert 0.06 < w["block_density"] < 0.071 and w["flops_removed"] > 0.93


def test_report_states_window_density_at_the_dims():
    from optfuse.estimate import estimate_traffic
    from optfuse.report.fusion import build_report, render_markdown

    S = 512
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    model = masked_attention((j <= i) & (j > i - 128))
    fused, res = fuse_model(model, dims={})
    (acc,) = _attention((FA,), res)
    assert acc.rewrite.attrs["window_left"] == 127 and acc.rewrite.info["window"] == 128
    est = estimate_traffic(fused, res)
    work = est.sparsity[acc.node_name]
    assert work["sq"] == work["sk"] == S and work["block_density"] == pytest.approx(7 / 16)
    report = build_report(res, estimate=est)
    assert report["fusions"][0]["sparsity"]["flops_removed"] == work["flops_removed"]
    md = render_markdown(report)
    assert "window=128" in md and "128-tile density 0.438" in md and "score FLOPs removed 56.2%" in md
    # a block layout: the listed tiles (10 of 16)
    fused, res = fuse_model(masked_attention(_local_global()))
    (acc,) = _attention((BSA,), res)
    assert estimate_traffic(fused, res).sparsity[acc.node_name]["block_density"] == pytest.approx(10 / 16)


# ------------------------------------------------------------------------------------------------
# exported HF models
# ------------------------------------------------------------------------------------------------
WINDOW = 10  # the test families' sliding_window
DIMS = {"batch": 3, "sequence": 24}  # windows of 10 matter at 24 tokens
#: family -> attention classes per layer (window or None)
LAYERS = {
    "mistral": [("sliding_window+padding", WINDOW)] * 2,
    "qwen2": [("causal+padding", None)] * 2 + [("sliding_window+padding", WINDOW)] * 2,  # max_window_layers = 2
    "gemma2": [("sliding_window+padding", WINDOW), ("causal+padding", None)],  # local, global
}
CASES = [(f, e, a) for f in LAYERS for e in ("torchscript", "dynamo") for a in ("sdpa", "eager")
         if not (f == "gemma2" and a == "sdpa")]


def _layer(acc) -> int | None:
    """The layer index in the original node names (layers.N / layers_N), if they carry one."""
    import re

    for n in acc.nodes:
        hit = re.search(r"layers[._](\d+)", n)
        if hit:
            return int(hit.group(1))
    return None


def _padded_masks(S):
    """Right-padded, left-padded and full rows (no row empty)."""
    return {"right": np.array([[1] * S, [1] * 7 + [0] * (S - 7), [1] * (S - 3) + [0] * 3], np.int64),
            "left": np.array([[1] * S, [0] * (S - 7) + [1] * 7, [0] * 3 + [1] * (S - 3)], np.int64)}


def _compare(model, fused, em, mask, everywhere=False):
    from optfuse.models import make_inputs

    feeds = make_inputs(em.inputs, {"batch": mask.shape[0], "sequence": mask.shape[1]}, seed=0)
    feeds["attention_mask"] = mask
    ref, got = _run(model, feeds)[0], _run(fused, feeds)[0]
    err = np.abs(ref - got) if everywhere else np.abs(ref - got)[mask.astype(bool)]
    return float(err.max())


@pytest.mark.slow
@pytest.mark.parametrize("family,exporter,attn", CASES)
def test_sliding_window_families_fuse_with_their_windows(fused_export, family, exporter, attn):
    em, model, fused, res = fused_export(family, exporter, attn)
    acc = _attention((FA, BSA), res)
    want = LAYERS[family]
    assert len(acc) == len(want) == em.counts["attention"], _rejections(res)
    assert {a.op for a in acc} == {FA} and "Softmax" not in [n.op_type for n in fused.graph.node]
    layers = [_layer(a) for a in acc]
    order = sorted(range(len(acc)), key=lambda k: layers[k]) if None not in layers else range(len(acc))
    got = [(acc[k].rewrite.info["mask_class"], acc[k].rewrite.info.get("window")) for k in order]
    if None in layers:  # dynamo names: compare as a multiset
        got, want = sorted(got, key=str), sorted(want, key=str)
    assert got == want
    for a in acc:
        attrs = a.rewrite.attrs
        assert attrs["causal"] == 1 and a.rewrite.info["mask_source"] == "attention_mask"
        w = a.rewrite.info.get("window")
        assert attrs.get("window_left", -1) == (w - 1 if w else -1)
        assert attrs.get("softcap", 0.0) == (50.0 if family == "gemma2" else 0.0)
        assert attrs["scale"] == pytest.approx(32 ** -0.5, rel=1e-5)
    for name, mask in _padded_masks(DIMS["sequence"]).items():
        assert _compare(model, fused, em, mask) <= 1e-4, name
    # the whole mask (attention_full_mask) is exact at every row, padded queries included
    _, _, full, res_full = fused_export(family, exporter, attn, attention_full_mask=True)
    assert {a.rewrite.attrs["causal"] for a in _attention((FA,), res_full)} == {0}
    assert not any("window_left" in a.rewrite.attrs for a in _attention((FA,), res_full))
    mask = _padded_masks(DIMS["sequence"])["right"]
    assert _compare(model, full, em, mask, everywhere=True) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("family,exporter", [(f, e) for f in LAYERS for e in ("torchscript", "dynamo")])
def test_verify_leaves_out_the_padded_queries_that_see_no_real_key(fused_export, family, exporter):
    """Every fused node of a padded causal / window mask names its mask in its metadata, so verify compares
    the fused model everywhere but at the padded queries whose view holds no real key: every position that
    differs is left out, only padded positions are, and verify passes (per node too: every intermediate exact
    at the kept positions); without the metadata it fails where a position differs (every export but Mistral's
    and Qwen2's TorchScript SDPA graphs, whose padded rows already come out as the fused node's)."""
    from optfuse.models import make_inputs
    from optfuse.verify import padded_query_inputs, verify
    from optfuse.verify.padding import PADDED_QUERIES_KEY, named_shapes, padded_positions
    from optfuse.verify.per_node import compare_per_node

    em, model, fused, _ = fused_export(family, exporter, "eager" if family == "gemma2" else "sdpa")
    views = padded_query_inputs(fused)
    assert list(views) == ["attention_mask"]
    assert sorted(v[:2] for v in views["attention_mask"]) == sorted({(1, w - 1 if w else -1) for _, w in LAYERS[family]})
    out = model.graph.output[0].name
    differing = []
    for name, mask in _padded_masks(DIMS["sequence"]).items():
        feeds = make_inputs(em.inputs, {"batch": mask.shape[0], "sequence": mask.shape[1]}, seed=0)
        feeds["attention_mask"] = mask
        ref, got = _run(model, feeds)[0], _run(fused, feeds)[0]
        (keep,), masks, axis = padded_positions(named_shapes(model), out, views, [feeds], [ref], [got])
        assert axis == 1
        differs = np.abs(ref - got).max(axis=-1) > 1e-4
        assert masks == ["attention_mask"], name
        assert not (differs & keep).any() and not (~keep & mask.astype(bool)).any(), name
        result = verify(model, fused, feeds=[feeds])
        assert result.passed and result.left_out.startswith(f"not compared: {out} at {int((~keep).sum())} of "), name
        differing += [feeds] if differs.any() else []
    assert differing or (exporter == "torchscript" and family != "gemma2")
    for feeds in differing[:1]:  # per node too: every compared tensor exact at the positions kept
        per_node = compare_per_node(model, fused, feeds=[feeds])
        assert per_node.left_out and max(t.max_abs for t in per_node.tensors.values()) <= 1e-4
    stripped = graphs.without_metadata(fused, PADDED_QUERIES_KEY)
    for feeds in differing:
        assert not verify(model, stripped, feeds=[feeds]).passed


@pytest.mark.slow
@pytest.mark.parametrize("exporter,attn", [(e, a) for e in ("torchscript", "dynamo") for a in ("sdpa", "eager")])
def test_bert_padded_batches_exact(fused_export, exporter, attn):
    """Key padding only: every row keeps its real keys, so left and right padding are exact everywhere."""
    em, model, fused, res = fused_export("bert", exporter, attn)
    assert {a.rewrite.info["mask_class"] for a in _attention((FA,), res)} == {"padding"}
    for name, mask in _padded_masks(12).items():
        assert _compare(model, fused, em, mask, everywhere=True) <= 1e-4, name


# ------------------------------------------------------------------------------------------------
# Families registered for this module only: Phi-3 with a window; Longformer and BigBird, whose
# sparse attention is chunked / gathered matmuls rather than a mask (reported as not fused)
# ------------------------------------------------------------------------------------------------
def _extra_families():
    from optfuse.models import Family

    return [
        Family("sparse_phi3", "Phi-3 decoder with a sliding window (fused qkv / gate_up projections)",
               "Phi3Config", "Phi3Model",
               dict(vocab_size=1000, max_position_embeddings=128, hidden_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, sliding_window=WINDOW,
                    use_cache=False, pad_token_id=0, bos_token_id=0, eos_token_id=0),
               ("input_ids", "attention_mask"), "rms_norm", causal=True, position="rotary",
               call_kwargs={"use_cache": False}),
        Family("sparse_longformer", "Longformer encoder (sliding chunks + global attention)", "LongformerConfig",
               "LongformerModel",
               dict(vocab_size=1000, max_position_embeddings=160, hidden_size=64, num_hidden_layers=2,
                    num_attention_heads=2, intermediate_size=128, attention_window=8, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, pad_token_id=1),
               ("input_ids", "attention_mask"), "layer_norm", causal=False),
        Family("sparse_bigbird", "BigBird encoder (block_sparse: gathered random / window / global blocks)",
               "BigBirdConfig", "BigBirdModel",
               dict(vocab_size=1000, max_position_embeddings=256, hidden_size=64, num_hidden_layers=2,
                    num_attention_heads=2, intermediate_size=128, attention_type="block_sparse", block_size=2,
                    num_random_blocks=1, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
               ("input_ids", "attention_mask"), "layer_norm", causal=False),
        Family("sparse_deberta", "DeBERTa-v2 encoder (disentangled attention: c2p / p2c position products)",
               "DebertaV2Config", "DebertaV2Model",
               dict(vocab_size=1000, max_position_embeddings=128, hidden_size=64, num_hidden_layers=2,
                    num_attention_heads=2, intermediate_size=128, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, relative_attention=True, position_buckets=32,
                    max_relative_positions=64, pos_att_type=["p2c", "c2p"], type_vocab_size=0),
               ("input_ids", "attention_mask"), "layer_norm", causal=False),
    ]


@pytest.fixture(scope="module")
def extra_export(model_cache_dir):
    models = pytest.importorskip("optfuse.models")
    added = {f.name: f for f in _extra_families()}
    assert not set(added) & set(models.FAMILIES)
    models.FAMILIES.update(added)
    memo = {}

    def get(family, exporter="torchscript", attn="eager"):
        if (family, exporter, attn) not in memo:
            em = models.cached_export(family, exporter, attn, cache_dir=model_cache_dir)
            model = onnx.load(str(em.path))
            memo[(family, exporter, attn)] = (em, model, *fuse_model(model, dims={"batch": 2, "sequence": 16}))
        return memo[(family, exporter, attn)]

    try:
        yield get
    finally:
        for name in added:
            models.FAMILIES.pop(name, None)


@pytest.mark.slow
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_phi3_window_fuses(extra_export, exporter):
    em, model, fused, res = extra_export("sparse_phi3", exporter, "eager")
    acc = _attention((FA, BSA), res)
    assert len(acc) == 2, _rejections(res)
    for a in acc:
        assert a.rewrite.info["mask_class"] == "sliding_window+padding" and a.rewrite.info["window"] == WINDOW
        assert a.rewrite.attrs["causal"] == 1 and a.rewrite.attrs["window_left"] == WINDOW - 1
    for name, mask in _padded_masks(DIMS["sequence"]).items():
        assert _compare(model, fused, em, mask) <= 1e-4, name


@pytest.mark.slow
@pytest.mark.parametrize("family", ["sparse_longformer", "sparse_bigbird"])
def test_chunked_sparse_attention_is_reported_not_fused(extra_export, family):
    """Longformer's sliding chunks and BigBird's block gathers are not a mask: nothing fuses, and
    the report says why for every Softmax of the model."""
    from optfuse.report.fusion import build_report, render_markdown

    em, model, fused, res = extra_export(family)
    assert not _attention((FA, BSA), res)
    softmaxes = {n.name for n in model.graph.node if n.op_type == "Softmax"}
    assert softmaxes
    rejected = [r for r in res.rejected if r.op == FA]
    covered = {n for r in rejected for n in r.nodes}
    assert softmaxes <= covered, (softmaxes - covered, [r.reason for r in rejected])
    md = render_markdown(build_report(res))
    if family == "sparse_longformer":  # its Softmax feeds the value product through chunk reshapes
        assert all(r.rule == "attention.unrecognized" for r in rejected)
        assert "Longformer's sliding chunks" in md
    assert "## Not fused" in md and all(r.rule in md for r in rejected)
    feeds = __import__("optfuse.models", fromlist=["make_inputs"]).make_inputs(em.inputs, seed=0)
    assert np.abs(_run(model, feeds)[0] - _run(fused, feeds)[0]).max() <= 1e-5


# ------------------------------------------------------------------------------------------------
# Input-side intermediates with other readers: the match shrinks instead of failing
# ------------------------------------------------------------------------------------------------
def test_head_split_read_elsewhere_stays_and_attention_fuses():
    """q's 3-D head merge (batched rule) also feeds a position product, as in DeBERTa: the Reshape
    stays for that reader, the fused node reads the 4-D q, the position scores are its bias."""
    H, S, D = 2, 8, 32
    b = graphs.Builder(17)
    q3 = b.node("Reshape", "q", b.const([H, S, D], dtype=np.int64))  # batch 1: [B*H, S, D]
    k3 = b.node("Reshape", "k", b.const([H, S, D], dtype=np.int64))
    v3 = b.node("Reshape", "v", b.const([H, S, D], dtype=np.int64))
    pos = b.node("MatMul", q3, b.node("Transpose", "pos_k", perm=[0, 2, 1]))  # c2p-like [B*H, S, S]
    s = b.node("Add", b.node("Mul", b.node("MatMul", q3, b.node("Transpose", k3, perm=[0, 2, 1])), b.const(D ** -0.5)),
               pos)
    p = b.node("Softmax", b.node("Reshape", s, b.const([1, H, S, S], dtype=np.int64)), axis=-1)
    o3 = b.node("MatMul", b.node("Reshape", p, b.const([H, S, S], dtype=np.int64)), v3)
    b.node("Reshape", o3, b.const([1, H, S, D], dtype=np.int64), out="y")
    io = [graphs.io(n, [1, H, S, D]) for n in ("q", "k", "v")] + [graphs.io("pos_k", [H, S, D])]
    model = b.model(io, [graphs.io("y", [1, H, S, D])])
    fused, res = fuse_model(model)
    (acc,) = _attention((FA,), res)
    assert acc.rule == "attention.batched" and acc.rewrite.info["kept_for_other_readers"]
    assert not set(acc.rewrite.info["kept_for_other_readers"]) & set(acc.nodes)  # not reported as replaced
    ops = [n.op_type for n in fused.graph.node]
    assert "Softmax" not in ops and ops.count("MatMul") == 1  # the position product stays
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal([1, H, S, D] if n != "pos_k" else [H, S, D]).astype(np.float32)
             for n in ("q", "k", "v", "pos_k")}
    assert np.abs(_run(model, feeds)[0] - _run(fused, feeds)[0]).max() <= 1e-5


def test_scores_read_elsewhere_still_reject():
    """Only input-side nodes may stay: the scores themselves used elsewhere still reject the match."""
    H, S, D = 2, 8, 32
    b = graphs.Builder(17)
    s = b.node("MatMul", "q", b.node("Transpose", "k", perm=[0, 1, 3, 2]))
    b.node("MatMul", b.node("Softmax", b.node("Mul", s, b.const(D ** -0.5)), axis=-1), "v", out="y")
    b.node("ReduceMax", s, axes=[-1], keepdims=0, out="smax")
    model = b.model([graphs.io(n, [1, H, S, D]) for n in ("q", "k", "v")],
                    [graphs.io("y", [1, H, S, D]), graphs.io("smax", [1, H, S])])
    _, res = fuse_model(model)
    assert not _attention((FA,), res) and any("is also used by" in r for r in _rejections(res))


@pytest.mark.slow
def test_disentangled_attention_fuses_around_its_position_products(extra_export):
    """DeBERTa-v2: the head-split q and k also feed the c2p / p2c products; they stay, the fused
    node takes the 4-D q, k, v and the summed position scores (+ the padding mask) as its bias."""
    em, model, fused, res = extra_export("sparse_deberta")
    acc = _attention((FA,), res)
    assert len(acc) == 2, _rejections(res)
    assert all(a.rewrite.info.get("kept_for_other_readers") for a in acc)
    assert all(a.rewrite.attrs["scale"] == pytest.approx((32 * 3) ** -0.5, rel=1e-5) for a in acc)  # scale_factor 3
    assert "Softmax" not in [n.op_type for n in fused.graph.node]
    for name, mask in _padded_masks(12).items():
        assert _compare(model, fused, em, mask, everywhere=True) <= 1e-4, name


def test_onnx_attention_op_with_a_window_mask():
    """ONNX Attention (opset 23) with a bool sliding-window + padding mask built from positions."""
    w = 3
    b = graphs.Builder(23)
    ones = b.node("Add", b.node("Mul", "attention_mask", b.const(0, dtype=np.int64)), b.const(1, dtype=np.int64))
    pos = b.node("Sub", b.node("CumSum", ones, b.const(1, dtype=np.int64)), b.const(1, dtype=np.int64))  # [b, s]
    rows, cols = b.node("Unsqueeze", pos, b.const([2], dtype=np.int64)), b.node("Unsqueeze", pos, b.const([1], dtype=np.int64))
    allowed = b.node("And", b.node("LessOrEqual", cols, rows),
                     b.node("Greater", cols, b.node("Sub", rows, b.const(w, dtype=np.int64))))  # [b, s, s]
    pad = b.node("Unsqueeze", b.node("Cast", "attention_mask", to=TensorProto.BOOL), b.const([1], dtype=np.int64))
    mask = b.node("Unsqueeze", b.node("And", allowed, pad), b.const([1], dtype=np.int64))  # [b, 1, s, s]
    b.node("Attention", "q", "k", "v", mask, out="y")
    model = b.model([graphs.io("q", ["b", 4, "s", 32]), graphs.io("k", ["b", 2, "s", 32]),
                     graphs.io("v", ["b", 2, "s", 32]), graphs.io("attention_mask", ["b", "s"], TensorProto.INT64)],
                    [graphs.io("y", ["b", 4, "s", 32])])
    model.ir_version = 10
    fused, res = fuse_model(model)
    (acc,) = _attention((FA,), res)
    assert acc.rule == "attention.onnx" and acc.rewrite.info["mask_class"] == "sliding_window+padding"
    assert acc.rewrite.attrs["causal"] == 1 and acc.rewrite.attrs["window_left"] == w - 1
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in
             (("q", (2, 4, 9, 32)), ("k", (2, 2, 9, 32)), ("v", (2, 2, 9, 32)))}
    feeds["attention_mask"] = np.array([[1] * 9, [0] * 3 + [1] * 6], np.int64)  # left padded
    real = feeds["attention_mask"].astype(bool)[:, None, :, None]
    assert np.abs(np.where(real, _run(model, feeds)[0] - _run(fused, feeds)[0], 0)).max() <= 1e-4
