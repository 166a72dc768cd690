"""The ONNX reference function a plugin ships for its op (what onnxruntime runs for the fused node).

Kept to ``onnx`` and the spec reader (pyyaml): plugin reference modules import it where only
numpy/onnx exist (GPU image).
"""

from __future__ import annotations

from .spec import OpSpec

#: Attributes every fused optfuse node carries besides the spec's (TensorRT's plugin lookup key).
PLUGIN_ATTRIBUTES = ("plugin_namespace", "plugin_version")


def plugin_function(spec: OpSpec, nodes: list, opset: int, doc: str | None = None):
    """``onnx.FunctionProto`` ``spec.domain::spec.op`` over ``nodes``, importing the default
    domain at ``opset``: the spec's inputs and outputs by name and in order, its attributes (those
    with a default carry it; the others must be set on the node) plus ``plugin_namespace`` /
    ``plugin_version`` with the spec's domain and version."""
    from onnx import helper

    required = [a.name for a in spec.attributes if a.default is None]
    attribute_protos = [helper.make_attribute(k, v) for k, v in spec.defaults().items()]
    attribute_protos += [helper.make_attribute("plugin_namespace", spec.domain),
                         helper.make_attribute("plugin_version", spec.plugin_version)]
    return helper.make_function(
        spec.domain,
        spec.op,
        [t.name for t in spec.inputs],
        [t.name for t in spec.outputs],
        nodes,
        opset_imports=[helper.make_opsetid("", opset)],
        attributes=required,
        attribute_protos=attribute_protos,
        doc_string=doc or f"optfuse {spec.op}: reference semantics for onnxruntime (TensorRT maps the node to a plugin).",
    )


#: E4M3's largest finite value (ONNX FLOAT8E4M3FN: no infinities); QuantizeLinear saturates to it.
E4M3_MAX = 448.0


def quantize_e4m3(values, scale):
    """``values / scale`` as QuantizeLinear with a float8e4m3fn zero point computes it: saturated to
    +-448, rounded to nearest even (ml_dtypes float8_e4m3fn, through float32 as onnxruntime's
    float32 QuantizeLinear rounds), NaN kept NaN. ``scale``: one value (a [1] or [] array)."""
    import ml_dtypes
    import numpy as np

    s = float(np.asarray(scale, np.float64).reshape(-1)[0])
    q = np.clip(np.asarray(values, np.float64) / s, -E4M3_MAX, E4M3_MAX)  # np.clip keeps NaN
    return q.astype(np.float32).astype(ml_dtypes.float8_e4m3fn)


def quantize_output_nodes(value: str, scale: str, out: str) -> list:
    """Function-body nodes ``out = QuantizeLinear(value, scale)`` to float8e4m3fn (saturate), the
    [1] ``scale`` read as the per-tensor scalar; ``value`` is float32 (default-domain opset >= 19)."""
    from onnx import TensorProto, helper

    return [
        helper.make_node("Constant", [], [f"{out}_scalar_shape"],
                         value=helper.make_tensor(f"{out}_scalar_shape", TensorProto.INT64, [0], [])),
        helper.make_node("Reshape", [scale, f"{out}_scalar_shape"], [f"{out}_scale_s"]),
        helper.make_node("Constant", [], [f"{out}_zero_point"],
                         value=helper.make_tensor(f"{out}_zero_point", TensorProto.FLOAT8E4M3FN, [], [0.0])),
        helper.make_node("QuantizeLinear", [value, f"{out}_scale_s", f"{out}_zero_point"], [out], saturate=1),
    ]
