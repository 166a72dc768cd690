"""The inspect, fuse, verify and demo flows.

    model (file, or exported from a recipe)  --fuse-->    fused .onnx + <model>.fusion_report.{json,md}
    model                                    --inspect--> the fusion report, nothing written
    original + candidate                     --verify-->  VerifyResult (per-output errors)
    the tiny BERT                            --demo-->    export, fuse, verify in one directory
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from ..errors import InputError, VerificationError
from ..estimate import TrafficEstimate
from ..recipe import Recipe
from ..rewrite import FusionResult
from ..verify import DEFAULT_ITERATIONS, VerifyResult
from .model import discard_staging, load_checked, resolve_model
from .options import Status, analysis_dims, enabled_families, fusion_options, noop, recipe_label, verify_options

DEMO_DIR = Path("optfuse-demo")


@dataclass
class InspectOutcome:
    model: Path
    report: dict[str, Any]  # the fusion report (report.build_report)
    result: FusionResult


@dataclass
class FuseOutcome:
    model: Path
    output: Path
    report: dict[str, Any]  # the fusion report, as written to <model>.fusion_report.json
    report_paths: tuple[Path, Path]
    result: FusionResult
    verification: VerifyResult | None = None  # when asked


def inspect(model: str | os.PathLike | None, recipe: Recipe | None = None, status: Status = noop) -> InspectOutcome:
    """What would fuse and what would not (and why); writes nothing."""
    from ..report import build_report

    with tempfile.TemporaryDirectory(prefix="optfuse-inspect-") as tmp:  # an export lands here, then goes
        path = resolve_model(model, recipe, workdir=Path(tmp), status=status)
        status(f"loading {path}")
        proto = load_checked(path, weights="disk")
        run = _fuse_and_estimate(proto, recipe, status, weights_dir=path.parent)  # (its weights may be in tmp)
        if model is None and recipe is not None and recipe.model.export is not None:
            e = recipe.model.export
            path = Path(f"<export {e.family} {e.exporter} attn={e.attn}>")
    report = build_report(run.result, estimate=run.estimate, model=str(path), recipe=recipe_label(recipe),
                          dims=run.dims, dims_source=run.dims_source, families=run.families)
    return InspectOutcome(path, report, run.result)


@dataclass
class _FuseRun:
    """What the fuse and inspect flows share: the fused model, its fusion result and traffic estimate."""

    fused: onnx.ModelProto
    result: FusionResult
    estimate: TrafficEstimate
    dims: dict[str, int]
    dims_source: str
    families: list[str]


def _fuse_and_estimate(proto: onnx.ModelProto, recipe: Recipe | None, status: Status, weights_dir: Path) -> _FuseRun:
    """sanitize -> match -> rewrite (fusions.fuse_model), then the estimate stage at the analysis dims.

    `proto` holds its big weights on disk, in `weights_dir`; the fused model refers to them there."""
    from ..estimate import estimate_traffic
    from ..fusions import fuse_model

    dims, dims_source = analysis_dims(proto, recipe)
    families = enabled_families(recipe)
    status("sanitizing, matching, rewriting")
    fused, result = fuse_model(proto, dims=dims, families=families, options=fusion_options(recipe),
                               weights_dir=weights_dir)
    status("estimating HBM traffic")
    return _FuseRun(fused, result, estimate_traffic(fused, result, dims), dims, dims_source, families)


def default_output(model: Path) -> Path:
    return model.with_name(f"{model.stem}.fused.onnx")


def fuse(model: str | os.PathLike | None, output: str | os.PathLike | None = None, recipe: Recipe | None = None,
         verify_after: bool = False, iterations: int | None = None, seed: int = 0,
         workdir: Path | None = None, status: Status = noop) -> FuseOutcome:
    """load -> sanitize -> match -> rewrite -> save -> report; optionally verify the result.

    Nothing is written until the fused model exists in memory, so bad input leaves no file behind;
    the model, its external data and the reports are written into ``<output>.partial-*/`` beside
    OUTPUT and moved into place together when complete (a failure or an interrupt leaves none of them).
    """
    from ..ir import save_model
    from ..report import build_report, report_stem, write_report

    path = resolve_model(model, recipe, workdir=workdir, status=status)
    out = Path(output) if output is not None else default_output(path)
    _check_output(path, out)
    status(f"loading {path}")
    proto = load_checked(path, weights="disk")
    run = _fuse_and_estimate(proto, recipe, status, weights_dir=path.parent)
    status(f"writing {out}")
    created = not out.parent.exists()
    try:  # the model, its external data and the reports go into a folder beside OUTPUT, then into place
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"{out.stem}.partial-", dir=out.parent))
    except OSError as exc:
        raise InputError(f"cannot write {out}: {exc.strerror or exc}") from None
    try:
        staged = staging / out.name
        save_model(run.fused, staged, weights_dir=path.parent)
        verification = None
        if verify_after:
            status("verifying")
            verification = verify(path, staged, recipe, iterations=iterations, seed=seed)
        report = build_report(run.result, estimate=run.estimate, model=str(path), fused_model=str(out),
                              recipe=recipe_label(recipe), dims=run.dims, dims_source=run.dims_source,
                              families=run.families,
                              verification=verification.to_dict() if verification is not None else None)
        staged_reports = write_report(report, staging, stem=report_stem(path.stem))
        data = out.parent / f"{out.name}.data"
        for f in sorted(staging.iterdir(), key=lambda p: p.name == out.name):  # the model itself last
            os.replace(f, out.parent / f.name)
        if data.exists() and not (staging / data.name).exists() and not _uses_external_data(out):
            data.unlink()  # an older fused model's weights, not this one's
    except OSError as exc:
        discard_staging(staging, out.parent, created)
        raise InputError(f"cannot write {out}: {exc.strerror or exc}") from None
    except BaseException:
        discard_staging(staging, out.parent, created)
        raise
    shutil.rmtree(staging, ignore_errors=True)
    paths = (out.parent / staged_reports[0].name, out.parent / staged_reports[1].name)
    return FuseOutcome(path, out, report, paths, run.result, verification)


def _uses_external_data(path: Path) -> bool:
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    return any(uses_external_data(t) for t in _get_all_tensors(onnx.load(str(path), load_external_data=False)))


def _check_output(model: Path, out: Path) -> None:
    if out.exists() and out.is_dir():
        raise InputError(f"output {out} is a directory; give a file name such as {out / 'model.fused.onnx'}")
    try:
        same = out.exists() and model.exists() and os.path.samefile(model, out)
    except OSError:
        same = False
    if same:
        raise InputError(f"output {out} is the input model; choose another file name")


def verify(original: str | os.PathLike, candidate: str | os.PathLike, recipe: Recipe | None = None,
           iterations: int | None = None, seed: int = 0, atol: float | None = None, rtol: float | None = None,
           status: Status = noop) -> VerifyResult:
    """ORIGINAL vs CANDIDATE in onnxruntime, with the recipe's inputs and tolerances."""
    from ..verify import verify as run_verify

    n = iterations or DEFAULT_ITERATIONS
    return run_verify(original, candidate, verify_options(recipe), iterations=n, seed=seed, atol=atol, rtol=rtol,
                      on_iteration=lambda i: status(f"running iteration {i + 1}/{n}"))


def raise_if_failed(result: VerifyResult | None) -> None:
    """VerificationError (exit 1) naming the outputs out of tolerance."""
    if result is None or result.passed:
        return
    bad = result.failed
    names = ", ".join(o.name for o in bad[:5]) + (" ..." if len(bad) > 5 else "")
    raise VerificationError(f"verification failed: {len(bad)} of {len(result.outputs)} output(s) out of tolerance ({names})")


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


def demo(directory: str | os.PathLike = DEMO_DIR, status: Status = noop) -> DemoOutcome:
    """Export the tiny BERT, fuse it, verify it; everything goes to `directory`."""
    from ..recipe import recipe_from_dict

    directory = Path(directory)
    recipe = recipe_from_dict(DEMO_RECIPE, label="demo recipe")
    exported = resolve_model(None, recipe, workdir=directory, status=status)
    outcome = fuse(exported, directory / f"{exported.stem}.fused.onnx", recipe, verify_after=True, status=status)
    return DemoOutcome(directory, exported, outcome)
