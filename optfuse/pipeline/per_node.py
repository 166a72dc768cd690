"""``verify --per-node`` and convert's per-node step: the plain verify, then every tensor both models
compute compared on the same feeds (:mod:`optfuse.verify.per_node`), the offenders ranked, and
the facts every report renders (:func:`optfuse.report.per_node.per_node_facts`).

    original + candidate --verify_per_node--> VerifyResult + per-node errors + ranked offenders
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..recipe import Recipe
from ..verify import DEFAULT_ITERATIONS, VerifyOptions, VerifyResult
from ..verify.per_node import Offender, PerNodeResult
from .options import NO_OVERRIDES, Overrides, Progress, Status, as_progress, model_header, noop, verify_options


@dataclass
class PerNodeOutcome:
    verification: VerifyResult
    per_node: PerNodeResult
    offenders: list[Offender]
    facts: dict[str, Any]  # report.per_node.per_node_facts


def verify_per_node(original: str | os.PathLike, candidate: str | os.PathLike, recipe: Recipe | None = None,
                    iterations: int | None = None, seed: int = 0, status: Status = noop, *,
                    overrides: Overrides = NO_OVERRIDES, load_inputs: Sequence[os.PathLike | str] = (),
                    chunk_size: int | None = None, save_inputs: str | os.PathLike | None = None,
                    save_outputs: str | os.PathLike | None = None,
                    html: str | os.PathLike | None = None) -> PerNodeOutcome:
    """The plain verify, then every shared tensor compared on the same feeds and the offenders
    ranked; `save_inputs`/`save_outputs` as for verify, `html`: the run's report.html with the
    per-node facts (pass or fail; checked before any work)."""
    from .fuse import check_html_target, verify, write_verify_html

    if html is not None:
        check_html_target(Path(html))
    progress = as_progress(status)
    result = verify(original, candidate, recipe, iterations=iterations, seed=seed, status=progress,
                    overrides=overrides, load_inputs=load_inputs, save_inputs=save_inputs, save_outputs=save_outputs)
    options = verify_options(recipe, overrides, model_header(original))
    per, offenders, facts = per_node_check(original, candidate, options, iterations, seed, progress,
                                           load_inputs=load_inputs, chunk_size=chunk_size)
    if html is not None:
        write_verify_html(result, candidate, Path(html), per_node=facts)
    return PerNodeOutcome(result, per, offenders, facts)


def per_node_check(original: str | os.PathLike, candidate: str | os.PathLike, options: VerifyOptions,
                   iterations: int | None, seed: int, progress: Progress, *,
                   load_inputs: Sequence[os.PathLike | str] = (),
                   chunk_size: int | None = None) -> tuple[PerNodeResult, list[Offender], dict[str, Any]]:
    """The per-node comparison (the feeds verify used: `load_inputs`, else the seeded ones) as a
    step of `progress`: the result, its ranked offenders and its facts (report.per_node)."""
    from ..report.per_node import per_node_facts
    from ..verify import plan_inputs
    from ..verify.per_node import DEFAULT_CHUNK_SIZE, attribute, compare_per_node
    from .arrays import load_feeds

    feeds = None
    if load_inputs:
        header = model_header(original)
        feeds = load_feeds(load_inputs, plan_inputs(header, options), header)
        del header
    with progress.step("per-node") as step:
        per = compare_per_node(original, candidate, options, iterations=iterations or DEFAULT_ITERATIONS, seed=seed,
                               feeds=feeds, chunk_size=chunk_size or DEFAULT_CHUNK_SIZE,
                               on_chunk=lambda i, n: progress(f"chunk {i + 1}/{n}"))
        offenders = attribute(per)
        step.detail = per_node_line(per, offenders)
    return per, offenders, per_node_facts(per, offenders)


def per_node_line(per: PerNodeResult, offenders: Sequence[Offender]) -> str:
    """One line: what was compared, and the top offender."""
    line = f"{len(per.tensors)} tensors compared in {per.chunks} chunk(s), {len(per.fused)} fused node(s)"
    if offenders:
        top = offenders[0]
        line += f"; top offender: {top.kind} {top.name} (" + (
            "FP16 overflow" if top.overflow else f"adds {top.growth:.3g}") + ")"
    return line
