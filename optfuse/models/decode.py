"""Decode graphs: a decoder family's model run one step over a KV cache (``past_key_values``).

``export_model(family, ..., past=True)`` exports the families in :data:`DECODE_FAMILIES` this way
(both exporters). The graph takes

- ``input_ids`` [batch, sequence]: the new tokens (Sq = sequence; 1 for decode, more for chunked prefill);
- ``attention_mask`` [batch, total_sequence]: 1 = attend, 0 = padding, over the cached and the new
  tokens (total_sequence = past_sequence + sequence; left padding is what batched generation makes);
- ``past_key_values.<layer>.key`` / ``.value`` [batch, kv_heads, past_sequence, head_dim]: the cache;

and returns ``last_hidden_state`` [batch, sequence, hidden] and ``present.<layer>.key`` / ``.value``
[batch, kv_heads, total_sequence, head_dim] (the cache concatenation is in the graph). The cache
reaches the model as transformers' ``DynamicCache`` (through forward()'s ``cache`` argument, or
``past_key_values`` in transformers versions before that name). Positions are the model's default for a cache
(past_sequence + i); no ``position_ids`` input. The three sequence dims must be fed consistently:
:func:`decode_dims` gives them.

torch and transformers are imported inside the functions only.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..model_families import DECODE_FAMILIES as _SCHEMA_DECODE_FAMILIES
from .facts import MAX_BATCH, dim_ranges, model_meta
from .families import ATTNS, check_choice, config_value, get_family
from .inputs import InputInfo, OutputInfo, input_infos

#: The families with a decode export (causal decoders whose model takes ``past_key_values``).
DECODE_FAMILIES: tuple[str, ...] = ("gpt2", "llama")
if DECODE_FAMILIES != _SCHEMA_DECODE_FAMILIES:  # the recipe schema validates model.export.past against that list
    raise RuntimeError(f"optfuse.models.decode defines {DECODE_FAMILIES} but optfuse.model_families lists "
                       f"{_SCHEMA_DECODE_FAMILIES}: keep the two in step")
#: The example inputs' sizes: two sequences, three new tokens over a past of five.
SAMPLE_SEQUENCE, SAMPLE_PAST = 3, 5


def check_decode_family(family: str) -> None:
    """ValueError unless ``family`` has a decode export."""
    get_family(family)
    if family not in DECODE_FAMILIES:
        raise ValueError(f"family {family!r} has no decode (past_key_values) export; "
                         f"decode families: {', '.join(DECODE_FAMILIES)}")


def decode_dims(sequence: int, past: int, batch: int = 2) -> dict[str, int]:
    """The symbolic dims of a decode graph for ``sequence`` new tokens over ``past`` cached ones."""
    return {"batch": batch, "sequence": sequence, "past_sequence": past, "total_sequence": past + sequence}


def decode_dim_ranges(family: str, config: Any) -> dict[str, dict[str, int]]:
    """Recipe ``dims`` of the decode graph: the position table split between past and new tokens."""
    max_seq = dim_ranges(family, config)["sequence"]["max"]
    half = max_seq // 2
    return {"batch": {"min": 1, "opt": 2, "max": MAX_BATCH},
            "sequence": {"min": 1, "opt": SAMPLE_SEQUENCE, "max": half},
            "past_sequence": {"min": 1, "opt": SAMPLE_PAST, "max": half},
            "total_sequence": {"min": 2, "opt": SAMPLE_SEQUENCE + SAMPLE_PAST, "max": max_seq}}


def cache_names(config: Any) -> list[tuple[str, str]]:
    """(past input, present output) names, layer by layer, key before value."""
    n = int(config_value(config, "num_hidden_layers"))
    return [(f"past_key_values.{i}.{kv}", f"present.{i}.{kv}") for i in range(n) for kv in ("key", "value")]


def decode_input_infos(family: str, config: Any) -> list[InputInfo]:
    """input_ids, attention_mask over past + new tokens, then the cache tensors."""
    check_decode_family(family)
    ids = next(i for i in input_infos(family, config) if i.name == "input_ids")
    meta = model_meta(family, config)
    cache = ["batch", meta["num_kv_heads"], "past_sequence", meta["head_dim"]]
    return [ids,
            InputInfo("attention_mask", "int64", ["batch", "total_sequence"], 0, 2, "mask",
                      "1 = attend, 0 = padding, over the past and the new tokens"),
            *(InputInfo(past, "float32", list(cache), -1.0, 1.0, "float", "cached keys/values")
              for past, _ in cache_names(config))]


def decode_output_infos(family: str, config: Any) -> list[OutputInfo]:
    """last_hidden_state, then the updated cache (past + new tokens)."""
    meta = model_meta(family, config)
    present = ["batch", meta["num_kv_heads"], "total_sequence", meta["head_dim"]]
    return [OutputInfo("last_hidden_state", "float32", ["batch", "sequence", meta["hidden_size"]]),
            *(OutputInfo(name, "float32", list(present)) for _, name in cache_names(config))]


def decode_wrapper_class():
    """The decode wrapper module class: positional (input_ids, attention_mask, *cache) in,
    (last_hidden_state, *present cache) out."""
    import torch

    class DecodeWrapped(torch.nn.Module):
        def __init__(self, model, num_layers: int):
            super().__init__()
            self.model = model
            self.num_layers = num_layers

        def forward(self, *args):
            input_ids, attention_mask, flat = args[0], args[1], args[2:]
            cache = make_cache([(flat[2 * i], flat[2 * i + 1]) for i in range(self.num_layers)])
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True,
                             **{self.cache_arg: cache})
            return (out.last_hidden_state, *cache_tensors(getattr(out, self.cache_arg)))

        @property
        def cache_arg(self) -> str:
            return cache_argument(self.model)

    return DecodeWrapped


def cache_argument(model) -> str:
    """The forward() argument (and output field) that carries the cache: ``cache`` in the
    transformers versions that renamed it, ``past_key_values`` before."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def make_cache(pairs: list[tuple[Any, Any]]):
    """A ``DynamicCache`` holding (key, value) per layer, the way the installed transformers builds one."""
    from transformers import DynamicCache

    if hasattr(DynamicCache, "from_legacy_cache"):  # transformers 4.x
        return DynamicCache.from_legacy_cache(tuple(pairs))
    return DynamicCache(pairs)


def cache_tensors(cache) -> list[Any]:
    """The cache's tensors, layer by layer, key before value."""
    if hasattr(cache, "layers"):
        return [t for layer in cache.layers for t in (layer.keys, layer.values)]
    return [t for k, v in zip(cache.key_cache, cache.value_cache) for t in (k, v)]  # transformers 4.x


def build_decode_model(family: str, attn: str = "sdpa", seed: int = 0, **overrides: Any):
    """The wrapped decode module (eval, float32, weights as :func:`~optfuse.models.build_model`'s)."""
    from .build import build_model

    check_decode_family(family)
    check_choice("attn", attn, ATTNS)
    inner = build_model(family, attn, seed, **{**overrides, "use_cache": True})
    wrapped = decode_wrapper_class()(inner.model, int(config_value(inner.config, "num_hidden_layers"))).eval()
    wrapped.config = inner.config
    return wrapped


def decode_torch_outputs(family: str, attn: str, feeds: Mapping[str, np.ndarray], seed: int = 0,
                         model=None, **overrides: Any) -> dict[str, np.ndarray]:
    """Run the torch decode model (rebuilt unless given) on NumPy feeds: every output by name."""
    import torch

    if model is None:
        model = build_decode_model(family, attn, seed, **overrides)
    names = [i.name for i in decode_input_infos(family, model.config)]
    args = tuple(torch.from_numpy(np.ascontiguousarray(feeds[n])) for n in names)
    with torch.no_grad():
        outs = model(*args)
    infos = decode_output_infos(family, model.config)
    return {o.name: t.detach().cpu().numpy() for o, t in zip(infos, outs)}


def left_padded_mask(lengths: list[int], total: int) -> np.ndarray:
    """[len(lengths), total] int64: row b attends to its last ``lengths[b]`` positions (left padding)."""
    j = np.arange(total)[None, :]
    return (j >= total - np.asarray(lengths)[:, None]).astype(np.int64)
