"""fusion_report.json / .md: counts, matches, rejections with reasons, HBM estimates, rule info."""

import json

import numpy as np

from optfuse.estimate import estimate_traffic
from optfuse.fusions import fuse_model
from optfuse.report import build_report, format_bytes, render_markdown, write_report
from optfuse.rewrite import Accepted, FusionResult, Rejected

import graphs


def _report(model, dims=None, **kw):
    fused, result = fuse_model(model, dims=dims, families=graphs.NORM_FAMILIES)
    return build_report(result, estimate=estimate_traffic(fused, result), model="m.onnx", dims=dims, **kw), result


def test_counts_matches_and_hbm():
    report, result = _report(graphs.residual_block(n_layers=2), dims={"b": 2, "s": 16})
    assert report["counts"] == {"SkipLayerNorm": 2}
    assert report["fused_nodes"] == 2
    for f, acc in zip(report["fusions"], result.accepted):
        assert f["rule"] == "skip_norm.layer_norm" and f["op"] == "SkipLayerNorm"
        assert f["node"].startswith("optfuse/skip_norm.layer_norm/")
        assert f["nodes"] == acc.nodes and len(f["nodes"]) == 2  # the Add and the LayerNormalization
        # the sum is written once and read once less: 2 * 16 * 64 floats = 8 KiB
        assert f["hbm_saved_bytes"] == 2 * 16 * 64 * 4
    assert report["hbm_saved_bytes_total"] == 2 * 8192 and report["hbm_unknown"] == 0
    assert report["original_nodes_replaced"] == 4
    # what each fused node still moves: x, skip, y and the sum (2 * 16 * 64 floats each), gamma, beta
    for f in report["fusions"]:
        assert f["hbm_moved_bytes"] == 4 * (2 * 16 * 64 * 4) + 2 * 64 * 4
    md = render_markdown(report)
    assert "| HBM saved | HBM moved |" in md and "| 8.0 KiB | 32.5 KiB |" in md
    json.dumps(report)  # plain JSON


def test_unresolved_dims_are_unknown():
    report, _ = _report(graphs.residual_block(n_layers=1), dims={})
    (f,) = report["fusions"]
    assert f["hbm_saved_bytes"] is None
    assert report["hbm_unknown"] == 1 and report["hbm_saved_bytes_total"] == 0
    md = render_markdown(report)
    assert "| unknown |" in md and "saved per run: **unknown**" in md
    # mixed: the known part is summed, the rest counted
    report["fusions"].append({**f, "hbm_saved_bytes": 4096})
    report.update(fused_nodes=2, hbm_saved_bytes_total=4096)
    assert "**4.0 KiB** (plus 1 fusion(s) of unknown size)" in render_markdown(report)


def test_rejections_have_reasons():
    # the variance is also a graph output: the LayerNorm cannot swallow it
    report, _ = _report(graphs.layer_norm(extra_output="variance"))
    assert report["counts"] == {}
    assert report["rejected"], "a near miss is reported"
    r = report["rejected"][0]
    assert r["rule"].startswith("layer_norm.") and r["op"] == "LayerNorm"
    assert "graph output" in r["reason"] and r["nodes"]
    md = render_markdown(report)
    assert "## Not fused" in md and "graph output" in md and "Nothing was fused." in md


def test_rewrite_info_is_reported(tmp_path):
    """Extra facts a rule records (e.g. the attention mask class) land in both files."""
    _, result = fuse_model(graphs.layer_norm(), dims={"b": 2, "s": 8})
    acc = result.accepted[0]
    acc.rewrite.info.update({"mask": "padding", "scale": np.float32(0.125), "heads": np.int64(4)})
    result.rejected.append(Rejected("attention.sdpa", "FlashAttention", ["MatMul_1", "Softmax_2"],
                                    "head size 96 is not supported"))
    report = build_report(result, model="m.onnx", fused_model="f.onnx", dims={"b": 2, "s": 8},
                          dims_source="recipe opt shapes", families=["layer_norm", "attention"])
    assert report["fusions"][0]["info"] == {"mask": "padding", "scale": 0.125, "heads": 4}
    jpath, mpath = write_report(report, tmp_path)
    assert jpath.name == "fusion_report.json" and mpath.name == "fusion_report.md"
    loaded = json.loads(jpath.read_text())
    assert loaded["fusions"][0]["info"]["mask"] == "padding"
    assert loaded["rejected"][-1]["reason"] == "head size 96 is not supported"
    md = mpath.read_text()
    assert "mask=padding" in md and "head size 96 is not supported" in md
    assert "b=2, s=8" in md and "recipe opt shapes" in md
    assert "| LayerNorm | 1 |" in md
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fusion_report.json", "fusion_report.md"]  # no temp files


def test_empty_result_and_byte_format():
    report = build_report(FusionResult())
    assert report["counts"] == {} and report["fusions"] == [] and report["hbm_saved_bytes_total"] == 0
    assert "Nothing was fused." in render_markdown(report)
    assert [format_bytes(n) for n in (None, 12, 8192, 3 << 20, -2048)] == ["unknown", "12 B", "8.0 KiB", "3.0 MiB", "-2.0 KiB"]


def test_absorbed_fusions_report_final_graph():
    """A LayerNorm taken in by a SkipLayerNorm is reported once, with all original nodes."""
    model = graphs.residual_block(n_layers=1)
    _, result = fuse_model(model, dims={"b": 1, "s": 4}, families=graphs.NORM_FAMILIES)
    assert [a.op for a in result.accepted] == ["SkipLayerNorm"]
    assert isinstance(result.accepted[0], Accepted)
    report = build_report(result)
    assert report["counts"] == {"SkipLayerNorm": 1}


def test_report_names_follow_the_model_and_the_umask(tmp_path):
    """`<model>.fusion_report.*` so two models share a folder; the files get the umask's mode, not mkstemp's 0600."""
    import os

    from optfuse.report import report_stem

    _, result = fuse_model(graphs.layer_norm(), dims={"b": 2, "s": 8})
    old = os.umask(0o022)
    try:
        paths = [*write_report(build_report(result), tmp_path, stem=report_stem("a")),
                 *write_report(build_report(result), tmp_path, stem=report_stem("b"))]
    finally:
        os.umask(old)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "a.fusion_report.json", "a.fusion_report.md", "b.fusion_report.json", "b.fusion_report.md"]
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in paths)
