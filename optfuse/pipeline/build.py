"""The build flow: fused (precision) ONNX -> TensorRT engine + build_report.{json,md} + build log,
through the TensorRT backend (:mod:`optfuse.trt.build`, imported on use: TensorRT is optional)."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .. import DOMAIN
from ..errors import InputError
from ..recipe import Recipe
from ..trt.build import BuildReport
from .model import discard_staging, load_checked
from .options import NO_OVERRIDES, Overrides, Status, as_progress, build_profile, noop, options_record


@dataclass
class BuildOutcome:
    model: Path
    engine: Path
    report: BuildReport
    report_paths: tuple[Path, Path]
    notes: list[str] = field(default_factory=list)
    #: why the engine does not target the recipe's arch (the backend cannot build it), or ""
    target_note: str = ""
    #: one line each, printed on stderr as ``warning: ...`` (e.g. a model with no optfuse node)
    warnings: list[str] = field(default_factory=list)
    #: the one line saying the profile guessed dims (printed on stdout), or ""
    profile_warning: str = ""
    #: what the build used and where each value came from (also in build_report.json)
    options: dict = field(default_factory=dict)


@dataclass(frozen=True)
class TargetPlan:
    """The target/backend check's answer: the backend (None: none installed), the arch to build
    for (None: the backend's default) and, when the recipe's arch was set aside, why."""

    backend: str | None
    target: str | None
    explicit: bool
    note: str = ""


def plan_target(target: str | None, recipe: Recipe | None, backend: str | None, *,
                use_recipe_target: bool = True) -> TargetPlan:
    """The one target/backend check, run before any work by ``build`` and ``convert``.

    An explicit ``--target`` the backend cannot build is an InputError (exit 2) naming the
    backends that can; a recipe's arch TensorRT-RTX cannot build falls back to RTX's default
    targets with a note (the engine still validates the build path)."""
    from ..target import BACKEND_ARCHS, parse_arch, target_problem
    from ..trt import compat

    resolved = compat.resolve_backend(backend or (recipe.target.backend if recipe is not None else None))
    if target is not None and target.strip().lower() not in ("", "auto"):
        try:
            cc = parse_arch(target)
        except ValueError as exc:
            raise InputError(f"--target: {exc}") from None
        problem = target_problem(resolved, cc) if resolved is not None else None
        if problem:
            raise InputError(problem)
        return TargetPlan(resolved, target, True)
    wanted = recipe.target.arch if recipe is not None and use_recipe_target else None
    if wanted is None or resolved != "tensorrt_rtx" or not target_problem(resolved, parse_arch(wanted)):
        return TargetPlan(resolved, wanted, False)
    caps = ", ".join(f"sm_{c}" for c in (80, 86, 89, 120) if c in BACKEND_ARCHS[resolved])
    return TargetPlan(resolved, None, False, (
        f"the recipe targets {wanted}, which TensorRT-RTX cannot build for; the RTX engine targets its defaults "
        f"({caps}) and validates the build path; a {wanted} engine needs TensorRT on that GPU"))


def build(model: str | os.PathLike, output: str | os.PathLike | None = None, recipe: Recipe | None = None, *,
          target: str | None = None, backend: str | None = None, timing_cache: str | os.PathLike | None = None,
          log_path: str | os.PathLike | None = None, use_recipe_target: bool = True,
          status: Status = noop, overrides: Overrides = NO_OVERRIDES) -> BuildOutcome:
    """FUSED.onnx -> engine + build_report.{json,md} + build log next to the engine, all or nothing
    (built in ``<engine>.partial-*/`` beside it, moved into place when complete)."""
    from ..report import write_build_report
    from ..trt.build import build_engine_file

    progress = as_progress(status)
    progress.plan(2)
    with progress.step("check") as step:
        plan = plan_target(target, recipe, backend, use_recipe_target=use_recipe_target)  # before any work
        model = Path(model)
        proto = load_checked(model, weights="disk")  # bad input (text, truncated, empty, .data missing, a folder) is exit 2 here
        if not proto.graph.output:
            raise InputError(f"{model} has no graph outputs (an empty model): nothing to build")
        optfuse_nodes = sum(1 for n in proto.graph.node if n.domain == DOMAIN)
        del proto
        engine = Path(output) if output is not None else model.with_suffix(".plan")
        if engine.exists() and engine.is_dir():
            raise InputError(f"output {engine} is a directory; give a file name such as {engine / 'model.plan'}")
        backend = backend or (recipe.target.backend if recipe is not None else None)
        target = plan.target
        profile, dims = build_profile(recipe, model, overrides)
        step.detail = (f"{optfuse_nodes} optfuse node(s), backend {plan.backend or 'none installed'}, "
                       f"profile {profile.source}")
    out_dir = engine.parent
    log_final = Path(log_path) if log_path else out_dir / "build.log"
    created = not out_dir.exists()
    try:  # everything is built into a folder beside the engine and moved into place when complete
        out_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"{engine.stem}.partial-", dir=out_dir))
    except OSError as exc:
        if created and out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()
        raise InputError(f"cannot write into {out_dir}: {exc.strerror or exc}") from None
    options = options_record(recipe, overrides, dims)
    progress(f"building {engine.name} ({backend or 'auto'} backend)")
    try:
        with progress.step("build") as record:
            report = build_engine_file(
                model, staging / engine.name, dims=profile.dims, input_shapes=profile.input_shapes, target=target,
                backend=backend, timing_cache=Path(timing_cache) if timing_cache else out_dir / "timing.cache",
                log_path=staging / "build.log",
            )
            record.detail = (f"parse {report.parse_seconds:.1f} s, build {report.build_seconds:.1f} s; "
                             f"{report.layers_by_kind.get('plugin', 0)} plugin / "
                             f"{report.layers_by_kind.get('native', 0)} native layers")
        report.engine = str(engine)
        if report.build_log:
            report.build_log = str(log_final)
        staged = write_build_report(report, staging, options)
        paths = (out_dir / staged[0].name, out_dir / staged[1].name)
        moves = [(staging / engine.name, engine), *zip(staged, paths)]
        if (staging / "build.log").is_file():
            moves.append((staging / "build.log", log_final))
        for src, dst in moves:
            os.replace(src, dst)
    except OSError as exc:
        discard_staging(staging, out_dir, created)
        raise InputError(f"cannot write into {out_dir}: {exc.strerror or exc}") from None
    except BaseException:
        discard_staging(staging, out_dir, created)
        raise
    shutil.rmtree(staging, ignore_errors=True)
    outcome = BuildOutcome(model, engine, report, paths, [f"profile dims: {profile.source}"], plan.note,
                           profile_warning=(dims.guess_warning() or "") if dims is not None else "", options=options)
    if optfuse_nodes == 0:
        outcome.warnings.append("0 optfuse nodes: did you mean `optfuse convert`?")
    return outcome
