"""The float64 reference and the ONNX functions (reference.py) on CPU, for every activation: the
contract test (tests/test_contracts.py) runs the functions at the spec's default activation only.
Each case is one fused node in onnxruntime against ``reference`` on ``sample_inputs`` (pre-activations
of order 1, both signs)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from optfuse.kernels.registry import plugin_module

R = plugin_module("gemm", "reference")


def test_relu2_is_the_square_of_relu():
    x = np.array([-3.0, -0.5, 0.0, 0.25, 1.5, 300.0])
    np.testing.assert_array_equal(R.activation64("relu2", x), [0.0, 0.0, 0.0, 0.0625, 2.25, 90000.0])


def _run_node(op: str, ins: list, attrs: dict) -> np.ndarray:
    import onnxruntime as ort

    names, feeds, vis = [], {}, []
    for t, x in zip(R.SPECS[op].inputs, ins):
        if x is None:
            names.append("")
            continue
        names.append(t.name)
        feeds[t.name] = x
        vis.append(helper.make_tensor_value_info(t.name, helper.np_dtype_to_tensor_dtype(x.dtype), list(x.shape)))
    while names[-1] == "":
        names.pop()
    node = helper.make_node(op, names, ["y"], domain="optfuse", **attrs)
    out = helper.make_tensor_value_info("y", helper.np_dtype_to_tensor_dtype(np.dtype(np.float32)), None)
    model = helper.make_model(helper.make_graph([node], "one", vis, [out]), functions=[R.onnx_function(op, opset=17)],
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("optfuse", 1),
                                             helper.make_opsetid("ai.onnx.ml", 2)])
    model.ir_version = 9
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


@pytest.mark.parametrize("position", R.RESIDUAL_POSITIONS)
@pytest.mark.parametrize("activation", R.ACTIVATIONS["GemmEpilogue"])
def test_gemm_epilogue_function_matches_reference(activation, position):
    ins, _ = R.sample_inputs("GemmEpilogue", np.random.default_rng(5))
    attrs = {"activation": activation, "residual_position": position}
    (want,) = R.reference("GemmEpilogue", ins, attrs)
    got = _run_node("GemmEpilogue", ins, attrs)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    if activation != "none":  # the activation is applied: the case tells it from the identity
        (plain,) = R.reference("GemmEpilogue", ins, {**attrs, "activation": "none"})
        assert np.abs(plain - want).max() > 1e-2


@pytest.mark.parametrize("activation", R.ACTIVATIONS["GatedGemm"])
def test_gated_gemm_function_matches_reference(activation):
    ins, _ = R.sample_inputs("GatedGemm", np.random.default_rng(6))
    (want,) = R.reference("GatedGemm", ins, {"activation": activation})
    np.testing.assert_allclose(_run_node("GatedGemm", ins, {"activation": activation}), want, rtol=2e-5, atol=2e-5)
