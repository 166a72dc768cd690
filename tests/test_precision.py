"""Precision stage: strongly typed FP16/BF16 of fused models, keep-FP32 policy, optfuse nodes intact."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto

import graphs
from optfuse.errors import InputError
from optfuse.fusions import fuse_model
from optfuse.precision import DEFAULT_KEEP_FP32, check_optfuse_io, convert_precision, resolve_keep_fp32
from optfuse.recipe import DEFAULT_TOLERANCES
from optfuse.report import precision_markdown


def _pair(norm: str, hidden: int = 64):
    m = graphs.residual_block(hidden=hidden, norm=norm, n_layers=2)
    fused, _ = fuse_model(m, dims={"b": 2, "s": 8}, families=graphs.NORM_FAMILIES)
    return m, fused


def _run(model: onnx.ModelProto, feed: dict) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feed)


def _types(model: onnx.ModelProto) -> dict[str, int]:
    out = {i.name: i.data_type for i in model.graph.initializer}
    for vi in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info):
        out[vi.name] = vi.type.tensor_type.elem_type
    for n in model.graph.node:
        if n.op_type == "Cast":
            out[n.output[0]] = n.attribute[0].i
    return out


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_fp16_fused_model_matches_fp32_original(norm):
    orig, fused = _pair(norm)
    half, res = convert_precision(fused, "fp16")
    onnx.checker.check_model(half)
    # optfuse nodes and their reference functions survive, all float inputs FP16
    assert [n.op_type for n in half.graph.node if n.domain == "optfuse"] == [n.op_type for n in fused.graph.node if n.domain == "optfuse"]
    assert {f.name for f in half.functions} == {f.name for f in fused.functions}
    types = _types(half)
    for n in half.graph.node:
        if n.domain == "optfuse":
            assert {types[i] for i in n.input if i} == {TensorProto.FLOAT16}, n.name
    # graph I/O kept as exported
    assert half.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert half.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert res.optfuse_nodes == 2 and res.initializers_converted > 0 and "onnxconverter-common" in res.converter
    x = np.random.default_rng(0).standard_normal((2, 8, 64)).astype(np.float32)
    ref, got = _run(orig, {"x": x})[0], _run(half, {"x": x})[0]
    atol, rtol = DEFAULT_TOLERANCES["fp16"]
    assert np.allclose(got, ref, atol=atol, rtol=rtol), float(np.abs(got - ref).max())


def test_keep_fp32_by_op_and_by_node():
    _, fused = _pair("layer_norm")
    ln = next(n for n in fused.graph.node if n.domain == "optfuse")
    mm = next(n for n in fused.graph.node if n.op_type == "MatMul")
    ops, names = resolve_keep_fp32(fused, [ln.op_type, mm.name, "no-such-thing"], use_defaults=False)
    assert ops == [ln.op_type] and names == [mm.name]
    half, res = convert_precision(fused, "fp16", keep_fp32=[ln.op_type, mm.name])
    types = _types(half)
    for n in half.graph.node:
        if n.op_type == ln.op_type or n.name == mm.name:
            floats = {types.get(i) for i in n.input if i and types.get(i) is not None}
            assert floats == {TensorProto.FLOAT}, (n.name, floats)
    assert res.keep_fp32_ops == [ln.op_type] and res.keep_fp32_nodes == [mm.name]
    assert "kept in FP32" in precision_markdown(res)


def test_default_keep_fp32_covers_overflowing_ops():
    orig = graphs.layer_norm(hidden=32)  # unfused: Pow + ReduceMean compute the variance
    half, res = convert_precision(orig, "fp16")
    assert "Pow" in res.keep_fp32_ops and "Pow" in DEFAULT_KEEP_FP32
    x = (np.random.default_rng(1).standard_normal((2, 8, 32)) * 300).astype(np.float32)  # x^2 > 65504
    ref, got = _run(orig, {"x": x})[0], _run(half, {"x": x})[0]
    assert np.isfinite(got).all() and np.allclose(got, ref, atol=2e-2, rtol=2e-2)


def test_io_dtype_fp16():
    _, fused = _pair("rms_norm")
    half, res = convert_precision(fused, "fp16", io_dtype="fp16")
    assert half.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    assert half.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    x = np.random.default_rng(0).standard_normal((2, 8, 64)).astype(np.float16)
    assert _run(half, {"x": x})[0].dtype == np.float16


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_graph_output_read_inside_the_graph(fused):
    """A value that is a graph output and read again inside the graph (a decoder's present KV cache, which its
    attention reads): with the graph's I/O kept FP32 the output gets a Cast back to FP32 and the graph's own
    readers take the FP16 value before it (onnxconverter-common alone leaves them on the FP32 copy, which
    onnxruntime refuses); a reader kept in FP32 keeps the FP32 copy."""
    b = graphs.Builder()
    w = b.const(np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32) * 0.1)
    present = b.node("MatMul", "x", w, out="present")
    y = b.node("MatMul", b.node("Unsqueeze", present, b.const(np.array([0], np.int64), dtype=np.int64)), w)
    b.node("Identity", b.node("Pow", present, b.const(2.0)), out="squares")
    b.node("Identity", y, out="y")
    model = b.model([graphs.io("x", [2, 8, 64])], [graphs.io("present", [2, 8, 64]), graphs.io("y", [1, 2, 8, 64]),
                                                   graphs.io("squares", [2, 8, 64])])
    if fused:
        model = graphs.residual_block(hidden=64, norm="layer_norm", n_layers=1)
        model.graph.output.append(graphs.io(model.graph.node[-1].input[0], None))  # the last add: also an output
        model, _ = fuse_model(model)
    half, res = convert_precision(model, "fp16")
    check_optfuse_io(half)
    assert any("rewired to the fp16 value" in n for n in res.notes)
    types = _types(half)
    outs = {o.name for o in half.graph.output}
    for n in half.graph.node:
        if n.op_type != "Cast" and n.op_type not in DEFAULT_KEEP_FP32:
            assert not [i for i in n.input if i in outs], n.name  # the graph's own readers: the FP16 value
    if not fused:
        pow_node = next(n for n in half.graph.node if n.op_type == "Pow")
        assert pow_node.input[0] == "present" and types["present"] == TensorProto.FLOAT  # kept FP32: the FP32 copy
    x = np.random.default_rng(1).standard_normal((2, 8, 64)).astype(np.float32)
    feeds = {half.graph.input[0].name: x}
    want, got = _run(model, feeds), _run(half, feeds)
    for a, g in zip(want, got):
        assert g.dtype == np.float32 and np.abs(a - g).max() <= 1e-2 + 1e-2 * np.abs(a).max()


def test_bf16_retypes_everything_half():
    _, fused = _pair("layer_norm")
    bf, res = convert_precision(fused, "bf16")
    types = _types(bf)
    assert TensorProto.FLOAT16 not in set(types.values())
    assert TensorProto.BFLOAT16 in {i.data_type for i in bf.graph.initializer}
    check_optfuse_io(bf)
    onnx.checker.check_model(bf)
    assert res.mode == "bf16" and res.notes


def test_fp32_is_identity_and_bad_mode():
    _, fused = _pair("layer_norm")
    same, res = convert_precision(fused, "fp32")
    assert same is fused and res.mode == "fp32"
    with pytest.raises(InputError):
        convert_precision(fused, "int8")
