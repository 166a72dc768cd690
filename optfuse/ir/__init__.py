"""Graph I/O and sanitization (stages `load` and `sanitize`)."""

from .load import load_model, save_model
from .sanitize import sanitize

__all__ = ["load_model", "save_model", "sanitize"]
