"""The convert flow: the whole pipeline into one directory::

    MODEL (or the recipe's export) -> fuse -> <name>.fused.onnx, <name>.fusion_report.{json,md}
      -> precision -> <name>.<mode>.onnx, precision_report.json
      -> verify (FP32 original vs fused+precision, both onnxruntime CPU)
      -> per-node comparison (``--per-node`` / the recipe's ``verify.per_node``; off by default)
      -> build (when a TensorRT backend is installed) -> <name>.plan, build_report.{json,md}, build.log
      -> engine check (polygraphy TrtRunner, only when the engine can run on this GPU)
      -> accuracy_report.{json,md}, report.{md,json,html} (every step: ran / skipped and why; the page
         needs the `report` extra, and without it the run says so in its "report.html" step)

It exits 0 when everything it ran passed; a step it could not run is reported, not failed. One
function per step; each appends its :class:`Step` to the outcome.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import onnx

from ..errors import BuildError, InputError, OptfuseError, VerificationError
from ..precision import PrecisionResult
from ..recipe import Recipe
from ..report.common import user_mode
from ..trt.build import BuildReport
from ..verify import CheckError, NotExecuted, VerifyResult
from .build import TargetPlan, build, plan_target
from .fuse import FuseOutcome, fuse, verify
from .model import resolve_model
from .options import (NO_OVERRIDES, Overrides, PerNodeSettings, Progress, Status, as_progress, model_header, noop,
                      options_record, per_node_settings, precision_options, resolve_dims, verify_options)


#: the step of an fp8 run that verifies its base-precision model (the FP8 candidate's side-by-side)
BASELINE_STEP = "verify (onnxruntime, base precision)"


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
    #: "onnxruntime" / "engine" -> the comparison, or why there is none
    accuracy: dict[str, VerifyResult | CheckError | NotExecuted] = field(default_factory=dict)
    build_report: BuildReport | None = None
    model: str | None = None  # the model converted (the export, when the recipe exports one)
    #: the one line saying the engine profile guessed dims (printed on stdout), or ""
    profile_warning: str = ""
    #: what the run used and where each value came from (also in the manifest and report.md)
    options: dict = field(default_factory=dict)
    #: the per-node comparison's facts (report.per_node.per_node_facts: per_node, attribution, overflow,
    #: how it ran), None when it did not run
    per_node: dict | None = None
    #: an fp8 run's base-precision model (verified on the same inputs as the FP8 candidate), else None
    baseline: Path | None = None

    @property
    def passed(self) -> bool:
        return all(s.state != "failed" for s in self.steps)

    def step(self, name: str) -> Step | None:
        return next((s for s in self.steps if s.name == name), None)


@dataclass(frozen=True)
class RunArrays:
    """``--load-inputs`` / ``--save-inputs`` / ``--save-outputs`` of the onnxruntime check (:mod:`.arrays`)."""

    load_inputs: tuple[str, ...] = ()
    save_inputs: str | None = None
    save_outputs: str | None = None


def convert(model: str | os.PathLike | None, recipe: Recipe | None, outdir: str | os.PathLike, *,
            target: str | None = None, backend: str | None = None, iterations: int | None = None, seed: int = 0,
            skip_build: bool = False, status: Status = noop, overrides: Overrides = NO_OVERRIDES,
            arrays: RunArrays = RunArrays()) -> ConvertOutcome:
    """The whole pipeline (see module doc), as a transaction on `outdir`.

    Every file is written into ``<outdir>/partial-<stamp>/`` first. A run that completes moves its
    files into `outdir` (removing what the previous run listed in its ``manifest.json``, and the
    fixed-name reports of a run before manifests, so the folder never mixes two runs) and writes
    ``manifest.json``. A run that fails or is interrupted leaves `outdir` as it was, plus that
    partial folder with ``error.log``; a bad input found before anything was written leaves nothing.

    Without a recipe, MODEL is required and the command line's options (or the defaults) are used.

    Raises VerificationError (exit 1) / BuildError (exit 2) after writing every report (into the
    partial folder) when a step that ran failed."""
    if recipe is None and model is None:
        raise InputError("no model given: pass MODEL.onnx or a recipe (-r) that names one")
    # the target/backend check, before any work (an unknown backend or an unbuildable --target: exit 2)
    plan = plan_target(target, recipe, backend)
    if plan.explicit:  # the precision stage's FP8 attention rule reads the arch built for
        overrides = replace(overrides, target=plan.target)
    outdir = Path(outdir)
    if outdir.exists() and not outdir.is_dir():
        raise InputError(f"output directory {outdir} is a file")
    created = not outdir.exists()
    try:
        outdir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"partial-{time.strftime('%Y%m%d-%H%M%S')}-", dir=outdir))
        os.chmod(staging, user_mode(0o777))
    except OSError as exc:
        if created and outdir.is_dir() and not any(outdir.iterdir()):
            outdir.rmdir()
        raise InputError(f"cannot write into {outdir}: {exc.strerror or exc}") from None
    try:
        res = _convert_into(staging, model, recipe, plan=plan, iterations=iterations, seed=seed,
                            skip_build=skip_build, status=status, overrides=overrides, arrays=arrays)
    except BaseException as exc:
        _keep_partial(staging, outdir, created, exc)
        raise
    try:
        return _commit(res, staging, outdir, recipe, target=target, backend=backend, iterations=iterations,
                       seed=seed, skip_build=skip_build, options=res.options)
    except OSError as exc:
        _keep_partial(staging, outdir, created, exc)
        raise InputError(f"cannot write into {outdir}: {exc.strerror or exc} (this run's files are in {staging})") \
            from None


#: the fixed-name files a convert run writes (removed from the folder a new run completes into)
_RUN_FILES = ("report.md", "report.json", "report.html", "accuracy_report.json", "accuracy_report.md", "precision_report.json",
              "build_report.json", "build_report.md", "build.log", "fusion_report.json", "fusion_report.md")


def _keep_partial(staging: Path, outdir: Path, created: bool, exc: BaseException) -> None:
    """A failed run: its partial folder stays with error.log, unless nothing was written at all."""
    if not staging.exists():
        return
    if not any(staging.iterdir()):
        shutil.rmtree(staging, ignore_errors=True)
        if created:
            try:
                outdir.rmdir()  # only when empty: the run made it
            except OSError:
                pass
        return
    what = "interrupted" if isinstance(exc, KeyboardInterrupt) else f"{type(exc).__name__}: {exc}"
    try:
        (staging / "error.log").write_text(f"optfuse convert did not complete; {outdir} was left as it was.\n"
                                           f"{what}\n")
    except OSError:
        pass
    try:
        exc.partial = staging  # the CLI names it
    except AttributeError:
        pass


def _relocate(staging: Path, dest: Path) -> None:
    """Rewrite the staging folder's name in its text reports to `dest` (where the files end up)."""
    for f in staging.iterdir():
        if f.suffix in (".md", ".json", ".html") and f.is_file():
            text = f.read_text(encoding="utf-8", errors="replace")
            if str(staging) in text:
                f.write_text(text.replace(str(staging), str(dest)))


def _commit(res: ConvertOutcome, staging: Path, outdir: Path, recipe: Recipe, **params) -> ConvertOutcome:
    """Move a completed run into `outdir`: the previous run's files go, this run's come, manifest.json last."""
    from ..report import MANIFEST, manifest_outputs, read_manifest, write_manifest
    from .options import recipe_label

    _relocate(staging, outdir)
    new = sorted(p.name for p in staging.iterdir())
    stem = Path(res.model).stem if res.model else None
    old = set(manifest_outputs(read_manifest(outdir))) | set(_RUN_FILES) | ({f"{stem}.plan"} if stem else set())
    (outdir / MANIFEST).unlink(missing_ok=True)  # a folder without manifest is not a complete run
    for name in sorted(old - set(new)):
        target = outdir / name
        if target.is_file() and target.parent == outdir:
            target.unlink()
    for name in new:
        os.replace(staging / name, outdir / name)
    shutil.rmtree(staging, ignore_errors=True)
    res.outdir = outdir
    res.summary = outdir / res.summary.name if res.summary is not None else None
    for s in res.steps:
        s.artifacts = [a.replace(str(staging), str(outdir)) for a in s.artifacts]
    model = res.model.replace(str(staging), str(outdir)) if res.model else None
    write_manifest(outdir, [outdir / n for n in new], command="convert",
                   parameters={"model": model, "recipe": recipe_label(recipe), "parameters": params})
    return res


def _convert_into(outdir: Path, model: str | os.PathLike | None, recipe: Recipe | None, *, plan: TargetPlan,
                  iterations: int | None, seed: int, skip_build: bool, status: Status, overrides: Overrides,
                  arrays: RunArrays) -> ConvertOutcome:
    """fuse -> precision -> verify -> build -> engine check -> reports, every file into `outdir`."""
    from ..report import REPORT_HTML, SUMMARY_JSON, missing_extra, write_accuracy_report, write_summary
    from ..trt.run import polygraphy_env

    progress = as_progress(status)
    res = ConvertOutcome(outdir)
    resolved = plan.backend
    if resolved is not None:
        polygraphy_env(resolved)  # before verify imports polygraphy

    per_node = per_node_settings(recipe, overrides)
    progress.plan(7 if per_node.enabled else 6)
    with progress.step("load") as step:
        path = resolve_model(model, recipe, workdir=outdir, status=progress)
        res.model = str(path)
        header = model_header(path)  # the shapes and tolerances are checked against it before any work
        dims = resolve_dims(header, recipe, overrides)
        _check_run_inputs(header, recipe, overrides, arrays)
        res.options = {**options_record(recipe, overrides, dims), "verify": per_node.to_dict()}
        res.profile_warning = "" if skip_build else dims.guess_warning() or ""
        step.detail = f"{len(header.graph.node)} nodes; dims {dims.source()}"
        del header  # a model with its weights inside holds them: not for the rest of the run
    with progress.step("fuse") as step:
        fused = _fuse_step(res, path, recipe, progress, overrides)
        step.detail = res.steps[-1].detail
    with progress.step("precision") as step:
        prec_path, prec = _precision_step(res, path.stem, fused.output, recipe, progress, overrides)
        step.detail = res.steps[-1].detail
    with progress.step("verify") as step:
        _verify_step(res, path, prec_path, recipe, iterations, seed, progress, overrides, arrays)
        checked = res.step("verify (onnxruntime)")
        step.detail = checked.detail.splitlines()[0] if checked.detail else checked.state
    if per_node.enabled:
        _per_node_step(res, path, prec_path, recipe, iterations, seed, progress, overrides, arrays, per_node)
    engine_path = outdir / f"{path.stem}.plan"
    with progress.step("build") as step:
        build_error = _build_step(res, prec_path, engine_path, recipe, plan, skip_build, progress, overrides)
        step.detail = f"{res.steps[-1].state}: {res.steps[-1].detail.splitlines()[0] if res.steps[-1].detail else ''}"
    with progress.step("verify engine") as step:
        _engine_step(res, path, prec_path, engine_path, recipe, resolved, iterations, seed, progress, overrides)
        step.detail = f"{res.steps[-1].state}: {res.steps[-1].detail.splitlines()[0] if res.steps[-1].detail else ''}"

    write_accuracy_report(res.accuracy, outdir)
    no_html = missing_extra()
    html = None if no_html else outdir / REPORT_HTML
    res.steps.append(Step("report.html", "skipped", no_html) if no_html else
                     Step("report.html", "ok", "the run as one page: report.html (its facts: report.json)",
                          [str(outdir / SUMMARY_JSON), str(html)]))
    res.summary = write_summary(recipe.name if recipe is not None else path.stem, path, outdir, res.steps,
                                fused.report, prec, res.accuracy, res.build_report, options=res.options,
                                per_node=res.per_node, html=html)
    if build_error is not None:
        raise type(build_error)(str(build_error))
    failed = [s for s in res.steps if s.state == "failed"]
    if failed:
        raise VerificationError("; ".join(f"{s.name}: {s.detail.splitlines()[0] if s.detail else 'failed'}" for s in failed)
                                + f" (see {res.summary})")
    return res


def _check_run_inputs(header: onnx.ModelProto, recipe: Recipe | None, overrides: Overrides, arrays: RunArrays) -> None:
    """The command line's shapes, tolerances and --load-inputs against the model, before any work."""
    from ..verify import plan_inputs
    from .arrays import load_feeds
    from .options import check_output_names

    check_output_names(header, overrides)
    options = verify_options(recipe, overrides, header)
    if arrays.load_inputs:
        load_feeds(arrays.load_inputs, plan_inputs(header, options), header)
    if precision_options(recipe, overrides).mode == "fp8":
        from .fp8 import check_calibration

        check_calibration(header, recipe, overrides)


def _fuse_step(res: ConvertOutcome, path: Path, recipe: Recipe | None, status: Status,
               overrides: Overrides) -> FuseOutcome:
    fused_path = res.outdir / f"{path.stem}.fused.onnx"
    out = fuse(path, fused_path, recipe, workdir=res.outdir, status=status, overrides=overrides)
    n_fused = len(out.report.get("fusions", []))
    res.steps.append(Step("fuse", "ok", f"{n_fused} fused node(s); {len(out.report.get('rejected', []))} rejected",
                          [str(fused_path), *map(str, out.report_paths)]))
    return out


def _precision_step(res: ConvertOutcome, name: str, fused_path: Path, recipe: Recipe | None,
                    status: Status, overrides: Overrides) -> tuple[Path, PrecisionResult]:
    from ..ir import load_model, save_model
    from ..precision import apply_precision
    from ..report import write_precision_report

    options = precision_options(recipe, overrides)
    mode = options.mode
    status(f"precision: {mode}")
    fused_model = load_model(fused_path)
    calibration, baseline = None, []
    if mode == "fp8":
        from .fp8 import baseline_model, baseline_path, calibration_feeds, calibration_source

        calibration = calibration_feeds(fused_model, recipe, overrides)
        status(f"precision: {options.fp8_base} baseline")
        base_model, _ = baseline_model(fused_model, options)
        res.baseline = baseline_path(res.outdir, name, options)
        save_model(base_model, res.baseline)
        baseline = [str(res.baseline)]
        del base_model
        status(f"precision: fp8, calibrating on {calibration_source(recipe, len(calibration))}")
    prec_model, prec = apply_precision(fused_model, options, calibration)
    if prec.fp8 is not None:
        prec.fp8["calibration_source"] = calibration_source(recipe, len(calibration))
    prec_path = res.outdir / f"{name}.{mode}.onnx"
    if mode == "fp32":
        shutil.copyfile(fused_path, prec_path)
    else:
        save_model(prec_model, prec_path)
    report_path = write_precision_report(prec, res.outdir)
    detail = f"{mode}; {prec.casts_added} Cast(s) added; kept FP32: {', '.join(prec.keep_fp32_ops) or 'none'}"
    if prec.fp8 is not None:
        detail = (f"fp8: {len(prec.fp8['gemms'])} GEMM(s) in E4M3, {len(prec.fp8['skipped'])} kept in "
                  f"{prec.fp8['base']}; {detail.split('; ', 1)[1]}")
    res.steps.append(Step("precision", "ok", detail, [str(prec_path), *baseline, str(report_path)]))
    return prec_path, prec


def _verify_step(res: ConvertOutcome, path: Path, prec_path: Path, recipe: Recipe | None, iterations: int | None,
                 seed: int, status: Status, overrides: Overrides, arrays: RunArrays) -> None:
    from ..report import verify_line
    from ..report.accuracy import ACCURACY_MD

    status("verifying in onnxruntime")
    try:
        v = verify(path, prec_path, recipe, iterations=iterations, seed=seed, status=status, overrides=overrides,
                   load_inputs=arrays.load_inputs, save_inputs=arrays.save_inputs, save_outputs=arrays.save_outputs)
    except VerificationError as exc:
        res.accuracy["onnxruntime"] = CheckError(str(exc))
        res.steps.append(Step("verify (onnxruntime)", "failed", str(exc)))
        return
    res.accuracy["onnxruntime"] = v
    res.steps.append(Step("verify (onnxruntime)", "ok" if v.passed else "failed", verify_line(v),
                          [str(res.outdir / ACCURACY_MD)]))
    if res.baseline is not None:
        _baseline_step(res, path, recipe, iterations, seed, status, overrides, arrays)


def _baseline_step(res: ConvertOutcome, path: Path, recipe: Recipe | None, iterations: int | None, seed: int,
                   status: Status, overrides: Overrides, arrays: RunArrays) -> None:
    """An fp8 run's base-precision model on the same inputs: what the FP8 candidate is reported next to
    (informational: its tolerances are its own precision's; the step fails only when it cannot run)."""
    from ..report import verify_line

    status(f"verifying the {res.baseline.suffixes[-2].lstrip('.')} baseline in onnxruntime")
    try:
        v = verify(path, res.baseline, recipe, iterations=iterations, seed=seed, status=status, overrides=overrides,
                   load_inputs=arrays.load_inputs)
    except VerificationError as exc:
        res.accuracy["baseline"] = CheckError(str(exc))
        res.steps.append(Step(BASELINE_STEP, "failed", str(exc)))
        return
    res.accuracy["baseline"] = v
    res.steps.append(Step(BASELINE_STEP, "ok", f"{verify_line(v)} (the FP8 candidate's side-by-side)",
                          [str(res.baseline)]))


def _per_node_step(res: ConvertOutcome, path: Path, prec_path: Path, recipe: Recipe | None, iterations: int | None,
                   seed: int, progress: Progress, overrides: Overrides, arrays: RunArrays,
                   settings: PerNodeSettings) -> None:
    """The per-node comparison on the onnxruntime check's feeds: its facts into ``res.per_node``
    (the reports render them). Skipped when the check itself could not run."""
    from ..report.facts import PER_NODE_STEP
    from .per_node import per_node_check, per_node_line

    if not isinstance(res.accuracy.get("onnxruntime"), VerifyResult):
        res.steps.append(Step(PER_NODE_STEP, "skipped", "the onnxruntime check did not run"))
        return
    options = verify_options(recipe, overrides, model_header(path))
    try:
        per, offenders, res.per_node = per_node_check(path, prec_path, options, iterations, seed, progress,
                                                      load_inputs=arrays.load_inputs, chunk_size=settings.chunk_size)
    except VerificationError as exc:
        res.steps.append(Step(PER_NODE_STEP, "failed", str(exc)))
        return
    res.steps.append(Step(PER_NODE_STEP, "ok", per_node_line(per, offenders)))


def _build_step(res: ConvertOutcome, prec_path: Path, engine_path: Path, recipe: Recipe | None, plan: TargetPlan,
                skip_build: bool, status: Status, overrides: Overrides) -> OptfuseError | None:
    """The build step; returns the build's error (re-raised after the reports are written)."""
    from ..trt import compat

    resolved = plan.backend
    if skip_build:
        res.steps.append(Step("build", "skipped", "--skip-build"))
        return None
    if resolved is None:
        res.steps.append(Step("build", "skipped", "no TensorRT backend is installed (pip install 'optfuse[trt-rtx]' "
                              "for CPU-only TensorRT-RTX builds, or tensorrt on a GPU machine)"))
        return None
    be = compat.load(resolved)
    explicit, tgt, note = plan.explicit, plan.target, plan.note
    if not be.is_rtx and not explicit:
        tgt = None  # standard TensorRT builds for the GPU present; build checks it against the recipe
    try:
        b = build(prec_path, engine_path, recipe, target=tgt, backend=resolved, use_recipe_target=False, status=status,
                  overrides=overrides)
    except (BuildError, InputError) as exc:
        res.steps.append(Step("build", "failed", str(exc)))
        return exc
    res.build_report = r = b.report
    detail = (f"{be.label}, target {r.target}: {r.layers_by_kind.get('plugin', 0)} plugin / "
              f"{r.layers_by_kind.get('native', 0)} native layers, engine {r.engine_bytes} B")
    res.steps.append(Step("build", "ok", detail + (f"; note: {note}" if note else ""),
                          [str(engine_path), *map(str, b.report_paths), str(res.outdir / "build.log")]))
    return None


def _engine_step(res: ConvertOutcome, path: Path, prec_path: Path, engine_path: Path, recipe: Recipe | None,
                 resolved: str | None, iterations: int | None, seed: int, status: Status, overrides: Overrides) -> None:
    """The engine check: the FP32 original in onnxruntime vs the engine (built from ``prec_path``), at the
    recipe's precision."""
    from ..report import verify_line
    from ..trt.run import run_engine
    from ..verify import padded_query_inputs, verify_against

    rep = res.build_report
    if rep is None:
        res.steps.append(Step("verify (engine)", "skipped", "no engine was built"))
        return
    if not rep.runnable_here:
        res.accuracy["engine"] = NotExecuted(reason=rep.not_runnable_reason)
        res.steps.append(Step("verify (engine)", "skipped", f"engine not executed: {rep.not_runnable_reason}"))
        return
    status("running the engine")
    try:
        ve = verify_against(path, functools.partial(run_engine, engine_path, backend=resolved),
                            verify_options(recipe, overrides, model_header(path)),
                            mode=precision_options(recipe, overrides).mode, iterations=iterations or 3, seed=seed,
                            candidate_label=str(engine_path), padded_queries=padded_query_inputs(model_header(prec_path)))
    except Exception as exc:  # a runtime failure of the engine is a failed check, reported
        res.accuracy["engine"] = NotExecuted(error=f"{type(exc).__name__}: {exc}")
        res.steps.append(Step("verify (engine)", "failed", f"{type(exc).__name__}: {exc}"))
        return
    res.accuracy["engine"] = ve
    res.steps.append(Step("verify (engine)", "ok" if ve.passed else "failed", verify_line(ve)))
