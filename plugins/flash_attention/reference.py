"""Reference semantics of FlashAttention and BlockSparseAttention: NumPy (float64) and ONNX functions.

    s = cap(scale * q @ k^T) + bias       per (b, h), kv head h // (H / Hkv); cap(x) = c * tanh(x / c), c > 0
    s[i, j] = -inf  where d = j - i - (Sk - Sq) is hidden: causal and d > 0, window_left >= 0 and
                    d < -window_left, window_right >= 0 and d > window_right (FlashAttention), or
                    the key block j // bs is not listed for query block i // bs (BlockSparseAttention)
    o = softmax(s) @ v                    a row whose every score is -inf gives o = 0

A finite very negative bias (HF masks use finfo(dtype).min) is added as a number, as in the unfused
graph: a row masked everywhere with finfo(float32).min gives the uniform average of v, because the
scores are absorbed by the bias.

ONNX function and the optional bias
-----------------------------------
onnxruntime does not cope with a missing optional input inside a function body: the inliner turns
it into "", which ops with a required slot reject, and ops with an optional slot (Sum,
LayerNormalization) crash on (onnxruntime 1.32; ``Optional("")`` fails type inference, ``If``
branches that name the input are rejected). ONNX function overloads would work but
onnx-graphsurgeon drops the node's ``overload`` field. So the function takes ``bias`` as a
**required** input, and the rewrite stage must always give the fused node four inputs: where the
matched subgraph has no additive mask it passes a scalar (rank-0) zero of q's dtype. The kernel
treats an all-broadcast (scalar) bias as a constant shift, which softmax ignores: it only checks it
once for -inf / NaN (see launch.py), so the dummy input costs nothing on the GPU.
The NumPy reference accepts ``bias=None`` as well.

FP8 and the output dtype: function variants
-------------------------------------------
Neither o's dtype nor the FP8 dequantization can be picked inside one body, so FlashAttention has
one function per variant, told apart by the ONNX function ``overload`` (IR >= 10), named by
:func:`function_overload` from a node's inputs and ``output_dtype``:

    ""                 q, k, v and o one dtype (v2's function)
    "to_<dtype>"       q, k, v one float dtype, o ``<dtype>`` (a Cast at the end)
    "fp8_to_<dtype>"   FP8 q, k, v: ``DequantizeLinear`` with the per-tensor scales, v transposed back
                       from [B, Hkv, D, Skv] and cut to Sk keys, FP32 math, o ``<dtype>``;
                       default-domain opset >= 19 (FP8 types). onnxruntime has no FP8 MatMul, so it
                       runs the node as fake-quant: the FP8 values, dequantized, in float32.

The NumPy reference dequantizes the same way (in float64); the kernel's rounding of the
probabilities to E4M3 for P @ V is a kernel error, not part of the contract. The FP8 pieces
(rounding, dequantization, the DequantizeLinear nodes) are in reference_fp8.py.

Past 500 lines: both ops' NumPy references and ONNX function bodies (scores, windows, layouts,
softmax, the variants) share the node helpers here.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from optfuse.functions import plugin_function
from optfuse.spec import FP8_DTYPES, LIKE_INPUT, plugin_spec

from .reference_fp8 import (FP8_MIN_OPSET, FP8_V_ALIGN, SCALES, dequantize_fp8, fp8_dequantize_nodes,  # noqa: F401
                            fp8_v_keys, is_fp8, quantize_fp8)

SPEC = plugin_spec(__file__, "FlashAttention")
OP = SPEC.op
#: What the fused node carries for an absent optional input (the function needs every input, see
#: above): a scalar of q's dtype with this value.
ABSENT_INPUTS = {"bias": 0.0}
# The body uses ops whose semantics are the same from opset 15 on (CastLike: 15, Trilu: 14, Shape
# start/end: 15); it runs under the model's own default-domain opset.
FUNCTION_OPSET = 17
OUTPUT_DTYPES = SPEC.attr("output_dtype").choices
def _attrs(op, attrs: dict) -> tuple[float, bool, int, int]:
    scale = float(attrs["scale"])
    causal = bool(int(attrs.get("causal", SPEC.attr("causal").default)))
    return scale, causal, int(attrs["num_heads"]), int(attrs["num_kv_heads"])


def _int_attr(attrs: dict, name: str, spec=None) -> int:
    spec = spec or SPEC
    return int(attrs.get(name, spec.attr(name).default))


def sample_inputs(op, rng: np.random.Generator, dtype: str = "float32") -> tuple[list[np.ndarray], dict]:
    """Random inputs in spec order (q, k, v and a full [B, H, Sq, Sk] bias; grouped-query heads,
    Sk != Sq; FlashAttention's FP8 scales absent; BlockSparseAttention: a per-head layout of the
    spec's default block size over 3 x 4 blocks, the last ones partial) and the attributes without a
    default: what the contract test runs through the ONNX function and this reference.
    ``dtype="float8e4m3fn"`` (FlashAttention): q, k, v rounded to E4M3 from scaled random values, v
    transposed to [B, Hkv, D, Skv] with padding keys past Sk, float32 scales, ``output_dtype``
    float32."""
    sparse = _op_name(op) == BLOCK_SPARSE
    block = BLOCK_SPARSE_SPEC.attr("block_size").default
    B, H, Hkv, Sq, Sk, D = 2, 4, 2, 5, 7, SPEC.limits["head_dims"][0]
    if sparse:
        Sq, Sk = 2 * block + 5, 3 * block + 7
    q = rng.standard_normal((B, H, Sq, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, Hkv, Sk, D)).astype(np.float32) for _ in range(2))
    bias = rng.standard_normal((B, H, Sq, Sk)).astype(np.float32)
    attrs = {"scale": D ** -0.5, "num_heads": H, "num_kv_heads": Hkv}
    if sparse:
        offsets, indices = random_layout(rng, H, Sq, Sk, block, density=0.6)
        return [q, k, v, bias, offsets, indices], attrs
    if dtype in FP8_DTYPES:
        scales = [np.float32(0.02 + 0.05 * rng.random()) for _ in SCALES]
        q8, k8 = (quantize_fp8(x, s) for x, s in zip((q, k), scales))
        vt = np.zeros((B, Hkv, D, fp8_v_keys(Sk)), np.float32) + 3.0  # padding keys: never read
        vt[..., :Sk] = v.transpose(0, 1, 3, 2)
        v8 = quantize_fp8(vt, scales[2])
        return [q8, k8, v8, bias, *(np.array(s, np.float32) for s in scales)], {**attrs, "output_dtype": "float32"}
    if dtype != "float32":
        raise ValueError(f"FlashAttention sample_inputs: no {dtype} case")
    return [q, k, v, bias, None, None, None], attrs


def _out_np_dtype(q, attrs: dict):
    """o's NumPy dtype: ``output_dtype`` (like_input: q's; an FP8 q needs a dtype)."""
    out = attrs.get("output_dtype", LIKE_INPUT)
    out = out.decode() if isinstance(out, bytes) else str(out)
    if out not in OUTPUT_DTYPES:
        raise ValueError(f"FlashAttention: output_dtype {out!r} not in {OUTPUT_DTYPES}")
    if out == LIKE_INPUT:
        if is_fp8(q):
            raise ValueError(f"FlashAttention: an FP8 q needs output_dtype, not {LIKE_INPUT}")
        return q.dtype
    if out == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(out)


BLOCK_SPARSE = "BlockSparseAttention"
BLOCK_SPARSE_SPEC = plugin_spec(__file__, BLOCK_SPARSE)


def _op_name(op) -> str:
    return getattr(op, "op", op) if op is not None else OP


def random_layout(rng: np.random.Generator, heads: int, sq: int, sk: int, block: int, density: float,
                  empty_rows: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """A random BSR layout (block_offsets [heads, Mb + 1], block_indices [heads, nnz], int32) with
    about ``density`` of the key blocks visible per query block; with ``empty_rows`` some query
    blocks may see none. Heads are padded to one nnz with trailing zeros past their offsets."""
    mb, nb = -(-sq // block), -(-sk // block)
    rows = []
    for _ in range(heads):
        lists = []
        for _ in range(mb):
            keep = np.flatnonzero(rng.random(nb) < density)
            if not empty_rows and keep.size == 0:
                keep = np.array([rng.integers(nb)])
            lists.append(keep)
        rows.append(lists)
    nnz = max(1, max(sum(len(x) for x in lists) for lists in rows))
    offsets = np.zeros((heads, mb + 1), np.int32)
    indices = np.zeros((heads, nnz), np.int32)
    for h, lists in enumerate(rows):
        offsets[h, 1:] = np.cumsum([len(x) for x in lists])
        flat = np.concatenate(lists) if lists else np.zeros(0, np.int64)
        indices[h, :flat.size] = flat
    return offsets, indices


def layout_mask(offsets: np.ndarray, indices: np.ndarray, sq: int, sk: int, block: int) -> np.ndarray:
    """The [Hl, Sq, Sk] boolean visibility a BSR layout gives (True: the key's block is listed)."""
    hl, mb = offsets.shape[0], offsets.shape[1] - 1
    nb = -(-sk // block)
    if mb != -(-sq // block):
        raise ValueError(f"block_offsets has {mb} query blocks, Sq = {sq} needs {-(-sq // block)}")
    blocks = np.zeros((hl, mb, nb), bool)
    for h in range(hl):
        for m in range(mb):
            idx = indices[h, offsets[h, m]:offsets[h, m + 1]]
            if idx.size and (idx.min() < 0 or idx.max() >= nb or np.any(np.diff(idx) <= 0)):
                raise ValueError(f"block_indices of head {h}, query block {m} are not strictly ascending in [0, {nb})")
            blocks[h, m, idx] = True
    full = np.repeat(np.repeat(blocks, block, axis=1), block, axis=2)
    return full[:, :sq, :sk]


def visible(sq: int, sk: int, causal: bool, window_left: int = -1, window_right: int = -1) -> np.ndarray:
    """[Sq, Sk] boolean: which keys each query may see (off = Sk - Sq; see spec.yaml)."""
    i = np.arange(sq)[:, None] + (sk - sq)
    j = np.arange(sk)[None, :]
    ok = np.ones((sq, sk), bool)
    if causal:
        ok &= j <= i
    if window_left >= 0:
        ok &= j >= i - window_left
    if window_right >= 0:
        ok &= j <= i + window_right
    return ok


def reference(op, inputs: list, attrs: dict) -> list[np.ndarray]:
    """NumPy FlashAttention / BlockSparseAttention in float64; returns [o].

    ``op``: the op name or OpSpec (None: FlashAttention). ``inputs`` = [q, k, v, bias or None]
    (FlashAttention: + q_scale, k_scale, v_scale, with FP8 q, k, v; BlockSparseAttention: +
    block_offsets, block_indices); o in ``output_dtype`` (like_input: q's). FP8 inputs are
    dequantized (:func:`dequantize_fp8`) and the rest is the same float64 math.
    """
    q, k, v = inputs[0], inputs[1], inputs[2]
    bias = inputs[3] if len(inputs) > 3 else None
    sparse = _op_name(op) == BLOCK_SPARSE
    spec = BLOCK_SPARSE_SPEC if sparse else SPEC
    scales = [None] * 3 if sparse else (list(inputs[4:7]) + [None] * 3)[:3]
    out_dtype = q.dtype if sparse else _out_np_dtype(q, attrs)
    if is_fp8(q):
        q, k, v = dequantize_fp8(q, k, v, scales)
    elif any(s is not None for s in scales) or is_fp8(k) or is_fp8(v):
        raise ValueError(f"FlashAttention: {', '.join(SCALES)} and FP8 k, v come only with an FP8 q")
    scale, causal, h, hkv = _attrs(op, attrs)
    softcap = float(attrs.get("softcap", spec.attr("softcap").default))
    wl = -1 if sparse else _int_attr(attrs, "window_left")
    wr = -1 if sparse else _int_attr(attrs, "window_right")
    B, H, Sq, D = q.shape
    Bk, Hkv, Sk, Dk = k.shape
    if H != h or Hkv != hkv or H % Hkv or Dk != D or v.shape != k.shape or Bk != B:
        raise ValueError(f"bad shapes q{q.shape} k{k.shape} v{v.shape} for num_heads={h}, "
                         f"num_kv_heads={hkv}")
    g = H // Hkv
    qf = q.astype(np.float64)
    kf = np.repeat(k.astype(np.float64), g, axis=1)  # query head i reads kv head i // g
    vf = np.repeat(v.astype(np.float64), g, axis=1)
    s = scale * (qf @ kf.transpose(0, 1, 3, 2))
    if softcap > 0:
        s = softcap * np.tanh(s / softcap)
    if bias is not None:
        s = s + np.broadcast_to(bias.astype(np.float64), s.shape)
    ok = np.broadcast_to(visible(Sq, Sk, causal, wl, wr), s.shape)
    if sparse:
        block = _int_attr(attrs, "block_size", spec)
        lay = layout_mask(np.asarray(inputs[4]), np.asarray(inputs[5]), Sq, Sk, block)
        if lay.shape[0] not in (1, H):
            raise ValueError(f"block layout has {lay.shape[0]} heads, not 1 or {H}")
        ok = ok & lay[None]
    s = np.where(ok, s, -np.inf)
    m = s.max(axis=-1, keepdims=True) if Sk else np.full(s.shape[:-1] + (1,), -np.inf)
    dead = ~np.isfinite(m) & (m < 0)  # every score -inf (or Sk == 0)
    m = np.where(dead, 0.0, m)
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.exp(s - m)
        l = p.sum(axis=-1, keepdims=True)
        o = (p @ vf) / np.where(dead, 1.0, l)
    o = np.where(dead, 0.0, o)
    return [o.astype(out_dtype)]


def _attr_ref(name: str, ref: str, kind: int) -> onnx.AttributeProto:
    a = onnx.AttributeProto()
    a.name, a.type, a.ref_attr_name = name, kind, ref
    return a


def _const_from_attr(out: str, value_field: str, attr: str, kind: int) -> onnx.NodeProto:
    """Constant whose value is the function's attribute ``attr``."""
    n = helper.make_node("Constant", [], [out])
    n.attribute.append(_attr_ref(value_field, attr, kind))
    return n


def _i64(name: str, vals: list[int]) -> onnx.TensorProto:
    return helper.make_tensor(name, TensorProto.INT64, [len(vals)], vals)


def _scalar(name: str, kind: int, value) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, kind, [], [value]))


def _scores_nodes() -> list[onnx.NodeProto]:
    """q, k, v, bias -> ``s1`` = cap(scale * q @ k^T) + bias over the repeated kv heads (``vr``), and
    the shapes ``sq_1``, ``sk_1`` (int64 [1]). cap is chosen from the softcap attribute with Where,
    dividing by 1 where softcap <= 0 (so no 0 / 0 is ever computed)."""
    mk = helper.make_node
    return [
        _const_from_attr("scale_f", "value_float", "scale", onnx.AttributeProto.FLOAT),
        _const_from_attr("softcap_f", "value_float", "softcap", onnx.AttributeProto.FLOAT),
        _const_from_attr("h_s", "value_int", "num_heads", onnx.AttributeProto.INT),
        _const_from_attr("hkv_s", "value_int", "num_kv_heads", onnx.AttributeProto.INT),
        mk("Constant", [], ["axis2"], value=_i64("axis2", [2])),
        mk("Constant", [], ["neg1"], value=_i64("neg1", [-1])),
        _scalar("zero_f", TensorProto.FLOAT, 0.0),
        _scalar("one_f0", TensorProto.FLOAT, 1.0),
        # -- shapes ---------------------------------------------------------------------------------
        mk("Shape", ["q"], ["b_1"], start=0, end=1),
        mk("Shape", ["q"], ["sq_1"], start=2, end=3),
        mk("Shape", ["k"], ["hkv_1"], start=1, end=2),
        mk("Shape", ["k"], ["skd_2"], start=2, end=4),
        mk("Shape", ["k"], ["sk_1"], start=2, end=3),
        # -- GQA: k, v [B, Hkv, Sk, D] -> [B, Hkv, G, Sk, D] -> [B, H, Sk, D] ------------------------
        mk("Div", ["h_s", "hkv_s"], ["g_s"]),
        mk("Unsqueeze", ["g_s", "neg1"], ["g_1"]),
        mk("Unsqueeze", ["h_s", "neg1"], ["h_1"]),
        mk("Concat", ["b_1", "hkv_1", "g_1", "skd_2"], ["exp_shape"], axis=0),
        mk("Concat", ["b_1", "h_1", "skd_2"], ["rep_shape"], axis=0),
        mk("Unsqueeze", ["k", "axis2"], ["k5"]),
        mk("Expand", ["k5", "exp_shape"], ["k5e"]),
        mk("Reshape", ["k5e", "rep_shape"], ["kr"]),
        mk("Unsqueeze", ["v", "axis2"], ["v5"]),
        mk("Expand", ["v5", "exp_shape"], ["v5e"]),
        mk("Reshape", ["v5e", "rep_shape"], ["vr"]),
        # -- s0 = scale * q @ k^T; capped = c * tanh(s0 / c) when c > 0 ------------------------------
        mk("Transpose", ["kr"], ["kt"], perm=[0, 1, 3, 2]),
        mk("MatMul", ["q", "kt"], ["qk"]),
        mk("CastLike", ["scale_f", "q"], ["scale_t"]),
        mk("Mul", ["qk", "scale_t"], ["s0"]),
        mk("Greater", ["softcap_f", "zero_f"], ["capped"]),
        mk("Where", ["capped", "softcap_f", "one_f0"], ["cap_div_f"]),
        mk("CastLike", ["cap_div_f", "q"], ["cap_div"]),
        mk("Div", ["s0", "cap_div"], ["s0_div"]),
        mk("Tanh", ["s0_div"], ["s0_tanh"]),
        mk("Mul", ["s0_tanh", "cap_div"], ["s0_cap"]),
        mk("Where", ["capped", "s0_cap", "s0"], ["s0c"]),
        mk("CastLike", ["bias", "q"], ["bias_t"]),
        mk("Add", ["s0c", "bias_t"], ["s1"]),
    ]


def _diagonal_offset_nodes() -> list[onnx.NodeProto]:
    """``d`` [Sq, Sk] = j - i - (Sk - Sq), from ``sq_1`` / ``sk_1`` (1-element shapes), ``zero_i``
    / ``one_i`` and ``neg1``: what the window and the layout masks compare."""
    mk = helper.make_node
    return [
        mk("Squeeze", ["sq_1"], ["sq_s"]),
        mk("Squeeze", ["sk_1"], ["sk_s"]),
        mk("Range", ["zero_i", "sq_s", "one_i"], ["i_r"]),
        mk("Range", ["zero_i", "sk_s", "one_i"], ["j_r"]),
        mk("Sub", ["sk_s", "sq_s"], ["off_s"]),
        mk("Add", ["i_r", "off_s"], ["i_off"]),
        mk("Unsqueeze", ["i_off", "neg1"], ["i_col"]),
        mk("Sub", ["j_r", "i_col"], ["d"]),
    ]


def _window_nodes() -> list[onnx.NodeProto]:
    """``allowed`` [Sq, Sk] bool from the shapes: d = j - i - (Sk - Sq); causal: d <= 0;
    window_left >= 0: d >= -window_left; window_right >= 0: d <= window_right."""
    mk = helper.make_node
    big = 1 << 62
    return [
        _const_from_attr("causal_s", "value_int", "causal", onnx.AttributeProto.INT),
        _const_from_attr("wl_s", "value_int", "window_left", onnx.AttributeProto.INT),
        _const_from_attr("wr_s", "value_int", "window_right", onnx.AttributeProto.INT),
        _scalar("zero_i", TensorProto.INT64, 0),
        _scalar("one_i", TensorProto.INT64, 1),
        _scalar("big_i", TensorProto.INT64, big),
        _scalar("nbig_i", TensorProto.INT64, -big),
        *_diagonal_offset_nodes(),  # d [Sq, Sk]
        # hi = min(window_right or +big, 0 if causal else +big); lo = -window_left or -big
        mk("GreaterOrEqual", ["wr_s", "zero_i"], ["has_wr"]),
        mk("Where", ["has_wr", "wr_s", "big_i"], ["wr_hi"]),
        mk("Greater", ["causal_s", "zero_i"], ["is_causal"]),
        mk("Where", ["is_causal", "zero_i", "big_i"], ["causal_hi"]),
        mk("Min", ["wr_hi", "causal_hi"], ["hi"]),
        mk("GreaterOrEqual", ["wl_s", "zero_i"], ["has_wl"]),
        mk("Neg", ["wl_s"], ["neg_wl"]),
        mk("Where", ["has_wl", "neg_wl", "nbig_i"], ["lo"]),
        mk("LessOrEqual", ["d", "hi"], ["below_hi"]),
        mk("GreaterOrEqual", ["d", "lo"], ["above_lo"]),
        mk("And", ["below_hi", "above_lo"], ["allowed"]),
    ]


def _layout_nodes() -> list[onnx.NodeProto]:
    """``allowed`` [1, Hl, Sq, Sk] bool from the causal flag and the BSR layout: position p of head
    h's indices belongs to query block m(p) = #{m : offsets[h, m + 1] <= p}; positions with m(p) =
    Mb (past offsets[h, -1]) are padding and match no block. blocks[h, m, n] = any p with m(p) = m
    and indices[h, p] = n (a one-hot product), then gathered at (i // bs, j // bs)."""
    mk = helper.make_node
    return [
        _const_from_attr("causal_s", "value_int", "causal", onnx.AttributeProto.INT),
        _const_from_attr("bs_s", "value_int", "block_size", onnx.AttributeProto.INT),
        _scalar("zero_i", TensorProto.INT64, 0),
        _scalar("one_i", TensorProto.INT64, 1),
        _scalar("half_f", TensorProto.FLOAT, 0.5),
        mk("Constant", [], ["one_1"], value=_i64("one_1", [1])),
        mk("Constant", [], ["big_1"], value=_i64("big_1", [1 << 62])),
        *_diagonal_offset_nodes(),  # d; causal part: d <= 0, or everything when causal = 0
        mk("Greater", ["causal_s", "zero_i"], ["is_causal"]),
        mk("LessOrEqual", ["d", "zero_i"], ["d_causal"]),
        mk("Not", ["is_causal"], ["not_causal"]),
        mk("Or", ["d_causal", "not_causal"], ["causal_ok"]),
        # the block of each position of block_indices
        mk("Cast", ["block_offsets"], ["offs"], to=TensorProto.INT64),
        mk("Cast", ["block_indices"], ["idx"], to=TensorProto.INT64),
        mk("Shape", ["block_offsets"], ["mb1_1"], start=1, end=2),
        mk("Sub", ["mb1_1", "one_1"], ["mb_1"]),
        mk("Squeeze", ["mb_1"], ["mb_s"]),
        mk("Slice", ["offs", "one_1", "big_1", "one_1"], ["offs_hi"]),  # [Hl, Mb]
        mk("Shape", ["block_indices"], ["nnz_1"], start=1, end=2),
        mk("Squeeze", ["nnz_1"], ["nnz_s"]),
        mk("Range", ["zero_i", "nnz_s", "one_i"], ["p_r"]),
        mk("Unsqueeze", ["p_r", "neg1"], ["p_col"]),  # [nnz, 1]
        mk("Unsqueeze", ["offs_hi", "one_1"], ["offs_hi3"]),  # [Hl, 1, Mb]
        mk("LessOrEqual", ["offs_hi3", "p_col"], ["before_p"]),  # [Hl, nnz, Mb]
        mk("Cast", ["before_p"], ["before_i"], to=TensorProto.INT64),
        mk("ReduceSum", ["before_i", "neg1"], ["row_of_p"], keepdims=1),  # [Hl, nnz, 1]
        mk("Range", ["zero_i", "mb_s", "one_i"], ["m_r"]),
        mk("Equal", ["row_of_p", "m_r"], ["p_in_m"]),  # [Hl, nnz, Mb]
        mk("Sub", ["sk_s", "one_i"], ["sk_m1"]),
        mk("Add", ["sk_m1", "bs_s"], ["sk_up"]),
        mk("Div", ["sk_up", "bs_s"], ["nb_s"]),
        mk("Range", ["zero_i", "nb_s", "one_i"], ["n_r"]),
        mk("Unsqueeze", ["idx", "neg1"], ["idx3"]),  # [Hl, nnz, 1]
        mk("Equal", ["idx3", "n_r"], ["p_is_n"]),  # [Hl, nnz, Nb]
        mk("Cast", ["p_in_m"], ["p_in_m_f"], to=TensorProto.FLOAT),
        mk("Cast", ["p_is_n"], ["p_is_n_f"], to=TensorProto.FLOAT),
        mk("Transpose", ["p_in_m_f"], ["m_of_p"], perm=[0, 2, 1]),
        mk("MatMul", ["m_of_p", "p_is_n_f"], ["hits"]),  # [Hl, Mb, Nb]
        mk("Greater", ["hits", "half_f"], ["blocks"]),
        mk("Div", ["i_r", "bs_s"], ["i_blk"]),
        mk("Div", ["j_r", "bs_s"], ["j_blk"]),
        mk("Gather", ["blocks", "i_blk"], ["rows_blk"], axis=1),  # [Hl, Sq, Nb]
        mk("Gather", ["rows_blk", "j_blk"], ["lay"], axis=2),  # [Hl, Sq, Sk]
        mk("Unsqueeze", ["lay", "zero_1"], ["lay4"]),
        mk("And", ["lay4", "causal_ok"], ["allowed"]),
    ]


def _softmax_nodes() -> list[onnx.NodeProto]:
    """s1 masked by ``allowed`` -> softmax -> o; rows whose every score is -inf give 0."""
    mk = helper.make_node
    return [
        mk("Constant", [], ["one_i_1"], value=_i64("one_i_1", [1])),
        mk("Constant", [], ["ninf_f"],
           value=helper.make_tensor("ninf_f", TensorProto.FLOAT, [], [float("-inf")])),
        mk("Constant", [], ["one_f"], value=helper.make_tensor("one_f", TensorProto.FLOAT, [1], [1.0])),
        mk("CastLike", ["ninf_f", "q"], ["ninf_t"]),
        mk("Where", ["allowed", "s1", "ninf_t"], ["s"]),
        mk("Softmax", ["s"], ["p0"], axis=-1),
        # IsInf has no fp16/bf16 kernel before opset 20: test in float32
        mk("Cast", ["s"], ["s_f32"], to=TensorProto.FLOAT),
        mk("IsInf", ["s_f32"], ["s_inf"], detect_positive=0),
        mk("Not", ["s_inf"], ["s_live"]),
        mk("CastLike", ["s_live", "q"], ["live_t"]),
        mk("CastLike", ["one_f", "q"], ["one_t"]),
        mk("Concat", ["sk_1", "one_i_1"], ["col_shape"], axis=0),
        mk("Expand", ["one_t", "col_shape"], ["ones_col"]),
        mk("MatMul", ["live_t", "ones_col"], ["n_live"]),
        mk("CastLike", ["zero_f", "q"], ["zero_t"]),
        mk("Greater", ["n_live", "zero_t"], ["row_live"]),
        mk("Where", ["row_live", "p0", "zero_t"], ["p"]),
        mk("MatMul", ["p", "vr"], ["o"]),
    ]


def function_overload(op, inputs, attrs: dict | None = None) -> str:
    """The function variant (ONNX ``overload``) of a node: ``inputs`` are its input names in spec
    order ("" or missing: absent), ``attrs`` its attributes (``output_dtype``). FP8 is told by the
    presence of ``q_scale``; an FP8 node with ``output_dtype`` like_input is a ValueError.
    BlockSparseAttention has one function ("")."""
    name = _op_name(op)
    if name == BLOCK_SPARSE:
        return ""
    if name != OP:
        raise ValueError(f"flash_attention plugin has no op {name!r}")
    out = (attrs or {}).get("output_dtype", SPEC.attr("output_dtype").default)
    out = out.decode() if isinstance(out, bytes) else str(out)
    if out not in OUTPUT_DTYPES:
        raise ValueError(f"{OP}: output_dtype {out!r} not in {OUTPUT_DTYPES}")
    i = SPEC.input_index("q_scale")
    if i < len(inputs) and bool(inputs[i]):
        if out == LIKE_INPUT:
            raise ValueError(f"{OP}: an FP8 node (q_scale present) needs output_dtype, not {LIKE_INPUT}")
        return f"fp8_to_{out}"
    return "" if out == LIKE_INPUT else f"to_{out}"


def function_overloads(op) -> tuple[str, ...]:
    """Every variant :func:`function_overload` names for ``op``."""
    if _op_name(op) == BLOCK_SPARSE:
        return ("",)
    dts = [d for d in OUTPUT_DTYPES if d != LIKE_INPUT]
    return ("", *(f"to_{d}" for d in dts), *(f"fp8_to_{d}" for d in dts))


def _rename_inputs(nodes: list[onnx.NodeProto], names: dict[str, str]) -> list[onnx.NodeProto]:
    """``nodes`` reading ``names[x]`` wherever they read x (the body over dequantized q, k, v)."""
    for n in nodes:
        for j, x in enumerate(n.input):
            if x in names:
                n.input[j] = names[x]
    return nodes


def _onnx_type(name: str) -> int:
    return {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}[name]


def onnx_function(op=None, opset: int = FUNCTION_OPSET, overload: str = "") -> onnx.FunctionProto:
    """``optfuse::FlashAttention(q, k, v, bias, q_scale, k_scale, v_scale) -> o`` or
    ``optfuse::BlockSparseAttention(q, k, v, bias, block_offsets, block_indices) -> o`` as an ONNX
    function onnxruntime can run; ``overload`` is the FlashAttention variant
    (:func:`function_overload`: "", ``to_<dtype>``, ``fp8_to_<dtype>``).

    ``opset`` is the default-domain opset the body imports; onnx.checker wants it equal to the
    model's (>= 15; an ``fp8_to_*`` variant needs >= 19, ``FP8_MIN_OPSET``), so the rewrite stage
    passes the model's opset.

    bias is required here (see the module docstring); it broadcasts to [B, H, Sq, Sk] and may be
    a scalar zero. GQA repeats kv heads with Unsqueeze/Expand/Reshape; softcap is applied with
    Where on the attribute (Div by 1 when it is 0); the causal / window visibility is built from the
    shapes (Range over i and j, offset Sk - Sq), so any sequence length works; BlockSparseAttention
    expands its layout into the [Hl, Sq, Sk] visibility (see `_layout_nodes`). Rows whose every
    score is -inf are set to 0 after Softmax (which would give NaN). The FP8 variant runs the same
    body on the dequantized float32 q, k, v (``fp8_dequantize_nodes``); ``to_*`` variants cast o.
    The scales are unused inputs of the other variants (absent on their nodes).
    """
    sparse = _op_name(op) == BLOCK_SPARSE
    spec = BLOCK_SPARSE_SPEC if sparse else SPEC
    if overload not in function_overloads(op):
        raise ValueError(f"{spec.op}: no function overload {overload!r} (have {function_overloads(op)})")
    fp8 = overload.startswith("fp8_")
    if fp8 and opset < FP8_MIN_OPSET:
        raise ValueError(f"{spec.op}: an FP8 node needs default-domain opset >= {FP8_MIN_OPSET} (float8e4m3fn "
                         f"DequantizeLinear); the model has opset {opset}")
    nodes = _scores_nodes()
    if sparse:
        nodes.append(helper.make_node("Constant", [], ["zero_1"], value=_i64("zero_1", [0])))
    nodes += _layout_nodes() if sparse else _window_nodes()
    nodes += _softmax_nodes()
    if fp8:
        nodes = fp8_dequantize_nodes() + _rename_inputs(nodes, {"q": "q_dq", "k": "k_dq", "v": "v_dq"})
    if overload:
        nodes[-1].output[0] = "o_body"  # the last node (p @ v) writes o
        nodes.append(helper.make_node("Cast", ["o_body"], ["o"], to=_onnx_type(overload.split("to_")[-1])))
    doc = ("softmax(cap(scale * q @ k^T) + bias [+ causal mask]) @ v over the key blocks the BSR layout lists"
           if sparse else "softmax(cap(scale * q @ k^T) + bias [+ causal / window mask]) @ v")
    if fp8:
        doc += " on q * q_scale, k * k_scale, v^T[..., :Sk] * v_scale (FP8 dequantized, float32)"
    fn = plugin_function(spec, nodes, opset,
                         doc=doc + "; GQA by repeating kv heads; bias is required (a scalar 0 when the fused "
                                   "graph has none).")
    if overload:
        fn.overload = overload
    return fn
