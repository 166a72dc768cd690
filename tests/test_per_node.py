"""verify --per-node: which tensors are compared, chunked runs, per-node growth, attribution (and the
brute-force check that it names the node whose removal helps most), FP16 overflow, the CLI."""

import json

import numpy as np
import onnx
import pytest

from optfuse.fusions import fuse_model
from optfuse.pattern import FusionOptions
from optfuse.precision import convert_precision
from optfuse.report.per_node import per_node_facts, per_node_markdown
from optfuse.verify import verify
from optfuse.verify import per_node as pn
from optfuse.verify.per_node import attribute, compare_per_node, tensor_map

import graphs
import planted
from cli_checks import invoke


def fused_residual(monkeypatch=None, eps=None, skip=()):
    if eps:
        planted.plant_layer_norm_eps(monkeypatch, eps)
    model = graphs.residual_block(n_layers=3)
    fused, _ = fuse_model(model, options=FusionOptions(skip_nodes=tuple(skip)))
    return model, fused


def test_fused_nodes_carry_rule_and_replaced_nodes():
    _, fused = fused_residual()
    norms = [n for n in fused.graph.node if n.op_type == "LayerNorm"]
    assert [pn.fused_node_facts(n) for n in norms] == [("layer_norm.native", [ln]) for ln in planted.LAYER_NORMS]
    gemm = next(n for n in fused.graph.node if n.op_type == "GemmEpilogue")
    assert pn.fused_node_facts(gemm) == ("gemm.residual", ["MatMul_1", "Add_2"])


def test_tensor_map_follows_precision_renames_and_casts():
    model, fused = fused_residual()
    assert set(tensor_map(model, fused).items()) >= {("add_2", "add_2"), ("layernormalization_3", "layernormalization_3")}
    cand, _ = convert_precision(fused, "fp16", keep_fp32=["Add_4"])
    mapping = tensor_map(model, cand)
    renamed = next(n for n in cand.graph.node if n.name == "Add_4").output[0]
    assert renamed != "add_4" and mapping[renamed] == "add_4"  # the kept node's renamed output
    cast = next(n for n in cand.graph.node if n.op_type == "Cast" and n.input[0] == renamed)
    assert mapping[cast.output[0]] == "add_4"  # and the Cast after it


def test_a_planted_fused_node_is_the_top_offender(monkeypatch):
    model, fused = fused_residual(monkeypatch, {"LayerNormalization_7": 2.0})
    result = compare_per_node(model, fused)
    top = attribute(result)[0]
    assert (top.kind, top.name) == ("fused_node", "optfuse/layer_norm.native/1")
    node = next(n for n in result.fused if n.node == top.name)
    assert node.err_in == 0 and node.err_out > 0.1 and node.growth == node.err_out
    assert node.replaced == ["LayerNormalization_7"] and node.rule == "layer_norm.native"
    upstream = [n for n in result.fused if n.depth < node.depth]
    assert upstream and all(n.err_out == 0 for n in upstream)  # exact before it


@pytest.mark.parametrize("chunk_size", [1, 3, 1000])
def test_chunks_give_the_same_errors_and_run_every_node_once(monkeypatch, chunk_size):
    model, fused = fused_residual(monkeypatch, {"LayerNormalization_7": 2.0})
    ran: dict[str, list[str]] = {"original": [], "candidate": []}
    infer = pn._Segments._infer

    def counting(self, nodes, inputs, outputs):
        ran[self.label].extend(n.name for n in nodes)
        assert len([o for o in outputs if o not in self.pending]) <= chunk_size  # bounded: a chunk plus the live set
        return infer(self, nodes, inputs, outputs)

    monkeypatch.setattr(pn._Segments, "_infer", counting)
    result = compare_per_node(model, fused, chunk_size=chunk_size)
    assert result.chunks == -(-len(tensor_map(model, fused)) // chunk_size)
    for label in ran:
        assert len(ran[label]) == len(set(ran[label]))  # no node ran twice
    whole = compare_per_node(model, fused, chunk_size=1000)
    assert {k: v.max_abs for k, v in result.tensors.items()} == {k: v.max_abs for k, v in whole.tensors.items()}


def test_attribution_agrees_with_disabling_each_fused_node(monkeypatch):
    """Brute force: leave each fused node out alone (fusions.skip_nodes); the largest drop of the
    output error is the top-ranked fused node."""
    eps = {"LayerNormalization_3": 0.3, "LayerNormalization_7": 3.0, "LayerNormalization_11": 0.05}
    model, fused = fused_residual(monkeypatch, eps)
    ranked = [o for o in attribute(compare_per_node(model, fused)) if o.kind == "fused_node"]
    base = verify(model, fused).outputs[0].max_abs
    drops = {}
    for node in compare_per_node(model, fused).fused:
        _, without = fused_residual(skip=node.replaced)
        drops[node.node] = base - verify(model, without).outputs[0].max_abs
    assert max(drops, key=drops.get) == ranked[0].name
    assert drops[ranked[0].name] > 0


def test_fp16_overflow_names_the_tensor_and_its_range():
    model = planted.overflow_model()
    fused, _ = fuse_model(model)
    cand, _ = convert_precision(fused, "fp16")
    result = compare_per_node(model, cand)
    top = attribute(result)[0]
    assert (top.kind, top.name) == ("node", "Mul_2") and top.overflow == ["mul_2"]
    assert "tensor mul_2: original range [" in top.detail and "|x| > 65504" in top.detail
    facts = per_node_facts(result, attribute(result))
    text = json.dumps(facts, allow_nan=False)  # strict JSON: no inf/nan numbers
    assert set(facts["attribution"][0]) == {"kind", "name", "growth", "detail", "depth"}
    assert set(facts["per_node"][0]) == {"node", "op", "rule", "replaced", "depth", "err_in", "err_out", "growth"}
    assert facts["overflow"] and "mul_2" in text
    assert "| 1 | node | `Mul_2` |" in per_node_markdown(facts)


def test_kept_fp32_node_and_its_cast_are_precision_decisions():
    model = planted.overflow_model()
    fused, _ = fuse_model(model)
    cand, _ = convert_precision(fused, "fp16", keep_fp32=["Mul_2"])
    ranked = attribute(compare_per_node(model, cand))
    kinds = {o.name: o.kind for o in ranked}
    assert kinds["Mul_2"] == "keep_fp32"
    top = ranked[0]  # the Cast back to FP16 is where the values overflow now
    assert top.kind == "cast" and np.isinf(top.growth) and "inf/nan" in top.detail


def test_cli_verify_per_node(tmp_path, monkeypatch):
    model, fused = fused_residual(monkeypatch, {"LayerNormalization_11": 2.0})
    onnx.save(model, tmp_path / "m.onnx")
    onnx.save(fused, tmp_path / "m.fused.onnx")
    res = invoke("verify", tmp_path / "m.onnx", tmp_path / "m.fused.onnx", "--per-node", "--json", "--chunk-size", "2")
    assert res.exit_code == 1, res.stderr
    data = json.loads(res.stdout)
    assert data["passed"] is False and data["chunks"] > 1
    assert data["attribution"][0]["name"] == "optfuse/layer_norm.native/2"
    res = invoke("verify", tmp_path / "m.onnx", tmp_path / "m.fused.onnx", "--per-node", "--top", "3")
    assert res.exit_code == 1
    assert "Top offenders" in res.stdout and "optfuse/layer_norm.native/2" in res.stdout
    assert "Traceback" not in res.stderr


def test_bad_chunk_size_is_bad_input():
    from optfuse.errors import InputError

    model, fused = fused_residual()
    with pytest.raises(InputError, match="chunk size"):
        compare_per_node(model, fused, chunk_size=0)


def test_a_mask_sentinel_held_as_minus_1e4_is_no_overflow():
    lowest = np.finfo(np.float32).min
    ref = [np.array([lowest, 0.0, 1.5], dtype=np.float32)]
    err = pn.tensor_error("mask", "mask", ref, [np.array([-1e4, 0.0, 1.5], dtype=np.float16)])
    assert (err.max_abs, err.over_fp16, err.overflow, err.ref_min) == (0.0, 0, False, 0.0)
    err = pn.tensor_error("x", "x", [np.array([7e4, 1.0], dtype=np.float32)], [np.array([np.inf, 1.0], np.float16)])
    assert err.overflow and err.nonfinite == 1 and np.isinf(err.max_abs) and err.over_fp16 == 1


def test_bf16_candidate_runs_emulated_with_errors_on_its_own_nodes():
    model, fused = fused_residual()
    cand, _ = convert_precision(fused, "bf16", keep_fp32=["Add_8"])
    one, whole = compare_per_node(model, cand, chunk_size=1), compare_per_node(model, cand, chunk_size=64)
    assert one.mode == "bf16" and {k: v.max_abs for k, v in one.tensors.items()} == \
        {k: v.max_abs for k, v in whole.tensors.items()}  # the emulation rounds explicitly: no chunk effect
    kinds = {n.node: n.kind for n in whole.nodes}
    assert kinds["Add_8"] == "keep_fp32" and kinds["Add_4"] == "node"
    assert not any("/bf16_round/" in n for n in kinds)  # the emulation's rounding counts with its node
    assert next(n for n in whole.nodes if n.node == "Add_4").err_out > 0
