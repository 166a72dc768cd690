"""Stage `build`: fused (precision) ONNX -> TensorRT engine, with a report and no silent fallback.

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

PLUGIN_LAYER_TYPES = ("PLUGIN", "PLUGIN_V2", "PLUGIN_V3")
DimRange = tuple[int, int, int]


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

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> BuildReport:
        d = dict(d)
        d["plugin_layers"] = [PluginLayer(**p) for p in d.get("plugin_layers", [])]
        return cls(**d)

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    def to_markdown(self) -> str:
        lines = [
            "## Engine build",
            "",
            f"- backend: {self.backend} {self.backend_version} (plugins: {self.plugin_mode})",
            f"- target: {self.target}",
            f"- engine: {self.engine or '(not written)'} ({_size(self.engine_bytes)})",
            f"- layers: {sum(self.layers_by_kind.values())} total, "
            + ", ".join(f"{k} {v}" for k, v in sorted(self.layers_by_kind.items())),
            f"- optfuse nodes in the model: {self.optfuse_nodes}; plugin layers: {len(self.plugin_layers)}",
            f"- parse {self.parse_seconds:.2f} s, build {self.build_seconds:.2f} s",
        ]
        if self.timing_cache:
            lines.append(f"- timing cache: {self.timing_cache}")
        if self.build_log:
            lines.append(f"- build log: {self.build_log}")
        if not self.runnable_here:
            lines.append(f"- not executed here: {self.not_runnable_reason}")
        if self.profiles:
            lines += ["", "| input | min | opt | max |", "|---|---|---|---|"]
            for name, p in self.profiles.items():
                lines.append(f"| {name} | {p['min']} | {p['opt']} | {p['max']} |")
        if self.plugin_layers:
            lines += ["", "| plugin layer | op | version | form |", "|---|---|---|---|"]
            for p in self.plugin_layers:
                lines.append(f"| {p.name} | {p.namespace}::{p.op} | {p.version} | {p.form} |")
        if self.layer_types:
            lines += ["", "| layer type | count |", "|---|---|"]
            for t, c in sorted(self.layer_types.items(), key=lambda kv: (-kv[1], kv[0])):
                lines.append(f"| {t} | {c} |")
        for w in self.warnings:
            lines.append(f"- warning: {w}")
        return "\n".join(lines) + "\n"


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# ------------------------------------------------------------------------------------------------
# Model preparation and checks (no TensorRT needed)
# ------------------------------------------------------------------------------------------------
def optfuse_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == DOMAIN]


def _attr_value(a: onnx.AttributeProto) -> Any:
    return onnx.helper.get_attribute_value(a)


def diagnose_nodes(model: onnx.ModelProto) -> dict[str, str]:
    """node name -> why the parser cannot map it to an optfuse plugin (only problem nodes)."""
    from ..spec import load_specs

    specs = load_specs()
    out: dict[str, str] = {}
    for i, n in enumerate(optfuse_nodes(model)):
        name = n.name or f"#{i} ({n.op_type})"
        attrs = {a.name: _attr_value(a) for a in n.attribute}
        ns = attrs.get("plugin_namespace", b"")
        ns = ns.decode() if isinstance(ns, bytes) else str(ns)
        ver = attrs.get("plugin_version", b"1")
        ver = ver.decode() if isinstance(ver, bytes) else str(ver)
        spec = specs.get(n.op_type)
        if spec is None:
            out[name] = f"op {n.op_type!r} is not an optfuse op (known: {', '.join(sorted(specs))})"
        elif ver != spec.plugin_version:
            out[name] = f"plugin_version {ver!r}, but optfuse provides {n.op_type} version {spec.plugin_version!r}"
        elif ns and ns != spec.domain:
            out[name] = f"plugin_namespace {ns!r}, but optfuse plugins live in namespace {spec.domain!r}"
        else:
            missing = [a.name for a in spec.attributes if a.name not in attrs and a.default is None]
            if missing:
                out[name] = f"attribute(s) {', '.join(missing)} missing (no default)"
    return out


def prepare_for_trt(model: onnx.ModelProto, plugin_mode: str) -> onnx.ModelProto:
    """The copy handed to the parser (see module doc); ``model`` is not modified."""
    from ..spec import load_specs

    specs = load_specs()
    m = onnx.ModelProto()
    m.CopyFrom(model)
    keep = [f for f in m.functions if f.domain != DOMAIN]
    del m.functions[:]
    m.functions.extend(keep)
    for n in m.graph.node:
        if n.domain != DOMAIN or n.op_type not in specs:
            continue
        spec = specs[n.op_type]
        have = {a.name for a in n.attribute}
        if "plugin_namespace" not in have:
            n.attribute.append(onnx.helper.make_attribute("plugin_namespace", spec.domain))
        if "plugin_version" not in have:
            n.attribute.append(onnx.helper.make_attribute("plugin_version", spec.plugin_version))
        for a in spec.attributes:
            if a.name not in have and a.default is not None:
                v = a.default
                v = float(v) if a.type == "float" else int(v) if a.type == "int" else v
                n.attribute.append(onnx.helper.make_attribute(a.name, v))
        if plugin_mode == "qdp" and "aot" not in have:
            n.attribute.append(onnx.helper.make_attribute("aot", 1))
    return m


def input_profiles(model: onnx.ModelProto, dims: dict[str, Any] | None = None,
                   input_shapes: dict[str, list[int | str]] | None = None) -> dict[str, dict[str, list[int]]]:
    """{input: {"min": [...], "opt": [...], "max": [...]}} for every graph input with a symbolic dim.

    ``dims`` maps dim names to (min, opt, max), an int, or an object/dict with min/opt/max;
    ``input_shapes`` (from a recipe) overrides an input's ONNX shape spelling.
    """
    dims = {k: _dim_range(k, v) for k, v in (dims or {}).items()}
    inits = {i.name for i in model.graph.initializer}
    out: dict[str, dict[str, list[int]]] = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        shape: list[int | str | None]
        if input_shapes and vi.name in input_shapes:
            shape = list(input_shapes[vi.name])
        else:
            shape = []
            for d in vi.type.tensor_type.shape.dim:
                shape.append(d.dim_value if d.HasField("dim_value") else (d.dim_param or None))
        if all(isinstance(d, int) for d in shape):
            continue
        lo, mid, hi = [], [], []
        for j, d in enumerate(shape):
            if isinstance(d, int):
                r = (d, d, d)
            elif d is None:
                raise InputError(f"input {vi.name!r} dim {j} has no size and no name; give it a shape in the recipe")
            elif d in dims:
                r = dims[d]
            else:
                declared = ", ".join(sorted(dims)) or "none"
                raise InputError(
                    f"input {vi.name!r} dim {j} is {d!r}, which has no min/opt/max (declared dims: {declared}); "
                    "add it to the recipe's 'dims'"
                )
            lo.append(r[0])
            mid.append(r[1])
            hi.append(r[2])
        out[vi.name] = {"min": lo, "opt": mid, "max": hi}
    return out


def _dim_range(name: str, v: Any) -> DimRange:
    if isinstance(v, int):
        return (v, v, v)
    if isinstance(v, dict):
        r = (int(v["min"]), int(v["opt"]), int(v["max"]))
    elif hasattr(v, "min") and hasattr(v, "opt"):
        r = (int(v.min), int(v.opt), int(v.max))
    else:
        r = tuple(int(x) for x in v)  # type: ignore[assignment]
    if len(r) != 3 or not 1 <= r[0] <= r[1] <= r[2]:
        raise InputError(f"dim {name!r}: expected 1 <= min <= opt <= max, got {v!r}")
    return r  # type: ignore[return-value]


def parse_target(target: Any) -> int | None:
    if target in (None, "", "auto"):
        return None
    from ..kernels.target import parse_arch

    try:
        return parse_arch(str(target) if not isinstance(target, int) else target)
    except ValueError as exc:
        raise InputError(str(exc)) from None


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
    if not onnx_path.is_file():
        raise InputError(f"model {onnx_path}: file not found")
    try:
        model = onnx.load(str(onnx_path), load_external_data=False)
    except Exception as exc:
        raise InputError(f"model {onnx_path}: not a readable ONNX file ({exc})") from None
    be = compat.load(backend)
    trt = be.trt
    arch = parse_target(target)
    compat.check_target(be, arch)
    gpu = _gpu_arch()
    if not be.is_rtx:
        if gpu is None:
            raise BuildError(f"{be.label} builds engines on a GPU and none was found; use --backend tensorrt_rtx for a CPU-only build")
        if arch is not None and arch != gpu:
            raise InputError(f"{be.label} builds for the GPU present (sm_{gpu}); --target sm_{arch} needs that GPU")
        arch = gpu
    mode = plugin_mode or be.plugin_mode
    if mode == "qdp" and not be.has_qdp_aot:
        raise InputError(f"{be.label} has no AOT Python plugins (QDP needs TensorRT >= 10.9)")
    if mode == "python" and not be.has_plugin_v3:
        raise InputError(f"{be.label} has no Python IPluginV3 classes")

    nodes = optfuse_nodes(model)
    diagnosis = diagnose_nodes(model)
    prepared = prepare_for_trt(model, mode)
    profiles = input_profiles(model, dims, input_shapes)

    if mode == "qdp":
        from . import qdp

        qdp.register_all(be, arch=arch)
    else:
        from . import plugins

        plugins.register_all(be)

    logger = _make_logger(trt)
    report = BuildReport(
        onnx=str(onnx_path), engine=None, backend=be.name, backend_version=be.version, plugin_mode=mode,
        target=_target_label(be, arch), optfuse_nodes=len(nodes), profiles=profiles,
    )
    try:
        t0 = time.perf_counter()
        builder = trt.Builder(logger)
        flags = 0
        if be.has_strongly_typed_flag:
            flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
        if mode == "qdp" and hasattr(trt.NetworkDefinitionCreationFlag, "PREFER_AOT_PYTHON_PLUGINS"):
            flags |= 1 << int(trt.NetworkDefinitionCreationFlag.PREFER_AOT_PYTHON_PLUGINS)
        network = builder.create_network(flags)
        parser = trt.OnnxParser(network, logger)
        ok = parser.parse(prepared.SerializeToString(), str(onnx_path))
        report.parse_seconds = time.perf_counter() - t0
        if not ok:
            raise BuildError(_parse_failure(parser, model, diagnosis))

        _inspect_layers(trt, network, nodes, report, diagnosis)

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
