"""Spec -> kernel glue shared by both plugin forms (no TensorRT import here).

Both the classic Python IPluginV3 (``plugins.py``, enqueue time, concrete shapes) and the QDP
``aot_impl`` (``qdp.py``, build time, symbolic shapes) ask the same question: for op ``op`` with
these input shapes/dtypes and attributes, which kernel and which launch parameters? The answer
comes from the plugin folder's ``launch.py`` (``kernel_config`` + ``launch_params``), so the two
forms cannot drift apart.

An op whose ``launch.py`` defines ``launch_plan`` may answer with several kernels and a workspace
(:class:`optfuse.kernels.artifact.LaunchPlan`, e.g. FlashAttention's split-KV decode):
:func:`resolve_plan` gives the classic plugin that plan (every other op: a plan of one step), and
:func:`workspace_size` the workspace to ask TensorRT for over a profile. QDP AOT launches one
kernel and no workspace, so it keeps :func:`resolve`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..spec import FLOAT_DTYPES, FP8_DTYPES, OpSpec, get_spec, plugin_module

#: TensorRT DataType member name -> spec dtype name (FP8 is E4M3).
TRT_DTYPE = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "FP8": "float8e4m3fn", "INT32": "int32",
             "INT64": "int64", "BOOL": "bool"}


def dtype_name(trt_dtype: Any) -> str:
    """``trt.DataType.HALF`` -> ``"float16"`` (also accepts spec names)."""
    name = getattr(trt_dtype, "name", None) or str(trt_dtype).split(".")[-1]
    if name in TRT_DTYPE:
        return TRT_DTYPE[name]
    if name in TRT_DTYPE.values():
        return name
    raise ValueError(f"dtype {trt_dtype!r} has no optfuse name")


def trt_dtype(trt: Any, name: str) -> Any:
    inv = {v: k for k, v in TRT_DTYPE.items()}
    return getattr(trt.DataType, inv[name])


def is_float_tensor(t) -> bool:
    return all(d in FLOAT_DTYPES + FP8_DTYPES for d in t.dtypes)


def output_dtypes(spec: OpSpec, input_dtypes: Sequence[str | None], attrs: dict | None) -> list[str]:
    """Every output's dtype name (:meth:`OpSpec.output_dtype`: its ``like`` input's, or its
    ``dtype_from`` attribute's value); both plugin forms call it."""
    return [spec.output_dtype(j, list(input_dtypes) + [None] * (len(spec.inputs) - len(input_dtypes)), attrs)
            for j in range(len(spec.outputs))]


def io_dtype_combinations(spec: OpSpec, n_inputs: int) -> list[tuple[str, ...]]:
    """The dtypes of (the first ``n_inputs`` inputs, then the outputs) that a node of ``spec`` may
    have, one tuple per combination, from the spec's dtype lists and output rules: per dtype ``c``
    of the first input and per value of an output's ``dtype_from`` attribute, the inputs listing
    the first input's dtypes take ``c``, those listing one dtype take it (FP8 scales, int32
    layouts), the others (GEMM bias, residual) take the first output's dtype. Combinations whose
    output dtype is not allowed (an FP8 A with ``like_input``), or whose present inputs break a
    ``with_dtypes`` rule (the GEMM's FP8 scales without FP8, or FP8 without them), are left out."""
    first = spec.inputs[0]
    rules = sorted({o.dtype_from for o in spec.outputs if o.dtype_from is not None})
    values = [[(r, v) for v in spec.attr(r).choices] for r in rules]
    settings: list[dict] = [{}]
    for options in values:
        settings = [{**s, k: v} for s in settings for k, v in options]
    out: list[tuple[str, ...]] = []
    for c in first.dtypes:
        for attrs in settings:
            combo = _combination(spec, n_inputs, c, attrs)
            if combo is not None and combo not in out:
                out.append(combo)
    return out


def _combination(spec: OpSpec, n_inputs: int, c: str, attrs: dict) -> tuple[str, ...] | None:
    try:
        ys = output_dtypes(spec, [c] * n_inputs, attrs)  # the absent inputs too (a quantized_by scale)
    except ValueError:
        return None
    ins = []
    for t in spec.inputs[:n_inputs]:
        if t.dtypes == spec.inputs[0].dtypes:
            ins.append(c)
        elif len(t.dtypes) == 1:
            ins.append(t.dtypes[0])
        elif ys[0] in t.dtypes:
            ins.append(ys[0])
        else:
            return None
    if spec.presence_error(ins + [None] * (len(spec.inputs) - len(ins))) is not None:
        return None
    return tuple(ins) + tuple(ys)


def complete_attrs(spec: OpSpec, attrs: dict | None) -> dict:
    """Spec attributes in spec order, defaults filled in; unknown names dropped.

    Raises KeyError naming an attribute that has no value and no default.
    """
    attrs = dict(attrs or {})
    out: dict[str, Any] = {}
    for a in spec.attributes:
        if a.name in attrs and attrs[a.name] is not None:
            out[a.name] = attrs[a.name]
        elif a.default is not None:
            out[a.name] = a.default
        else:
            raise KeyError(f"{spec.op}: attribute {a.name!r} has no value and no default")
    return out


def output_like_index(spec: OpSpec) -> list[int]:
    """For each output, the index of the input whose shape and dtype it takes (spec ``like``)."""
    idx = []
    for o in spec.outputs:
        if o.like is None:
            raise NotImplementedError(
                f"{spec.op}: output {o.name!r} has no 'like' rule; TensorRT plugins are generated only "
                "for outputs shaped like an input"
            )
        idx.append(spec.input_index(o.like))
    return idx


def output_last_dim_index(spec: OpSpec) -> list[tuple[int, int] | None]:
    """For each output, (input index, axis) of the dim its last dim takes (spec ``last_dim``: a
    GEMM's [..., K] x [N, K] -> [..., N]), or None when it keeps the ``like`` input's last dim."""
    return [None if o.last_dim is None else (spec.input_index(o.last_dim[0]), o.last_dim[1]) for o in spec.outputs]


def output_dims(spec: OpSpec, j: int, dims: Sequence[Sequence[Any]], like: list[int] | None = None) -> list[Any]:
    """Output ``j``'s dims from the inputs' dims (any dim type: ints, TensorRT dim expressions):
    those of its ``like`` input, the last one from the ``last_dim`` input where the spec says so."""
    like = output_like_index(spec) if like is None else like
    out = list(dims[like[j]])
    last = output_last_dim_index(spec)[j]
    if last is not None:
        src, axis = last
        out[-1] = list(dims[src])[axis]
    return out


def static_shape(spec: OpSpec, shapes: Sequence[Sequence[Any] | None], dtypes: Sequence[str | None] | None = None) -> dict:
    """The compile-time shape facts a kernel specializes on.

    A plugin's ``launch.py`` may define ``static_shape(op, shapes, dtypes) -> dict``; otherwise:
    ``hidden`` and ``head_dim`` = the last dim of the first input, and for every present input
    ``<name>`` / ``<name>_shape`` (its dims, -1 where dynamic) and ``<name>_dtype``.
    """
    launch = plugin_module(spec.folder, "launch")
    fn = getattr(launch, "static_shape", None)
    if fn is not None:
        return dict(fn(spec.op, shapes, dtypes))
    last = shapes[0][-1]
    out: dict[str, Any] = {"hidden": last, "head_dim": last}
    for i, t in enumerate(spec.inputs):
        if i < len(shapes) and shapes[i] is not None:
            out[t.name] = list(shapes[i])
            out[f"{t.name}_shape"] = list(shapes[i])
            if dtypes is not None and i < len(dtypes) and dtypes[i] is not None:
                out[f"{t.name}_dtype"] = dtypes[i]
    return out


def pad_inputs(spec: OpSpec, values: Sequence[Any]) -> list[Any]:
    """Present inputs (TensorRT drops trailing absent optional ones) padded with None to the spec."""
    values = list(values)
    if len(values) > len(spec.inputs):
        raise ValueError(f"{spec.op}: {len(values)} inputs, the spec has {len(spec.inputs)}")
    for t in spec.inputs[len(values):]:
        if not t.optional:
            raise ValueError(f"{spec.op}: required input {t.name!r} is missing")
    return values + [None] * (len(spec.inputs) - len(values))


@dataclass
class ResolvedKernel:
    """What one launch needs: the compiled kernel and its launch parameters."""

    source: Any  # KernelSource
    artifact: Any  # KernelArtifact
    params: Any  # LaunchParams (ints, or symbolic expressions in QDP)
    static_shape: dict


def kernel_source(op: str, dtype: str, attrs: dict | None, static: dict):
    spec = get_spec(op)
    launch = plugin_module(spec.folder, "launch")
    return launch.kernel_config(op, dtype, complete_attrs(spec, attrs), static)


def resolve(
    op: str,
    shapes: Sequence[Sequence[Any] | None],
    dtypes: Sequence[str | None],
    attrs: dict | None,
    *,
    arch: int | str | None = None,
    cdiv=None,
    static: dict | None = None,
    cache=None,
) -> ResolvedKernel:
    """Kernel + launch parameters for one op instance.

    ``shapes``/``dtypes`` are per spec input (None for an absent optional input); ``static`` is
    the compile-time shape dict (default: from ``shapes``, which must then be concrete where it
    matters); ``cdiv`` is ``trtp.cdiv`` for symbolic shapes.
    """
    from ..kernels import build_kernel
    from ..kernels import cdiv as int_cdiv
    from ..kernels.target import resolve_arch

    spec = get_spec(op)
    launch = plugin_module(spec.folder, "launch")
    attrs = complete_attrs(spec, attrs)
    shapes = pad_inputs(spec, shapes)
    dtypes = pad_inputs(spec, dtypes)
    static = dict(static) if static is not None else static_shape(spec, shapes, dtypes)
    # The target is a compile-time fact too: a plugin may pick an arch-specific kernel (sm_90a).
    static.setdefault("arch", resolve_arch(arch))
    dtype = dtypes[0]
    src = launch.kernel_config(op, dtype, attrs, static)
    art = build_kernel(src, arch, cache=cache)
    params = launch.launch_params(op, shapes, dtypes, attrs, cdiv=cdiv or int_cdiv, static_shape=static)
    return ResolvedKernel(src, art, params, static)


def resolve_plan(
    op: str,
    shapes: Sequence[Sequence[int] | None],
    dtypes: Sequence[str | None],
    attrs: dict | None,
    *,
    arch: int | str | None = None,
    static: dict | None = None,
    cache=None,
):
    """The :class:`LaunchPlan` of one op instance at concrete shapes, every step's artifact built:
    ``launch.launch_plan(op, shapes, dtypes, attrs, static_shape=...)`` where the plugin defines it
    and it returns a plan, else the one kernel of :func:`resolve` as a plan of one step."""
    from ..kernels import build_kernel
    from ..kernels.artifact import single_step_plan
    from ..kernels.target import resolve_arch

    spec = get_spec(op)
    launch = plugin_module(spec.folder, "launch")
    shapes_p, dtypes_p = pad_inputs(spec, shapes), pad_inputs(spec, dtypes)
    static_p = dict(static) if static is not None else static_shape(spec, shapes_p, dtypes_p)
    static_p.setdefault("arch", resolve_arch(arch))
    fn = getattr(launch, "launch_plan", None)
    plan = None
    if fn is not None:
        plan = fn(op, shapes_p, dtypes_p, complete_attrs(spec, attrs), static_shape=static_p)
    if plan is None:
        rk = resolve(op, shapes, dtypes, attrs, arch=arch, static=static_p, cache=cache)
        plan = single_step_plan(rk.source, rk.params, len(spec.outputs))
        plan.steps[0].artifact = rk.artifact
        return plan
    for step in plan.steps:
        step.artifact = build_kernel(step.source, arch, cache=cache)
    return plan


def workspace_size(
    op: str,
    min_shapes: Sequence[Sequence[int] | None],
    max_shapes: Sequence[Sequence[int] | None],
    dtypes: Sequence[str | None],
    attrs: dict | None,
) -> int:
    """Workspace bytes for every shape of a TensorRT profile [min_shapes, max_shapes]: the
    plugin's ``launch.workspace_bytes(op, min_shapes, max_shapes, dtypes, attrs)`` (its largest
    plan's workspace over the profile), 0 when the plugin has none."""
    spec = get_spec(op)
    fn = getattr(plugin_module(spec.folder, "launch"), "workspace_bytes", None)
    if fn is None:
        return 0
    return int(fn(op, pad_inputs(spec, min_shapes), pad_inputs(spec, max_shapes), pad_inputs(spec, dtypes),
                  complete_attrs(spec, attrs)))
