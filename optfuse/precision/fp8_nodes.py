"""What the FP8 placements (:mod:`.fp8`, :mod:`.fp8_attention`) share: the base types and the
dtype names of the FP8 forms, the exclusion by ``fp8_exclude``, and the builder of the Q/DQ nodes,
scale initializers and value_info they add to the base model."""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .calibrate import TensorCalibration

BASE_TYPES = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}
OUTPUT_DTYPE = {TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16", TensorProto.FLOAT: "float32"}


def replaced_names(node: onnx.NodeProto) -> list[str]:
    """The original node names a fused node replaced (its ``optfuse.replaced`` metadata)."""
    for p in node.metadata_props:
        if p.key == "optfuse.replaced":
            try:
                return [str(n) for n in json.loads(p.value)]
            except ValueError:
                return []
    return []


def excluded_by(node: onnx.NodeProto, patterns: Sequence[str]) -> str | None:
    """The first ``fp8_exclude`` entry naming the node (its name, an original name, its op type)."""
    names = [node.name, *replaced_names(node)]
    for p in patterns:
        if p == node.op_type or any(n and (n == p or fnmatch.fnmatchcase(n, p)) for n in names):
            return p
    return None


class QdqBuilder:
    """New initializers, nodes and value_info for the base model, with unique names."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.names = {t.name for t in model.graph.initializer} | {o for n in model.graph.node for o in n.output}
        self.names |= {n.name for n in model.graph.node}
        self.inits: list[TensorProto] = []
        self.value_info: list[onnx.ValueInfoProto] = []
        self.new_nodes: dict[str, list[onnx.NodeProto]] = {}  # node name -> nodes to insert before it
        self.quantized: dict[str, tuple[str, str]] = {}  # activation -> (its Q output, the Q's scale)
        self.dequantized: dict[str, str] = {}  # activation -> its Q -> DQ output

    def unique(self, base: str) -> str:
        name, i = base, 1
        while name in self.names:
            name, i = f"{base}_{i}", i + 1
        self.names.add(name)
        return name

    def constant(self, base: str, array: np.ndarray, data_type: int) -> str:
        name = self.unique(base)
        self.inits.append(make_tensor(name, array, data_type))
        return name

    def add_node(self, before: str, node: onnx.NodeProto, output_type: int) -> None:
        self.new_nodes.setdefault(before, []).append(node)
        self.value_info.append(helper.make_tensor_value_info(node.output[0], output_type, None))

    def quantize(self, act: str, scale: float, dtype: int, before: str) -> tuple[str, str]:
        """``QuantizeLinear(act)`` to E4M3 (one per tensor, placed before node `before` the first
        time): its output and its scale initializer (of type `dtype`, the activation's)."""
        if act not in self.quantized:
            s = self.constant(f"{act}/fp8_scale", np.array(scale, np.float32), dtype)
            zp = self.constant(f"{act}/fp8_zero_point", np.zeros((), np.float32), TensorProto.FLOAT8E4M3FN)
            q = self.unique(f"{act}/fp8")
            self.add_node(before, helper.make_node("QuantizeLinear", [act, s, zp], [q],
                                                   name=self.unique(f"{act}/QuantizeLinear")), TensorProto.FLOAT8E4M3FN)
            self.quantized[act] = (q, s)
        return self.quantized[act]

    def qdq(self, act: str, scale: float, dtype: int, before: str) -> str:
        """``DequantizeLinear(QuantizeLinear(act))`` (TensorRT's activation pattern), one per tensor."""
        q, s = self.quantize(act, scale, dtype, before)
        if act not in self.dequantized:
            dq = self.unique(f"{act}/fp8_dq")
            zp = self.constant(f"{act}/fp8_dq_zero_point", np.zeros((), np.float32), TensorProto.FLOAT8E4M3FN)
            self.add_node(before, helper.make_node("DequantizeLinear", [q, s, zp], [dq],
                                                   name=self.unique(f"{act}/DequantizeLinear")), dtype)
            self.dequantized[act] = dq
        return self.dequantized[act]


def make_tensor(name: str, array: np.ndarray, data_type: int) -> TensorProto:
    """A TensorProto of `array` in `data_type` (FLOAT, FLOAT16, BFLOAT16 or FLOAT8E4M3FN)."""
    import ml_dtypes

    if data_type == TensorProto.FLOAT8E4M3FN:
        arr = np.asarray(array)
        if arr.dtype != ml_dtypes.float8_e4m3fn:
            arr = arr.astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
        return helper.make_tensor(name, data_type, list(arr.shape), arr.view(np.uint8).tobytes(), raw=True)
    np_type = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16,
               TensorProto.BFLOAT16: ml_dtypes.bfloat16}[data_type]
    return numpy_helper.from_array(np.asarray(array, np.float32).astype(np_type), name)


def round_to(values: np.ndarray, data_type: int) -> np.ndarray:
    """Scales as the base type holds them (float32 values), kept at or above its smallest normal."""
    import ml_dtypes

    v = np.asarray(values, np.float32)
    if data_type == TensorProto.FLOAT16:
        return np.maximum(v, np.float32(np.finfo(np.float16).tiny)).astype(np.float16).astype(np.float32)
    if data_type == TensorProto.BFLOAT16:
        return np.maximum(v, np.float32(np.finfo(np.float32).tiny)).astype(ml_dtypes.bfloat16).astype(np.float32)
    return v


def calibration_source(c: TensorCalibration) -> str:
    what = {"max": "max |x|", "percentile": "percentile of |x|", "mse": "E4M3 MSE-optimal clip"}[c.method]
    clip = f"; clips max |x| {c.max_abs:.4g}" if c.method != "max" and c.amax < c.max_abs else ""
    aligned = f", grid-aligned x{c.amax / c.max_abs:.4g}" if c.method == "max" and c.amax > c.max_abs > 0 else ""
    return f"{what}{aligned} over {c.batches} calibration batch(es){clip}"


def insert_nodes(model: onnx.ModelProto, b: QdqBuilder) -> None:
    """The builder's nodes (each before the node it names), initializers and value_info, into `model`."""
    g = model.graph
    nodes = []
    for n in g.node:
        nodes.extend(b.new_nodes.get(n.name, ()))
        nodes.append(n)
    del g.node[:]
    g.node.extend(nodes)
    g.initializer.extend(b.inits)
    g.value_info.extend(b.value_info)
