"""``optfuse debug``: where a candidate's error comes from, as a recipe change.

    model + recipe --debug--> the smallest recipe change that passes, and every step

(``verify --per-node``, the per-node comparison it starts from, is :mod:`.per_node`.)

``debug`` builds the candidate as ``convert`` does before TensorRT (fuse, then precision, per the
recipe) and checks it in onnxruntime against the FP32 original. When it fails, it searches, in
optfuse's own terms, like ``polygraphy debug reduce`` / ``precision``:

1. fusion families: the fewest families whose fusions, all left out, make it pass;
2. within them, the fewest rule ids (``fusions.disabled_rules``);
3. within those rules, the fewest fused nodes (``fusions.skip_nodes``: the original nodes they
   replaced); when every node of the rules is needed, the rule ids are the patch;
4. when no fusion change passes and the candidate computes in FP16/BF16: the nodes to keep in FP32
   (``precision.keep_fp32``), guided by the attribution (an overflowing tensor's producer first; the
   consumers of an overflowing Cast next), one node per round, then each dropped again if the
   rest still passes.

Each search over a list ranked most-suspect first (by the per-node attribution of the failing
candidate) takes the shortest passing prefix (bisection over its length) and then drops every
member whose removal still passes. Every candidate tried is a step of the report.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import onnx

from ..errors import InputError, VerificationError
from ..recipe import Recipe
from ..verify import DEFAULT_ITERATIONS, VerifyResult
from ..verify.per_node import Offender, PerNodeResult
from .options import (NO_OVERRIDES, Overrides, Status, as_progress, check_output_names, enabled_families,
                      fusion_options, model_header, noop, precision_options, verify_options)

#: Rounds of the precision search (one node kept in FP32 per round).
MAX_PRECISION_ROUNDS = 12
DEBUG_JSON, DEBUG_MD, PATCH_YAML = "debug_report.json", "debug_report.md", "recipe_patch.yaml"


@dataclass(frozen=True)
class Change:
    """A change to the recipe: families and rules off, nodes not fused, nodes kept in FP32."""

    families: tuple[str, ...] = ()
    rules: tuple[str, ...] = ()
    skip_nodes: tuple[str, ...] = ()
    keep_fp32: tuple[str, ...] = ()

    def describe(self) -> str:
        parts = [f"{label} {', '.join(v)}" for label, v in
                 (("families off:", self.families), ("rules off:", self.rules),
                  ("nodes not fused:", self.skip_nodes), ("kept FP32:", self.keep_fp32)) if v]
        return "; ".join(parts) or "the recipe as it is"


@dataclass
class DebugStep:
    stage: str  # baseline | families | rules | nodes | precision | final
    change: str
    passed: bool
    worst: str  # report.verify_line of the check


@dataclass
class DebugOutcome:
    model: Path
    outdir: Path
    passed_before: bool
    passed_after: bool
    change: Change | None
    patch: dict[str, Any]  # the recipe fields to set (YAML)
    steps: list[DebugStep] = field(default_factory=list)
    fault: str = ""  # what was found, in one line
    facts: dict[str, Any] = field(default_factory=dict)  # per-node facts of the failing candidate
    files: list[Path] = field(default_factory=list)


@dataclass
class Trial:
    """One candidate checked: onnxruntime's verdict, and (reduced precision) the tensors that
    overflowed FP16 in the per-node run, which fail it too (onnxruntime's CPU provider computes
    chains of FP16 nodes in FP32 and can skip the rounding between them; a GPU engine does not)."""

    result: VerifyResult
    path: Path
    overflow: list[str] = field(default_factory=list)
    per_node: PerNodeResult | None = None
    offenders: list[Offender] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.result.passed and not self.overflow


class _Trials:
    """Builds and checks candidates: fuse + precision per the recipe and a Change, onnxruntime vs
    the FP32 original on fixed feeds; one Trial per distinct Change."""

    def __init__(self, path: Path, recipe: Recipe | None, overrides: Overrides, iterations: int, seed: int,
                 workdir: Path, status: Callable[[str], None]):
        from ..pipeline.model import load_checked

        self.path, self.recipe, self.workdir, self.status = path, recipe, workdir, status
        self.iterations, self.seed = iterations, seed
        self.proto = load_checked(path, weights="disk")
        check_output_names(self.proto, overrides)
        self.options = verify_options(recipe, overrides, self.proto)
        self.families = enabled_families(recipe)
        self.fusion = fusion_options(recipe)
        self.precision = precision_options(recipe, overrides)
        self.calibration = None
        if self.precision.mode == "fp8":  # one set of calibration batches for every trial
            from .fp8 import calibration_feeds

            self.calibration = calibration_feeds(self.proto, recipe, overrides)
        self.cache: dict[Change, Trial] = {}
        self.steps: list[DebugStep] = []
        self.prefix = "trial"  # of the candidate files in `workdir`

    def check(self, change: Change, stage: str) -> Trial:
        from ..report import verify_line

        if change not in self.cache:
            self.status(f"{stage}: {change.describe()}")
            trial = self._evaluate(change, len(self.cache))
            if self.precision.mode != "fp32":
                self.ranked(trial)
                trial.overflow = [t.range_text() for t in trial.per_node.tensors.values() if t.overflow]
            worst = verify_line(trial.result) + (f"; FP16 overflow: {trial.overflow[0]}" if trial.overflow else "")
            self.steps.append(DebugStep(stage, change.describe(), trial.passed, worst))
            self.cache[change] = trial
        return self.cache[change]

    def passes(self, change: Change, stage: str) -> bool:
        return self.check(change, stage).passed

    def ranked(self, trial: Trial) -> list[Offender]:
        """The trial's offenders (its per-node comparison, run once)."""
        from ..verify.per_node import attribute, compare_per_node

        if trial.per_node is None:
            trial.per_node = compare_per_node(self.path, trial.path, self.options, iterations=self.iterations,
                                              seed=self.seed)
            trial.offenders = attribute(trial.per_node)
        return trial.offenders

    def _evaluate(self, change: Change, k: int) -> Trial:
        from ..fusions import fuse_model
        from ..ir import load_model, save_model
        from ..precision import apply_precision
        from ..verify import verify

        families = [f for f in self.families if f not in change.families]
        options = replace(self.fusion, disabled_rules=self.fusion.disabled_rules | set(change.rules),
                          skip_nodes=self.fusion.skip_nodes + change.skip_nodes)
        fused, _ = fuse_model(self.proto, families=families, options=options, weights_dir=self.path.parent)
        fused_path = save_model(fused, self.workdir / f"{self.prefix}{k}.fused.onnx", weights_dir=self.path.parent)
        cand_path = fused_path
        if self.precision.mode != "fp32":
            precision = replace(self.precision, keep_fp32=self.precision.keep_fp32 + change.keep_fp32)
            cand, _ = apply_precision(load_model(fused_path), precision, self.calibration)
            cand_path = save_model(cand, self.workdir / f"{self.prefix}{k}.{precision.mode}.onnx")
        try:
            result = verify(self.path, cand_path, self.options, iterations=self.iterations, seed=self.seed)
        except VerificationError as exc:  # a candidate onnxruntime cannot run fails this trial
            raise VerificationError(f"{change.describe()}: {exc}") from None
        return Trial(result, cand_path)


def smallest(items: Sequence[Any], passes: Callable[[tuple], bool]) -> tuple | None:
    """A small subset of `items` (ranked most-suspect first) for which `passes` holds: the shortest
    passing prefix (bisection over its length), then each member dropped while the rest passes.
    None when even all of them do not pass."""
    items = tuple(items)
    if not items or not passes(items):
        return None
    lo, hi = 1, len(items)
    while lo < hi:
        mid = (lo + hi) // 2
        if passes(items[:mid]):
            hi = mid
        else:
            lo = mid + 1
    chosen = items[:lo]
    for x in chosen[::-1]:
        rest = tuple(y for y in chosen if y != x)
        if rest and passes(rest):
            chosen = rest
    return chosen


def _fusion_search(trials: _Trials, per: PerNodeResult, offenders: list[Offender]) -> tuple[Change, str] | None:
    """Families, then rules, then fused nodes (module doc, steps 1-3); None when leaving out every
    fusion does not pass either."""
    rank = {o.name: i for i, o in enumerate(offenders)}
    fused = sorted(per.fused, key=lambda n: rank.get(n.node, len(rank)))
    families = list(dict.fromkeys(n.rule.split(".")[0] for n in fused if n.rule))
    fams = smallest(families, lambda s: trials.passes(Change(families=s), "families"))
    if fams is None:
        return None
    rules = list(dict.fromkeys(n.rule for n in fused if n.rule.split(".")[0] in fams))
    picked_rules = smallest(rules, lambda s: trials.passes(Change(rules=s), "rules"))
    if picked_rules is None:
        return Change(families=fams), f"the fusions of {', '.join(fams)} add the error (no subset of their rules)"
    nodes = [n for n in fused if n.rule in picked_rules]

    def skipped(chosen) -> tuple[str, ...]:
        return tuple(dict.fromkeys(x for n in chosen for x in n.replaced))

    picked = smallest(nodes, lambda s: trials.passes(Change(skip_nodes=skipped(s)), "nodes"))
    if picked is None or len(picked) == len(nodes):
        return (Change(rules=picked_rules),
                f"every fused node of rule {', '.join(picked_rules)} adds error ({len(nodes)} node(s))")
    names = ", ".join(f"{n.node} (replacing {', '.join(n.replaced)})" for n in picked)
    return Change(skip_nodes=skipped(picked)), f"fused node(s) {names} add the error"


def _precision_search(trials: _Trials, trial: Trial) -> tuple[Change, str] | None:
    """Nodes kept in FP32, one per round, guided by the attribution; then each dropped again when
    the rest still passes (module doc, step 4)."""
    keep: list[str] = []
    reasons: dict[str, str] = {}
    for _ in range(MAX_PRECISION_ROUNDS):
        new = _fp32_fix(trials.ranked(trial), onnx.load(str(trial.path), load_external_data=False), keep)
        if not new:
            return None
        for name, why in new:
            keep.append(name)
            reasons[name] = why
        trial = trials.check(Change(keep_fp32=tuple(keep)), "precision")
        if trial.passed:
            break
    else:
        return None
    for name in keep[::-1]:
        rest = tuple(k for k in keep if k != name)
        if rest and trials.passes(Change(keep_fp32=rest), "precision"):
            keep = list(rest)
    why = "; ".join(f"{k}: {reasons[k]}" for k in keep)
    return Change(keep_fp32=tuple(keep)), f"precision: {len(keep)} node(s) must stay FP32 ({why})"


def _fp32_fix(offenders: list[Offender], model: onnx.ModelProto, keep: list[str]) -> list[tuple[str, str]]:
    """The nodes to keep in FP32 next: the top offender's own node, or for a precision Cast the
    nodes that read what it casts (the tensor stays FP32 for them); (name, why) pairs."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        for t in n.input:
            readers.setdefault(t, []).append(n)
    by_name = {n.name: n for n in model.graph.node}
    for o in offenders:
        if o.kind == "keep_fp32" or not (o.overflow or o.growth > 0):
            continue
        why = o.detail.split("; ")[-1] if o.overflow else f"adds {o.growth:.3g}"
        if o.kind == "cast" and o.name in by_name:
            out = by_name[o.name].output[0]
            new = [r.name for r in readers.get(out, []) if r.op_type != "Cast" and r.name and r.name not in keep]
            if new:
                return [(r, f"reads {out}, cast by {o.name}: {why}") for r in new]
        elif o.name not in keep and o.kind != "cast":
            return [(o.name, why)]
    return []


def recipe_patch(trials: _Trials, change: Change) -> dict[str, Any]:
    """The recipe fields that make `change` (lists in full: a patch's list replaces the recipe's)."""
    fusions: dict[str, Any] = {fam: False for fam in change.families}
    if change.rules:
        fusions["disabled_rules"] = sorted(set(trials.fusion.disabled_rules) | set(change.rules))
    if change.skip_nodes:
        fusions["skip_nodes"] = list(dict.fromkeys([*trials.fusion.skip_nodes, *change.skip_nodes]))
    patch: dict[str, Any] = {"fusions": fusions} if fusions else {}
    if change.keep_fp32:
        patch["precision"] = {"keep_fp32": list(dict.fromkeys([*trials.precision.keep_fp32, *change.keep_fp32]))}
    return patch


def patched_recipe(recipe: Recipe | None, path: Path | None, mode: str, patch: dict[str, Any]) -> dict[str, Any]:
    """The whole recipe with the patch applied; `path`: the model given on the command line (made
    absolute), None to keep the recipe's own model section (a relative path made absolute)."""
    data = recipe.model_dump(mode="json", exclude_defaults=True) if recipe is not None else {}
    data.setdefault("name", path.stem if path is not None else "model")
    if path is not None:
        data["model"] = {"path": str(path.resolve())}
    elif recipe is not None and recipe.model.path is not None:
        data["model"] = {"path": str(recipe.resolve_path(recipe.model.path).resolve())}
    for section, fields in patch.items():
        data.setdefault(section, {}).update(fields)
    if mode != "fp32":
        data.setdefault("precision", {})["mode"] = mode
    return data


def debug(model: str | os.PathLike | None, recipe: Recipe | None, outdir: str | os.PathLike, *,
          iterations: int | None = None, seed: int = 0, status: Status = noop,
          overrides: Overrides = NO_OVERRIDES) -> DebugOutcome:
    """Find the smallest recipe change that makes the candidate pass (module doc) and write
    ``recipe_patch.yaml``, ``<name>.patched.yaml`` and ``debug_report.{json,md}`` into `outdir`.

    Raises VerificationError (exit 1) after writing the report when no change is found."""
    from .model import resolve_model

    if recipe is None and model is None:
        raise InputError("no model given: pass MODEL.onnx or a recipe (-r) that names one")
    outdir = Path(outdir)
    if outdir.exists() and not outdir.is_dir():
        raise InputError(f"output directory {outdir} is a file")
    progress = as_progress(status)
    progress.plan(3)
    with tempfile.TemporaryDirectory(prefix="optfuse-debug-") as tmp:
        with progress.step("load") as step:
            path = resolve_model(model, recipe, workdir=Path(tmp), status=progress)
            trials = _Trials(path, recipe, overrides, iterations or DEFAULT_ITERATIONS, seed, Path(tmp), progress)
            step.detail = f"{len(trials.proto.graph.node)} nodes; {trials.precision.mode}"
        with progress.step("search") as step:
            outcome = _search(trials, path, outdir)
            step.detail = outcome.fault
        if outcome.change is not None:
            with progress.step("check the patched recipe") as step:
                outcome.passed_after = _check_patched(trials, recipe, model, path, outcome)
                step.detail = "passes" if outcome.passed_after else "FAILS"
        outcome.steps = trials.steps
        outcome.files = _write_outputs(outcome, recipe, None if model is None else path, trials.precision.mode)
    if not outcome.passed_after:
        raise VerificationError(f"debug: {outcome.fault} (report: {outdir / DEBUG_MD})")
    return outcome


def _search(trials: _Trials, path: Path, outdir: Path) -> DebugOutcome:
    from ..report.per_node import per_node_facts

    base = trials.check(Change(), "baseline")
    outcome = DebugOutcome(path, outdir, base.passed, base.passed, None, {})
    if base.passed:
        outcome.fault = "the candidate passes as the recipe makes it: nothing to change"
        if base.per_node is not None:  # compared already (reduced precision): the report shows it
            outcome.facts = per_node_facts(base.per_node, base.offenders)
        return outcome
    offenders = trials.ranked(base)
    outcome.facts = per_node_facts(base.per_node, offenders)
    found = _fusion_search(trials, base.per_node, offenders)
    if found is None and trials.precision.mode != "fp32":
        found = _precision_search(trials, base)
    if found is None:
        outcome.fault = "no fusion or precision change found that passes"
        return outcome
    outcome.change, outcome.fault = found
    outcome.patch = recipe_patch(trials, outcome.change)
    return outcome


def _check_patched(trials: _Trials, recipe: Recipe | None, model, path: Path, outcome: DebugOutcome) -> bool:
    """The patched recipe, read back as a recipe, makes a candidate that passes."""
    from ..recipe import recipe_from_dict

    data = patched_recipe(recipe, None if model is None else path, trials.precision.mode, outcome.patch)
    if recipe is not None and recipe.model.export is not None and model is None:
        data["model"] = {"path": str(path.resolve())}  # the model this run exported
    patched = recipe_from_dict(data, label="patched recipe")
    check = _Trials(path, patched, NO_OVERRIDES, trials.iterations, trials.seed, trials.workdir, trials.status)
    check.prefix = "patched"
    final = check.check(Change(), "final")
    trials.steps.append(replace(check.steps[-1], change="the patched recipe"))
    return final.passed


def _write_outputs(outcome: DebugOutcome, recipe: Recipe | None, path: Path | None, mode: str) -> list[Path]:
    """recipe_patch.yaml and <name>.patched.yaml (when a change was found), debug_report.{json,md}."""
    import yaml

    from ..report.per_node import debug_markdown

    report = debug_dict(outcome)
    files: dict[str, str] = {DEBUG_JSON: json.dumps(report, indent=1, default=str), DEBUG_MD: debug_markdown(report)}
    if outcome.change is not None:
        files[PATCH_YAML] = yaml.safe_dump(outcome.patch, sort_keys=False)
        name = recipe.name if recipe is not None else outcome.model.stem
        files[f"{name}.patched.yaml"] = yaml.safe_dump(patched_recipe(recipe, path, mode, outcome.patch),
                                                        sort_keys=False)
    try:
        outcome.outdir.mkdir(parents=True, exist_ok=True)
        if outcome.change is None:  # a patch from an earlier run would read as this run's
            name = recipe.name if recipe is not None else outcome.model.stem
            for stale in (PATCH_YAML, f"{name}.patched.yaml"):
                (outcome.outdir / stale).unlink(missing_ok=True)
        written = []
        for name, text in files.items():
            target = outcome.outdir / name
            tmp = target.with_name(f".{name}.partial")
            tmp.write_text(text)
            os.replace(tmp, target)
            written.append(target)
    except OSError as exc:
        raise InputError(f"cannot write into {outcome.outdir}: {exc.strerror or exc}") from None
    return written


def debug_dict(outcome: DebugOutcome) -> dict[str, Any]:
    return {
        "model": str(outcome.model), "passed_before": outcome.passed_before, "passed_after": outcome.passed_after,
        "fault": outcome.fault, "patch": outcome.patch,
        "steps": [{"stage": s.stage, "change": s.change, "passed": s.passed, "worst": s.worst} for s in outcome.steps],
        **({"per_node": outcome.facts} if outcome.facts else {}),
    }
