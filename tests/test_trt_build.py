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


PLUGIN_IO_SCRIPT = PARSE_SCRIPT.replace(
    'print("parsed", ok, kinds.count("PLUGIN_V3"))',
    'print("parsed", ok, [[net.get_layer(i).get_input(j).dtype.name for j in range(net.get_layer(i).num_inputs)]'
    ' for i in range(net.num_layers) if kinds[i] == "PLUGIN_V3"])')


@needs_trt
@pytest.mark.trt
def test_rtx_parses_block_sparse_layout_inputs(tmp_path):
    """A fused BlockSparseAttention node reaches the parser with its int32 BSR layout initializers
    as plugin inputs (the plugin's formats accept int32 where the spec says so)."""
    if not compat.installed_backends().count("tensorrt_rtx"):
        pytest.skip("TensorRT-RTX not installed")
    from test_sparse_attention_fusion import _local_global, masked_attention

    fused, res = fuse_model(masked_attention(_local_global()))
    assert [a.op for a in res.accepted] == ["BlockSparseAttention"]
    onnx.save(prepare_for_trt(fused, "classic"), tmp_path / "m.onnx")
    (tmp_path / "parse.py").write_text(PLUGIN_IO_SCRIPT)
    env = compat.child_env(dict(os.environ, PYTHONPATH=str(ROOT)))
    proc = subprocess.run([sys.executable, str(tmp_path / "parse.py"), str(tmp_path / "m.onnx")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "parsed True [['FLOAT', 'FLOAT', 'FLOAT', 'FLOAT', 'INT32', 'INT32']]" in proc.stdout, proc.stdout


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


# ------------------------------------------------------------------------------------------------
# Outputs whose last dim comes from another input (a GEMM's N)
# ------------------------------------------------------------------------------------------------
def test_output_dims_follow_like_and_last_dim():
    from optfuse.spec import get_spec
    from optfuse.trt import glue

    gemm, gated, ln = get_spec("GemmEpilogue"), get_spec("GatedGemm"), get_spec("LayerNorm")
    assert glue.output_last_dim_index(gemm) == [(1, 0)] and glue.output_last_dim_index(ln) == [None]
    assert glue.output_dims(gemm, 0, [("B", "S", 64), (192, 64), (192,), ()]) == ["B", "S", 192]
    assert glue.output_dims(gated, 0, [("M", 128), (256, 128), (256, 128)]) == ["M", 256]
    assert glue.output_dims(ln, 0, [("B", "S", 64), (64,), (64,)]) == ["B", "S", 64]


def test_classic_plugin_output_shapes_take_n_from_the_weight():
    """IPluginV3.get_output_shapes over stand-in DimsExprs: y = [..., N] with N = W's dim 0."""
    import types

    from optfuse.spec import get_spec
    from optfuse.trt import plugins

    bases = {name: type(name, (), {"__init__": lambda self, *a, **k: None})
             for name in ("IPluginV3", "IPluginV3OneCore", "IPluginV3OneBuild", "IPluginV3OneRuntime")}
    fake = types.SimpleNamespace(**bases, DimsExprs=list)
    plugin = plugins._plugin_class(fake, get_spec("GemmEpilogue"))()
    a, w = ["B", "S", 64], [192, 64]
    assert plugin.get_output_shapes([a, w, [192], []], [], None) == [["B", "S", 192]]
    assert a == ["B", "S", 64]  # the input's dims are not changed
    ln = plugins._plugin_class(fake, get_spec("LayerNorm"))()
    assert ln.get_output_shapes([["B", "S", 64], [64], [64]], [], None) == [["B", "S", 64]]


def _gemm_model(hidden=64, inner=128) -> onnx.ModelProto:
    """A fused pre-norm FFN: LayerNorm -> GemmEpilogue(gelu) -> GemmEpilogue(+ residual)."""
    rng = np.random.default_rng(0)
    b = graphs.Builder(17)
    h = b.node("LayerNormalization", "x", b.const(np.ones(hidden)), b.const(np.zeros(hidden)), axis=-1)
    up = b.node("Relu", b.node("Add", b.node("MatMul", h, b.const(rng.standard_normal((hidden, inner)) / 8)),
                               b.const(rng.standard_normal(inner))))
    b.node("Add", b.node("MatMul", up, b.const(rng.standard_normal((inner, hidden)) / 8)), "x", out="y")
    return b.model([graphs.io("x", ["b", "s", hidden])], [graphs.io("y", ["b", "s", hidden])])


@needs_trt
@pytest.mark.trt
@pytest.mark.parametrize("target", RTX_TARGETS[:1])
def test_build_fused_gemm_model(tmp_path, target):
    """GemmEpilogue nodes (output [..., N] from the weight) become plugin layers, one per node."""
    from optfuse.spec import plugin_module

    try:
        plugin_module("gemm", "launch")
    except ModuleNotFoundError:
        pytest.skip("the GEMM kernels (plugins/gemm/launch.py) are not in this checkout")
    fused, res = fuse_model(_gemm_model(), dims={"b": 2, "s": 8})
    assert res.counts() == {"LayerNorm": 1, "GemmEpilogue": 2}
    half, _ = convert_precision(fused, "fp16")
    path = tmp_path / "ffn.onnx"
    onnx.save(half, path)
    r = build_engine_file(path, tmp_path / "ffn.plan", dims=DIMS, target=target, backend="rtx")
    assert r.layers_by_kind["plugin"] == 3 == r.optfuse_nodes
    assert r.engine_bytes > 0
