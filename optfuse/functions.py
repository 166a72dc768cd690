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
