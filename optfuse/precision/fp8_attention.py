"""Precision fp8: optfuse's FlashAttention nodes in their FP8 form (FlashAttention spec v3).

Which nodes (:func:`flash_targets`): each ``FlashAttention`` node whose spec has the FP8 form
(``q_scale`` and an FP8 ``q``), that ``precision.fp8_exclude`` does not name, where FP8 pays on the
target (``precision.fp8_attention``):

- ``auto`` (the default): the spec's ``fp8_speedup`` entry for the target's arch, the node's head
  dim (q's last dim) and its bias form (none, key padding, other) decides; where its lowest speedup
  is <= 1 (sm_90 at D = 64, and at D = 128 with a key-padding bias: the Triton FP8 branch, slower
  than the bf16 CUDA kernel) the node stays in the base precision, with that measurement as the
  reason. What the spec does not list (sm_89, no target, D = 32, another bias) goes FP8;
- ``on``: every node; ``off``: none.

Each node chosen takes E4M3 q, k, v directly (no DequantizeLinear in front of the plugin), like the
optfuse GEMMs:

- q, k, v are calibrated per tensor on the FP32 model like GEMM activations (the recipe's
  calibrator; scale amax / 448, rounded to the base type so the Q and the plugin hold one value);
- ``QuantizeLinear(q)``, ``QuantizeLinear(k)`` (E4M3, one per tensor, shared by the nodes reading
  it); v goes through ``Transpose(0, 1, 3, 2)`` and a ``Pad`` of its key axis to a multiple of 16
  (the spec's [B, Hkv, D, Skv] layout: keys contiguous for the FP8 tensor cores) before its
  ``QuantizeLinear``;
- the node reads ``q8, k8, vt8, bias, q_scale, k_scale, v_scale`` (float32 [1] scales) and writes
  o in the base precision (``output_dtype``); its reference function (``fp8_to_<dtype>``)
  dequantizes, so onnxruntime runs the candidate as fake-quant.

The softmax probabilities are rounded to E4M3 inside the kernel (scale 1 / 448, TensorRT's FP8
MHA convention); the fake-quant model keeps them in float32, so onnxruntime measures the q, k, v
quantization only. Nodes that stay in the base precision are listed with why.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .. import DOMAIN
from ..errors import InputError
from .fp8_nodes import BASE_TYPES, OUTPUT_DTYPE, QdqBuilder, calibration_source, excluded_by, insert_nodes, round_to

FLASH_OP = "FlashAttention"
#: FP8 v's key axis is padded to a multiple of this (the spec's Skv)
V_KEY_ALIGN = 16
#: precision.fp8_attention: auto (where the spec's fp8_speedup says FP8 pays on the target), on, off
FP8_ATTENTION_MODES = ("auto", "on", "off")


@dataclass
class Fp8FlashAttention:
    """One FlashAttention node in its FP8 form: q, k, v's amax, scale and source."""

    name: str
    tensors: list[dict]  # {"role": q|k|v, "tensor", "amax", "scale", "source"}


def flash_fp8_ready() -> bool:
    """Whether the FlashAttention spec has the FP8 form (a ``q_scale`` input, an FP8 ``q``)."""
    from ..spec import get_spec

    spec = get_spec(FLASH_OP)
    return "q_scale" in [t.name for t in spec.inputs] and "float8e4m3fn" in spec.inputs[0].dtypes


def check_mode(mode: str) -> None:
    """An InputError for a ``precision.fp8_attention`` value that is not one of FP8_ATTENTION_MODES."""
    if mode not in FP8_ATTENTION_MODES:
        raise InputError(f"precision.fp8_attention {mode!r}: expected {', '.join(FP8_ATTENTION_MODES)}")


def flash_targets(model: onnx.ModelProto, exclude: Sequence[str] = (), *, mode: str = "auto",
                  arch: int | None = None) -> tuple[list[onnx.NodeProto], list[dict]]:
    """The FlashAttention nodes to put in FP8 form, and those kept in the base precision with why.
    `mode`: ``precision.fp8_attention`` (module doc); `arch`: the target's compute capability (None: unknown)."""
    from ..spec import get_spec

    check_mode(mode)
    inits = {t.name for t in model.graph.initializer}
    nodes = [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == FLASH_OP]
    if nodes and not flash_fp8_ready():
        return [], [{"name": n.name, "op": FLASH_OP, "reason": "the FlashAttention spec has no FP8 form"} for n in nodes]
    spec = get_spec(FLASH_OP)
    facts = _node_facts(model, nodes) if mode == "auto" and nodes else {}
    targets, kept = [], []
    for n in nodes:
        pattern = excluded_by(n, exclude)
        head_dim, bias = facts.get(n.name, (None, "none"))
        timed = spec.fp8_speedup_at(arch, head_dim, bias)
        if pattern is not None:
            kept.append({"name": n.name, "op": FLASH_OP, "reason": f"excluded by precision.fp8_exclude ({pattern!r})"})
        elif any(not x or x in inits for x in n.input[:3]):
            kept.append({"name": n.name, "op": FLASH_OP, "reason": "q, k or v is a constant"})
        elif any(n.input[4:]):
            kept.append({"name": n.name, "op": FLASH_OP, "reason": "already in FP8 form"})
        elif mode == "off":
            kept.append({"name": n.name, "op": FLASH_OP, "reason": "precision.fp8_attention is off"})
        elif mode == "auto" and timed is not None and not timed.pays:
            kept.append({"name": n.name, "op": FLASH_OP, "reason": timed.describe("attention", bias)})
        else:
            targets.append(n)
    return targets, kept


def _node_facts(model: onnx.ModelProto, nodes: Sequence[onnx.NodeProto]) -> dict[str, tuple[int | None, str]]:
    """Each node's (head dim, bias form) where the model's shapes give them (value_info, inputs,
    outputs and initializers, else ONNX shape inference): the head dim is q's (else o's) last dim,
    None when unknown; the bias form one of the spec's BIAS_FORMS (:func:`bias_form`)."""
    def known(m: onnx.ModelProto) -> dict[str, list]:
        out: dict[str, list] = {t.name: list(t.dims) for t in m.graph.initializer}
        for vi in [*m.graph.input, *m.graph.value_info, *m.graph.output]:
            if vi.type.tensor_type.HasField("shape"):
                out[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
        return out

    def facts(shapes: dict[str, list]) -> dict[str, tuple[int | None, str | None]]:
        out = {}
        for n in nodes:
            q = shapes.get(n.input[0]) or shapes.get(n.output[0])
            head_dim = q[-1] if q is not None and len(q) == 4 else None
            bias = n.input[3] if len(n.input) > 3 and n.input[3] else None
            out[n.name] = (head_dim, "none" if bias is None else (bias_form(shapes[bias]) if bias in shapes else None))
        return out

    found = facts(known(model))
    if any(h is None or b is None for h, b in found.values()):
        from ..ir.shapes import infer_shapes

        again = facts(known(infer_shapes(model)))
        found = {k: (h if h is not None else again[k][0], b if b is not None else again[k][1])
                 for k, (h, b) in found.items()}
    return {k: (h, b or "other") for k, (h, b) in found.items()}


def bias_form(dims: Sequence[int | None]) -> str:
    """A FlashAttention bias's form (the spec's BIAS_FORMS) from its dims (None: not static):
    ``none`` when every dim is statically 1 (one broadcast value, which softmax ignores), ``key_padding``
    for [B|1, 1, 1, Sk] (rank 4 or less, H and Sq statically 1), else ``other``."""
    dims = [1] * (4 - len(dims)) + list(dims) if len(dims) <= 4 else list(dims)
    if all(d == 1 for d in dims):
        return "none"
    if len(dims) == 4 and dims[1] == 1 and dims[2] == 1:
        return "key_padding"
    return "other"


def place_flash_attention(out: onnx.ModelProto, fp32: onnx.ModelProto, options, calibration, result) -> None:
    """Put `out`'s FlashAttention nodes (the base-precision model of :func:`fp8.quantize_fp8`) in
    their FP8 form, calibrated on `fp32`; `result.fp8` gains ``flash_attention`` (the nodes and
    their scales) and ``flash_attention_kept`` (the others, with why), and its ``kept`` entry for
    FlashAttention counts only those others."""
    from .calibrate import calibrate

    targets, kept = flash_targets(fp32, options.fp8_exclude, mode=options.fp8_attention, arch=options.target_arch)
    if result.fp8 is not None:
        result.fp8["flash_attention_kept"] = kept
        by_policy = result.fp8.setdefault("kept", {})
        by_policy.pop(FLASH_OP, None)
        if kept:  # the count and why, in place of the policy's "no FP8 contract"
            reasons = sorted({k["reason"] for k in kept})
            by_policy[FLASH_OP] = [len(kept), "attention: " + "; ".join(reasons)]
    if not targets:
        return
    cal = calibrate(fp32, [x for n in targets for x in n.input[:3]], calibration, options.calibrator,
                    options.percentile, options.scale_steps)
    placed = _place(out, targets, cal, options.fp8_base)
    _check_io(out, {p.name for p in placed})
    if result.fp8 is not None:
        result.fp8["flash_attention"] = [asdict(p) for p in placed]
    result.notes.append(f"FP8 (E4M3): {len(placed)} optfuse FlashAttention node(s) take E4M3 q, k, v with per-tensor "
                        f"scales (v transposed to [B, Hkv, D, Skv]); probabilities rounded to E4M3 in the kernel")


def _place(out: onnx.ModelProto, targets: Sequence[onnx.NodeProto], cal: Mapping, base: str) -> list[Fp8FlashAttention]:
    from ..rewrite import add_functions
    from .fp16 import _tensor_types

    types = _tensor_types(out)
    b = QdqBuilder(out)
    by_name = {n.name: n for n in out.graph.node}
    base_type = BASE_TYPES[base]
    transposed: dict[str, str] = {}
    placed = []
    for t in targets:
        node = by_name[t.name]
        dtype = types.get(node.input[0], base_type)
        quantized, scales, entries = [], [], []
        for idx, role in enumerate("qkv"):
            act = node.input[idx]
            c = cal[t.input[idx]]
            scale = float(round_to(np.array([c.scale]), types.get(act, dtype))[0])
            src = act if role != "v" else transposed.setdefault(act, _v_transposed(b, act, types.get(act, dtype), node.name))
            quantized.append(b.quantize(src, scale, types.get(act, dtype), node.name)[0])
            scales.append(b.constant(f"{node.name}/{role}_scale", np.array([scale], np.float32), TensorProto.FLOAT))
            entries.append({"role": role, "tensor": t.input[idx], "amax": c.amax, "scale": scale, "source": calibration_source(c)})
        bias = node.input[3] if len(node.input) > 3 and node.input[3] else \
            b.constant(f"{node.name}/bias", np.zeros((), np.float32), dtype)
        del node.input[:]
        node.input.extend([*quantized, bias, *scales])
        for a in list(node.attribute):
            if a.name == "output_dtype":
                node.attribute.remove(a)
        node.attribute.append(helper.make_attribute("output_dtype", OUTPUT_DTYPE[types.get(node.output[0], dtype)]))
        placed.append(Fp8FlashAttention(node.name, entries))
    insert_nodes(out, b)
    add_functions(out)  # each node's variant (fp8_to_<dtype>) re-embedded
    return placed


def _v_transposed(b, v: str, dtype: int, before: str) -> str:
    """``Pad(Transpose(v, 0 1 3 2), key axis to a multiple of 16)``: v as [B, Hkv, D, Skv]."""
    vt = b.unique(f"{v}/transposed")
    b.add_node(before, helper.make_node("Transpose", [v], [vt], perm=[0, 1, 3, 2], name=b.unique(f"{v}/Transpose")), dtype)
    sk, neg, pad, pads, out = (b.unique(f"{v}/{s}") for s in ("keys", "neg_keys", "key_pad", "pads", "transposed_padded"))
    align, zeros = _int64(b, f"{v}/key_align", [V_KEY_ALIGN]), _int64(b, f"{v}/pads_head", [0] * 7)
    b.add_node(before, helper.make_node("Shape", [v], [sk], start=2, end=3, name=b.unique(f"{v}/Shape")), TensorProto.INT64)
    b.add_node(before, helper.make_node("Neg", [sk], [neg], name=b.unique(f"{v}/Neg")), TensorProto.INT64)
    b.add_node(before, helper.make_node("Mod", [neg, align], [pad], name=b.unique(f"{v}/Mod")), TensorProto.INT64)
    # pads for all four axes (no ``axes`` input: onnxruntime's transpose optimizer permutes a Pad's
    # pads as if they covered every axis, and fails on the short form)
    b.add_node(before, helper.make_node("Concat", [zeros, pad], [pads], axis=0, name=b.unique(f"{v}/Concat")), TensorProto.INT64)
    b.add_node(before, helper.make_node("Pad", [vt, pads], [out], name=b.unique(f"{v}/Pad")), dtype)
    return out


def _int64(b, base: str, values: list[int]) -> str:
    """A new int64 vector initializer holding `values`."""
    name = b.unique(base)
    b.inits.append(numpy_helper.from_array(np.array(values, np.int64), name))
    return name


def _check_io(model: onnx.ModelProto, names: set[str]) -> None:
    """The FP8 contract of each placed node: q, k, v float8e4m3fn, the scales float32."""
    from .fp16 import _tensor_types

    types = _tensor_types(model)
    bad = []
    for n in model.graph.node:
        if n.name not in names:
            continue
        if any(types.get(i) != TensorProto.FLOAT8E4M3FN for i in n.input[:3]):
            bad.append(f"{n.name}: q, k, v not all float8e4m3fn")
        if any(types.get(i) != TensorProto.FLOAT for i in n.input[4:7]):
            bad.append(f"{n.name}: q_scale, k_scale, v_scale not all float32")
    if bad:
        raise InputError("precision fp8 left FlashAttention nodes breaking their FP8 contract:\n  " + "\n  ".join(bad))
