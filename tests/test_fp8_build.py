"""TensorRT-RTX CPU builds of FP8 BERT and LLaMA for sm_89 (Ada has FP8): every optfuse node a
plugin layer, the engine serialized, and the build report naming the layers that run FP8."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import onnx  # noqa: E402

from optfuse import DOMAIN  # noqa: E402
from optfuse.fusions import available_families, fuse_model  # noqa: E402
from optfuse.pipeline.fp8 import calibration_feeds  # noqa: E402
from optfuse.precision import PrecisionOptions, apply_precision  # noqa: E402
from optfuse.precision.fp8 import PLUGIN_GEMMS, fp8_ready  # noqa: E402
from optfuse.report.build import build_markdown  # noqa: E402
from optfuse.trt import compat  # noqa: E402
from optfuse.trt.build import build_engine_file, optfuse_nodes  # noqa: E402

CASES = [("bert", "dynamo"), ("llama", "dynamo"), ("llama", "torchscript")]


def _build(exported_model, tmp_path, family, exporter, families):
    if "tensorrt_rtx" not in compat.installed_backends():
        pytest.skip("TensorRT-RTX not installed")
    em = exported_model(family, exporter, "sdpa")
    fused, _ = fuse_model(onnx.load(str(em.path)), dims={"batch": 2, "sequence": 16}, families=families)
    model, res = apply_precision(fused, PrecisionOptions(mode="fp8"), calibration_feeds(fused, None))
    path = tmp_path / f"{family}.fp8.onnx"
    onnx.save(model, path)
    dims = {k: (d["min"], d["opt"], d["max"]) for k, d in em.dims.items()}
    report = build_engine_file(path, tmp_path / f"{family}.plan", dims=dims, target="sm_89", backend="rtx")
    n = len(optfuse_nodes(model))
    assert report.layers_by_kind["plugin"] == n == report.optfuse_nodes > 0
    assert report.engine_bytes > 0 and report.target == "sm_89" and (tmp_path / f"{family}.plan").stat().st_size > 0
    return model, res, report


@pytest.mark.slow
@pytest.mark.trt
@pytest.mark.parametrize("family, exporter", CASES)
def test_fp8_qdq_builds_with_rtx(family, exporter, exported_model, tmp_path):
    model, res, report = _build(exported_model, tmp_path, family, exporter,
                                [f for f in available_families() if f != "gemm"])
    gemms = [g["name"] for g in res.fp8["gemms"]]
    assert gemms
    fp8 = {entry.rsplit(" (", 1)[0]: entry.rsplit(" (", 1)[1].rstrip(")") for entry in report.fp8_layers}
    for name in gemms:  # every quantized GEMM runs FP8: TensorRT fuses its Q/DQ pattern
        assert fp8.get(name) == "MATRIX_MULTIPLY", (name, sorted(fp8))
    assert sum(t == "QUANTIZE" for t in fp8.values()) == sum(n.op_type == "QuantizeLinear" for n in model.graph.node)
    assert "Layers that run FP8" in build_markdown(report)


@pytest.mark.slow
@pytest.mark.trt
@pytest.mark.parametrize("family, exporter", CASES)
def test_fp8_mha_builds_with_rtx(family, exporter, exported_model, tmp_path):
    """Attention unfused, in TensorRT's FP8 MHA pattern: both batched GEMMs of every block run FP8."""
    model, res, report = _build(exported_model, tmp_path, family, exporter,
                                [f for f in available_families() if f != "attention"])
    matmuls = {m for a in res.fp8["attention"] for m in a["matmuls"]}
    assert matmuls
    fp8 = {entry.rsplit(" (", 1)[0]: entry.rsplit(" (", 1)[1].rstrip(")") for entry in report.fp8_layers}
    assert all(fp8.get(m) == "MATRIX_MULTIPLY" for m in matmuls), sorted(matmuls - set(fp8))


@pytest.mark.slow
@pytest.mark.trt
@pytest.mark.parametrize("family, exporter", CASES)
def test_fp8_plugins_build_with_rtx(family, exporter, exported_model, tmp_path):
    if not all(fp8_ready(op) for op in PLUGIN_GEMMS):
        pytest.skip("the GEMM spec has no FP8 form yet")
    model, res, report = _build(exported_model, tmp_path, family, exporter, None)
    plugin = {n.name for n in model.graph.node if n.domain == DOMAIN and n.op_type in PLUGIN_GEMMS}
    assert plugin and {g["name"] for g in res.fp8["gemms"]} == plugin
    fp8 = {entry.rsplit(" (", 1)[0] for entry in report.fp8_layers}
    assert plugin <= fp8, sorted(plugin - fp8)


@pytest.mark.slow
@pytest.mark.trt
@pytest.mark.parametrize("family, exporter", [c for c in CASES if c[0] == "llama"])
def test_fp8_norm_outputs_build_with_rtx(family, exporter, exported_model, tmp_path):
    """LLaMA's RMSNorms in front of FP8 GEMMs write E4M3 (optfuse.precision.fp8_norm): their plugin
    layers have an FP8 output in the network, so the build report lists them among the FP8 layers."""
    model, res, report = _build(exported_model, tmp_path, family, exporter, None)
    folded = {x["name"] for x in res.fp8["norms"] if x["form"] == "fp8_output"}
    assert folded
    fp8 = {entry.rsplit(" (", 1)[0] for entry in report.fp8_layers}
    assert folded <= fp8, sorted(folded - fp8)
