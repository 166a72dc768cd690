"""What the flows take: a recipe (read from a file) and the command line's :class:`Overrides`,
turned into the typed options each stage needs. No stage reads a Recipe; these functions are the
only place that looks inside one. A command-line value wins over the recipe's, which wins over the
default; :func:`options_record` says which one each setting came from (the reports keep it).

- shapes: :func:`resolve_dims` (every symbolic dim's min/opt/max: command line, recipe or guessed);
- fuse: :func:`enabled_families`, :func:`analysis_dims` (dims for the HBM estimate), :func:`fusion_options`;
- verify: :func:`verify_options` (input specs at the opt dims, tolerances per precision mode);
- precision: :func:`precision_options`;
- build: :func:`build_profile` (the optimization profile);
- progress: :class:`Progress` (numbered steps with counts and elapsed time; a plain callable works too).

Over 500 lines: the one place that reads a recipe, for every stage, so that precedence and the
record of where each setting came from stay in one file.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import onnx

from ..defaults import (DEFAULT_BATCH, DEFAULT_DIM, DEFAULT_TOLERANCES, concrete_dims, derived_dims, dim_value,
                        is_batch_name, value_shape)
from ..errors import InputError
from ..pattern import FusionOptions
from ..precision import PrecisionOptions
from ..recipe import Recipe, load_recipe
from ..target import arch_name, parse_arch
from ..trt.build import BuildProfile
from ..verify import Agreement, FeedSpec, Tolerances, VerifyOptions

#: (min, opt, max) shapes of one input, as the command line gives them
ShapeRange = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


# ------------------------------------------------------------------------------------------------
# progress
# ------------------------------------------------------------------------------------------------
class Progress:
    """What a flow reports while it runs: numbered steps (:meth:`step`), each ending with its counts
    and elapsed time (:meth:`finished`), and live messages within a step (calling the object).

    This base class shows nothing; the CLI subclasses it (live display on a terminal, plain lines on
    a pipe). A step opened inside another one (``convert`` running ``fuse``) is not counted: it
    becomes a message of the outer step. Flows also accept a plain ``Callable[[str], None]``
    (:func:`as_progress`)."""

    def __init__(self) -> None:
        self.total = 0
        self.index = 0
        self._depth = 0
        self.current = ""

    def __call__(self, message: str) -> None:
        self.message(message)

    # -- what a display overrides -----------------------------------------------------------------
    def message(self, text: str) -> None:
        """A live message within the current step."""

    def started(self, index: int, total: int, name: str) -> None:
        """Step `index` of `total` (1-based) begins."""

    def finished(self, index: int, total: int, name: str, detail: str, seconds: float) -> None:
        """Step `index` of `total` ended: its counts (`detail`) and elapsed time."""

    # -- what a flow calls ------------------------------------------------------------------------
    def plan(self, total: int) -> None:
        """The outermost flow says how many steps it runs (a nested flow's plan is ignored)."""
        if self._depth == 0:
            self.total, self.index = total, 0

    @contextmanager
    def step(self, name: str) -> Iterator[StepRecord]:
        record = StepRecord(name)
        if self._depth > 0:  # a nested flow's step: a message of the step that runs it
            self.message(name)
            self._depth += 1
            try:
                yield record
            finally:
                self._depth -= 1
            return
        self.index += 1
        self.total = max(self.total, self.index)
        self.current = name
        self.started(self.index, self.total, name)
        t0 = time.perf_counter()
        self._depth += 1
        try:
            yield record
        finally:
            self._depth -= 1
        # only a step that completed reports (a failure reports itself, as the error)
        self.finished(self.index, self.total, name, record.detail, time.perf_counter() - t0)


@dataclass
class StepRecord:
    """A running step: the flow sets `detail` (its counts, e.g. "4 nodes matched") before it ends."""

    name: str
    detail: str = ""


class _CallbackProgress(Progress):
    def __init__(self, callback: Callable[[str], None]) -> None:
        super().__init__()
        self._callback = callback

    def message(self, text: str) -> None:
        self._callback(text)

    def started(self, index: int, total: int, name: str) -> None:
        self._callback(name)


#: Progress of every flow: a :class:`Progress`, or a callable given short texts of what runs now.
Status = Union[Progress, Callable[[str], None]]


def as_progress(status: Status | None) -> Progress:
    if isinstance(status, Progress):
        return status
    return Progress() if status is None or status is noop else _CallbackProgress(status)


def noop(_: str) -> None:
    pass


def read_recipe(path: str | os.PathLike | None) -> Recipe | None:
    return None if path is None else load_recipe(path)


def recipe_label(recipe: Recipe | None) -> str | None:
    if recipe is None:
        return None
    return str(recipe.source) if recipe.source is not None else recipe.name


# ------------------------------------------------------------------------------------------------
# command-line overrides
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Overrides:
    """Values given on the command line; each one replaces the recipe's (empty / None: not given).

    `shapes`: input -> (min, opt, max) shapes (``--shapes`` sets all three); `atol`/`rtol`: every
    output; `output_atol`/`output_rtol`: one output each (polygraphy's ``out:1e-3``), over `atol`."""

    shapes: Mapping[str, ShapeRange] = field(default_factory=dict)
    precision: str | None = None
    keep_fp32: tuple[str, ...] = ()
    atol: float | None = None
    rtol: float | None = None
    output_atol: Mapping[str, float] = field(default_factory=dict)
    output_rtol: Mapping[str, float] = field(default_factory=dict)
    #: ``convert --per-node`` / ``--no-per-node`` (over the recipe's ``verify.per_node``)
    per_node: bool | None = None
    #: ``convert --target`` (over the recipe's ``target.arch``): the arch the precision stage's
    #: FP8 attention rule reads
    target: str | None = None

    def tolerances_given(self) -> bool:
        return (self.atol is not None or self.rtol is not None or bool(self.output_atol)
                or bool(self.output_rtol))


NO_OVERRIDES = Overrides()


def check_output_names(model: onnx.ModelProto, overrides: Overrides) -> None:
    """A per-output tolerance must name an output of the model (exit 2 otherwise)."""
    names = [o.name for o in model.graph.output]
    for flag, table in (("--atol", overrides.output_atol), ("--rtol", overrides.output_rtol)):
        unknown = [n for n in table if n not in names]
        if unknown:
            raise InputError(f"{flag} {unknown[0]}:...: {unknown[0]!r} is not an output of the model "
                             f"(its outputs: {', '.join(names)})")


# ------------------------------------------------------------------------------------------------
# shapes: every symbolic dim's (min, opt, max)
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DimPlan:
    """The dims a run uses: each symbolic dim's (min, opt, max) and where it came from ("command
    line", "recipe", "guessed", or "derived": a dim named by an expression over others, from theirs),
    and the input shapes spelled in those dim names (the recipe's spelling over the model's; an axis
    with no name in either is named ``<input>.<axis>``)."""

    ranges: dict[str, tuple[int, int, int]]
    sources: dict[str, str]
    input_shapes: dict[str, list[int | str]]

    @property
    def guessed(self) -> list[str]:
        return [d for d, s in self.sources.items() if s == "guessed"]

    def opt(self) -> dict[str, int]:
        return {k: v[1] for k, v in self.ranges.items()}

    def source(self) -> str:
        """One phrase for the reports: where the dims came from."""
        kinds = [k for k in ("command line", "recipe", "guessed") if k in self.sources.values()]
        if not kinds:
            return "static shapes"
        return " + ".join("defaults (guessed)" if k == "guessed" else k for k in kinds)

    def guess_warning(self) -> str | None:
        """The one warning line when dims were guessed (None when every dim was given)."""
        if not self.guessed:
            return None
        dims = ", ".join(f"{d} {self.ranges[d][0]}..{self.ranges[d][2]} (opt {self.ranges[d][1]})"
                         for d in self.guessed)
        name, shape = next(((n, s) for n, s in self.input_shapes.items() if set(s) & set(self.guessed)),
                           ("INPUT", [1, 128]))
        example = "x".join(str(d if isinstance(d, int) else self.ranges[d][1]) for d in shape)
        return (f"no shapes given for dynamic dims, guessed {dims}; set them with --shapes {name}:{example} "
                f"(or --min-shapes/--opt-shapes/--max-shapes) or a recipe's dims (optfuse recipe init MODEL.onnx)")


def spelled_shapes(model: onnx.ModelProto, recipe: Recipe | None) -> dict[str, list[int | str]]:
    """Each graph input's shape in dim names: the recipe's spelling, else the model's."""
    inits = {t.name for t in model.graph.initializer}
    out: dict[str, list[int | str]] = {}
    for inp in model.graph.input:
        if inp.name in inits:
            continue
        if recipe is not None and inp.name in recipe.inputs:
            out[inp.name] = list(recipe.inputs[inp.name].shape)
            continue
        raw = value_shape(inp)
        if raw is None:
            continue
        out[inp.name] = [d if d is not None else f"{inp.name}.{axis}" for axis, d in enumerate(raw)]
    return out


def resolve_dims(model: onnx.ModelProto, recipe: Recipe | None, overrides: Overrides = NO_OVERRIDES) -> DimPlan:
    """Every symbolic dim's (min, opt, max): from ``--shapes``/``--*-shapes`` (matched to the input
    shapes' dim names), else the recipe's ``dims``, else guessed (min 1, opt = max = verify's default:
    2 for a batch dim, 16 otherwise); a dim named by an expression over others (``past_sequence_length
    + 1``) that nothing gave is derived from their min / opt / max. A shape that names no input, has the
    wrong rank, changes a fixed axis or gives one dim two values is an InputError (exit 2)."""
    spelled = spelled_shapes(model, recipe)
    ranges: dict[str, tuple[int, int, int]] = {}
    sources: dict[str, str] = {}
    if recipe is not None:
        for name, d in recipe.dims.items():
            ranges[name], sources[name] = (d.min, d.opt, d.max), "recipe"
    given: dict[str, tuple[str, tuple[int, int, int]]] = {}
    for name, (lo, mid, hi) in overrides.shapes.items():
        if name not in spelled:
            raise InputError(f"--shapes: {name!r} is not an input of the model (its inputs: {', '.join(spelled)})")
        shape = spelled[name]
        if len(mid) != len(shape):
            raise InputError(f"--shapes {name}: {len(mid)} dims given, but the input has rank {len(shape)} ({shape})")
        for axis, dim in enumerate(shape):
            r = (lo[axis], mid[axis], hi[axis])
            if isinstance(dim, int):
                if r != (dim, dim, dim):
                    raise InputError(f"--shapes {name}: axis {axis} is fixed to {dim} by the model, got "
                                     f"{_range_text(r)}")
                continue
            if dim in given and given[dim][1] != r:
                other, prev = given[dim]
                raise InputError(f"--shapes: dim {dim!r} is {_range_text(prev)} for {other!r} but "
                                 f"{_range_text(r)} for {name!r}")
            given[dim] = (name, r)
            ranges[dim], sources[dim] = r, "command line"
    derived = derived_dims([*ranges, *(d for shape in spelled.values() for d in shape if isinstance(d, str))])
    for shape in spelled.values():
        for axis, dim in enumerate(shape):
            if isinstance(dim, str) and dim not in ranges and dim not in derived:
                value = DEFAULT_BATCH if axis == 0 or is_batch_name(dim) else DEFAULT_DIM
                ranges[dim], sources[dim] = (1, value, value), "guessed"
    for dim, (evaluate, names) in derived.items():  # from the dims it reads: min, opt and max each
        if dim not in ranges:
            lo, mid, hi = (max(1, evaluate({n: ranges[n][k] for n in names})) for k in range(3))
            ranges[dim], sources[dim] = (min(lo, mid), mid, max(hi, mid)), "derived"
    return DimPlan(ranges, sources, spelled)


def _range_text(r: tuple[int, int, int]) -> str:
    return str(r[1]) if r[0] == r[1] == r[2] else f"{r[0]}..{r[2]} (opt {r[1]})"


def model_header(path: str | os.PathLike) -> onnx.ModelProto:
    """The model's graph without its weights (cheap: external data stays on disk)."""
    from ..ir import load_model

    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001 - load_model names what is wrong with the file
        return load_model(path)


def options_record(recipe: Recipe | None, overrides: Overrides, dims: DimPlan | None = None) -> dict[str, Any]:
    """What a run used and where each value came from, for the reports and the manifest."""
    def src(given: bool, in_recipe: bool) -> str:
        return "command line" if given else "recipe" if in_recipe else "default"

    rec: dict[str, Any] = {"recipe": recipe_label(recipe)}
    if dims is not None:
        rec["dims"] = {k: {"min": v[0], "opt": v[1], "max": v[2], "source": dims.sources[k]}
                       for k, v in dims.ranges.items()}
    if overrides.shapes:
        rec["shapes"] = {k: {"min": list(v[0]), "opt": list(v[1]), "max": list(v[2])}
                         for k, v in overrides.shapes.items()}
    p = precision_options(recipe, overrides)
    rec["precision"] = {"mode": p.mode, "source": src(overrides.precision is not None, recipe is not None),
                        "keep_fp32": list(p.keep_fp32),
                        "keep_fp32_source": src(bool(overrides.keep_fp32), bool(recipe and recipe.precision.keep_fp32))}
    if p.mode == "fp8":
        c = calibration_settings(recipe)
        rec["precision"].update({"fp8_base": p.fp8_base, "fp8_exclude": list(p.fp8_exclude),
                                 "fp8_attention": p.fp8_attention,
                                 "fp8_attention_target": arch_name(p.target_arch) if p.target_arch is not None else None,
                                 "fp8_attention_target_source": src(overrides.target is not None, recipe is not None
                                                                     and "target" in recipe.model_fields_set),
                                 "calibration": {
            "method": p.calibrator, "percentile": p.percentile if p.calibrator == "percentile" else None,
            "batches": c.batches, "seed": None if c.npz is not None else c.seed, "npz": c.npz_label or None}})
    given = overrides.tolerances_given()
    rec["tolerances"] = {"atol": overrides.atol, "rtol": overrides.rtol, "outputs_atol": dict(overrides.output_atol),
                         "outputs_rtol": dict(overrides.output_rtol),
                         "source": "command line over recipe" if given and recipe is not None else
                         src(given, recipe is not None)}
    return rec


@dataclass(frozen=True)
class PerNodeSettings:
    """Whether convert's onnxruntime check also runs the per-node comparison, its chunk size, and
    where the switch came from ("command line", "recipe" or "default")."""

    enabled: bool
    chunk_size: int
    source: str

    def to_dict(self) -> dict[str, Any]:
        return {"per_node": self.enabled, "chunk_size": self.chunk_size, "source": self.source}


def per_node_settings(recipe: Recipe | None, overrides: Overrides = NO_OVERRIDES) -> PerNodeSettings:
    from ..verify.per_node import DEFAULT_CHUNK_SIZE

    chunk = recipe.verify.chunk_size if recipe is not None else DEFAULT_CHUNK_SIZE
    if overrides.per_node is not None:
        return PerNodeSettings(overrides.per_node, chunk, "command line")
    if recipe is not None and "per_node" in recipe.verify.model_fields_set:
        return PerNodeSettings(recipe.verify.per_node, chunk, "recipe")
    return PerNodeSettings(False, chunk, "default")


# ------------------------------------------------------------------------------------------------
# fuse
# ------------------------------------------------------------------------------------------------
def enabled_families(recipe: Recipe | None) -> list[str]:
    from ..fusions import available_families

    avail = available_families()
    if recipe is None:
        return avail
    on = set(recipe.fusions.enabled())
    return [f for f in avail if f in on]


def analysis_dims(model: onnx.ModelProto, recipe: Recipe | None,
                  overrides: Overrides = NO_OVERRIDES) -> tuple[dict[str, int], str]:
    """Symbolic dims for size estimates: the command line's opt shapes, the recipe's opt values, else
    the defaults."""
    if overrides.shapes:
        plan = resolve_dims(model, recipe, overrides)
        return concrete_dims(model, plan.opt()), f"{plan.source()} opt shapes"
    dims = concrete_dims(model, recipe.opt_dims() if recipe is not None else None)
    if recipe is not None and recipe.dims:
        return dims, "recipe opt shapes"
    return dims, f"defaults: batch {DEFAULT_BATCH}, other dims {DEFAULT_DIM}"


def fusion_options(recipe: Recipe | None) -> FusionOptions:
    if recipe is None:
        return FusionOptions()
    f = recipe.fusions
    if f.disabled_rules:
        from ..fusions import available_families, family_rules

        known = [r.id for fam in available_families() for r in family_rules(fam)]
        unknown = [r for r in f.disabled_rules if r not in known]
        if unknown:
            raise InputError(f"recipe {recipe_label(recipe)}: field 'fusions.disabled_rules': unknown rule id(s) "
                             f"{', '.join(unknown)} (rules: {', '.join(known)})")
    return FusionOptions(attention_full_mask=f.attention_full_mask, disabled_rules=frozenset(f.disabled_rules),
                         skip_nodes=tuple(f.skip_nodes))


# ------------------------------------------------------------------------------------------------
# verify / precision / build
# ------------------------------------------------------------------------------------------------
def verify_options(recipe: Recipe | None, overrides: Overrides = NO_OVERRIDES,
                   model: onnx.ModelProto | None = None) -> VerifyOptions:
    """The recipe's inputs (shapes at the opt dims, npz paths resolved), opt dims and tolerances, with
    the command line's opt shapes and tolerances over them (`model`: needed for command-line shapes)."""
    plan = resolve_dims(model, recipe, overrides) if overrides.shapes and model is not None else None
    opt = plan.opt() if plan is not None else recipe.opt_dims() if recipe is not None else {}
    inputs = {}
    for name, spec in (recipe.inputs if recipe is not None else {}).items():
        inputs[name] = FeedSpec(
            dtype=spec.dtype, shape=tuple(dim_value(d, opt) for d in spec.shape), kind=spec.kind,
            range=(spec.range[0], spec.range[1]) if spec.range is not None else None,
            padding=spec.padding or "right",
            npz=recipe.resolve_path(spec.npz) if spec.npz is not None else None,
            npz_label=str(spec.npz) if spec.npz is not None else "",
        )
    if plan is not None:  # a command-line shape for an input the recipe does not describe
        inputs.update(_shaped_inputs(model, overrides, exclude=set(inputs)))
    tolerances = {}
    for mode in DEFAULT_TOLERANCES:
        if recipe is None:
            table = Tolerances(*DEFAULT_TOLERANCES[mode])
        else:
            named = {o for t in recipe.tolerance_tables(mode) for o in t.outputs}
            table = Tolerances(*recipe.tolerance(None, mode), outputs={o: recipe.tolerance(o, mode) for o in named})
        tolerances[mode] = _override_tolerances(table, overrides)
    if recipe is None:
        return VerifyOptions(inputs=inputs, dims=opt, tolerances=tolerances)
    fp8 = recipe.verify.fp8
    return VerifyOptions(inputs=inputs, dims=opt, tolerances=tolerances,
                         agreement={"fp8": Agreement(fp8.min_cosine, fp8.min_top1)})


def _shaped_inputs(model: onnx.ModelProto, overrides: Overrides, exclude: set[str]) -> dict[str, FeedSpec]:
    out = {}
    for inp in model.graph.input:
        if inp.name not in overrides.shapes or inp.name in exclude:
            continue
        try:
            dtype = onnx.helper.tensor_dtype_to_np_dtype(inp.type.tensor_type.elem_type).name
        except Exception:  # noqa: BLE001 - an element type NumPy lacks: verify's input planning says so
            continue
        name = {"bool_": "bool", "bool": "bool"}.get(dtype, dtype)
        out[inp.name] = FeedSpec(dtype=name, shape=tuple(overrides.shapes[inp.name][1]))
    return out


def _override_tolerances(table: Tolerances, overrides: Overrides) -> Tolerances:
    """Command-line tolerances over a recipe's (or the defaults): ``--atol X`` replaces every
    output's atol; ``--atol out:X`` that one output's (likewise rtol)."""
    if not overrides.tolerances_given():
        return table
    a = overrides.atol if overrides.atol is not None else table.atol
    r = overrides.rtol if overrides.rtol is not None else table.rtol
    outputs = {}
    for name, (oa, orr) in table.outputs.items():
        outputs[name] = (overrides.atol if overrides.atol is not None else oa,
                         overrides.rtol if overrides.rtol is not None else orr)
    for name in set(overrides.output_atol) | set(overrides.output_rtol):
        oa, orr = outputs.get(name, (a, r))
        outputs[name] = (overrides.output_atol.get(name, oa), overrides.output_rtol.get(name, orr))
    return Tolerances(a, r, outputs=outputs)


def precision_options(recipe: Recipe | None, overrides: Overrides = NO_OVERRIDES) -> PrecisionOptions:
    """The recipe's precision section; ``--fp16``/``--bf16``/``--fp8`` and ``--keep-fp32`` replace its mode
    and patterns. The target arch is ``convert --target``, else the recipe's ``target.arch`` (None
    without a recipe: unknown)."""
    p = recipe.precision if recipe is not None else None
    mode = overrides.precision or (p.mode if p is not None else "fp32")
    keep = overrides.keep_fp32 or (tuple(p.keep_fp32) if p is not None else ())
    arch = overrides.target or (recipe.target.arch if recipe is not None else None)
    target_arch = parse_arch(arch) if arch is not None else None
    if p is None:
        return PrecisionOptions(mode=mode, keep_fp32=tuple(keep), target_arch=target_arch)
    c = p.calibration
    return PrecisionOptions(mode=mode, keep_fp32=tuple(keep), io_dtype=p.io_dtype, fp8_base=p.fp8_base,
                            calibrator=c.method, percentile=c.percentile, scale_steps=c.scale_steps,
                            fp8_exclude=tuple(p.fp8_exclude),
                            fp8_attention=p.fp8_attention, target_arch=target_arch)


@dataclass(frozen=True)
class CalibrationSettings:
    """Where an fp8 run's calibration batches come from: `batches` generated with `seed` (verify's
    input generator), or the first `batches` of `npz` (resolved path; None: generated)."""

    batches: int = 8
    seed: int = 1
    npz: Path | None = None
    npz_label: str = ""


def calibration_settings(recipe: Recipe | None) -> CalibrationSettings:
    if recipe is None:
        return CalibrationSettings()
    c = recipe.precision.calibration
    return CalibrationSettings(c.batches, c.seed, recipe.resolve_path(c.npz) if c.npz is not None else None,
                               str(c.npz) if c.npz is not None else "")


def build_profile(recipe: Recipe | None, model_path: Path | None = None,
                  overrides: Overrides = NO_OVERRIDES) -> tuple[BuildProfile, DimPlan | None]:
    """The optimization profile: every symbolic dim's min/opt/max (:func:`resolve_dims`: command
    line, recipe, else guessed: min 1, opt = max = verify's default) and the input shapes spelled in
    those names; with the dim plan (None: no model to read)."""
    if model_path is None:
        if recipe is not None and recipe.dims:
            dims = {k: (v.min, v.opt, v.max) for k, v in recipe.dims.items()}
            shapes = {k: list(v.shape) for k, v in recipe.inputs.items()} or None
            return BuildProfile(dims, shapes, "recipe min/opt/max"), None
        return BuildProfile({}, None, "static shapes"), None
    plan = resolve_dims(model_header(model_path), recipe, overrides)
    kinds = set(plan.sources.values())
    source = ("recipe min/opt/max" if kinds == {"recipe"} else
              "defaults (no recipe): min 1, opt = max = verify's default" if kinds == {"guessed"} else plan.source())
    return BuildProfile(dict(plan.ranges), dict(plan.input_shapes) or None, source), plan
