"""CPU tests of FlashAttention's FP8 form: the NumPy reference against an FP64 computation of the
dequantized math written out, the ONNX function variants in onnxruntime (fake-quant), the
contract's refusals, and the launch choices (the FP8 Triton kernel on sm_89 / sm_90)."""

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from optfuse.kernels.registry import plugin_module

R = plugin_module("flash_attention", "reference")
L = plugin_module("flash_attention", "launch")


def _fp8_case(rng, B=2, H=4, Hkv=2, Sq=9, Sk=21, D=16, pad_value=np.nan):
    """E4M3 q, k, v (v as [B, Hkv, D, Skv], padding keys = pad_value) and float32 scales."""
    scales = [np.array(s, np.float32) for s in (0.011, 0.023, 0.037)]
    q = R.quantize_fp8(rng.standard_normal((B, H, Sq, D)) * 2.0, 0.011 / 4)
    k = R.quantize_fp8(rng.standard_normal((B, Hkv, Sk, D)), 0.023)
    vt = np.full((B, Hkv, D, R.fp8_v_keys(Sk)), pad_value, np.float32)
    vt[..., :Sk] = rng.standard_normal((B, Hkv, D, Sk)) * 10.0
    v = R.quantize_fp8(vt, 0.037)
    return q, k, v, scales


def _loop64(q, k, v, bias, scale, causal, window_left=-1):
    """The definition row by row in float64 on dequantized [B, H, S, D] inputs."""
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    g = H // Hkv
    o = np.zeros((B, H, Sq, D))
    for b in range(B):
        for h in range(H):
            for i in range(Sq):
                s = scale * (k[b, h // g] @ q[b, h, i])
                if bias is not None:
                    s = s + np.broadcast_to(bias, (B, H, Sq, Sk))[b, h, i]
                j = np.arange(Sk)
                d = j - i - (Sk - Sq)
                if causal:
                    s[d > 0] = -np.inf
                if window_left >= 0:
                    s[d < -window_left] = -np.inf
                if np.all(s == -np.inf):
                    continue
                p = np.exp(s - s.max())
                o[b, h, i] = p @ v[b, h // g] / p.sum()
    return o


@pytest.mark.parametrize("causal,window_left,with_bias", [(0, -1, False), (1, -1, True), (1, 4, False)])
def test_reference_is_the_dequantized_math(causal, window_left, with_bias):
    rng = np.random.default_rng(3)
    q, k, v, scales = _fp8_case(rng)
    bias = rng.standard_normal((2, 1, 1, 21)) if with_bias else None
    attrs = {"scale": 0.3, "causal": causal, "num_heads": 4, "num_kv_heads": 2, "window_left": window_left,
             "output_dtype": "float32"}
    (o,) = R.reference("FlashAttention", [q, k, v, bias, *scales], attrs)
    qd = q.astype(np.float64) * 0.011
    kd = k.astype(np.float64) * 0.023
    vd = v.astype(np.float64)[..., :21].transpose(0, 1, 3, 2) * 0.037
    want = _loop64(qd, kd, vd, bias, 0.3, causal, window_left)
    assert o.dtype == np.float32 and np.isfinite(o).all()  # the NaN padding keys are never read
    np.testing.assert_allclose(o, want, rtol=1e-6, atol=1e-6)


def test_reference_output_dtypes_and_refusals():
    rng = np.random.default_rng(4)
    q, k, v, scales = _fp8_case(rng)
    base = {"scale": 0.3, "num_heads": 4, "num_kv_heads": 2}
    for name, dt in (("bfloat16", ml_dtypes.bfloat16), ("float16", np.float16), ("float32", np.float32)):
        (o,) = R.reference("FlashAttention", [q, k, v, None, *scales], {**base, "output_dtype": name})
        assert o.dtype == np.dtype(dt)
    with pytest.raises(ValueError, match="needs output_dtype"):
        R.reference("FlashAttention", [q, k, v, None, *scales], base)
    with pytest.raises(ValueError, match="need q_scale"):
        R.reference("FlashAttention", [q, k, v, None, scales[0], None, scales[2]], {**base, "output_dtype": "float32"})
    with pytest.raises(ValueError, match="is not \\[B, Hkv, D, Skv\\]"):  # v not transposed
        R.reference("FlashAttention", [q, k, v.transpose(0, 1, 3, 2)[:, :, :21], None, *scales],
                    {**base, "output_dtype": "float32"})
    qf, kf = (x.astype(np.float32) for x in (q, k))
    vf = v.astype(np.float32)[..., :21].transpose(0, 1, 3, 2)
    with pytest.raises(ValueError, match="come only with an FP8 q"):
        R.reference("FlashAttention", [qf, kf, vf, None, *scales], base)
    # a float instance with output_dtype: computed in float64, o in that dtype
    (o16,) = R.reference("FlashAttention", [qf, kf, vf, None], {**base, "output_dtype": "float16"})
    (o32,) = R.reference("FlashAttention", [qf, kf, vf, None], base)
    assert o16.dtype == np.float16 and o32.dtype == np.float32
    np.testing.assert_allclose(o16.astype(np.float32), o32, rtol=2e-3, atol=2e-3)


def test_quantize_saturates_and_rounds_to_nearest_even():
    x = np.array([1.0625, 1.1875, 124.8, 460.0, -1e6, 2.0 ** -9 * 1.5])
    got = R.quantize_fp8(x, 1.0).astype(np.float64)
    np.testing.assert_array_equal(got, [1.0, 1.25, 128.0, 448.0, -448.0, 2.0 ** -8])


def _feed(x):
    import onnxruntime as ort

    if x.dtype == ml_dtypes.float8_e4m3fn:
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(np.ascontiguousarray(x).view(np.uint8),
                                                               TensorProto.FLOAT8E4M3FN)
    return x


def _onnx_type(x):
    if x.dtype == ml_dtypes.float8_e4m3fn:
        return TensorProto.FLOAT8E4M3FN
    return helper.np_dtype_to_tensor_dtype(x.dtype)


def _run_fp8_node(inputs, attrs, out_dtype, opset=19):
    """One FP8 FlashAttention node (bias always given: a scalar 0 where the graph has none) in
    onnxruntime with the variant function_overload names."""
    import onnxruntime as ort

    names = [t.name for t in R.SPEC.inputs]
    attrs = {**attrs, "output_dtype": out_dtype}
    node = helper.make_node("FlashAttention", names, ["o"], domain="optfuse", plugin_namespace="optfuse",
                            plugin_version=R.SPEC.plugin_version, **attrs)
    node.overload = R.function_overload("FlashAttention", names, attrs)
    assert node.overload == f"fp8_to_{out_dtype}"
    vis = [helper.make_tensor_value_info(n, _onnx_type(x), list(x.shape)) for n, x in zip(names, inputs)]
    out_type = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}[out_dtype]
    nodes, out = [node], "o"
    if out_dtype == "bfloat16":  # onnxruntime returns no bf16 arrays: widen the checked o
        nodes.append(helper.make_node("Cast", ["o"], ["o_f32"], to=TensorProto.FLOAT))
        out, out_type = "o_f32", TensorProto.FLOAT
    graph = helper.make_graph(nodes, "fp8", vis, [helper.make_tensor_value_info(out, out_type, list(inputs[0].shape))])
    model = helper.make_model(graph, functions=[R.onnx_function("FlashAttention", opset, overload=node.overload)],
                              opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("optfuse", 1)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {n: _feed(x) for n, x in zip(names, inputs)})[0]


@pytest.mark.parametrize("out_dtype,causal,Sk", [("float32", 0, 21), ("float16", 1, 32), ("bfloat16", 1, 13)])
def test_fp8_function_is_fake_quant_of_the_reference(out_dtype, causal, Sk):
    rng = np.random.default_rng(5)
    q, k, v, scales = _fp8_case(rng, Sk=Sk, pad_value=1e3)  # padding keys: saturated values, cut off
    bias = rng.standard_normal((2, 4, 9, Sk)).astype(np.float32)
    attrs = {"scale": 0.3, "causal": causal, "num_heads": 4, "num_kv_heads": 2}
    got = _run_fp8_node([q, k, v, bias, *scales], attrs, out_dtype).astype(np.float64)
    (want,) = R.reference("FlashAttention", [q, k, v, bias, *scales], {**attrs, "output_dtype": "float32"})
    tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}[out_dtype] * max(1.0, float(np.abs(want).max()))
    assert np.abs(got - want).max() <= tol


def test_function_variants_and_their_refusals():
    names = [t.name for t in R.SPEC.inputs]
    assert R.function_overload("FlashAttention", names[:4], {}) == ""
    assert R.function_overload("FlashAttention", names[:4], {"output_dtype": "float16"}) == "to_float16"
    assert R.function_overload("FlashAttention", names, {"output_dtype": b"bfloat16"}) == "fp8_to_bfloat16"
    assert R.function_overload("BlockSparseAttention", ["q", "k", "v", "bias", "o", "i"], {}) == ""
    with pytest.raises(ValueError, match="needs output_dtype"):
        R.function_overload("FlashAttention", names, {})
    with pytest.raises(ValueError, match="opset >= 19"):
        R.onnx_function("FlashAttention", 18, overload="fp8_to_float16")
    with pytest.raises(ValueError, match="no function overload"):
        R.onnx_function("BlockSparseAttention", 19, overload="fp8_to_float16")
    fn = R.onnx_function("FlashAttention", 19, overload="fp8_to_bfloat16")
    assert fn.overload == "fp8_to_bfloat16" and "DequantizeLinear" in {n.op_type for n in fn.node}
    assert fn.node[-1].op_type == "Cast" and fn.node[-1].attribute[0].i == TensorProto.BFLOAT16


# -- launch --------------------------------------------------------------------------------------
ATTRS = {"scale": 0.125, "causal": 1, "num_heads": 8, "num_kv_heads": 2, "output_dtype": "bfloat16"}


@pytest.mark.parametrize("arch", [None, 89, 90])
def test_fp8_triton_kernel_where_the_cuda_one_does_not_apply(arch):
    """The Triton kernel's FP8 branch: every FP8 target but sm_90 at D = 128 (there with a key-padding
    bias only: the CUDA kernel's FP8 path takes none or a scalar)."""
    bias = (-1, 1, 1, -1) if arch == 90 else ()
    src = L.kernel_config("FlashAttention", L.FP8, ATTRS, {"head_dim": 128, "bias_shape": bias, "arch": arch})
    assert src.lang == "triton" and src.n_inputs == 7
    assert list(src.signature) == ["Q", "K", "V", "Bias", "QScale", "KScale", "VScale", "H", "Hkv", "Sq", "Sk", "Out"]
    assert src.signature["Q"] == "*fp8e4nv" and src.signature["Bias"] == "*bf16" and src.signature["Out"] == "*bf16"
    assert "float8e4m3fn_to_bfloat16" in src.name and src.meta["out_dtype"] == "bfloat16"
    assert L.choose_config(L.FP8, 128, True) == L.TUNED[("fp8", 128, True)]


@pytest.mark.parametrize("bias", [None, ()])
def test_fp8_cuda_kernel_on_sm90(bias):
    """sm_90, D = 128, no bias or a scalar one, o fp16/bf16: the CUDA kernel's FP8 path, in the
    Triton kernel's argument order plus num_tiles (q, k, v[, bias], q_scale, k_scale, v_scale, H,
    Hkv, Sq, Sk, num_tiles, o); o's dtype is the 16-bit type the kernel is built for."""
    for out in ("bfloat16", "float16"):
        attrs = {**ATTRS, "output_dtype": out}
        src = L.kernel_config("FlashAttention", L.FP8, attrs, {"head_dim": 128, "bias_shape": bias, "arch": 90})
        assert src.lang == "cuda" and src.n_inputs == 6 + (bias is not None) and src.n_extra == 5
        assert src.defines["FP8"] == "1" and src.defines["OPTFUSE_DTYPE"] == ("2" if out == "bfloat16" else "1")
        assert "SOFTMAX_STREAM" not in src.defines and "ONES_SUM" not in src.defines
        assert f"float8e4m3fn_to_{out}" in src.name and "fa_sm90_d128" in src.name
        cfg = L.FAConfig(**src.meta["config"])
        shapes = [[2, 8, 300, 128], [2, 2, 517, 128], [2, 2, 128, 528], bias and list(bias), [1], [1], [1]]
        p = L.launch_params("FlashAttention", [s for s in shapes if s is not None], [L.FP8], attrs,
                            static_shape={"head_dim": 128, "bias_shape": bias, "arch": 90})
        assert p.grid == (L.SM90_GRID, 1, 1) and p.block == (384, 1, 1)
        assert list(p.extra_args) == [8, 2, 300, 517, 3 * 2 * 8]
        # E4M3 K and V^T tiles: half the 16-bit ring; the Q slots stay 16-bit (o is staged there)
        assert p.shared_mem == L.sm90_shared_mem(128, cfg, 0 if bias is None else 1, 1)
        assert p.shared_mem < L.sm90_shared_mem(128, cfg, 0 if bias is None else 1)
    assert L.candidate_configs(L.FP8, 128, False, arch=90)[0] == L.choose_config(L.FP8, 128, False, arch=90)


@pytest.mark.parametrize("static,attrs", [
    ({"head_dim": 64, "bias_shape": None}, {}),                        # D = 64: one chunk per row is D = 128's
    ({"head_dim": 128, "bias_shape": None}, {"output_dtype": "float32"}),  # o not 16-bit
    ({"head_dim": 128, "bias_shape": None}, {"softcap": 30.0}),        # soft-cap
])
def test_fp8_cuda_kernel_refusals_pick_triton(static, attrs):
    src = L.kernel_config("FlashAttention", L.FP8, {**ATTRS, **attrs}, {**static, "arch": 90})
    assert src.lang == "triton"


def test_fp8_refusals_and_plans():
    with pytest.raises(ValueError, match="sm_89 or newer"):
        L.kernel_config("FlashAttention", L.FP8, ATTRS, {"head_dim": 64, "arch": 80})
    with pytest.raises(ValueError, match="output_dtype"):
        L.kernel_config("FlashAttention", L.FP8, {**ATTRS, "output_dtype": "like_input"}, {"head_dim": 64})
    with pytest.raises(ValueError, match="no FP8 form"):
        L.kernel_config("BlockSparseAttention", L.FP8, {**ATTRS, "block_size": 128}, {"head_dim": 64})
    with pytest.raises(ValueError, match="sm90 kernel"):
        L.kernel_config("FlashAttention", L.FP8, ATTRS, {"head_dim": 64}, config=L.sm90_config(64, True))
    # decode shapes (Sq <= 16 over long Sk) keep the one FP8 kernel: no split-KV plan, no workspace
    shapes = [[2, 8, 1, 64], [2, 2, 4096, 64], [2, 2, 64, 4096], None, [1], [1], [1]]
    assert L.launch_plan("FlashAttention", shapes, [L.FP8], ATTRS) is None
    assert L.workspace_bytes("FlashAttention", shapes, shapes, [L.FP8], ATTRS) == 0
    p = L.launch_params("FlashAttention", shapes, [L.FP8], ATTRS, static_shape={"head_dim": 64, "bias_shape": None})
    assert list(p.extra_args) == [8, 2, 1, 4096]
    L.check_shapes([[2, 8, 5, 64], [2, 2, 37, 64], [2, 2, 64, 48]], ATTRS, fp8=True)
    with pytest.raises(ValueError):
        L.check_shapes([[2, 8, 5, 64], [2, 2, 37, 64], [2, 2, 37, 64]], ATTRS, fp8=True)


def test_other_output_dtype_keeps_the_sm90_kernel_out():
    """A float q with o in another dtype runs the Triton kernel (the CUDA one writes q's dtype)."""
    attrs = {**ATTRS, "output_dtype": "float32"}
    src = L.kernel_config("FlashAttention", "bfloat16", attrs, {"head_dim": 128, "arch": 90})
    assert src.lang == "triton" and src.signature["Out"] == "*fp32" and src.signature["Q"] == "*bf16"
    same = L.kernel_config("FlashAttention", "bfloat16", {**attrs, "output_dtype": "bfloat16"}, {"head_dim": 128, "arch": 90})
    assert same.lang == "cuda"
    shapes = [[2, 8, 1, 64], [2, 2, 4096, 64], [2, 2, 4096, 64], None]
    assert L.launch_plan("FlashAttention", shapes, ["bfloat16"], attrs) is None
    assert L.launch_plan("FlashAttention", shapes, ["bfloat16"], {**attrs, "output_dtype": "like_input"}) is not None
