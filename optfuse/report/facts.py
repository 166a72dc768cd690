"""The facts of a convert or verify run as one JSON-ready dict: ``report.json``, and what
``report.html`` draws (the Markdown summary states the same facts).

Sections (keys): ``steps``, ``not_run`` (what did not run and why), ``fusion`` (counts per op,
matches with rule ids, rejections with reasons, HBM traffic saved per family and in total),
``precision``, ``accuracy`` (each check with its per-output errors and |diff| quantiles), the
per-node comparison and ``build`` (None when no engine was built).

The per-node comparison (``verify --per-node``, ``convert --per-node`` / the recipe's
``verify.per_node``) is four keys, drawn from :func:`optfuse.report.per_node.per_node_facts`:

- ``per_node``: every fused node ``{node, op, rule, replaced, depth, err_in, err_out, growth}``
  (:data:`PER_NODE_KEYS`), None when the comparison did not run;
- ``attribution``: the ranked offenders ``{kind, name, growth, detail, depth}`` (kind fused_node,
  cast, keep_fp32 or node; an FP16 overflow first, naming the tensor and its range), [] when it
  did not run;
- ``top_offenders``: the fused-node entries that add the most error, in the attribution's order;
- ``per_node_run``: how it ran (``mode, iterations, seed, compared_tensors, chunks, chunk_size``)
  and ``overflow`` (each tensor past the FP16 range, with its range), None when it did not run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..precision import PrecisionResult
from ..trt.build import BuildReport
from ..verify import VerifyResult
from .accuracy import Check, accuracy_dict

REPORT_JSON = "report.json"
#: what the per-node section says when the per-node comparison did not run
PER_NODE_NOT_RUN = "verify --per-node was not requested (convert: --per-node, or verify.per_node in the recipe)"
#: the convert step of the per-node comparison (its own "not run" entry says why when skipped)
PER_NODE_STEP = "verify (per-node)"
#: the keys of one ``per_node`` entry
PER_NODE_KEYS = ("node", "op", "rule", "replaced", "depth", "err_in", "err_out", "growth")
#: how many per-node entries the report names as the top offenders
TOP_OFFENDERS = 5


def family_of(rule: str) -> str:
    """A rule id's fusion family (``gemm.residual`` -> ``gemm``)."""
    return rule.split(".", 1)[0]


def hbm_by_family(fusion: Mapping[str, Any]) -> dict[str, Any]:
    """HBM traffic saved per family and in total (bytes per run), and how many fusions have no estimate."""
    per_family: dict[str, int] = {}
    unknown: dict[str, int] = {}
    for f in fusion.get("fusions", []):
        fam = family_of(f["rule"])
        if f.get("hbm_saved_bytes") is None:
            unknown[fam] = unknown.get(fam, 0) + 1
        else:
            per_family[fam] = per_family.get(fam, 0) + int(f["hbm_saved_bytes"])
    return {"per_family": dict(sorted(per_family.items())), "total": sum(per_family.values()),
            "unknown_per_family": dict(sorted(unknown.items())), "dims": dict(fusion.get("dims") or {})}


def fusion_facts(fusion: Mapping[str, Any]) -> dict[str, Any]:
    keys = ("node", "op", "rule", "nodes", "hbm_saved_bytes", "hbm_moved_bytes")
    fusions = [{k: f.get(k) for k in keys} for f in fusion.get("fusions", [])]
    counts: dict[str, int] = {}
    for f in fusions:
        counts[f["op"]] = counts.get(f["op"], 0) + 1
    return {"counts": dict(sorted(counts.items())), "fusions": fusions,
            "rejected": [dict(r) for r in fusion.get("rejected", [])], "hbm": hbm_by_family(fusion)}


#: the keys of ``per_node_run`` (besides ``overflow``)
PER_NODE_RUN_KEYS = ("mode", "iterations", "seed", "compared_tensors", "chunks", "chunk_size", "left_out")


def _growth_key(e: Mapping[str, Any]) -> float:
    g = float(e["growth"])  # "inf" / "nan" (strict JSON) read back as floats
    return -g if not math.isnan(g) else math.inf


def top_offenders(per_node: Sequence[Mapping[str, Any]] | None, n: int = TOP_OFFENDERS,
                  attribution: Sequence[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
    """The `n` entries that add the most error: in the attribution's order when there is one (an
    overflow first), else largest growth first."""
    rank = {o["name"]: i for i, o in enumerate(attribution)}
    return [dict(e) for e in sorted(per_node or (), key=lambda e: (rank.get(e["node"], len(rank)), _growth_key(e)))[:n]]


def per_node_sections(per_node: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None) -> dict[str, Any]:
    """The facts' per-node keys (module doc) from the per-node facts
    (:func:`optfuse.report.per_node.per_node_facts`), from a bare list of fused-node entries (no
    attribution), or from None (not run)."""
    if per_node is None:
        return {"per_node": None, "attribution": [], "top_offenders": [], "per_node_run": None}
    if isinstance(per_node, Mapping):
        entries = [dict(e) for e in per_node.get("per_node") or ()]
        attribution = [dict(o) for o in per_node.get("attribution") or ()]
        run = {k: per_node[k] for k in PER_NODE_RUN_KEYS if k in per_node}
        run["overflow"] = list(per_node.get("overflow") or ())
    else:
        entries, attribution, run = [dict(e) for e in per_node], [], None
    return {"per_node": entries, "attribution": attribution, "top_offenders": top_offenders(entries, attribution=attribution),
            "per_node_run": run}


def not_run(steps: Sequence[Any], accuracy: Mapping[str, Check], per_node: Any) -> list[dict[str, str]]:
    """Every part of the run that did not run, and why."""
    out = [{"what": s.name, "why": s.detail} for s in steps if s.state == "skipped"]
    named = {o["what"] for o in out}
    for label, d in accuracy_dict(accuracy).items():
        if d.get("executed") is False and f"verify ({label})" not in named:
            out.append({"what": f"verify ({label})", "why": d.get("reason") or d.get("error", "")})
    if per_node is None and PER_NODE_STEP not in named:
        out.append({"what": "per-node comparison", "why": PER_NODE_NOT_RUN})
    return out


def convert_facts(name: str, model: Path, outdir: Path, steps: Sequence[Any], fusion: Mapping[str, Any],
                  precision: PrecisionResult, accuracy: Mapping[str, Check], build: BuildReport | None,
                  options: Mapping[str, Any] | None = None,
                  per_node: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The facts of a convert run (see the module doc; `per_node`: see :func:`per_node_sections`)."""
    return {
        "command": "convert", "name": name, "model": str(model), "outdir": str(outdir),
        "steps": [{"name": s.name, "state": s.state, "detail": s.detail} for s in steps],
        "not_run": not_run(steps, accuracy, per_node),
        "fusion": fusion_facts(fusion),
        "precision": precision.to_dict(),
        "accuracy": accuracy_dict(accuracy),
        **per_node_sections(per_node),
        "build": build.to_dict() if build is not None else None,
        "options": dict(options or {}),
    }


def verify_facts(result: VerifyResult, mode: str,
                 per_node: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The facts of a verify run: its one check (the candidate computed in precision `mode`) and,
    with ``--per-node``, the per-node facts (:func:`per_node_sections`); fusion and build are None
    (verify neither fuses nor builds)."""
    not_run_ = [{"what": "fuse, precision, build", "why": "verify compares two given models"}]
    if per_node is None:
        not_run_.append({"what": "per-node comparison", "why": PER_NODE_NOT_RUN})
    return {
        "command": "verify", "name": Path(result.candidate).stem if result.candidate else "verify",
        "model": result.original, "candidate": result.candidate,
        "steps": [{"name": "verify (onnxruntime)", "state": "ok" if result.passed else "failed", "detail": ""}],
        "not_run": not_run_,
        "fusion": None,
        "precision": {"mode": mode},
        "accuracy": {"onnxruntime": result.to_dict()},
        **per_node_sections(per_node),
        "build": None,
        "options": {},
    }
