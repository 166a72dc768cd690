"""The split-KV decode plan on CPU: launch.py's dispatch, the split size rule, the plan's
buffers, workspace (its bound over a TensorRT profile) and state, symbolic launch parameters, the
glue's plans, the launcher's plan steps and the classic plugin's workspace size, state and
enqueue (CUDA stubbed out)."""

from __future__ import annotations

import itertools
import types

import pytest

from optfuse.kernels.artifact import Buffer, LaunchPlan
from optfuse.kernels.registry import plugin_module
from optfuse.kernels.testing import SymDim, sym_cdiv

T = plugin_module("flash_attention", "testing")
L = plugin_module("flash_attention", "launch")
LD = plugin_module("flash_attention", "launch_decode")


def _plan(B, H, Hkv, Sq, Sk, D=128, causal=1, bias=None, dtype="bfloat16", **kw):
    return T.case_plan(dtype, [(B, H, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, D), bias],
                       T.attrs_for(H, Hkv, D, causal), **kw)


@pytest.mark.parametrize("Sq,Sk", [(1, 512), (1, 131072), (4, 1025), (16, 8192), (16, 600)])
@pytest.mark.parametrize("bias", ["none", "scalar", "keypad", "keypad_shared"])
def test_decode_shapes_take_the_plan(Sq, Sk, bias):
    B = 3
    shape = {"none": None, "scalar": (), "keypad": (B, 1, 1, Sk), "keypad_shared": (1, 1, 1, Sk)}[bias]
    plan = _plan(B, 32, 8, Sq, Sk, bias=shape)
    assert plan is not None
    (split,) = plan.steps  # one kernel: the last split of each row block combines
    assert split.source.entry == LD.SPLIT_ENTRY and not split.source.constexprs["DIRECT"]
    assert split.inputs == [Buffer("input", i) for i in range(3 + (shape is not None))]
    assert [b.kind for b in split.outputs] == ["workspace"] * 3 + ["state", "output"]
    assert split.outputs[3:] == [Buffer("state", 0), Buffer("output", 0)]
    rows = 4 * Sq  # G = 32 / 8 query heads per kv head, Sq rows each
    block_m = min(64, max(16, 1 << (rows - 1).bit_length()))
    units = -(-rows // block_m) * B * 8  # 24
    split_keys = split.source.constexprs["SPLIT_KEYS"]
    assert split_keys == LD.split_keys_for(units, Sk)
    # 131072 keys: 4096 would make 768 programs (a little over a wave); 16 x 8192: 1024 -> 192
    want = {(1, 512): 128, (1, 131072): 2048, (4, 1025): 128, (16, 8192): 1024, (16, 600): 128}
    assert split_keys == want[(Sq, Sk)]
    n_split = -(-Sk // split_keys)
    assert split.source.constexprs["BLOCK_M"] == block_m
    assert split.params.grid == (-(-rows // block_m) * n_split * B * 8, 1, 1)
    assert split.params.extra_args == [32, 8, Sq, Sk]
    # one int32 arrival counter per (b, kv head, row block), 256-byte aligned
    assert plan.state_bytes == -(-(units * 4) // 256) * 256


@pytest.mark.parametrize("units,Sk,want", [
    (8, 1024, 128),       # B = 1, GQA 32/8: 64 programs even at 128 keys -> the smallest size
    (8, 2048, 128),       # 128 programs
    (8, 8192, 512),       # 128 programs of 512 keys
    (8, 32768, 2048),
    (8, 131072, 4096),    # 256 programs of the longest size
    (128, 16384, 16384),  # B = 16: 128 programs of every key (the direct kernel); 4096 -> 512 programs
    (512, 4096, 2048),    # B = 64: 1024 programs; one split (512 programs) is a little over a wave
    (512, 8192, 4096),
    (2048, 4096, 4096),   # B = 256: one split, 2048 programs
    (2048, 1024, 1024),
])
def test_split_size_rule(units, Sk, want):
    """split_keys_for: the largest size (or every key) keeping >= MIN_PROGRAMS programs, skipping
    grids a little over one wave (the H100 sweep of the README's decode section)."""
    assert LD.split_keys_for(units, Sk) == want
    programs = units * -(-Sk // want)
    assert programs >= LD.MIN_PROGRAMS or want == LD.SPLIT_SIZES[0]
    assert not LD.RESIDENT_PROGRAMS < programs < 2 * LD.RESIDENT_PROGRAMS


def test_one_split_is_the_direct_kernel():
    """B = 16 over 16k keys: one split of every key -- the direct kernel writes o, no workspace or state."""
    plan = _plan(16, 32, 8, 1, 16384)
    (step,) = plan.steps
    assert step.source.constexprs["DIRECT"] and step.source.meta["kernel"] == "decode_direct"
    assert step.outputs == [Buffer("output", 0)] and plan.workspace_bytes == 0 and plan.state_bytes == 0
    assert step.params.grid == (16 * 8, 1, 1)


def test_workspace_holds_the_partials_without_overlap():
    B, H, Hkv, Sq, Sk, D = 2, 32, 8, 3, 1000, 80
    plan = _plan(B, H, Hkv, Sq, Sk, D=D)
    part, row_max, row_sum = (b.index for b in plan.steps[0].outputs[:3])
    slots = B * H * Sq * -(-Sk // plan.steps[0].source.constexprs["SPLIT_KEYS"])
    assert part == 0 and row_max >= slots * D * 4 and row_sum >= row_max + slots * 4
    assert plan.workspace_bytes >= row_sum + slots * 4
    assert all(x % LD.WORKSPACE_ALIGN == 0 for x in (row_max, row_sum, plan.workspace_bytes))


@pytest.mark.parametrize("op,Sq,Sk,bias", [
    ("FlashAttention", 17, 4096, None),             # prefill: the one-kernel path, unchanged
    ("FlashAttention", 1, 511, None),               # a short cache: one split would be all
    ("FlashAttention", 1, 4096, (2, 32, 1, 4096)),  # a per-head bias
    ("FlashAttention", 4, 4096, (2, 1, 4, 4096)),   # a per-query bias
    ("FlashAttention", 4, 4096, (2, 32, 4, 4096)),  # a full bias
    ("BlockSparseAttention", 1, 4096, None),        # the block-sparse op
])
def test_other_shapes_do_not_decode(op, Sq, Sk, bias):
    """No decode plan: the one kernel, as its HOST_MAPS build where that is the CUDA kernel with
    TMA (no bias or a scalar one here), else no plan (a per-head, per-query or full bias: Triton)."""
    attrs = T.attrs_for(32, 8, 128, 1)
    shapes = [[2, 32, Sq, 128], [2, 8, Sk, 128], [2, 8, Sk, 128], None if bias is None else list(bias)]
    if op != L.OP:
        attrs = dict(attrs, layout_block=128)
        shapes += [[1, 2 * 32 + 1], [1, 4]]
    static = {"head_dim": 128, "bias_shape": bias, "arch": 90}
    plan = L.launch_plan(op, shapes, ["bfloat16"], attrs, static_shape=static)
    if bias is None:
        assert [s.source.defines.get("HOST_MAPS") for s in plan.steps] == ["1"]
    else:
        assert plan is None
    assert L.launch_plan(op, shapes, ["bfloat16"], attrs, static_shape=static, host_maps=False) is None


def test_symbolic_shapes_keep_one_kernel_and_qdp_params():
    """QDP's symbolic shapes never decode (the plan is made at run time, at concrete shapes), and
    launch_params of a decode shape is still the one kernel's (what QDP AOT embeds)."""
    B, Sq, Sk = SymDim("B"), SymDim("Sq"), SymDim("Sk")
    attrs = T.attrs_for(32, 8, 128, 1)
    assert L.launch_plan(L.OP, [[B, 32, Sq, 128], [B, 8, Sk, 128], [B, 8, Sk, 128], None], ["bfloat16"], attrs,
                         static_shape={"head_dim": 128, "bias_shape": None}) is None
    src, params = T.case_sources("bfloat16", [(1, 32, 1, 128), (1, 8, 8192, 128), (1, 8, 8192, 128), None], attrs,
                                 arch=90)
    assert src.entry == L.SM90_ENTRY and len(params.extra_args) == 5


def test_decode_launch_params_are_shape_expressions():
    """The split count, the grid, the workspace layout and the state use only + - * and cdiv."""
    B, H, Hkv, Sq, Sk = (SymDim(n) for n in ("B", "H", "Hkv", "Sq", "Sk"))
    cfg = LD.DecodeConfig()
    sp = LD.split_params(B, H, Hkv, Sq, Sk, 4, 16, cfg, cdiv=sym_cdiv)
    assert repr(sp.grid[0]) == "((cdiv((4*Sq),16)*cdiv(Sk,256))*(B*Hkv))"
    assert repr(LD.state_bytes(B, Hkv, 4, Sq, 16, cdiv=sym_cdiv)) == "(cdiv((((B*Hkv)*cdiv((4*Sq),16))*4),256)*256)"
    layout = LD.workspace_layout(B, H, Sq, Sk, 128, cfg, cdiv=sym_cdiv)
    assert "cdiv(Sk,256)" in repr(layout[3])


def test_workspace_bound_covers_every_shape_of_the_profile():
    """TensorRT asks for the workspace once, for the profile: it must hold the plan of every
    shape in it (Sq from 1 up to past the decode limit, Sk across the threshold)."""
    attrs = T.attrs_for(8, 2, 64, 1)
    lo_q, hi_q, lo_k, hi_k = [1, 8, 1, 64], [3, 8, 40, 64], [1, 2, 100, 64], [3, 2, 1300, 64]
    for bias in (None, (3, 1, 1, 1300)):
        mins = [lo_q, lo_k, lo_k] + ([[1, 1, 1, 100]] if bias else [None])
        maxs = [hi_q, hi_k, hi_k] + ([list(bias)] if bias else [None])
        bound = L.workspace_bytes(L.OP, mins, maxs, ["float16"], attrs)
        biggest = 0
        for B, Sq, Sk in itertools.product((1, 2, 3), (1, 7, 16, 17, 40), (100, 511, 512, 777, 1300)):
            plan = T.case_plan("float16", [(B, 8, Sq, 64), (B, 2, Sk, 64), (B, 2, Sk, 64),
                                           None if bias is None else (B, 1, 1, Sk)], attrs)
            if plan is not None:
                biggest = max(biggest, plan.workspace_bytes)
        assert 0 < biggest == bound


def test_workspace_is_zero_where_nothing_decodes():
    attrs = T.attrs_for(8, 2, 64, 1)
    q, k = [2, 8, 64, 64], [2, 2, 4096, 64]
    assert L.workspace_bytes(L.OP, [[1, 8, 17, 64], k, k, None], [q, k, k, None], ["float16"], attrs) == 0
    short = [2, 2, 511, 64]
    assert L.workspace_bytes(L.OP, [[1, 8, 1, 64], short, short, None], [q, short, short, None], ["float16"],
                             attrs) == 0
    full = [2, 8, 64, 4096]
    assert L.workspace_bytes(L.OP, [[1, 8, 1, 64], k, k, full], [q, k, k, full], ["float16"], attrs) == 0
    assert L.workspace_bytes(L.BLOCK_SPARSE, [[1, 8, 1, 64], k, k, None, [1, 2], [1, 4]],
                             [q, k, k, None, [1, 2], [1, 4]], ["float16"], {**attrs, "block_size": 128}) == 0


def test_decode_config_checks_its_tiles():
    with pytest.raises(ValueError, match="does not divide"):
        LD.DecodeConfig(split_keys=256, block_n=96)
    fp32 = LD.decode_config("float32", 64)
    assert (fp32.block_n, fp32.block_m, fp32.combine_rows) == (16, 16, 1)
    assert LD.decode_config("bfloat16", 256).block_n == 32 and LD.decode_config("bfloat16", 256).combine_rows == 2
    assert LD.SPLIT_KEYS % LD.decode_config("float16", 128).block_n == 0


# -- glue, launcher and the classic plugin, with the compile and CUDA stubbed out ---------------
# (plugins/conftest.py: stub_cuda, fake_artifact, classic_plugin)
def test_glue_resolve_plan_decode_or_prefill(stub_cuda):
    from optfuse.trt import glue

    attrs = T.attrs_for(32, 8, 128, 1)
    q, kv = [2, 32, 1, 128], [2, 8, 4096, 128]
    plan = glue.resolve_plan(L.OP, [q, kv, kv, [2, 1, 1, 4096]], ["bfloat16"] * 4, attrs, arch=90)
    assert [s.artifact.name for s in plan.steps] == [LD.SPLIT_ENTRY]
    assert plan.workspace_bytes > 0 and plan.state_bytes > 0
    prefill = glue.resolve_plan(L.OP, [[2, 32, 300, 128], kv, kv, None], ["bfloat16"] * 3, attrs, arch=90)
    (step,) = prefill.steps
    assert step.artifact.name == L.SM90_ENTRY and prefill.workspace_bytes == 0
    assert step.inputs == [Buffer("input", i) for i in range(3)] and step.outputs == [Buffer("output", 0)]
    ln = glue.resolve_plan("LayerNorm", [[4, 64], [64], [64]], ["float16"] * 3, {}, arch=90)
    assert len(ln.steps) == 1 and ln.workspace_bytes == 0
    assert glue.workspace_size("LayerNorm", [[1, 64], [64], [64]], [[4, 64], [64], [64]], ["float16"] * 3, {}) == 0


def test_launch_plan_resolves_buffers_in_order(stub_cuda, fake_artifact):
    from optfuse.kernels import launcher

    plan = _plan(1, 8, 2, 1, 1024, D=64, bias=(1, 1, 1, 1024), dtype="float16")
    for step in plan.steps:
        step.artifact = fake_artifact(step.source)
    launcher.launch_plan(plan, [0x1000, 0x2000, 0x3000, 0x4000], [0x9000], workspace=0x100000, stream=7,
                         state=0x700000)
    ((name, _, ins, outs),) = stub_cuda
    offsets = [b.index for b in plan.steps[0].outputs[:3]]
    assert name == LD.SPLIT_ENTRY
    assert ins == [0x1000, 0x2000, 0x3000, 0x4000]
    assert outs == [0x100000 + o for o in offsets] + [0x700000, 0x9000]
    with pytest.raises(ValueError, match="workspace"):
        launcher.launch_plan(plan, [0x1000, 0x2000, 0x3000, 0x4000], [0x9000], workspace=0, state=0x700000)
    with pytest.raises(ValueError, match="state"):
        launcher.launch_plan(plan, [0x1000, 0x2000, 0x3000, 0x4000], [0x9000], workspace=0x100000)
    unbuilt = LaunchPlan([plan.steps[0].__class__(plan.steps[0].source, plan.steps[0].params, [], [])])
    with pytest.raises(ValueError, match="no built artifact"):
        launcher.launch_plan(unbuilt, [], [])


@pytest.fixture
def fa_plugin(classic_plugin):
    return classic_plugin(L.OP, T.attrs_for(32, 8, 128, 1))


def _dyn(lo, hi, dtype="BF16"):
    return types.SimpleNamespace(min=lo, max=hi, desc=types.SimpleNamespace(type=types.SimpleNamespace(name=dtype)))


def test_classic_plugin_workspace_size_from_the_profile(fa_plugin):
    """get_workspace_size: the decode partials at the profile's largest decoding shape (Sq capped
    at 16, B and Sk at their max) with the smallest split size, 0 for a prefill-only profile."""
    plugin = fa_plugin
    kv_lo, kv_hi = [1, 8, 1, 128], [4, 8, 32768, 128]
    decode = [_dyn([1, 32, 1, 128], [4, 32, 64, 128]), _dyn(kv_lo, kv_hi), _dyn(kv_lo, kv_hi)]
    want = LD.workspace_layout(4, 32, 16, 32768, 128, LD.DecodeConfig(split_keys=LD.SPLIT_SIZES[0]))[3]
    assert plugin.get_workspace_size(decode, []) == want > 0
    prefill = [_dyn([1, 32, 64, 128], [4, 32, 4096, 128]), _dyn(kv_lo, kv_hi), _dyn(kv_lo, kv_hi)]
    assert plugin.get_workspace_size(prefill, []) == 0


def test_classic_plugin_state_and_enqueue(stub_cuda, fa_plugin, monkeypatch):
    """on_shape_change allocates the instance's state (zeroed) for the decode plan; enqueue passes
    it with TensorRT's workspace; a clone (another execution context) gets a state of its own; a
    prefill shape needs none."""
    from optfuse.kernels import launcher

    allocs = []

    def ensure(self, nbytes):
        if nbytes > self.nbytes:
            self.ptr, self.nbytes = 0x500000 + 0x10000 * len(allocs), nbytes
            allocs.append(nbytes)
        return self.ptr

    monkeypatch.setattr(launcher.DeviceState, "ensure", ensure)
    monkeypatch.setattr(launcher.DeviceState, "free", lambda self: None)
    plugin = fa_plugin
    bf16 = types.SimpleNamespace(name="BF16")
    descs = [types.SimpleNamespace(dims=d, type=bf16) for d in ([2, 32, 1, 128], [2, 8, 5000, 128], [2, 8, 5000, 128])]
    plugin.on_shape_change(descs, [])
    want = LD.state_bytes(2, 8, 4, 1, 16)
    assert allocs == [want] and plugin._state.ptr == 0x500000
    plugin.enqueue(descs, [], [0x1000, 0x2000, 0x3000], [0x9000], 0x200000, 5)
    assert allocs == [want]  # enqueue reuses it
    ((name, _, ins, outs),) = stub_cuda
    assert name == LD.SPLIT_ENTRY and ins == [0x1000, 0x2000, 0x3000]
    assert all(p >= 0x200000 for p in outs[:3]) and outs[3:] == [0x500000, 0x9000]
    other = plugin.clone()
    other.on_shape_change(descs, [])
    assert other._state is not plugin._state and other._state.ptr == 0x510000
    stub_cuda.clear()
    descs[0] = types.SimpleNamespace(dims=[2, 32, 300, 128], type=bf16)
    plugin.enqueue(descs, [], [0x1000, 0x2000, 0x3000], [0x9000], 0, 5)
    assert [c[0] for c in stub_cuda] == [L.SM90_ENTRY]  # prefill: one launch, no workspace
    assert stub_cuda[0][2] == [0x1000, 0x2000, 0x3000] and stub_cuda[0][3] == [0x9000]


def test_benchmark_decode_rows_run_the_plan():
    """scripts/bench_attention_shapes.py's decode rows all go through the split-KV plan, with the
    default config and every config of its --sweep-decode."""
    from optfuse.plugin_dirs import script_module

    bench = script_module("bench_attention_shapes")
    rows = [s for s in bench.SHAPES if s[0].startswith("decode")]
    assert len(rows) >= 10 and {r[1] for r in rows} >= {1, 64, 256}
    for name, B, H, Hkv, Sq, Sk, D, causal, pad in rows:
        bias = (B, 1, 1, Sk) if pad else None
        for cfg in [None] + LD.candidate_decode_configs("bfloat16", D):
            assert _plan(B, H, Hkv, Sq, Sk, D=D, causal=causal, bias=bias, decode=cfg) is not None, name


def test_benchmark_contender_keys_differ_where_configs_differ():
    """Each decode contender of the benchmark is keyed by its config's tag: configs that differ in
    any field (the combine tile included) must not share a key, or one's times overwrite the other's."""
    import dataclasses

    from optfuse.plugin_dirs import script_module

    bench = script_module("bench_attention_shapes")
    rule = LD.plan_config("bfloat16", 128, 64, 32, 8, 1, 4096)
    configs = [rule, dataclasses.replace(rule, num_stages=2), dataclasses.replace(rule, combine_rows=2),
               dataclasses.replace(rule, combine_rows=2, num_stages=2), dataclasses.replace(rule, combine_splits=8)]
    configs += LD.candidate_decode_configs("bfloat16", 128)
    configs = list(dict.fromkeys(configs))
    assert len({bench._config_tag(c) for c in configs}) == len(configs)


# B, H, Hkv, Sk, key padding: B = 1 and 64, caches of 1k..128k keys, GQA 32/8 and MHA
_RUNTIME_DECODE = [
    (1, 32, 8, 1024, False), (1, 32, 8, 4096, True), (1, 32, 8, 32768, False), (1, 32, 8, 131072, True),
    (64, 32, 8, 1024, True), (64, 32, 8, 4096, False), (64, 32, 8, 16384, True), (64, 32, 8, 131072, False),
    (1, 32, 8, 16384, True), (1, 32, 32, 2048, True), (1, 32, 32, 65536, False), (64, 32, 32, 8192, True),
    (64, 16, 16, 1024, False),
]


@pytest.mark.parametrize("arch", [90, None])
@pytest.mark.parametrize("D,causal,dtype", [(128, 1, "bfloat16"), (64, 0, "float16")])
def test_runtime_decode_kernels_are_prebuilt(arch, D, causal, dtype):
    """Every kernel a decode step asks for at run time (Sq = 1; the plan for concrete shapes on
    the target) is in prebuild_sources of that target, by name and by specialization (the cache
    key's spec: signature, constexprs, tiles): `optfuse kernels build` leaves nothing to compile
    at the first enqueue."""
    pre = {s.name: s for s in L.prebuild_sources(arch)}
    assert len(pre) == len(L.prebuild_sources(arch))  # no name twice
    sizes = set()
    for B, H, Hkv, Sk, pad in _RUNTIME_DECODE:
        for bias in ((B, 1, 1, Sk) if pad else None, () if not pad else (1, 1, 1, Sk)):
            plan = _plan(B, H, Hkv, 1, Sk, D=D, causal=causal, bias=bias, dtype=dtype, arch=arch)
            assert plan is not None
            for step in plan.steps:
                src = step.source
                assert src.name in pre, (B, H, Hkv, Sk, bias)
                assert pre[src.name].spec_dict() == src.spec_dict(), src.name
            sizes.add(plan.steps[0].source.constexprs["SPLIT_KEYS"])
    assert sizes == {0, *LD.SPLIT_SIZES}  # the shapes reach every split size and the direct kernel


@pytest.mark.parametrize("arch", [None, 80, 89, 90])
def test_prebuilt_decode_kernels(arch):
    """The decode part of prebuild_sources: per (dtype, D, causal, bias pattern) one split kernel
    per split size and one direct kernel (BLOCK_M 16: Sq = 1 with G <= 16), the same on every target."""
    srcs = [s for s in L.prebuild_sources(arch) if s.entry == LD.SPLIT_ENTRY]
    split = [s for s in srcs if not s.constexprs["DIRECT"]]
    direct = [s for s in srcs if s.constexprs["DIRECT"]]
    assert len(split) == 2 * 2 * 2 * 4 * len(LD.SPLIT_SIZES) and len(direct) == 2 * 2 * 2 * 4
    assert {s.constexprs["SPLIT_KEYS"] for s in split} == set(LD.SPLIT_SIZES)
    assert {s.constexprs["SPLIT_KEYS"] for s in direct} == {0}
    assert {s.constexprs["BLOCK_M"] for s in split + direct} == {16}
    assert {s.name for s in srcs} == {s.name for s in L.prebuild_sources(90) if s.entry == LD.SPLIT_ENTRY}


def test_split_kernel_compiles_with_the_arrival_counter(tmp_path):
    """The sm_90 build releases the partials and acquires the others' with one GPU-scope atomic
    add after a CTA barrier, resets the counter, and reads the partials from L2."""
    pytest.importorskip("triton")
    from optfuse.kernels import KernelCache

    (split,) = _plan(1, 32, 8, 1, 8192, arch=90).steps
    ptx = KernelCache(tmp_path).build(split.source, 90).ptx
    assert "atom.global.gpu.acq_rel.add" in ptx and "atom.global.gpu.relaxed.exch" in ptx
    assert "bar.sync" in ptx and "ld.global.cg" in ptx
