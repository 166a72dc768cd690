"""Reference semantics of FlashAttention: a NumPy function (float64) and an ONNX function.

    s = scale * q @ k^T + bias            per (b, h), kv head h // (H / Hkv)
    s[i, j] = -inf  where causal and j > i + (Sk - Sq)
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
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from optfuse.functions import plugin_function
from optfuse.spec import plugin_spec

SPEC = plugin_spec(__file__, "FlashAttention")
OP = SPEC.op
#: What the fused node carries for an absent optional input (the function needs every input, see
#: above): a scalar of q's dtype with this value.
ABSENT_INPUTS = {"bias": 0.0}
# The body uses ops whose semantics are the same from opset 15 on (CastLike: 15, Trilu: 14, Shape
# start/end: 15); it runs under the model's own default-domain opset.
FUNCTION_OPSET = 17


def _attrs(op, attrs: dict) -> tuple[float, bool, int, int]:
    scale = float(attrs["scale"])
    causal = bool(int(attrs.get("causal", SPEC.attr("causal").default)))
    return scale, causal, int(attrs["num_heads"]), int(attrs["num_kv_heads"])


def _int_attr(attrs: dict, name: str, spec=None) -> int:
    spec = spec or SPEC
    return int(attrs.get(name, spec.attr(name).default))


def sample_inputs(op, rng: np.random.Generator) -> tuple[list[np.ndarray], dict]:
    """Random float32 inputs in spec order (q, k, v and a full [B, H, Sq, Sk] bias; grouped-query
    heads, Sk != Sq; BlockSparseAttention: a per-head layout of 4-key blocks) and the attributes
    without a default: what the contract test runs through the ONNX function and this reference."""
    B, H, Hkv, Sq, Sk, D = 2, 4, 2, 5, 7, SPEC.limits["head_dims"][0]
    q = rng.standard_normal((B, H, Sq, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, Hkv, Sk, D)).astype(np.float32) for _ in range(2))
    bias = rng.standard_normal((B, H, Sq, Sk)).astype(np.float32)
    attrs = {"scale": D ** -0.5, "num_heads": H, "num_kv_heads": Hkv}
    if _op_name(op) == BLOCK_SPARSE:
        offsets, indices = random_layout(rng, H, Sq, Sk, 4, density=0.6)
        return [q, k, v, bias, offsets, indices], {**attrs, "block_size": 4}
    return [q, k, v, bias], attrs


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
    """NumPy FlashAttention / BlockSparseAttention in float64; returns o in q's dtype.

    ``op``: the op name or OpSpec (None: FlashAttention). ``inputs`` = [q, k, v, bias or None]
    (+ block_offsets, block_indices for BlockSparseAttention).
    """
    q, k, v = inputs[0], inputs[1], inputs[2]
    bias = inputs[3] if len(inputs) > 3 else None
    sparse = _op_name(op) == BLOCK_SPARSE
    spec = BLOCK_SPARSE_SPEC if sparse else SPEC
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
    return [o.astype(q.dtype)]


def _attr_ref(name: str, ref: str, kind: int) -> onnx.AttributeProto:
    a = onnx.AttributeProto()
    a.name, a.type, a.ref_attr_name = name, kind, ref
    return a


def _const_from_attr(out: str, value_field: str, attr: str, kind: int) -> onnx.NodeProto:
    """Constant whose value is the function's attribute ``attr``."""
    n = helper.make_node("Constant", [], [out])
    n.attribute.append(_attr_ref(value_field, attr, kind))
    return n


def onnx_function(op=None, opset: int = FUNCTION_OPSET) -> onnx.FunctionProto:
    """``optfuse::FlashAttention(q, k, v, bias) -> o`` as an ONNX function onnxruntime can run.

    ``opset`` is the default-domain opset the body imports; onnx.checker wants it equal to the
    model's (>= 15), so the rewrite stage passes the model's opset.

    bias is required here (see the module docstring); it broadcasts to [B, H, Sq, Sk] and may be
    a scalar zero. GQA repeats kv heads with Unsqueeze/Expand/Reshape; the causal mask is built
    with Trilu from the shapes (diagonal offset Sk - Sq, or Sk when causal = 0, which keeps all);
    rows whose every score is -inf are set to 0 after Softmax (which would give NaN).
    """
    mk = helper.make_node
    i64 = lambda name, vals: helper.make_tensor(name, TensorProto.INT64, [len(vals)], vals)  # noqa: E731
    nodes = [
        # -- attributes as tensors ----------------------------------------------------------------
        _const_from_attr("scale_f", "value_float", "scale", onnx.AttributeProto.FLOAT),
        _const_from_attr("h_s", "value_int", "num_heads", onnx.AttributeProto.INT),
        _const_from_attr("hkv_s", "value_int", "num_kv_heads", onnx.AttributeProto.INT),
        _const_from_attr("causal_s", "value_int", "causal", onnx.AttributeProto.INT),
        mk("Constant", [], ["one_i"], value=helper.make_tensor("one_i", TensorProto.INT64, [], [1])),
        mk("Constant", [], ["one_i_1"], value=i64("one_i_1", [1])),
        mk("Constant", [], ["axis2"], value=i64("axis2", [2])),
        mk("Constant", [], ["neg1"], value=i64("neg1", [-1])),
        mk("Constant", [], ["zero_f"], value=helper.make_tensor("zero_f", TensorProto.FLOAT, [], [0.0])),
        mk("Constant", [], ["ninf_f"],
           value=helper.make_tensor("ninf_f", TensorProto.FLOAT, [], [float("-inf")])),
        mk("Constant", [], ["one_f"], value=helper.make_tensor("one_f", TensorProto.FLOAT, [1], [1.0])),
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
        # -- scores = scale * q @ k^T + bias -----------------------------------------------------------
        mk("Transpose", ["kr"], ["kt"], perm=[0, 1, 3, 2]),
        mk("MatMul", ["q", "kt"], ["qk"]),
        mk("CastLike", ["scale_f", "q"], ["scale_t"]),
        mk("Mul", ["qk", "scale_t"], ["s0"]),
        mk("CastLike", ["bias", "q"], ["bias_t"]),
        mk("Add", ["s0", "bias_t"], ["s1"]),
        # -- causal: allowed = Trilu(ones[Sq, Sk], k = Sk - Sq + (1 - causal) * Sq) ------------------
        mk("Concat", ["sq_1", "sk_1"], ["sqsk"], axis=0),
        mk("ConstantOfShape", ["sqsk"], ["ones2"],
           value=helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])),
        mk("Sub", ["sk_1", "sq_1"], ["diag0"]),
        mk("Sub", ["one_i", "causal_s"], ["not_causal"]),
        mk("Mul", ["not_causal", "sq_1"], ["diag_extra"]),
        mk("Add", ["diag0", "diag_extra"], ["diag_1"]),
        mk("Squeeze", ["diag_1"], ["diag"]),
        mk("Trilu", ["ones2", "diag"], ["allowed_f"], upper=0),
        mk("Cast", ["allowed_f"], ["allowed"], to=TensorProto.BOOL),
        mk("CastLike", ["ninf_f", "q"], ["ninf_t"]),
        mk("Where", ["allowed", "s1", "ninf_t"], ["s"]),
        # -- softmax; rows with no finite score -> 0 ---------------------------------------------------
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
    return plugin_function(SPEC, nodes, opset,
                           doc="softmax(scale * q @ k^T + bias [+ causal mask]) @ v; GQA by repeating kv "
                               "heads; bias is required (a scalar 0 when the fused graph has none).")
