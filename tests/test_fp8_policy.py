"""FP8 policy on hand-built graphs: ``fp8_exclude`` (node names, the names a fused node replaced, op
types), the BF16 base, the opset raise, the report of what runs FP8 and why, and the accuracy
metrics verify adds (cosine similarity, top-1 agreement of head outputs)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import graphs
from optfuse.fusions import fuse_model
from optfuse.precision import PrecisionOptions, apply_precision
from optfuse.precision.fp8 import FP8_OPSET, default_opset, excluded_by, replaced_names
from optfuse.report import precision_markdown
from optfuse.verify import Agreement, compare_arrays, head_outputs, verify
from optfuse.verify.compare import cosine_similarity, top1_agreement


def _feeds(n=3, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((2, 8, 64)).astype(np.float32)} for _ in range(n)]


def _unfused_block():
    m = graphs.residual_block(n_layers=2)
    fused, _ = fuse_model(m, dims={"b": 2, "s": 8}, families=graphs.NORM_FAMILIES)
    return m, fused


def test_exclude_by_name_keeps_that_gemm_in_the_base_precision():
    _, fused = _unfused_block()
    out, res = apply_precision(fused, PrecisionOptions(mode="fp8", fp8_exclude=("MatMul_5",)), _feeds())
    assert [g["name"] for g in res.fp8["gemms"]] == ["MatMul_1"]
    assert res.fp8["skipped"] == [{"name": "MatMul_5", "op": "MatMul",
                                   "reason": "excluded by precision.fp8_exclude ('MatMul_5')"}]
    mm5 = next(n for n in out.graph.node if n.name == "MatMul_5")
    producers = {o: n.op_type for n in out.graph.node for o in n.output}
    assert all(producers.get(i) != "DequantizeLinear" for i in mm5.input)
    assert {t.name: t.data_type for t in out.graph.initializer}[mm5.input[1]] == TensorProto.FLOAT16


def test_exclude_matches_the_nodes_a_fused_node_replaced():
    m = graphs.residual_block(n_layers=2)
    fused, _ = fuse_model(m, dims={"b": 2, "s": 8})
    gemm = next(n for n in fused.graph.node if n.op_type == "GemmEpilogue" and "MatMul_1" in replaced_names(n))
    assert excluded_by(gemm, ["Add_*"]) == "Add_*" and excluded_by(gemm, ["GemmEpilogue"]) == "GemmEpilogue"
    assert excluded_by(gemm, ["MatMul_9"]) is None
    _, res = apply_precision(fused, PrecisionOptions(mode="fp8", fp8_exclude=("MatMul_1",)), _feeds())
    reasons = {s["name"]: s["reason"] for s in res.fp8["skipped"]}
    assert reasons[gemm.name] == "excluded by precision.fp8_exclude ('MatMul_1')"


def test_opset_raised_and_reported():
    m, fused = _unfused_block()
    assert default_opset(fused) == 17
    out, res = apply_precision(fused, PrecisionOptions(mode="fp8"), _feeds())
    assert default_opset(out) == FP8_OPSET and res.fp8["opset"] == [17, FP8_OPSET]
    onnx.checker.check_model(out)
    md = precision_markdown(res)
    assert "### FP8 (E4M3)" in md and "| MatMul_1 | MatMul | qdq |" in md and "opset 17 -> 19" in md
    assert "Kept in fp16 by policy: SkipLayerNorm x2 (norm)" in md


@pytest.mark.parametrize("base, q_type", [("fp16", TensorProto.FLOAT16), ("bf16", TensorProto.BFLOAT16)])
def test_base_precision_types_the_rest_and_the_scales(base, q_type, tmp_path):
    m, fused = _unfused_block()
    out, res = apply_precision(fused, PrecisionOptions(mode="fp8", fp8_base=base), _feeds())
    inits = {t.name: t for t in out.graph.initializer}
    for q in (n for n in out.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")):
        assert inits[q.input[1]].data_type == q_type
    assert res.fp8["base"] == base
    onnx.save(m, tmp_path / "m.onnx")
    onnx.save(out, tmp_path / "c.onnx")
    v = verify(str(tmp_path / "m.onnx"), str(tmp_path / "c.onnx"), None, feeds=_feeds(seed=5))
    # E4M3 fake quantization of two random 64-wide layers: mean |error| ~0.075 of a unit-scale output and a
    # max |error| near the FP8 tolerance's 0.5 (over 40 verify seeds, 4-6 of them cross it at an element
    # with |ref| ~ 0, at scale_steps 1 and 8 alike), so the bound here is on the error itself.
    o = v.outputs[0]
    assert o.cosine > 0.99 and o.mean_abs < 0.1 and o.max_abs < 1.0, v.outputs


def test_cosine_and_top1():
    rng = np.random.default_rng(0)
    ref = [rng.standard_normal((4, 10)) for _ in range(2)]
    assert cosine_similarity(ref, ref) == pytest.approx(1.0)
    assert cosine_similarity(ref, [-r for r in ref]) == pytest.approx(-1.0)
    assert cosine_similarity([np.zeros(3)], [np.zeros(3)]) == 1.0 and cosine_similarity([np.zeros(3)], [np.ones(3)]) == 0.0
    got = [r.copy() for r in ref]
    rows = np.argmax(got[0], axis=-1)
    got[0][0, rows[0]] = -100.0  # one row of eight loses its argmax
    assert top1_agreement(ref, got) == pytest.approx(7 / 8)
    assert top1_agreement([np.ones((3, 1))], [np.ones((3, 1))]) is None


def test_agreement_bars_fail_an_output():
    ref = [np.linspace(-1, 1, 100).reshape(10, 10)]
    noisy = [ref[0] + np.random.default_rng(1).standard_normal((10, 10))]
    r = compare_arrays("logits", ref, noisy, 10.0, 10.0, Agreement(0.99, 0.9), head=True)
    assert not r.passed and r.cosine < 0.99 and "cosine similarity" in r.note and r.top1 is not None
    ok = compare_arrays("logits", ref, ref, 1e-6, 0.0, Agreement(0.99, 0.9), head=True)
    assert ok.passed and ok.top1 == 1.0 and ok.min_top1 == 0.9
    unbarred = compare_arrays("y", ref, noisy, 10.0, 10.0, None)
    assert unbarred.passed and unbarred.min_cosine is None and unbarred.top1 is None


def test_head_outputs_by_name_and_vocabulary():
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])
    table = onnx.numpy_helper.from_array(np.zeros((50, 8), np.float32), "table")
    w = onnx.numpy_helper.from_array(np.zeros((8, 50), np.float32), "w")
    nodes = [helper.make_node("Gather", ["table", "input_ids"], ["h"]), helper.make_node("MatMul", ["h", "w"], ["lm"]),
             helper.make_node("Identity", ["h"], ["hidden"]), helper.make_node("Identity", ["lm"], ["cls_logits"])]
    outs = [helper.make_tensor_value_info("lm", TensorProto.FLOAT, ["b", "s", 50]),
            helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["b", "s", 8]),
            helper.make_tensor_value_info("cls_logits", TensorProto.FLOAT, ["b", "s", 50])]
    model = helper.make_model(helper.make_graph(nodes, "g", [ids], outs, [table, w]))
    assert head_outputs(model) == {"lm", "cls_logits"}
