"""AOT compiles of the FlashAttention kernel through optfuse.kernels (CPU only, no GPU needed)."""

import re

import pytest

pytest.importorskip("triton")

from optfuse.kernels import KernelCache  # noqa: E402
from optfuse.kernels.registry import plugin_module  # noqa: E402
from optfuse.kernels.testing import cubin_usage, cuobjdump  # noqa: E402

L = plugin_module("flash_attention", "launch")

# Max dynamic shared memory per block: sm_80 163 KiB, sm_89 99 KiB, sm_90 227 KiB.
SMEM_LIMIT = {80: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}


@pytest.mark.parametrize("arch,dtype,D,causal,bias_shape", [
    (90, "bfloat16", 128, 1, None),
    (90, "float16", 64, 0, ()),
    (80, "float16", 128, 0, (-1, 1, 1, -1)),
    (80, "float32", 80, 1, (-1, -1, -1, -1)),
])
def test_aot_compile(tmp_path, arch, dtype, D, causal, bias_shape):
    attrs = {"scale": D ** -0.5, "causal": causal, "num_heads": 8, "num_kv_heads": 2}
    src = L.kernel_config("FlashAttention", dtype, attrs, {"head_dim": D, "bias_shape": bias_shape})
    art = KernelCache(tmp_path).build(src, arch)
    n_in = 3 if bias_shape is None else 4
    assert (art.n_inputs, art.n_extra, art.n_outputs) == (n_in, 4, 1)
    assert art.cubin and art.arch == arch
    assert art.threads == src.num_warps * 32
    assert 0 < art.shared_mem <= SMEM_LIMIT[arch]
    # QDP order: inputs, H, Hkv, Sq, Sk, output, then Triton's scratch pointers
    entry = re.search(r"\.entry\s+" + re.escape(art.name) + r"\s*\((.*?)\)", art.ptx, re.S).group(1)
    params = re.findall(r"\.param\s+\.(\w+)", entry)
    assert params[:n_in] == ["u64"] * n_in
    assert params[n_in:n_in + 4] == ["u32"] * 4
    assert len(params) == n_in + 4 + 1 + art.n_scratch
    if arch == 90 and dtype != "float32":
        assert "wgmma" in art.ptx  # Hopper tensor-core path
    # a second build is a cache hit
    assert KernelCache(tmp_path).build(src, arch).key == art.key


def _entry_param_types(art):
    entry = re.search(r"\.entry\s+" + re.escape(art.name) + r"\s*\((.*?)\)", art.ptx, re.S).group(1)
    return re.findall(r"\.param\s+\.(\w+)", entry)


@pytest.mark.parametrize("arch,dtype,D,bias_shape,Sq", [
    (90, "bfloat16", 128, (2, 1, 1, 4096), 1),
    (89, "float16", 64, None, 16),
    (80, "float32", 128, (), 4),
])
def test_aot_compile_decode_plan(tmp_path, arch, dtype, D, bias_shape, Sq):
    """The split-KV decode kernel compiles for sm_80 / 89 / 90 without a GPU, in QDP argument order:
    q, k, v[, bias], H, Hkv, Sq, Sk, Part, RowMax, RowSum, Count, o; no global scratch (the
    launcher passes null scratch pointers)."""
    T = plugin_module("flash_attention", "testing")
    shapes = [(2, 32, Sq, D), (2, 8, 4096, D), (2, 8, 4096, D), bias_shape]
    plan = T.case_plan(dtype, shapes, {"scale": D ** -0.5, "causal": 1, "num_heads": 32, "num_kv_heads": 8})
    (step,) = plan.steps
    assert not step.source.constexprs["DIRECT"]
    split = KernelCache(tmp_path).build(step.source, arch)
    n_in = 3 + (bias_shape is not None)
    assert _entry_param_types(split) == ["u64"] * n_in + ["u32"] * 4 + ["u64"] * 5 + ["u64"] * split.n_scratch
    assert split.cubin and split.arch == arch and split.threads == step.source.num_warps * 32
    assert split.shared_mem <= SMEM_LIMIT[arch]
    if dtype != "float32":
        assert "cp.async" in split.ptx  # the K/V loads are software-pipelined
        assert "mma.sync" in split.ptx  # packed rows on the tensor cores (M = 16 .. 64: no wgmma)


@pytest.mark.parametrize("arch,D,causal,bias_shape,out_dtype", [
    (90, 128, 0, (-1, 1, 1, -1), "bfloat16"),  # key padding: the Triton kernel on sm_90 at D = 128 too
    (90, 64, 1, (), "float16"),
    (89, 128, 1, (-1, 1, 1, -1), "bfloat16"),
    (89, 80, 0, None, "float32"),
])
def test_aot_compile_fp8(tmp_path, arch, D, causal, bias_shape, out_dtype):
    """The Triton kernel's FP8 form compiles for sm_90 and sm_89 without a GPU, in QDP argument order (q, k, v[,
    bias], q_scale, k_scale, v_scale, H, Hkv, Sq, Sk, o): both dots on E4M3 tensor cores (wgmma on
    sm_90, mma.sync on sm_89) and p rounded to E4M3 with cvt.rn.satfinite."""
    attrs = {"scale": D ** -0.5, "causal": causal, "num_heads": 8, "num_kv_heads": 2, "output_dtype": out_dtype}
    src = L.kernel_config("FlashAttention", L.FP8, attrs, {"head_dim": D, "bias_shape": bias_shape, "arch": arch})
    art = KernelCache(tmp_path).build(src, arch)
    n_in = 6 + (bias_shape is not None)
    assert (art.n_inputs, art.n_extra, art.n_outputs) == (n_in, 4, 1) and art.cubin and art.arch == arch
    assert 0 < art.shared_mem <= SMEM_LIMIT[arch]
    params = _entry_param_types(art)
    assert params == ["u64"] * n_in + ["u32"] * 4 + ["u64"] + ["u64"] * art.n_scratch
    mma = re.findall(r"(wgmma\.mma_async[\w.]*|mma\.sync[\w.]*)", art.ptx)
    if arch == 90:
        assert mma and all(m.startswith("wgmma") and m.endswith(".f32.e4m3.e4m3") for m in mma), sorted(set(mma))
    else:
        assert mma and all(m.startswith("mma.sync") and ".e4m3.e4m3." in m for m in mma), sorted(set(mma))
    assert "cvt.rn.satfinite.e4m3x2.f32" in art.ptx


@pytest.mark.parametrize("dtype,D,Sq", [
    ("bfloat16", 128, 1), ("bfloat16", 128, 16), ("bfloat16", 256, 1), ("float16", 64, 4),
    ("float32", 64, 16), ("float32", 128, 1), ("float32", 128, 16), ("float32", 256, 16),
])
def test_decode_kernel_has_no_spills(tmp_path, dtype, D, Sq):
    """The sm_90 build of the decode plan's kernel keeps every value in registers (no stack, no
    local memory): the default tiles per dtype and D, the combine's tile included (cuobjdump)."""
    tool = cuobjdump()
    if not tool:
        pytest.skip("no cuobjdump")
    T = plugin_module("flash_attention", "testing")
    shapes = [(1, 32, Sq, D), (1, 8, 8192, D), (1, 8, 8192, D), None]
    plan = T.case_plan(dtype, shapes, {"scale": D ** -0.5, "causal": 1, "num_heads": 32, "num_kv_heads": 8}, arch=90)
    (step,) = plan.steps
    res, _ = cubin_usage(tool, KernelCache(tmp_path).build(step.source, 90), tmp_path)
    assert "STACK:0" in res and "LOCAL:0" in res, res
