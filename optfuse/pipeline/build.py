"""The build flow: fused (precision) ONNX -> TensorRT engine + build_report.{json,md} + build log,
through the TensorRT backend (:mod:`optfuse.trt.build`, imported on use: TensorRT is optional)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .. import DOMAIN
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
    #: one line each, printed on stderr as ``warning: ...`` (e.g. a model with no optfuse node)
    warnings: list[str] = field(default_factory=list)


def build(model: str | os.PathLike, output: str | os.PathLike | None = None, recipe: Recipe | None = None, *,
          target: str | None = None, backend: str | None = None, timing_cache: str | os.PathLike | None = None,
          log_path: str | os.PathLike | None = None, use_recipe_target: bool = True,
          status: Status = noop) -> BuildOutcome:
    """FUSED.onnx -> engine + build_report.{json,md} + build log next to the engine."""
    from ..report import write_build_report
    from ..trt.build import build_engine_file

    from .model import load_checked

    model = Path(model)
    proto = load_checked(model)  # bad input (text, truncated, empty, .data missing, a folder) is exit 2 here
    optfuse_nodes = sum(1 for n in proto.graph.node if n.domain == DOMAIN)
    del proto
    engine = Path(output) if output is not None else model.with_suffix(".plan")
    if engine.exists() and engine.is_dir():
        raise InputError(f"output {engine} is a directory; give a file name such as {engine / 'model.plan'}")
    backend = backend or (recipe.target.backend if recipe is not None else None)
    if target is None and use_recipe_target and recipe is not None:
        target = recipe.target.arch
    profile = build_profile(recipe, model)
    out_dir = engine.parent
    status(f"building {engine.name} ({backend or 'auto'} backend)")
    report = build_engine_file(
        model, engine, dims=profile.dims, input_shapes=profile.input_shapes, target=target, backend=backend,
        timing_cache=Path(timing_cache) if timing_cache else out_dir / "timing.cache",
        log_path=Path(log_path) if log_path else out_dir / "build.log",
    )
    paths = write_build_report(report, out_dir)
    outcome = BuildOutcome(model, engine, report, paths, [f"profile dims: {profile.source}"])
    if optfuse_nodes == 0:
        outcome.warnings.append("0 optfuse nodes: did you mean `optfuse convert`?")
    return outcome
