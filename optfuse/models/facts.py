"""Facts derived from a family's config: symbolic dim ranges, expected fusion counts, model meta.

These are what a test or recipe checks a fused model against: :func:`dim_ranges` (a recipe's
``dims``), :func:`expected_counts` (how many of each fusable structure the model holds, keys
:data:`COUNT_KEYS`) and :func:`model_meta` (heads, KV heads, head dim, causal, activation, norm
eps). ``config`` is a transformers config or its ``to_dict()`` (a sidecar's ``config``).
"""

from __future__ import annotations

from typing import Any

from .families import config_value, get_family, has_field
from .inputs import DEFAULT_DIMS

#: Max batch declared in :attr:`ExportedModel.dims` (the graph itself has no limit).
MAX_BATCH = 8
#: Max sequence declared for models without a position table (T5: relative position buckets).
DEFAULT_MAX_SEQ = 128

#: Counts every family reports (keys of :attr:`ExportedModel.counts`).
COUNT_KEYS = ("layers", "attention", "mlp", "layer_norm", "skip_layer_norm", "embed_layer_norm",
              "rms_norm", "skip_rms_norm")


def dim_ranges(family: str, config: Any) -> dict[str, dict[str, int]]:
    """Recipe ``dims``: min/opt/max of each symbolic dim (opt = the example inputs' value)."""
    fam = get_family(family)
    dims = {"batch": {"min": 1, "opt": DEFAULT_DIMS["batch"], "max": MAX_BATCH}}
    if "input_ids" in fam.inputs:
        # The position table's size; relative-position models (T5) have none: declare DEFAULT_MAX_SEQ.
        max_seq = next((int(config_value(config, k)) for k in ("max_position_embeddings", "n_positions") if has_field(config, k)),
                       DEFAULT_MAX_SEQ)
        dims["sequence"] = {"min": 1, "opt": DEFAULT_DIMS["sequence"], "max": max_seq}
    return dims


def expected_counts(family: str, config: Any) -> dict[str, int]:
    """How many of each fusable structure the model holds, from its config (L = num_hidden_layers).

    - ``attention``: self-attention blocks, one per layer (L); the exported graph has one Softmax each.
    - ``mlp``: feed-forward blocks (L).
    - ``layer_norm``: every ``nn.LayerNorm`` (one LayerNormalization node each at opset >= 17):
      BERT 2L + 1 (two per layer, post-LN, plus the embedding LayerNorm), GPT-2 and ViT 2L + 1
      (two per layer, pre-LN, plus the final ln_f / layernorm).
    - ``skip_layer_norm``: the LayerNorms whose input is a residual add ``x + sublayer(x)`` of two
      full ``[batch, seq, hidden]`` tensors: 2L in all three (BERT: both per layer; GPT-2/ViT: the
      second of layer 0, both of later layers and the final one).
    - ``embed_layer_norm``: the one LayerNorm fed by the embedding sum instead (BERT: word + position
      + token type; GPT-2: wte + wpe; ViT: patches + position), where the added position table is
      broadcast over the batch. ``skip_layer_norm + embed_layer_norm == layer_norm``.
    - ``rms_norm`` / ``skip_rms_norm``: the same for RMS norms (LLaMA ``LlamaRMSNorm``, T5
      ``T5LayerNorm``; decomposed into Pow/ReduceMean/Add/Sqrt/.../Mul, one ReduceMean each): 2L + 1,
      of which 2L follow a residual add; the first norm of layer 0 reads the embedding Gather directly.
      Gemma 2 has 4 per layer (``norms_per_layer``: also after attention and after the MLP, on the
      sublayer's output), so 4L + 1, still 2L after a residual add (the pre-MLP one, the next
      layer's input norm, the final norm).
    """
    fam = get_family(family)
    n = int(config_value(config, "num_hidden_layers"))
    counts = dict.fromkeys(COUNT_KEYS, 0)
    counts.update(layers=n, attention=n, mlp=n)
    if fam.norm == "layer_norm":
        counts.update(layer_norm=2 * n + 1, skip_layer_norm=2 * n, embed_layer_norm=1)
    else:
        counts.update(rms_norm=fam.norms_per_layer * n + 1, skip_rms_norm=2 * n)
    return counts


def model_meta(family: str, config: Any) -> dict[str, Any]:
    """Facts a fusion test may check: heads, KV heads, head dim, causal, activation, norm eps."""
    fam = get_family(family)
    g = lambda *keys: next((config_value(config, k) for k in keys if has_field(config, k)), None)  # noqa: E731
    hidden = int(g("hidden_size"))
    heads = int(g("num_attention_heads"))
    kv = g("num_key_value_heads")
    head_dim = g("head_dim", "d_kv") or hidden // heads
    return {
        "hidden_size": hidden,
        "num_heads": heads,
        "num_kv_heads": int(kv) if kv is not None else heads,
        "head_dim": int(head_dim),
        "causal": fam.causal,
        "position": fam.position,
        "attention_scale": (1.0 / float(head_dim) ** 0.5) if fam.scaled else 1.0,
        "attention_mask": "attention_mask" in fam.inputs,
        "norm": fam.norm,
        # None where the config has no such field (OPT, DistilBERT: eps fixed in the modeling code)
        "norm_eps": _float_or_none(g("layer_norm_eps", "layer_norm_epsilon", "rms_norm_eps")),
        "activation": str(g("hidden_act", "activation_function", "feed_forward_proj", "activation")),
        # None where the config names no FFN width (MPT: expansion_ratio * d_model)
        "intermediate_size": _int_or_none(g("intermediate_size", "n_inner", "d_ff", "ffn_dim", "hidden_dim",
                                            "ffn_hidden_size")),
        "description": fam.description,
        "notes": fam.notes,
    }


def _float_or_none(v: Any) -> float | None:
    return None if v is None else float(v)


def _int_or_none(v: Any) -> int | None:
    return None if v is None else int(v)
