"""The model families: which transformers classes, the tiny config of each, and how to read a config.

A :class:`Family` names a transformers config class and model class, the config kwargs of its tiny
test model, its forward() inputs in graph-input order and the facts a fusion test checks (norm
kind, causal, position encoding, scaled attention). :data:`FAMILIES` must list exactly the names
in :data:`optfuse.model_families.EXPORT_FAMILIES` (the recipe schema validates against that list
without importing this package); importing this module fails otherwise.

transformers is imported only when a config is built (:meth:`Family.config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

from ..model_families import EXPORT_FAMILIES

Exporter = Literal["torchscript", "dynamo"]
Attn = Literal["sdpa", "eager"]
EXPORTERS: tuple[str, ...] = ("torchscript", "dynamo")
ATTNS: tuple[str, ...] = ("sdpa", "eager")
DEFAULT_TORCHSCRIPT_OPSET = 17


@dataclass(frozen=True)
class Family:
    """One model family: its transformers classes, the tiny config, and the facts a fusion test checks."""

    name: str
    description: str
    config_class: str  # in transformers
    model_class: str  # in transformers; built with ``_from_config(config, attn_implementation=...)``
    defaults: dict[str, Any]  # config kwargs for the tiny model
    inputs: tuple[str, ...]  # forward() argument names, in graph-input order
    norm: Literal["layer_norm", "rms_norm"]
    causal: bool
    position: Literal["absolute", "rotary", "relative_bias"] = "absolute"
    scaled: bool = True  # attention scores scaled by 1/sqrt(head_dim) (T5: no)
    call_kwargs: dict[str, Any] = field(default_factory=dict)  # extra forward() kwargs
    norms_per_layer: int = 2  # norm modules per layer (Gemma 2: also after attention and the MLP)
    notes: str = ""

    def config(self, **overrides: Any):
        """The transformers config (defaults + overrides); unknown keys are an error."""
        import transformers

        cls = getattr(transformers, self.config_class)
        base = cls()
        known = set(base.to_dict()) | set(getattr(cls, "attribute_map", {}) or {})
        unknown = sorted(k for k in overrides if k not in known and not hasattr(base, k))
        if unknown:
            raise ValueError(f"unknown {self.config_class} field(s) for family {self.name!r}: {', '.join(unknown)}")
        return cls(**{**self.defaults, **overrides})


_TEXT = dict(vocab_size=1000, max_position_embeddings=128)

# Every family's head dim is 32: the smallest FlashAttention supports (spec limits.head_dims), so
# attention fuses on the default models.

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "bert", "BERT encoder (post-LN, GELU-erf MLP, padding mask, token types)",
            "BertConfig", "BertModel",
            dict(_TEXT, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                 type_vocab_size=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
            ("input_ids", "attention_mask", "token_type_ids"), "layer_norm", causal=False,
        ),
        Family(
            "gpt2", "GPT-2 decoder without KV cache (pre-LN, Conv1D/Gemm projections, GELU-tanh MLP, causal + padding mask)",
            "GPT2Config", "GPT2Model",
            dict(vocab_size=1000, n_positions=128, n_embd=64, n_layer=2, n_head=2, n_inner=128, use_cache=False,
                 bos_token_id=0, eos_token_id=0,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
            ("input_ids", "attention_mask"), "layer_norm", causal=True, call_kwargs={"use_cache": False},
        ),
        Family(
            "vit", "ViT image encoder (patch Conv, CLS token, pre-LN, GELU-erf MLP, no mask)",
            "ViTConfig", "ViTModel",
            dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                 image_size=32, patch_size=8, num_channels=3, hidden_dropout_prob=0.0,
                 attention_probs_dropout_prob=0.0),
            ("pixel_values",), "layer_norm", causal=False,
        ),
        Family(
            "llama", "LLaMA decoder without KV cache (RMSNorm, RoPE, GQA: 4 query / 2 KV heads, SwiGLU MLP, causal + padding mask)",
            "LlamaConfig", "LlamaModel",
            dict(_TEXT, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, use_cache=False),
            ("input_ids", "attention_mask"), "rms_norm", causal=True, position="rotary",
            call_kwargs={"use_cache": False},
        ),
        Family(
            "t5", "T5 encoder (T5EncoderModel: RMS-style T5LayerNorm, relative position bias, ReLU MLP, padding mask)",
            "T5Config", "T5EncoderModel",
            dict(vocab_size=1000, d_model=64, d_kv=32, d_ff=128, num_layers=2, num_heads=2, use_cache=False,
                 dropout_rate=0.0, relative_attention_num_buckets=32, relative_attention_max_distance=128),
            ("input_ids", "attention_mask"), "rms_norm", causal=False, position="relative_bias", scaled=False,
            notes="attention scores get a float position bias (+ mask) before Softmax and are not scaled by 1/sqrt(d)",
        ),
        Family(
            "mistral", "Mistral decoder without KV cache (LLaMA-like, GQA 4/2, sliding-window causal attention: window 10 < the exported sequence 16)",
            "MistralConfig", "MistralModel",
            dict(_TEXT, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, intermediate_size=128, sliding_window=10, use_cache=False),
            ("input_ids", "attention_mask"), "rms_norm", causal=True, position="rotary",
            call_kwargs={"use_cache": False},
            notes="every layer attends to the last sliding_window keys (i - w < j <= i)",
        ),
        Family(
            "qwen2", "Qwen2 decoder without KV cache (GQA 4/2, q/k/v biases, use_sliding_window with max_window_layers: layers 0-1 full, 2-3 windowed, window 10)",
            "Qwen2Config", "Qwen2Model",
            dict(_TEXT, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, use_sliding_window=True, sliding_window=10, max_window_layers=2,
                 use_cache=False),
            ("input_ids", "attention_mask"), "rms_norm", causal=True, position="rotary",
            call_kwargs={"use_cache": False},
            notes="layers >= max_window_layers use the sliding window, the others full causal attention",
        ),
        Family(
            "gemma2", "Gemma 2 decoder without KV cache (local window-10 layers alternating with global ones, attention-logit soft-capping, 4 RMSNorms per layer, GeGLU MLP)",
            "Gemma2Config", "Gemma2Model",
            dict(_TEXT, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, intermediate_size=128, sliding_window=10, attn_logit_softcapping=50.0,
                 final_logit_softcapping=None, query_pre_attn_scalar=32, use_cache=False),
            ("input_ids", "attention_mask"), "rms_norm", causal=True, position="rotary",
            call_kwargs={"use_cache": False}, norms_per_layer=4,
            notes="scores soft-capped as c * tanh(s / c) before the mask; even layers sliding-window, odd ones global",
        ),
    )
}

if tuple(FAMILIES) != EXPORT_FAMILIES:  # the recipe schema validates family names against that list
    raise ImportError(f"optfuse.models defines the families {tuple(FAMILIES)}, but optfuse.model_families "
                      f"lists {EXPORT_FAMILIES}: keep the two in step")

#: (family, exporter, attn) -> why that export is known to fail with the pinned torch/transformers.
#: Tests and the fixtures skip these with the reason instead of exporting.
KNOWN_FAILURES: dict[tuple[str, str, str], str] = {
    ("gemma2", exporter, "sdpa"): "Gemma2Model has no SDPA attention in transformers (soft-capping needs eager)"
    for exporter in EXPORTERS
}


def get_family(name: str) -> Family:
    """The family called ``name``; ValueError naming the known ones otherwise."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}") from None


def check_choice(what: str, value: str, choices: Sequence[str]) -> None:
    """ValueError unless ``value`` is one of ``choices`` (``what`` names the setting)."""
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}; expected one of: {', '.join(choices)}")


def config_value(config: Any, key: str) -> Any:
    """``config[key]`` for a mapping (a sidecar's config), else the attribute (a transformers config)."""
    return config[key] if isinstance(config, Mapping) else getattr(config, key)


def has_field(config: Any, key: str) -> bool:
    """Whether ``config`` has ``key`` with a value other than None."""
    if isinstance(config, Mapping):
        return config.get(key) is not None
    return getattr(config, key, None) is not None
