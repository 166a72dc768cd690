"""What the ONNX parser is handed, checked before any TensorRT call (no TensorRT needed): the
optfuse nodes of a model, why a node cannot map to a plugin, the prepared copy (reference
functions removed, spec defaults written out, ``aot=1`` for QDP), the optimization profile of
every input with a symbolic dim, and ``--target`` parsing."""

from __future__ import annotations

from typing import Any

import onnx

from .. import DOMAIN
from ..errors import InputError

DimRange = tuple[int, int, int]


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
    from ..target import parse_arch

    try:
        return parse_arch(str(target) if not isinstance(target, int) else target)
    except ValueError as exc:
        raise InputError(str(exc)) from None
