"""report.html (optfuse.report.html) and report.json: every section, nothing from the network, the
missing-extra path, verify --html, and the page in headless Chromium (slow)."""

from __future__ import annotations

import json
import os
import re
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import onnx
import pytest

import browser
import graphs
from cli_checks import invoke, one_line
from optfuse.pipeline import convert
from optfuse.recipe import load_recipe
from optfuse.report import EXTRA_HINT, SECTION_IDS, missing_extra, render_html
from optfuse.report.facts import PER_NODE_NOT_RUN
from optfuse.verify import compare_arrays
from optfuse.verify.options import QUANTILE_LEVELS

RECIPE = """
name: block
model: {path: block.onnx}
inputs:
  x: {dtype: float32, shape: [b, s, 64]}
dims:
  b: {min: 1, opt: 2, max: 4}
  s: {min: 1, opt: 8, max: 16}
precision: {mode: fp16}
target: {arch: sm_90, backend: auto}
"""
#: where the browser test also writes its screenshot (docs/report.png is made this way)
SCREENSHOT_ENV = "OPTFUSE_REPORT_SCREENSHOT"
needs_extra = pytest.mark.skipif(missing_extra() is not None, reason=EXTRA_HINT)


@pytest.fixture
def recipe(tmp_path):
    onnx.save(graphs.residual_block(hidden=64, norm="layer_norm", n_layers=2), tmp_path / "block.onnx")
    (tmp_path / "r.yaml").write_text(RECIPE)
    return load_recipe(tmp_path / "r.yaml")


class _Page(HTMLParser):
    """Every element id, and every attribute that loads something (src, href, srcset, ...)."""

    def __init__(self):
        super().__init__()
        self.ids, self.loads, self.tags = [], [], set()

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        for k, v in attrs:
            if k == "id":
                self.ids.append(v)
            elif k in ("src", "srcset", "data", "poster", "action") or (k.endswith("href") and not (v or "").startswith("#")):
                self.loads.append((tag, k, v))


def parse(text: str) -> _Page:
    page = _Page()
    page.feed(text)
    return page


def assert_self_contained(text: str) -> None:
    page = parse(text)
    assert not re.search(r"https?://", text), re.search(r".{40}https?://.{40}", text)
    assert not page.loads, page.loads  # no image, script, stylesheet or font from elsewhere (nor from a file)
    assert not {"script", "link", "iframe", "img", "object", "embed"} & page.tags
    assert "@import" not in text and "url(http" not in text


def per_node_entries(n=12):
    rng = np.random.default_rng(0)
    return [{"node": f"optfuse/layer_norm.native/{i}", "op": "LayerNorm" if i % 2 else "GemmEpilogue",
             "rule": "layer_norm.native" if i % 2 else "gemm.residual", "replaced": [f"N_{i}", f"M_{i}"],
             "depth": 3 * i, "err_in": float(rng.random() * 1e-3), "err_out": float(rng.random() * 1e-2),
             "growth": float(i == 7) * 0.5 + float(rng.random() * 1e-3)} for i in range(n)]


# -------------------------------------------------------------------------------------------------
# the |diff| quantiles the per-output plot is drawn from
# -------------------------------------------------------------------------------------------------
def test_abs_quantiles_pool_every_iteration():
    rng = np.random.default_rng(1)
    ref = [rng.standard_normal((4, 50)).astype(np.float32) for _ in range(3)]
    got = [r + rng.standard_normal(r.shape).astype(np.float32) * 1e-3 for r in ref]
    res = compare_arrays("y", ref, got, 1e-2, 0.0)
    diff = np.concatenate([np.abs(r.astype(np.float64) - g.astype(np.float64)).ravel() for r, g in zip(ref, got)])
    assert [p for p, _ in res.abs_quantiles] == list(QUANTILE_LEVELS)
    np.testing.assert_allclose([q for _, q in res.abs_quantiles], np.quantile(diff, QUANTILE_LEVELS))
    assert res.abs_quantiles[-1][1] == res.max_abs


def test_abs_quantiles_of_a_shape_mismatch_are_empty():
    res = compare_arrays("y", [np.zeros((2, 3))], [np.zeros((3, 2))], 1e-3, 1e-3)
    assert not res.passed and res.abs_quantiles == []


# -------------------------------------------------------------------------------------------------
# convert: report.json, report.md and report.html state the same facts
# -------------------------------------------------------------------------------------------------
@needs_extra
def test_convert_writes_a_self_contained_report_html(tmp_path, recipe):
    out = tmp_path / "out"
    res = convert(None, recipe, out)
    assert res.passed and res.step("report.html").state == "ok"
    text = (out / "report.html").read_text()
    page = parse(text)
    assert set(SECTION_IDS) <= set(page.ids)
    assert len(page.ids) == len(set(page.ids))  # the figures' element ids do not collide
    assert_self_contained(text)
    assert text.count("<svg") == 2  # HBM per family, the |diff| CDF of y
    assert "partial-" not in text  # the staging folder's name was rewritten to the output folder
    facts = json.loads((out / "report.json").read_text())
    hbm = facts["fusion"]["hbm"]
    # 2 GemmEpilogue (residual taken) + 2 LayerNorm (saves nothing: one native op replaced)
    assert facts["fusion"]["counts"] == {"GemmEpilogue": 2, "LayerNorm": 2}
    assert set(hbm["per_family"]) == {"gemm", "layer_norm"} and hbm["per_family"]["gemm"] > 0
    assert hbm["total"] == sum(f["hbm_saved_bytes"] for f in facts["fusion"]["fusions"])
    assert {"what": "per-node comparison", "why": PER_NODE_NOT_RUN} in facts["not_run"]
    assert facts["per_node"] is None
    assert facts["accuracy"]["onnxruntime"]["outputs"][0]["abs_quantiles"]
    md = (out / "report.md").read_text()
    assert "## HBM traffic saved" in md and f"- gemm: " in md and "p99 abs" in md
    assert f"not run: {PER_NODE_NOT_RUN}" in md and f"not run: {PER_NODE_NOT_RUN}" in text
    manifest = json.loads((out / "manifest.json").read_text())
    assert {"report.html", "report.json"} <= {o["path"] for o in manifest["outputs"]}


def test_convert_without_the_report_extra_writes_markdown_and_json(tmp_path, recipe, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert missing_extra() == EXTRA_HINT
    out = tmp_path / "out"
    res = convert(None, recipe, out)
    assert res.passed
    step = res.step("report.html")
    assert step.state == "skipped" and step.detail == EXTRA_HINT and "\n" not in step.detail
    assert "pip install 'optfuse[report]'" in EXTRA_HINT
    assert not (out / "report.html").exists()
    assert (out / "report.md").is_file() and json.loads((out / "report.json").read_text())["fusion"]["counts"]
    assert f"- report.html: {EXTRA_HINT}" in (out / "report.md").read_text()


# -------------------------------------------------------------------------------------------------
# the per-node section, and verify --html
# -------------------------------------------------------------------------------------------------
@needs_extra
def test_per_node_section_plots_and_names_the_top_offenders(tmp_path, recipe):
    convert(None, recipe, tmp_path / "out", skip_build=True)
    facts = json.loads((tmp_path / "out" / "report.json").read_text())
    from optfuse.report.facts import top_offenders

    facts["per_node"] = per_node_entries()
    facts["top_offenders"] = top_offenders(facts["per_node"])
    text = render_html(facts)
    assert_self_contained(text)
    section = text[text.index('id="per-node"'):text.index('id="build"')]
    assert "<svg" in section and PER_NODE_NOT_RUN not in section
    assert facts["top_offenders"][0]["node"] == "optfuse/layer_norm.native/7"  # the planted growth of 0.5
    top = section[section.index("Top offenders"):section.index("<details")]
    assert top.index("optfuse/layer_norm.native/7") < min(top.index(e["node"]) for e in facts["top_offenders"][1:])


def test_report_md_names_the_top_offenders():
    from optfuse.report.convert import per_node_markdown

    lines = per_node_markdown(per_node_entries())
    rows = [ln for ln in lines if ln.startswith("| optfuse/")]
    assert len(rows) == 5 and rows[0].startswith("| optfuse/layer_norm.native/7 |")
    assert per_node_markdown(None)[-1] == f"not run: {PER_NODE_NOT_RUN}"


@needs_extra
def test_verify_html_writes_the_page(tmp_path):
    onnx.save(graphs.residual_block(hidden=64, norm="layer_norm", n_layers=1), tmp_path / "a.onnx")
    page = tmp_path / "verify.html"
    res = invoke("verify", tmp_path / "a.onnx", tmp_path / "a.onnx", "--html", page)
    assert res.exit_code == 0, res.stderr
    assert f"wrote the report to {page}" in " ".join(res.stdout.split())
    text = page.read_text()
    assert set(SECTION_IDS) <= set(parse(text).ids)
    assert_self_contained(text)
    assert "not run: verify does not fuse" in text and "<svg" in text


def test_verify_html_without_the_extra_is_exit_2_before_any_work(tmp_path, monkeypatch):
    onnx.save(graphs.residual_block(hidden=64, norm="layer_norm", n_layers=1), tmp_path / "a.onnx")
    monkeypatch.setitem(sys.modules, "jinja2", None)
    res = invoke("verify", tmp_path / "a.onnx", tmp_path / "a.onnx", "--html", tmp_path / "v.html")
    one_line(res, 2, "--html", "pip install 'optfuse[report]'")
    assert not (tmp_path / "v.html").exists()


@pytest.mark.parametrize("where", ["missing/v.html", "."])
def test_verify_html_bad_path_is_exit_2(tmp_path, where):
    onnx.save(graphs.residual_block(hidden=64, norm="layer_norm", n_layers=1), tmp_path / "a.onnx")
    res = invoke("verify", tmp_path / "a.onnx", tmp_path / "a.onnx", "--html", tmp_path / where)
    if missing_extra():
        one_line(res, 2, "pip install 'optfuse[report]'")
    else:
        one_line(res, 2, "--html", "does not exist" if where != "." else "is a directory")
    assert not (tmp_path / "missing").exists()


# -------------------------------------------------------------------------------------------------
# the page in a real browser
# -------------------------------------------------------------------------------------------------
def _chromium() -> str:
    found = browser.find_chromium()
    if found is None:
        pytest.skip("no Chromium here: apt-get install -y chromium (.ci/run installs it)")
    return found


@pytest.mark.slow
def test_the_browser_check_sees_requests_and_console_errors(tmp_path):
    """The check below can fail: a page that loads an image from elsewhere and logs an error."""
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><html><body><p id="a">x</p><img src="http://127.0.0.1:9/x.png">'
                   '<script>console.error("boom"); missing();</script></body></html>')
    run = browser.load_page(_chromium(), bad)
    assert run.requests[0] == bad.as_uri() and "http://127.0.0.1:9/x.png" in run.requests
    assert "boom" in run.errors and any("missing" in e for e in run.errors)
    assert run.ids == ["a"]


@pytest.mark.slow
@needs_extra
def test_report_html_in_headless_chromium(tmp_path, recipe):
    out = tmp_path / "out"
    convert(None, recipe, out)
    page = out / "report.html"
    run = browser.load_page(_chromium(), page)
    assert run.requests == [page.as_uri()], run.requests  # the file itself, nothing else
    assert not run.errors, run.console + run.exceptions
    assert set(SECTION_IDS) <= set(run.ids), sorted(set(SECTION_IDS) - set(run.ids))
    assert run.screenshot.startswith(b"\x89PNG") and len(run.screenshot) > 10_000
    (tmp_path / "report.png").write_bytes(run.screenshot)
    if os.environ.get(SCREENSHOT_ENV):
        Path(os.environ[SCREENSHOT_ENV]).write_bytes(run.screenshot)
