"""Stage wiring: the functions the CLI calls, one per command. The CLI parses and prints; this module runs.

Stages and their artifacts (data flows one way)::

    model (file, or exported from a recipe)  --fuse-->    fused .onnx + fusion_report.{json,md}
    original + candidate                     --verify-->  VerifyResult (per-output errors)
    fused .onnx                              --build-->   TensorRT engine + build report
    model or recipe                          --convert--> fuse -> precision -> verify -> build, one directory

Every stage function takes its inputs, options and a `status` callback (progress text) and returns
a result object; the CLI commands only parse, call one of these and print. `build` and `convert`
live in :mod:`optfuse.trt.stages` (TensorRT is optional) and are re-exported here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from .errors import InputError, OptfuseError, VerificationError
from .recipe import Recipe, load_recipe

Status = Callable[[str], None]

DEMO_DIR = Path("optfuse-demo")
EXPORT_HINT = "pip install -e '.[export]' torch==2.13.0"


def _noop(_: str) -> None:
    pass


# ------------------------------------------------------------------------------------------------
# Inputs: recipe, model
# ------------------------------------------------------------------------------------------------
def read_recipe(path: str | os.PathLike | None) -> Recipe | None:
    return None if path is None else load_recipe(path)


def resolve_model(model: str | os.PathLike | None, recipe: Recipe | None, workdir: Path | None = None,
                  status: Status = _noop) -> Path:
    """The model file to work on: the argument, else the recipe's path, else exported per the recipe."""
    if model is not None:
        return Path(model)
    if recipe is None:
        raise InputError("no model given: pass MODEL.onnx or a recipe (-r) that names one")
    if recipe.model.path is not None:
        return recipe.resolve_path(recipe.model.path)
    spec = recipe.model.export
    out_dir = Path(workdir) if workdir is not None else Path.cwd()
    dest = out_dir / f"{recipe.name}.onnx"
    status(f"exporting {spec.family} ({spec.exporter}, attn={spec.attn})")
    return export_model(spec.family, dest, exporter=spec.exporter, attn=spec.attn, opset=spec.opset, config=spec.config)


def export_model(family: str, dest: Path, exporter: str = "dynamo", attn: str = "sdpa", opset: int | None = None,
                 config: dict | None = None) -> Path:
    """Export a tiny model of `family` through optfuse.models (needs torch + transformers)."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        raise InputError(f"exporting a model needs torch and transformers ({exc.name} is missing): {EXPORT_HINT}") from None
    try:
        from . import models
    except ModuleNotFoundError as exc:
        if exc.name == "optfuse.models":
            raise InputError("this optfuse has no model exporter (optfuse.models)") from None
        raise InputError(f"exporting a model needs {exc.name}: {EXPORT_HINT}") from None
    if family not in models.FAMILIES:
        raise InputError(f"unknown model family {family!r}; known: {', '.join(models.FAMILIES)}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        return Path(models.export(family, dest, exporter=exporter, attn=attn, opset=opset, **(config or {})))
    except models.ExportError as exc:
        raise OptfuseError(str(exc)) from None
    except ValueError as exc:
        raise InputError(str(exc)) from None


def enabled_families(recipe: Recipe | None) -> list[str]:
    from .fusions import available_families

    avail = available_families()
    if recipe is None:
        return avail
    on = set(recipe.fusions.enabled())
    return [f for f in avail if f in on]


def analysis_dims(model: onnx.ModelProto, recipe: Recipe | None) -> tuple[dict[str, int], str]:
    """Symbolic dims for size estimates: the recipe's opt values, else verify's defaults."""
    from .verify import DEFAULT_BATCH, DEFAULT_DIM, concrete_dims

    dims = concrete_dims(model, recipe)
    if recipe is not None and recipe.dims:
        return dims, "recipe opt shapes"
    return dims, f"defaults: batch {DEFAULT_BATCH}, other dims {DEFAULT_DIM}"


def load_checked(path: Path) -> onnx.ModelProto:
    """load_model plus a structural check: a graph that does not hold together is bad input (exit 2).

    Not onnx.checker: it rejects models onnxruntime runs (outputs without shapes, unsorted nodes).
    """
    from .ir import load_model

    proto = load_model(path)
    problem = graph_problem(proto.graph)
    if problem:
        raise InputError(f"{path} is not a valid ONNX graph: {problem}")
    return proto


def graph_problem(graph: onnx.GraphProto) -> str | None:
    """The first structural defect of a top-level graph, or None: dangling inputs, tensors produced
    twice, graph outputs nothing produces, standard-domain ops ONNX does not define."""
    known = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    known |= {t.name for t in graph.sparse_initializer}
    produced: set[str] = set()
    for n in graph.node:
        for o in n.output:
            if o and o in produced:
                return f"tensor {o!r} is produced twice (node {n.name or n.op_type})"
            produced.add(o)
    available = known | produced
    for n in graph.node:
        for i in n.input:
            if i not in available:
                return f"node {n.name or n.op_type!r} ({n.op_type}) reads {i!r}, which no node, input or initializer provides"
        if n.domain in ("", "ai.onnx", "ai.onnx.ml") and not onnx.defs.has(n.op_type, n.domain):
            return f"node {n.name or n.op_type!r} uses {n.op_type!r}, which is not an ONNX operator"
    for o in graph.output:
        if o.name not in available:
            return f"graph output {o.name!r} is not produced by any node"
    return None


def _options(recipe: Recipe | None):
    from .pattern import FusionOptions

    if recipe is None:
        return FusionOptions()
    return FusionOptions(attention_full_mask=recipe.fusions.attention_full_mask)


# ------------------------------------------------------------------------------------------------
# inspect / fuse
# ------------------------------------------------------------------------------------------------
@dataclass
class InspectOutcome:
    model: Path
    report: dict
    result: object  # FusionResult


def inspect(model: str | os.PathLike | None, recipe: Recipe | None = None, status: Status = _noop) -> InspectOutcome:
    """What would fuse and what would not (and why); writes nothing."""
    import tempfile

    from .estimate import estimate_traffic
    from .fusions import fuse_model
    from .report import build_report

    with tempfile.TemporaryDirectory(prefix="optfuse-inspect-") as tmp:  # an export lands here, then goes
        path = resolve_model(model, recipe, workdir=Path(tmp), status=status)
        status(f"loading {path}")
        proto = load_checked(path)
        if model is None and recipe is not None and recipe.model.export is not None:
            e = recipe.model.export
            path = Path(f"<export {e.family} {e.exporter} attn={e.attn}>")
    dims, dims_source = analysis_dims(proto, recipe)
    families = enabled_families(recipe)
    status("sanitizing and matching")
    fused, result = fuse_model(proto, dims=dims, families=families, options=_options(recipe))
    report = build_report(result, estimate=estimate_traffic(fused, result), model=str(path),
                          recipe=_recipe_label(recipe), dims=dims, dims_source=dims_source, families=families)
    return InspectOutcome(path, report, result)


@dataclass
class FuseOutcome:
    model: Path
    output: Path
    report: dict
    report_paths: tuple[Path, Path]
    result: object  # FusionResult
    verification: object | None = None  # VerifyResult when asked


def default_output(model: Path) -> Path:
    return model.with_name(f"{model.stem}.fused.onnx")


def fuse(model: str | os.PathLike | None, output: str | os.PathLike | None = None, recipe: Recipe | None = None,
         verify_after: bool = False, iterations: int | None = None, seed: int = 0,
         workdir: Path | None = None, status: Status = _noop) -> FuseOutcome:
    """load -> sanitize -> match -> rewrite -> save (atomic) -> report; optionally verify the result.

    Nothing is written until the fused model exists in memory, so bad input leaves no file behind.
    """
    from .estimate import estimate_traffic
    from .fusions import fuse_model
    from .ir import save_model
    from .report import build_report, write_report

    path = resolve_model(model, recipe, workdir=workdir, status=status)
    out = Path(output) if output is not None else default_output(path)
    _check_output(path, out)
    status(f"loading {path}")
    proto = load_checked(path)
    dims, dims_source = analysis_dims(proto, recipe)
    families = enabled_families(recipe)
    status("sanitizing, matching, rewriting")
    fused, result = fuse_model(proto, dims=dims, families=families, options=_options(recipe))
    status(f"writing {out}")
    try:
        save_model(fused, out)
    except OSError as exc:
        raise InputError(f"cannot write {out}: {exc.strerror or exc}") from None
    verification = None
    if verify_after:
        status("verifying")
        verification = verify(path, out, recipe, iterations=iterations, seed=seed)
    report = build_report(result, estimate=estimate_traffic(fused, result), model=str(path), fused_model=str(out),
                          recipe=_recipe_label(recipe), dims=dims, dims_source=dims_source, families=families,
                          verification=verification.to_dict() if verification is not None else None)
    try:
        paths = write_report(report, out.parent)
    except OSError as exc:
        raise InputError(f"cannot write the fusion report next to {out}: {exc.strerror or exc}") from None
    return FuseOutcome(path, out, report, paths, result, verification)


def _check_output(model: Path, out: Path) -> None:
    if out.exists() and out.is_dir():
        raise InputError(f"output {out} is a directory; give a file name such as {out / 'model.fused.onnx'}")
    try:
        same = out.exists() and model.exists() and os.path.samefile(model, out)
    except OSError:
        same = False
    if same:
        raise InputError(f"output {out} is the input model; choose another file name")


def _recipe_label(recipe: Recipe | None) -> str | None:
    if recipe is None:
        return None
    return str(recipe.source) if recipe.source is not None else recipe.name


# ------------------------------------------------------------------------------------------------
# verify
# ------------------------------------------------------------------------------------------------
def verify(original: str | os.PathLike, candidate: str | os.PathLike, recipe: Recipe | None = None,
           iterations: int | None = None, seed: int = 0, atol: float | None = None, rtol: float | None = None,
           status: Status = _noop):
    from .verify import DEFAULT_ITERATIONS
    from .verify import verify as run_verify

    n = iterations or DEFAULT_ITERATIONS
    return run_verify(original, candidate, recipe, iterations=n, seed=seed, atol=atol, rtol=rtol,
                      on_iteration=lambda i: status(f"running iteration {i + 1}/{n}"))


# ------------------------------------------------------------------------------------------------
# demo
# ------------------------------------------------------------------------------------------------
# The tiny BERT: the demo shows every fusion of an encoder (LayerNorm, SkipLayerNorm, FlashAttention).
DEMO_RECIPE = {
    "name": "bert",
    "model": {"export": {"family": "bert", "exporter": "dynamo", "attn": "sdpa"}},
    "dims": {"batch": {"min": 1, "opt": 2, "max": 8}, "sequence": {"min": 1, "opt": 16, "max": 128}},
}


@dataclass
class DemoOutcome:
    directory: Path
    exported: Path
    fuse: FuseOutcome
    notes: list[str] = field(default_factory=list)


def demo(directory: str | os.PathLike = DEMO_DIR, status: Status = _noop) -> DemoOutcome:
    """Export the tiny BERT, fuse it, verify it; everything goes to `directory`."""
    from .recipe import recipe_from_dict

    directory = Path(directory)
    recipe = recipe_from_dict(DEMO_RECIPE, label="demo recipe")
    exported = resolve_model(None, recipe, workdir=directory, status=status)
    outcome = fuse(exported, directory / f"{exported.stem}.fused.onnx", recipe, verify_after=True, status=status)
    return DemoOutcome(directory, exported, outcome)


# ------------------------------------------------------------------------------------------------
# build / convert (optfuse.trt.stages; imported on use: TensorRT is optional)
# ------------------------------------------------------------------------------------------------
def build(*args, **kwargs):
    """Fused ONNX -> TensorRT engine; see :func:`optfuse.trt.stages.build`."""
    from .trt import stages

    return stages.build(*args, **kwargs)


def convert(*args, **kwargs):
    """fuse -> precision -> verify -> build in one directory; see :func:`optfuse.trt.stages.convert`."""
    from .trt import stages

    return stages.convert(*args, **kwargs)


def raise_if_failed(result) -> None:
    """VerificationError (exit 1) naming the outputs out of tolerance."""
    if result is None or result.passed:
        return
    bad = result.failed
    names = ", ".join(o.name for o in bad[:5]) + (" ..." if len(bad) > 5 else "")
    raise VerificationError(f"verification failed: {len(bad)} of {len(result.outputs)} output(s) out of tolerance ({names})")
