"""CPU tests of the FlashAttention reference: NumPy semantics and the ONNX function in onnxruntime."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from optfuse.kernels.registry import plugin_module
from optfuse.kernels.testing import SymDim, sym_cdiv

R = plugin_module("flash_attention", "reference")
L = plugin_module("flash_attention", "launch")


def _attrs(H, Hkv, causal, scale=0.3):
    return {"scale": scale, "causal": causal, "num_heads": H, "num_kv_heads": Hkv}


def _naive(q, k, v, bias, scale, causal):
    """Row-by-row float64 loop: the definition written out, for cross-checking reference()."""
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    g = H // Hkv
    o = np.zeros((B, H, Sq, D))
    full = None if bias is None else np.broadcast_to(bias, (B, H, Sq, Sk)).astype(np.float64)
    for b in range(B):
        for h in range(H):
            for i in range(Sq):
                s = scale * (k[b, h // g].astype(np.float64) @ q[b, h, i].astype(np.float64))
                if full is not None:
                    s = s + full[b, h, i]
                if causal:
                    s[np.arange(Sk) > i + Sk - Sq] = -np.inf
                if np.all(s == -np.inf):
                    continue  # defined as 0
                p = np.exp(s - s.max())
                o[b, h, i] = p @ v[b, h // g].astype(np.float64) / p.sum()
    return o


@pytest.mark.parametrize("B,H,Hkv,Sq,Sk,D,causal,bias_shape", [
    (2, 4, 2, 5, 7, 8, 0, None),
    (2, 4, 1, 7, 5, 8, 1, (2, 1, 1, 5)),   # Sk < Sq: the first rows see no key
    (1, 6, 3, 9, 13, 16, 1, (6, 9, 13)),
    (2, 2, 2, 4, 4, 8, 0, ()),
])
def test_reference_matches_loop(B, H, Hkv, Sq, Sk, D, causal, bias_shape):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, H, Sq, D))
    k = rng.standard_normal((B, Hkv, Sk, D))
    v = rng.standard_normal((B, Hkv, Sk, D))
    bias = None if bias_shape is None else rng.standard_normal(bias_shape)
    (o,) = R.reference(None, [q, k, v, bias], _attrs(H, Hkv, causal))
    np.testing.assert_allclose(o, _naive(q, k, v, bias, 0.3, causal), rtol=1e-12, atol=1e-12)


def test_masked_rows_defined():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 2, 6, 8)).astype(np.float32)
    k = rng.standard_normal((1, 2, 5, 8)).astype(np.float32)
    v = rng.standard_normal((1, 2, 5, 8)).astype(np.float32)
    bias = rng.standard_normal((1, 2, 6, 5)).astype(np.float32)
    bias[..., 1, :] = -np.inf                        # every score -inf -> 0
    bias[..., 2, :] = np.finfo(np.float32).min       # HF mask: absorbed -> uniform average of v
    (o,) = R.reference(None, [q, k, v, bias], _attrs(2, 2, 0))
    assert o.dtype == np.float32 and np.isfinite(o).all()
    np.testing.assert_array_equal(o[..., 1, :], 0.0)
    np.testing.assert_allclose(o[..., 2, :], v.mean(axis=2), rtol=1e-6, atol=1e-6)
    # causal with Sk < Sq: row i sees keys j <= i - 1, so row 0 sees none
    (oc,) = R.reference(None, [q, k, v, None], _attrs(2, 2, 1))
    np.testing.assert_array_equal(oc[..., 0, :], 0.0)
    assert np.abs(oc[..., 1:, :]).min() >= 0 and np.isfinite(oc).all()


def test_gqa_equals_repeated_heads():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 6, 5, 8))
    k = rng.standard_normal((2, 2, 7, 8))
    v = rng.standard_normal((2, 2, 7, 8))
    (o,) = R.reference(None, [q, k, v, None], _attrs(6, 2, 1))
    (o2,) = R.reference(None, [q, np.repeat(k, 3, 1), np.repeat(v, 3, 1), None], _attrs(6, 6, 1))
    np.testing.assert_array_equal(o, o2)


def _one_node_model(B, H, Hkv, Sq, Sk, D, bias_shape, attrs, opset):
    node = helper.make_node("FlashAttention", ["q", "k", "v", "bias"], ["o"], domain="optfuse",
                            plugin_namespace="optfuse", plugin_version=R.SPEC.plugin_version, **attrs)
    f = TensorProto.FLOAT
    graph = helper.make_graph(
        [node], "fa",
        [helper.make_tensor_value_info("q", f, [B, H, Sq, D]),
         helper.make_tensor_value_info("k", f, [B, Hkv, Sk, D]),
         helper.make_tensor_value_info("v", f, [B, Hkv, Sk, D]),
         helper.make_tensor_value_info("bias", f, list(bias_shape))],
        [helper.make_tensor_value_info("o", f, [B, H, Sq, D])])
    model = helper.make_model(graph, functions=[R.onnx_function(None, opset=opset)],
                              opset_imports=[helper.make_opsetid("", opset),
                                             helper.make_opsetid("optfuse", 1)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("B,H,Hkv,Sq,Sk,D,causal,bias_shape,opset", [
    (2, 4, 2, 5, 7, 8, 0, (2, 1, 1, 7), 17),     # GQA + key padding
    (2, 4, 2, 5, 7, 8, 1, (2, 1, 1, 7), 17),     # + causal, Sk > Sq
    (2, 4, 1, 7, 5, 8, 1, (), 17),               # scalar zero bias (no mask), causal Sk < Sq
    (1, 6, 3, 9, 9, 16, 1, (1, 6, 9, 9), 21),
    (1, 2, 2, 6, 5, 8, 0, (6, 5), 18),
])
def test_onnx_function_matches_reference(B, H, Hkv, Sq, Sk, D, causal, bias_shape, opset):
    ort = pytest.importorskip("onnxruntime")
    attrs = _attrs(H, Hkv, causal)
    model = _one_node_model(B, H, Hkv, Sq, Sk, D, bias_shape, attrs, opset)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(3)
    q = rng.standard_normal((B, H, Sq, D)).astype(np.float32)
    k = rng.standard_normal((B, Hkv, Sk, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, Sk, D)).astype(np.float32)
    bias = (np.zeros(bias_shape, np.float32) if bias_shape == ()
            else rng.standard_normal(bias_shape).astype(np.float32))
    if len(bias_shape) >= 2 and bias_shape[-2] > 3:
        bias[..., 2, :] = -np.inf
        bias[..., 3, :] = np.finfo(np.float32).min
    (o,) = sess.run(None, {"q": q, "k": k, "v": v, "bias": bias})
    (ref,) = R.reference(None, [q, k, v, bias], attrs)
    assert np.isfinite(o).all()
    assert np.abs(o - ref).max() <= 1e-5


@pytest.mark.parametrize("op,inputs", [
    ("FlashAttention", ["q", "k", "v", "bias", "q_scale", "k_scale", "v_scale"]),
    ("BlockSparseAttention", ["q", "k", "v", "bias", "block_offsets", "block_indices"]),
])
def test_function_signature_follows_spec(op, inputs):
    spec = R.SPEC if op == "FlashAttention" else R.BLOCK_SPARSE_SPEC
    spec_attrs = {"scale", "causal", "num_heads", "num_kv_heads", "softcap"}
    spec_attrs |= {"window_left", "window_right", "output_dtype"} if op == "FlashAttention" else {"block_size"}
    assert {a.name for a in spec.attributes} == spec_attrs
    fn = R.onnx_function(op)
    assert (fn.domain, fn.name) == ("optfuse", op)
    names = set(fn.attribute) | {a.name for a in fn.attribute_proto}
    assert names == spec_attrs | {"plugin_namespace", "plugin_version"}
    assert list(fn.input) == inputs and list(fn.output) == ["o"]


def test_launch_params_use_only_ring_ops():
    """launch_params must work on symbolic dims: feed objects that only support + - * and cdiv."""
    B, H, Hkv, Sq, Sk = (SymDim(n) for n in ("B", "H", "Hkv", "Sq", "Sk"))
    attrs = {"scale": 0.125, "causal": 1, "num_heads": 8, "num_kv_heads": 2}
    p = L.launch_params("FlashAttention", [[B, H, Sq, 64], [B, Hkv, Sk, 64], [B, Hkv, Sk, 64],
                                          [B, 1, 1, Sk]], ["float16"], attrs, cdiv=sym_cdiv)
    cfg = L.choose_config("float16", 64, True)
    assert p.grid[0].e == f"(cdiv(Sq,{cfg.block_m})*(B*H))"
    assert [a.e for a in p.extra_args] == ["H", "Hkv", "Sq", "Sk"]
    assert p.block == (cfg.num_warps * 32, 1, 1)


def test_kernel_config_variants():
    attrs = {"scale": 0.125, "causal": 0, "num_heads": 8, "num_kv_heads": 8}
    nb = L.kernel_config("FlashAttention", "float16", attrs, {"head_dim": 64})
    assert nb.n_inputs == 3 and nb.constexprs["Bias"] is None and "Bias" not in nb.signature
    kp = L.kernel_config("FlashAttention", "bfloat16", attrs, {"head_dim": 80, "bias_shape": (-1, 1, 1, -1)})
    assert kp.n_inputs == 4 and kp.signature["Bias"] == "*bf16" and kp.constexprs["HEAD_DIM_PAD"] == 128
    assert (kp.constexprs["BIAS_B"], kp.constexprs["BIAS_H"], kp.constexprs["BIAS_M"], kp.constexprs["BIAS_N"]) == (1, 0, 0, 1)
    sc = L.kernel_config("FlashAttention", "float16", attrs, {"head_dim": 64, "bias_shape": ()})
    assert sc.constexprs["SCALAR_BIAS"] and not sc.constexprs["HAS_BIAS"]
    assert list(sc.signature) == ["Q", "K", "V", "Bias", "H", "Hkv", "Sq", "Sk", "Out"]
    with pytest.raises(ValueError):
        L.kernel_config("FlashAttention", "float16", attrs, {"head_dim": 48})
    # the one kernel: 2 dtypes x 2 head dims x causal or not x 3 biases, and its FP8 form with o in
    # fp16 / bf16 (2 x 2 x 2 x 3); the decode plan's kernels (test_decode_plan.py): 2 x 2 x 2 x 4
    # biases x 6 split sizes split kernels, 2 x 2 x 2 x 4 direct kernels
    srcs = L.prebuild_sources()
    assert len(srcs) == 24 + 24 + 192 + 32 == len({s.name for s in srcs})
    assert sum(s.entry == L.ENTRY for s in srcs) == 48
    assert sum(s.meta["dtype"] == L.FP8 for s in srcs) == 24
    # no FP8 tensor cores on sm_80: no FP8 form; sm_90: the CUDA kernel's FP8 path at D = 128 without
    # a key bias (8 of the 24) and its 8 HOST_MAPS builds, the Triton kernel's FP8 branch for the rest
    assert not any(s.meta.get("dtype") == L.FP8 for s in L.prebuild_sources(80))
    fp8_90 = [s for s in L.prebuild_sources(90) if s.meta.get("dtype") == L.FP8]
    assert len(fp8_90) == 32 and sum(s.lang == "cuda" for s in fp8_90) == 16
    assert sum("HOST_MAPS" in s.defines for s in fp8_90) == 8


@pytest.mark.parametrize("opset", [17, 20])
def test_fp16_function_runs_below_opset_20(opset):
    """fp16 fused models from TorchScript exports (opset 17) must run in onnxruntime too."""
    import onnxruntime as ort

    fn = R.onnx_function("FlashAttention", opset=opset)
    node = helper.make_node("FlashAttention", ["q", "k", "v", "b"], ["o"], domain="optfuse", scale=0.25, causal=1,
                            num_heads=4, num_kv_heads=2, plugin_namespace="optfuse", plugin_version=R.SPEC.plugin_version)
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT16, None) for n in "qkvb"]
    g = helper.make_graph([node], "g", vi, [helper.make_tensor_value_info("o", TensorProto.FLOAT16, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("optfuse", 1)],
                          functions=[fn])
    m.ir_version = 9
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4, 5, 32)).astype(np.float16)
    k, v = (rng.standard_normal((2, 2, 7, 32)).astype(np.float16) for _ in range(2))
    o = sess.run(None, {"q": q, "k": k, "v": v, "b": np.zeros((), np.float16)})[0]
    r = R.reference("FlashAttention", [q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), None],
                  {"scale": 0.25, "causal": 1, "num_heads": 4, "num_kv_heads": 2})[0]
    assert np.abs(o.astype(np.float64) - r).max() < 5e-3


# -- FlashAttention v2 (windows, softcap) and BlockSparseAttention through the ONNX function --------
def _run_op(op, inputs, attrs, opset=17):
    """One optfuse node over ``inputs`` (spec order, bias always given) in onnxruntime (CPU)."""
    import onnxruntime as ort

    spec = R.SPEC if op == "FlashAttention" else R.BLOCK_SPARSE_SPEC
    names = [t.name for t in spec.inputs][:len(inputs)]
    vis = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(x.dtype), list(x.shape))
           for n, x in zip(names, inputs)]
    node = helper.make_node(op, names, ["o"], domain="optfuse", plugin_namespace="optfuse",
                            plugin_version=spec.plugin_version, **attrs)
    graph = helper.make_graph([node], "op", vis, [helper.make_tensor_value_info("o", TensorProto.FLOAT, list(inputs[0].shape))])
    model = helper.make_model(graph, functions=[R.onnx_function(op, opset=opset)],
                              opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("optfuse", 1)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, dict(zip(names, inputs)))[0]


def _qkv(rng, B, H, Hkv, Sq, Sk, D=8):
    q = rng.standard_normal((B, H, Sq, D)).astype(np.float32)
    k = rng.standard_normal((B, Hkv, Sk, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, Sk, D)).astype(np.float32)
    return q, k, v


def test_visible_matches_definition():
    for sq, sk, causal, wl, wr in ((5, 9, 1, 2, -1), (9, 5, 0, 1, 3), (6, 6, 0, -1, 0), (4, 11, 1, 0, 5)):
        got = R.visible(sq, sk, bool(causal), wl, wr)
        for i in range(sq):
            for j in range(sk):
                d = j - i - (sk - sq)
                want = (not causal or d <= 0) and (wl < 0 or d >= -wl) and (wr < 0 or d <= wr)
                assert got[i, j] == want


@pytest.mark.parametrize("Sq,Sk,causal,wl,wr,softcap", [
    (6, 11, 1, 3, -1, 0.0),     # HF sliding window (causal, left), Sk > Sq (a cache)
    (11, 6, 1, 2, -1, 0.0),     # Sk < Sq: the first rows see no key
    (7, 7, 0, 2, 1, 0.0),       # non-causal window both sides
    (5, 9, 0, -1, 2, 0.0),      # right only
    (9, 5, 0, 3, -1, 0.0),      # left only, non-causal
    (7, 7, 1, 0, -1, 0.0),      # window of one key (the diagonal)
    (8, 8, 1, -1, -1, 2.5),     # Gemma 2 softcap, causal
    (6, 10, 0, 2, 2, 0.7),      # softcap + window, Sk != Sq
])
def test_onnx_function_windows_and_softcap(Sq, Sk, causal, wl, wr, softcap):
    rng = np.random.default_rng(Sq * 31 + Sk)
    q, k, v = _qkv(rng, 2, 4, 2, Sq, Sk)
    q *= 3.0  # large scores: the cap matters
    bias = rng.standard_normal((2, 1, 1, Sk)).astype(np.float32)
    attrs = {**_attrs(4, 2, causal), "window_left": wl, "window_right": wr, "softcap": softcap}
    o = _run_op("FlashAttention", [q, k, v, bias], attrs)
    (ref,) = R.reference("FlashAttention", [q, k, v, bias], attrs)
    assert np.isfinite(o).all()
    assert np.abs(o - ref).max() <= 1e-5
    # the attributes change the result (the test sees them)
    (plain,) = R.reference("FlashAttention", [q, k, v, bias], _attrs(4, 2, causal))
    assert np.abs(plain - ref).max() > 1e-3


def test_softcap_is_tanh_cap_before_bias():
    rng = np.random.default_rng(7)
    q, k, v = _qkv(rng, 1, 2, 2, 4, 6)
    bias = rng.standard_normal((1, 2, 4, 6)).astype(np.float32)
    c, scale = 1.5, 0.9
    s = c * np.tanh(scale * (q.astype(np.float64) @ k.astype(np.float64).transpose(0, 1, 3, 2)) / c) + bias
    p = np.exp(s - s.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ v
    attrs = {**_attrs(2, 2, 0, scale=scale), "softcap": c}
    np.testing.assert_allclose(_run_op("FlashAttention", [q, k, v, bias], attrs), want, atol=1e-5)


def _bsr(blocks: np.ndarray, rng) -> tuple[np.ndarray, np.ndarray]:
    """BSR of a [heads, Mb, Nb] block visibility; heads padded to one nnz with random entries."""
    heads, mb, _ = blocks.shape
    nnz = int(blocks.sum(axis=(1, 2)).max()) + 2
    offsets = np.zeros((heads, mb + 1), np.int32)
    indices = rng.integers(0, blocks.shape[2] + 3, (heads, nnz)).astype(np.int32)
    for h in range(heads):
        offsets[h, 1:] = np.cumsum(blocks[h].sum(-1))
        flat = np.concatenate([np.flatnonzero(r) for r in blocks[h]])
        indices[h, :flat.size] = flat
    return offsets, indices


@pytest.mark.parametrize("heads,block,Sq,Sk,causal,softcap", [
    (4, 4, 13, 18, 0, 0.0),     # per-head layout, partial last blocks
    (1, 4, 13, 18, 0, 0.0),     # one layout shared by all heads
    (4, 3, 9, 9, 1, 0.0),       # + causal
    (1, 5, 12, 21, 1, 1.3),     # shared, causal, softcap, Sk > Sq
])
def test_block_sparse_function_matches_reference(heads, block, Sq, Sk, causal, softcap):
    rng = np.random.default_rng(heads * 100 + block)
    q, k, v = _qkv(rng, 2, 4, 2, Sq, Sk)
    bias = rng.standard_normal((2, 4, Sq, Sk)).astype(np.float32)
    blocks = rng.random((heads, -(-Sq // block), -(-Sk // block))) < 0.5
    blocks[0, 1] = False  # a query block that sees nothing
    blocks[-1, 0, -1] = True  # a partial key block
    offsets, indices = _bsr(blocks, rng)
    attrs = {**_attrs(4, 2, causal), "block_size": block, "softcap": softcap}
    o = _run_op("BlockSparseAttention", [q, k, v, bias, offsets, indices], attrs)
    (ref,) = R.reference("BlockSparseAttention", [q, k, v, bias, offsets, indices], attrs)
    assert np.isfinite(o).all()
    assert np.abs(o - ref).max() <= 1e-5


def test_block_sparse_padding_entries_and_empty_rows():
    """Entries past offsets[h, -1] are padding (any value); a query block with no key block gives 0."""
    rng = np.random.default_rng(11)
    Sq, Sk, block = 8, 12, 4  # 2 query blocks, 3 key blocks
    q, k, v = _qkv(rng, 1, 2, 2, Sq, Sk)
    bias = np.zeros((), np.float32)
    # head 0: block 0 sees key blocks 0, 2; block 1 sees none. head 1: block 0 none, block 1 sees 1.
    offsets = np.array([[0, 2, 2], [0, 0, 1]], np.int32)
    indices = np.array([[0, 2, 1, 0], [1, 2, 0, 2]], np.int32)  # padding: [1, 0] and [2, 0, 2]
    attrs = {**_attrs(2, 2, 0), "block_size": block}
    o = _run_op("BlockSparseAttention", [q, k, v, bias, offsets, indices], attrs)
    (ref,) = R.reference("BlockSparseAttention", [q, k, v, bias, offsets, indices], attrs)
    assert np.abs(o - ref).max() <= 1e-5
    np.testing.assert_array_equal(o[0, 0, 4:], 0.0)
    np.testing.assert_array_equal(o[0, 1, :4], 0.0)
    # head 0, block 0 equals dense attention over keys 0..3 and 8..11
    keys = np.r_[0:4, 8:12]
    s = 0.3 * q[0, 0, :4].astype(np.float64) @ k[0, 0, keys].astype(np.float64).T
    p = np.exp(s - s.max(-1, keepdims=True))
    np.testing.assert_allclose(o[0, 0, :4], (p / p.sum(-1, keepdims=True)) @ v[0, 0, keys], atol=1e-5)
