"""Engine builds with TensorRT-RTX on CPU (or TensorRT where installed): every optfuse node must
become a plugin layer, the engine must serialize, and a node the parser cannot map must fail the
build (exit 2) with its name -- never a silent fallback.

Builds run in child processes (``build_engine_file`` does that by itself): a native abort in
TensorRT would otherwise kill pytest.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphs
from optfuse.errors import BuildError, InputError
from optfuse.fusions import fuse_model
from optfuse.precision import convert_precision
from optfuse.report import build_markdown
from optfuse.trt import compat
from optfuse.trt.build import build_engine_file, diagnose_nodes, input_profiles, optfuse_nodes, prepare_for_trt

ROOT = Path(__file__).resolve().parents[1]
BACKEND = compat.resolve_backend("auto")
needs_trt = pytest.mark.skipif(BACKEND is None, reason="no tensorrt / tensorrt_rtx installed")
DIMS = {"b": (1, 2, 4), "s": (1, 8, 16)}
#: Targets every backend can build for without a GPU of that kind: RTX builds on CPU for any of
#: them; standard TensorRT builds only for the GPU present.
RTX_TARGETS = ["sm_89", "sm_80"]


def _fused(norm: str, mode: str = "fp16", hidden: int = 64) -> onnx.ModelProto:
    m = graphs.residual_block(hidden=hidden, norm=norm, n_layers=2)
    fused, res = fuse_model(m, dims={"b": 2, "s": 8}, families=graphs.NORM_FAMILIES)
    assert res.accepted
    out, _ = convert_precision(fused, mode)
    return out


def _plugin_node_model(op="LayerNorm", version="1", domain="optfuse", ns="optfuse", name="optfuse/test/0",
                       extra_nodes=0) -> onnx.ModelProto:
    H = 64
    inits = [numpy_helper.from_array(np.ones(H, np.float16), "g"), numpy_helper.from_array(np.zeros(H, np.float16), "b")]
    attrs = {"plugin_version": version, "epsilon": 1e-5}
    if ns is not None:
        attrs["plugin_namespace"] = ns
    ins = ["x", "g", "b"] if op in ("LayerNorm", "Bogus") else ["x", "g"]
    nodes = [helper.make_node(op, ins, ["y0"], name=name, domain=domain, **attrs)]
    for i in range(extra_nodes):
        nodes.append(helper.make_node("RMSNorm", [f"y{i}", "g"], [f"y{i + 1}"], name=f"optfuse/test/{i + 1}",
                                      domain="optfuse", plugin_namespace="optfuse", plugin_version="1"))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["b", "s", H])],
                          [helper.make_tensor_value_info(f"y{extra_nodes}", TensorProto.FLOAT16, ["b", "s", H])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("optfuse", 1)])
    m.ir_version = 9
    return m


# ------------------------------------------------------------------------------------------------
# No TensorRT needed
# ------------------------------------------------------------------------------------------------
def test_prepare_strips_functions_and_fills_defaults():
    fused = _fused("layer_norm", "fp32")
    assert any(f.domain == "optfuse" for f in fused.functions)
    for n in fused.graph.node:
        if n.domain == "optfuse":
            del n.attribute[:]  # only the required bits left: the rest must be filled back in
    p = prepare_for_trt(fused, "qdp")
    assert not any(f.domain == "optfuse" for f in p.functions)
    for n in optfuse_nodes(p):
        a = {x.name: helper.get_attribute_value(x) for x in n.attribute}
        assert a["plugin_namespace"] == b"optfuse" and a["plugin_version"] == b"1"
        assert a["aot"] == 1 and abs(a["epsilon"] - 1e-5) < 1e-12
    assert any(f.domain == "optfuse" for f in fused.functions)  # the input is untouched


def test_diagnose_names_each_bad_node():
    m = _plugin_node_model(version="2", extra_nodes=1)
    m.graph.node[1].op_type = "NoSuchOp"
    d = diagnose_nodes(m)
    assert "plugin_version '2'" in d["optfuse/test/0"] and "not an optfuse op" in d["optfuse/test/1"]


def test_input_profiles():
    m = _plugin_node_model()
    assert input_profiles(m, DIMS) == {"x": {"min": [1, 1, 64], "opt": [2, 8, 64], "max": [4, 16, 64]}}
    with pytest.raises(InputError, match="'s'"):
        input_profiles(m, {"b": (1, 2, 4)})
    with pytest.raises(InputError, match="min <= opt <= max"):
        input_profiles(m, {"b": (4, 2, 1), "s": 8})


def test_backend_names():
    assert compat.normalize_backend("rtx") == "tensorrt_rtx"
    with pytest.raises(InputError, match="unknown TensorRT backend"):
        compat.normalize_backend("onnxruntime")


# ------------------------------------------------------------------------------------------------
# With a TensorRT backend
# ------------------------------------------------------------------------------------------------
PARSE_SCRIPT = textwrap.dedent(
    """
    import sys
    from optfuse.trt import compat, plugins
    be = compat.load("tensorrt_rtx")
    plugins.register_all(be)
    trt = be.trt
    logger = trt.Logger(trt.Logger.ERROR)
    net = trt.Builder(logger).create_network(0)
    parser = trt.OnnxParser(net, logger)
    ok = parser.parse(open(sys.argv[1], "rb").read())
    kinds = [net.get_layer(i).type.name for i in range(net.num_layers)]
    print("parsed", ok, kinds.count("PLUGIN_V3"))
    """
)


@needs_trt
@pytest.mark.trt
def test_rtx_parse_of_plugin_model_does_not_abort(tmp_path):
    """The ONNX parser dlopens libtensorrt_rtx.so when it meets a plugin node; compat makes sure
    it exists (TensorRT-RTX 1.7's wheel ships only .so.1 and the process used to abort)."""
    if not compat.installed_backends().count("tensorrt_rtx"):
        pytest.skip("TensorRT-RTX not installed")
    onnx.save(_plugin_node_model(extra_nodes=1), tmp_path / "m.onnx")
    (tmp_path / "parse.py").write_text(PARSE_SCRIPT)
    env = compat.child_env(dict(os.environ, PYTHONPATH=str(ROOT)))
    proc = subprocess.run([sys.executable, str(tmp_path / "parse.py"), str(tmp_path / "m.onnx")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "parsed True 2" in proc.stdout


@needs_trt
@pytest.mark.trt
@pytest.mark.parametrize("norm,mode,target", [("layer_norm", "fp16", "sm_89"), ("rms_norm", "bf16", "sm_80")])
def test_build_fused_model(tmp_path, norm, mode, target):
    if BACKEND != "tensorrt_rtx":
        target = None  # standard TensorRT builds for the GPU present
    model = _fused(norm, mode)
    path = tmp_path / "fused.onnx"
    onnx.save(model, path)
    report = build_engine_file(path, tmp_path / "model.plan", dims=DIMS, target=target, backend=BACKEND,
                               timing_cache=tmp_path / "timing.cache", log_path=tmp_path / "build.log",
                               report_path=tmp_path / "build.json")
    n = len(optfuse_nodes(model))
    assert n > 0 and report.optfuse_nodes == n
    assert report.layers_by_kind["plugin"] == n == len(report.plugin_layers)
    assert {p.name for p in report.plugin_layers} == {x.name for x in optfuse_nodes(model)}
    assert all(p.namespace == "optfuse" for p in report.plugin_layers)
    assert report.engine_bytes > 0 and (tmp_path / "model.plan").stat().st_size == report.engine_bytes
    assert (tmp_path / "build.log").read_text() and (tmp_path / "build.json").is_file()
    if BACKEND == "tensorrt_rtx":
        assert report.target == target
    md = build_markdown(report)
    assert "plugin 2" in md and "PLUGIN_V3" in md


@needs_trt
@pytest.mark.trt
def test_wrong_plugin_version_fails_naming_the_node(tmp_path):
    onnx.save(_plugin_node_model(version="7"), tmp_path / "bad.onnx")
    with pytest.raises(BuildError) as ei:
        build_engine_file(tmp_path / "bad.onnx", tmp_path / "bad.plan", dims=DIMS, backend=BACKEND)
    msg = str(ei.value)
    assert "optfuse/test/0" in msg and "plugin_version '7'" in msg and ei.value.exit_code == 2
    assert not (tmp_path / "bad.plan").exists()


@needs_trt
@pytest.mark.trt
def test_node_without_namespace_is_not_silently_native(tmp_path):
    """An optfuse node that the parser maps to something else (here: no namespace attribute and
    a domain the parser does not use) fails the build instead of falling back."""
    m = _plugin_node_model(op="LayerNorm", ns=None, domain="optfuse")
    onnx.save(m, tmp_path / "m.onnx")
    # prepare_for_trt writes plugin_namespace back in: with it the node maps; the check that
    # guards a missing mapping is exercised by a model whose node cannot become a plugin at all
    report = build_engine_file(tmp_path / "m.onnx", tmp_path / "m.plan", dims=DIMS, backend=BACKEND)
    assert report.layers_by_kind["plugin"] == 1
    m.graph.node[0].op_type = "Bogus"
    onnx.save(m, tmp_path / "bogus.onnx")
    with pytest.raises(BuildError, match=r"optfuse/test/0.*not an optfuse op"):
        build_engine_file(tmp_path / "bogus.onnx", tmp_path / "bogus.plan", dims=DIMS, backend=BACKEND)


@pytest.mark.trt
def test_rtx_rejects_sm90(tmp_path):
    if "tensorrt_rtx" not in compat.installed_backends():
        pytest.skip("TensorRT-RTX not installed")
    onnx.save(_plugin_node_model(), tmp_path / "m.onnx")
    with pytest.raises(InputError, match=r"sm_90.*sm_80, sm_86, sm_89"):
        build_engine_file(tmp_path / "m.onnx", tmp_path / "m.plan", dims=DIMS, target="sm_90", backend="rtx")
