"""Declarative patterns and fusion rules over onnx-graphsurgeon graphs."""

from .core import AnyOf, Capture, Const, Match, OpPattern, Pattern, Var, const_value, match, maybe_cast, node_attr, op
from .rule import After, Context, FusedOutput, FusionOptions, FusionRule, NewTensor, Rewrite

__all__ = [
    "After", "AnyOf", "Capture", "Const", "Context", "FusedOutput", "FusionOptions", "FusionRule", "Match", "NewTensor", "OpPattern", "Pattern", "Rewrite",
    "Var", "const_value", "match", "maybe_cast", "node_attr", "op",
]
