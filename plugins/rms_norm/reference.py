"""NumPy references and ONNX functions of RMSNorm / SkipRMSNorm (see docs/CONTRACTS.md).

``reference`` computes in float64 and returns the input dtype. SkipRMSNorm's ``sum`` output is
``x + skip`` rounded to x's dtype, and ``y`` normalizes that rounded sum.

FP8 output (``y_scale`` present): y = QuantizeLinear(norm(x), y_scale) to float8e4m3fn (saturate to
+-448, round to nearest even, NaN stays NaN), from the unrounded normalized value: the reference
quantizes the float64 result, the ONNX function (variant ``fp8``, opset >= 19) the float32 result
(computed in float32 like the plain variant), never a y rounded to x's 16-bit dtype first. ``sum``
stays in x's dtype.
"""

from __future__ import annotations

import numpy as np

from optfuse.functions import plugin_function, quantize_e4m3, quantize_output_nodes
from optfuse.spec import plugin_specs, shared

SPECS = plugin_specs(__file__)
OPS = tuple(SPECS)
DEFAULT_EPSILON = shared(SPECS, lambda s: s.attr("epsilon").default, "the epsilon default")
#: The default-domain opset the FP8 variant needs (QuantizeLinear to float8e4m3fn)
FP8_OPSET = 19
#: Inputs in spec order without the optional y_scale
_OPERANDS = {op: tuple(t.name for t in s.inputs if t.name != "y_scale") for op, s in SPECS.items()}


def rms_norm64(x: np.ndarray, gamma: np.ndarray, epsilon: float) -> np.ndarray:
    """float64 RMSNorm over the last axis (no rounding)."""
    x = np.asarray(x, dtype=np.float64)
    ms = (x * x).mean(axis=-1, keepdims=True)
    return x / np.sqrt(ms + float(epsilon)) * np.asarray(gamma, np.float64)


def sample_inputs(op: str, rng: np.random.Generator) -> tuple[list[np.ndarray], dict]:
    """Random float32 inputs of ``op`` in spec order, and its attributes without a default (none):
    what the contract test runs through the ONNX function and this reference. Rows of a small
    mean square, so that the epsilon default shows in the result; y_scale 1/100, so that the
    largest |y| (a few units) saturate at 448 (the contract test drops it too: the float32 y)."""
    x = (0.003 * rng.standard_normal((2, 3, 32))).astype(np.float32)
    skip = [(0.003 * rng.standard_normal(x.shape)).astype(np.float32)] if op == "SkipRMSNorm" else []
    return [x, *skip, rng.standard_normal(32).astype(np.float32), np.array([0.01], np.float32)], {}


def split_inputs(op: str, inputs: list) -> tuple[list, np.ndarray | None]:
    """(the operands x, [skip], gamma; y_scale or None) from inputs in spec order (y_scale may be
    left out)."""
    if op not in OPS:
        raise ValueError(f"rms_norm plugin has no op {op!r}")
    n = len(_OPERANDS[op])
    if len(inputs) not in (n, n + 1):
        raise ValueError(f"{op}: {len(inputs)} inputs, expected {n} or {n + 1} (with y_scale)")
    return list(inputs[:n]), (inputs[n] if len(inputs) > n else None)


def reference(op: str, inputs: list, attrs: dict) -> list[np.ndarray]:
    eps = float(attrs.get("epsilon", DEFAULT_EPSILON))
    operands, y_scale = split_inputs(op, inputs)

    def out(y64, like):
        return y64.astype(like.dtype) if y_scale is None else quantize_e4m3(y64, y_scale)

    if op == "RMSNorm":
        x, gamma = operands
        return [out(rms_norm64(x, gamma, eps), x)]
    x, skip, gamma = operands
    s = (x.astype(np.float64) + skip.astype(np.float64)).astype(x.dtype)
    return [out(rms_norm64(s, gamma, eps), x), s]


def function_overload(op: str, inputs, attrs: dict | None = None) -> str:
    """The function variant (ONNX ``overload``) of a node: ``fp8`` when y_scale is present
    (``inputs``: its input names in spec order, "" or missing: absent), else the plain one."""
    if op not in OPS:
        raise ValueError(f"rms_norm plugin has no op {op!r}")
    i = SPECS[op].input_index("y_scale")
    return "fp8" if i < len(inputs) and inputs[i] else ""


def function_overloads(op: str) -> tuple[str, ...]:
    """Every variant :func:`function_overload` names."""
    return ("", "fp8")


def onnx_function(op: str, opset: int = 17, dtype: str = "float32", overload: str = ""):
    """``onnx.FunctionProto`` (domain ``optfuse``, name ``op``): the RMSNorm decomposed into
    standard ops, computed in float32 (``Cast`` in, ``CastLike`` out) for any I/O dtype;
    ``overload="fp8"``: the float32 result quantized with y_scale (``QuantizeLinear``, opset >= 19).
    ``opset`` is the default-domain opset of the model it goes into (ReduceMean's axes moved
    from attribute to input in opset 18; below opset 15, which lacks ``CastLike``, the result is
    cast to ``dtype``, the model's I/O dtype)."""
    import onnx
    from onnx import TensorProto, helper

    if opset < 13:
        raise ValueError("optfuse ONNX functions need default-domain opset >= 13")
    if overload not in function_overloads(op):
        raise ValueError(f"{op}: no function variant {overload!r} (variants: {function_overloads(op)})")
    if overload == "fp8" and opset < FP8_OPSET:
        raise ValueError(f"{op}: the FP8-output variant needs default-domain opset >= {FP8_OPSET} (got {opset})")
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
    if overload == "fp8":
        nodes += quantize_output_nodes("yf", "y_scale", "y")
    elif opset >= 15:
        nodes.append(helper.make_node("CastLike", ["yf", "x"], ["y"]))
    else:
        to = TensorProto.BFLOAT16 if dtype == "bfloat16" else helper.np_dtype_to_tensor_dtype(__import__("numpy").dtype(dtype))
        nodes.append(helper.make_node("Cast", ["yf"], ["y"], to=to))
    fn = plugin_function(SPECS[op], nodes, opset)
    fn.overload = overload
    return fn
