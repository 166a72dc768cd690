"""Normalization fusions on hand-built graphs: every exporter variant, boundaries, numerics."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from optfuse.estimate import estimate_traffic
from optfuse.fusions import fuse_model

import graphs


def _run(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _ops(model):
    return [n.op_type for n in model.graph.node]


def _assert_same(original, fused, hidden=64, shape=(2, 8)):
    x = np.random.default_rng(1).standard_normal((*shape, hidden)).astype(np.float32) * 3 + 1
    ref = _run(original, {"x": x})
    got = _run(fused, {"x": x})
    for r, g in zip(ref, got):
        assert np.abs(r - g).max() <= 1e-4


@pytest.mark.parametrize("variant", ["pow_div", "mul_div", "pow_reciprocal", "pow_div_one"])
@pytest.mark.parametrize("opset", [14, 17, 18])
@pytest.mark.parametrize("casts", [False, True])
def test_decomposed_layer_norm_variants(variant, opset, casts):
    model = graphs.layer_norm(variant=variant, opset=opset, casts=casts)
    fused, res = fuse_model(model)
    assert res.counts() == {"LayerNorm": 1}, res.rejected
    assert _ops(fused) == ["LayerNorm"]
    node = fused.graph.node[0]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert node.domain == "optfuse"
    assert attrs["plugin_namespace"] == b"optfuse" and attrs["plugin_version"] == b"1"
    assert attrs["epsilon"] == pytest.approx(1e-5)
    _assert_same(model, fused)


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_affine_params_exact(affine):
    model = graphs.layer_norm(affine=affine, eps=1e-12)
    fused, res = fuse_model(model)
    assert res.counts() == {"LayerNorm": 1}
    eps = [a.f for a in fused.graph.node[0].attribute if a.name == "epsilon"][0]
    assert eps == pytest.approx(1e-12, rel=1e-6)
    _assert_same(model, fused)


@pytest.mark.parametrize("variant", ["reciprocal", "div_one", "div"])
@pytest.mark.parametrize("gamma_first", [True, False])
@pytest.mark.parametrize("opset", [17, 18])
def test_rms_norm_variants(variant, gamma_first, opset):
    model = graphs.rms_norm(variant=variant, gamma_first=gamma_first, opset=opset)
    fused, res = fuse_model(model)
    assert res.counts() == {"RMSNorm": 1}, res.rejected
    assert _ops(fused) == ["RMSNorm"]
    _assert_same(model, fused)


@pytest.mark.parametrize("norm,fused_op", [("layer_norm", "SkipLayerNorm"), ("rms_norm", "SkipRMSNorm")])
def test_residual_add_folds_into_skip_norm(norm, fused_op):
    model = graphs.residual_block(norm=norm, n_layers=3)
    fused, res = fuse_model(model, families=graphs.NORM_FAMILIES)
    assert res.counts() == {fused_op: 3}, (res.counts(), res.rejected)
    assert fused_op in _ops(fused) and "LayerNormalization" not in _ops(fused)
    # the sum is a second output and is read again by the residual Add after the norm
    for node in fused.graph.node:
        if node.op_type == fused_op:
            assert len(node.output) == 2
    _assert_same(model, fused)


def test_intermediate_graph_output_is_not_fused():
    model = graphs.layer_norm(extra_output="variance")
    fused, res = fuse_model(model)
    assert res.counts() == {}
    assert "LayerNorm" not in _ops(fused)
    reasons = [r.reason for r in res.rejected]
    assert any("graph output" in r for r in reasons), reasons
    _assert_same(model, fused)


def test_non_last_axis_is_not_fused():
    model = graphs.layer_norm(axes=(1,), affine=False, shape=["b", 8, 64])
    fused, res = fuse_model(model)
    assert res.counts() == {}
    assert any("not the last axis" in r.reason for r in res.rejected), res.rejected


def test_hidden_over_the_kernel_limit_is_not_fused():
    model = graphs.layer_norm(hidden=20000)
    fused, res = fuse_model(model)
    assert res.counts() == {}
    assert any("outside the kernel contract" in r.reason for r in res.rejected), res.rejected


def test_unsupported_dtype_is_not_fused():
    model = graphs.layer_norm(affine=False)
    for vi in list(model.graph.input) + list(model.graph.output):
        vi.type.tensor_type.elem_type = onnx.TensorProto.DOUBLE
    for init in model.graph.initializer:  # eps, exponent
        arr = onnx.numpy_helper.to_array(init).astype(np.float64)
        init.CopyFrom(onnx.numpy_helper.from_array(arr, init.name))
    fused, res = fuse_model(model)
    assert res.counts() == {}
    assert any("float64" in r.reason for r in res.rejected), res.rejected


def test_broadcasting_residual_stays_a_plain_norm():
    b = graphs.Builder()
    pos = b.const(np.random.default_rng(0).standard_normal((1, 8, 64)))
    s = b.node("Add", "x", pos)
    b.node("LayerNormalization", s, b.const(np.ones(64)), b.const(np.zeros(64)), axis=-1, epsilon=1e-5, out="y")
    model = b.model([graphs.io("x", ["b", 8, 64])], [graphs.io("y", ["b", 8, 64])])
    fused, res = fuse_model(model)
    assert res.counts() == {"LayerNorm": 1}
    assert any("broadcasts" in r.reason for r in res.rejected), res.rejected
    _assert_same(model, fused)


# --- real exports: every norm layer of every family fuses, both exporters ---------------------------
_FAMILIES = ["bert", "gpt2", "vit", "llama", "t5"]


@pytest.mark.slow
@pytest.mark.parametrize("family", _FAMILIES)
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_exported_models_fuse_every_norm(exported_model, family, exporter):
    em = exported_model(family, exporter, "eager")
    model = onnx.load(str(em.path))
    fused, res = fuse_model(model, dims={d: r["opt"] for d, r in em.dims.items()},
                            families=["layer_norm", "rms_norm", "skip_norm"])
    counts = res.counts()
    kind = "layer_norm" if em.counts.get("layer_norm") else "rms_norm"
    plain, skip = ("LayerNorm", "SkipLayerNorm") if kind == "layer_norm" else ("RMSNorm", "SkipRMSNorm")
    expected_skip = em.counts[f"skip_{kind}"]
    assert counts.get(plain, 0) + counts.get(skip, 0) == em.counts[kind], (counts, res.rejected)
    assert counts.get(skip, 0) == expected_skip, (counts, [r.reason for r in res.rejected])
    left = [n.op_type for n in fused.graph.node]
    assert "LayerNormalization" not in left and "ReduceMean" not in left
    # every fused norm saves traffic except a plain native LayerNormalization (one node to one node)
    saved = estimate_traffic(fused, res).saved_bytes
    assert all(saved[a.node_name] is not None for a in res.accepted)
    feeds = em.make_inputs(seed=3)
    ref, got = _run(model, feeds), _run(fused, feeds)
    for r, g in zip(ref, got):
        assert np.abs(r.astype(np.float64) - g).max() <= 1e-4


def test_estimate_is_one_shape_inference_per_run(monkeypatch):
    """Fusing runs no shape inference at the analysis dims (only the one at probe dims that tells
    symbolically equal shapes); the estimate runs exactly one, however many families applied."""
    from optfuse.ir import shapes

    calls = []
    infer = shapes._infer_static
    monkeypatch.setattr(shapes, "_infer_static", lambda m: calls.append(m) or infer(m))
    model = graphs.residual_block(n_layers=2)
    fused, res = fuse_model(model, dims={"b": 2, "s": 16}, families=graphs.NORM_FAMILIES)
    assert [a.op for a in res.accepted] == ["SkipLayerNorm"] * 2  # two families applied (LayerNorm, Skip)
    assert len(calls) == 1  # the probe shapes
    est = estimate_traffic(fused, res)
    assert len(calls) == 2
    assert est.dims == {"b": 2, "s": 16}
    assert [est.saved_bytes[a.node_name] for a in res.accepted] == [2 * 16 * 64 * 4] * 2
    # other dims on request: the same run sized for a larger batch
    assert [estimate_traffic(fused, res, {"b": 4, "s": 16}).saved_bytes[a.node_name] for a in res.accepted] \
        == [4 * 16 * 64 * 4] * 2
