"""The CUDA (sm90) FlashAttention kernel on the CPU machine: when launch.py picks it, its launch
parameters (symbolic too), NVRTC compiles for sm_90a (wgmma, setmaxnreg, no local memory), and the
benchmark's ``--variants`` of it."""

import dataclasses
import re

import pytest

from optfuse.kernels import KernelCache
from optfuse.kernels.registry import plugin_module
from optfuse.plugin_dirs import script_module
from optfuse.kernels.testing import SymDim, cubin_usage, cuobjdump, sym_cdiv

L = plugin_module("flash_attention", "launch")
OP = "FlashAttention"


def _attrs(D, causal=0, H=8, Hkv=2):
    return {"scale": D ** -0.5, "causal": causal, "num_heads": H, "num_kv_heads": Hkv}


@pytest.mark.parametrize("arch,dtype,D,bias,expect", [
    (90, "bfloat16", 128, None, "cuda"),
    (90, "float16", 128, (), "cuda"),                   # the rewrite's scalar dummy bias
    (90, "float16", 64, (), "cuda"),
    (90, "float16", 64, "causal", "cuda"),              # causal without a mask
    (90, "float16", 128, (-1, 1, 1, -1), "cuda"),       # key padding [B, 1, 1, Sk]
    (90, "bfloat16", 64, (1, 1, 1, -1), "cuda"),        # key padding shared by the batch
    (90, "bfloat16", 128, (-1, -1, -1, -1), "triton"),  # full bias: Triton
    (90, "bfloat16", 128, (-1, 1, -1, 1), "triton"),    # per-query bias: Triton
    (90, "float32", 128, None, "triton"),
    (90, "float16", 96, None, "triton"),
    (89, "bfloat16", 128, None, "triton"),
    (80, "float16", 64, None, "triton"),
    (None, "bfloat16", 128, None, "triton"),            # target unknown: the portable kernel
])
def test_kernel_choice(arch, dtype, D, bias, expect):
    causal = int(bias == "causal")
    bias = None if bias == "causal" else bias
    src = L.kernel_config(OP, dtype, _attrs(D, causal), {"head_dim": D, "bias_shape": bias, "arch": arch})
    assert src.lang == expect
    if expect == "cuda":
        keypad = L.is_keypad(L.bias_pattern(bias))
        # three consumer warpgroups (SM90_DEFAULTS), but for a key-padding row shared by the batch
        three = D == 64 and not (keypad and (causal or not L.bias_pattern(bias)[0]))
        assert src.arch_suffix == "a" and src.threads == (512 if three else 384)
        assert src.n_inputs == 3 + (bias is not None) and src.n_extra == 5
        mode = 0 if bias is None else 1 if not any(L.bias_pattern(bias)) else 2
        assert src.defines["BIAS_MODE"] == str(mode)
        # TMA loads everywhere but non-causal D = 64 with key padding (SM90_DEFAULTS)
        assert ("TMA" in src.defines) == (not (D == 64 and not causal and keypad))
        # K and V share one "full" barrier with the 3-stage ring of D = 64, not with D = 128's 2
        assert ("KV_ONE_FULL" in src.defines) == (D == 64) == (int(src.defines["STAGES"]) >= 3)
    # a negative scale (never exported, but legal) keeps the Triton kernel
    neg = dict(_attrs(D, causal), scale=-0.1)
    assert L.kernel_config(OP, dtype, neg, {"head_dim": D, "bias_shape": bias, "arch": arch}).lang == "triton"


@pytest.mark.parametrize("op,extra,static,block_m,tag", [
    ("FlashAttention", {"window_left": 255}, {}, 128, "_window255_-1"),       # short window: 128-row tiles
    ("FlashAttention", {"window_left": 1023}, {}, 192, "_window1023_-1"),
    ("FlashAttention", {"window_left": 100, "window_right": 100}, {}, 128, "_window100_100"),
    ("FlashAttention", {"softcap": 50.0}, {}, 192, "_softcap50"),
    ("BlockSparseAttention", {"block_size": 128}, {"layout_heads": True}, 128, "_bsr_heads"),
    ("BlockSparseAttention", {"block_size": 128}, {}, 128, "_bsr"),
])
def test_sparse_kernel_choice(op, extra, static, block_m, tag):
    """Windows, soft-caps and layouts are compiled in; a layout (and a window of up to
    SM90_SHORT_WINDOW keys at D = 64) runs 128-row tiles; BlockSparseAttention takes the layout's
    two int32 inputs and nnz after num_tiles."""
    attrs = {**_attrs(64, 1), **extra}
    st = {"head_dim": 64, "bias_shape": None, "arch": 90, **static}
    src = L.kernel_config(op, "bfloat16", attrs, st)
    assert src.lang == "cuda" and src.meta["config"]["block_m"] == block_m
    assert tag in src.name and src.name.startswith(f"flash_attention/{op}/")
    layout = op == "BlockSparseAttention"
    assert src.n_inputs == 3 + 2 * layout and src.n_extra == 5 + layout
    assert ("LAYOUT" in src.defines) == layout
    if "softcap" in extra:
        assert float(src.defines["SOFTCAP_LOG2"].rstrip("f")) == pytest.approx(50 * 1.4426950408889634)
    shapes = [[2, 8, "S", 64], [2, 2, "S", 64], [2, 2, "S", 64]] + ([[8, 9], [8, "nnz"]] if layout else [])
    p = L.launch_params(op, shapes, ["bfloat16"], attrs, cdiv=lambda a, b: ("cdiv", a, b), static_shape=st)
    assert p.extra_args[:4] == [8, 2, "S", "S"] and p.extra_args[5:] == (["nnz"] if layout else [])
    tsrc = L.kernel_config(op, "bfloat16", attrs, {**st, "arch": None})  # the Triton kernel
    assert tsrc.lang == "triton" and tag in tsrc.name and tsrc.n_extra == 4 + layout
    if layout:
        assert list(tsrc.signature)[3:6] == ["Offsets", "Indices", "H"] and "Nnz" in tsrc.signature
        assert tsrc.num_stages <= 2


def test_sparse_attributes_checked():
    with pytest.raises(ValueError, match="window"):
        L.kernel_config("FlashAttention", "bfloat16", {**_attrs(64), "window_left": -2},
                        {"head_dim": 64, "bias_shape": None, "arch": 90})
    with pytest.raises(ValueError, match="block_size"):
        L.kernel_config("BlockSparseAttention", "bfloat16", {**_attrs(64), "block_size": 64},
                        {"head_dim": 64, "bias_shape": None, "arch": 90})


def test_rows_per_tile_follow_the_waves_of_short_sequences():
    """D = 64 without a mask: 128-row tiles where the batch, heads and query length are known and
    their waves finish >= 5 % sooner (BERT-base S = 512 at B = 8, ViT-B's 197 tokens); the tuned
    192-row tiles otherwise (the dense table's B * S = 16k shapes, S > 1024, dynamic dims)."""
    assert L.rows_per_tile_by_waves(8, 12, 512) == 128
    assert L.rows_per_tile_by_waves(64, 12, 197) == 128
    assert L.rows_per_tile_by_waves(32, 16, 512) == 192
    assert L.rows_per_tile_by_waves(16, 16, 1024) == 192
    assert L.rows_per_tile_by_waves(8, 20, 1500) == 192

    def rows(q_shape, causal=0, bias_shape=None):
        static = {"head_dim": 64, "arch": 90, "q_shape": q_shape, "bias_shape": bias_shape}
        src = L.kernel_config(OP, "float16", {"scale": 0.125, "causal": causal}, static)
        return src.meta["config"]["block_m"]

    assert rows([8, 12, 512, 64]) == 128
    assert rows([-1, 12, 512, 64]) == 192  # a dynamic batch: the tuned tiles
    assert rows([32, 16, 512, 64]) == 192
    assert rows([8, 12, 512, 64], bias_shape=[8, 1, 1, 512]) == 128  # key padding follows the waves too
    assert rows([16, 32, 1024, 64], bias_shape=[16, 1, 1, 1024]) == 192
    assert rows([8, 12, 512, 64], causal=1, bias_shape=[8, 1, 1, 512]) == 128  # causal: 128 rows below Sq 4096 anyway
    q = [8, 12, 512, 64]
    cfg = L._config_for("float16", 64, False, None, 0.125, {"arch": 90, "q_shape": q})
    params = L.launch_params(OP, [q, [8, 12, 512, 64], [8, 12, 512, 64]], ["float16"] * 3,
                             {"scale": 0.125}, static_shape={"head_dim": 64, "arch": 90, "q_shape": q})
    assert cfg.block_m == 128 and params.extra_args[-1] == 4 * 8 * 12  # the launch counts the same tiles


def test_batch_one_key_padding_row_takes_the_per_batch_kernel():
    """A [1, 1, 1, Sk] key-padding row with q's batch a known 1 addresses the bias as a per-batch
    row does (batch 0 only), so it takes that kernel (D = 64: three consumer warpgroups); with a
    larger or dynamic batch the row is shared and keeps the two-warpgroup kernel. Kernel and launch
    agree on the tiles either way."""
    def choice(q, bias):
        static = {"head_dim": 64, "arch": 90, "q_shape": q, "bias_shape": bias}
        src = L.kernel_config(OP, "bfloat16", {"scale": 0.125}, static)
        params = L.launch_params(OP, [q, q, q, bias], ["bfloat16"] * 4, {"scale": 0.125}, static_shape=static)
        bm = src.meta["config"]["block_m"]
        assert params.block[0] == 32 * src.meta["config"]["num_warps"]
        if q[0] > 0:
            assert params.extra_args[-1] == -(-q[2] // bm) * q[0] * q[1]  # num_tiles of the same tiles
        return bm, src.defines["BIAS_BATCH"]

    assert choice([1, 32, 16384, 64], [1, 1, 1, 16384]) == (192, "1")
    assert choice([4, 32, 4096, 64], [1, 1, 1, 4096]) == (128, "0")
    assert choice([-1, 32, 4096, 64], [1, 1, 1, 4096]) == (128, "0")
    assert choice([4, 32, 4096, 64], [4, 1, 1, 4096]) == (192, "1")
    assert L.kernel_bias_pattern([1, 1, 1, 512], {"q_shape": [1, 8, 512, 64]}) == (1, 0, 0, 1)
    assert L.kernel_bias_pattern([1, 1, 1, 512], None) == (0, 0, 0, 1)
    assert L.kernel_bias_pattern(None, {"q_shape": [1, 8, 512, 64]}) is None
    assert L.kernel_bias_pattern((), {"q_shape": [1, 8, 512, 64]}) == (0, 0, 0, 0)  # a scalar stays one
    assert L.kernel_bias_pattern([1, 1, 1, 1], {"q_shape": [1, 8, 512, 64]}) == (0, 0, 0, 0)


def test_launch_params_persistent_and_symbolic():
    static = {"head_dim": 128, "bias_shape": (-1, 1, 1, -1), "arch": 90}
    shapes = [[2, 16, 1000, 128], [2, 4, 1000, 128], [2, 4, 1000, 128], [2, 1, 1, 1000]]
    p = L.launch_params(OP, shapes, ["bfloat16"], _attrs(128, 1, 16, 4), static_shape=static)
    assert p.grid == (L.SM90_GRID, 1, 1) and p.block == (384, 1, 1)
    assert p.extra_args == [16, 4, 1000, 1000, 8 * 2 * 16]  # num_tiles = cdiv(Sq, 128) * B * H
    cfg = L.choose_config("bfloat16", 128, True, arch=90, pattern=(1, 0, 0, 1), scale=0.1)
    assert p.shared_mem == L.sm90_shared_mem(128, cfg, 2)
    p2 = L.launch_params(OP, shapes, ["bfloat16"], _attrs(128, 1, 16, 4),
                         static_shape=dict(static, sm_count=114))
    assert p2.grid == (114, 1, 1)
    # D = 64 without a mask: 192-row tiles, producer + three consumer warpgroups
    shapes64 = [[2, 16, 1000, 64], [2, 16, 1000, 64], [2, 16, 1000, 64]]
    p3 = L.launch_params(OP, shapes64, ["float16"], _attrs(64, 0, 16, 16),
                         static_shape={"head_dim": 64, "arch": 90})
    assert p3.block == (512, 1, 1) and p3.extra_args[-1] == 6 * 2 * 16  # cdiv(1000, 192) = 6
    cfg64 = L.choose_config("float16", 64, False, arch=90, scale=0.1)
    assert cfg64.block_m == 192 and p3.shared_mem == L.sm90_shared_mem(64, cfg64, 0)

    B, H, S = SymDim("B"), SymDim("H"), SymDim("S")
    sym = L.launch_params(OP, [[B, H, S, 128], [B, H, S, 128], [B, H, S, 128], [B, 1, 1, S]],
                          ["float16"], _attrs(128), cdiv=sym_cdiv, static_shape=static)
    assert sym.extra_args[-1].e == "(cdiv(S,128)*(B*H))"


def test_every_sweep_config_fits_shared_memory():
    for D in L.SM90_HEAD_DIMS:
        for causal in (0, 1):
            for cfg in L.candidate_configs("bfloat16", D, causal, arch=90):
                assert cfg.impl == "sm90"
                for mode in (0, 1, 2):
                    assert L.sm90_shared_mem(D, cfg, mode) <= 227 * 1024, (D, cfg, mode)


def _entry_params(art):
    """The PTX parameter types of the artifact's entry, in order."""
    entry = re.search(r"\.entry\s+" + re.escape(art.name) + r"\s*\((.*?)\)", art.ptx, re.S).group(1)
    return re.findall(r"\.param\s+\.(\w+)", entry)


@pytest.mark.parametrize("dtype,D,causal,bias,ones_sum,tma", [
    ("bfloat16", 128, 0, None, False, True),
    ("float16", 128, 1, (-1, 1, 1, -1), False, True),
    ("bfloat16", 128, 0, (-1, 1, 1, -1), False, True),  # 56-register producer: warps 1-3 sit out pure tiles
    ("bfloat16", 64, 1, (), True, True),  # D = 64: row sums on the tensor cores (m64n72 P V), the default
    ("float16", 64, 0, (-1, 1, 1, -1), True, True),  # three consumers with key padding (cp.async)
    ("bfloat16", 64, 0, None, True, True),  # three consumer warpgroups (160 registers each): no spills either
    ("float16", 64, 1, (-1, 1, 1, -1), False, True),  # the plain row sums, still a variant
    ("bfloat16", 64, 0, None, False, False),  # cp.async loads only
    ("float16", 128, 0, (1, 1, 1, -1), False, False),
])
def test_sm90a_compile(tmp_path, dtype, D, causal, bias, ones_sum, tma):
    pytest.importorskip("cuda.bindings.nvrtc")
    cfg = dataclasses.replace(L.sm90_config(D, causal), ones_sum=ones_sum, tma=tma)
    src = L.kernel_config(OP, dtype, _attrs(D, causal), {"head_dim": D, "bias_shape": bias, "arch": 90},
                          config=cfg)
    art = KernelCache(tmp_path).build(src, 90)
    assert art.arch == 90 and art.arch_suffix == "a" and art.cubin
    # QDP order: q, k, v[, bias] pointers, H, Hkv, Sq, Sk, num_tiles, o; no scratch pointers
    params = _entry_params(art)
    n_in = 3 + (bias is not None)
    assert params == ["u64"] * n_in + ["u32"] * 5 + ["u64"]
    assert art.n_scratch == 0
    for instr in ("wgmma.mma_async", "setmaxnreg.inc", "setmaxnreg.dec", "cp.async.mbarrier.arrive",
                  "ex2.approx"):
        assert instr in art.ptx, instr  # cp.async stays in the TMA build: its fallback
    # TMA: maps built on the device (no host-encoded map among the parameters), 3-D tile loads
    # (three consumer warpgroups with a key-padding bias keep cp.async: their 32-register producer
    # spills with both load paths)
    tma = tma and not (cfg.block_m == 192 and bias is not None and any(bias))
    assert ("TMA" in src.defines) == tma
    for instr in ("tensormap.replace", "tensormap.cp_fenceproxy", "cp.async.bulk.tensor.3d"):
        assert (instr in art.ptx) == tma, instr
    tool = cuobjdump()
    if tool:  # registers fit (no spills to local memory) and the tensor-core path is HGMMA
        res, sass = cubin_usage(tool, art, tmp_path)
        assert "STACK:0" in res and "LOCAL:0" in res, res
        assert "HGMMA.64x128x16.F32" in sass
        assert ("HGMMA.64x72x16.F32" in sass) == ones_sum
        assert "USETMAXREG" in sass
        assert ("UTMALDG.3D" in sass) == tma


@pytest.mark.parametrize("causal,bias,tma", [(0, None, True), (1, (), True), (1, None, False)])
def test_sm90a_compile_fp8(tmp_path, causal, bias, tma):
    """The FP8 path (E4M3 q, k, V^T; bf16 o): both products on E4M3 wgmma (QGMMA in SASS, no
    16-bit HGMMA), q_scale / k_scale / v_scale after the bias in the parameters, no spills."""
    pytest.importorskip("cuda.bindings.nvrtc")
    attrs = {**_attrs(128, causal), "output_dtype": "bfloat16"}
    cfg = dataclasses.replace(L.sm90_config(128, causal, fp8=True), tma=tma)
    src = L.kernel_config(OP, L.FP8, attrs, {"head_dim": 128, "bias_shape": bias, "arch": 90}, config=cfg)
    art = KernelCache(tmp_path).build(src, 90)
    assert _entry_params(art) == ["u64"] * (6 + (bias is not None)) + ["u32"] * 5 + ["u64"]
    mma = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.[\w.]+", art.ptx))
    assert mma == {"wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"}, mma
    assert "cvt.rn.satfinite.e4m3x2.f32" in art.ptx
    assert ("cp.async.bulk.tensor.3d" in art.ptx) == tma
    tool = cuobjdump()
    if tool:
        res, sass = cubin_usage(tool, art, tmp_path)
        assert "STACK:0" in res and "LOCAL:0" in res, res
        assert "QGMMA.64x128x32.F32.E4M3.E4M3" in sass and "HGMMA" not in sass


@pytest.mark.parametrize("dtype,D,causal,bias,block_m", [
    ("float16", 128, 1, (-1, 1, 1, -1), 128),  # 64-register producer: the key-padding scan with causal pairs
    ("bfloat16", 64, 0, None, 192),  # three consumer warpgroups, 32-register producer
    ("bfloat16", 64, 1, (-1, 1, 1, -1), 128),  # key padding with the scan ahead
    ("float16", 64, 0, None, 128),  # the waves rule's 128-row tiles
    (L.FP8, 128, 1, (), 128),  # E4M3: V^T's map has the keys as columns
])
def test_sm90a_compile_host_maps(tmp_path, dtype, D, causal, bias, block_m):
    """A HOST_MAPS build (launch_plan's): B after num_tiles, the three maps as 64-byte aligned
    128-byte parameters after o, prefetched; no map built or published on the device and no cp.async
    fallback left; no spills."""
    pytest.importorskip("cuda.bindings.nvrtc")
    fp8 = dtype == L.FP8
    attrs = {**_attrs(D, causal), **({"output_dtype": "bfloat16"} if fp8 else {})}
    static = {"head_dim": D, "bias_shape": bias, "arch": 90, "q_shape": [1, 1, 64 if block_m == 128 else 4096, D]}
    src = L.kernel_config(OP, dtype, attrs, static, host_maps=True)
    assert src.meta["config"]["block_m"] == block_m and src.defines["HOST_MAPS"] == "1"
    assert [t.pointer for t in src.tensor_maps] == [0, 1, 2]
    art = KernelCache(tmp_path).build(src, 90)
    assert art.tensor_maps == [t.spec() for t in src.tensor_maps]
    n_in = 3 + (bias is not None) + 3 * fp8
    assert _entry_params(art) == ["u64"] * n_in + ["u32"] * 6 + ["u64"] + ["align"] * 3
    assert len(re.findall(r"\.param \.align 64 \.b8 \w+\[128\]", art.ptx)) == 3
    assert art.ptx.count("prefetch.tensormap") == 3
    for instr in ("tensormap.replace", "tensormap.cp_fenceproxy", "cp.async.ca", "cp.async.cg",
                  "cp.async.mbarrier.arrive"):
        assert instr not in art.ptx, instr
    assert "cp.async.bulk.tensor.3d" in art.ptx
    tool = cuobjdump()
    if tool:
        res, sass = cubin_usage(tool, art, tmp_path)
        assert "STACK:0" in res and "LOCAL:0" in res, res
        assert "UTMALDG.3D" in sass


def test_host_maps_need_the_cuda_kernel_with_tma():
    """HOST_MAPS is a TMA build of the CUDA kernel: asked of a cp.async config or of the Triton
    kernel, kernel_config refuses."""
    static = {"head_dim": 64, "bias_shape": None, "arch": 90}
    with pytest.raises(ValueError, match="need TMA"):
        L.kernel_config(OP, "bfloat16", _attrs(64, 0), static,
                        config=dataclasses.replace(L.sm90_config(64, False), tma=False), host_maps=True)
    with pytest.raises(ValueError, match="sm_90 CUDA kernel"):
        L.kernel_config(OP, "bfloat16", _attrs(64, 0), {**static, "arch": 80}, host_maps=True)


def _map_layouts(step, pointers):
    from optfuse.kernels.launcher import tensor_map_layout

    return [tensor_map_layout(t, pointers, step.params.extra_args) for t in step.source.tensor_maps]


def test_host_maps_plan_is_the_one_kernel_with_host_maps():
    """At concrete shapes on sm_90, launch_plan runs the one kernel's HOST_MAPS build: the config the
    one-kernel path picks at those shapes, its extra args plus B, the op's inputs and output; the
    maps are the device-built ones ([B * H, Sq, D] and [B * Hkv, Sk, D], one 128-byte chunk by 64 /
    128 rows a box)."""
    B, H, Hkv, Sq, Sk, D = 2, 8, 2, 300, 517, 128
    shapes = [[B, H, Sq, D], [B, Hkv, Sk, D], [B, Hkv, Sk, D], None]
    attrs = _attrs(D, 1, H, Hkv)
    static = {"head_dim": D, "bias_shape": None, "arch": 90}
    plan = L.launch_plan(OP, shapes, ["bfloat16"], attrs, static_shape=static)
    (step,) = plan.steps
    one = L.kernel_config(OP, "bfloat16", attrs, {**static, "q_shape": shapes[0]})
    assert step.source.defines == {**one.defines, "HOST_MAPS": "1"} and step.source.name != one.name
    one_params = L.launch_params(OP, shapes, ["bfloat16"], attrs, static_shape=static)
    assert step.params.extra_args == one_params.extra_args + [B]
    assert [(b.kind, b.index) for b in step.inputs + step.outputs] == [("input", 0), ("input", 1), ("input", 2),
                                                                     ("output", 0)]
    assert plan.workspace_bytes == 0 and plan.state_bytes == 0
    q, k, v = _map_layouts(step, [0x10000, 0x20000, 0x30000, 0x40000])
    assert q == (0x10000, (D, Sq, B * H), (2 * D, 2 * D * Sq), (64, 64, 1))
    assert k == (0x20000, (D, Sk, B * Hkv), (2 * D, 2 * D * Sk), (64, 128, 1))
    assert v == (0x30000, (D, Sk, B * Hkv), (2 * D, 2 * D * Sk), (64, 128, 1))
    # D = 64 non-causal at few tiles: the waves rule's 128-row tiles, as the one-kernel path at these dims
    shapes64 = [[1, 2, 300, 64], [1, 2, 300, 64], [1, 2, 300, 64], None]
    plan64 = L.launch_plan(OP, shapes64, ["float16"], _attrs(64, 0, 2, 2), static_shape={**static, "head_dim": 64})
    assert plan64.steps[0].source.meta["config"]["block_m"] == 128
    # no plan: an empty key axis (no map of 0 keys), another target, or the maps asked off
    empty = [[B, H, Sq, D], [B, Hkv, 0, D], [B, Hkv, 0, D], None]
    assert L.launch_plan(OP, empty, ["bfloat16"], attrs, static_shape=static) is None
    assert L.launch_plan(OP, shapes, ["bfloat16"], attrs, static_shape={**static, "arch": 89}) is None
    assert L.launch_plan(OP, shapes, ["bfloat16"], attrs, static_shape=static, host_maps=False) is None


def test_host_maps_plan_fp8_and_block_sparse():
    """FP8: V^T's map has the Sk keys as columns, rows Skv (Sk rounded up to 16) bytes apart, boxes of
    128 keys by D rows; the scales are inputs 4-6. BlockSparseAttention: B after nnz."""
    B, H, Hkv, Sq, Sk, D = 3, 4, 2, 129, 45, 128
    shapes = [[B, H, Sq, D], [B, Hkv, Sk, D], [B, Hkv, D, 48], None, [1], [1], [1]]
    attrs = {**_attrs(D, 0, H, Hkv), "output_dtype": "bfloat16"}
    plan = L.launch_plan(OP, shapes, [L.FP8], attrs, static_shape={"head_dim": D, "bias_shape": None, "arch": 90})
    (step,) = plan.steps
    assert step.source.defines["FP8"] == "1" and [b.index for b in step.inputs] == [0, 1, 2, 4, 5, 6]
    q, k, vt = _map_layouts(step, [0x10000, 0x20000, 0x30000, 0x1000, 0x1010, 0x1020, 0x40000])
    assert q == (0x10000, (D, Sq, B * H), (D, D * Sq), (128, 64, 1))
    assert vt == (0x30000, (Sk, D, B * Hkv), (48, 48 * D), (128, 128, 1))
    bsa = dict(_attrs(D, 0, H, Hkv), layout_block=128)
    shapes = [[B, H, 300, D], [B, Hkv, 300, D], [B, Hkv, 300, D], None, [1, 4], [1, 6]]
    (step,) = L.launch_plan(L.BLOCK_SPARSE, shapes, ["float16"], bsa,
                            static_shape={"head_dim": D, "bias_shape": None, "arch": 90}).steps
    assert [b.index for b in step.inputs] == [0, 1, 2, 4, 5] and step.params.extra_args[5:] == [6, B]
    assert {t.heads for t in step.source.tensor_maps} == {"extra:6*extra:0", "extra:6*extra:1"}


def test_benchmarks_launch_what_the_plugin_launches():
    """testing.launch_sources (what the benchmarks' launch_fn launches): the plan's kernel where
    launch_plan makes one (BlockSparseAttention and FP8 included), a given config as its HOST_MAPS
    build where the plan takes that form, and the one kernel elsewhere (Triton, cp.async)."""
    import numpy as np

    T = plugin_module("flash_attention", "testing")
    B, H, S, D = 2, 4, 300, 64
    shapes = [(B, H, S, D)] * 3 + [None]
    attrs = _attrs(D, 1, H, H)
    plan = T.case_plan("bfloat16", shapes, attrs, arch=90)
    assert T.launch_sources("bfloat16", shapes, attrs) == [plan.steps[0].source]
    assert "host_maps" in plan.steps[0].source.name
    (device_maps,) = T.launch_sources("bfloat16", shapes, attrs, host_maps=False)
    assert device_maps == T.case_sources("bfloat16", shapes, attrs, arch=90)[0]
    (triton,) = T.launch_sources("bfloat16", shapes, attrs, arch=None)
    assert triton.lang == "triton"
    variant = dataclasses.replace(L.sm90_config(D, True), num_stages=3)
    (vsrc,) = T.launch_sources("bfloat16", shapes, attrs, config=variant)
    assert vsrc == T.case_sources("bfloat16", shapes, attrs, config=variant, arch=90, host_maps=True)[0]
    cp_async = dataclasses.replace(L.sm90_config(D, True), tma=False)
    assert T.launch_sources("bfloat16", shapes, attrs, config=cp_async) == [
        T.case_sources("bfloat16", shapes, attrs, config=cp_async, arch=90)[0]]
    layout = (np.zeros((1, 4), np.int32), np.zeros((1, 6), np.int32))
    bsa = {**_attrs(D, 0, H, H), "block_size": 128}
    (bsrc,) = T.launch_sources("bfloat16", shapes, bsa, layout=layout)
    assert bsrc == T.case_sources("bfloat16", shapes, bsa, arch=90, layout=layout, host_maps=True)[0]
    assert "host_maps" in bsrc.name and bsrc != T.launch_sources("bfloat16", shapes, _attrs(D, 0, H, H))[0]


@pytest.mark.parametrize("D,causal,bias,dtype", [(64, 0, None, "float16"), (64, 1, "keypad", "bfloat16"),
                                                 (128, 0, (), "bfloat16"), (128, 1, "keypad", "float16"),
                                                 (128, 1, None, "fp8")])
def test_runtime_host_maps_kernels_are_prebuilt(D, causal, bias, dtype):
    """Every HOST_MAPS build a plan asks for at run time (batches, heads and lengths from 1 to 16k,
    key padding per batch or shared) is in prebuild_sources(90), by name and by specialization:
    `optfuse kernels build` leaves nothing to compile at the first enqueue."""
    pre = {s.name: s for s in L.prebuild_sources(90)}
    dtype = L.FP8 if dtype == "fp8" else dtype
    attrs = {**_attrs(D, causal, 16, 4), **({"output_dtype": "bfloat16"} if dtype == L.FP8 else {})}
    seen = set()
    for B, Sq, Sk in ((1, 17, 17), (1, 77, 77), (8, 512, 512), (64, 197, 197), (1, 16384, 16384), (4, 4096, 5000)):
        b = None if bias is None else () if bias == () else (B, 1, 1, Sk) if B > 1 else (1, 1, 1, Sk)
        static = {"head_dim": D, "bias_shape": b, "arch": 90, "q": [B, 16, Sq, D]}
        v = [B, 4, D, -(-Sk // 16) * 16] if dtype == L.FP8 else [B, 4, Sk, D]
        shapes = [[B, 16, Sq, D], [B, 4, Sk, D], v, None if b is None else list(b)]
        shapes += [[1], [1], [1]] if dtype == L.FP8 else []
        plan = L.launch_plan(OP, shapes, [dtype], attrs, static_shape=static)
        if plan is None:  # the cp.async configs (D = 64 non-causal key padding)
            continue
        (step,) = plan.steps
        assert step.source.name in pre, step.source.name
        assert pre[step.source.name].spec_dict() == step.source.spec_dict()
        seen.add(step.source.name)
    assert seen or (D, causal, bias) == (64, 0, "keypad")


def test_bench_variants():
    bench = script_module("bench_attention")
    variants = bench.parse_variants("softmax_stream=0;block_m=192,num_warps=16")
    assert variants == [("softmax_stream=0", {"softmax_stream": False}),
                        ("block_m=192,num_warps=16", {"block_m": 192, "num_warps": 16})]
    for bad in ("num_stages=x", "no_such_field=1", "pingpong", "pingpong=0", "q_buffers=1", "lazy_rescale=0"):
        with pytest.raises(SystemExit):
            bench.parse_variants(bad)
    # over the shipped config of the case; one the kernel does not take there is left out
    at128 = bench.variant_configs("bfloat16", 128, False, variants)
    assert [name for name, _ in at128] == ["softmax_stream=0"]
    assert at128[0][1] == L.sm90_config(128, False, softmax_stream=False)
    at64 = dict(bench.variant_configs("bfloat16", 64, True, variants))
    assert at64["block_m=192,num_warps=16"].block_m == 192 and not at64["softmax_stream=0"].softmax_stream
    assert bench.variant_configs("float32", 64, True, variants) == []  # no CUDA kernel for fp32
    # variants are built (and timed) for the mask rows too, over the key-padding default config
    srcs = bench.build_sources(sweep=False, tests=False, arch=90, variants=bench.parse_variants("tma=0"))
    keypad = [s for s in srcs if s.lang == "cuda" and s.meta["bias_pattern"] == (1, 0, 0, 1)]
    cp_async = [s for s in keypad if not s.meta["config"]["tma"]]
    assert {(s.meta["head_dim"], s.meta["causal"]) for s in cp_async} == {
        (D, c) for D in (64, 128) for c in (False, True)}
    assert {s.meta["dtype"] for s in cp_async if s.meta["head_dim"] == 128} == {bench.MASK_DTYPE}
    with pytest.raises(SystemExit) as exc:  # a usage error, before any GPU work
        bench.main(["--causal", "2"])
    assert exc.value.code == 2


def test_profile_script_phases_and_summary():
    """scripts/profile_attention.py: its phase names are the kernel's PR_* counters, the profiled
    source only adds PROFILE and the second output, and the shares add up per role."""
    np = pytest.importorskip("numpy")
    prof = script_module("profile_attention")
    names = prof.phase_names()
    assert "N" not in names and {"TOTAL", "TILES", "BLOCKS", "KV_LATE"} <= set(names)
    assert set(prof.CONSUMER_PHASES) <= set(names) and set(prof.PRODUCER_PHASES) <= set(names)
    assert len(names) == len(set(names)) == 15
    src = L.kernel_config(OP, "bfloat16", _attrs(64, 1), {"head_dim": 64, "arch": 90})
    p = prof.profiled(src)
    assert p.defines == {**src.defines, "PROFILE": "1"} and p.n_outputs == 2 and src.n_outputs == 1
    # 2 CTAs x 8 warps (4 producer, 4 consumer); consumer warp 7 of CTA 1 sat out (all zero)
    c = np.zeros((2, 8, len(names)))
    i = {n: k for k, n in enumerate(names)}
    c[:, :4, i["TOTAL"]], c[:, :4, i["WAIT_KV"]], c[:, :4, i["ISSUE"]] = 100, 60, 30
    c[:, 4:, i["TOTAL"]], c[:, 4:, i["SOFTMAX"]], c[:, 4:, i["TURN"]] = 200, 120, 50
    c[:, 4:, i["TILES"]], c[:, 4:, i["BLOCKS"]], c[:, 4:, i["KV_LATE"]] = 2, 5, 1
    c[1, 7, :] = 0
    share = prof.summarize(c, names, 8)
    assert share["producer"]["WAIT_KV"] == pytest.approx(0.6) and share["producer"]["other"] == pytest.approx(0.1)
    assert share["consumer"]["SOFTMAX"] == pytest.approx(0.6) and share["consumer"]["TURN"] == pytest.approx(0.25)
    assert share["consumer"]["blocks_per_tile"] == pytest.approx(2.5)
    assert share["consumer"]["kv_late_per_block"] == pytest.approx(0.2)
    assert share["consumer"]["cycles_per_warp"] == pytest.approx(200)
    assert prof.parse_shapes("512:64:1,4096:128:0") == [(512, 64, 1), (4096, 128, 0)]
    for bad in ("512:64", "512:96:0", "500:64:0", "512:64:2", "x:64:0"):
        with pytest.raises(ValueError):
            prof.parse_shapes(bad)


def test_ones_sum_only_at_d64():
    cfg = dataclasses.replace(L.sm90_config(128, False), ones_sum=True)
    with pytest.raises(ValueError, match="ones_sum only at head_dim 64"):
        L.kernel_config(OP, "bfloat16", _attrs(128), {"head_dim": 128, "arch": 90}, config=cfg)
    c64 = L.sm90_config(64, True)
    assert c64.ones_sum and not L.sm90_config(128, True).ones_sum  # the D = 64 default
    src = L.kernel_config(OP, "bfloat16", _attrs(64, 1), {"head_dim": 64, "arch": 90})
    assert src.defines["ONES_SUM"] == "1"
    assert src.name.endswith("/fa_sm90_d64_causal_nobias_3wg_3stages_tma_ones_sum_kv_one_full_softmax_stream")
    # the ones tile (128 rows of 128 bytes) counts in the shared memory the launch asks for
    off = dataclasses.replace(c64, ones_sum=False)
    assert L.sm90_shared_mem(64, c64, 0) == L.sm90_shared_mem(64, off, 0) + 128 * 128
    assert "ONES_SUM" not in L.kernel_config(OP, "bfloat16", _attrs(64, 1), {"head_dim": 64, "arch": 90},
                                             config=off).defines


def test_kv_one_full_follows_the_ring_depth():
    """One "full" barrier for K and V needs a third ring stage (README "Tried"): the default
    follows the stages unless set."""
    assert L.sm90_config(64, True).kv_one_full and not L.sm90_config(128, True).kv_one_full
    assert not L.sm90_config(64, False, stages=2).kv_one_full
    assert L.sm90_config(128, False, stages=3).kv_one_full
    assert not L.sm90_config(64, False, kv_one_full=False).kv_one_full
    off = L.kernel_config(OP, "float16", _attrs(64), {"head_dim": 64, "arch": 90},
                          config=L.sm90_config(64, False, kv_one_full=False))
    assert "KV_ONE_FULL" not in off.defines
    assert off.name.endswith("_3wg_3stages_tma_ones_sum_softmax_stream")  # no kv_one_full


def test_softmax_stream_where_it_measured_faster():
    """The softmax as one instruction stream (README "Tried"): on at D = 64 (every mask) and
    for D = 128 non-causal without a key bias; off for D = 128 causal or with key padding (neutral
    there and 0.97-0.99x on the mask rows); one define, one name tag."""
    for causal in (False, True):
        for keypad in (False, True):
            assert L.sm90_config(64, causal, keypad=keypad).softmax_stream
    assert L.sm90_config(128, False).softmax_stream
    assert not L.sm90_config(128, True).softmax_stream
    assert not L.sm90_config(128, False, keypad=True).softmax_stream
    assert not L.sm90_config(64, True, softmax_stream=False).softmax_stream
    for pattern, on in ((None, True), ((1, 1, 1, -1), False)):
        src = L.kernel_config(OP, "bfloat16", _attrs(128), {"head_dim": 128, "bias_shape": pattern, "arch": 90})
        assert (src.defines.get("SOFTMAX_STREAM") == "1") == on and src.name.endswith("_softmax_stream") == on
