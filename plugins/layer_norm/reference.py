"""NumPy references and ONNX functions of LayerNorm / SkipLayerNorm (see docs/CONTRACTS.md).

``reference`` computes in float64 and returns the input dtype. SkipLayerNorm's ``sum`` output is
``x + skip`` rounded to x's dtype, and ``y`` normalizes that rounded sum (what the unfused
Add -> LayerNormalization graph computes).

FP8 output (``y_scale`` present): y = QuantizeLinear(norm(x), y_scale) to float8e4m3fn (saturate to
+-448, round to nearest even, NaN stays NaN), from the unrounded normalized value: the reference
quantizes the float64 result, the ONNX function (variant ``fp8``, opset >= 19) the float32
LayerNormalization of x cast to float32, never a y rounded to x's 16-bit dtype first. ``sum`` stays in
x's dtype.
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


def layer_norm64(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, epsilon: float) -> np.ndarray:
    """float64 LayerNorm over the last axis (no rounding)."""
    x = np.asarray(x, dtype=np.float64)
    mean = x.mean(axis=-1, keepdims=True)
    xc = x - mean
    var = (xc * xc).mean(axis=-1, keepdims=True)
    return xc / np.sqrt(var + float(epsilon)) * np.asarray(gamma, np.float64) + np.asarray(beta, np.float64)


def sample_inputs(op: str, rng: np.random.Generator) -> tuple[list[np.ndarray], dict]:
    """Random float32 inputs of ``op`` in spec order, and its attributes without a default (none):
    what the contract test runs through the ONNX function and this reference. Rows of a small
    variance, so that the epsilon default shows in the result; y_scale 1/100, so that the largest
    |y| (a few units) saturate at 448 (the contract test drops it too: the float32 y)."""
    x = (0.01 * rng.standard_normal((2, 3, 32)) + 0.5).astype(np.float32)
    skip = [(0.01 * rng.standard_normal(x.shape)).astype(np.float32)] if op == "SkipLayerNorm" else []
    gamma, beta = (rng.standard_normal(32).astype(np.float32) for _ in range(2))
    return [x, *skip, gamma, beta, np.array([0.01], np.float32)], {}


def split_inputs(op: str, inputs: list) -> tuple[list, np.ndarray | None]:
    """(the operands x, [skip], gamma, beta; y_scale or None) from inputs in spec order (y_scale
    may be left out)."""
    if op not in OPS:
        raise ValueError(f"layer_norm plugin has no op {op!r}")
    n = len(_OPERANDS[op])
    if len(inputs) not in (n, n + 1):
        raise ValueError(f"{op}: {len(inputs)} inputs, expected {n} or {n + 1} (with y_scale)")
    return list(inputs[:n]), (inputs[n] if len(inputs) > n else None)


def reference(op: str, inputs: list, attrs: dict) -> list[np.ndarray]:
    eps = float(attrs.get("epsilon", DEFAULT_EPSILON))
    operands, y_scale = split_inputs(op, inputs)

    def out(y64, like):
        return y64.astype(like.dtype) if y_scale is None else quantize_e4m3(y64, y_scale)

    if op == "LayerNorm":
        x, gamma, beta = operands
        return [out(layer_norm64(x, gamma, beta, eps), x)]
    x, skip, gamma, beta = operands
    s = (x.astype(np.float64) + skip.astype(np.float64)).astype(x.dtype)
    return [out(layer_norm64(s, gamma, beta, eps), x), s]


def function_overload(op: str, inputs, attrs: dict | None = None) -> str:
    """The function variant (ONNX ``overload``) of a node: ``fp8`` when y_scale is present
    (``inputs``: its input names in spec order, "" or missing: absent), else the plain one."""
    if op not in OPS:
        raise ValueError(f"layer_norm plugin has no op {op!r}")
    i = SPECS[op].input_index("y_scale")
    return "fp8" if i < len(inputs) and inputs[i] else ""


def function_overloads(op: str) -> tuple[str, ...]:
    """Every variant :func:`function_overload` names."""
    return ("", "fp8")


def onnx_function(op: str, opset: int = 17, dtype: str = "float32", overload: str = ""):
    """``onnx.FunctionProto`` (domain ``optfuse``, name ``op``), attributes epsilon /
    plugin_namespace / plugin_version, written for the model's default-domain ``opset``;
    ``overload="fp8"``: the FP8-output variant (opset >= 19: x cast to float32, the float32
    ``LayerNormalization``, ``QuantizeLinear`` with y_scale; SkipLayerNorm's sum in x's dtype), else:

    * opset >= 17: the standard ``LayerNormalization`` (SkipLayerNorm adds an ``Add``);
    * opset 15-16: the same math decomposed (ReduceMean, Sub, Mul, Sqrt, Div) in float32,
      cast back with ``CastLike``;
    * opset 13-14 (no ``CastLike``): decomposed in float32 and cast back to ``dtype`` (the
      model's I/O dtype, float32 unless told).
    """
    import onnx
    from onnx import helper

    if opset < 13:
        raise ValueError("optfuse ONNX functions need default-domain opset >= 13")
    if overload not in function_overloads(op):
        raise ValueError(f"{op}: no function variant {overload!r} (variants: {function_overloads(op)})")
    if overload == "fp8":
        return _fp8_function(op, opset)
    if op == "LayerNorm":
        ln_in, nodes = "x", []
    elif op == "SkipLayerNorm":
        ln_in = "sum"
        nodes = [helper.make_node("Add", ["x", "skip"], ["sum"])]
    else:
        raise ValueError(f"layer_norm plugin has no op {op!r}")
    if opset >= 17:
        ln = helper.make_node("LayerNormalization", [ln_in, "gamma", "beta"], ["y"], axis=-1)
        ln.attribute.append(helper.make_attribute_ref("epsilon", onnx.AttributeProto.FLOAT))
        nodes.append(ln)
    else:
        nodes += _decomposed(ln_in, opset, dtype)
    return plugin_function(SPECS[op], nodes, opset)


def _fp8_function(op: str, opset: int):
    import onnx
    from onnx import TensorProto, helper

    if opset < FP8_OPSET:
        raise ValueError(f"{op}: the FP8-output variant needs default-domain opset >= {FP8_OPSET} (got {opset})")
    F = TensorProto.FLOAT
    nodes = [helper.make_node("Add", ["x", "skip"], ["sum"])] if op == "SkipLayerNorm" else []
    nodes += [
        helper.make_node("Cast", ["sum" if op == "SkipLayerNorm" else "x"], ["xf"], to=F),
        helper.make_node("Cast", ["gamma"], ["gf"], to=F),
        helper.make_node("Cast", ["beta"], ["bf"], to=F),
    ]
    ln = helper.make_node("LayerNormalization", ["xf", "gf", "bf"], ["yf"], axis=-1)
    ln.attribute.append(helper.make_attribute_ref("epsilon", onnx.AttributeProto.FLOAT))
    nodes.append(ln)
    nodes += quantize_output_nodes("yf", "y_scale", "y")
    fn = plugin_function(SPECS[op], nodes, opset)
    fn.overload = "fp8"
    return fn


def _decomposed(x: str, opset: int, dtype: str) -> list:
    """LayerNorm of ``x`` into ``y`` from standard ops, statistics in float32."""
    import onnx
    from onnx import TensorProto, helper

    def mean(inp, out):
        if opset >= 18:
            return [helper.make_node("Constant", [], [out + "_axes"], value_ints=[-1]),
                    helper.make_node("ReduceMean", [inp, out + "_axes"], [out], keepdims=1)]
        return [helper.make_node("ReduceMean", [inp], [out], axes=[-1], keepdims=1)]

    F = TensorProto.FLOAT
    eps = helper.make_node("Constant", [], ["eps"])
    ref = onnx.AttributeProto()
    ref.name, ref.ref_attr_name, ref.type = "value_float", "epsilon", onnx.AttributeProto.FLOAT
    eps.attribute.append(ref)
    nodes = [helper.make_node("Cast", [x], ["xf"], to=F)]
    nodes += mean("xf", "mean")
    nodes += [helper.make_node("Sub", ["xf", "mean"], ["xc"]), helper.make_node("Mul", ["xc", "xc"], ["sq"])]
    nodes += mean("sq", "var")
    nodes += [
        eps,
        helper.make_node("Add", ["var", "eps"], ["var_eps"]),
        helper.make_node("Sqrt", ["var_eps"], ["std"]),
        helper.make_node("Div", ["xc", "std"], ["xn"]),
        helper.make_node("Cast", ["gamma"], ["gf"], to=F),
        helper.make_node("Cast", ["beta"], ["bf"], to=F),
        helper.make_node("Mul", ["xn", "gf"], ["xg"]),
        helper.make_node("Add", ["xg", "bf"], ["yf"]),
    ]
    if opset >= 15:
        nodes.append(helper.make_node("CastLike", ["yf", "x"], ["y"]))
    else:
        to = helper.np_dtype_to_tensor_dtype(__import__("numpy").dtype(dtype)) if dtype != "bfloat16" else TensorProto.BFLOAT16
        nodes.append(helper.make_node("Cast", ["yf"], ["y"], to=to))
    return nodes
