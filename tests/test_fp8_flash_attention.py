"""Precision fp8 on optfuse's FlashAttention (optfuse/precision/fp8_attention.py): on the tiny BERT
and LLaMA models each fused FlashAttention node takes E4M3 q, k, v (v transposed and padded to
[B, Hkv, D, Skv]) with float32 scales calibrated per tensor, o in the base precision, and the
fake-quant candidate stays within the recipe's FP8 tolerances of the FP32 original in onnxruntime."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

from optfuse import DOMAIN  # noqa: E402
from optfuse.fusions import fuse_model  # noqa: E402
from optfuse.pipeline.fp8 import calibration_feeds  # noqa: E402
from optfuse.precision import PrecisionOptions, apply_precision  # noqa: E402
from optfuse.verify import verify  # noqa: E402

DIMS = {"batch": 2, "sequence": 16}
CASES = [("bert", "dynamo"), ("llama", "dynamo"), ("llama", "torchscript")]


def _fused(exported_model, family, exporter):
    em = exported_model(family, exporter, "sdpa")
    fused, _ = fuse_model(onnx.load(str(em.path)), dims=DIMS)
    return em, fused


def _flash(model):
    return [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == "FlashAttention"]


@pytest.mark.slow
@pytest.mark.parametrize("family, exporter", CASES)
def test_flash_attention_takes_fp8_q_k_v(family, exporter, exported_model, tmp_path):
    em, fused = _fused(exported_model, family, exporter)
    names = {n.name for n in _flash(fused)}
    assert names
    out, res = apply_precision(fused, PrecisionOptions(mode="fp8"), calibration_feeds(fused, None))
    assert {a["name"] for a in res.fp8["flash_attention"]} == names and "FlashAttention" not in res.fp8["kept"]
    prod = {o: n for n in out.graph.node for o in n.output}
    inits = {t.name: t for t in out.graph.initializer}
    for n in _flash(out):
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        assert attrs["output_dtype"] == b"float16" and attrs["plugin_version"] == b"3"
        assert n.overload == "fp8_to_float16" and len(n.input) == 7
        q, k, vq = (prod[i] for i in n.input[:3])
        assert q.op_type == k.op_type == vq.op_type == "QuantizeLinear"  # no DQ in front of the plugin
        assert all(inits[x.input[2]].data_type == TensorProto.FLOAT8E4M3FN for x in (q, k, vq))
        pad = prod[vq.input[0]]
        assert pad.op_type == "Pad" and prod[pad.input[0]].op_type == "Transpose"
        assert list(helper.get_attribute_value(prod[pad.input[0]].attribute[0])) == [0, 1, 3, 2]
        for x, s in zip((q, k, vq), n.input[4:7]):
            assert inits[s].data_type == TensorProto.FLOAT and list(inits[s].dims) == [1]
            q_scale = onnx.numpy_helper.to_array(inits[x.input[1]]).astype(np.float32)
            assert q_scale == onnx.numpy_helper.to_array(inits[s])[0] > 0  # the Q and the plugin agree
    assert {(f.name, f.overload) for f in out.functions if f.name == "FlashAttention"} == {("FlashAttention", "fp8_to_float16")}
    path = tmp_path / "fp8.onnx"
    onnx.save(out, path)
    v = verify(str(em.path), str(path), None)
    assert v.passed, [(o.name, o.max_abs, o.cosine, o.note) for o in v.outputs]
    assert all(o.cosine >= 0.99 for o in v.outputs)


@pytest.mark.slow
def test_excluded_flash_attention_stays_in_the_base_precision(exported_model):
    em, fused = _fused(exported_model, "llama", "dynamo")
    out, res = apply_precision(fused, PrecisionOptions(mode="fp8", fp8_exclude=("FlashAttention",)),
                               calibration_feeds(fused, None))
    kept = res.fp8["flash_attention_kept"]
    assert {k["name"] for k in kept} == {n.name for n in _flash(fused)} and "flash_attention" not in res.fp8
    assert all("fp8_exclude" in k["reason"] for k in kept)
    assert res.fp8["kept"]["FlashAttention"][0] == len(kept)
    for n in _flash(out):
        assert len(n.input) == 4 and not n.overload
