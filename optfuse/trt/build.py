"""Stage `build` (TensorRT backend): fused (precision) ONNX -> TensorRT engine, with a report and
no silent fallback. The report is plain data (:class:`BuildReport`); :mod:`optfuse.report` renders it.

:func:`build_engine` parses the model with the ONNX parser after registering optfuse's plugins
(QDP AOT on TensorRT >= 10.9, classic Python IPluginV3 on TensorRT-RTX and older TensorRT),
inspects the network's layers and raises :class:`BuildError` (exit 2) naming every optfuse node
that did not become a plugin layer -- whether the parser failed on it (wrong plugin version,
unknown op...) or mapped it to something else. Then it builds with one optimization profile from
the recipe's min/opt/max dims, a timing cache, and the chosen target.

The copy handed to TensorRT differs from the file in three ways: the optfuse reference ONNX
functions are removed (so no parser can quietly inline them instead of using the plugin),
attributes left at their spec default are written out (QDP needs every attribute), and QDP mode
adds ``aot=1``.

:func:`build_engine_file` runs the build in a child process (``python -m optfuse.trt.build``):
a native abort inside TensorRT then becomes a BuildError instead of killing the caller, and the
child gets the environment TensorRT-RTX needs (see :func:`optfuse.trt.compat.child_env`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import onnx

from .. import DOMAIN
from ..errors import BuildError, InputError, OptfuseError
from . import compat
from .prepare import (DimRange, _dim_range, diagnose_nodes, input_profiles, optfuse_nodes, parse_target,
                      prepare_for_trt)

__all__ = ["BuildProfile", "BuildReport", "PluginLayer", "build_engine", "build_engine_file", "diagnose_nodes",
           "input_profiles", "optfuse_nodes", "prepare_for_trt", "runnable_here"]

PLUGIN_LAYER_TYPES = ("PLUGIN", "PLUGIN_V2", "PLUGIN_V3")


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------
@dataclass
class PluginLayer:
    name: str
    op: str
    namespace: str
    version: str
    kind: str  # layer type: PLUGIN_V3...
    form: str  # "qdp-aot" | "python-v3" | "other"


@dataclass
class BuildReport:
    onnx: str
    engine: str | None
    backend: str
    backend_version: str
    plugin_mode: str
    target: str
    optfuse_nodes: int
    plugin_layers: list[PluginLayer] = field(default_factory=list)
    layers_by_kind: dict[str, int] = field(default_factory=dict)  # plugin / native
    layer_types: dict[str, int] = field(default_factory=dict)
    engine_bytes: int = 0
    profiles: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    timing_cache: str | None = None
    build_log: str | None = None
    parse_seconds: float = 0.0
    build_seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)
    runnable_here: bool = False
    not_runnable_reason: str = ""
    #: layers that run FP8: "<name> (<type>)" for each layer with an FP8 input or output tensor in the
    #: network (Q/DQ, plugins taking E4M3) and each matrix multiply fed by FP8 dequantization (TensorRT
    #: runs it in FP8 after fusing the Q/DQ pattern)
    fp8_layers: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> BuildReport:
        d = dict(d)
        d["plugin_layers"] = [PluginLayer(**p) for p in d.get("plugin_layers", [])]
        return cls(**d)

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))


@dataclass(frozen=True)
class BuildProfile:
    """The one optimization profile of a build: each symbolic dim's (min, opt, max), input shapes
    spelled by a recipe (over the ONNX shapes), and where the ranges came from (for the notes)."""

    dims: dict[str, DimRange] = field(default_factory=dict)
    input_shapes: dict[str, list[int | str]] | None = None
    source: str = "static shapes"


# ------------------------------------------------------------------------------------------------
# The build (in-process)
# ------------------------------------------------------------------------------------------------
def _make_logger(trt, min_severity=None):
    class _Logger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.lines: list[tuple[str, str]] = []

        def log(self, severity, msg):
            self.lines.append((str(getattr(severity, "name", severity)), str(msg)))

    return _Logger()


def _layer_plugin(trt, layer) -> tuple[str, str, str, str]:
    """(op, namespace, version, form) of a plugin layer (best effort)."""
    form = "other"
    for cls_name in ("IPluginV3Layer", "IPluginV2Layer"):
        cls = getattr(trt, cls_name, None)
        if cls is None:
            continue
        try:
            layer.__class__ = cls
            plg = layer.plugin
        except Exception:
            continue
        op = getattr(plg, "plugin_name", None) or getattr(plg, "plugin_type", "") or ""
        ns = getattr(plg, "plugin_namespace", "") or ""
        ver = getattr(plg, "plugin_version", "") or ""
        tname = type(plg).__name__
        if "AOT" in tname:
            form = "qdp-aot"
        elif tname.endswith("PluginV3"):
            form = "python-v3"
        return str(op), str(ns), str(ver), form
    return "", "", "", form


def _gpu_arch() -> int | None:
    from ..kernels.target import detect_arch

    return detect_arch()


def build_engine(
    onnx_path: str | os.PathLike,
    *,
    dims: dict[str, Any] | None = None,
    input_shapes: dict[str, list] | None = None,
    target: Any = None,
    backend: str | None = None,
    timing_cache: str | os.PathLike | None = None,
    log_path: str | os.PathLike | None = None,
    plugin_mode: str | None = None,
    opt_level: int | None = None,
) -> tuple[bytes, BuildReport]:
    """Build an engine in this process; returns (engine bytes, report). See module doc."""
    onnx_path = Path(onnx_path)
    model = _load(onnx_path)
    be = compat.load(backend)
    trt = be.trt
    arch, gpu = _build_arch(be, parse_target(target))
    mode = _plugin_mode(be, plugin_mode)

    nodes = optfuse_nodes(model)
    diagnosis = diagnose_nodes(model)
    prepared = prepare_for_trt(model, mode)
    profiles = input_profiles(model, dims, input_shapes)
    _register_plugins(be, mode, arch)

    logger = _make_logger(trt)
    report = BuildReport(
        onnx=str(onnx_path), engine=None, backend=be.name, backend_version=be.version, plugin_mode=mode,
        target=_target_label(be, arch), optfuse_nodes=len(nodes), profiles=profiles,
    )
    try:
        t0 = time.perf_counter()
        builder = trt.Builder(logger)
        # the parser owns the weights the network points at: it stays referenced until the build is done
        network, _parser = _parse(be, builder, logger, mode, prepared, onnx_path, model, diagnosis)
        report.parse_seconds = time.perf_counter() - t0
        _inspect_layers(trt, network, nodes, report, diagnosis)

        config = _config(be, builder, profiles, arch, opt_level)
        cache_obj = None
        if timing_cache is not None and hasattr(config, "create_timing_cache"):
            tc = Path(timing_cache)
            cache_obj = config.create_timing_cache(tc.read_bytes() if tc.is_file() else b"")
            config.set_timing_cache(cache_obj, ignore_mismatch=True)
        t1 = time.perf_counter()
        engine = builder.build_serialized_network(network, config)
        report.build_seconds = time.perf_counter() - t1
        if engine is None:
            errors = [m for s, m in logger.lines if s in ("ERROR", "INTERNAL_ERROR")]
            raise BuildError("TensorRT could not build the engine:\n  " + "\n  ".join(errors[-10:] or ["(no error logged)"]))
        data = bytes(memoryview(engine))
        report.engine_bytes = len(data)
        if cache_obj is not None:
            Path(timing_cache).parent.mkdir(parents=True, exist_ok=True)
            Path(timing_cache).write_bytes(bytes(memoryview(config.get_timing_cache().serialize())))
            report.timing_cache = str(timing_cache)
        report.runnable_here, report.not_runnable_reason = runnable_here(be, arch, gpu)
        report.warnings += [m for s, m in logger.lines if s == "WARNING"][:20]
        return data, report
    finally:
        if log_path is not None:
            Path(log_path).parent.mkdir(parents=True, exist_ok=True)
            Path(log_path).write_text("".join(f"[{s}] {m}\n" for s, m in logger.lines))
            report.build_log = str(log_path)


def _load(onnx_path: Path) -> onnx.ModelProto:
    if not onnx_path.is_file():
        raise InputError(f"model {onnx_path}: file not found")
    try:
        return onnx.load(str(onnx_path), load_external_data=False)
    except Exception as exc:
        raise InputError(f"model {onnx_path}: not a readable ONNX file ({exc})") from None


def _build_arch(be: compat.Backend, arch: int | None) -> tuple[int | None, int | None]:
    """(the arch the engine targets, the GPU present): RTX builds for any arch it supports;
    standard TensorRT only for the GPU present."""
    compat.check_target(be, arch)
    gpu = _gpu_arch()
    if not be.is_rtx:
        if gpu is None:
            raise BuildError(f"{be.label} builds engines on a GPU and none was found; use --backend tensorrt_rtx for a CPU-only build")
        if arch is not None and arch != gpu:
            raise InputError(f"{be.label} builds for the GPU present (sm_{gpu}); --target sm_{arch} needs that GPU")
        arch = gpu
    return arch, gpu


def _plugin_mode(be: compat.Backend, plugin_mode: str | None) -> str:
    mode = plugin_mode or be.plugin_mode
    if mode == "qdp" and not be.has_qdp_aot:
        raise InputError(f"{be.label} has no AOT Python plugins (QDP needs TensorRT >= 10.9)")
    if mode == "python" and not be.has_plugin_v3:
        raise InputError(f"{be.label} has no Python IPluginV3 classes")
    return mode


def _register_plugins(be: compat.Backend, mode: str, arch: int | None) -> None:
    if mode == "qdp":
        from . import qdp

        qdp.register_all(be, arch=arch)
    else:
        from . import plugins

        plugins.register_all(be)


def _parse(be: compat.Backend, builder, logger, mode: str, prepared: onnx.ModelProto, onnx_path: Path,
           model: onnx.ModelProto, diagnosis: dict[str, str]):
    """(network, parser) parsed from the prepared model; BuildError naming every node the parser rejected."""
    trt = be.trt
    flags = 0
    if be.has_strongly_typed_flag:
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    if mode == "qdp" and hasattr(trt.NetworkDefinitionCreationFlag, "PREFER_AOT_PYTHON_PLUGINS"):
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.PREFER_AOT_PYTHON_PLUGINS)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(prepared.SerializeToString(), str(onnx_path)):
        raise BuildError(_parse_failure(parser, model, diagnosis))
    return network, parser


def _config(be: compat.Backend, builder, profiles: dict[str, dict[str, list[int]]], arch: int | None,
            opt_level: int | None):
    """Builder config: the optimization profile, the RTX compute capability, the optimization level."""
    trt = be.trt
    config = builder.create_builder_config()
    if profiles:
        prof = builder.create_optimization_profile()
        for name, p in profiles.items():
            prof.set_shape(name, p["min"], p["opt"], p["max"])
        config.add_optimization_profile(prof)
    if be.is_rtx and arch is not None:
        config.num_compute_capabilities = 1
        config.set_compute_capability(getattr(trt.ComputeCapability, f"SM{arch}"), 0)
    if opt_level is not None:
        config.builder_optimization_level = int(opt_level)
    return config


def _target_label(be: compat.Backend, arch: int | None) -> str:
    if arch is not None:
        return f"sm_{arch}"
    if be.is_rtx:
        return "TensorRT-RTX default (" + ", ".join(f"sm_{c}" for c in (80, 86, 89, 120) if c in be.compute_capabilities) + ")"
    return "GPU present"


def runnable_here(be: compat.Backend, arch: int | None, gpu: int | None) -> tuple[bool, str]:
    if gpu is None:
        return False, "no GPU on this machine"
    if be.is_rtx:
        if gpu not in be.compute_capabilities:
            return False, f"the GPU here is sm_{gpu}, which TensorRT-RTX does not support"
        if arch is not None and arch != gpu:
            return False, f"the engine targets sm_{arch}; the GPU here is sm_{gpu}"
    return True, ""


def _parse_failure(parser, model: onnx.ModelProto, diagnosis: dict[str, str]) -> str:
    lines = []
    seen = set()
    for i in range(parser.num_errors):
        e = parser.get_error(i)
        try:
            node_name, op = e.node_name(), e.node_operator()
        except Exception:
            node_name, op = "", ""
        if not node_name and e.node() >= 0 and e.node() < len(model.graph.node):
            nd = model.graph.node[e.node()]
            node_name, op = nd.name, nd.op_type
        desc = e.desc()
        why = diagnosis.get(node_name)
        lines.append(f"node {node_name!r} ({op}): {desc}" + (f" -- {why}" if why else ""))
        seen.add(node_name)
    for name, why in diagnosis.items():
        if name not in seen:
            lines.append(f"node {name!r}: {why}")
    n_bad = len(set(diagnosis) | seen)
    return f"the ONNX parser rejected the model ({n_bad} node(s)):\n  " + "\n  ".join(lines)


def _inspect_layers(trt, network, nodes: list[onnx.NodeProto], report: BuildReport, diagnosis: dict) -> None:
    types: Counter = Counter()
    by_name: dict[str, list[str]] = {}
    plugin_names: set[str] = set()
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        tname = layer.type.name
        types[tname] += 1
        by_name.setdefault(layer.name, []).append(tname)
        if tname in PLUGIN_LAYER_TYPES:
            op, ns, ver, form = _layer_plugin(trt, layer)
            report.plugin_layers.append(PluginLayer(layer.name, op, ns, ver, tname, form))
            plugin_names.add(layer.name)
    n_plugin = sum(types[t] for t in PLUGIN_LAYER_TYPES)
    report.layer_types = dict(types)
    report.fp8_layers = _fp8_layers(trt, network)
    report.layers_by_kind = {"plugin": n_plugin, "native": sum(types.values()) - n_plugin}
    missing = []
    for n in nodes:
        if n.name and n.name in plugin_names:
            continue
        if not n.name:
            continue
        became = by_name.get(n.name)
        why = diagnosis.get(n.name)
        what = f"became {', '.join(became)} layer(s)" if became else "has no layer of its name"
        missing.append(f"node {n.name!r} ({n.op_type}) {what}" + (f" -- {why}" if why else ""))
    unnamed = [n for n in nodes if not n.name]
    n_ours = sum(1 for p in report.plugin_layers if p.namespace in ("", DOMAIN))
    if unnamed and n_ours < len(nodes):
        missing.append(f"{len(nodes) - n_ours} unnamed optfuse node(s) ({', '.join(sorted({n.op_type for n in unnamed}))})")
    if missing:
        raise BuildError(
            f"{len(missing)} of {len(nodes)} optfuse node(s) did not become plugin layers:\n  " + "\n  ".join(missing)
        )


def _fp8_layers(trt, network) -> list[str]:
    """The layers that run FP8 (see :attr:`BuildReport.fp8_layers`), from the network's tensor types."""
    fp8 = getattr(trt.DataType, "FP8", None)
    if fp8 is None:
        return []
    producer: dict[str, Any] = {}
    layers = [network.get_layer(i) for i in range(network.num_layers)]
    for layer in layers:
        for j in range(layer.num_outputs):
            producer[layer.get_output(j).name] = layer

    def tensors(layer):
        ins = [layer.get_input(j) for j in range(layer.num_inputs)]
        return [t for t in ins + [layer.get_output(j) for j in range(layer.num_outputs)] if t is not None]

    def fp8_dq(t, depth: int = 0) -> bool:
        """`t` dequantizes FP8 (through the parser's reshapes / broadcasts of a weight)."""
        p = producer.get(t.name)
        if p is not None and p.type.name == "SHUFFLE" and depth < 3:
            return fp8_dq(p.get_input(0), depth + 1)
        return p is not None and p.type.name == "DEQUANTIZE" and p.get_input(0).dtype == fp8

    out = []
    for layer in layers:
        if layer.type.name == "CONSTANT":  # the FP8 weights themselves: their DQ layers are listed
            continue
        runs_fp8 = any(t.dtype == fp8 for t in tensors(layer))
        if not runs_fp8 and layer.type.name == "MATRIX_MULTIPLY":
            ins = [layer.get_input(j) for j in range(layer.num_inputs)]
            runs_fp8 = bool(ins) and all(t is not None and fp8_dq(t) for t in ins)
        if runs_fp8:
            out.append(f"{layer.name} ({layer.type.name})")
    return out


# ------------------------------------------------------------------------------------------------
# The build in a child process
# ------------------------------------------------------------------------------------------------
def build_engine_file(
    onnx_path: str | os.PathLike,
    engine_path: str | os.PathLike,
    *,
    isolated: bool = True,
    report_path: str | os.PathLike | None = None,
    timeout: float | None = None,
    **kwargs: Any,
) -> BuildReport:
    """Build and write ``engine_path``; in a child process unless ``isolated=False``.

    ``kwargs`` are :func:`build_engine`'s (dims, input_shapes, target, backend, timing_cache,
    log_path, plugin_mode, opt_level). Errors keep their class (InputError / BuildError).
    """
    engine_path = Path(engine_path)
    engine_path.parent.mkdir(parents=True, exist_ok=True)
    if not isolated:
        data, report = build_engine(onnx_path, **kwargs)
        engine_path.write_bytes(data)
        report.engine = str(engine_path)
        if report_path:
            report.save(report_path)
        return report
    # Resolve the backend here so that a missing one is an InputError before any child starts.
    compat.resolve_backend(kwargs.get("backend"))
    with tempfile.TemporaryDirectory(prefix="optfuse-build-") as tmp:
        job = Path(tmp) / "job.json"
        result = Path(tmp) / "result.json"
        args = {k: (str(v) if isinstance(v, Path) else v) for k, v in kwargs.items()}
        if args.get("dims"):
            args["dims"] = {k: list(_dim_range(k, v)) for k, v in args["dims"].items()}
        job.write_text(json.dumps({"onnx": str(onnx_path), "engine": str(engine_path), "result": str(result),
                                   "kwargs": args}))
        env = compat.child_env()
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join([root, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
        proc = subprocess.run(
            [sys.executable, "-m", "optfuse.trt.build", str(job)], env=env, capture_output=True, text=True,
            timeout=timeout,
        )
        if result.is_file():
            res = json.loads(result.read_text())
            if "error" in res:
                cls = {"InputError": InputError, "BuildError": BuildError}.get(res["error"]["type"], BuildError)
                raise cls(res["error"]["message"])
            report = BuildReport.from_dict(res["report"])
            if report_path:
                report.save(report_path)
            return report
        tail = "\n  ".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
        how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit code {proc.returncode}"
        raise BuildError(f"the TensorRT build process died ({how}) before reporting:\n  {tail}")


def _child_main(job_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    result = Path(job["result"])
    try:
        data, report = build_engine(job["onnx"], **job["kwargs"])
        Path(job["engine"]).write_bytes(data)
        report.engine = job["engine"]
        result.write_text(json.dumps({"report": report.to_dict()}))
        return 0
    except OptfuseError as exc:
        result.write_text(json.dumps({"error": {"type": type(exc).__name__, "message": str(exc)}}))
        return exc.exit_code
    except Exception as exc:  # an unexpected failure is still a failed build, with its message
        import traceback

        traceback.print_exc()
        result.write_text(json.dumps({"error": {"type": "BuildError", "message": f"{type(exc).__name__}: {exc}"}}))
        return 2


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1]))
