"""scripts/bench_gemm.py on the CPU: point selection, the sources a GPU run needs, the contenders'
labels, and the loss summary (the timing itself needs a GPU)."""

from __future__ import annotations

import pytest

from optfuse.plugin_dirs import script_module

bench = script_module("bench_gemm")


def test_quick_and_selection():
    args = bench.parse_args(["--quick"])
    assert args.shapes.split(",") == list(bench.QUICK_SHAPES) and args.token_list == [4096]
    pts = bench.points(["bert-base.ffn_up", "square-8k"], [512, 2048], ["float16", "bfloat16"])
    assert ("bert-base.ffn_up", 2048, "bfloat16") in pts and ("square-8k", 8192, "float16") in pts
    assert len(pts) == 2 * 2 + 2  # squares once per dtype, at M = N = K


def test_epilogue_shapes_named_only():
    """BERT-large FFN up with each other epilogue: selectable, not in the default run, same GEMM."""
    default = bench.parse_args([]).shapes.split(",")
    assert default == list(bench.DEFAULT_SHAPES) and not set(default) & set(bench.EPILOGUE_SHAPES)
    base = bench.case_of("bert-large.ffn_up", 4096, "float16")
    acts = set()
    for name in bench.EPILOGUE_SHAPES:
        case = bench.case_of(name, 4096, "float16")
        assert (case.m, case.n, case.k) == (base.m, base.n, base.k)
        acts.add((case.activation, case.bias))
    assert len(acts) == len(bench.EPILOGUE_SHAPES)
    assert bench.parse_args(["--shapes", "bert-large.ffn_up.relu"]).shapes == "bert-large.ffn_up.relu"


def test_ffn_down_shapes_named_only():
    """The FFN down shapes without bias / residual, with one of them: same GEMM, named by --shapes only."""
    default = set(bench.parse_args([]).shapes.split(","))
    assert not default & set(bench.FFN_DOWN_SHAPES)
    full = bench.case_of("bert-large.ffn_down", 4096, "float16")
    parts = {(c.bias, c.residual) for c in (bench.case_of(f"bert-large.ffn_down.{t}", 4096, "float16")
                                            for t in ("bare", "bias", "res"))
             if (c.m, c.n, c.k, c.activation) == (full.m, full.n, full.k, "none")}
    assert parts == {("none", "none"), ("vector", "none"), ("none", "full")} != {(full.bias, full.residual)}
    llama, bare = (bench.case_of(n, 4096, "float16") for n in ("llama-7b.ffn_down", "llama-7b.ffn_down.bare"))
    assert (bare.n, bare.k, bare.bias, bare.residual) == (llama.n, llama.k, "none", "none") and llama.residual == "full"


def _tree_copy(tmp_path, rel="plugins/gemm/kernel_sm90.cu"):
    """A baseline checkout holding the gemm plugin's CUDA sources, the kernel changed by one comment."""
    import shutil

    root = tmp_path / "base"
    for d in ("plugins/gemm", "plugins/common"):
        shutil.copytree(bench.ROOT / d, root / d, ignore=shutil.ignore_patterns("__pycache__", "results"))
    (root / rel).write_text((root / rel).read_text() + "\n// baseline\n")
    return root


def test_baseline_sources(tmp_path):
    """--baseline: each CUDA config once more from the other checkout (own name and hash); Triton and
    the run-time plan's kernels (host maps) not."""
    root = _tree_copy(tmp_path)
    pts = bench.points(["bert-large.ffn_up"], [4096], ["float16"])
    plain = bench.needed_sources(pts, 90, None, with_tests=False)
    both = bench.needed_sources(pts, 90, None, with_tests=False, baseline=str(root))
    cuda = [s for s in plain if s.lang == "cuda" and not s.meta["host_maps"]]
    assert cuda and len(both) == len(plain) + len(cuda)
    base = {s.name: s for s in both if s.name.endswith("_baseline")}
    for s in cuda:
        b = base[s.name + "_baseline"]
        assert b.path == str(root / "plugins/gemm/kernel_sm90.cu") and b.defines == s.defines
        assert b.spec_dict()["source_sha256"] != s.spec_dict()["source_sha256"]
    assert bench.parse_args(["--baseline", str(root)]).baseline == str(root)


def test_device_maps_sources():
    """--device-maps: each 16-bit point's plan once more with the maps built on the device (HOST_MAPS 0, no
    tensor-map parameters, its own name)."""
    pts = bench.points(["bert-base.qkv", "bert-base.ffn_down"], [512], ["float16"])
    plain = {s.name: s for s in bench.needed_sources(pts, 90, None, with_tests=False)}
    both = {s.name: s for s in bench.needed_sources(pts, 90, None, with_tests=False, device_maps=True)}
    extra = [both[n] for n in both.keys() - plain.keys()]
    assert len(extra) == 2  # FFN down's split-K GEMM and its reduce
    for s in extra:
        assert s.defines["HOST_MAPS"] == "0" and not s.tensor_maps and "hostmaps" not in s.name
        assert s.name.replace("5stages_splitk", "5stages_hostmaps_splitk") in both
    # QKV's plan (the static ping-pong) with device-built maps is the kernel QDP runs: the config's source
    case = bench.case_of("bert-base.qkv", 512, "float16")
    step, = bench.T.case_plan(case, 90, host_maps=False).steps
    assert step.source.spec_dict() == plain[step.source.name].spec_dict()
    assert bench.parse_args(["--device-maps"]).device_maps


def test_schedule_plans_and_sources():
    """--schedules: every sm_90 schedule that takes a 16-bit point, as an unsplit host-maps plan of that
    schedule (launch_plan(schedule=...)); one that does not take the point is left out; FP8 has none."""
    L = bench.L
    case = bench.case_of("bert-base.ffn_up", 2048, "float16")
    plans = bench.T.schedule_plans(case, 90)
    assert set(plans) == set(L.SM90_SCHEDULES)  # N = 3072, K = 768: every schedule takes it
    for impl, plan in plans.items():
        (step,) = plan.steps
        meta = step.source.meta
        assert (meta["kernel"], meta["split_k"], meta["host_maps"]) == (impl, 1, True) and step.source.tensor_maps
    # the plan's own pick is one of them, with the same source
    (pick,) = bench.T.case_plan(case, 90).steps
    assert pick.source.name in {p.steps[0].source.name for p in plans.values()}
    # N = 1184 (a 32-column last tile of 128): neither 128 x 128 schedule takes it
    odd = bench.T.Case("GemmEpilogue", (512,), 1184, 768, "float16", "gelu_erf", "vector", "none")
    assert set(bench.T.schedule_plans(odd, 90)) == {"cuda_sm90", L.launch_sm90.EPILOGUE_WG, L.launch_sm90.TILE_192}
    for refused in (L.launch_sm90.PINGPONG, "cuda_sm90_no_such"):
        with pytest.raises(ValueError, match="does not take"):
            bench.T.case_plan(odd, 90, schedule=refused)
    assert bench.T.schedule_plans(bench.case_of("bert-base.qkv", 512, bench.FP8), 90) == {}
    pts = bench.points(["bert-base.ffn_up"], [2048], ["float16"])
    plain = {s.name for s in bench.needed_sources(pts, 90, None, with_tests=False)}
    more = {s.name for s in bench.needed_sources(pts, 90, None, with_tests=False, schedules=True)}
    assert more > plain and {p.steps[0].source.name for p in plans.values()} <= more
    assert bench.parse_args(["--schedules"]).schedules


def test_schedule_misses():
    """A point is listed where the plan's pick is more than 3 % slower than the fastest schedule."""
    def row(plan, **scheds):
        ms = {"mm": 1.0, "ours[plan]": plan, **{f"ours[{k}|plan]": v for k, v in scheds.items()}}
        return {"shape": "s", "M": 2048, "dtype": "float16", "ms": ms,
                "notes": {"ours[plan]": "cuda_sm90_narrow_128x128x64_hostmaps (prebuilt)"}}
    rows = [row(20.9, cuda_sm90_pingpong=18.4, cuda_sm90_narrow=21.0),  # 1.136x ping-pong
            row(22.5, cuda_sm90_pingpong=21.9),  # 1.027x: within the spread
            row(10.0),  # no --schedules contenders
            {"shape": "e", "M": 1, "dtype": "float16", "error": "x"}]
    (line,) = bench.schedule_misses(rows)
    assert line == "s M=2048 float16: the plan (cuda_sm90_narrow_128x128x64_hostmaps) 1.136x cuda_sm90_pingpong"


def test_baseline_without_the_kernel_exits(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--baseline", str(tmp_path)])
    assert e.value.code == 2 and "no plugins/gemm/kernel_sm90.cu there" in capsys.readouterr().err
    src = next(s for s in bench.needed_sources(bench.points(["bert-large.ffn_up"], [4096], ["float16"]), 90, None,
                                               with_tests=False) if s.lang == "cuda")
    with pytest.raises(SystemExit, match="no plugins/gemm/kernel_sm90.cu there"):
        bench.baseline_source(src, str(tmp_path))


@pytest.mark.parametrize("argv", [["--shapes", "gpt-5.ffn"], ["--tokens", "4k"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2


def _candidates(case, arch=90):
    return bench.L.candidate_configs(case.op, case.dtype, case.n, case.k, arch, bench.T.case_static(case, arch),
                                     case.activation)


def test_every_shape_builds_and_sources_are_distinct():
    pts = bench.points(list(bench.SHAPES), [512], ["float16"])
    srcs = bench.needed_sources(pts, 90, None, with_tests=False)
    # one specialization per shape (M is dynamic) and kernel source (sm_90: CUDA schedules + Triton),
    # and the run-time plan's kernels (host maps; 16-bit shapes): two (GEMM, reduce) where it splits K
    want = sum(len({c.impl for c in _candidates(bench.case_of(name, m, dt))}) for name, m, dt in pts)
    plans = {n: p for n, m, dt in pts if not (c := bench.case_of(n, m, dt)).fp8 and (p := bench.T.case_plan(c, 90))}
    splits = [n for n, p in plans.items() if len(p.steps) == 2]
    assert splits == ["bert-base.ffn_down", "bert-large.ffn_down", *(f"bert-large.ffn_down.{t}" for t in ("bare", "bias", "res"))]
    assert len(srcs) == want + sum(len(p.steps) for p in plans.values()) and want > len(bench.SHAPES)
    assert len({s.name for s in srcs}) == len(srcs)
    with_variants = bench.needed_sources(pts[:1], 90, "all", with_tests=False)
    case = bench.case_of(*pts[0][:1], 512, "float16")
    assert len(with_variants) == len(_candidates(case)) + 1  # and the plan's kernel


def test_ours_labels():
    case = bench.case_of("llama-7b.ffn_gate_up", 4096, "bfloat16")
    labels = [label for label, _ in bench.ours_configs(case, 90, None)]
    assert labels == ["ours[cuda_sm90]", "ours[cuda_sm90_epilogue_wg]", "ours[triton]"]
    assert [label for label, _ in bench.ours_configs(case, 89, None)] == ["ours[triton]"]
    cands = _candidates(case)
    named = bench.ours_configs(case, 90, bench.L.config_name(cands[1]))
    first = [next(c for c in cands if c.impl == impl) for impl in ("cuda_sm90_epilogue_wg", "triton")]
    assert [c for _, c in named] == [cands[0], *first, cands[1]]


def test_torch_contenders_take_the_16_bit_inputs():
    """The eager chain and cuBLASLt's call get the op's inputs without the (absent) FP8 scales."""
    import numpy as np

    for name in ("bert-base.ffn_down", "bert-base.ffn_up", "llama-7b.ffn_gate_up"):
        case = bench.case_of(name, 8, "float32")
        full = bench.T.case_inputs(case)
        y = bench.chain_fn(case)(*bench.torch_inputs(case, full))
        ref = bench.T.reference_of(case, full)
        np.testing.assert_allclose(y.double().numpy().reshape(ref.shape), ref, rtol=1e-4, atol=1e-4)


def test_cublaslt_contender_only_where_one_call_does_it():
    lt = {name: bench.cublaslt_fn(bench.case_of(name, 512, "float16")) is not None for name in bench.SHAPES}
    assert lt["bert-base.ffn_up"] and lt["bert-base.qkv"] and lt["llama-7b.ffn_down"]
    assert not lt["bert-base.ffn_down"] and not lt["llama-7b.ffn_gate_up"]  # bias + residual; SwiGLU


def test_losses_and_table(capsys):
    rows = [
        {"shape": "bert-large.ffn_up", "M": 4096, "dtype": "float16", "ms": {"mm": 1.0, "lt": 1.1, "chain": 1.5,
                                                                            "ours[triton]": 1.05},
         "tflops": {"ours[triton]": 500.0}, "ours/mm": 1.05, "ours/lt": 1.05 / 1.1, "ours/chain": 0.7},
        {"shape": "llama-7b.ffn_gate_up", "M": 4096, "dtype": "float16",
         "ms": {"packed": 2.0, "mm2": 2.1, "chain": 2.3, "ours[triton]": 1.9}, "tflops": {"ours[triton]": 600.0},
         "ours/packed": 0.95},
        {"shape": "square-8k", "M": 8192, "dtype": "float16", "error": "RuntimeError: x"},
    ]
    assert bench.losses(rows) == ["bert-large.ffn_up M=4096 float16: 1.050x mm"]
    bench.print_table(rows)
    out = capsys.readouterr().out
    assert "bert-large.ffn_up" in out and "error: RuntimeError" in out


def test_fp8_points_sources_and_table(capsys):
    """--fp8 adds the FP8 points (y in --fp8-output); their sources are the sm_90 CUDA kernel's FP8
    path (the static choice, and the run-time plan's build with host-encoded maps) and the FP8 Triton
    kernel's, and they print in their own table; losses count _scaled_mm."""
    args = bench.parse_args(["--quick", "--fp8", "--fp8-output", "float16"])
    assert args.dtypes.split(",") == ["float16", bench.FP8]
    case = bench.case_of("llama-7b.ffn_gate_up", 4096, bench.FP8)
    assert case.fp8 and case.y_dtype == "float16" and case.dtype == bench.FP8
    bench.parse_args([])  # back to the default y dtype
    assert bench.case_of("bert-large.ffn_up", 4096, bench.FP8).y_dtype == "bfloat16"
    pts = bench.points(list(bench.QUICK_SHAPES), [4096], [bench.FP8])
    srcs = bench.needed_sources(pts, 90, None, with_tests=False)
    assert len(srcs) == 3 * len(pts) and all("float8e4m3fn-to-bfloat16" in s.name for s in srcs)
    assert sorted(s.lang for s in srcs) == ["cuda"] * 2 * len(pts) + ["triton"] * len(pts)
    assert sum(s.meta.get("host_maps", False) for s in srcs) == len(pts)
    rows = [{"shape": "bert-large.ffn_up", "M": 4096, "dtype": bench.FP8, "output_dtype": "bfloat16",
             "ms": {"scaled": 1.0, "rowwise": 1.1, "fp8_chain": 1.6, "bf16": 1.9, "ours[triton]": 1.2},
             "tflops": {"ours[triton]": 900.0}, "ours/scaled": 1.2, "ours/fp8_chain": 0.75, "ours/bf16": 0.63}]
    assert bench.losses(rows) == ["bert-large.ffn_up M=4096 float8e4m3fn: 1.200x scaled"]
    bench.print_table(rows)
    out = capsys.readouterr().out
    assert "shape (FP8)" in out and "900" in out and "ours ms" in out


def test_profile_small_m_sources():
    """scripts/profile_gemm_small_m.py: one sm_90 source per specialization (M is dynamic); the FTZ
    points differ from the default narrow / 128 x 192 build only by CONSUMER_FTZ."""
    prof = script_module("profile_gemm_small_m")
    pts = prof.points()
    srcs = [prof.source(case, cfg, ftz)[0] for _, case, cfg, ftz in pts]
    specs = {(c.n, c.k, c.activation, c.bias, cfg.impl, f) for _, c, cfg, f in pts}
    assert len({s.name for s in srcs}) == len(specs) == 20
    assert {cfg.impl for _, _, cfg, _ in pts} == {"cuda_sm90_pingpong", "cuda_sm90_narrow", "cuda_sm90_n192"}
    ftz = [(s, f, case, cfg) for s, (_, case, cfg, f) in zip(srcs, pts) if f is not None]
    assert {f for _, f, _, _ in ftz} == {0, 1}
    for s, f, case, cfg in ftz:
        assert s.defines == {**prof.source(case, cfg, None)[0].defines, "CONSUMER_FTZ": str(f)}
        assert s.defines["NARROW"] == "1" or s.defines["TILE_N"] == "192"


def test_markdown_table_from_out_rows(tmp_path, capsys):
    """--markdown: an --out file's 16-bit rows as the README table: the first ``ours`` contender is what
    runs (a plan named by its config, split-K as such), the others against cuBLAS (the packed GEMM for
    GatedGemm); error and FP8 rows left out; a file without rows is exit 2 with one line."""
    import json

    rows = [
        {"shape": "bert-base.qkv", "M": 512, "dtype": "float16",
         "ms": {"mm": 0.005, "lt": 0.006, "chain": 0.01, "ours[cuda_sm90_pingpong]": 0.0075,
                "ours[cuda_sm90_epilogue_wg]": 0.01, "ours[cuda_sm90_epilogue_wg|baseline]": 0.011},
         "notes": {}},
        {"shape": "bert-base.ffn_down", "M": 512, "dtype": "float16",
         "ms": {"mm": 0.008, "chain": 0.0124, "ours[plan]": 0.0118, "ours[cuda_sm90]": 0.033},
         "notes": {"ours[plan]": "cuda_sm90_pingpong_128x128x64_g8_12warps_5stages_splitk4 + "
                                 "cuda_sm90_pingpong_128x128x64_g8_12warps_5stages_splitk4_reduce (prebuilt)"}},
        {"shape": "bert-large.ffn_up", "M": 512, "dtype": "float16",
         "ms": {"mm": 0.008, "lt": 0.01, "chain": 0.017, "ours[plan]": 0.0106, "ours[plan|device maps]": 0.012,
                "ours[triton]": 0.0175},
         "notes": {"ours[plan]": "cuda_sm90_narrow_128x128x64_g8_12warps_5stages_hostmaps (prebuilt)",
                   "ours[plan|device maps]": "cuda_sm90_narrow_128x128x64_g8_12warps_5stages (prebuilt)"}},
        {"shape": "llama-7b.ffn_gate_up", "M": 4096, "dtype": "float16",
         "ms": {"packed": 1.0, "mm2": 1.01, "chain": 1.2, "ours[cuda_sm90]": 1.01, "ours[cuda_sm90_epilogue_wg]": 1.02},
         "notes": {}},
        {"shape": "square-4k", "M": 4096, "dtype": "float16", "error": "AssertionError: off"},
        {"shape": "square-4k", "M": 4096, "dtype": bench.FP8, "ms": {"scaled": 0.1, "ours[cuda_sm90]": 0.11}},
    ]
    lines = bench.markdown_table(rows)
    assert len(lines) == 2 + 4
    assert lines[2] == ("| bert-base.qkv | 512 | 5.0 | 6.0 | 10.0 | 7.5 (ping-pong) | 1.50 | 1.25 | 0.75 "
                        "| epilogue warps 2.00, epilogue warps (baseline) 2.20 |")
    assert lines[3] == ("| bert-base.ffn_down | 512 | 8.0 | - | 12.4 | 11.8 (split-K x4 + reduce) | 1.47 | - | 0.95 "
                        "| cooperative 4.12 |")
    assert lines[4] == ("| bert-large.ffn_up | 512 | 8.0 | 10.0 | 17.0 | 10.6 (narrow, run-time plan) | 1.32 | 1.06 | 0.62 "
                        "| narrow, run-time plan (device maps) 1.50, Triton 2.19 |")
    assert lines[5] == ("| llama-7b.ffn_gate_up | 4096 | 1000.0 (packed) | - | 1200.0 | 1010.0 (cooperative) | 1.01 | - "
                        "| 0.84 | epilogue warps 1.02 |")
    out = tmp_path / "bench.json"
    out.write_text(json.dumps({"info": {}, "rows": rows}))
    assert bench.main(["--markdown", str(out)]) == 0
    assert capsys.readouterr().out.splitlines() == lines
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert bench.main(["--markdown", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a bench_gemm --out file" in err[0]
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["--markdown", str(tmp_path / "missing.json")])
    assert exc.value.code == 2
