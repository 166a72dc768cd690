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

import yaml

import browser
import graphs
import planted
from cli_checks import invoke, one_line
from optfuse.errors import VerificationError
from optfuse.pipeline import convert
from optfuse.recipe import load_recipe
from optfuse.report import EXTRA_HINT, SECTION_IDS, missing_extra, render_html
from optfuse.report.facts import PER_NODE_NOT_RUN, PER_NODE_STEP
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
# the per-node comparison in the reports: convert --per-node / verify.per_node, verify --per-node --html
# -------------------------------------------------------------------------------------------------
#: (planted model, recipe sections, the top offender's kind and name, a fragment of its detail)
PLANTED = {
    "layer_norm_eps": ("layer_norm.native", {}, ("fused_node", "optfuse/layer_norm.native/1"),
                       "replacing 1 node(s): LayerNormalization_7"),
    "fp16_overflow": ("overflow", {"precision": {"mode": "fp16"}}, ("node", "Mul_2"),
                      "tensor mul_2: original range"),
}


def planted_recipe(tmp_path, monkeypatch, which, **sections):
    from optfuse.recipe import recipe_from_dict

    model, extra, _, _ = PLANTED[which]
    if which == "layer_norm_eps":
        planted.plant_layer_norm_eps(monkeypatch, {"LayerNormalization_7": 2.0})
        onnx.save(graphs.residual_block(n_layers=3), tmp_path / "m.onnx")
    else:
        onnx.save(planted.overflow_model(), tmp_path / "m.onnx")
    data = {"name": "m", "model": {"path": str(tmp_path / "m.onnx")}, **extra, **sections}
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(data))
    return recipe_from_dict(data), tmp_path / "m.yaml"


def reports_of(run_dir: Path) -> Path:
    """The folder a convert run left its reports in: the output folder, or (a failed check) its
    one partial folder."""
    if (run_dir / "report.json").is_file():
        return run_dir
    (partial,) = run_dir.glob("partial-*")
    return partial


def per_node_section(text: str) -> str:
    return text[text.index('id="per-node"'):text.index('id="build"')]


def assert_per_node_reports(folder: Path, kind: str, name: str, fragment: str) -> None:
    """report.json, report.md and report.html of `folder` rank (kind, name) first."""
    facts = json.loads((folder / "report.json").read_text())
    assert facts["per_node_run"]["compared_tensors"] > 0
    assert (facts["attribution"][0]["kind"], facts["attribution"][0]["name"]) == (kind, name)
    assert fragment in facts["attribution"][0]["detail"]
    assert not any(n["what"] == "per-node comparison" for n in facts["not_run"])
    md = (folder / "report.md").read_text()
    assert f"| 1 | {kind} | `{name}` |" in md and PER_NODE_NOT_RUN not in md
    if missing_extra() is None:
        text = (folder / "report.html").read_text()
        assert_self_contained(text)
        section = per_node_section(text)
        assert PER_NODE_NOT_RUN not in section and "<svg" in section
        ranked = section[section.index("Ranked offenders"):]
        first = ranked[ranked.index("<td"):ranked.index("</tr>", ranked.index("<td"))]
        assert f"<code>{name}</code>" in first and fragment in first


@pytest.mark.parametrize("which", sorted(PLANTED))
def test_convert_per_node_from_the_recipe_ranks_the_planted_fault(tmp_path, monkeypatch, which):
    recipe, _ = planted_recipe(tmp_path, monkeypatch, which, verify={"per_node": True, "chunk_size": 3})
    _, _, (kind, name), fragment = PLANTED[which]
    try:
        convert(None, recipe, tmp_path / "out", skip_build=True)
    except VerificationError:
        pass  # the planted fault fails the check; the reports are in the partial folder
    folder = reports_of(tmp_path / "out")
    facts = json.loads((folder / "report.json").read_text())
    step = next(s for s in facts["steps"] if s["name"] == PER_NODE_STEP)
    assert step["state"] == "ok" and f"top offender: {kind} {name}" in step["detail"]
    assert facts["per_node_run"]["chunk_size"] == 3 and facts["per_node_run"]["chunks"] > 1
    assert facts["options"]["verify"] == {"per_node": True, "chunk_size": 3, "source": "recipe"}
    if which == "fp16_overflow":
        assert facts["per_node_run"]["overflow"][0].startswith("tensor mul_2: original range")
    else:
        assert facts["top_offenders"][0]["node"] == name and facts["top_offenders"][0]["replaced"] == \
            ["LayerNormalization_7"]
    assert_per_node_reports(folder, kind, name, fragment)


def test_convert_cli_per_node_switch(tmp_path, monkeypatch):
    """--per-node turns it on, --no-per-node off over the recipe's verify.per_node; exit 1 with the
    reports in the partial folder when the planted fault fails the check."""
    _, path = planted_recipe(tmp_path, monkeypatch, "layer_norm_eps")
    res = invoke("convert", "-r", path, "-o", tmp_path / "on", "--skip-build", "--per-node")
    assert res.exit_code == 1 and "Traceback" not in res.stderr, res.stderr
    folder = reports_of(tmp_path / "on")
    facts = json.loads((folder / "report.json").read_text())
    assert facts["options"]["verify"]["source"] == "command line"
    assert next(s for s in facts["steps"] if s["name"] == PER_NODE_STEP)["state"] == "ok"
    assert_per_node_reports(folder, "fused_node", "optfuse/layer_norm.native/1", "LayerNormalization_7")
    _, path = planted_recipe(tmp_path, monkeypatch, "layer_norm_eps", verify={"per_node": True})
    res = invoke("convert", "-r", path, "-o", tmp_path / "off", "--skip-build", "--no-per-node", "--atol", "10")
    assert res.exit_code == 0, res.stderr
    facts = json.loads((tmp_path / "off" / "report.json").read_text())
    assert facts["per_node"] is None and PER_NODE_STEP not in [s["name"] for s in facts["steps"]]
    assert {"what": "per-node comparison", "why": PER_NODE_NOT_RUN} in facts["not_run"]


def test_per_node_settings_sources():
    from optfuse.pipeline import Overrides
    from optfuse.pipeline.options import per_node_settings
    from optfuse.recipe import recipe_from_dict

    base = {"name": "m", "model": {"path": "m.onnx"}}
    on = recipe_from_dict({**base, "verify": {"per_node": True, "chunk_size": 8}})
    assert per_node_settings(None).to_dict() == {"per_node": False, "chunk_size": 64, "source": "default"}
    assert per_node_settings(recipe_from_dict(base)).source == "default"
    assert per_node_settings(on).to_dict() == {"per_node": True, "chunk_size": 8, "source": "recipe"}
    assert per_node_settings(on, Overrides(per_node=False)).to_dict() == \
        {"per_node": False, "chunk_size": 8, "source": "command line"}
    with pytest.raises(Exception, match="chunk_size"):
        recipe_from_dict({**base, "verify": {"chunk_size": 0}})


@needs_extra
def test_verify_per_node_html_ranks_the_fp16_overflow(tmp_path):
    from optfuse.fusions import fuse_model
    from optfuse.precision import convert_precision

    model = planted.overflow_model()
    fused, _ = fuse_model(model)
    onnx.save(model, tmp_path / "ovf.onnx")
    onnx.save(convert_precision(fused, "fp16")[0], tmp_path / "ovf.fp16.onnx")
    page, feeds = tmp_path / "v.html", tmp_path / "feeds.json"
    res = invoke("verify", tmp_path / "ovf.onnx", tmp_path / "ovf.fp16.onnx", "--per-node", "--html", page,
                 "--save-inputs", feeds)
    assert res.exit_code == 1 and "Traceback" not in res.stderr, res.stderr
    out = " ".join(res.stdout.split())
    assert "Top offenders" in out and f"wrote the report to {page}" in out and feeds.is_file()
    text = page.read_text()
    assert set(SECTION_IDS) <= set(parse(text).ids)
    assert_self_contained(text)
    section = per_node_section(text)
    assert "FP16 overflow: tensor mul_2: original range" in section and "<svg" in section
    ranked = section[section.index("Ranked offenders"):]
    assert "<code>Mul_2</code>" in ranked[:ranked.index("</tr>", ranked.index("<td"))]
    assert "Mul_2" in section[section.index("<svg"):section.index("</svg>")]  # labelled in the plot


def test_verify_per_node_html_bad_path_is_exit_2_before_any_work(tmp_path):
    onnx.save(graphs.residual_block(hidden=64, norm="layer_norm", n_layers=1), tmp_path / "a.onnx")
    res = invoke("verify", tmp_path / "a.onnx", tmp_path / "a.onnx", "--per-node", "--html", tmp_path / "no" / "v.html")
    one_line(res, 2, "pip install 'optfuse[report]'" if missing_extra() else "does not exist")


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


@pytest.mark.slow
@needs_extra
def test_convert_per_node_page_in_headless_chromium(tmp_path, monkeypatch):
    """The page of a convert with the per-node comparison (the FP16 overflow planted): the plot with
    its offenders and the ranked table render with no request and no console error."""
    recipe, _ = planted_recipe(tmp_path, monkeypatch, "fp16_overflow", verify={"per_node": True})
    with pytest.raises(VerificationError):
        convert(None, recipe, tmp_path / "out", skip_build=True)
    page = reports_of(tmp_path / "out") / "report.html"
    run = browser.load_page(_chromium(), page)
    assert run.requests == [page.as_uri()], run.requests
    assert not run.errors, run.console + run.exceptions
    assert set(SECTION_IDS) <= set(run.ids) and "per-node-figure_1" in run.ids
    assert run.screenshot.startswith(b"\x89PNG")


@pytest.mark.slow
@needs_extra
@pytest.mark.parametrize("name", ["bert", "gpt2", "vit", "llama"])
def test_public_recipe_fp16_with_per_node_writes_every_section(tmp_path, name):
    """convert -r recipes/<name>.yaml --fp16 --per-node: report.html has every section, the per-node
    one with its plot and ranked offenders; report.json says how the comparison ran."""
    from optfuse.pipeline import Overrides

    recipe = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / f"{name}.yaml")
    out = tmp_path / "out"
    res = convert(None, recipe, out, skip_build=True, overrides=Overrides(precision="fp16", per_node=True))
    assert res.passed and res.step(PER_NODE_STEP).state == "ok"
    text = (out / "report.html").read_text()
    assert set(SECTION_IDS) <= set(parse(text).ids)
    assert_self_contained(text)
    section = per_node_section(text)
    assert "<svg" in section and "Ranked offenders" in section and PER_NODE_NOT_RUN not in section
    facts = json.loads((out / "report.json").read_text())
    assert facts["per_node_run"]["mode"] == "fp16" and facts["per_node_run"]["compared_tensors"] > 0
    assert facts["per_node"] and facts["attribution"][0]["growth"] != 0
