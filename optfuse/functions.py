"""The ONNX reference function a plugin ships for its op (what onnxruntime runs for the fused node).

Kept to ``onnx`` alone: plugin reference modules import it where only numpy/onnx exist (GPU image).
"""

from __future__ import annotations

from typing import Any, Sequence

from . import DOMAIN


def plugin_function(op: str, inputs: Sequence[str], outputs: Sequence[str], nodes: list, opset: int,
                    defaults: dict[str, Any]):
    """``onnx.FunctionProto`` ``DOMAIN::op`` over ``nodes``, importing the default domain at
    ``opset``, with the op's attributes and their defaults (``defaults``) plus the
    ``plugin_namespace`` / ``plugin_version`` every optfuse node carries."""
    from onnx import helper

    attribute_protos = [helper.make_attribute(k, v) for k, v in defaults.items()]
    attribute_protos += [helper.make_attribute("plugin_namespace", DOMAIN),
                         helper.make_attribute("plugin_version", "1")]
    return helper.make_function(
        DOMAIN,
        op,
        list(inputs),
        list(outputs),
        nodes,
        opset_imports=[helper.make_opsetid("", opset)],
        attributes=[],
        attribute_protos=attribute_protos,
        doc_string=f"optfuse {op}: reference semantics for onnxruntime (TensorRT maps the node to a plugin).",
    )
