"""FlashAttention's FP8 form: E4M3 rounding, dequantization, and the ONNX nodes that dequantize.

A value of an FP8 instance is its E4M3 number times the tensor's float32 scale (``DequantizeLinear``);
v is stored transposed, [B, Hkv, D, Skv] with Skv = Sk rounded up to ``FP8_V_ALIGN`` (spec.yaml).
reference.py's NumPy reference and ONNX function use these; the tests quantize with them.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

#: The lowest default-domain opset of an FP8 node (ONNX's float8 types, DequantizeLinear 19).
FP8_MIN_OPSET = 19
#: FlashAttention's FP8 scales, in spec order (q_scale, k_scale, v_scale).
SCALES = ("q_scale", "k_scale", "v_scale")
#: An FP8 v's key dim (Skv) is Sk rounded up to a multiple of this (16-byte aligned rows).
FP8_V_ALIGN = 16


def fp8_v_keys(sk: int) -> int:
    """Skv of an FP8 v: Sk rounded up to a multiple of FP8_V_ALIGN."""
    return -(-int(sk) // FP8_V_ALIGN) * FP8_V_ALIGN


def quantize_fp8(x, scale) -> np.ndarray:
    """x / scale rounded to E4M3 (ml_dtypes, round to nearest even), saturated to +-448 like
    QuantizeLinear's saturate=1."""
    import ml_dtypes

    y = np.clip(np.asarray(x, np.float64) / float(scale), -448.0, 448.0)
    return y.astype(np.float32).astype(ml_dtypes.float8_e4m3fn)


def is_fp8(x) -> bool:
    return x is not None and np.asarray(x).dtype.name == "float8_e4m3fn"


def dequantize_fp8(q, k, v, scales, sk: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float64 q, k, v of an FP8 instance: each value times its scale, v transposed back from
    [B, Hkv, D, Skv] to [B, Hkv, Sk, D] (Sk: k's keys)."""
    if any(s is None for s in scales):
        raise ValueError(f"FlashAttention: FP8 q, k, v need {', '.join(SCALES)} (got {['absent' if s is None else 'present' for s in scales]})")
    if not (is_fp8(k) and is_fp8(v)):
        raise ValueError("FlashAttention: q, k and v must all be FP8 or none")
    sk = k.shape[2] if sk is None else sk
    if v.shape[:3] != (k.shape[0], k.shape[1], k.shape[3]) or v.shape[3] != fp8_v_keys(sk):
        raise ValueError(f"FlashAttention: FP8 v{tuple(v.shape)} is not [B, Hkv, D, Skv] for k{tuple(k.shape)} "
                         f"(Skv = {fp8_v_keys(sk)})")
    s = [float(np.asarray(x, np.float64).reshape(-1)[0]) for x in scales]
    qf = q.astype(np.float64) * s[0]
    kf = k.astype(np.float64) * s[1]
    vf = v.astype(np.float64)[..., :sk].transpose(0, 1, 3, 2) * s[2]
    return qf, kf, vf


def fp8_dequantize_nodes() -> list[onnx.NodeProto]:
    """``q_dq``, ``k_dq``, ``v_dq`` (float32, v as [B, Hkv, Sk, D]) from the FP8 inputs and their
    scales: DequantizeLinear with each scale as a scalar, v transposed back and cut to k's Sk."""
    mk = helper.make_node
    nodes = [mk("Constant", [], ["scalar_shape"], value=helper.make_tensor("scalar_shape", TensorProto.INT64, [0], []))]
    for x, s in zip(("q", "k", "v"), SCALES):
        nodes += [mk("Reshape", [s, "scalar_shape"], [f"{s}_s"]),
                  mk("DequantizeLinear", [x, f"{s}_s"], [f"{x}_dq" if x != "v" else "vt_dq"])]
    nodes += [
        # v^T -> v as an Einsum, not a Transpose: with a Transpose here and the graph's
        # Transpose -> Pad -> QuantizeLinear in front (the precision pass's v), onnxruntime 1.32's
        # graph optimizations (level basic and up) miscompute the fused LLaMA candidate; it is
        # right with them disabled, and with the Einsum
        mk("Einsum", ["vt_dq"], ["v_full"], equation="bhds->bhsd"),
        mk("Shape", ["k_dq"], ["sk_v"], start=2, end=3),  # a float tensor's: onnxruntime has no FP8 Shape
        mk("Constant", [], ["zero_v"], value=helper.make_tensor("zero_v", TensorProto.INT64, [1], [0])),
        mk("Constant", [], ["axis_v"], value=helper.make_tensor("axis_v", TensorProto.INT64, [1], [2])),
        mk("Slice", ["v_full", "zero_v", "sk_v", "axis_v"], ["v_dq"]),
    ]
    return nodes
