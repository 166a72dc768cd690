"""Shape inference: ONNX's (symbolic dims kept, for sanitize) and onnxruntime's at concrete dims.

``concrete_shapes`` takes a ModelProto: a caller whose graph holds optfuse nodes embeds their
reference functions first (``optfuse.rewrite.add_functions``), so inference can follow them.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import onnx
import onnx_graphsurgeon as gs

from .load import _PROTO_LIMIT, model_bytes

log = logging.getLogger(__name__)


#: The names ONNX shape inference gives the dims it cannot name (``unk__3``): fresh per run, so a
#: stored one means nothing to a later run and may even equal one of its new names.
_INFERRED_SYMBOL = re.compile(r"unk__\d+")


def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """ONNX shape inference with data propagation; models past the protobuf limit are left as they are.

    A stored dim named ``unk__N`` (the model's value_info or outputs as a saved earlier inference
    wrote them) is forgotten first: ONNX keeps a stored symbolic dim over the one it propagates, so
    a model saved after an inference without data propagation would keep ``unk__N`` head counts and
    sequence lengths where data propagation finds ``4`` or ``sequence``. Every other stored dim (an
    exporter's ``sequence``, a static size) is kept, and a stored shape still stands where
    inference cannot follow an op. The proto is left as it was.
    """
    if model_bytes(model) > _PROTO_LIMIT:
        log.warning("model over 2 GiB: skipping in-memory shape inference")
        return model
    stored = [(vi, onnx.ValueInfoProto.FromString(vi.SerializeToString()))
              for vi in [*model.graph.value_info, *model.graph.output] if _has_inferred_symbol(vi)]
    for vi, _ in stored:  # put back below: no copy of the weights for this
        _forget_inferred_symbols(vi)
    try:
        return onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception as exc:  # inference is best effort: a model onnxruntime runs is still valid input
        log.warning("shape inference failed: %s", str(exc).splitlines()[0])
        return model
    finally:
        for vi, old in stored:
            vi.CopyFrom(old)


def _has_inferred_symbol(vi: onnx.ValueInfoProto) -> bool:
    return any(d.HasField("dim_param") and _INFERRED_SYMBOL.fullmatch(d.dim_param) for d in _dims(vi))


def _forget_inferred_symbols(vi: onnx.ValueInfoProto) -> None:
    """Turn every ``unk__N`` dim of ``vi`` into an unknown one."""
    for d in _dims(vi):
        if d.HasField("dim_param") and _INFERRED_SYMBOL.fullmatch(d.dim_param):
            d.ClearField("dim_param")


def _dims(vi: onnx.ValueInfoProto):
    tt = vi.type.tensor_type
    return tt.shape.dim if tt.HasField("shape") else []


def concrete_shapes(model: onnx.ModelProto, dims: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape when the graph inputs' symbolic dims take the values in `dims`.

    Shape inference on the symbolic graph names many intermediate dims with fresh symbols
    (`unk__3` after a broadcasting Add, `batch*heads` after a Reshape); with static inputs
    onnxruntime's symbolic shape inference resolves them to numbers (ONNX's own inference stops
    at mask-building chains). Tensors that stay unresolved are left out. `model` is modified
    (its input dims are set, its value_info replaced): pass a copy you own.
    """
    if not dims:
        return {}
    for vi in model.graph.input:
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_param") and d.dim_param in dims:
                d.dim_value = int(dims[d.dim_param])
    del model.graph.value_info[:]
    model = _infer_static(model)
    shapes: dict[str, tuple[int, ...]] = {}
    for vi in list(model.graph.value_info) + list(model.graph.output) + list(model.graph.input):
        tt = vi.type.tensor_type
        if not tt.HasField("shape"):
            continue
        dims_ = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
        if all(d is not None for d in dims_):
            shapes[vi.name] = tuple(dims_)
    return shapes


def probe_dims(graph: gs.Graph) -> dict[str, int]:
    """Distinct primes for the graph inputs' symbolic dims: shapes equal under this assignment are
    equal symbolically (a broadcast dim of 1 never coincides with a probed dim)."""
    primes = [7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47]
    names: list[str] = []
    for t in graph.inputs:
        for d in t.shape or []:
            if isinstance(d, str) and d not in names:
                names.append(d)
    return {n: primes[i % len(primes)] + 48 * (i // len(primes)) for i, n in enumerate(names)}


def _symbolic_shape_inference():
    """onnxruntime's SymbolicShapeInference class, without importing the package ``onnxruntime.tools``:
    that package's ``__init__`` imports torch when it is installed (seconds, for an export helper
    nothing here uses). The module itself needs only numpy, onnx, sympy and packaging."""
    import importlib.util
    import sys

    name = "onnxruntime.tools.symbolic_shape_infer"
    if "onnxruntime.tools" in sys.modules or name in sys.modules:
        return importlib.import_module(name).SymbolicShapeInference
    own = "optfuse._ort_symbolic_shape_infer"
    if own not in sys.modules:
        ort = importlib.util.find_spec("onnxruntime")
        if ort is None or not ort.submodule_search_locations:
            raise ImportError("onnxruntime is not installed")
        path = Path(next(iter(ort.submodule_search_locations))) / "tools" / "symbolic_shape_infer.py"
        spec = importlib.util.spec_from_file_location(own, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[own] = module
    return sys.modules[own].SymbolicShapeInference


def _infer_static(model: onnx.ModelProto) -> onnx.ModelProto:
    try:
        SymbolicShapeInference = _symbolic_shape_inference()

        # The loop of SymbolicShapeInference.infer_shapes, minus its last step: when some shape
        # stays unknown, that dumps the model into the current directory and raises, whereas a
        # partial result is what we want (unknown tensors just stay out of the estimate).
        sym = SymbolicShapeInference(2**31 - 1, True, False, 0)
        sym._preprocess(model)
        while sym.run_:
            sym._infer_impl()
        sym._update_output_from_vi()
        return sym.out_mp_
    except Exception:  # unsupported op or a model it cannot follow: ONNX's inference is the fallback
        return infer_shapes(model)
