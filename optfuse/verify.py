"""Stage `verify`: run the original and the candidate model on the same inputs, compare every output.

Both models run in onnxruntime (CPU) through polygraphy (``OnnxrtRunner(SessionFromOnnx(...))``,
``Comparator.run``) on a list of feed dicts built here, so the inputs mean what the model expects:

- from the recipe when it describes an input (``range``, ``kind``, ``npz``);
- else inferred from the graph: an integer input used (through Cast/Reshape/...) as the indices of a
  ``Gather`` on a constant table gets values in ``[0, rows)`` (token ids below the vocabulary size,
  token type ids below the type-table size); an input named like ``*mask*`` gets right-padded 0/1
  masks (ones then zeros; at least one row is padded); other floats are N(0, 1).

Symbolic dims take the recipe's opt values, else batch (the first axis) 2 and 16 for the others.
Every output of the original is compared elementwise: it passes when ``|cand - ref| <= atol + rtol *
|ref|`` everywhere (numpy's isclose) over all iterations, with the recipe's tolerances (default atol
1e-4, rtol 1e-3 for fp32).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from .errors import InputError, VerificationError
from .recipe import DEFAULT_TOLERANCES, Recipe

DEFAULT_BATCH = 2
DEFAULT_DIM = 16
DEFAULT_ITERATIONS = 3
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
# Results
# ------------------------------------------------------------------------------------------------
@dataclass
class OutputResult:
    name: str
    passed: bool
    max_abs: float
    max_rel: float
    mean_abs: float
    atol: float
    rtol: float
    shape: list[int] | None = None
    note: str = ""  # why it failed other than by tolerance (missing output, shape mismatch, NaN)


@dataclass
class InputInfo:
    name: str
    dtype: str
    shape: list[int]
    source: str  # how the values were made, e.g. "tokens [0, 1000) (Gather table rows)"


@dataclass
class VerifyResult:
    outputs: list[OutputResult]
    inputs: list[InputInfo]
    iterations: int
    seed: int
    original: str = ""
    candidate: str = ""

    @property
    def passed(self) -> bool:
        return bool(self.outputs) and all(o.passed for o in self.outputs)

    @property
    def failed(self) -> list[OutputResult]:
        return [o for o in self.outputs if not o.passed]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["passed"] = self.passed
        return d


# ------------------------------------------------------------------------------------------------
# Input planning
# ------------------------------------------------------------------------------------------------
@dataclass
class InputPlan:
    """How to make one input: dtype, concrete shape and a generator kind with its parameters."""

    name: str
    dtype: Any
    shape: list[int]
    kind: str  # tokens | mask | float | int | bool | npz
    low: float = 0.0
    high: float = 1.0
    npz: np.ndarray | None = None
    source: str = ""
    uniform: bool = False  # floats: uniform in [low, high) instead of N(0, 1)


def _value_shape(vi: onnx.ValueInfoProto) -> list[int | str | None] | None:
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


def _is_batch_name(name: str) -> bool:
    return bool(re.search(r"batch|^b$|^n$|^bs$", name, re.IGNORECASE))


def concrete_dims(model: onnx.ModelProto, recipe: Recipe | None = None) -> dict[str, int]:
    """Symbolic dim name -> value: the recipe's opt, else 2 for a leading (batch) dim and 16 otherwise."""
    dims: dict[str, int] = dict(recipe.opt_dims()) if recipe else {}
    init_names = {t.name for t in model.graph.initializer}
    for inp in model.graph.input:
        if inp.name in init_names:
            continue
        shape = _value_shape(inp) or []
        for axis, d in enumerate(shape):
            if isinstance(d, str) and d not in dims:
                dims[d] = DEFAULT_BATCH if axis == 0 or _is_batch_name(d) else DEFAULT_DIM
    return dims


def plan_inputs(model: onnx.ModelProto, recipe: Recipe | None = None) -> list[InputPlan]:
    """Decide dtype, shape and value kind of every graph input (see module doc)."""
    dims = concrete_dims(model, recipe)
    rows = gather_table_rows(model)
    init_names = {t.name for t in model.graph.initializer}
    graph_inputs = [i for i in model.graph.input if i.name not in init_names]
    if recipe is not None:
        unknown = sorted(set(recipe.inputs) - {i.name for i in graph_inputs})
        if unknown:
            raise InputError(f"recipe input(s) {', '.join(map(repr, unknown))} are not inputs of the model "
                             f"(its inputs: {', '.join(i.name for i in graph_inputs)})")
    plans = []
    for inp in graph_inputs:
        spec = recipe.inputs.get(inp.name) if recipe else None
        elem = inp.type.tensor_type.elem_type
        if spec is not None:
            if spec.dtype == "bfloat16":
                raise InputError(f"input {inp.name!r}: bfloat16 inputs cannot be fed to onnxruntime from NumPy")
            dtype = _NAMED_DTYPES[spec.dtype]
            shape = recipe.opt_shape(inp.name)
            _check_against_model(inp, np.dtype(dtype), shape, spec.npz is not None)
        else:
            if elem not in _NP_DTYPES:
                raise InputError(f"input {inp.name!r} has an element type ({onnx.TensorProto.DataType.Name(elem)}) "
                                 "verify cannot generate; describe it in a recipe")
            dtype = _NP_DTYPES[elem]
            raw = _value_shape(inp)
            if raw is None:
                raise InputError(f"input {inp.name!r} has no shape in the model; give it one in a recipe")
            shape = [d if isinstance(d, int) else dims.get(d, DEFAULT_DIM) if isinstance(d, str)
                     else (DEFAULT_BATCH if i == 0 else DEFAULT_DIM) for i, d in enumerate(raw)]
        plans.append(_plan_one(inp.name, np.dtype(dtype), shape, spec, rows.get(inp.name), recipe))
    return plans


def _check_against_model(inp: onnx.ValueInfoProto, dtype: np.dtype, shape: list[int], from_npz: bool) -> None:
    """A recipe input must agree with the graph input it describes (else onnxruntime fails later)."""
    elem = inp.type.tensor_type.elem_type
    if elem in _NP_DTYPES and np.dtype(_NP_DTYPES[elem]) != dtype:
        raise InputError(f"recipe input {inp.name!r} is {dtype.name}, but the model's is "
                         f"{np.dtype(_NP_DTYPES[elem]).name}")
    raw = _value_shape(inp)
    if raw is None or from_npz:
        return
    if len(raw) != len(shape):
        raise InputError(f"recipe input {inp.name!r} has rank {len(shape)}, but the model's has rank {len(raw)} ({raw})")
    for axis, (m, r) in enumerate(zip(raw, shape)):
        if isinstance(m, int) and m != r:
            raise InputError(f"recipe input {inp.name!r}: axis {axis} is {r}, but the model fixes it to {m}")


def _plan_one(name: str, dtype: np.dtype, shape: list[int], spec, rows: int | None,
              recipe: Recipe | None) -> InputPlan:
    p = InputPlan(name, dtype, shape, kind="float")
    lname = name.lower()
    kind = spec.kind if spec is not None else None
    rng = spec.range if spec is not None else None
    if spec is not None and spec.npz is not None:
        p.kind, p.npz = "npz", _load_npz(recipe.resolve_path(spec.npz), name, dtype)
        p.shape = list(p.npz.shape)
        p.source = f"npz {spec.npz}"
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
        p.source = "right-padded 0/1 mask"
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
            elif len(keys) == 1:
                arr = z[keys[0]]
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
            feed[p.name] = right_padded_mask(p.shape, rng).astype(p.dtype)
        elif p.kind in ("tokens", "int"):
            feed[p.name] = rng.integers(int(p.low), int(p.high), size=p.shape).astype(p.dtype)
        elif p.kind == "bool":
            feed[p.name] = rng.integers(0, 2, size=p.shape).astype(np.bool_)
        elif p.uniform:
            feed[p.name] = rng.uniform(p.low, p.high, size=p.shape).astype(p.dtype)
        else:
            feed[p.name] = rng.standard_normal(p.shape).astype(p.dtype)
    return feed


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


# ------------------------------------------------------------------------------------------------
# Running and comparing
# ------------------------------------------------------------------------------------------------
def _prepare_polygraphy() -> None:
    """Quiet polygraphy's logger, and keep it from importing torch on every inference.

    polygraphy's ``util.array.is_torch`` imports torch (seconds) just to ask whether a NumPy feed is a
    torch tensor; an object can only be one if torch is already imported, so ask sys.modules instead.
    """
    import sys

    from polygraphy.logger import G_LOGGER
    from polygraphy.util import array as parray

    G_LOGGER.module_severity = G_LOGGER.ERROR
    if not getattr(parray.is_torch, "_optfuse", False):
        def is_torch(obj) -> bool:
            torch = sys.modules.get("torch")
            return torch is not None and isinstance(obj, torch.Tensor)

        is_torch._optfuse = True
        parray.is_torch = is_torch


def compare_arrays(name: str, ref: list[np.ndarray], got: list[np.ndarray], atol: float, rtol: float) -> OutputResult:
    """Elementwise isclose over every iteration, plus max abs / max rel / mean abs error."""
    max_abs = max_rel = 0.0
    abs_sum, count = 0.0, 0
    passed, note, shape = True, "", None
    for r, g in zip(ref, got):
        r = np.asarray(r)
        g = np.asarray(g)
        shape = list(r.shape)
        if r.shape != g.shape:
            return OutputResult(name, False, float("inf"), float("inf"), float("inf"), atol, rtol, shape,
                                f"shape {list(g.shape)} differs from the original's {list(r.shape)}")
        r64, g64 = r.astype(np.float64), g.astype(np.float64)
        nan_r, nan_g = np.isnan(r64), np.isnan(g64)
        if (nan_r != nan_g).any():
            passed, note = False, "NaN where the original has none" if (nan_g & ~nan_r).any() else "NaN mismatch"
        ok = ~(nan_r | nan_g)
        with np.errstate(invalid="ignore"):  # inf - inf: handled just below
            diff = np.abs(r64 - g64)[ok]
        ref_abs = np.abs(r64)[ok]
        if diff.size:
            inf_r, inf_g = np.isinf(r64[ok]), np.isinf(g64[ok])
            same_inf = inf_r & inf_g & (r64[ok] == g64[ok])
            diff = np.where(same_inf, 0.0, diff)
            max_abs = max(max_abs, float(diff.max()))
            with np.errstate(divide="ignore", invalid="ignore"):
                rel = np.where(diff == 0, 0.0, diff / np.where(ref_abs == 0, np.finfo(np.float64).tiny, ref_abs))
            max_rel = max(max_rel, float(rel.max()))
            abs_sum += float(diff.sum())
            count += diff.size
            if not bool((diff <= atol + rtol * np.where(np.isinf(ref_abs), 0, ref_abs)).all()):
                passed = False
    mean_abs = abs_sum / count if count else 0.0
    return OutputResult(name, passed, max_abs, max_rel, mean_abs, atol, rtol, shape, note)


def verify(original: str | os.PathLike | onnx.ModelProto, candidate: str | os.PathLike | onnx.ModelProto,
           recipe: Recipe | None = None, iterations: int = DEFAULT_ITERATIONS, seed: int = 0,
           atol: float | None = None, rtol: float | None = None,
           feeds: list[dict[str, np.ndarray]] | None = None,
           on_iteration: Callable[[int], None] | None = None) -> VerifyResult:
    """Run both models on the same seeded inputs and compare every output of the original.

    `atol`/`rtol` override the recipe for every output. `feeds` replaces input generation.
    """
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.comparator import Comparator

    from .ir import load_model

    ref_model = original if isinstance(original, onnx.ModelProto) else load_model(original)
    cand_model = candidate if isinstance(candidate, onnx.ModelProto) else load_model(candidate)
    if iterations < 1:
        raise InputError(f"iterations must be >= 1, got {iterations}")

    plans = plan_inputs(ref_model, recipe)
    _check_candidate_inputs(plans, cand_model)
    if feeds is None:
        rng = np.random.default_rng(seed)
        feeds = [make_feed(plans, rng) for _ in range(iterations)]

    _prepare_polygraphy()
    # Sessions are made up front so that a model onnxruntime rejects is named: the original is bad
    # input (exit 2), a candidate that does not load has failed verification (exit 1).
    runners = []
    for label, src, model, err in (("original", original, ref_model, InputError),
                                   ("candidate", candidate, cand_model, VerificationError)):
        try:
            session = SessionFromOnnx(_bytes_or_path(src, model), providers=["cpu"])()
        except Exception as exc:
            raise err(f"onnxruntime cannot load the {label} model: {_first_line(exc)}") from None
        runners.append(OnnxrtRunner(session, name=label))
    try:
        results = Comparator.run(runners, data_loader=_Loader(feeds, on_iteration))
    except Exception as exc:
        raise VerificationError(f"onnxruntime could not run the models: {_first_line(exc)}") from None
    if not results or len(results) != 2:
        raise VerificationError("onnxruntime could not run the models (polygraphy returned no results)")
    ref_iters = results["original"]
    cand_iters = results["candidate"]

    out_names = [o.name for o in ref_model.graph.output]
    mode = precision_of(cand_model)
    outputs = []
    for name in out_names:
        a, r = _tolerance(name, recipe, atol, rtol, mode)
        if any(name not in it for it in cand_iters):
            outputs.append(OutputResult(name, False, float("inf"), float("inf"), float("inf"), a, r, None,
                                        "missing from the candidate"))
            continue
        outputs.append(compare_arrays(name, [it[name] for it in ref_iters], [it[name] for it in cand_iters], a, r))
    infos = [InputInfo(p.name, np.dtype(p.dtype).name, list(p.shape), p.source) for p in plans]
    return VerifyResult(outputs, infos, len(feeds), seed, _label(original), _label(candidate))


class _Loader:
    """A polygraphy data loader over prepared feed dicts (reports each iteration for progress)."""

    def __init__(self, feeds: list[dict[str, np.ndarray]], on_iteration: Callable[[int], None] | None):
        self.feeds = feeds
        self.on_iteration = on_iteration

    def __len__(self) -> int:
        return len(self.feeds)

    def __iter__(self):
        for i, f in enumerate(self.feeds):
            if self.on_iteration is not None:
                self.on_iteration(i)
            yield f

    def __getitem__(self, i: int):
        return self.feeds[i]


def _tolerance(name: str, recipe: Recipe | None, atol: float | None, rtol: float | None,
               mode: str = "fp32") -> tuple[float, float]:
    a, r = recipe.tolerance(name, mode) if recipe else DEFAULT_TOLERANCES[mode]
    return (a if atol is None else atol), (r if rtol is None else rtol)


def precision_of(model: onnx.ModelProto) -> str:
    """'fp16' / 'bf16' when the model keeps floating weights in that type, else 'fp32': the
    tolerance a candidate is held to follows the precision it computes in."""
    kinds = {t.data_type for t in model.graph.initializer}
    if onnx.TensorProto.BFLOAT16 in kinds:
        return "bf16"
    if onnx.TensorProto.FLOAT16 in kinds:
        return "fp16"
    return "fp32"


def _check_candidate_inputs(plans: list[InputPlan], cand: onnx.ModelProto) -> None:
    init = {t.name for t in cand.graph.initializer}
    want = {i.name for i in cand.graph.input if i.name not in init}
    have = {p.name for p in plans}
    if want - have:
        raise InputError(f"the candidate needs inputs the original does not have: {', '.join(sorted(want - have))}")


def _bytes_or_path(src: Any, model: onnx.ModelProto) -> Any:
    # a path keeps external data readable by onnxruntime; in-memory models go as bytes
    return str(src) if isinstance(src, (str, os.PathLike)) else model.SerializeToString()


def _label(src: Any) -> str:
    return str(src) if isinstance(src, (str, os.PathLike)) else "<in memory>"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
