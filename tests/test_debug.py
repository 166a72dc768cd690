"""optfuse debug: it finds a planted fault (a fused node that adds error, a rule whose every node
does, an activation that overflows FP16), writes a recipe patch that convert then passes with, and
reports every step; the recipe fields it writes are validated."""

import importlib
import json

import onnx
import pytest
import yaml

from optfuse.errors import InputError, VerificationError
from optfuse.fusions import fuse_model
from optfuse.pipeline import convert, debug, fusion_options
from optfuse.recipe import load_recipe, recipe_from_dict

import graphs
import planted
from cli_checks import invoke, one_line

debug_flow = importlib.import_module("optfuse.pipeline.debug")


def write(tmp_path, model, name="m"):
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, path)
    return path


def recipe_for(path, **sections):
    return recipe_from_dict({"name": path.stem, "model": {"path": str(path)}, **sections})


def converts_with(patched_yaml, tmp_path):
    """The patched recipe, read back from its file, passes convert's onnxruntime check."""
    outcome = convert(None, load_recipe(patched_yaml), tmp_path / "convert", skip_build=True)
    return outcome.step("verify (onnxruntime)").state == "ok"


def test_a_broken_fused_node_is_found_and_left_unfused(tmp_path, monkeypatch):
    planted.plant_layer_norm_eps(monkeypatch, {"LayerNormalization_7": 2.0})
    path = write(tmp_path, graphs.residual_block(n_layers=3))
    outcome = debug(path, recipe_for(path), tmp_path / "out")
    assert not outcome.passed_before and outcome.passed_after
    assert outcome.patch == {"fusions": {"skip_nodes": ["LayerNormalization_7"]}}
    assert [s.stage for s in outcome.steps][0] == "baseline" and outcome.steps[-1].stage == "final"
    assert {"families", "rules", "nodes"} <= {s.stage for s in outcome.steps}
    assert yaml.safe_load((tmp_path / "out" / "recipe_patch.yaml").read_text()) == outcome.patch
    report = json.loads((tmp_path / "out" / "debug_report.json").read_text())
    assert report["per_node"]["attribution"][0]["name"] == "optfuse/layer_norm.native/1"
    assert "LayerNormalization_7" in (tmp_path / "out" / "debug_report.md").read_text()
    assert converts_with(tmp_path / "out" / "m.patched.yaml", tmp_path)


def test_a_rule_broken_everywhere_is_disabled(tmp_path, monkeypatch):
    planted.plant_layer_norm_eps(monkeypatch, dict.fromkeys(planted.LAYER_NORMS, 2.0))
    path = write(tmp_path, graphs.residual_block(n_layers=3))
    outcome = debug(path, recipe_for(path), tmp_path / "out")
    assert outcome.patch == {"fusions": {"disabled_rules": ["layer_norm.native"]}}
    assert converts_with(tmp_path / "out" / "m.patched.yaml", tmp_path)


def test_an_fp16_overflow_is_kept_in_fp32(tmp_path):
    path = write(tmp_path, planted.overflow_model(), "ovf")
    outcome = debug(path, recipe_for(path, precision={"mode": "fp16"}), tmp_path / "out")
    assert outcome.patch == {"precision": {"keep_fp32": ["Mul_2", "Mul_3"]}}
    assert "tensor mul_2: original range" in outcome.fault
    assert any(s.stage == "families" and not s.passed for s in outcome.steps)  # fusions ruled out first
    patched = load_recipe(tmp_path / "out" / "ovf.patched.yaml")
    assert patched.precision.mode == "fp16" and patched.precision.keep_fp32 == ["Mul_2", "Mul_3"]
    assert converts_with(tmp_path / "out" / "ovf.patched.yaml", tmp_path)


def test_a_passing_candidate_needs_no_patch(tmp_path):
    path = write(tmp_path, graphs.residual_block(n_layers=2))
    outcome = debug(path, None, tmp_path / "out")
    assert outcome.passed_before and outcome.patch == {} and len(outcome.steps) == 1
    assert not (tmp_path / "out" / "recipe_patch.yaml").exists()
    assert (tmp_path / "out" / "debug_report.md").exists()


def test_no_change_found_is_exit_1_with_the_report(tmp_path, monkeypatch):
    monkeypatch.setattr(debug_flow, "MAX_PRECISION_ROUNDS", 1)
    path = write(tmp_path, planted.overflow_model(), "ovf")
    with pytest.raises(VerificationError, match="no fusion or precision change"):
        debug(path, recipe_for(path, precision={"mode": "fp16"}), tmp_path / "out")
    assert json.loads((tmp_path / "out" / "debug_report.json").read_text())["passed_after"] is False


def test_smallest_finds_a_pair():
    tried = []

    def passes(s):
        tried.append(s)
        return {"b", "d"} <= set(s)

    assert debug_flow.smallest("abcde", passes) == ("b", "d")
    assert debug_flow.smallest("ac", lambda s: False) is None


def test_cli_debug(tmp_path, monkeypatch):
    planted.plant_layer_norm_eps(monkeypatch, {"LayerNormalization_3": 2.0})
    path = write(tmp_path, graphs.residual_block(n_layers=3))
    res = invoke("debug", path, "-o", tmp_path / "out", "--json")
    assert res.exit_code == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["patch"] == {"fusions": {"skip_nodes": ["LayerNormalization_3"]}} and data["passed_after"]
    res = invoke("debug", path, "-o", tmp_path / "out2")
    assert res.exit_code == 0 and "Bisection steps" in res.stdout and "skip_nodes" in res.stdout


def test_recipe_rule_fields_are_validated(tmp_path):
    path = write(tmp_path, graphs.residual_block(n_layers=1))
    with pytest.raises(InputError, match="fusions.disabled_rules"):
        recipe_for(path, fusions={"disabled_rules": ["nonsense"]})
    with pytest.raises(InputError, match="fusions.skip_nodes"):
        recipe_for(path, fusions={"skip_nodes": [""]})
    with pytest.raises(InputError, match="unknown rule id.*layer_norm.nope"):
        fusion_options(recipe_for(path, fusions={"disabled_rules": ["layer_norm.nope"]}))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "r", "model": {"path": str(path)},
                                      "fusions": {"disabled_rules": ["gemm.nope"]}}))
    one_line(invoke("debug", "-r", recipe, "-o", tmp_path / "out"), 2, "gemm.nope")
    assert not (tmp_path / "out").exists()


def test_recipe_rule_fields_change_what_fuses():
    model = graphs.residual_block(n_layers=2)
    off = fusion_options(recipe_from_dict({"name": "r", "model": {"path": "m.onnx"},
                                           "fusions": {"disabled_rules": ["gemm.residual"],
                                                       "skip_nodes": ["LayerNorm*_3"]}}))
    _, result = fuse_model(model, options=off)
    _, plain = fuse_model(model)
    assert "gemm.residual" in {a.rule for a in plain.accepted}
    assert "gemm.residual" not in {a.rule for a in result.accepted}
    assert any("LayerNormalization_3" in a.nodes for a in plain.accepted)
    assert not any("LayerNormalization_3" in a.nodes for a in result.accepted)
    assert any("LayerNormalization_7" in a.nodes for a in result.accepted)
    assert any("fusions.skip_nodes" in r.reason for r in result.rejected)


@pytest.mark.slow
def test_debug_finds_a_broken_layer_norm_in_an_exported_bert(tmp_path, monkeypatch, exported_model):
    """A real export (tiny BERT, dynamo): the fused LayerNorm of one layer is planted with a wrong
    epsilon; debug names that layer's original node, and the patched recipe passes convert."""
    import shutil

    model = exported_model("bert", "dynamo", "sdpa")
    path = tmp_path / "bert.onnx"
    shutil.copyfile(model.path, path)
    fused, result = fuse_model(onnx.load(path))
    norms = [a.nodes[0] for a in result.accepted if a.rule == "layer_norm.native"]
    assert len(norms) >= 3
    planted.plant_layer_norm_eps(monkeypatch, {norms[2]: 5.0})
    outcome = debug(path, recipe_for(path), tmp_path / "out")
    assert outcome.patch == {"fusions": {"skip_nodes": [norms[2]]}}
    assert outcome.facts["attribution"][0]["kind"] == "fused_node"
    assert converts_with(tmp_path / "out" / "bert.patched.yaml", tmp_path)
