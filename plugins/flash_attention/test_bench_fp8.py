"""CPU tests of ``scripts/bench_attention.py --fp8`` (scripts/bench_attention_fp8.py): argument
handling, the sources it builds and times, and the target summary (no GPU)."""

import pytest

from optfuse.kernels.registry import plugin_module
from optfuse.plugin_dirs import script_module

L = plugin_module("flash_attention", "launch")


def test_fp8_refuses_bf16_only_options(capsys):
    bench = script_module("bench_attention")
    for extra in (["--variants", "tma=0"], ["--tuned-from", "sweep.json"]):
        with pytest.raises(SystemExit) as exc:
            bench.main(["--fp8", *extra])
        assert exc.value.code == 2
        assert "--fp8 takes neither" in capsys.readouterr().err


def test_help_names_the_fp8_mode(capsys):
    with pytest.raises(SystemExit) as exc:
        script_module("bench_attention").main(["--help"])
    assert exc.value.code == 0
    assert "--fp8" in capsys.readouterr().out


@pytest.mark.parametrize("D,causal", [(64, 0), (128, 1)])
def test_fp8_source_of_a_grid_shape(D, causal):
    fp8 = script_module("bench_attention_fp8")
    src, params = fp8.fp8_source_for(4096, D, causal)
    B, H = 16384 // 4096, 2048 // D
    assert src.lang == "triton" and src.signature["Q"] == src.signature["V"] == "*fp8e4nv"
    assert [src.signature[s] for s in ("QScale", "KScale", "VScale")] == ["*fp32"] * 3
    assert src.signature["Out"] == "*bf16" and src.n_inputs == 6
    cfg = L.choose_config(L.FP8, D, causal)
    assert params.grid[0] == -(-4096 // cfg.block_m) * B * H
    assert list(params.extra_args) == [H, H, 4096, 4096]


def test_fp8_build_sources_cover_grid_tests_and_sweep():
    fp8 = script_module("bench_attention_fp8")
    plain = fp8.fp8_build_sources([64, 128])
    swept = fp8.fp8_build_sources([64, 128], sweep=True)
    names = {s.name for s in plain}
    assert len(names) == len(plain) and names < {s.name for s in swept}
    assert all(s.signature["Q"] == "*fp8e4nv" for s in swept)
    gpu = plugin_module("flash_attention", "test_kernel_fp8_gpu")
    n_configs = sum(len(L.candidate_configs(L.FP8, D, c)) for D in (64, 128) for c in (0, 1))
    assert len(swept) >= n_configs and len(plain) <= len(gpu.CASES) + 4


def test_misses_apply_both_targets():
    fp8 = script_module("bench_attention_fp8")
    rows = [dict(S=4096, D=128, causal=0, fp8_tfs=950.0, speedup=1.6),   # meets both
            dict(S=4096, D=128, causal=1, fp8_tfs=850.0, speedup=1.7),   # under 900 TF/s
            dict(S=16384, D=128, causal=0, fp8_tfs=1000.0, speedup=1.4),  # under 1.5x
            dict(S=2048, D=128, causal=0, fp8_tfs=500.0, speedup=1.1),   # S < 4096: no target
            dict(S=8192, D=64, causal=0, fp8_tfs=500.0, speedup=1.1)]    # D = 64: no target
    assert [(r["S"], r["causal"]) for r in fp8.misses(rows)] == [(4096, 1), (16384, 0)]


def test_fp8_padding_needs_fp8_and_a_fraction(capsys):
    bench = script_module("bench_attention")
    for argv in (["--fp8-padding", "0.3"], ["--fp8", "--fp8-padding", "1.5"], ["--fp8", "--fp8-padding", "-0.1"]):
        with pytest.raises(SystemExit) as exc:
            bench.main(argv)
        assert exc.value.code == 2
        assert "--fp8-padding" in capsys.readouterr().err


def test_fp8_padded_sources_take_the_key_padding_bias():
    """--fp8-padding: both forms with a bf16 [B, 1, 1, S] bias; on sm_90 at D = 128 the FP8 form
    then runs the Triton FP8 branch and the bf16 form the CUDA kernel (what the spec's key-padding
    entry compares)."""
    fp8 = script_module("bench_attention_fp8")
    plain, _ = fp8.fp8_source_for(4096, 128, 0, arch=90)
    padded, _ = fp8.fp8_source_for(4096, 128, 0, arch=90, padded=True)
    assert plain.lang == "cuda" and padded.lang == "triton"
    assert padded.n_inputs == 7 and padded.signature["Bias"] == "*bf16" and "bias_B_1_1_Sk" in padded.name
    srcs = fp8.fp8_build_sources([128], arch=90, padded=True)
    names = {s.name for s in srcs}
    assert padded.name in names and names > {s.name for s in fp8.fp8_build_sources([128], arch=90)}
    bf16 = [s for s in srcs if "/bfloat16/" in s.name]
    assert bf16 and all("bias_B_1_1_Sk" in s.name for s in bf16) and any(s.lang == "cuda" for s in bf16)


def test_padding_bias_masks_the_last_keys_of_each_batch():
    torch = pytest.importorskip("torch")
    fp8 = script_module("bench_attention_fp8")
    bias = fp8.padding_bias(2, 8, 0.25, device="cpu")
    assert bias.shape == (2, 1, 1, 8) and bias.dtype == torch.bfloat16
    assert (bias[..., :6] == 0).all() and (bias[..., 6:] == torch.finfo(torch.bfloat16).min).all()
    assert (fp8.padding_bias(1, 8, 0.0, device="cpu") == 0).all()
