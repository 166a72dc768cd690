"""FlashAttention AOT artifacts launched through optfuse.kernels.launcher on a GPU, against the
float64 NumPy reference. Fresh random inputs every run (the seed is printed); outputs are poisoned
with NaN before each launch so unwritten elements fail.

Run on the device machine: ``python -m pytest plugins/flash_attention -m gpu``. With
``$OPTFUSE_FA_PREBUILT`` pointing at a KernelCache root built on the CPU machine (Triton 3.9 cubins
for sm_90), those artifacts are used; otherwise they are compiled with the local Triton.
"""

import dataclasses
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from optfuse.kernels.registry import plugin_module  # noqa: E402

T = plugin_module("flash_attention", "testing")
L = plugin_module("flash_attention", "launch")

pytestmark = pytest.mark.gpu

# (B, H, Hkv, Sq, Sk, D, causal, bias_shape, dtype, poison): shapes chosen so that Sq and Sk are
# not multiples of the tiles (64/128) and the causal band, GQA and every bias pattern appear.
CASES = [
    (2, 8, 2, 300, 517, 128, 0, None, "bfloat16", None),
    (2, 8, 2, 517, 300, 128, 1, None, "bfloat16", None),          # Sk < Sq: dead rows -> 0
    (1, 4, 4, 1000, 1000, 128, 1, None, "float16", None),
    (3, 6, 3, 257, 383, 64, 0, (3, 1, 1, 383), "float16", "pad"),  # key padding, finfo.min
    (2, 4, 1, 129, 700, 64, 1, (2, 1, 1, 700), "bfloat16", "pad"),
    (2, 4, 4, 200, 190, 64, 0, (2, 4, 200, 190), "float16", "rows"),  # full bias, -inf rows
    (1, 4, 2, 333, 333, 32, 1, None, "float16", None),
    (2, 2, 2, 150, 260, 80, 0, None, "bfloat16", None),           # padded head dims
    (2, 2, 1, 260, 150, 96, 1, (150,), "float16", None),
    (1, 2, 2, 190, 310, 256, 0, (), "bfloat16", None),            # scalar bias (rewrite's 0)
    (1, 2, 2, 190, 310, 256, 1, None, "float16", None),
    (2, 2, 1, 77, 91, 64, 1, (2, 2, 77, 91), "float32", "rows"),
    (1, 2, 2, 65, 130, 96, 0, None, "float32", None),
    # longer runs of the CUDA kernel's K/V ring (wraps several times), small Sq, Sk < Sq
    (2, 8, 8, 1024, 1024, 128, 0, (), "bfloat16", None),
    (1, 4, 2, 2000, 2000, 128, 1, (1, 1, 1, 2000), "float16", "pad"),
    (2, 4, 4, 64, 1500, 64, 0, None, "bfloat16", None),
    (2, 2, 2, 1500, 64, 128, 1, None, "float16", None),
    (1, 4, 1, 777, 1900, 64, 1, (1, 1, 1, 1900), "bfloat16", "pad"),
    # causal D = 64 from Sq = 4096 on: the third consumer warpgroup joins (SQ_THREE), 192-row tiles
    (1, 2, 1, 4100, 4100, 64, 1, None, "bfloat16", None),
    (1, 2, 2, 4200, 4400, 64, 1, (), "float16", None),
    # causal D = 64 with Sk < Sq: whole tiles and single warpgroups of dead rows (-> 0)
    (2, 4, 2, 700, 450, 64, 1, None, "float16", None),
    # causal with several rounds of tile pairs per CTA (512 pairs on 132 CTAs; the cases above have
    # at most one round); odd query-block count with Sk > Sq
    (8, 16, 4, 1024, 1024, 64, 1, None, "bfloat16", None),
    (8, 16, 4, 800, 1000, 128, 1, None, "float16", None),
    # TMA loads keep their tensor maps in the CTA's last output tile: CTAs whose last tile has too
    # few rows for them (1 or 2 rows at D = 64, 1 at D = 128) load with cp.async, the others with
    # TMA, in the same launch
    (3, 5, 5, 130, 257, 64, 0, None, "float16", None),
    (2, 3, 1, 129, 200, 128, 1, None, "bfloat16", None),
    # causal with Sk << Sq: most CTAs own only tiles with no visible key (zeros written at once);
    # such a CTA must not keep tensor maps in its output (it once raced with their publication)
    (2, 8, 4, 2500, 100, 64, 1, None, "bfloat16", None),  # and (2, 2, 2, 1500, 64, 128, 1) above
]


@pytest.fixture(scope="module")
def seed():
    s = int.from_bytes(os.urandom(4), "little")
    print(f"\nflash_attention gpu tests: seed {s}")
    return s


def _poison_bias(bias, how):
    if how == "pad":  # HF key-padding mask: the last keys of each batch masked with finfo.min
        for b in range(bias.shape[0]):
            bias[b, ..., bias.shape[-1] - 17 * (b + 1):] = torch.finfo(bias.dtype).min
    elif how == "rows":
        bias[..., 3, :] = float("-inf")
        bias[..., 5, :] = torch.finfo(bias.dtype).min
        bias[..., 7, ::3] = float("-inf")


def _device_arch():
    from optfuse.kernels.target import detect_arch

    return detect_arch()


def _sm90_applies(case) -> bool:
    B, H, Hkv, Sq, Sk, D, causal, bias_shape, dtype, poison = case
    return L.sm90_eligible(dtype, D, L.bias_pattern(bias_shape), D ** -0.5, 90)


#: The CUDA kernel with the maps built on the device (QDP's) and with the host's (launch_plan's HOST_MAPS)
IMPLS = ["triton", "sm90", "sm90_host_maps"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:9])).replace(" ", ""))
def test_artifact_matches_reference(case, impl, seed):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    sm90 = impl.startswith("sm90")
    if sm90 and (not _sm90_applies(case) or _device_arch() != 90):
        pytest.skip("the CUDA (sm90) kernel does not take this case / needs an sm_90 device")
    # the CUDA kernel on every case it takes, whether or not launch.py's policy picks it there
    _check_case(case, seed, arch=90 if sm90 else None, config=_sm90_default(case) if sm90 else None,
                host_maps=impl == "sm90_host_maps")


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:9])).replace(" ", ""))
def test_launch_plan_matches_reference(case, seed):
    """What the classic plugin runs at these shapes on sm_90 (launch_plan through the launcher): the
    HOST_MAPS build of the config the one-kernel path picks there (the waves rule's rows per tile,
    the batch-1 key-padding flip), its B and maps from the plan."""
    if not torch.cuda.is_available() or _device_arch() != 90:
        pytest.skip("needs an sm_90 device")
    B, H, Hkv, Sq, Sk, D, causal, bias_shape, dtype, poison = case
    plan = T.case_plan(dtype, [(B, H, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, D), bias_shape],
                       T.attrs_for(H, Hkv, D, causal), arch=90)
    if plan is None or plan.steps[0].source.defines.get("HOST_MAPS") != "1":
        pytest.skip("no HOST_MAPS plan here (Triton, the cp.async config or a decode shape)")
    _check_case(case, seed, plan=plan)


def _sm90_default(case) -> "L.FAConfig":
    """The CUDA kernel's default config for a case (its head dim, causality and key padding)."""
    return L.sm90_config(case[5], case[6], keypad=L.is_keypad(L.bias_pattern(case[7])))


#: CUDA kernel variants (any a sweep picks), run on every case the CUDA kernel takes: FAConfig
#: fields over the case's default config.
SM90_VARIANTS = [
    dict(num_stages=2), dict(num_stages=4),
    dict(block_m=192, num_warps=16), dict(block_m=192, num_warps=16, num_stages=4),
    dict(block_m=128, num_warps=12),
    dict(ones_sum=False), dict(ones_sum=False, block_m=128, num_warps=12),
    # the cp.async loads (TMA's fallback: a CTA whose last output tile cannot hold the tensor maps)
    dict(tma=False), dict(tma=False, num_stages=3), dict(tma=False, block_m=128, num_warps=12),
    # K and V on one "full" barrier per ring stage or on one each (the default from 3 / with 2
    # stages), with both load paths
    dict(kv_one_full=False), dict(kv_one_full=True), dict(kv_one_full=False, tma=False),
    # the softmax as one instruction stream or not (on by default at D = 64 and for D = 128
    # non-causal without a key bias), with the plain row sums and the cp.async loads
    dict(softmax_stream=True), dict(softmax_stream=False), dict(softmax_stream=True, ones_sum=False),
    dict(softmax_stream=True, tma=False),
]


def variant_config(variant: dict, head_dim: int, causal) -> "L.FAConfig | None":
    """The case's default CUDA config with ``variant`` applied; None where the variant does not
    exist (three consumer warpgroups and the choice of row sums, ones_sum: D = 64 only) or its K/V
    ring does not fit shared memory. The GPU tests run exactly these configs, and
    ``bench_attention.py --build`` prebuilds them."""
    if head_dim != 64 and (variant.get("block_m") == 192 or "ones_sum" in variant):
        return None
    cfg = dataclasses.replace(L.sm90_config(head_dim, causal), **variant)
    return cfg if L.sm90_shared_mem(head_dim, cfg, 2) <= L.SM90_SMEM_LIMIT else None


@pytest.mark.parametrize("variant", SM90_VARIANTS, ids=lambda v: ",".join(f"{k}={v[k]}" for k in v))
@pytest.mark.parametrize("case", [c for c in CASES if _sm90_applies(c)],
                         ids=lambda c: "-".join(map(str, c[:9])).replace(" ", ""))
def test_sm90_variants(case, variant, seed):
    if not torch.cuda.is_available() or _device_arch() != 90:
        pytest.skip("needs an sm_90 device")
    D = case[5]
    cfg = variant_config(variant, D, case[6])
    if cfg is None:
        pytest.skip(f"no such variant at D = {D} (block_m 192 and ones_sum: D = 64 only), or its K/V "
                    f"ring exceeds shared memory")
    if cfg == _sm90_default(case):
        pytest.skip("the case's default config (test_artifact_matches_reference[sm90] runs it)")
    _check_case(case, seed, arch=90, config=cfg)


@pytest.mark.parametrize("tma", [False, True, "host_maps"])
def test_sm90_output_not_64_byte_aligned(tma, seed):
    """An output 16 bytes past an allocation's start: no CTA may keep its tensor maps there (they
    need 64-byte alignment), so every CTA of the TMA build falls back to cp.async; the HOST_MAPS
    build keeps no map in the output and loads with TMA."""
    if not torch.cuda.is_available() or _device_arch() != 90:
        pytest.skip("needs an sm_90 device")
    case = (2, 4, 2, 300, 300, 64, 1, None, "bfloat16", None)
    cfg = dataclasses.replace(L.sm90_config(64, True), tma=bool(tma))
    _check_case(case, seed, arch=90, config=cfg, out_offset=8, host_maps=tma == "host_maps")


#: CUDA kernel variants run as HOST_MAPS builds (every other case): rows per tile, ring depths, the
#: K / V barriers, the softmax stream
HOST_MAPS_VARIANTS = [dict(num_stages=2), dict(num_stages=4), dict(block_m=128, num_warps=12),
                      dict(block_m=192, num_warps=16), dict(kv_one_full=False), dict(softmax_stream=True)]


@pytest.mark.parametrize("variant", HOST_MAPS_VARIANTS, ids=lambda v: ",".join(f"{k}={v[k]}" for k in v))
@pytest.mark.parametrize("case", [c for c in CASES if _sm90_applies(c)][::2],
                         ids=lambda c: "-".join(map(str, c[:9])).replace(" ", ""))
def test_sm90_host_maps_variants(case, variant, seed):
    if not torch.cuda.is_available() or _device_arch() != 90:
        pytest.skip("needs an sm_90 device")
    cfg = variant_config(variant, case[5], case[6])
    if cfg is None or cfg == _sm90_default(case):
        pytest.skip("no such variant at this head dim, its ring exceeds shared memory, or it is the default")
    _check_case(case, seed, arch=90, config=cfg, host_maps=True)


# Sparse cases: (B, H, Hkv, Sq, Sk, D, causal, bias_shape, dtype, extra) with extra: window
# (window_left, window_right), softcap, keypad (right / left / dead / holes: how the key-padding
# bias masks), layout (density, layout heads). Lengths are not multiples of the 128-blocks.
SPARSE_CASES = [
    # sliding windows w = 1 .. S (causal, window_left = w - 1), Sk > Sq, two-sided
    (1, 4, 2, 1500, 1500, 128, 1, None, "bfloat16", {"window": (0, -1)}),
    (1, 4, 2, 1500, 1500, 128, 1, None, "bfloat16", {"window": (63, -1)}),
    (1, 4, 2, 1500, 1500, 64, 1, None, "float16", {"window": (127, -1)}),
    (1, 4, 2, 1500, 1500, 64, 1, None, "bfloat16", {"window": (128, -1)}),
    (1, 4, 1, 4200, 4200, 64, 1, None, "bfloat16", {"window": (1000, -1)}),  # three consumers
    (1, 4, 2, 1500, 1500, 128, 1, (), "float16", {"window": (1499, -1)}),
    (1, 4, 1, 700, 1900, 64, 1, None, "bfloat16", {"window": (300, -1)}),
    (2, 4, 4, 1000, 1000, 64, 0, None, "float16", {"window": (200, 50)}),
    (2, 4, 4, 1000, 1000, 128, 0, None, "bfloat16", {"window": (-1, 300)}),
    # soft-capping (Gemma 2), with and without a window
    (1, 4, 2, 777, 777, 128, 1, None, "bfloat16", {"softcap": 30.0}),
    (2, 4, 2, 600, 600, 64, 1, None, "float16", {"softcap": 50.0, "window": (255, -1)}),
    # key padding: the live range skipped to, per batch, lengths off the block grid
    (4, 4, 2, 1000, 1000, 128, 0, (4, 1, 1, 1000), "bfloat16", {"keypad": "right"}),
    (4, 4, 2, 1000, 1000, 64, 0, (4, 1, 1, 1000), "float16", {"keypad": "right"}),
    (3, 4, 2, 900, 900, 128, 1, (3, 1, 1, 900), "float16", {"keypad": "left"}),
    (3, 4, 1, 900, 900, 64, 1, (3, 1, 1, 900), "bfloat16", {"keypad": "right"}),
    (3, 4, 2, 700, 700, 64, 0, (3, 1, 1, 700), "bfloat16", {"keypad": "dead"}),
    (3, 4, 2, 700, 700, 128, 0, (3, 1, 1, 700), "float16", {"keypad": "holes"}),
    (2, 4, 2, 800, 800, 128, 1, (2, 1, 1, 800), "bfloat16", {"keypad": "right", "window": (200, -1)}),
    (1, 8, 2, 1300, 1300, 64, 0, (1, 1, 1, 1300), "float16", {"keypad": "right"}),
    # more tiles than CTAs, so each CTA's tiles cross batches (the producer's live range rescanned per batch change)
    (6, 8, 2, 1100, 1100, 128, 0, (6, 1, 1, 1100), "bfloat16", {"keypad": "right"}),
    (6, 8, 2, 1100, 1100, 64, 0, (6, 1, 1, 1100), "float16", {"keypad": "left"}),
    (6, 8, 2, 1100, 1100, 128, 1, (6, 1, 1, 1100), "float16", {"keypad": "holes"}),
    (5, 8, 2, 1100, 1100, 64, 1, (5, 1, 1, 1100), "bfloat16", {"keypad": "dead"}),
    # block layouts (BSR of 128-blocks): densities, per head or shared, causal, empty query blocks
    (1, 4, 2, 1500, 1400, 128, 0, None, "bfloat16", {"layout": (0.1, 4)}),
    (1, 4, 2, 1500, 1400, 64, 0, None, "float16", {"layout": (0.5, 1)}),
    (2, 4, 4, 1000, 1000, 128, 1, None, "float16", {"layout": (0.3, 4)}),
    (2, 4, 1, 1000, 1000, 64, 1, (), "bfloat16", {"layout": (0.25, 1)}),
    (2, 4, 2, 900, 1000, 128, 0, (2, 1, 1, 1000), "bfloat16", {"layout": (0.5, 4), "keypad": "right"}),
    (1, 2, 2, 3000, 3000, 128, 0, None, "bfloat16", {"layout": (0.05, 2)}),
    # more tiles than CTAs: the equal-cost tile ranges over 40 per-head layouts, three batches
    (3, 40, 8, 1300, 1300, 64, 0, None, "bfloat16", {"layout": (0.2, 40)}),
    (2, 40, 8, 1300, 1300, 128, 1, (2, 1, 1, 1300), "float16", {"layout": (0.3, 40), "keypad": "right"}),
]



def _sparse_attrs(case):
    B, H, Hkv, Sq, Sk, D, causal, bias_shape, dtype, extra = case
    return T.sparse_attrs(H, Hkv, D, causal, Sq, Sk, extra)


def _sparse_id(c):
    extra = ",".join(f"{k}={v}" for k, v in c[9].items()).replace(" ", "")
    return "-".join(map(str, c[:9])).replace(" ", "") + "-" + extra


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", SPARSE_CASES, ids=_sparse_id)
def test_sparse_matches_reference(case, impl, seed):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    sm90 = impl.startswith("sm90")
    if sm90 and (not _sm90_applies(case) or _device_arch() != 90):
        pytest.skip("the CUDA (sm90) kernel does not take this case / needs an sm_90 device")
    attrs, layout = _sparse_attrs(case)
    cfg = None
    if sm90:
        cfg = _sm90_default(case)
        if layout is not None:
            cfg = dataclasses.replace(cfg, block_m=128, num_warps=12)
    _check_case(case[:9] + (None,), seed, arch=90 if sm90 else None, config=cfg,
                attrs=attrs, layout=layout, keypad=case[9].get("keypad"), host_maps=impl == "sm90_host_maps")


@pytest.mark.parametrize("variant", [dict(tma=False), dict(num_stages=3), dict(softmax_stream=True)],
                         ids=lambda v: ",".join(f"{k}={v[k]}" for k in v))
@pytest.mark.parametrize("case", [c for c in SPARSE_CASES if _sm90_applies(c)][::3], ids=_sparse_id)
def test_sparse_sm90_variants(case, variant, seed):
    if not torch.cuda.is_available() or _device_arch() != 90:
        pytest.skip("needs an sm_90 device")
    attrs, layout = _sparse_attrs(case)
    cfg = dataclasses.replace(_sm90_default(case), **variant)
    if layout is not None:
        cfg = dataclasses.replace(cfg, block_m=128, num_warps=12)
    if L.sm90_shared_mem(case[5], cfg, 2) > L.SM90_SMEM_LIMIT:
        pytest.skip("K/V ring exceeds shared memory")
    _check_case(case[:9] + (None,), seed, arch=90, config=cfg, attrs=attrs, layout=layout,
                keypad=case[9].get("keypad"))


def _check_case(case, seed, arch=None, config=None, out_offset=0, attrs=None, layout=None, keypad=None,
                host_maps=False, plan=None):
    """One case against the float64 reference: the kernel of (arch, config), its HOST_MAPS build
    (``host_maps``: skipped where the config loads with cp.async), or ``plan`` (one step)."""
    from optfuse.kernels import launch
    from optfuse.kernels.launcher import launch_plan

    B, H, Hkv, Sq, Sk, D, causal, bias_shape, dtype, poison = case
    gen = torch.Generator().manual_seed(seed + hash(case) % 1000)
    q, k, v, bias = T.random_inputs(B, H, Hkv, Sq, Sk, D, dtype, bias_shape, generator=gen)
    if poison:
        _poison_bias(bias, poison)
    if keypad:
        T.key_padding(bias, keypad)
    attrs = attrs or T.attrs_for(H, Hkv, D, causal)
    if plan is not None:
        (step,) = plan.steps
        src, params = step.source, step.params
    else:
        try:
            src, params = T.case_sources(dtype, [q.shape, k.shape, v.shape,
                                                 None if bias is None else bias.shape], attrs,
                                         config=config, arch=arch, layout=layout, host_maps=host_maps)
        except ValueError as exc:
            if host_maps and "need TMA" in str(exc):
                pytest.skip("a cp.async config: no HOST_MAPS build")
            raise
    if arch == 90:
        assert src.lang == "cuda", src.name
    art = None if plan is not None else T.get_artifact(src)
    dev = [t.cuda() if t is not None else None for t in (q, k, v, bias)]
    # out_offset elements into a larger allocation: the output's alignment is only that offset's
    out = torch.full((dev[0].numel() + out_offset,), float("nan"), dtype=dev[0].dtype,
                     device=dev[0].device)[out_offset:].view(dev[0].shape)
    ins = dev[:3] + ([dev[3]] if bias is not None else [])
    if layout is not None:
        ins += [torch.from_numpy(a).cuda() for a in layout]
    ref = T.reference_of(q, k, v, bias, attrs, layout=layout)
    stream = torch.cuda.current_stream().cuda_stream
    if plan is not None:
        T.build_plan(plan)
    for _ in range(2):  # twice: a race or a read of unwritten memory shows as a changing result
        out.fill_(float("nan"))
        if plan is not None:  # the op's inputs in spec order, as the plugin passes them
            launch_plan(plan, dev, [out], 0, stream, sync=True)
        else:
            launch(art, params, ins, [out], stream, sync=True)
        T.check_close(out, ref, dtype, src.name)
    if poison == "rows":
        assert (out[..., 3, :] == 0).all()
    if causal and Sk < Sq:
        assert (out[:, :, : Sq - Sk, :] == 0).all()
    assert np.isfinite(out.float().cpu().numpy()).all()
