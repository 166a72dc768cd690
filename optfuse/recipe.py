"""Recipes: one YAML file per model family (``recipes/<name>.yaml``) that says what to fuse and how to check it.

A recipe names the model (a file, or an export spec resolved through :mod:`optfuse.models`), its
inputs (dtype, shape in ints or dim names, value range and meaning), the range of each symbolic
dim (min/opt/max: the opt value is what verify feeds and what HBM estimates assume), which fusion
families run, the precision policy, verification tolerances (and whether ``convert``'s check
also runs per node) and the GPU target.

Every model is strict (unknown keys are errors). :func:`load_recipe` turns validation failures
into an :class:`~optfuse.errors.InputError` whose message has one line per problem::

    recipe bert.yaml: field 'inputs.input_ids.shape': dim 'seq' is not declared in 'dims' (declared: batch)

The schema is a bottom-layer module: it imports only :mod:`optfuse.errors`, :mod:`optfuse.defaults`,
:mod:`optfuse.model_families` and :mod:`optfuse.target`. No stage reads a Recipe: the pipeline turns
it into the typed options each stage takes (:mod:`optfuse.pipeline.options`).
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from .defaults import DEFAULT_FP8_MIN_COSINE, DEFAULT_FP8_MIN_TOP1, DEFAULT_TOLERANCES, dim_expression, dim_value
from .errors import InputError
from .model_families import DECODE_FAMILIES, EXPORT_FAMILIES
from .target import arch_name, parse_arch

DType = Literal["float32", "float16", "bfloat16", "int64", "int32", "int8", "uint8", "bool"]
_DIM_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ExportSpec(_Strict):
    """Export a tiny model of a family with torch (see optfuse.models)."""

    family: str = Field(min_length=1)
    exporter: Literal["torchscript", "dynamo"] = "dynamo"
    attn: Literal["sdpa", "eager"] = "sdpa"
    # None: the exporter's default (17 for TorchScript, 18+ for dynamo)
    opset: Optional[int] = Field(None, ge=7, le=23)
    # transformers config fields over the family's tiny defaults, e.g. {num_attention_heads: 2}
    config: dict[str, Union[bool, int, float, str]] = {}
    # the decode step over a KV cache (past_key_values.* inputs, present.* outputs; DECODE_FAMILIES)
    past: bool = False

    @field_validator("family")
    @classmethod
    def _known_family(cls, v: str) -> str:
        if v not in EXPORT_FAMILIES:
            raise ValueError(f"expected one of the model families {', '.join(EXPORT_FAMILIES)}, got {v!r}")
        return v

    @model_validator(mode="after")
    def _decode_family(self) -> ExportSpec:
        if self.past and self.family not in DECODE_FAMILIES:
            raise ValueError(f"past: true needs a decode family ({', '.join(DECODE_FAMILIES)}), got {self.family!r}")
        return self


class ModelSource(_Strict):
    """Exactly one of `path` (an .onnx file, relative to the recipe) or `export`."""

    path: Optional[Path] = None
    export: Optional[ExportSpec] = None

    @model_validator(mode="after")
    def _one_of(self) -> ModelSource:
        if (self.path is None) == (self.export is None):
            raise ValueError("expected exactly one of 'path' or 'export'")
        return self


class InputSpec(_Strict):
    dtype: DType
    shape: list[Union[int, str]]
    range: Optional[list[float]] = None
    kind: Optional[Literal["tokens", "mask", "float"]] = None
    # a mask's padding in the verify inputs: right (encoders, a prefill's default) or left (batched
    # generation pads the prompts on the left)
    padding: Optional[Literal["right", "left"]] = None
    npz: Optional[Path] = None

    @model_validator(mode="after")
    def _padding_of_a_mask(self) -> InputSpec:
        if self.padding is not None and self.kind not in (None, "mask"):
            raise ValueError(f"padding applies to kind: mask, not kind: {self.kind}")
        return self

    @field_validator("shape", mode="before")
    @classmethod
    def _shape(cls, v: Any) -> Any:
        if not isinstance(v, list):
            raise ValueError(f"expected a list of positive ints or dim names, got {_show(v)}")
        for i, d in enumerate(v):
            if isinstance(d, bool) or not isinstance(d, (int, str)):
                raise ValueError(f"expected a positive int or a dim name at position {i}, got {_show(d)}")
            if isinstance(d, int) and d < 1:
                raise ValueError(f"expected a positive int at position {i}, got {d}")
            if isinstance(d, str) and not _DIM_NAME.match(d) and dim_expression(d) is None:
                raise ValueError(f"expected a dim name (letters, digits, _) or an expression over dim names "
                                 f"(past_sequence + sequence) at position {i}, got {d!r}")
        return v

    @field_validator("range")
    @classmethod
    def _range(cls, v: Optional[list[float]]) -> Optional[list[float]]:
        if v is None:
            return v
        if len(v) != 2:
            raise ValueError(f"expected [low, high), got {len(v)} values")
        lo, hi = v
        if not (math.isfinite(lo) and math.isfinite(hi)) or not lo < hi:
            raise ValueError(f"expected [low, high) with low < high, got [{lo}, {hi}]")
        return v


class DimSpec(_Strict):
    min: int = Field(ge=1)
    opt: int = Field(ge=1)
    max: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> DimSpec:
        if not self.min <= self.opt <= self.max:
            raise ValueError(f"expected min <= opt <= max, got {self.min}, {self.opt}, {self.max}")
        return self


class Fusions(_Strict):
    """Which fusion families run (all on by default)."""

    layer_norm: bool = True
    rms_norm: bool = True
    skip_norm: bool = True
    attention: bool = True
    gemm: bool = True
    # causal+padding masks: pass the whole mask (exact even for query rows whose every allowed key
    # is padding, e.g. left padding) instead of causal=1 plus the [B,1,1,Sk] padding row (fast)
    attention_full_mask: bool = False
    # rule ids that do not run (``<family>.<variant>``, e.g. gemm.act_residual; checked against the
    # rules when the recipe is used)
    disabled_rules: list[str] = []
    # original node names or globs: a fusion that would take one of these nodes is not made
    skip_nodes: list[str] = []

    @field_validator("disabled_rules")
    @classmethod
    def _rule_ids(cls, v: list[str]) -> list[str]:
        families = cls.families()
        for rule in v:
            family, dot, variant = rule.partition(".")
            if not dot or not variant or family not in families:
                raise ValueError(f"expected a rule id <family>.<variant> with family one of "
                                 f"{', '.join(families)}, got {rule!r}")
        return v

    @field_validator("skip_nodes")
    @classmethod
    def _node_names(cls, v: list[str]) -> list[str]:
        if any(not isinstance(n, str) or not n.strip() for n in v):
            raise ValueError("expected non-empty node names or globs")
        return v

    @staticmethod
    def families() -> tuple[str, ...]:
        return ("layer_norm", "rms_norm", "attention", "gemm", "skip_norm")

    def enabled(self) -> list[str]:
        return [name for name in self.families() if getattr(self, name)]


class OutputTolerance(_Strict):
    atol: Optional[float] = Field(None, ge=0)
    rtol: Optional[float] = Field(None, ge=0)


class Tolerances(_Strict):
    """Default atol/rtol (from the precision mode when absent) plus per-output overrides."""

    atol: Optional[float] = Field(None, ge=0)
    rtol: Optional[float] = Field(None, ge=0)
    outputs: dict[str, OutputTolerance] = {}


class PrecisionTolerances(Tolerances):
    """Tolerances of the reduced-precision candidates: the atol / rtol / outputs here hold for every
    mode; a mode's own table (``fp16``, ``bf16``, ``fp8``) goes over them for that mode, so a recipe
    written for FP16 does not hold a ``--bf16`` or ``--fp8`` run to FP16's bar."""

    fp16: Optional[Tolerances] = None
    bf16: Optional[Tolerances] = None
    fp8: Optional[Tolerances] = None


class Calibration(_Strict):
    """FP8 calibration: how many batches, from where, and how each activation's amax is chosen."""

    # batches of the verify input generator (seeded by `seed`), or the first `batches` of `npz`
    batches: int = Field(8, ge=1)
    seed: int = Field(1, ge=0)
    # inputs as ``--load-inputs`` reads them (one key per input, or ``<batch>/<input>``); relative to the recipe
    npz: Optional[Path] = None
    # max (amax = max |x|) | percentile (of |x|) | mse (E4M3 fake-quant error); see optfuse.precision.calibrate
    method: Literal["max", "percentile", "mse"] = "max"
    percentile: float = Field(99.99, gt=0, le=100)
    # scale candidates per binade of the E4M3 grid-alignment search (weights per channel, max-calibrated
    # activations per tensor); 1: amax / 448 exactly. See optfuse.precision.calibrate
    scale_steps: int = Field(8, ge=1, le=64)


class Precision(_Strict):
    mode: Literal["fp32", "fp16", "bf16", "fp8"] = "fp32"
    keep_fp32: list[str] = []
    io_dtype: Literal["keep", "fp16"] = "keep"
    # fp8: what is not quantized runs in this precision
    fp8_base: Literal["fp16", "bf16"] = "fp16"
    # fp8: GEMM node names or globs (fused node names, the original names they replaced, op types) kept in fp8_base
    fp8_exclude: list[str] = []
    # fp8: which FlashAttention nodes take E4M3 q, k, v: auto (where the op spec's fp8_speedup says FP8
    # pays on target.arch), on (every node), off (none)
    fp8_attention: Literal["auto", "on", "off"] = "auto"
    calibration: Calibration = Calibration()
    # how close the reduced-precision model must stay to the FP32 original: for every mode, with a
    # table per mode over it (`fp16: {atol: ...}`); what neither sets is the mode's default. The
    # top-level `tolerances` are for FP32 candidates (the fused model)
    tolerances: PrecisionTolerances = PrecisionTolerances()

    @field_validator("fp8_attention", mode="before")
    @classmethod
    def _on_off(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare on / off as true / false
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v


class Fp8Accuracy(_Strict):
    """Scale-free bars of an FP8 candidate: cosine similarity per output, top-1 agreement on heads."""

    min_cosine: float = Field(DEFAULT_FP8_MIN_COSINE, ge=-1, le=1)
    # None: top-1 agreement is reported, not required
    min_top1: Optional[float] = Field(DEFAULT_FP8_MIN_TOP1, ge=0, le=1)


class VerifySettings(_Strict):
    """What ``convert``'s onnxruntime check runs besides the output comparison."""

    # also compare every tensor both models compute and rank what adds the error (about one more
    # verify's time); the reports then carry the per-node facts
    per_node: bool = False
    # intermediate tensors exposed per onnxruntime run of the per-node comparison (bounds memory)
    chunk_size: int = Field(64, ge=1)
    # what an fp8 candidate must also meet per output, besides precision.tolerances (see optfuse.defaults)
    fp8: Fp8Accuracy = Fp8Accuracy()


class Target(_Strict):
    arch: str = "sm_90"
    backend: Literal["auto", "tensorrt", "tensorrt_rtx"] = "auto"

    @field_validator("arch")
    @classmethod
    def _arch(cls, v: str) -> str:
        if not re.match(r"^sm_\d{2,3}a?$", v):
            raise ValueError(f"expected an arch like 'sm_80', 'sm_86', 'sm_89' or 'sm_90', got {v!r}")
        try:
            cc = parse_arch(v)
        except ValueError as exc:
            raise ValueError(str(exc)) from None
        return arch_name(cc) + ("a" if v.endswith("a") else "")


class DimsNotDeclared(ValueError):
    """Cross-field errors: (field path, message) pairs, reported one per line."""

    def __init__(self, errors: list[tuple[str, str]]):
        self.errors = errors
        super().__init__("; ".join(f"field {p!r}: {m}" for p, m in errors))


class Recipe(_Strict):
    name: str = Field(min_length=1)
    model: ModelSource
    inputs: dict[str, InputSpec] = {}
    dims: dict[str, DimSpec] = {}
    fusions: Fusions = Fusions()
    precision: Precision = Precision()
    tolerances: Tolerances = Tolerances()
    verify: VerifySettings = VerifySettings()
    target: Target = Target()

    _base_dir: Path = PrivateAttr(default_factory=Path.cwd)
    _source: Optional[Path] = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _dims_declared(self) -> Recipe:
        errors = []
        for name, spec in self.inputs.items():
            for d in spec.shape:
                if not isinstance(d, str) or d in self.dims:
                    continue
                expr = dim_expression(d)
                if expr is not None and expr[1] <= set(self.dims):
                    continue  # an expression over declared dims (past_sequence + sequence)
                missing = sorted(expr[1] - set(self.dims)) if expr is not None and not _DIM_NAME.match(d) else [d]
                for n in missing:
                    declared = ", ".join(self.dims) or "none"
                    errors.append((f"inputs.{name}.shape", f"dim {n!r} is not declared in 'dims' (declared: {declared})"))
        if errors:
            raise DimsNotDeclared(errors)
        return self

    # -- derived values ------------------------------------------------------------------------
    @property
    def source(self) -> Optional[Path]:
        """The YAML file this recipe came from (None when built in code)."""
        return self._source

    def resolve_path(self, p: os.PathLike | str) -> Path:
        """A path from the recipe, relative to the recipe file's folder."""
        p = Path(p).expanduser()
        return p if p.is_absolute() else self._base_dir / p

    def opt_dims(self) -> dict[str, int]:
        return {k: v.opt for k, v in self.dims.items()}

    def opt_shape(self, input_name: str) -> list[int]:
        """An input's shape at the opt dims (an expression over dim names evaluated at theirs)."""
        opt = self.opt_dims()  # the schema admits only declared names and expressions over them
        return [dim_value(d, opt) for d in self.inputs[input_name].shape]

    def tolerance_tables(self, mode: str = "fp32") -> list[Tolerances]:
        """The recipe's tables for a candidate computed in `mode`, general first: `tolerances` for
        fp32; `precision.tolerances`, then its table for the mode (if any), otherwise."""
        if mode == "fp32":
            return [self.tolerances]
        mine = getattr(self.precision.tolerances, mode)
        return [self.precision.tolerances] + ([mine] if mine is not None else [])

    def tolerance(self, output: str | None, mode: str = "fp32") -> tuple[float, float]:
        """(atol, rtol) for one output of a candidate computed in `mode`: each of tolerance_tables
        in turn (its default, then its override for the output) over the mode's default, so the
        mode's own table wins. ``output=None``: the default of every output without an override."""
        atol, rtol = DEFAULT_TOLERANCES[mode]
        for t in self.tolerance_tables(mode):
            atol = t.atol if t.atol is not None else atol
            rtol = t.rtol if t.rtol is not None else rtol
            o = t.outputs.get(output) if output is not None else None
            if o is not None:
                atol = o.atol if o.atol is not None else atol
                rtol = o.rtol if o.rtol is not None else rtol
        return atol, rtol


# ------------------------------------------------------------------------------------------------
# Loading and error formatting
# ------------------------------------------------------------------------------------------------
def load_recipe(path: os.PathLike | str) -> Recipe:
    """Read and validate a recipe file; every problem is an InputError (one line per problem)."""
    path = Path(path)
    label = f"recipe {path}"
    if not path.exists():
        raise InputError(f"{label}: file not found")
    if not path.is_file():
        raise InputError(f"{label}: not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{label}: cannot be read ({exc})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InputError(f"{label}: not valid YAML{where}: {problem}") from None
    return recipe_from_dict(data, label=label, base_dir=path.resolve().parent, source=path)


def recipe_from_dict(data: Any, label: str = "recipe", base_dir: Path | None = None,
                     source: Path | None = None) -> Recipe:
    if not isinstance(data, dict):
        raise InputError(f"{label}: expected a mapping of recipe fields, got {_type_name(data)}")
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        raise InputError("\n".join(f"{label}: {line}" for line in format_errors(exc))) from None
    recipe._base_dir = base_dir or Path.cwd()
    recipe._source = source
    return recipe


def format_errors(exc: ValidationError) -> list[str]:
    """Pydantic errors as ``field 'a.b.c': expected ...`` lines, in document order, no duplicates."""
    lines: list[str] = []
    for err in exc.errors(include_url=False):
        ctx_err = (err.get("ctx") or {}).get("error")
        if isinstance(ctx_err, DimsNotDeclared):
            lines.extend(f"field {p!r}: {m}" for p, m in ctx_err.errors)
            continue
        loc = _clean_loc(err["loc"])
        path = ".".join(str(p) for p in loc) or "<top>"
        lines.append(f"field {path!r}: {_describe(err, loc)}")
    seen: set[str] = set()
    return [ln for ln in lines if not (ln in seen or seen.add(ln))]


def _clean_loc(loc: tuple) -> tuple:
    # Union branches and validator wrappers add pseudo-locations ('int', 'function-after[...]').
    return tuple(p for p in loc if not (isinstance(p, str) and ("[" in p or p in {"int", "str", "float", "bool"})))


def _describe(err: dict, loc: tuple) -> str:
    typ, msg, given = err["type"], err["msg"], err.get("input")
    if typ == "missing":
        return "missing (required)"
    if typ == "extra_forbidden":
        allowed = _allowed_keys(loc[:-1])
        hint = f"; expected one of: {', '.join(allowed)}" if allowed else ""
        return f"unknown key{hint}"
    if typ == "value_error":
        text = msg.removeprefix("Value error, ")
    elif msg.startswith("Input should be "):
        text = "expected " + msg[len("Input should be "):]
    elif msg.startswith("Input should have "):
        text = "expected " + msg[len("Input should "):]
    else:
        text = msg[:1].lower() + msg[1:]
    if "got " not in text and typ not in ("value_error",):
        text += f" (got {_show(given)})"
    return text


def _allowed_keys(loc: tuple) -> list[str]:
    """Field names of the model at `loc` (walks Recipe's fields; a dict key skips one level)."""
    return _walk_fields(Recipe, list(loc))


def _walk_fields(model: Any, loc: list) -> list[str]:
    while loc:
        fields = getattr(model, "model_fields", None)
        if fields is None or loc[0] not in fields:
            return []
        model, is_dict = _unwrap(fields[loc[0]].annotation)
        loc = loc[1:]
        if is_dict:
            if not loc:
                return []
            loc = loc[1:]
    fields = getattr(model, "model_fields", None)
    return list(fields) if fields else []


def _unwrap(ann: Any) -> tuple[Any, bool]:
    """(inner model type, is a dict of it) for Optional[X], dict[str, X], X."""
    import typing

    args = typing.get_args(ann)
    origin = typing.get_origin(ann)
    if origin is dict:
        inner, _ = _unwrap(args[1])
        return inner, True
    if origin is Union:
        for a in args:
            if a is not type(None):
                return _unwrap(a)
    return ann, False


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _type_name(v: Any) -> str:
    if v is None:
        return "an empty document"
    return {list: "a list", str: "a string", int: "a number", float: "a number", bool: "a boolean"}.get(type(v), type(v).__name__)
