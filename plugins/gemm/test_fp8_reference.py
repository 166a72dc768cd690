"""The FP8 side of the GEMM contract (spec v2) on CPU: the NumPy reference's checks, the ONNX
function variants (``overload``) and a model holding FP8 and non-FP8 GEMM nodes side by side, as
``optfuse.rewrite.add_functions`` embeds them, run in onnxruntime against the reference."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from optfuse.kernels.registry import plugin_module

R = plugin_module("gemm", "reference")
FP8 = R.np_dtype("float8e4m3fn")


def _ort_value(x: np.ndarray):
    import onnxruntime as ort

    if x.dtype == FP8:
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(np.ascontiguousarray(x).view(np.uint8),
                                                               TensorProto.FLOAT8E4M3FN)
    return x


def _onnx_type(x: np.ndarray) -> int:
    return TensorProto.FLOAT8E4M3FN if x.dtype == FP8 else helper.np_dtype_to_tensor_dtype(x.dtype)


def test_onnxruntime_dequantizes_fp8_per_axis_like_the_reference():
    """ORT's CPU DequantizeLinear on float8e4m3fn (opset 19): per tensor and per axis 0, exactly
    the FP8 value (as float64 from ml_dtypes) times its scale, rounded to float32."""
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((6, 8)) * 100).astype(np.float32).astype(FP8)
    s = rng.random(6).astype(np.float32) + 0.5
    for axis_scale, axis in ((s, 0), (s[:1].reshape(()), None)):
        node = helper.make_node("DequantizeLinear", ["w", "s"], ["y"], **({"axis": axis} if axis is not None else {}))
        graph = helper.make_graph([node], "dq", [helper.make_tensor_value_info("w", TensorProto.FLOAT8E4M3FN, [6, 8]),
                                                 helper.make_tensor_value_info("s", TensorProto.FLOAT, list(axis_scale.shape))],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [6, 8])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
        y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"w": _ort_value(w), "s": axis_scale})[0]
        want = (w.astype(np.float64) * (axis_scale.reshape(-1, 1) if axis == 0 else axis_scale)).astype(np.float32)
        assert np.array_equal(y, want)


@pytest.mark.parametrize("op", R.OPS)
def test_reference_checks_the_fp8_rules(op):
    rng = np.random.default_rng(1)
    ins, attrs = R.sample_inputs(op, rng, "float8e4m3fn")
    (y,) = R.reference(op, ins, attrs)
    assert y.dtype == np.float32 and np.isfinite(y).all()
    assert R.reference(op, ins, {**attrs, "output_dtype": "bfloat16"})[0].dtype == R.np_dtype("bfloat16")
    scales = [i for i, t in enumerate(R.SPECS[op].inputs) if t.name in R.SCALES[op]]
    with pytest.raises(ValueError, match="must be present with FP8"):
        R.reference(op, [None if i == scales[-1] else x for i, x in enumerate(ins)], attrs)
    with pytest.raises(ValueError, match="must all be FP8 or none"):
        R.reference(op, [x.astype(np.float16) if i == 1 else x for i, x in enumerate(ins)], attrs)
    with pytest.raises(ValueError, match=r"would be float8e4m3fn \(output_dtype like_input"):
        R.reference(op, ins, {})
    f32, _ = R.sample_inputs(op, rng)
    with pytest.raises(ValueError, match="must be absent without FP8"):
        R.reference(op, [ins[i] if i in scales else x for i, x in enumerate(f32)], {})


def test_fp8_reference_scales_the_product_of_the_fp8_values():
    """y = (A as f64) @ (W as f64)^T * a_scale * w_scale[n], then the epilogue as v1."""
    rng = np.random.default_rng(2)
    a = (rng.standard_normal((5, 16)) * 8).astype(np.float32).astype(FP8)
    w = (rng.standard_normal((8, 16)) * 8).astype(np.float32).astype(FP8)
    sa, sw = np.array(0.5, np.float32), (rng.random(8) + 0.1).astype(np.float32)
    bias = rng.standard_normal(8).astype(np.float32)
    (y,) = R.reference("GemmEpilogue", [a, w, bias, None, sa, sw], {"output_dtype": "float32", "activation": "relu",
                                                                    "alpha": 2.0})
    want = np.maximum(2.0 * (a.astype(np.float64) @ w.astype(np.float64).T) * 0.5 * sw.astype(np.float64) + bias, 0)
    np.testing.assert_allclose(y, want.astype(np.float32), rtol=1e-6)


def test_function_overloads_and_opset():
    assert R.function_overload("GemmEpilogue", ["A", "W"]) == ""
    assert R.function_overload("GemmEpilogue", ["A", "W", "b", "", "", ""], {"output_dtype": b"float32"}) == "to_float32"
    assert R.function_overload("GemmEpilogue", ["A", "W", "z", "z", "sa", "sw"], {"output_dtype": "float16"}) == "fp8_to_float16"
    assert R.function_overload("GatedGemm", ["A", "Wg", "Wu", "sa", "sg", "su"], {"output_dtype": "bfloat16"}) == \
        "fp8_to_bfloat16"
    with pytest.raises(ValueError, match="needs output_dtype"):
        R.function_overload("GatedGemm", ["A", "Wg", "Wu", "sa", "sg", "su"], {})
    assert set(R.function_overloads("GemmEpilogue")) == {"", "to_float16", "to_bfloat16", "to_float32",
                                                         "fp8_to_float16", "fp8_to_bfloat16", "fp8_to_float32"}
    with pytest.raises(ValueError, match="opset >= 19"):
        R.onnx_function("GemmEpilogue", opset=18, overload="fp8_to_float16")
    assert R.onnx_function("GemmEpilogue", opset=19, overload="fp8_to_float16").overload == "fp8_to_float16"
    body = [n.op_type for n in R.onnx_function("GatedGemm", opset=19, overload="fp8_to_float16").node]
    assert body.count("DequantizeLinear") == 3 and body[-1] == "Cast"


def _mixed_model(rng) -> tuple[onnx.ModelProto, dict, list]:
    """One graph: an fp32 GemmEpilogue (v1's function), an FP8 GemmEpilogue with y float32, an
    fp32 one with y float16 and an FP8 GatedGemm with y float32, all reading their own inputs."""
    nodes, feeds, vis, outs, want = [], {}, [], [], []
    cases = [("GemmEpilogue", "float32", {}), ("GemmEpilogue", "float8e4m3fn", {"output_dtype": "float32", "activation": "gelu_erf"}),
             ("GemmEpilogue", "float32", {"output_dtype": "float16"}), ("GatedGemm", "float8e4m3fn", {"output_dtype": "float32"})]
    for j, (op, dt, extra) in enumerate(cases):
        ins, attrs = R.sample_inputs(op, rng, dt)
        attrs = {**attrs, **extra}
        names = []
        for t, x in zip(R.SPECS[op].inputs, ins):
            if x is None:
                names.append("")
                continue
            name = f"n{j}_{t.name}"
            names.append(name)
            feeds[name] = _ort_value(x)
            vis.append(helper.make_tensor_value_info(name, _onnx_type(x), list(x.shape)))
        while names[-1] == "":
            names.pop()
        (y,) = R.reference(op, ins, attrs)
        nodes.append(helper.make_node(op, names, [f"y{j}"], domain="optfuse", name=f"node{j}", **attrs))
        outs.append(helper.make_tensor_value_info(f"y{j}", helper.np_dtype_to_tensor_dtype(y.dtype), list(y.shape)))
        want.append(y)
    model = helper.make_model(helper.make_graph(nodes, "mixed", vis, outs),
                              opset_imports=[helper.make_opsetid("", 19), helper.make_opsetid("ai.onnx.ml", 2)])
    model.ir_version = 9
    return model, feeds, want


def test_a_model_with_fp8_and_other_gemm_nodes_runs_in_onnxruntime():
    """add_functions gives each node its variant's overload (one function per variant, IR 10) and
    onnxruntime runs FP8 and non-FP8 nodes of one op in one model, each matching the reference."""
    import onnxruntime as ort

    from optfuse.rewrite import add_functions

    model, feeds, want = _mixed_model(np.random.default_rng(3))
    model = add_functions(model)
    assert [n.overload for n in model.graph.node] == ["", "fp8_to_float32", "to_float16", "fp8_to_float32"]
    assert sorted((f.name, f.overload) for f in model.functions) == [
        ("GatedGemm", "fp8_to_float32"), ("GemmEpilogue", ""), ("GemmEpilogue", "fp8_to_float32"),
        ("GemmEpilogue", "to_float16")]
    assert model.ir_version == 10
    assert add_functions(model).functions == model.functions  # idempotent
    onnx.checker.check_model(model, full_check=True)
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=1e-3 if g.dtype == np.float16 else 2e-5,
                                   atol=1e-3 if g.dtype == np.float16 else 2e-5)
