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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import onnx

from ..errors import InputError, VerificationError
from ..estimate import TrafficEstimate
from ..recipe import Recipe
from ..rewrite import FusionResult
from ..verify import DEFAULT_ITERATIONS, VerifyResult
from .model import discard_staging, load_checked, resolve_model
from .options import (NO_OVERRIDES, Overrides, Status, analysis_dims, as_progress, check_output_names,
                      enabled_families, fusion_options, model_header, noop, options_record, recipe_label,
                      verify_options)

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


def inspect(model: str | os.PathLike | None, recipe: Recipe | None = None, status: Status = noop, *,
            overrides: Overrides = NO_OVERRIDES) -> InspectOutcome:
    """What would fuse and what would not (and why); writes nothing."""
    from ..report import build_report

    progress = as_progress(status)
    progress.plan(3)
    with tempfile.TemporaryDirectory(prefix="optfuse-inspect-") as tmp:  # an export lands here, then goes
        with progress.step("load") as step:
            path = resolve_model(model, recipe, workdir=Path(tmp), status=progress)
            progress(f"loading {path}")
            proto = load_checked(path, weights="disk")
            step.detail = f"{len(proto.graph.node)} nodes"
        run = _fuse_and_estimate(proto, recipe, progress, overrides, weights_dir=path.parent)  # (its weights may be in tmp)
        if model is None and recipe is not None and recipe.model.export is not None:
            e = recipe.model.export
            path = Path(f"<export {e.family} {e.exporter} attn={e.attn}{' past' if e.past else ''}>")
    report = build_report(run.result, estimate=run.estimate, model=str(path), recipe=recipe_label(recipe),
                          dims=run.dims, dims_source=run.dims_source, families=run.families,
                          options=options_record(recipe, overrides))
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


def _fuse_and_estimate(proto: onnx.ModelProto, recipe: Recipe | None, status: Status,
                       overrides: Overrides = NO_OVERRIDES, *, weights_dir: Path) -> _FuseRun:
    """sanitize -> match -> rewrite (fusions.fuse_model), then the estimate stage at the analysis dims
    (two progress steps: fuse, estimate).

    `proto` holds its big weights on disk, in `weights_dir`; the fused model refers to them there."""
    from ..estimate import estimate_traffic
    from ..fusions import fuse_model

    progress = as_progress(status)
    dims, dims_source = analysis_dims(proto, recipe, overrides)
    families = enabled_families(recipe)
    with progress.step("fuse") as step:
        progress("sanitizing, matching, rewriting")
        fused, result = fuse_model(proto, dims=dims, families=families, options=fusion_options(recipe),
                                   weights_dir=weights_dir)
        replaced = sum(len(a.nodes) for a in result.accepted)
        step.detail = (f"{len(result.accepted)} matched ({replaced} nodes replaced), "
                       f"{len(result.rejected)} rejected")
    with progress.step("estimate") as step:
        progress("estimating HBM traffic")
        estimate = estimate_traffic(fused, result, dims)
        step.detail = f"{len(estimate.saved_bytes)} fused node(s) sized"
    return _FuseRun(fused, result, estimate, dims, dims_source, families)


def default_output(model: Path) -> Path:
    return model.with_name(f"{model.stem}.fused.onnx")


def fuse(model: str | os.PathLike | None, output: str | os.PathLike | None = None, recipe: Recipe | None = None,
         verify_after: bool = False, iterations: int | None = None, seed: int = 0,
         workdir: Path | None = None, status: Status = noop, *, overrides: Overrides = NO_OVERRIDES) -> FuseOutcome:
    """load -> sanitize -> match -> rewrite -> save -> report; optionally verify the result.

    Nothing is written until the fused model exists in memory, so bad input leaves no file behind;
    the model, its external data and the reports are written into ``<output>.partial-*/`` beside
    OUTPUT and moved into place together when complete (a failure or an interrupt leaves none of them).
    """
    from ..ir import save_model
    from ..report import build_report, report_stem, write_report

    progress = as_progress(status)
    progress.plan(5 if verify_after else 4)
    with progress.step("load") as step:
        path = resolve_model(model, recipe, workdir=workdir, status=progress)
        out = Path(output) if output is not None else default_output(path)
        _check_output(path, out)
        progress(f"loading {path}")
        proto = load_checked(path, weights="disk")
        if verify_after:  # a tolerance for an output the model lacks is bad input before any work
            check_output_names(proto, overrides)
        step.detail = f"{len(proto.graph.node)} nodes"
    run = _fuse_and_estimate(proto, recipe, progress, overrides, weights_dir=path.parent)
    progress(f"writing {out}")
    created = not out.parent.exists()
    try:  # the model, its external data and the reports go into a folder beside OUTPUT, then into place
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"{out.stem}.partial-", dir=out.parent))
    except OSError as exc:
        raise InputError(f"cannot write {out}: {exc.strerror or exc}") from None
    try:
        staged = staging / out.name
        with progress.step("write") as step:
            save_model(run.fused, staged, weights_dir=path.parent)
            step.detail = f"{len(run.fused.graph.node)} nodes"
        verification = None
        if verify_after:
            verification = verify(path, staged, recipe, iterations=iterations, seed=seed, status=progress,
                                  overrides=overrides)
        report = build_report(run.result, estimate=run.estimate, model=str(path), fused_model=str(out),
                              recipe=recipe_label(recipe), dims=run.dims, dims_source=run.dims_source,
                              families=run.families,
                              verification=verification.to_dict() if verification is not None else None,
                              options=options_record(recipe, overrides))
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
           status: Status = noop, *, overrides: Overrides = NO_OVERRIDES, load_inputs: Sequence[os.PathLike | str] = (),
           save_inputs: str | os.PathLike | None = None, save_outputs: str | os.PathLike | None = None,
           html: str | os.PathLike | None = None) -> VerifyResult:
    """ORIGINAL vs CANDIDATE in onnxruntime, with the recipe's inputs and tolerances under the
    command line's (`overrides`; `atol`/`rtol`: every output). `load_inputs` replaces the generated
    feeds; `save_inputs`/`save_outputs` write the feeds and both runs' outputs (:mod:`.arrays`);
    `html` writes the run's report.html there (pass or fail; checked before any work)."""
    from dataclasses import replace

    from ..verify import InputInfo, make_feed, plan_inputs
    from ..verify import verify as run_verify
    from .arrays import load_feeds, save_feeds
    from .arrays import save_outputs as write_outputs

    if atol is not None or rtol is not None:
        overrides = replace(overrides, atol=atol if atol is not None else overrides.atol,
                            rtol=rtol if rtol is not None else overrides.rtol)
    progress = as_progress(status)
    if html is not None:
        check_html_target(Path(html))
    header = model_header(original)  # bad input (missing, not ONNX) is exit 2 here
    check_output_names(header, overrides)
    options = verify_options(recipe, overrides, header)
    n = iterations or DEFAULT_ITERATIONS
    feeds = None
    if load_inputs:
        feeds = load_feeds(load_inputs, plan_inputs(header, options), header)
        n = len(feeds)
    elif save_inputs is not None:  # the feeds verify would make, made here so that they can be saved
        plans = plan_inputs(header, options)
        rng = np.random.default_rng(seed)
        feeds = [make_feed(plans, rng) for _ in range(n)]
    del header  # a model with its weights inside holds them: the stage loads its own
    outputs: dict = {}
    with progress.step("verify") as step:
        result = run_verify(original, candidate, options, iterations=n, seed=seed, feeds=feeds,
                            on_iteration=lambda i: progress(f"running iteration {i + 1}/{n}"),
                            on_outputs=outputs.update if save_outputs is not None else None)
        step.detail = (f"{result.iterations} iteration(s), {len(result.outputs) - len(result.failed)}/"
                       f"{len(result.outputs)} output(s) within tolerance")
    if load_inputs:  # the inputs table names the files, not the generator verify did not use
        source = f"--load-inputs {', '.join(map(str, load_inputs))}"
        result.inputs = [InputInfo(name, arr.dtype.name, list(arr.shape), source) for name, arr in feeds[0].items()]
    if save_inputs is not None:
        save_feeds(save_inputs, feeds)
    if save_outputs is not None:
        write_outputs(save_outputs, outputs)
    if html is not None:
        write_verify_html(result, candidate, Path(html))
    return result


def write_verify_html(result: VerifyResult, candidate: str | os.PathLike, html: Path,
                      per_node: dict[str, Any] | None = None) -> None:
    """The page of one verify run at `html` (`per_node`: report.per_node.per_node_facts of
    ``verify --per-node``); a page that cannot be written is an InputError naming it."""
    from ..report import verify_facts, write_html
    from ..verify import precision_of

    try:
        write_html(verify_facts(result, precision_of(model_header(candidate)), per_node=per_node), html)
    except OSError as exc:
        raise InputError(f"cannot write {html}: {exc.strerror or exc}") from None


def check_html_target(path: Path) -> None:
    """InputError (exit 2) unless report.html can be written at `path`: the report extra is
    installed, the folder exists and `path` is not a folder."""
    from ..report import missing_extra

    missing = missing_extra()
    if missing:
        raise InputError(f"--html: {missing}")
    if path.is_dir():
        raise InputError(f"--html {path}: is a directory")
    if not path.parent.is_dir():
        raise InputError(f"--html {path}: folder {path.parent} does not exist")


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
