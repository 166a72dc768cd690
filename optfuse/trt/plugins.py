"""Classic Python IPluginV3 + IPluginCreatorV3One, generated from an :class:`OpSpec`.

Used on TensorRT-RTX (whose parser accepts only V3One creators) and on TensorRT < 10.9 (no AOT
QDP). One generic class per op, made by :func:`make_plugin`; nothing is written per op:

* name / namespace / version: ``spec.op`` / ``optfuse`` / ``spec.plugin_version`` (what the fused
  ONNX node carries, so the parser's FallbackPluginImporter finds the creator);
* fields: the spec attributes (float -> FLOAT32, int -> INT32, string -> CHAR, floats/ints ->
  arrays) -- the parser converts ONNX attributes by *their* type (INT arrives as int32, FLOAT as
  float32), so decoding is by field type, and missing fields take the spec default;
* output dtypes and shapes: the spec's ``like`` rule (the last dim from ``last_dim`` where given),
  the dtype from ``dtype_from`` where given (:func:`optfuse.trt.glue.output_dtypes`);
* formats: linear only; the dtypes one of :func:`optfuse.trt.glue.io_dtype_combinations` (every
  float tensor one dtype, but for FP8 operands with float32 scales and an ``output_dtype`` y);
* workspace: :func:`optfuse.trt.glue.workspace_size` over the profile's min / max input dims (the
  scratch memory of the largest multi-kernel plan the plugin's ``launch.py`` makes in it; 0 for
  most ops);
* state: a plan may keep ``state_bytes`` of device memory from launch to launch (the decode
  kernel's arrival counters), zeroed when allocated and left zero by every launch; each plugin
  instance (TensorRT clones one per execution context) owns its own
  (:class:`optfuse.kernels.launcher.DeviceState`), allocated in ``on_shape_change`` -- before the
  enqueue, so outside any CUDA graph capture of it;
* enqueue: :func:`optfuse.trt.glue.resolve_plan` (the plugin's ``launch.py``: one kernel, or a plan
  with a workspace and a state) and ``optfuse.kernels.launcher.launch_plan`` with TensorRT's
  workspace pointer -- so this form needs Python at run time, unlike QDP.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ..spec import OpSpec, load_specs
from . import glue

_registered: dict[tuple[str, str], Any] = {}  # (backend, op) -> creator (kept alive: TRT holds a raw pointer)
_lock = threading.Lock()


def _field_type(trt, attr_type: str):
    return {
        "float": trt.PluginFieldType.FLOAT32,
        "floats": trt.PluginFieldType.FLOAT32,
        "int": trt.PluginFieldType.INT32,
        "ints": trt.PluginFieldType.INT32,
        "string": trt.PluginFieldType.CHAR,
    }[attr_type]


def decode_field(trt, attr_type: str, field: Any) -> Any:
    """A PluginField's value as the spec attribute type (by the field's actual type)."""
    data = field.data
    ftype = field.type
    if ftype == trt.PluginFieldType.CHAR or attr_type == "string":
        raw = bytes(np.asarray(data).astype(np.uint8).tobytes()) if not isinstance(data, (bytes, str)) else data
        if isinstance(raw, str):
            return raw
        return raw.split(b"\0", 1)[0].decode("utf-8")
    arr = np.asarray(data).reshape(-1)
    if attr_type == "float":
        return float(arr[0])
    if attr_type == "int":
        return int(arr[0])
    if attr_type == "floats":
        return [float(v) for v in arr]
    if attr_type == "ints":
        return [int(v) for v in arr]
    raise ValueError(f"unsupported attribute type {attr_type!r}")


def encode_field(trt, attr_type: str, name: str, value: Any):
    if attr_type == "string":
        return trt.PluginField(name, np.frombuffer(str(value).encode() + b"\0", dtype=np.int8), trt.PluginFieldType.CHAR)
    if attr_type in ("float", "floats"):
        arr = np.asarray(value if attr_type == "floats" else [value], dtype=np.float32)
    else:
        arr = np.asarray(value if attr_type == "ints" else [value], dtype=np.int32)
    return trt.PluginField(name, arr, _field_type(trt, attr_type))


def make_plugin(trt, spec: OpSpec):
    """(PluginClass, CreatorClass) for ``spec`` on the TensorRT module ``trt``."""
    plugin = _plugin_class(trt, spec)
    return plugin, _creator_class(trt, spec, plugin)


def _plugin_class(trt, spec: OpSpec):
    """The IPluginV3 (core, build and runtime in one object) for ``spec``."""
    like = glue.output_like_index(spec)
    last_dim = glue.output_last_dim_index(spec)
    attr_types = {a.name: a.type for a in spec.attributes}

    class Plugin(trt.IPluginV3, trt.IPluginV3OneCore, trt.IPluginV3OneBuild, trt.IPluginV3OneRuntime):
        def __init__(self, attrs: dict | None = None, phase=None):
            trt.IPluginV3.__init__(self)
            trt.IPluginV3OneCore.__init__(self)
            trt.IPluginV3OneBuild.__init__(self)
            trt.IPluginV3OneRuntime.__init__(self)
            self.plugin_name = spec.op
            self.plugin_namespace = spec.domain
            self.plugin_version = spec.plugin_version
            self.num_outputs = len(spec.outputs)
            self.timing_cache_id = ""
            self.attrs = dict(attrs or {})
            self.phase = phase
            self._kernels: dict = {}
            self._state = None  # launcher.DeviceState, made when a plan first needs one

        # -- core / build ------------------------------------------------------------------
        def get_capability_interface(self, type):
            return self

        def clone(self):
            c = Plugin(self.attrs, self.phase)
            c._kernels = self._kernels  # compiled kernels are shareable
            return c

        def get_output_data_types(self, input_types):
            names = glue.output_dtypes(spec, [glue.dtype_name(t) for t in input_types], self.attrs)
            return [glue.trt_dtype(trt, n) for n in names]

        def get_output_shapes(self, inputs, shape_inputs, expr_builder):
            shapes = [trt.DimsExprs(inputs[i]) for i in like]
            for j, last in enumerate(last_dim):
                if last is not None:  # a GEMM's N: dim `axis` of input `src`
                    src, axis = last
                    shapes[j][len(shapes[j]) - 1] = inputs[src][axis]
            return shapes

        def supports_format_combination(self, pos, in_out, num_inputs):
            return _supports_format(trt, spec, like, pos, in_out, num_inputs)

        def configure_plugin(self, inp, out):
            pass

        def get_workspace_size(self, inp, out):
            return _workspace_size(spec, self.attrs, inp)

        def get_valid_tactics(self):
            return []

        # -- runtime -----------------------------------------------------------------------
        def set_tactic(self, tactic):
            pass

        def on_shape_change(self, inp, out):
            plan = _plan(spec, self.attrs, self._kernels, inp)
            if int(plan.state_bytes or 0) > 0:
                self._state = _ensure_state(self._state, plan.state_bytes)

        def attach_to_context(self, context):
            return self.clone()

        def get_fields_to_serialize(self):
            return trt.PluginFieldCollection(
                [encode_field(trt, attr_types[k], k, v) for k, v in self.attrs.items() if k in attr_types]
            )

        def enqueue(self, input_desc, output_desc, inputs, outputs, workspace, stream):
            plan = _plan(spec, self.attrs, self._kernels, input_desc)
            if int(plan.state_bytes or 0) > 0:  # on_shape_change allocated it; grow it if not
                self._state = _ensure_state(self._state, plan.state_bytes)
            _enqueue(spec, plan, inputs, outputs, workspace, stream, self._state)

    Plugin.__name__ = Plugin.__qualname__ = f"{spec.op}PluginV3"
    return Plugin


def _creator_class(trt, spec: OpSpec, plugin):
    """The IPluginCreatorV3One that makes ``plugin`` objects from the parser's fields."""
    attr_types = {a.name: a.type for a in spec.attributes}

    class Creator(trt.IPluginCreatorV3One):
        def __init__(self):
            trt.IPluginCreatorV3One.__init__(self)
            self.name = spec.op
            self.plugin_namespace = spec.domain
            self.plugin_version = spec.plugin_version
            self.field_names = trt.PluginFieldCollection(
                [trt.PluginField(a.name, np.array([]), _field_type(trt, a.type)) for a in spec.attributes]
            )

        def create_plugin(self, name, fc, phase):
            got = {}
            for f in fc:
                if f.name in attr_types:
                    got[f.name] = decode_field(trt, attr_types[f.name], f)
            return plugin(glue.complete_attrs(spec, got), phase)

    Creator.__name__ = Creator.__qualname__ = f"{spec.op}CreatorV3One"
    return Creator


def _supports_format(trt, spec: OpSpec, like: list[int], pos: int, in_out, num_inputs: int) -> bool:
    """Linear only; the dtypes of positions 0..pos a prefix of one of the spec's I/O dtype
    combinations (``glue.io_dtype_combinations``: outputs of their ``output_dtype`` or like their
    input, float inputs one dtype, FP8 operands with float32 scales). ``like`` is kept for the
    plugin class's call."""
    desc = in_out[pos].desc
    if desc.format != trt.TensorFormat.LINEAR:
        return False
    try:
        got = [glue.dtype_name(in_out[j].desc.type) for j in range(pos + 1)]
    except ValueError:
        return False
    # a combination lists the present inputs, then the outputs: the positions' order
    return any(list(c[:pos + 1]) == got for c in glue.io_dtype_combinations(spec, num_inputs))


def _workspace_size(spec: OpSpec, attrs: dict, inp) -> int:
    """Bytes of workspace for every shape of the profile: ``inp`` are DynamicPluginTensorDescs
    (``min`` / ``max`` dims, ``desc.type``)."""
    mins = [tuple(int(d) for d in t.min) for t in inp]
    maxs = [tuple(int(d) for d in t.max) for t in inp]
    dtypes = [glue.dtype_name(t.desc.type) for t in inp]
    return glue.workspace_size(spec.op, mins, maxs, dtypes, attrs)


def _plan(spec: OpSpec, attrs: dict, kernels: dict, input_desc):
    """The plan for these shapes / dtypes / arch (PluginTensorDescs), memoized in ``kernels``."""
    from ..kernels import launcher

    shapes = [tuple(int(d) for d in desc.dims) for desc in input_desc]
    dtypes = [glue.dtype_name(desc.type) for desc in input_desc]
    arch = launcher.current_device_arch()
    key = (tuple(shapes), tuple(dtypes), arch)
    plan = kernels.get(key)
    if plan is None:
        plan = kernels[key] = glue.resolve_plan(spec.op, shapes, dtypes, attrs, arch=arch)
    return plan


def _ensure_state(state, nbytes: int):
    """``state`` (a launcher.DeviceState, made here when None) holding at least ``nbytes``."""
    from ..kernels import launcher

    state = state or launcher.DeviceState()
    state.ensure(int(nbytes))
    return state


def _enqueue(spec: OpSpec, plan, inputs, outputs, workspace, stream, state) -> None:
    """Launch ``plan``'s steps on ``stream``, with TensorRT's ``workspace`` and the instance's ``state``."""
    from ..kernels import launcher

    ins = glue.pad_inputs(spec, [int(p) for p in inputs])
    launcher.launch_plan(plan, ins, [int(p) for p in outputs], int(workspace or 0), int(stream),
                         state=state.ptr if state is not None else 0)


def register_all(backend, ops: list[str] | None = None) -> list[str]:
    """Register a V3One creator for every spec (or ``ops``) with ``backend`` (a compat.Backend).

    Idempotent per process. Returns the op names registered now or before.
    """
    trt = backend.trt
    registry = trt.get_plugin_registry()
    done = []
    with _lock:
        for op, spec in load_specs().items():
            if ops is not None and op not in ops:
                continue
            key = (backend.name, op)
            if key not in _registered:
                _, Creator = make_plugin(trt, spec)
                creator = Creator()
                if not registry.register_creator(creator, spec.domain):
                    raise RuntimeError(f"TensorRT refused to register plugin creator {spec.domain}::{op}")
                _registered[key] = creator
            done.append(op)
    return done
