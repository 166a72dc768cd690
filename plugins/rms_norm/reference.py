"""NumPy references and ONNX functions of RMSNorm / SkipRMSNorm (see docs/CONTRACTS.md).

``reference`` computes in float64 and returns the input dtype. SkipRMSNorm's ``sum`` output is
``x + skip`` rounded to x's dtype, and ``y`` normalizes that rounded sum.
"""

from __future__ import annotations

import numpy as np

from optfuse.functions import plugin_function
from optfuse.spec import plugin_specs, shared

SPECS = plugin_specs(__file__)
OPS = tuple(SPECS)
DEFAULT_EPSILON = shared(SPECS, lambda s: s.attr("epsilon").default, "the epsilon default")


def rms_norm64(x: np.ndarray, gamma: np.ndarray, epsilon: float) -> np.ndarray:
    """float64 RMSNorm over the last axis (no rounding)."""
    x = np.asarray(x, dtype=np.float64)
    ms = (x * x).mean(axis=-1, keepdims=True)
    return x / np.sqrt(ms + float(epsilon)) * np.asarray(gamma, np.float64)


def sample_inputs(op: str, rng: np.random.Generator) -> tuple[list[np.ndarray], dict]:
    """Random float32 inputs of ``op`` in spec order, and its attributes without a default (none):
    what the contract test runs through the ONNX function and this reference. Rows of a small
    mean square, so that the epsilon default shows in the result."""
    x = (0.003 * rng.standard_normal((2, 3, 32))).astype(np.float32)
    skip = [(0.003 * rng.standard_normal(x.shape)).astype(np.float32)] if op == "SkipRMSNorm" else []
    return [x, *skip, rng.standard_normal(32).astype(np.float32)], {}


def reference(op: str, inputs: list, attrs: dict) -> list[np.ndarray]:
    eps = float(attrs.get("epsilon", DEFAULT_EPSILON))
    if op == "RMSNorm":
        x, gamma = inputs
        return [rms_norm64(x, gamma, eps).astype(x.dtype)]
    if op == "SkipRMSNorm":
        x, skip, gamma = inputs
        s = (x.astype(np.float64) + skip.astype(np.float64)).astype(x.dtype)
        return [rms_norm64(s, gamma, eps).astype(x.dtype), s]
    raise ValueError(f"rms_norm plugin has no op {op!r}")


def onnx_function(op: str, opset: int = 17, dtype: str = "float32"):
    """``onnx.FunctionProto`` (domain ``optfuse``, name ``op``): the RMSNorm decomposed into
    standard ops, computed in float32 (``Cast`` in, ``CastLike`` out) for any I/O dtype.
    ``opset`` is the default-domain opset of the model it goes into (ReduceMean's axes moved
    from attribute to input in opset 18; below opset 15, which lacks ``CastLike``, the result is
    cast to ``dtype``, the model's I/O dtype)."""
    import onnx
    from onnx import TensorProto, helper

    if opset < 13:
        raise ValueError("optfuse ONNX functions need default-domain opset >= 13")
    if op == "RMSNorm":
        nodes = [helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT)]
    elif op == "SkipRMSNorm":
        nodes = [
            helper.make_node("Add", ["x", "skip"], ["sum"]),
            helper.make_node("Cast", ["sum"], ["xf"], to=TensorProto.FLOAT),
        ]
    else:
        raise ValueError(f"rms_norm plugin has no op {op!r}")
    eps = helper.make_node("Constant", [], ["eps"])
    ref = onnx.AttributeProto()
    ref.name, ref.ref_attr_name, ref.type = "value_float", "epsilon", onnx.AttributeProto.FLOAT
    eps.attribute.append(ref)
    nodes.append(helper.make_node("Mul", ["xf", "xf"], ["sq"]))
    if opset >= 18:
        nodes.append(helper.make_node("Constant", [], ["axes"], value_ints=[-1]))
        nodes.append(helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1))
    else:
        nodes.append(helper.make_node("ReduceMean", ["sq"], ["ms"], axes=[-1], keepdims=1))
    nodes += [
        eps,
        helper.make_node("Add", ["ms", "eps"], ["ms_eps"]),
        helper.make_node("Sqrt", ["ms_eps"], ["rms"]),
        helper.make_node("Div", ["xf", "rms"], ["xn"]),
        helper.make_node("Cast", ["gamma"], ["gf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["xn", "gf"], ["yf"]),
    ]
    if opset >= 15:
        nodes.append(helper.make_node("CastLike", ["yf", "x"], ["y"]))
    else:
        to = TensorProto.BFLOAT16 if dtype == "bfloat16" else helper.np_dtype_to_tensor_dtype(__import__("numpy").dtype(dtype))
        nodes.append(helper.make_node("Cast", ["yf"], ["y"], to=to))
    return plugin_function(SPECS[op], nodes, opset)
