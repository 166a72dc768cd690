#!/usr/bin/env python3
"""Where a small-M GEMM's time goes (sm_90): the sm_90 kernel's 128 x 128 schedules against cuBLAS.

    python scripts/profile_gemm_small_m.py --build DIR                 # CPU: compile every artifact
    PYTHONPATH=$PWD python scripts/profile_gemm_small_m.py --prebuilt DIR [--out f.json]

At M = 512 (BERT-base FFN up, N = 3072: 96 tiles of 128 x 128, at most one per CTA), for K = 384,
768 and 1536, with the FFN's bias + GELU and with no epilogue at all, timed from CUDA graph replays
in interleaved rounds:

* ``pingpong``: one consumer warpgroup per tile (the CTA's other one idle), MMAs then epilogue;
* ``narrow``: both consumer warpgroups on each tile (64 rows each);
* ``mm``: torch.mm on the same A and W (cuBLAS);

so that the K slope gives the mainloop's cost per k-block, the intercept the fixed cost (launch,
tensor maps, ring fill, drain), and the difference of the two epilogues the epilogue's cost. Then
narrow tiles with the consumers' activation in its short (FTZ) form and in the full one, on BERT-base
and BERT-large FFN up at M = 512 and 2048. Each artifact's output is checked against the float64
chain before it is timed. A development tool: it answers "is the loss in the mainloop, the epilogue
or the fixed cost?" before a kernel change is designed. Last, 128 x 192 tiles with the short and the full
activation forms where plans run them with an activation (BERT-base FFN up at M = 1024; N = 768, K = 3072 at
M = 4096).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from optfuse.kernels.registry import plugin_module  # noqa: E402
from optfuse.plugin_dirs import script_module  # noqa: E402

T = plugin_module("gemm", "testing")
L = plugin_module("gemm", "launch")
L9 = plugin_module("gemm", "launch_sm90")
B = script_module("bench_gemm")


def config(impl: str, case):
    """The first sm_90 candidate config of schedule ``impl`` for ``case`` (its deepest ring)."""
    cands = L.candidate_configs(case.op, case.dtype, case.n, case.k, 90, T.case_static(case, 90), case.activation)
    return next(c for c in cands if c.impl == impl)


def points() -> list[tuple[str, "T.Case", object, int | None]]:
    """(label, case, config, CONSUMER_FTZ override or None)."""
    out = []
    for k in (384, 768, 1536):
        for act, bias in (("gelu_erf", "vector"), ("none", "none")):
            for impl in (L9.PINGPONG, L9.NARROW):
                label = f"M=512 N=3072 K={k} {act}+{bias} {impl.removeprefix('cuda_sm90_')}"
                case = T.Case("GemmEpilogue", (512,), 3072, k, "float16", act, bias, "none")
                out.append((label, case, config(impl, case), None))
    for name in ("bert-base.ffn_up", "bert-large.ffn_up"):
        for m in (512, 2048):
            case = B.case_of(name, m, "float16")
            for ftz in (0, 1):
                out.append((f"{name} M={m} narrow ftz={ftz}", case, config(L9.NARROW, case), ftz))
    for label, case in (("bert-base.ffn_up M=1024", B.case_of("bert-base.ffn_up", 1024, "float16")),
                        ("M=4096 N=768 K=3072 gelu_tanh", T.Case("GemmEpilogue", (4096,), 768, 3072, "float16",
                                                                 "gelu_tanh", "vector", "none"))):
        for ftz in (0, 1):
            out.append((f"{label} n192 ftz={ftz}", case, config(L9.TILE_192, case), ftz))
    return out


def source(case, cfg, ftz):
    src, params = T.case_sources(case, config=cfg, arch=90)
    if ftz is not None:
        src = dataclasses.replace(src, name=f"{src.name}_ftz{ftz}", defines={**src.defines, "CONSUMER_FTZ": str(ftz)})
    return src, params


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", metavar="DIR", help="compile every artifact into DIR and exit (CPU or GPU)")
    ap.add_argument("--prebuilt", metavar="DIR", help="a KernelCache root from --build")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", help="write the times (us) as JSON here")
    args = ap.parse_args(argv)
    pts = points()
    if args.build:
        from optfuse.kernels import KernelCache

        srcs = {s.name: s for s in (source(c, cfg, f)[0] for _, c, cfg, f in pts)}
        KernelCache(args.build).build_many(list(srcs.values()), 90, jobs=1)
        print(f"built {len(srcs)} artifacts into {args.build}")
        return 0

    import torch

    from optfuse.kernels import launch

    assert torch.cuda.is_available(), "needs a CUDA GPU"
    artifacts = B.Artifacts(args.prebuilt)
    gen = torch.Generator(device="cuda").manual_seed(1)
    fns = {}
    for label, case, cfg, ftz in pts:
        src, params = source(case, cfg, ftz)
        art, _ = artifacts.get(src, 90)
        ins = B._cuda_inputs(case, gen)
        present = [t for t in ins if t is not None]
        out = torch.full((case.m, case.n), float("nan"), dtype=torch.float16, device="cuda")
        launch(art, params, present, [out], torch.cuda.current_stream().cuda_stream, sync=True)
        ref = B.chain_fn(case)(*[t.double() if t is not None else None for t in B.torch_inputs(case, ins)])
        B.check_on_device(out, ref, case.dtype, label)
        fns[label] = (lambda a=art, p=params, pr=present, o=out:
                      launch(a, p, pr, [o], torch.cuda.current_stream().cuda_stream))
        mm = f"M={case.m} N={case.n} K={case.k} mm"
        if mm not in fns:
            fns[mm] = (lambda x=ins[0], w=ins[1]: torch.mm(x, w.t()))
    times = {k: v * 1e3 for k, v in B.interleaved(fns, args.rounds, {}).items()}
    print(json.dumps({"device": torch.cuda.get_device_name()}))
    for k, v in times.items():
        print(f"{k:48s} {v:8.2f} us")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "us": times}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
