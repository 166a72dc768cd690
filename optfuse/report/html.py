"""``report.html``: one self-contained page of a run's facts (:mod:`.facts`), readable offline.

The page is rendered from ``templates/report.html.j2`` (jinja2, autoescaped) with its plots as
inline SVG (matplotlib, Agg backend): HBM traffic saved per family, the |diff| CDF of each output
against its atol (a series per check, i.e. per candidate precision), and the per-node error growth
along the graph's depth with the top offenders labelled (the precision decisions and unfused
nodes the attribution ranks high as crosses; an overflow's infinite growth drawn above the rest). Nothing on the page refers to the
network: no script, font, stylesheet or image from elsewhere (the SVGs lose their XML namespace
and metadata URLs, which inline SVG in HTML does not need).

jinja2 and matplotlib are the ``report`` extra (``pip install 'optfuse[report]'``), not core
dependencies: :func:`missing_extra` says what is missing, and the callers write the Markdown and
JSON reports without the page.
"""

from __future__ import annotations

import importlib
import io
import math
import re
from contextlib import contextmanager
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .common import atomic_write, format_bytes
from .facts import PER_NODE_NOT_RUN

REPORT_HTML = "report.html"
EXTRA_HINT = "report.html needs pip install 'optfuse[report]' (jinja2 and matplotlib)"
#: the id of every section of the page (the browser test looks for each)
SECTION_IDS = ("summary", "not-run", "fusion", "hbm", "accuracy", "per-node", "build")
#: outputs drawn as |diff| CDFs (the worst first, by max abs over atol); the table lists every one
PLOTTED_OUTPUTS = 6
#: ranked offenders listed on the page; of these, the precision decisions and unfused nodes are
#: also drawn in the per-node plot when among the first PLOTTED_OTHERS
TOP_ATTRIBUTION, PLOTTED_OTHERS = 10, 5
#: decades of log scale the per-node growth axis shows below its largest value (linear under them)
GROWTH_DECADES = 4
_KIND_LABELS = {"cast": "precision Cast", "keep_fp32": "kept FP32", "node": "unfused node"}
_EXTRA_MODULES = ("jinja2", "matplotlib")


def missing_extra() -> str | None:
    """None when report.html can be written, else the one line saying what to install."""
    for name in _EXTRA_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            return EXTRA_HINT
    return None


# ------------------------------------------------------------------------------------------------
# Plots (inline SVG)
# ------------------------------------------------------------------------------------------------
@contextmanager
def _figure(salt: str, figsize: tuple[float, float]):
    """A matplotlib figure and axes under the page's settings (the caller's rcParams untouched)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    # text stays text (no glyph paths); ids differ between the page's figures (they share one document)
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": salt, "font.size": 9,
                                "font.family": "sans-serif"}):
        fig, ax = plt.subplots(figsize=figsize)
        try:
            yield fig, ax
        finally:
            plt.close(fig)


def _svg(fig, prefix: str) -> str:
    """`fig` as an SVG element for an HTML page: no XML prolog, DOCTYPE, metadata or namespace URLs,
    every element id (and each reference to one) prefixed, unique in a page of several figures."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Creator": None, "Date": None, "Format": None,
                                                                     "Type": None})
    text = buf.getvalue()
    text = text[text.index("<svg"):]
    text = re.sub(r"<metadata>.*?</metadata>", "", text, flags=re.S)
    text = re.sub(r'\s+xmlns(:\w+)?="[^"]*"', "", text)
    text = re.sub(r'\bid="([^"]+)"', lambda m: f'id="{prefix}-{m.group(1)}"', text)
    return re.sub(r'(url\(|href=")#([^)"]+)', lambda m: f"{m.group(1)}#{prefix}-{m.group(2)}", text)


def hbm_svg(hbm: Mapping[str, Any]) -> str | None:
    """Bars of the HBM bytes saved per family and in total; None when nothing was estimated."""
    per_family = dict(hbm.get("per_family") or {})
    if not per_family:
        return None
    labels = [*per_family, "total"]
    values = [*per_family.values(), hbm.get("total", sum(per_family.values()))]
    from matplotlib.ticker import MaxNLocator

    with _figure("hbm", (6.4, 0.45 * len(labels) + 0.9)) as (fig, ax):
        bars = ax.barh(labels, values, color=["#4878a8"] * len(per_family) + ["#2d4d6e"])
        ax.invert_yaxis()
        for bar, v in zip(bars, values):  # right of the bar, or of 0 for a family that saves less than nothing
            ax.annotate(format_bytes(int(v)), (max(v, 0), bar.get_y() + bar.get_height() / 2), xytext=(3, 0),
                        textcoords="offset points", va="center")
        ax.xaxis.set_major_formatter(lambda v, _pos: format_bytes(int(v)))
        ax.set_xlabel("estimated HBM traffic saved per run")
        ax.set_xlim(min(min(values) * 1.25, 0), max(max(values) * 1.25, 1))  # a family can save less than 0
        ax.xaxis.set_major_locator(MaxNLocator(nbins=5))
        ax.spines[["top", "right"]].set_visible(False)
        return _svg(fig, "hbm")


def _output_ratio(o: Mapping[str, Any]) -> float:
    return float(o["max_abs"]) / max(float(o["atol"]), 1e-30)


def worst_outputs(accuracy: Mapping[str, Any], n: int = PLOTTED_OUTPUTS) -> list[str]:
    """The names of the `n` outputs with the largest max abs / atol over every check."""
    worst: dict[str, float] = {}
    for check in accuracy.values():
        for o in check.get("outputs") or ():
            worst[o["name"]] = max(worst.get(o["name"], 0.0), _output_ratio(o))
    return sorted(worst, key=lambda k: -worst[k])[:n]


def error_svg(output: str, series: Sequence[tuple[str, Mapping[str, Any]]], key: str = "err") -> str | None:
    """The CDF of |diff| of one output, a line per (label, output result) with quantiles, and
    each distinct atol as a vertical line; None when no series has quantiles. `key`: the figure's
    id prefix (one per figure of a page)."""
    drawn = [(label, o) for label, o in series if o.get("abs_quantiles")]
    if not drawn:
        return None
    positive = [q for _, o in drawn for _, q in o["abs_quantiles"] if q > 0 and math.isfinite(q)]
    floor = min(positive) / 10 if positive else 1e-12
    with _figure(key, (6.4, 2.8)) as (fig, ax):
        _draw_cdf(ax, drawn, floor, output)
        return _svg(fig, key)


def _draw_cdf(ax, drawn: Sequence[tuple[str, Mapping[str, Any]]], floor: float, output: str) -> None:
    for label, o in drawn:
        ps = [p for p, _ in o["abs_quantiles"]]
        qs = [max(q, floor) if math.isfinite(q) else float("nan") for _, q in o["abs_quantiles"]]
        ax.plot(qs, ps, marker=".", label=f"{label} (max {o['max_abs']:.3g})")
    for atol in sorted({float(o["atol"]) for _, o in drawn}):
        ax.axvline(max(atol, floor), color="#c0392b", linestyle="--", linewidth=1)
        ax.annotate(f"atol {atol:g}", (max(atol, floor), 0.02), color="#c0392b", rotation=90, ha="right", va="bottom")
    ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel(f"|diff| of {output} (pass: |diff| <= atol + rtol * |ref| per element)")
    ax.set_ylabel("fraction of elements")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(True, which="major", alpha=0.3)


def per_node_svg(per_node: Sequence[Mapping[str, Any]], offenders: Sequence[Mapping[str, Any]],
                 attribution: Sequence[Mapping[str, Any]] = ()) -> str | None:
    """The error each fused node adds (growth) against its depth in the graph, the offenders named;
    the top precision decisions and unfused nodes of the attribution as crosses."""
    others = [o for o in attribution[:PLOTTED_OTHERS] if o["kind"] != "fused_node" and "depth" in o]
    if not per_node and not others:
        return None
    with _figure("per-node", (7.2, 3.2)) as (fig, ax):
        _draw_growth(ax, per_node, offenders, others)
        return _svg(fig, "per-node")


def _draw_growth(ax, per_node: Sequence[Mapping[str, Any]], offenders: Sequence[Mapping[str, Any]],
                 others: Sequence[Mapping[str, Any]]) -> None:
    growths = [float(e["growth"]) for e in [*per_node, *others]]
    finite = [abs(g) for g in growths if math.isfinite(g) and g != 0]
    top = max(finite, default=1.0) * 10  # where a non-finite growth (an FP16 overflow) is drawn

    def y(e: Mapping[str, Any]) -> float:
        g = float(e["growth"])
        return g if math.isfinite(g) else top

    ops = sorted({str(e["op"]) for e in per_node})
    for op in ops:
        pts = [e for e in per_node if str(e["op"]) == op]
        ax.scatter([e["depth"] for e in pts], [y(e) for e in pts], s=18, label=op)
    for kind in dict.fromkeys(o["kind"] for o in others):
        pts = [o for o in others if o["kind"] == kind]
        ax.scatter([o["depth"] for o in pts], [y(o) for o in pts], s=30, marker="x", label=_KIND_LABELS.get(kind, kind))
    for e, name in [*((e, e["node"]) for e in offenders), *((o, o["name"]) for o in others)]:
        g = float(e["growth"])
        if math.isfinite(g) and g <= 0:
            continue  # adds no error: not labelled as an offender
        label = str(name).removeprefix("optfuse/")  # a fused node's rule id and index say enough
        ax.annotate(label + ("" if math.isfinite(g) else f" ({g})"), (e["depth"], y(e)), xytext=(4, 4),
                    textcoords="offset points", fontsize=7, color="#c0392b")
    # linear below linthresh, log above: at most GROWTH_DECADES decades of log scale below the largest
    linthresh = max(min(finite), max(finite) * 10.0 ** -GROWTH_DECADES) if finite else 1e-6
    ax.set_yscale("symlog", linthresh=linthresh)
    ax.set_xlabel("depth in the graph (nodes from the inputs)")
    ax.set_ylabel("error added (growth)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.grid(True, alpha=0.3)


# ------------------------------------------------------------------------------------------------
# The page
# ------------------------------------------------------------------------------------------------
def _plots(facts: Mapping[str, Any]) -> dict[str, Any]:
    accuracy = facts.get("accuracy") or {}
    mode = (facts.get("precision") or {}).get("mode", "")
    errors = []
    for i, name in enumerate(worst_outputs(accuracy)):
        series = [(f"{label} ({mode})" if mode else label, o) for label, check in accuracy.items()
                  for o in check.get("outputs") or () if o["name"] == name]
        errors.append({"output": name, "svg": error_svg(name, series, key=f"err{i}")})
    fusion = facts.get("fusion")
    per_node = facts.get("per_node")
    return {"hbm": hbm_svg(fusion["hbm"]) if fusion else None, "errors": errors,
            "per_node": per_node_svg(per_node, facts.get("top_offenders") or [], facts.get("attribution") or [])
            if per_node is not None else None}


def _environment():
    import jinja2

    env = jinja2.Environment(loader=jinja2.PackageLoader("optfuse.report", "templates"),
                             autoescape=jinja2.select_autoescape(["html", "j2"]), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True)
    env.filters["bytes"] = format_bytes
    env.filters["g3"] = lambda v: "unknown" if v is None else f"{float(v):.3g}"
    return env


def render_html(facts: Mapping[str, Any]) -> str:
    """The page of `facts` (a :mod:`.facts` dict). Needs the ``report`` extra (see :func:`missing_extra`)."""
    from markupsafe import Markup

    plots = _plots(facts)
    svg = {k: Markup(v) if isinstance(v, str) else v for k, v in plots.items() if k != "errors"}
    svg["errors"] = [{"output": e["output"], "svg": Markup(e["svg"]) if e["svg"] else None} for e in plots["errors"]]
    return _environment().get_template("report.html.j2").render(
        facts=facts, plots=svg, section_ids=SECTION_IDS, per_node_not_run=PER_NODE_NOT_RUN,
        top_attribution=TOP_ATTRIBUTION)


def write_html(facts: Mapping[str, Any], path: Path) -> Path:
    """Write the page of `facts` to `path` (atomically)."""
    atomic_write(path, render_html(facts))
    return path
