"""The graph layer: I/O (`load`), sanitization (`sanitize`), read-only queries (`query`), shape
inference (`shapes`) and static evaluation of values and dims (`static`). Nothing here imports the
stages above it (pattern, rewrite, fusions)."""

from .load import load_model, save_model
from .sanitize import sanitize

__all__ = ["load_model", "save_model", "sanitize"]
