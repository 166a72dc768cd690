"""Stage functions behind ``optfuse build`` and ``optfuse convert`` (re-exported by optfuse.pipeline).

``convert`` runs the whole pipeline into one directory::

    MODEL (or the recipe's export) -> fuse -> <name>.fused.onnx, fusion_report.{json,md}
      -> precision -> <name>.<mode>.onnx, precision_report.json
      -> verify (FP32 original vs fused+precision, both onnxruntime CPU)
      -> build (when a TensorRT backend is installed) -> <name>.plan, build_report.{json,md}, build.log
      -> engine check (polygraphy TrtRunner, only when the engine can run on this GPU)
      -> accuracy_report.{json,md}, report.md (every step: ran / skipped and why)

It exits 0 when everything it ran passed; a step it could not run is reported, not failed.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import BuildError, InputError, OptfuseError, VerificationError

Status = Callable[[str], None]


def _noop(_: str) -> None:
    pass


# ------------------------------------------------------------------------------------------------
# build
# ------------------------------------------------------------------------------------------------
def recipe_dims(recipe, model_path: Path | None = None) -> tuple[dict[str, Any], dict[str, list] | None, str]:
    """(dims as name -> (min, opt, max), input shapes from the recipe, where they came from)."""
    if recipe is not None and recipe.dims:
        dims = {k: (v.min, v.opt, v.max) for k, v in recipe.dims.items()}
        shapes = {k: list(v.shape) for k, v in recipe.inputs.items()} or None
        return dims, shapes, "recipe min/opt/max"
    if model_path is None:
        return {}, None, "static shapes"
    # No recipe: every symbolic dim gets min 1 and opt = max = verify's default for it.
    import onnx

    from ..verify import concrete_dims

    m = onnx.load(str(model_path), load_external_data=False)
    dims = {k: (1, int(v), int(v)) for k, v in concrete_dims(m, None).items()}
    return dims, None, "defaults (no recipe): min 1, opt = max = verify's default"


@dataclass
class BuildOutcome:
    model: Path
    engine: Path
    report: Any  # BuildReport
    report_paths: tuple[Path, Path]
    notes: list[str] = field(default_factory=list)


def build(model: str | os.PathLike, output: str | os.PathLike | None = None, recipe=None, *,
          target: str | None = None, backend: str | None = None, timing_cache: str | os.PathLike | None = None,
          log_path: str | os.PathLike | None = None, use_recipe_target: bool = True,
          status: Status = _noop) -> BuildOutcome:
    """FUSED.onnx -> engine + build_report.{json,md} + build log next to the engine."""
    from .build import build_engine_file

    model = Path(model)
    if not model.is_file():
        raise InputError(f"model {model}: file not found")
    engine = Path(output) if output is not None else model.with_suffix(".plan")
    if engine.exists() and engine.is_dir():
        raise InputError(f"output {engine} is a directory; give a file name such as {engine / 'model.plan'}")
    backend = backend or (recipe.target.backend if recipe is not None else None)
    if target is None and use_recipe_target and recipe is not None:
        target = recipe.target.arch
    dims, shapes, source = recipe_dims(recipe, model)
    out_dir = engine.parent
    status(f"building {engine.name} ({backend or 'auto'} backend)")
    report = build_engine_file(
        model, engine, dims=dims, input_shapes=shapes, target=target, backend=backend,
        timing_cache=Path(timing_cache) if timing_cache else out_dir / "timing.cache",
        log_path=Path(log_path) if log_path else out_dir / "build.log",
    )
    paths = write_build_report(report, out_dir)
    return BuildOutcome(model, engine, report, paths, [f"profile dims: {source}"])


def write_build_report(report, directory: Path) -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    j, m = directory / "build_report.json", directory / "build_report.md"
    report.save(j)
    m.write_text(report.to_markdown())
    return j, m


# ------------------------------------------------------------------------------------------------
# convert
# ------------------------------------------------------------------------------------------------
@dataclass
class Step:
    name: str
    state: str  # ok | failed | skipped
    detail: str = ""
    artifacts: list[str] = field(default_factory=list)


@dataclass
class ConvertOutcome:
    outdir: Path
    steps: list[Step] = field(default_factory=list)
    summary: Path | None = None
    accuracy: dict = field(default_factory=dict)
    build_report: Any = None

    @property
    def passed(self) -> bool:
        return all(s.state != "failed" for s in self.steps)

    def step(self, name: str) -> Step | None:
        return next((s for s in self.steps if s.name == name), None)


def _rtx_target_for(recipe_target: str | None, explicit: bool, be) -> tuple[str | None, str]:
    """RTX cannot build every arch; a recipe's arch it lacks falls back to RTX's defaults (an
    explicit --target does not: that is an error, from build)."""
    from ..kernels.target import parse_arch

    if recipe_target is None or explicit or not be.is_rtx:
        return recipe_target, ""
    cc = parse_arch(recipe_target)
    if cc in be.compute_capabilities:
        return recipe_target, ""
    caps = ", ".join(f"sm_{c}" for c in (80, 86, 89, 120) if c in be.compute_capabilities)
    return None, (f"the recipe targets {recipe_target}, which TensorRT-RTX cannot build for; the RTX engine targets "
                  f"its defaults ({caps}) and validates the build path; a {recipe_target} engine needs TensorRT on that GPU")


def convert(model: str | os.PathLike | None, recipe, outdir: str | os.PathLike, *, target: str | None = None,
            backend: str | None = None, iterations: int | None = None, seed: int = 0,
            skip_build: bool = False, status: Status = _noop) -> ConvertOutcome:
    """The whole pipeline (see module doc). Raises VerificationError (exit 1) / BuildError (exit 2)
    after writing every report when a step that ran failed."""
    from .. import pipeline
    from ..ir import load_model, save_model
    from ..precision import convert_precision
    from . import compat
    from .run import polygraphy_env

    if recipe is None:
        raise InputError("convert needs a recipe (-r RECIPE.yaml): it gives the dims, precision and tolerances")
    outdir = Path(outdir)
    if outdir.exists() and not outdir.is_dir():
        raise InputError(f"output directory {outdir} is a file")
    outdir.mkdir(parents=True, exist_ok=True)
    res = ConvertOutcome(outdir)
    want_backend = backend or recipe.target.backend
    resolved = compat.resolve_backend(want_backend)  # InputError for an unknown name
    if resolved is not None:
        polygraphy_env(resolved)  # before verify imports polygraphy

    # 1. fuse
    path = pipeline.resolve_model(model, recipe, workdir=outdir, status=status)
    name = path.stem
    fused_path = outdir / f"{name}.fused.onnx"
    fuse = pipeline.fuse(path, fused_path, recipe, workdir=outdir, status=status)
    n_fused = len(fuse.report.get("fusions", []))
    res.steps.append(Step("fuse", "ok", f"{n_fused} fused node(s); {len(fuse.report.get('rejected', []))} rejected",
                          [str(fused_path), *map(str, fuse.report_paths)]))

    # 2. precision
    mode = recipe.precision.mode
    status(f"precision: {mode}")
    fused = load_model(fused_path)
    prec_model, prec = convert_precision(fused, mode, keep_fp32=recipe.precision.keep_fp32,
                                         io_dtype=recipe.precision.io_dtype)
    prec_path = outdir / f"{name}.{mode}.onnx"
    if mode == "fp32":
        shutil.copyfile(fused_path, prec_path)
    else:
        save_model(prec_model, prec_path)
    (outdir / "precision_report.json").write_text(json.dumps(prec.to_dict(), indent=1))
    res.steps.append(Step("precision", "ok", f"{mode}; {prec.casts_added} Cast(s) added; kept FP32: "
                          f"{', '.join(prec.keep_fp32_ops) or 'none'}", [str(prec_path), str(outdir / 'precision_report.json')]))

    # 3. verify in onnxruntime
    status("verifying in onnxruntime")
    try:
        v = pipeline.verify(path, prec_path, recipe, iterations=iterations, seed=seed, status=status)
        res.accuracy["onnxruntime"] = v.to_dict()
        res.steps.append(Step("verify (onnxruntime)", "ok" if v.passed else "failed",
                              _verify_line(v), [str(outdir / "accuracy_report.md")]))
    except VerificationError as exc:
        res.accuracy["onnxruntime"] = {"passed": False, "error": str(exc)}
        res.steps.append(Step("verify (onnxruntime)", "failed", str(exc)))

    # 4. build
    build_error: OptfuseError | None = None
    engine_path = outdir / f"{name}.plan"
    if skip_build:
        res.steps.append(Step("build", "skipped", "--skip-build"))
    elif resolved is None:
        res.steps.append(Step("build", "skipped", "no TensorRT backend is installed (pip install 'optfuse[trt-rtx]' "
                              "for CPU-only TensorRT-RTX builds, or tensorrt on a GPU machine)"))
    else:
        be = compat.load(resolved)
        explicit = target is not None
        tgt, note = _rtx_target_for(target or recipe.target.arch, explicit, be)
        if not be.is_rtx and not explicit:
            tgt = None  # standard TensorRT builds for the GPU present; build checks it against the recipe
        try:
            b = build(prec_path, engine_path, recipe, target=tgt, backend=resolved, use_recipe_target=False,
                      status=status)
            res.build_report = b.report
            detail = (f"{be.label}, target {b.report.target}: {b.report.layers_by_kind.get('plugin', 0)} plugin / "
                      f"{b.report.layers_by_kind.get('native', 0)} native layers, engine {b.report.engine_bytes} B")
            res.steps.append(Step("build", "ok", detail + (f"; note: {note}" if note else ""),
                                  [str(engine_path), *map(str, b.report_paths), str(outdir / "build.log")]))
        except (BuildError, InputError) as exc:
            build_error = exc
            res.steps.append(Step("build", "failed", str(exc)))

    # 5. engine accuracy
    rep = res.build_report
    if rep is None:
        res.steps.append(Step("verify (engine)", "skipped", "no engine was built"))
    elif not rep.runnable_here:
        res.accuracy["engine"] = {"executed": False, "reason": rep.not_runnable_reason}
        res.steps.append(Step("verify (engine)", "skipped", f"engine not executed: {rep.not_runnable_reason}"))
    else:
        status("running the engine")
        try:
            from .run import verify_engine

            ve = verify_engine(path, engine_path, recipe, backend=resolved, iterations=iterations or 3, seed=seed)
            res.accuracy["engine"] = ve.to_dict()
            res.steps.append(Step("verify (engine)", "ok" if ve.passed else "failed", _verify_line(ve)))
        except Exception as exc:  # a runtime failure of the engine is a failed check, reported
            res.accuracy["engine"] = {"executed": False, "error": f"{type(exc).__name__}: {exc}"}
            res.steps.append(Step("verify (engine)", "failed", f"{type(exc).__name__}: {exc}"))

    # 6. reports
    write_accuracy_report(res.accuracy, outdir)
    res.summary = write_summary(res, recipe, path, prec, fuse.report)
    if build_error is not None:
        raise type(build_error)(str(build_error))
    failed = [s for s in res.steps if s.state == "failed"]
    if failed:
        raise VerificationError("; ".join(f"{s.name}: {s.detail.splitlines()[0] if s.detail else 'failed'}" for s in failed)
                                + f" (see {res.summary})")
    return res


def _verify_line(v) -> str:
    worst = max(v.outputs, key=lambda o: o.max_abs / max(o.atol + o.rtol, 1e-30), default=None)
    if worst is None:
        return "no outputs compared"
    return (f"{sum(o.passed for o in v.outputs)}/{len(v.outputs)} outputs within tolerance; worst {worst.name}: "
            f"max abs {worst.max_abs:.3g} (atol {worst.atol:g}, rtol {worst.rtol:g})")


def _accuracy_md(acc: dict) -> str:
    lines = ["# Accuracy", ""]
    for label, title in (("onnxruntime", "FP32 original vs fused + precision model (onnxruntime CPU)"),
                         ("engine", "FP32 original (onnxruntime) vs TensorRT engine (polygraphy TrtRunner)")):
        d = acc.get(label)
        lines += [f"## {title}", ""]
        if d is None:
            lines += ["not run", ""]
            continue
        if "outputs" not in d:
            lines += [f"not executed: {d.get('reason') or d.get('error')}", ""]
            continue
        lines += [f"{d['iterations']} iteration(s), seed {d['seed']}: **{'pass' if d['passed'] else 'FAIL'}**", "",
                  "| output | max abs | max rel | mean abs | atol | rtol | result |", "|---|---|---|---|---|---|---|"]
        for o in d["outputs"]:
            lines.append(f"| {o['name']} | {o['max_abs']:.3g} | {o['max_rel']:.3g} | {o['mean_abs']:.3g} | "
                         f"{o['atol']:g} | {o['rtol']:g} | {'pass' if o['passed'] else 'FAIL ' + o.get('note', '')} |")
        lines.append("")
    return "\n".join(lines)


def write_accuracy_report(acc: dict, outdir: Path) -> None:
    (outdir / "accuracy_report.json").write_text(json.dumps(acc, indent=1, default=str))
    (outdir / "accuracy_report.md").write_text(_accuracy_md(acc))


def write_summary(res: ConvertOutcome, recipe, model: Path, prec, fuse_report: dict) -> Path:
    lines = [f"# optfuse convert: {recipe.name}", "", f"- model: {model}", f"- output directory: {res.outdir}", "",
             "| step | result | detail |", "|---|---|---|"]
    for s in res.steps:
        detail = (s.detail.splitlines()[0] if s.detail else "").replace("|", "\\|")
        lines.append(f"| {s.name} | {s.state} | {detail} |")
    skipped = [s for s in res.steps if s.state == "skipped"]
    if skipped:
        lines += ["", "## Not run here", ""] + [f"- {s.name}: {s.detail}" for s in skipped]
    lines += ["", "## Fusions", ""]
    per_op: dict[str, int] = {}
    for f in fuse_report.get("fusions", []):
        per_op[f["op"]] = per_op.get(f["op"], 0) + 1
    lines += [f"- {op}: {n}" for op, n in sorted(per_op.items())] or ["- nothing fused"]
    lines += ["", "See fusion_report.md.", "", prec.to_markdown(), _accuracy_md(res.accuracy).replace("# Accuracy", "## Accuracy", 1)]
    if res.build_report is not None:
        lines += ["", res.build_report.to_markdown()]
    lines += ["", "## Files", ""]
    for s in res.steps:
        lines += [f"- {a}" for a in s.artifacts]
    path = res.outdir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
