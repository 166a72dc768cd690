"""CI's TensorRT-RTX check on the test models: export (optfuse.models), fuse, FP16, build on CPU for
sm_89 and sm_80; each build has one plugin layer per optfuse node (GEMM fusions included: every
FFN, LLaMA's gated FFNs as GatedGemm) and serializes; the FP16 model
stays within FP16 tolerances of the FP32 original in onnxruntime."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import onnx  # noqa: E402

from optfuse.fusions import fuse_model  # noqa: E402
from optfuse.precision import convert_precision  # noqa: E402
from optfuse.recipe import DEFAULT_TOLERANCES  # noqa: E402
from optfuse.trt import compat  # noqa: E402
from optfuse.trt.build import build_engine_file, optfuse_nodes  # noqa: E402
from optfuse.verify import verify  # noqa: E402

FAMILIES = ["bert", "gpt2", "vit", "llama"]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.mark.slow
@pytest.mark.trt
@pytest.mark.parametrize("family", FAMILIES)
def test_model_fp16_builds_with_rtx(family, models_dir):
    from optfuse.models import export_model

    if "tensorrt_rtx" not in compat.installed_backends():
        pytest.skip("TensorRT-RTX not installed")
    m = export_model(family, "dynamo", "sdpa", models_dir)
    dims = {k: (d["min"], d["opt"], d["max"]) for k, d in m.dims.items()}
    fused, res = fuse_model(onnx.load(str(m.path)), dims={k: v[1] for k, v in dims.items()})
    half, _ = convert_precision(fused, "fp16")
    path = models_dir / f"{family}.fp16.onnx"
    onnx.save(half, path)
    atol, rtol = DEFAULT_TOLERANCES["fp16"]
    v = verify(str(m.path), str(path), None, atol=atol, rtol=rtol)
    assert v.passed, [(o.name, o.max_abs) for o in v.outputs]
    n = len(optfuse_nodes(half))
    assert n == len(res.accepted) > 0
    counts = res.counts()
    assert counts.get("GemmEpilogue", 0) > 0 and counts.get("GatedGemm", 0) == (m.counts["attention"] if family == "llama" else 0)
    for target in ("sm_89", "sm_80"):
        r = build_engine_file(path, models_dir / f"{family}.{target}.plan", dims=dims, target=target, backend="rtx")
        assert r.layers_by_kind["plugin"] == n == r.optfuse_nodes
        assert r.engine_bytes > 0 and r.target == target
