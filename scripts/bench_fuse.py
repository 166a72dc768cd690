"""Peak memory and wall time of `optfuse fuse`, `optfuse fuse --verify` and onnxruntime's transformers
optimizer on the same model file.

    # export a LLaMA-architecture model with FP32 external data (random weights)
    python scripts/bench_fuse.py make /tmp/big/llama.onnx --family llama --layers 8 --hidden 2048 \
        --heads 16 --kv-heads 4 --intermediate 8192
    # measure it (one process per tool, peak RSS from wait4, wall time)
    python scripts/bench_fuse.py run /tmp/big/llama.onnx --model-type gpt2 [--verify] [--ort]
    # the small-width rows: export, measure, delete
    python scripts/bench_fuse.py small --layers 12 48

Each measured command runs in its own child process; its peak RSS is the child's ``ru_maxrss``
(os.wait4), so the numbers are what ``/usr/bin/time -v`` reports as "Maximum resident set size".
(Linux counts a child's peak from the RSS of the process it was forked from, so this process
never holds a model: exports run in a child too.)
Prints a Markdown table: model, weights, tool, wall time, peak RSS, RSS / weights, and optfuse's
wall time over the optimizer's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GB = 1e9


@dataclass
class Measurement:
    model: str
    weights: int  # bytes of initializers
    tool: str
    wall_s: float
    peak_rss: int  # bytes
    rc: int


def weights_bytes(path: Path) -> int:
    import onnx
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    total = 0
    for t in _get_all_tensors(onnx.load(str(path), load_external_data=False)):
        if uses_external_data(t):
            total += int({e.key: e.value for e in t.external_data}.get("length", 0))
        else:
            total += len(t.raw_data)
    return total


def measure(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, int, int]:
    """(wall seconds, peak RSS bytes, exit code) of `cmd` run as one child process."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        print(f"  {' '.join(cmd[:4])} ... exit {proc.returncode}: {err.strip().splitlines()[-1:] or ''}",
              file=sys.stderr)
    return wall, usage.ru_maxrss * 1024, proc.returncode


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(REPO)
    return env


def run_tools(model: Path, model_type: str, verify: bool, ort: bool, label: str | None = None) -> list[Measurement]:
    weights = weights_bytes(model)
    label = label or model.name
    out: list[Measurement] = []
    with tempfile.TemporaryDirectory(prefix="bench-fuse-", dir=model.parent) as tmp:
        jobs = [("optfuse fuse", [sys.executable, "-m", "optfuse", "fuse", str(model), "-o", f"{tmp}/f.onnx"])]
        if verify:
            jobs.append(("optfuse fuse --verify", [sys.executable, "-m", "optfuse", "fuse", str(model), "-o",
                                                   f"{tmp}/v.onnx", "--verify"]))
        if ort:
            jobs.append((f"ORT optimizer ({model_type})",
                         [sys.executable, "-m", "onnxruntime.transformers.optimizer", "--input", str(model),
                          "--output", f"{tmp}/o.onnx", "--model_type", model_type, "--use_external_data_format"]))
        for tool, cmd in jobs:
            wall, rss, rc = measure(cmd, _env())
            out.append(Measurement(label, weights, tool, wall, rss, rc))
            print(f"  {label}: {tool}: {wall:.1f} s, {rss / GB:.2f} GB (exit {rc})", file=sys.stderr)
            for f in Path(tmp).iterdir():  # one tool's outputs at a time on disk
                shutil.rmtree(f) if f.is_dir() else f.unlink()
    return out


def table(rows: list[Measurement]) -> str:
    lines = ["| model | weights | tool | wall | peak RSS | RSS / weights | fuse time / ORT time |",
             "|---|---|---|---|---|---|---|"]
    ort_wall = {r.model: r.wall_s for r in rows if r.tool.startswith("ORT")}
    for r in rows:
        ratio = f"{r.wall_s / ort_wall[r.model]:.2f}x" if r.tool == "optfuse fuse" and r.model in ort_wall else ""
        size = f"{r.weights / GB:.2f} GB" if r.weights >= 0.1 * GB else f"{r.weights / 1e6:.1f} MB"
        status = "" if r.rc == 0 else f" (exit {r.rc})"
        lines.append(f"| {r.model} | {size} | {r.tool}{status} | {r.wall_s:.1f} s | {r.peak_rss / GB:.2f} GB "
                     f"| {r.peak_rss / max(r.weights, 1):.2f}x | {ratio} |")
    return "\n".join(lines)


def make_model(dest: Path, family: str, exporter: str, layers: int, hidden: int | None, heads: int | None,
               kv_heads: int | None, intermediate: int | None, vocab: int | None) -> Path:
    """Export `family` with random weights; FP32 weights in `<dest>.data` (external data) when large."""
    import torch

    from optfuse.models import build_model, input_infos, make_inputs, quiet
    from optfuse.models.facts import dim_ranges
    from optfuse.models.exporting import _output_infos

    overrides: dict = {"num_hidden_layers": layers}
    for key, value in (("hidden_size", hidden), ("num_attention_heads", heads), ("num_key_value_heads", kv_heads),
                       ("intermediate_size", intermediate), ("vocab_size", vocab)):
        if value is not None:
            overrides[key] = value
    dest.parent.mkdir(parents=True, exist_ok=True)
    with quiet(), torch.no_grad():
        model = build_model(family, "sdpa", 0, **overrides)
        inputs = input_infos(family, model.config)
        feeds = make_inputs(inputs)
        args = tuple(torch.from_numpy(feeds[i.name]) for i in inputs)
        outputs = _output_infos(inputs, model(*args))
        if exporter == "dynamo":
            from torch.export import Dim

            dim_max = {k: v["max"] for k, v in dim_ranges(family, model.config).items() if k != "batch"}
            dims = {}
            specs = []
            for info in inputs:
                axes = {}
                for a, s in enumerate(info.shape):
                    if isinstance(s, str):
                        dims.setdefault(s, Dim(s, max=dim_max[s]) if s in dim_max else Dim(s))
                        axes[a] = dims[s]
                specs.append(axes or None)
            torch.onnx.export(model, args, str(dest), dynamo=True, input_names=[i.name for i in inputs],
                              output_names=[o.name for o in outputs], dynamic_shapes=(tuple(specs),),
                              external_data=True, optimize=True, verbose=False)
        else:
            dynamic_axes = {i.name: {a: s for a, s in enumerate(i.shape) if isinstance(s, str)}
                            for i in [*inputs, *outputs]}
            torch.onnx.export(model, args, str(dest), dynamo=False, opset_version=17,
                              input_names=[i.name for i in inputs], output_names=[o.name for o in outputs],
                              dynamic_axes=dynamic_axes, do_constant_folding=True)
    return dest


def _small(args) -> list[Measurement]:
    rows: list[Measurement] = []
    for family, model_type in (("llama", "gpt2"), ("bert", "bert")):
        for layers in args.layers:
            with tempfile.TemporaryDirectory(prefix="bench-small-") as tmp:
                # exported by a child process: a child forked from a process holding torch and the
                # model would start with that process's RSS as its peak
                path = Path(tmp) / f"{family}{layers}.onnx"
                subprocess.run([sys.executable, __file__, "make", str(path), "--family", family,
                                "--layers", str(layers)], env=_env(), check=True, stdout=subprocess.DEVNULL)
                rows += run_tools(path, model_type, verify=False, ort=True, label=f"{family} {layers} layers")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make", help="export a model with random weights")
    mk.add_argument("dest", type=Path)
    mk.add_argument("--family", default="llama")
    mk.add_argument("--exporter", default="dynamo", choices=["dynamo", "torchscript"])
    mk.add_argument("--layers", type=int, default=8)
    for name in ("hidden", "heads", "kv-heads", "intermediate", "vocab"):
        mk.add_argument(f"--{name}", type=int)
    rn = sub.add_parser("run", help="measure the tools on a model file")
    rn.add_argument("model", type=Path)
    rn.add_argument("--model-type", default="gpt2", help="the optimizer's --model_type (gpt2 for decoders, bert)")
    rn.add_argument("--verify", action="store_true", help="also measure fuse --verify")
    rn.add_argument("--ort", action="store_true", help="also measure onnxruntime's transformers optimizer")
    sm = sub.add_parser("small", help="the small-width LLaMA and BERT rows (exported, measured, deleted)")
    sm.add_argument("--layers", type=int, nargs="+", default=[12, 48])
    args = p.parse_args(argv)
    if args.cmd == "make":
        path = make_model(args.dest, args.family, args.exporter, args.layers, args.hidden, args.heads,
                          args.kv_heads, args.intermediate, args.vocab)
        print(f"{path}: {weights_bytes(path) / GB:.2f} GB of weights")
        return 0
    rows = run_tools(args.model, args.model_type, args.verify, args.ort) if args.cmd == "run" else _small(args)
    print(table(rows))
    return 0 if all(r.rc == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
