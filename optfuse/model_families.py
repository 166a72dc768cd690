"""Names of the model families :mod:`optfuse.models` exports (``bert``, ``gpt2``, ...).

Plain data at the bottom layer: the recipe schema checks ``model.export.family`` against it
without importing the exporter, and :mod:`optfuse.models` defines exactly these families and
decode families (it checks that at import).
"""

EXPORT_FAMILIES: tuple[str, ...] = ("bert", "gpt2", "vit", "llama", "t5", "mistral", "qwen2", "gemma2")
#: The families :mod:`optfuse.models` also exports as a decode step over a KV cache (``past``).
DECODE_FAMILIES: tuple[str, ...] = ("gpt2", "llama")
