"""BF16 candidates are verified through their FP32 emulation (onnxruntime has no BF16 MatMul on CPU)."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto

import graphs
from optfuse.pipeline import convert
from optfuse.precision import convert_precision
from optfuse.recipe import load_recipe
from optfuse.verify import verify
from optfuse.verify.emulate import emulate_bf16, uses_bf16


def _bf16(a: np.ndarray) -> np.ndarray:
    return a.astype(ml_dtypes.bfloat16).astype(np.float32)


def _linear(hidden=32):
    """y = (x @ W) * g + b: FP32, one MatMul and two elementwise ops."""
    rng = np.random.default_rng(0)
    b = graphs.Builder(17)
    w, g, bias = (rng.standard_normal(s).astype(np.float32) for s in ((hidden, hidden), (hidden,), (hidden,)))
    b.node("Add", b.node("Mul", b.node("MatMul", "x", b.const(w, "w")), b.const(g, "g")), b.const(bias, "b"), out="y")
    model = b.model([graphs.io("x", ["b", hidden])], [graphs.io("y", ["b", hidden])])
    return model, (w, g, bias)


def _run(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


def test_emulation_rounds_where_the_bf16_model_does():
    model, (w, g, bias) = _linear()
    bf16, _ = convert_precision(model, "bf16")
    assert uses_bf16(bf16) and not uses_bf16(model)
    try:
        _run(bf16, {"x": np.zeros((2, 32), np.float32)})
        raise AssertionError("onnxruntime ran a BF16 MatMul on CPU; the emulation would not be needed")
    except Exception as exc:
        assert "MatMul" in str(exc) or "NOT_IMPLEMENTED" in str(exc)
    emulated = emulate_bf16(bf16)
    assert not any(t.data_type == TensorProto.BFLOAT16 for t in emulated.graph.initializer)
    x = np.random.default_rng(1).standard_normal((4, 32)).astype(np.float32)
    got = _run(emulated, {"x": x})
    # the BF16 model: x cast to BF16, each op's result stored as BF16, the output cast to FP32
    mm = _bf16(_bf16(x) @ _bf16(w))
    want = _bf16(_bf16(mm * _bf16(g)) + _bf16(bias))
    assert np.array_equal(got, _bf16(got))  # every output value is a BF16 value
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-6)  # at most one BF16 ulp (summation order)
    assert np.mean(got == want) > 0.95
    # and it is not just the FP32 model: BF16 rounding shows
    assert not np.allclose(got, _run(model, {"x": x}), rtol=1e-4, atol=1e-5)


def test_verify_bf16_candidate_says_how(tmp_path):
    model, _ = _linear()
    bf16, _ = convert_precision(model, "bf16")
    onnx.save(model, tmp_path / "m.onnx")
    onnx.save(bf16, tmp_path / "m.bf16.onnx")
    res = verify(tmp_path / "m.onnx", tmp_path / "m.bf16.onnx")
    assert res.passed and "emulated in FP32" in res.method
    assert res.to_dict()["method"] == res.method
    plain = verify(tmp_path / "m.onnx", tmp_path / "m.onnx")
    assert plain.method == "" and "method" not in plain.to_dict()


RECIPE = """
name: block
model: {path: block.onnx}
inputs:
  x: {dtype: float32, shape: [b, s, 64]}
dims:
  b: {min: 1, opt: 2, max: 4}
  s: {min: 1, opt: 8, max: 16}
precision: {mode: bf16}
"""


def test_convert_bf16_finishes_and_reports_the_method(tmp_path):
    onnx.save(graphs.residual_block(hidden=64, norm="layer_norm", n_layers=2), tmp_path / "block.onnx")
    (tmp_path / "r.yaml").write_text(RECIPE)
    out = tmp_path / "out"
    res = convert(None, load_recipe(tmp_path / "r.yaml"), out, skip_build=True)
    assert res.passed
    assert res.step("verify (onnxruntime)").state == "ok"
    acc = json.loads((out / "accuracy_report.json").read_text())
    assert acc["onnxruntime"]["passed"] and "emulated in FP32" in acc["onnxruntime"]["method"]
    assert "Candidate run as: BF16 emulated in FP32" in (out / "accuracy_report.md").read_text()
    assert (out / "block.bf16.onnx").is_file()
