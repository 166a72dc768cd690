"""Attention fusion on model families the patterns were not written against (slow: exports).

The fusion rules were developed on the families of ``optfuse.models.FAMILIES`` (BERT, GPT-2, ViT,
LLaMA, T5). Issue 5 asks that every attention block fuses on families never seen as well; these
differ from those in how they build the attention subgraph:

- Qwen2: q/k/v projections with bias, GQA (4 query / 2 KV heads), rotary, causal + padding;
- GPT-NeoX: one fused QKV projection split per head, partial rotary (a quarter of the head dim);
- OPT: q scaled before Q K^T, causal mask from its own decoder code;
- DistilBERT: its own padding-mask chain (masked_fill on a boolean mask), no token types;
- CLIP text: causal + padding masks combined, quick-GELU;
- Falcon (new decoder architecture): q, k, v sliced out of one [B, S, Hkv, G + 2, D] view of the
  fused QKV projection (TorchScript leaves the sliced head counts to the static dims), k and v
  broadcast to the query heads, attention and MLP in parallel;
- MPT (eager only): ALiBi added to the scores before the masked_fill of the padding mask;
- GPT-Neo (eager only): unscaled scores, a masked_fill by the causal buffer plus an additive
  padding mask, global and local (window) layers;
- BLOOM (eager only): heads merged into the batch around 3-D bmm's, ALiBi added to the 3-D
  scores, and (TorchScript) the merged output's batch and sequence read from its shape;
- Nemotron: half-rotary heads, LayerNorm1P (weight + 1), and a squared-ReLU MLP without bias
  (``relu(x) ** 2``: TorchScript writes ``Mul(r, r)``, dynamo ``Pow(r, 2)``), which fuses into
  GemmEpilogue's ``relu2``;
- Persimmon: one fused QKV projection split per head, half-rotary heads, and the squared-ReLU MLP
  with bias (``relu2`` as well).

Each is exported with both torch exporters and both attention implementations (SDPA, eager; MPT,
GPT-Neo and BLOOM have no SDPA attention in transformers), fused, and must have one ``FlashAttention``
node per layer, no Softmax and no unfused norm left, and match the unfused model in onnxruntime
on right-padded masks (max abs error <= 1e-4, FP32). The families
are registered only for this module's tests (a fixture adds and removes them), so nothing else
parametrized over ``FAMILIES`` sees them. An encoder-decoder model (BART, its own export wrapper)
adds cross-attention: every encoder, decoder and cross-attention block must fuse as well.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from conftest import _EXPORT_NEEDS, _missing
from optfuse.fusions import fuse_model

_TEXT = dict(vocab_size=1000, max_position_embeddings=128)
_NO_CACHE = {"use_cache": False}
#: GPT-Neo's window (keys i - w < j <= i): smaller than the test sequences (12, 16)
GPT_NEO_WINDOW = 6


def _families():
    from optfuse.models import Family

    return [
        Family("heldout_qwen2", "Qwen2 decoder (q/k/v bias, GQA, rotary)", "Qwen2Config", "Qwen2Model",
               dict(_TEXT, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=128, use_cache=False),
               ("input_ids", "attention_mask"), "rms_norm", causal=True, position="rotary", call_kwargs=_NO_CACHE),
        Family("heldout_gpt_neox", "GPT-NeoX decoder (fused QKV, partial rotary)", "GPTNeoXConfig", "GPTNeoXModel",
               dict(_TEXT, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                    use_cache=False, rotary_pct=0.25, attention_dropout=0.0, hidden_dropout=0.0),
               ("input_ids", "attention_mask"), "layer_norm", causal=True, position="rotary", call_kwargs=_NO_CACHE),
        Family("heldout_opt", "OPT decoder (q scaled before Q K^T)", "OPTConfig", "OPTModel",
               dict(_TEXT, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, ffn_dim=128,
                    word_embed_proj_dim=64, use_cache=False, dropout=0.0, attention_dropout=0.0),
               ("input_ids", "attention_mask"), "layer_norm", causal=True, call_kwargs=_NO_CACHE),
        Family("heldout_distilbert", "DistilBERT encoder (masked_fill padding mask)", "DistilBertConfig",
               "DistilBertModel",
               dict(_TEXT, dim=64, n_layers=2, n_heads=2, hidden_dim=128, dropout=0.0, attention_dropout=0.0),
               ("input_ids", "attention_mask"), "layer_norm", causal=False),
        Family("heldout_clip_text", "CLIP text encoder (causal + padding, quick-GELU)", "CLIPTextConfig",
               "CLIPTextModel",
               dict(vocab_size=1000, max_position_embeddings=64, hidden_size=64, num_hidden_layers=2,
                    num_attention_heads=2, intermediate_size=128, attention_dropout=0.0),
               ("input_ids", "attention_mask"), "layer_norm", causal=True),
        Family("heldout_falcon", "Falcon decoder (new decoder architecture: QKV view sliced into q, k, v)",
               "FalconConfig", "FalconModel",
               dict(_TEXT, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
                    ffn_hidden_size=128, new_decoder_architecture=True, alibi=False, parallel_attn=True,
                    bias=False, use_cache=False, attention_dropout=0.0, hidden_dropout=0.0),
               ("input_ids", "attention_mask"), "layer_norm", causal=True, position="rotary", call_kwargs=_NO_CACHE),
        Family("heldout_mpt", "MPT decoder (ALiBi added before the padding masked_fill)", "MptConfig", "MptModel",
               dict(vocab_size=1000, d_model=64, n_layers=2, n_heads=2, expansion_ratio=2, max_seq_len=128,
                    use_cache=False),
               ("input_ids", "attention_mask"), "layer_norm", causal=True, call_kwargs=_NO_CACHE),
        Family("heldout_gpt_neo", "GPT-Neo decoder (unscaled, causal masked_fill + padding, local layers)",
               "GPTNeoConfig", "GPTNeoModel",
               dict(_TEXT, hidden_size=64, num_layers=2, num_heads=2, attention_types=[[["global", "local"], 1]],
                    window_size=GPT_NEO_WINDOW, intermediate_size=128, use_cache=False, resid_dropout=0.0, embed_dropout=0.0,
                    attention_dropout=0.0),
               ("input_ids", "attention_mask"), "layer_norm", causal=True, scaled=False, call_kwargs=_NO_CACHE),
        Family("heldout_bloom", "BLOOM decoder (3-D batched heads, ALiBi, merged heads read from the output shape)",
               "BloomConfig", "BloomModel",
               dict(vocab_size=1000, hidden_size=64, n_layer=2, n_head=2, use_cache=False, hidden_dropout=0.0,
                    attention_dropout=0.0),
               ("input_ids", "attention_mask"), "layer_norm", causal=True, position="relative_bias",
               call_kwargs=_NO_CACHE),
        Family("heldout_nemotron", "Nemotron decoder (squared-ReLU MLP, LayerNorm1P, partial rotary)",
               "NemotronConfig", "NemotronModel",
               dict(_TEXT, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                    head_dim=32, intermediate_size=128, use_cache=False, attention_dropout=0.0),
               ("input_ids", "attention_mask"), "layer_norm", causal=True, position="rotary", call_kwargs=_NO_CACHE),
        Family("heldout_persimmon", "Persimmon decoder (squared-ReLU MLP with bias, fused QKV, partial rotary)",
               "PersimmonConfig", "PersimmonModel",
               dict(_TEXT, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                    use_cache=False, attention_dropout=0.0, hidden_dropout=0.0),
               ("input_ids", "attention_mask"), "layer_norm", causal=True, position="rotary", call_kwargs=_NO_CACHE),
    ]


NAMES = ["heldout_qwen2", "heldout_gpt_neox", "heldout_opt", "heldout_distilbert", "heldout_clip_text",
         "heldout_falcon", "heldout_mpt", "heldout_gpt_neo", "heldout_bloom", "heldout_nemotron", "heldout_persimmon"]
#: families whose transformers model has no SDPA attention
EAGER_ONLY = {"heldout_mpt", "heldout_gpt_neo", "heldout_bloom"}
#: families with sliding-window layers
WINDOWED = {"heldout_gpt_neo"}
CASES = [(f, e, a) for f in NAMES for e in ("torchscript", "dynamo") for a in ("sdpa", "eager")
         if not (f in EAGER_ONLY and a == "sdpa")]
#: ops of a norm that did not fuse
UNFUSED_NORM = {"ReduceMean", "LayerNormalization", "RMSNormalization"}
LAYERS = 2


@pytest.fixture(scope="module")
def heldout_export(model_cache_dir):
    """Factory over the held-out families, registered in ``FAMILIES`` for this module only."""
    models = pytest.importorskip("optfuse.models")
    added = {f.name: f for f in _families()}
    assert not set(added) & set(models.FAMILIES)
    models.FAMILIES.update(added)
    memo = {}

    def get(family, exporter, attn):
        missing = _missing(_EXPORT_NEEDS[exporter])
        if missing:
            pytest.skip(f"exporting with {exporter} needs {', '.join(missing)} (not installed)")
        if (family, exporter, attn) not in memo:
            memo[(family, exporter, attn)] = models.cached_export(family, exporter, attn, cache_dir=model_cache_dir)
        return memo[(family, exporter, attn)]

    try:
        yield get
    finally:
        for name in added:
            models.FAMILIES.pop(name, None)


def _run(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in feeds.items() if k in names})


@pytest.mark.slow
@pytest.mark.parametrize("family,exporter,attn", CASES)
def test_heldout_family_attention_fused(heldout_export, family, exporter, attn):
    from optfuse.models import make_inputs

    em = heldout_export(family, exporter, attn)
    model = onnx.load(str(em.path))
    fused, res = fuse_model(model, dims={"batch": 2, "sequence": 16})
    ops = [n.op_type for n in fused.graph.node]
    why = [str(r) for r in res.rejected if r.op == "FlashAttention"]
    assert ops.count("FlashAttention") == LAYERS, why
    assert "Softmax" not in ops
    assert not UNFUSED_NORM & set(ops), [str(r) for r in res.rejected if r.op in ("LayerNorm", "RMSNorm")]
    assert {"LayerNorm", "RMSNorm", "SkipLayerNorm", "SkipRMSNorm"} & set(ops)
    for seed in range(2):  # make_inputs right-pads rows 1.. of the attention mask
        feeds = make_inputs(em.inputs, {"batch": 3, "sequence": 12}, seed=seed)
        _assert_equal(family, feeds, _run(model, feeds), _run(fused, feeds))


def _assert_equal(family, feeds, want, got):
    """Every output equal (max abs error <= 1e-4); with a window, on the real tokens: a right-padded
    query more than w - 1 positions past the last real key sees no real key (README, "Masks")."""
    real = feeds["attention_mask"].astype(bool) if family in WINDOWED else None
    for w, g in zip(want, got):
        err = np.abs(w.astype(np.float64) - g)
        assert float(np.max(err if real is None else err[real])) <= 1e-4


# ------------------------------------------------------------------------------------------------
# Cross-attention: an encoder-decoder model (BART), exported through its own small wrapper
# (optfuse.models has no decoder inputs). Per layer pair: encoder self-attention (padding mask),
# decoder causal self-attention, decoder cross-attention (Sq = target length != Sk = source length,
# the encoder's padding mask).
# ------------------------------------------------------------------------------------------------
def _export_bart(path, exporter, attn):
    """BART through optfuse.models' own wrapper and exporters (only the inputs are new: the
    decoder's tokens have a sequence length of their own). Returns the export's feeds."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    missing = _missing(_EXPORT_NEEDS[exporter])
    if missing:
        pytest.skip(f"exporting with {exporter} needs {', '.join(missing)} (not installed)")
    from optfuse import models

    cfg = transformers.BartConfig(vocab_size=1000, max_position_embeddings=64, d_model=64, encoder_layers=2,
                                  decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
                                  encoder_ffn_dim=128, decoder_ffn_dim=128, dropout=0.0, attention_dropout=0.0,
                                  use_cache=False)
    torch.manual_seed(0)
    bart = transformers.BartModel._from_config(cfg, attn_implementation=attn).eval()
    inputs = [models.InputInfo("input_ids", "int64", ["batch", "src"], 3, 1000, "tokens"),
              models.InputInfo("attention_mask", "int64", ["batch", "src"], 0, 2, "mask"),
              models.InputInfo("decoder_input_ids", "int64", ["batch", "tgt"], 3, 1000, "tokens")]
    outputs = [models.OutputInfo("last_hidden_state", "float32", ["batch", "tgt", 64])]
    feeds = models.make_inputs(inputs, {"batch": 2, "src": 12, "tgt": 7})
    model = models._wrapper_class()(bart, [i.name for i in inputs], {"use_cache": False})
    args = tuple(torch.from_numpy(feeds[i.name]) for i in inputs)
    with models._quiet(), torch.no_grad():
        if exporter == "torchscript":
            models._export_torchscript(model, args, path, inputs, outputs, models.DEFAULT_TORCHSCRIPT_OPSET)
        else:
            models._export_dynamo(model, args, path, inputs, outputs, None, True, {"src": 60, "tgt": 60})
    return feeds


@pytest.mark.slow
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_encoder_decoder_cross_attention_fused(tmp_path, exporter, attn):
    path = tmp_path / f"bart_{exporter}_{attn}.onnx"
    feeds = _export_bart(path, exporter, attn)
    model = onnx.load(str(path))
    fused, res = fuse_model(model, dims={"batch": 2, "src": 12, "tgt": 7})
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("FlashAttention") == 3 * LAYERS, [str(r) for r in res.rejected if r.op == "FlashAttention"]
    assert "Softmax" not in ops
    cross = [a for a in res.accepted if a.op == "FlashAttention" and a.rewrite.attrs["causal"] == 0]
    assert len(cross) == 2 * LAYERS  # encoder self + decoder cross (the decoder self-attention is causal)
    for want, got in zip(_run(model, feeds), _run(fused, feeds)):
        assert float(np.max(np.abs(want.astype(np.float64) - got))) <= 1e-4


#: The FFN of each held-out family: the rule that fuses it and its activation.
HELDOUT_FFN = {"heldout_qwen2": ("gemm.gated", "silu"), "heldout_gpt_neox": ("gemm.act", "gelu_erf"),
               "heldout_opt": ("gemm.act", "relu"), "heldout_distilbert": ("gemm.act", "gelu_erf"),
               "heldout_clip_text": ("gemm.act", "quick_gelu"), "heldout_falcon": ("gemm.act", "gelu_erf"),
               "heldout_mpt": ("gemm.act", "gelu_erf"), "heldout_gpt_neo": ("gemm.act", "gelu_tanh"),
               "heldout_bloom": ("gemm.act", "gelu_tanh"), "heldout_nemotron": ("gemm.act", "relu2"),
               "heldout_persimmon": ("gemm.act", "relu2")}


@pytest.mark.slow
@pytest.mark.parametrize("family,exporter,attn", CASES)
def test_heldout_family_gemms_fused(heldout_export, family, exporter, attn):
    """Every GEMM of the held-out families fuses (none left as MatMul / Gemm), each FFN with the
    family's activation, and the fused model equals the original."""
    from collections import Counter

    from optfuse.models import make_inputs

    em = heldout_export(family, exporter, attn)
    model = onnx.load(str(em.path))
    fused, res = fuse_model(model, dims={"batch": 2, "sequence": 16})
    ops = Counter(n.op_type for n in fused.graph.node)
    why = [r.reason for r in res.rejected if r.op in ("GemmEpilogue", "GatedGemm")]
    assert not ops["MatMul"] and not ops["Gemm"], why
    assert not {"Erf", "Tanh", "Sigmoid", "Relu", "Gelu"} & set(ops), ops
    rule, act = HELDOUT_FFN[family]
    ffn = [a for a in res.accepted if a.rule == rule]
    assert len(ffn) == LAYERS and all(a.rewrite.attrs["activation"] == act for a in ffn)
    if act == "relu2":  # each Relu's square (Pow, or Mul(r, r)) went into the GEMM with it
        relu_out = {n.output[0] for n in model.graph.node if n.op_type == "Relu"}
        squares = {n.name for n in model.graph.node if set(n.input) & relu_out}
        assert len(squares) == LAYERS and not squares & {n.name for n in fused.graph.node}, squares
    feeds = make_inputs(em.inputs, {"batch": 3, "sequence": 12}, seed=0)
    _assert_equal(family, feeds, _run(model, feeds), _run(fused, feeds))


# ------------------------------------------------------------------------------------------------
# GPT-Neo's local layers: a masked_fill by a constant [1, 1, n, n] window buffer sliced to the
# sequence (keys i - w < j <= i: w keys, the query's own included), plus HF's causal + padding mask
# ------------------------------------------------------------------------------------------------
def _padded_rows(S):
    """Right- and left-padded batches (one full row, two padded), every row with a real token."""
    return {"right": np.array([[1] * S, [1] * 7 + [0] * (S - 7), [1] * (S - 3) + [0] * 3], np.int64),
            "left": np.array([[1] * S, [0] * (S - 7) + [1] * 7, [0] * 3 + [1] * (S - 3)], np.int64)}


def _real_token_error(model, fused, em, mask):
    from optfuse.models import make_inputs

    feeds = make_inputs(em.inputs, {"batch": mask.shape[0], "sequence": mask.shape[1]}, seed=0)
    feeds["attention_mask"] = mask
    ref, got = _run(model, feeds)[0], _run(fused, feeds)[0]
    return float(np.abs(ref.astype(np.float64) - got)[mask.astype(bool)].max())


def _bias_shapes(fused):
    """The [.., Sq, Sk] dims of each FlashAttention node's bias input, from onnx shape inference."""
    inferred = onnx.shape_inference.infer_shapes(fused)
    shapes = {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim]
              for v in list(inferred.graph.value_info) + list(inferred.graph.input)}
    shapes.update({t.name: list(t.dims) for t in fused.graph.initializer})
    return [shapes.get(n.input[3]) for n in fused.graph.node if n.op_type == "FlashAttention"]


@pytest.mark.slow
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_gpt_neo_local_layers_fuse_with_their_window(heldout_export, exporter):
    """The global layer fuses causal + key padding, the local one causal with window_left = w - 1
    plus key padding; neither takes a dense [Sq, Sk] bias, and both are exact on every real token
    of left- and right-padded batches longer than the window."""
    em = heldout_export("heldout_gpt_neo", exporter, "eager")
    model = onnx.load(str(em.path))
    fused, res = fuse_model(model, dims={"batch": 2, "sequence": 16})
    acc = [a for a in res.accepted if a.op == "FlashAttention"]
    got = sorted((a.rewrite.info["mask_class"], a.rewrite.info.get("window"), a.rewrite.attrs["causal"],
                  a.rewrite.attrs.get("window_left", -1)) for a in acc)
    assert got == [("causal+padding", None, 1, -1),
                   ("sliding_window+padding", GPT_NEO_WINDOW, 1, GPT_NEO_WINDOW - 1)], got
    for shape in _bias_shapes(fused):  # a key-padding row [B, 1, 1, Sk], not the whole mask
        assert shape is not None and len(shape) == 4 and shape[-2] == 1, shape
    for name, mask in _padded_rows(16).items():
        assert _real_token_error(model, fused, em, mask) <= 1e-4, name


@pytest.mark.slow
def test_gpt_neo_window_must_hold_for_every_length_of_its_buffer(heldout_export):
    """A window buffer that holds the window at the probe lengths but not at one longer length
    (one key past the window allowed in row 40 of the 128-row buffer) gets no window: the mask
    is passed whole, and the fused model stays exact."""
    import onnx_graphsurgeon as gs

    em = heldout_export("heldout_gpt_neo", "torchscript", "eager")
    g = gs.import_onnx(onnx.load(str(em.path)))
    buffers = [n.attrs["value"] for n in g.nodes if n.op == "Constant" and isinstance(n.attrs.get("value"), gs.Constant)
               and n.attrs["value"].values.dtype == bool and n.attrs["value"].values.ndim == 4]
    buffers += [t for t in g.tensors().values() if isinstance(t, gs.Constant) and t.values.dtype == bool
                and t.values.ndim == 4]
    local = [b for b in buffers if not b.values[0, 0, -1, 0]]  # the local layer's: row n - 1 misses key 0
    assert local, "no window buffer in the export"
    for b in local:
        v = b.values.copy()
        assert not v[0, 0, 40, 40 - GPT_NEO_WINDOW]
        v[0, 0, 40, 40 - GPT_NEO_WINDOW] = True
        b.values = v
    model = gs.export_onnx(g)
    fused, res = fuse_model(model, dims={"batch": 2, "sequence": 16})
    acc = [a for a in res.accepted if a.op == "FlashAttention"]
    assert sorted(a.rewrite.info["mask_class"] for a in acc) == ["block", "causal+padding"]
    tampered = next(a for a in acc if a.rewrite.info["mask_class"] == "block")
    assert "window_left" not in tampered.rewrite.attrs and tampered.rewrite.attrs["causal"] == 0
    assert "Sq = 41" in tampered.rewrite.info["mask_detail"]["buffer"]
    for name, mask in _padded_rows(16).items():
        assert _real_token_error(model, fused, em, mask) <= 1e-4, name
