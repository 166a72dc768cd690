"""TensorRT "quickly deployable plugins" (``tensorrt.plugin``, TensorRT >= 10.9), AOT form,
generated from the op specs: engines that run without Python (trtexec, C++).

Per spec, :func:`register_spec` declares with generated signatures (``inspect.Signature``; no
per-op code):

* ``@trtp.register("optfuse::<Op>")``: inputs as ``TensorDesc``, attributes typed from the spec
  (float, int, str, NDArray[float32|int32]); outputs ``like`` the spec says (the last dim from
  ``last_dim`` where given: a GEMM's N), of the dtype ``dtype_from`` gives where given;
* ``@trtp.autotune``: one linear type combination per I/O dtype combination of the spec
  (:func:`optfuse.trt.glue.io_dtype_combinations`: every float I/O of one dtype, integer inputs
  such as a block layout in their own one dtype, FP8 operands with float32 scales and a y of
  ``output_dtype``);
* ``@trtp.aot_impl``: a thin adapter around :func:`aot_kernel`, the plain function that does the
  work and that tests call without TensorRT.

:func:`aot_kernel` asks the plugin's ``launch.py`` (via :mod:`optfuse.trt.glue`) for the kernel
(float attributes such as epsilon are compiled in: AOT engines do not keep plugin attributes and
extra kernel arguments are int32 only) and its launch parameters, written over the (possibly
symbolic) shapes with ``+ - *`` and ``cdiv``. It returns the PTX that TensorRT embeds. Triton >= 3.3
appends two scratch pointer parameters that TensorRT's AOT launch does not pass; they are unused
by optfuse's kernels and are removed from the PTX entry (:func:`qdp_artifact`), so the kernel's
parameter list is exactly QDP's: inputs, int32 extras, outputs.
"""

from __future__ import annotations

import importlib
import inspect
import re
import threading
import typing
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np

from ..spec import OpSpec, get_spec, load_specs
from . import glue

TRTP_DTYPE = {"float32": "FP32", "float16": "FP16", "bfloat16": "BF16", "float8e4m3fn": "FP8", "int32": "INT32",
              "int64": "INT64", "bool": "BOOL"}

_registered: dict[tuple[str, str], int | None] = {}  # (backend, op) -> arch
_lock = threading.Lock()


# ------------------------------------------------------------------------------------------------
# The plain part: no TensorRT needed
# ------------------------------------------------------------------------------------------------
@dataclass
class TensorInfo:
    """An input as aot_kernel sees it: dtype name, shape (ints or symbolic expressions) and the
    concrete dims known at build time (-1 where dynamic; default: ``shape`` when it is all ints)."""

    dtype: str
    shape: Sequence[Any]
    static: Sequence[int] | None = None

    def static_dims(self) -> list[int]:
        if self.static is not None:
            return [int(d) for d in self.static]
        return [d if isinstance(d, int) else -1 for d in self.shape]


@dataclass
class AotKernel:
    """What ``aot_impl`` returns, before wrapping in TensorRT types. Unpacks as the QDP 4-tuple
    ``(kernel name, PTX, launch params, extra args)``."""

    name: str
    image: str  # PTX text, parameter list = inputs, int32 extras, outputs
    launch: Any  # optfuse.kernels.LaunchParams (ints or symbolic)
    extra_args: list[Any]
    artifact: Any = field(repr=False, default=None)  # KernelArtifact with the QDP ABI (ptx only)

    def __iter__(self):
        return iter((self.name, self.image, self.launch, self.extra_args))


_ENTRY_RE = r"\.entry\s+{name}\s*\((?P<params>[^)]*)\)"
_PARAM_RE = re.compile(r"\.param\s+[^,]*?\b(?P<pname>[A-Za-z_$][\w$]*)\s*$")


def entry_params(ptx: str, name: str) -> list[str]:
    """Parameter names of the ``.entry`` ``name`` in ``ptx``."""
    m = re.search(_ENTRY_RE.format(name=re.escape(name)), ptx)
    if not m:
        raise ValueError(f"PTX has no .entry {name}")
    out = []
    for chunk in m.group("params").split(","):
        chunk = chunk.strip()
        if not chunk:
            continue
        pm = _PARAM_RE.search(chunk)
        if not pm:
            raise ValueError(f"cannot read PTX parameter {chunk!r} of {name}")
        out.append(pm.group("pname"))
    return out


def strip_trailing_params(ptx: str, name: str, n: int) -> str:
    """Remove the last ``n`` parameters of ``.entry name`` (they must be unreferenced)."""
    if n <= 0:
        return ptx
    params = entry_params(ptx, name)
    drop = params[-n:]
    body_start = re.search(_ENTRY_RE.format(name=re.escape(name)), ptx).end()
    for p in drop:
        if re.search(rf"\b{re.escape(p)}\b", ptx[body_start:]):
            raise ValueError(f"{name}: parameter {p} is used by the kernel; TensorRT QDP cannot pass it")

    def fix(m: re.Match) -> str:
        chunks = [c for c in m.group("params").split(",")]
        keep = chunks[: len(chunks) - n]
        text = ",".join(keep).rstrip()
        return m.group(0).replace(m.group("params"), text + "\n")

    return re.sub(_ENTRY_RE.format(name=re.escape(name)), fix, ptx, count=1)


def qdp_artifact(art):
    """The artifact TensorRT runs: PTX only, the trailing Triton scratch parameters removed."""
    if art.ptx is None:
        raise ValueError(f"kernel {art.name} has no PTX; TensorRT QDP AOT embeds PTX")
    ptx = strip_trailing_params(art.ptx, art.name, art.n_scratch)
    n = len(entry_params(ptx, art.name))
    want = art.n_inputs + art.n_extra + art.n_outputs
    if n != want:
        raise ValueError(f"kernel {art.name} has {n} parameters; QDP passes {want} (inputs, extras, outputs)")
    return replace(art, ptx=ptx, cubin=None, n_scratch=0, key=(art.key + "-qdp") if art.key else "",
                   metadata={**art.metadata, "qdp": True})


def aot_kernel(
    op: str,
    inputs: Sequence[TensorInfo | None],
    attrs: dict | None,
    tactic: int | None = None,
    *,
    arch: int | str | None = None,
    cdiv=None,
) -> AotKernel:
    """The body of every optfuse ``aot_impl``: kernel + launch parameters for one op instance.

    ``inputs`` are the present inputs in spec order (trailing optional ones may be left out or
    None). Shapes may be ints (tests, launcher) or TensorRT shape expressions with ``cdiv`` =
    ``trtp.cdiv``; dims a kernel specializes on (hidden size, head dim) must be static.
    ``tactic`` is accepted for the QDP signature; optfuse registers one tactic per op.
    """
    spec = get_spec(op)
    infos = glue.pad_inputs(spec, list(inputs))
    statics = [None if t is None else t.static_dims() for t in infos]
    if statics[0] and statics[0][-1] < 0:
        raise ValueError(f"{op}: the last dim of input {spec.inputs[0].name!r} must be static for an AOT kernel "
                         f"(got dims {statics[0]}, -1 = dynamic)")
    static = glue.static_shape(spec, statics, [None if t is None else t.dtype for t in infos])
    rk = glue.resolve(
        op,
        [None if t is None else list(t.shape) for t in infos],
        [None if t is None else t.dtype for t in infos],
        attrs,
        arch=arch,
        cdiv=cdiv,
        static=static,
    )
    art = qdp_artifact(rk.artifact)
    params = rk.params
    block = tuple(params.block) + (1,) * (3 - len(params.block))
    if isinstance(block[0], int) and block[0] * block[1] * block[2] != art.threads:
        raise ValueError(f"{op}: launch block {block} != the {art.threads} threads {art.name} was compiled for")
    if len(params.extra_args) != art.n_extra:
        raise ValueError(f"{op}: {len(params.extra_args)} extra args for a kernel that takes {art.n_extra}")
    return AotKernel(art.name, art.ptx, params, list(params.extra_args), art)


def int_cdiv(a, b):
    return -(-a // b)


# ------------------------------------------------------------------------------------------------
# The TensorRT part
# ------------------------------------------------------------------------------------------------
def _trtp(be):
    return importlib.import_module(f"{be.trt.__name__}.plugin")


def _py_type(attr_type: str):
    import numpy.typing as npt

    return {
        "float": float,
        "int": int,
        "string": str,
        "floats": npt.NDArray[np.float32],
        "ints": npt.NDArray[np.int32],
    }[attr_type]


def _plain(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return v.tolist()
    return v


def register_spec(be, spec: OpSpec, arch: int | None) -> str:
    """Register ``optfuse::<op>`` with tensorrt.plugin (register + autotune + aot_impl)."""
    trtp = _trtp(be)
    trt = be.trt
    pid = f"{spec.domain}::{spec.op}"
    like = glue.output_like_index(spec)
    last_dim = glue.output_last_dim_index(spec)
    P = inspect.Parameter
    in_params = [P(t.name, P.POSITIONAL_OR_KEYWORD, annotation=trtp.TensorDesc) for t in spec.inputs]
    attr_params = [P(a.name, P.POSITIONAL_OR_KEYWORD, annotation=_py_type(a.type)) for a in spec.attributes]
    outputs_ann = typing.Tuple[tuple([trtp.TensorDesc] * len(spec.outputs))] if len(spec.outputs) > 1 else typing.Tuple[trtp.TensorDesc]
    out_param = P("outputs", P.POSITIONAL_OR_KEYWORD, annotation=outputs_ann)
    n_attr = len(spec.attributes)
    attr_names = [a.name for a in spec.attributes]
    cdiv = _make_cdiv(trtp)

    # Functions are variadic so a node without its trailing optional inputs still works; the
    # declared signature (what tensorrt.plugin validates) is the full one.
    def register_fn(*descs, **attrs):
        outs = [descs[i].like() for i in like]
        dtypes = glue.output_dtypes(spec, [glue.dtype_name(d.dtype) for d in descs], attrs)
        for j, out in enumerate(outs):
            if last_dim[j] is not None:  # like() shares the input's shape_expr: give the output its own
                exprs = glue.output_dims(spec, j, [d.shape_expr for d in descs], like)
                out.shape_expr = type(descs[like[j]].shape_expr).from_tuple(tuple(exprs))
            out.dtype = glue.trt_dtype(trt, dtypes[j])
        return outs[0] if len(outs) == 1 else tuple(outs)

    ret = trtp.TensorDesc if len(spec.outputs) == 1 else typing.Tuple[tuple([trtp.TensorDesc] * len(spec.outputs))]
    register_fn.__signature__ = inspect.Signature(in_params + attr_params, return_annotation=ret)
    register_fn.__name__ = f"{spec.op}_register"

    def autotune_fn(*args):
        descs, outputs = args[:-1], args[-1]
        outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        return [trtp.AutoTuneCombination(", ".join(TRTP_DTYPE[d] for d in combo), "LINEAR")
                for combo in autotune_combinations(spec, len(descs), [_dtype_or_none(o) for o in outputs])]

    autotune_fn.__signature__ = inspect.Signature(
        in_params + [out_param], return_annotation=typing.List[trtp.AutoTuneCombination]
    )
    autotune_fn.__name__ = f"{spec.op}_autotune"

    def aot_fn(*args):
        tactic, outputs = args[-1], args[-2]
        vals = args[len(args) - 2 - n_attr: len(args) - 2]
        descs = args[: len(args) - 2 - n_attr]
        attrs = {k: _plain(v) for k, v in zip(attr_names, vals)}
        infos = [TensorInfo(glue.dtype_name(d.dtype), list(d.shape_expr), _static_of(d)) for d in descs]
        ak = aot_kernel(spec.op, infos, attrs, tactic, arch=arch, cdiv=cdiv)
        lp = trtp.KernelLaunchParams()
        grid = tuple(ak.launch.grid) + (1,) * (3 - len(ak.launch.grid))
        block = tuple(ak.launch.block) + (1,) * (3 - len(ak.launch.block))
        lp.grid_x, lp.grid_y, lp.grid_z = grid
        lp.block_x, lp.block_y, lp.block_z = block
        lp.shared_mem = max(int(ak.launch.shared_mem or 0), int(ak.artifact.shared_mem))
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in ak.extra_args])
        return ak.name, ak.image, lp, extra

    aot_fn.__signature__ = inspect.Signature(
        in_params + attr_params + [out_param, P("tactic", P.POSITIONAL_OR_KEYWORD, annotation=int)],
        return_annotation=typing.Tuple[typing.Union[str, bytes], typing.Union[str, bytes], trtp.KernelLaunchParams, trtp.SymIntExprs],
    )
    aot_fn.__name__ = f"{spec.op}_aot_impl"

    trtp.register(pid)(register_fn)
    trtp.autotune(pid)(autotune_fn)
    trtp.aot_impl(pid)(aot_fn)
    _ = trt  # the module stays referenced for the plugin's lifetime
    return pid


def autotune_combinations(spec: OpSpec, n_inputs: int, output_dtypes: Sequence[str | None]) -> list[tuple[str, ...]]:
    """The I/O dtype combinations (``glue.io_dtype_combinations``) whose outputs have the dtypes
    ``register`` gave them (None: any)."""
    combos = glue.io_dtype_combinations(spec, n_inputs)
    return [c for c in combos
            if all(want is None or c[n_inputs + j] == want for j, want in enumerate(output_dtypes))]


def _dtype_or_none(desc) -> str | None:
    try:
        return glue.dtype_name(desc.dtype)
    except (AttributeError, ValueError):
        return None


def _static_of(desc) -> list[int] | None:
    try:
        return [int(d) for d in desc.shape]
    except Exception:
        return None


def _make_cdiv(trtp):
    def cdiv(a, b):
        if isinstance(a, int) and isinstance(b, int):
            return int_cdiv(a, b)
        return trtp.cdiv(a, b)

    return cdiv


def register_all(be, arch: int | None = None, ops: list[str] | None = None) -> list[str]:
    """Register every spec (or ``ops``) as an AOT QDP for kernels of ``arch``. Idempotent."""
    if not be.has_qdp_aot:
        raise RuntimeError(f"{be.label} has no AOT quickly deployable plugins (TensorRT >= 10.9 needed)")
    done = []
    with _lock:
        for op, spec in load_specs().items():
            if ops is not None and op not in ops:
                continue
            key = (be.name, op)
            if key in _registered:
                if _registered[key] != arch:
                    raise RuntimeError(f"{op} was registered for sm_{_registered[key]} in this process; build for one arch per process")
            else:
                register_spec(be, spec, arch)
                _registered[key] = arch
            done.append(op)
    return done
