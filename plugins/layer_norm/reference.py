"""NumPy references and ONNX functions of LayerNorm / SkipLayerNorm (see docs/CONTRACTS.md).

``reference`` computes in float64 and returns the input dtype. SkipLayerNorm's ``sum`` output is
``x + skip`` rounded to x's dtype, and ``y`` normalizes that rounded sum (what the unfused
Add -> LayerNormalization graph computes).
"""

from __future__ import annotations

import numpy as np

DOMAIN = "optfuse"
OPS = ("LayerNorm", "SkipLayerNorm")
DEFAULT_EPSILON = 1e-5


def layer_norm64(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, epsilon: float) -> np.ndarray:
    """float64 LayerNorm over the last axis (no rounding)."""
    x = np.asarray(x, dtype=np.float64)
    mean = x.mean(axis=-1, keepdims=True)
    xc = x - mean
    var = (xc * xc).mean(axis=-1, keepdims=True)
    return xc / np.sqrt(var + float(epsilon)) * np.asarray(gamma, np.float64) + np.asarray(beta, np.float64)


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


def onnx_function(op: str, opset: int = 17):
    """``onnx.FunctionProto`` (domain ``optfuse``, name ``op``) built on the standard
    ``LayerNormalization`` (opset >= 17), attributes epsilon / plugin_namespace / plugin_version."""
    import onnx
    from onnx import helper

    if opset < 17:
        raise ValueError("LayerNorm functions need default-domain opset >= 17 (LayerNormalization)")
    eps_attr = helper.make_attribute_ref("epsilon", onnx.AttributeProto.FLOAT)
    if op == "LayerNorm":
        inputs, outputs = ["x", "gamma", "beta"], ["y"]
        ln_in = "x"
        nodes = []
    elif op == "SkipLayerNorm":
        inputs, outputs = ["x", "skip", "gamma", "beta"], ["y", "sum"]
        ln_in = "sum"
        nodes = [helper.make_node("Add", ["x", "skip"], ["sum"])]
    else:
        raise ValueError(f"layer_norm plugin has no op {op!r}")
    ln = helper.make_node("LayerNormalization", [ln_in, "gamma", "beta"], ["y"], axis=-1)
    ln.attribute.append(eps_attr)
    nodes.append(ln)
    attribute_proto = [
        helper.make_attribute("epsilon", DEFAULT_EPSILON),
        helper.make_attribute("plugin_namespace", "optfuse"),
        helper.make_attribute("plugin_version", "1"),
    ]
    return helper.make_function(
        DOMAIN,
        op,
        inputs,
        outputs,
        nodes,
        opset_imports=[helper.make_opsetid("", opset)],
        attributes=[],
        attribute_protos=attribute_proto,
        doc_string=f"optfuse {op}: reference semantics for onnxruntime (TensorRT maps the node to a plugin).",
    )
