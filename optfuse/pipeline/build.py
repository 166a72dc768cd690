"""The build flow: fused (precision) ONNX -> TensorRT engine + build_report.{json,md} + build log,
through the TensorRT backend (:mod:`optfuse.trt.build`, imported on use: TensorRT is optional)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InputError
from ..recipe import Recipe
from ..trt.build import BuildReport
from .options import Status, build_profile, noop


@dataclass
class BuildOutcome:
    model: Path
    engine: Path
    report: BuildReport
    report_paths: tuple[Path, Path]
    notes: list[str] = field(default_factory=list)
    #: why the engine does not target the recipe's arch (the backend cannot build it), or ""
    target_note: str = ""


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
          status: Status = noop) -> BuildOutcome:
    """FUSED.onnx -> engine + build_report.{json,md} + build log next to the engine."""
    from ..report import write_build_report
    from ..trt.build import build_engine_file

    plan = plan_target(target, recipe, backend, use_recipe_target=use_recipe_target)  # before any work
    model = Path(model)
    if not model.is_file():
        raise InputError(f"model {model}: file not found")
    engine = Path(output) if output is not None else model.with_suffix(".plan")
    if engine.exists() and engine.is_dir():
        raise InputError(f"output {engine} is a directory; give a file name such as {engine / 'model.plan'}")
    backend = backend or (recipe.target.backend if recipe is not None else None)
    target = plan.target
    profile = build_profile(recipe, model)
    out_dir = engine.parent
    status(f"building {engine.name} ({backend or 'auto'} backend)")
    report = build_engine_file(
        model, engine, dims=profile.dims, input_shapes=profile.input_shapes, target=target, backend=backend,
        timing_cache=Path(timing_cache) if timing_cache else out_dir / "timing.cache",
        log_path=Path(log_path) if log_path else out_dir / "build.log",
    )
    paths = write_build_report(report, out_dir)
    return BuildOutcome(model, engine, report, paths, [f"profile dims: {profile.source}"], plan.note)
