"""TensorRT's FP8 MHA pattern on unfused attention (``MatMul -> [scale, mask] -> Softmax -> MatMul``).

TensorRT fuses an FP8 multi-head attention when both batched GEMMs read Q/DQ'd inputs: Q and K
(the inputs of the first MatMul) and the softmax output and V (the inputs of the second), each with
a per-tensor scale (ModelOpt's ONNX FP8 flow places the same four). :func:`find_attention` finds
the blocks: from each Softmax back through the score arithmetic (scale, mask, casts) to a MatMul of
two activations, and forward to the MatMul that reads the probabilities as its first input.
optfuse's own FlashAttention nodes take their FP8 form instead (:mod:`.fp8_attention`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import onnx

#: ops between the Q.K^T MatMul and the Softmax (scaling, masking, casts, reshapes)
SCORE_OPS = ("Add", "Sub", "Mul", "Div", "Where", "Cast", "Reshape", "Tanh")
#: ops between the Softmax and the P.V MatMul
PROBABILITY_OPS = ("Cast", "Where")  # Where: torch SDPA's where(isnan(p), 0, p)


@dataclass(frozen=True)
class AttentionTarget:
    """One unfused attention block: its node names and the four tensors Q/DQ'd (FP32 model
    names), each with the node and input position that reads it."""

    softmax: str
    qk: str
    pv: str
    tensors: tuple[tuple[str, str, int], ...]  # (tensor, consumer node, input index): Q, K, P, V

    @property
    def matmuls(self) -> tuple[str, str]:
        return self.qk, self.pv


def find_attention(model: onnx.ModelProto, inits: Mapping[str, onnx.TensorProto]) -> list[AttentionTarget]:
    """Every ``MatMul(Q, K^T) -> ... -> Softmax -> MatMul(P, V)`` of activations in `model`."""
    producer = {o: n for n in model.graph.node for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)

    def activations(n: onnx.NodeProto) -> bool:
        return len(n.input) == 2 and all(i and i not in inits for i in n.input)

    def qk_of(tensor: str, depth: int = 0) -> onnx.NodeProto | None:
        p = producer.get(tensor)
        if p is None or depth > 6:
            return None
        if p.op_type == "MatMul":
            return p if activations(p) else None
        if p.op_type not in SCORE_OPS:
            return None
        for i in p.input:
            if i and i not in inits:
                found = qk_of(i, depth + 1)
                if found is not None:
                    return found
        return None

    def pv_of(tensor: str, depth: int = 0) -> tuple[onnx.NodeProto, str] | None:
        for c in consumers.get(tensor, ()):
            if c.op_type == "MatMul" and c.input[0] == tensor and activations(c):
                return c, tensor
            if c.op_type in PROBABILITY_OPS and depth < 3:
                found = pv_of(c.output[0], depth + 1)
                if found is not None:
                    return found
        return None

    out = []
    for s in model.graph.node:
        if s.op_type != "Softmax":
            continue
        qk = qk_of(s.input[0])
        found = pv_of(s.output[0])
        if qk is None or found is None:
            continue
        pv, p = found
        out.append(AttentionTarget(s.name, qk.name, pv.name, ((qk.input[0], qk.name, 0), (qk.input[1], qk.name, 1),
                                                               (p, pv.name, 0), (pv.input[1], pv.name, 1))))
    return out

