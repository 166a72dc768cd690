"""Input planning: dtype, concrete shape and value kind of every graph input, and seeded feeds
(the rules are in the package doc)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from ..defaults import DEFAULT_BATCH, DEFAULT_DIM, concrete_dims, value_shape
from ..errors import InputError
from .options import FeedSpec, VerifyOptions

DEFAULT_INT_HIGH = 8  # integer inputs with no known meaning get [0, 8)

# Ops that pass integer values through unchanged on the way to a Gather's indices.
_PASS_THROUGH = {"Cast", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Expand", "Slice",
                 "Transpose", "Concat", "Tile", "View"}

_NP_DTYPES = {
    onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16, onnx.TensorProto.DOUBLE: np.float64,
    onnx.TensorProto.INT64: np.int64, onnx.TensorProto.INT32: np.int32, onnx.TensorProto.INT8: np.int8,
    onnx.TensorProto.UINT8: np.uint8, onnx.TensorProto.BOOL: np.bool_,
}
_NAMED_DTYPES = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "int32": np.int32,
                 "int8": np.int8, "uint8": np.uint8, "bool": np.bool_}


# ------------------------------------------------------------------------------------------------
# Input planning
# ------------------------------------------------------------------------------------------------
@dataclass
class InputPlan:
    """How to make one input: dtype, concrete shape and a generator kind with its parameters."""

    name: str
    dtype: np.dtype
    shape: list[int]
    kind: str  # tokens | mask | float | int | bool | npz
    low: float = 0.0
    high: float = 1.0
    npz: np.ndarray | None = None
    source: str = ""
    uniform: bool = False  # floats: uniform in [low, high) instead of N(0, 1)
    left: bool = False  # masks: padded on the left (left_padded_mask) instead of the right


def gather_table_rows(model: onnx.ModelProto) -> dict[str, int]:
    """Graph inputs used as Gather indices into a constant table -> rows of the smallest such table."""
    graph = model.graph
    consts: dict[str, tuple[int, ...]] = {t.name: tuple(t.dims) for t in graph.initializer}
    for n in graph.node:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value":
                    consts[n.output[0]] = tuple(a.t.dims)
    consumers: dict[str, list[onnx.NodeProto]] = {}
    producer: dict[str, onnx.NodeProto] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
        for o in n.output:
            producer[o] = n

    def table_shape(name: str, depth: int = 0) -> tuple[int, ...] | None:
        if name in consts:
            return consts[name]
        p = producer.get(name)
        if p is not None and depth < 4 and p.op_type in {"Identity", "Cast"} and p.input:
            return table_shape(p.input[0], depth + 1)
        return None

    rows: dict[str, int] = {}
    init_names = set(consts)
    for inp in graph.input:
        if inp.name in init_names:
            continue
        frontier, seen = [inp.name], set()
        while frontier:
            t = frontier.pop()
            if t in seen:
                continue
            seen.add(t)
            for c in consumers.get(t, []):
                if c.op_type == "Gather" and len(c.input) > 1 and c.input[1] == t:
                    shape = table_shape(c.input[0])
                    axis = next((a.i for a in c.attribute if a.name == "axis"), 0)
                    if shape and -len(shape) <= axis < len(shape):
                        r = int(shape[axis])
                        rows[inp.name] = min(rows.get(inp.name, r), r)
                elif c.op_type in _PASS_THROUGH and c.input and c.input[0] == t:
                    frontier.extend(c.output)
    return rows


def plan_inputs(model: onnx.ModelProto, options: VerifyOptions | None = None) -> list[InputPlan]:
    """Decide dtype, shape and value kind of every graph input (see module doc)."""
    options = options or VerifyOptions()
    dims = concrete_dims(model, options.dims)
    rows = gather_table_rows(model)
    init_names = {t.name for t in model.graph.initializer}
    graph_inputs = [i for i in model.graph.input if i.name not in init_names]
    unknown = sorted(set(options.inputs) - {i.name for i in graph_inputs})
    if unknown:
        raise InputError(f"recipe input(s) {', '.join(map(repr, unknown))} are not inputs of the model "
                         f"(its inputs: {', '.join(i.name for i in graph_inputs)})")
    plans = []
    for inp in graph_inputs:
        spec = options.inputs.get(inp.name)
        elem = inp.type.tensor_type.elem_type
        if spec is not None:
            if spec.dtype == "bfloat16":
                raise InputError(f"input {inp.name!r}: bfloat16 inputs cannot be fed to onnxruntime from NumPy")
            dtype = _NAMED_DTYPES[spec.dtype]
            shape = list(spec.shape)
            _check_against_model(inp, np.dtype(dtype), shape, spec.npz is not None)
        else:
            if elem not in _NP_DTYPES:
                raise InputError(f"input {inp.name!r} has an element type ({onnx.TensorProto.DataType.Name(elem)}) "
                                 "verify cannot generate; describe it in a recipe")
            dtype = _NP_DTYPES[elem]
            raw = value_shape(inp)
            if raw is None:
                raise InputError(f"input {inp.name!r} has no shape in the model; give it one in a recipe")
            shape = [d if isinstance(d, int) else dims.get(d, DEFAULT_DIM) if isinstance(d, str)
                     else (DEFAULT_BATCH if i == 0 else DEFAULT_DIM) for i, d in enumerate(raw)]
        plan = _plan_one(inp.name, np.dtype(dtype), shape, spec, rows.get(inp.name))
        if plan.kind == "npz":
            _check_npz_shape(inp, plan.shape, spec.npz_label or str(spec.npz))
        plans.append(plan)
    return plans


def _check_against_model(inp: onnx.ValueInfoProto, dtype: np.dtype, shape: list[int], from_npz: bool) -> None:
    """A recipe input must agree with the graph input it describes (else onnxruntime fails later)."""
    elem = inp.type.tensor_type.elem_type
    if elem in _NP_DTYPES and np.dtype(_NP_DTYPES[elem]) != dtype:
        raise InputError(f"recipe input {inp.name!r} is {dtype.name}, but the model's is "
                         f"{np.dtype(_NP_DTYPES[elem]).name}")
    raw = value_shape(inp)
    if raw is None or from_npz:
        return
    if len(raw) != len(shape):
        raise InputError(f"recipe input {inp.name!r} has rank {len(shape)}, but the model's has rank {len(raw)} ({raw})")
    for axis, (m, r) in enumerate(zip(raw, shape)):
        if isinstance(m, int) and m != r:
            raise InputError(f"recipe input {inp.name!r}: axis {axis} is {r}, but the model fixes it to {m}")


def _check_npz_shape(inp: onnx.ValueInfoProto, shape: list[int], label: str) -> None:
    """An npz array must have the model input's rank and its fixed axes."""
    raw = value_shape(inp)
    if raw is None:
        return
    if len(raw) != len(shape):
        raise InputError(f"input {inp.name!r}: the array in {label} has shape {shape} (rank {len(shape)}), "
                         f"but the model's input has rank {len(raw)} ({raw})")
    for axis, (m, r) in enumerate(zip(raw, shape)):
        if isinstance(m, int) and m != r:
            raise InputError(f"input {inp.name!r}: axis {axis} of the array in {label} is {r}, "
                             f"but the model fixes it to {m}")


def _plan_one(name: str, dtype: np.dtype, shape: list[int], spec: FeedSpec | None, rows: int | None) -> InputPlan:
    p = InputPlan(name, dtype, shape, kind="float")
    lname = name.lower()
    kind = spec.kind if spec is not None else None
    rng = spec.range if spec is not None else None
    if spec is not None and spec.npz is not None:
        p.kind, p.npz = "npz", _load_npz(spec.npz, name, dtype)
        p.shape = list(p.npz.shape)
        p.source = f"npz {spec.npz_label or spec.npz}"
        return p
    if kind is None:
        if "mask" in lname:
            kind = "mask"
        elif dtype.kind in "iu" and (rows is not None or "token" in lname or lname.endswith("ids")):
            kind = "tokens"
        elif dtype.kind == "b":
            kind = "bool"
        elif dtype.kind in "iu":
            kind = "int"
        else:
            kind = "float"
    p.kind = kind
    if kind == "mask":
        p.left = spec is not None and spec.padding == "left"
        p.source = f"{'left' if p.left else 'right'}-padded 0/1 mask"
    elif kind in ("tokens", "int"):
        if rng is not None:
            p.low, p.high = int(np.ceil(rng[0])), int(np.ceil(rng[1]))
            p.source = f"{kind} [{p.low}, {p.high}) (recipe)"
        elif rows is not None:
            p.low, p.high = 0, rows
            p.source = f"{kind} [0, {rows}) (Gather table rows)"
        else:
            p.low, p.high = 0, (2 if "token_type" in lname else DEFAULT_INT_HIGH)
            p.source = f"{kind} [0, {p.high}) (default)"
        if p.high <= p.low:
            raise InputError(f"input {name!r}: empty integer range [{p.low}, {p.high})")
        if dtype.kind == "f":  # tokens declared on a float input: still integers, as floats
            p.source += " as float"
    elif kind == "bool":
        p.source = "random bool"
    else:
        if rng is not None:
            p.low, p.high, p.uniform = float(rng[0]), float(rng[1]), True
            p.source = f"uniform [{p.low:g}, {p.high:g}) (recipe)"
        else:
            p.source = "N(0, 1)"
    return p


def _load_npz(path: Path, name: str, dtype: np.dtype) -> np.ndarray:
    if not path.is_file():
        raise InputError(f"input {name!r}: npz file not found: {path}")
    try:
        with np.load(path, allow_pickle=False) as z:
            keys = list(z.keys())
            if name in keys:
                arr = z[name]
            else:
                raise InputError(f"input {name!r}: {path} holds {keys}, none named {name!r}")
    except InputError:
        raise
    except Exception as exc:
        raise InputError(f"input {name!r}: cannot read npz file {path}: {exc}") from None
    return arr.astype(dtype, copy=False)


def make_feed(plans: Sequence[InputPlan], rng: np.random.Generator) -> dict[str, np.ndarray]:
    feed = {}
    for p in plans:
        if p.kind == "npz":
            feed[p.name] = p.npz
        elif p.kind == "mask":
            feed[p.name] = (left_padded_mask if p.left else right_padded_mask)(p.shape, rng).astype(p.dtype)
        elif p.kind in ("tokens", "int"):
            feed[p.name] = rng.integers(int(p.low), int(p.high), size=p.shape).astype(p.dtype)
        elif p.kind == "bool":
            feed[p.name] = rng.integers(0, 2, size=p.shape).astype(np.bool_)
        elif p.uniform:
            feed[p.name] = rng.uniform(p.low, p.high, size=p.shape).astype(p.dtype)
        else:
            feed[p.name] = rng.standard_normal(p.shape).astype(p.dtype)
    return feed


def left_padded_mask(shape: Sequence[int], rng: np.random.Generator) -> np.ndarray:
    """right_padded_mask's rows reversed: zeros then ones (the padding batched generation puts before
    each prompt)."""
    return np.ascontiguousarray(right_padded_mask(shape, rng)[..., ::-1])


def right_padded_mask(shape: Sequence[int], rng: np.random.Generator) -> np.ndarray:
    """0/1 mask over the last axis: ones then zeros per row; row 0 is full, row 1 (or the only row) is padded."""
    shape = list(shape)
    if not shape:
        return np.ones((), dtype=np.int64)
    length = shape[-1]
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    lens = rng.integers(1, length + 1, size=rows)
    if rows >= 1:
        lens[0] = length
    if length > 1:
        padded = 1 if rows > 1 else 0
        lens[padded] = rng.integers(1, length)  # at least one row with padding
    mask = (np.arange(length)[None, :] < lens[:, None]).astype(np.int64)
    return mask.reshape(shape)
