"""NumPy references and ONNX functions of LayerNorm / SkipLayerNorm (see docs/CONTRACTS.md).

``reference`` computes in float64 and returns the input dtype. SkipLayerNorm's ``sum`` output is
``x + skip`` rounded to x's dtype, and ``y`` normalizes that rounded sum (what the unfused
Add -> LayerNormalization graph computes).
"""

from __future__ import annotations

import numpy as np

from optfuse.functions import plugin_function
from optfuse.spec import plugin_specs, shared

SPECS = plugin_specs(__file__)
OPS = tuple(SPECS)
DEFAULT_EPSILON = shared(SPECS, lambda s: s.attr("epsilon").default, "the epsilon default")


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
    variance, so that the epsilon default shows in the result."""
    x = (0.01 * rng.standard_normal((2, 3, 32)) + 0.5).astype(np.float32)
    skip = [(0.01 * rng.standard_normal(x.shape)).astype(np.float32)] if op == "SkipLayerNorm" else []
    gamma, beta = (rng.standard_normal(32).astype(np.float32) for _ in range(2))
    return [x, *skip, gamma, beta], {}


def reference(op: str, inputs: list, attrs: dict) -> list[np.ndarray]:
    eps = float(attrs.get("epsilon", DEFAULT_EPSILON))
    if op == "LayerNorm":
        x, gamma, beta = inputs
        return [layer_norm64(x, gamma, beta, eps).astype(x.dtype)]
    if op == "SkipLayerNorm":
        x, skip, gamma, beta = inputs
        s = (x.astype(np.float64) + skip.astype(np.float64)).astype(x.dtype)
        return [layer_norm64(s, gamma, beta, eps).astype(x.dtype), s]
    raise ValueError(f"layer_norm plugin has no op {op!r}")


def onnx_function(op: str, opset: int = 17, dtype: str = "float32"):
    """``onnx.FunctionProto`` (domain ``optfuse``, name ``op``), attributes epsilon /
    plugin_namespace / plugin_version, written for the model's default-domain ``opset``:

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
