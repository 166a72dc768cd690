"""Defaults shared by the recipe schema and the stages (bottom layer: imports only onnx).

- Symbolic dims: a recipe's opt value, else :data:`DEFAULT_BATCH` (2) for a leading or
  batch-named dim and :data:`DEFAULT_DIM` (16) for any other (:func:`concrete_dims`); a dim named
  by an expression over other dims (``past_sequence_length + 1``: :func:`dim_expression`) follows
  them. Verify feeds these shapes, the HBM estimate assumes them and an engine profile without a
  recipe uses them.
- Tolerances per precision mode (:data:`DEFAULT_TOLERANCES`): fp32 agrees to rounding, the half
  types and FP8 to their mantissa; FP8 also by cosine similarity (:data:`DEFAULT_FP8_MIN_COSINE`).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterable, Mapping

import onnx

DEFAULT_BATCH = 2
DEFAULT_DIM = 16

#: (atol, rtol) per precision mode of the candidate.
DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    "fp32": (1e-4, 1e-3),
    "fp16": (1e-2, 1e-2),
    "bf16": (5e-2, 5e-2),
    # E4M3 keeps 3 mantissa bits: each quantized operand is off by up to 2^-4 of itself, and a GEMM
    # output of random-signed terms by ~5% of its RMS (the tiny LLaMA's unit-scale hidden state:
    # mean |diff| 0.047, max 0.30 over 12k elements); 0.5 + 0.25 |ref| is ~8 sigma of that.
    # Elementwise maxima grow with the element count: cosine similarity (verify.fp8) is the main bar.
    "fp8": (5e-1, 2.5e-1),
}
#: FP8 candidates: the least cosine similarity of each output to the original's (~5% relative RMS
#: error gives 0.9987), and the least top-1 agreement of head outputs (None: reported, not required)
DEFAULT_FP8_MIN_COSINE = 0.99
DEFAULT_FP8_MIN_TOP1: float | None = None


def value_shape(vi: onnx.ValueInfoProto) -> list[int | str | None] | None:
    """A value's shape: ints for fixed dims, names for symbolic ones, None for unknown; None without a shape."""
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        return None
    out: list[int | str | None] = []
    for d in t.shape.dim:
        if d.HasField("dim_value"):
            out.append(int(d.dim_value))
        elif d.HasField("dim_param") and d.dim_param:
            out.append(d.dim_param)
        else:
            out.append(None)
    return out


def is_batch_name(name: str) -> bool:
    return bool(re.search(r"batch|^b$|^n$|^bs$", name, re.IGNORECASE))


_DIM_OPS: dict[type, Callable[[int, int], int]] = {
    ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
    ast.FloorDiv: lambda a, b: a // b}


def dim_expression(name: str) -> tuple[Callable[[Mapping[str, int]], int], frozenset[str]] | None:
    """A dim name that is arithmetic over other dim names, as HF optimum and torch.onnx name derived
    dims (``past_sequence_length + 1``, ``past_sequence + sequence``, ``2*s0``: + - * // and integer
    literals): its evaluator over the other dims' values, and the names it reads. None for a plain
    name, or text that is not such an expression."""
    try:
        tree = ast.parse(name.strip(), mode="eval").body
    except SyntaxError:
        return None
    names: set[str] = set()

    def well_formed(node: ast.AST) -> bool:
        if isinstance(node, ast.BinOp) and type(node.op) in _DIM_OPS:
            return well_formed(node.left) and well_formed(node.right)
        if isinstance(node, ast.Name):
            names.add(node.id)
            return True
        return isinstance(node, ast.Constant) and type(node.value) is int

    if isinstance(tree, ast.Name) or not well_formed(tree) or not names:
        return None

    def evaluate(values: Mapping[str, int]) -> int:
        def value(node: ast.AST) -> int:
            if isinstance(node, ast.BinOp):
                return _DIM_OPS[type(node.op)](value(node.left), value(node.right))
            return int(node.value) if isinstance(node, ast.Constant) else int(values[node.id])
        return value(tree)

    return evaluate, frozenset(names)


def dim_value(dim: int | str, values: Mapping[str, int]) -> int:
    """One entry of a shape at these dim values: an int as it is, a named dim's value, or an expression
    over named dims (:func:`dim_expression`) evaluated at theirs (at least 1)."""
    if isinstance(dim, int):
        return dim
    if dim in values:
        return values[dim]
    return max(1, dim_expression(dim)[0](values))


def derived_dims(names: Iterable[str]) -> dict[str, tuple[Callable[[Mapping[str, int]], int], frozenset[str]]]:
    """The names among `names` that are expressions over the others (:func:`dim_expression`), with
    their evaluators: ``past_sequence + sequence`` where ``past_sequence`` and ``sequence`` are among
    them too. A name whose parts are not (a plain ``seq-len``) stays a name."""
    names = set(names)
    out = {}
    for n in names:
        expr = dim_expression(n)
        if expr is not None and expr[1] <= names:
            out[n] = expr
    return out


def input_dim_names(model: onnx.ModelProto) -> list[str]:
    """The symbolic dim names of the graph inputs (initializers left out), in order of first use."""
    init_names = {t.name for t in model.graph.initializer}
    return list(dict.fromkeys(d for inp in model.graph.input if inp.name not in init_names
                              for d in value_shape(inp) or [] if isinstance(d, str)))


def concrete_dims(model: onnx.ModelProto, opt_dims: Mapping[str, int] | None = None) -> dict[str, int]:
    """Symbolic dim name -> value: ``opt_dims`` (a recipe's opt values), else 2 for a leading (batch)
    dim and 16 otherwise, for every symbolic dim of the graph inputs; a dim named by an expression
    over the others (:func:`derived_dims`) gets its value from theirs."""
    dims: dict[str, int] = dict(opt_dims or {})
    derived = derived_dims(input_dim_names(model))
    init_names = {t.name for t in model.graph.initializer}
    for inp in model.graph.input:
        if inp.name in init_names:
            continue
        shape = value_shape(inp) or []
        for axis, d in enumerate(shape):
            if isinstance(d, str) and d not in dims and d not in derived:
                dims[d] = DEFAULT_BATCH if axis == 0 or is_batch_name(d) else DEFAULT_DIM
    for d, (evaluate, _) in derived.items():
        if d not in dims:
            dims[d] = max(1, evaluate(dims))
    return dims
