#!/usr/bin/env python
"""optfuse's FP8 (E4M3) PTQ next to NVIDIA ModelOpt's ONNX FP8 PTQ on the same models and calibration data.

    python scripts/compare_modelopt_fp8.py                               # bert, gpt2, vit, llama
    python scripts/compare_modelopt_fp8.py --family llama --method max --markdown table.md
    python scripts/compare_modelopt_fp8.py --modelopt-python /tmp/modelopt-venv/bin/python
    python scripts/compare_modelopt_fp8.py --seeds 10 --iterations 30 --scale-grid   # spread over verify seeds
    python scripts/compare_modelopt_fp8.py --seeds 10 --first-seed 10 --iterations 30  # seeds 10 .. 19

ModelOpt is never an optfuse dependency: it runs as ``python -m modelopt.onnx.quantization
--quantize_mode fp8`` in a separate environment (``--modelopt-python``, default
``$OPTFUSE_MODELOPT_PYTHON`` or ``/tmp/modelopt-venv/bin/python``; made with ``python -m venv
--system-site-packages /tmp/modelopt-venv && /tmp/modelopt-venv/bin/pip install 'nvidia-modelopt[onnx]'``),
on the exported FP32 model, calibrating on the CPU with the same batches optfuse uses (verify's input
generator, seed 1, concatenated along the batch axis into one ``.npz``), high precision FP16.

Each candidate is compared with the FP32 original in onnxruntime (CPU) on the same verify batches
(``--iterations`` batches, seed 0 or ``--first-seed``): max / mean |diff| and cosine similarity per output; and its Q/DQ nodes are counted with
where they sit (the op types a DequantizeLinear feeds, the optfuse nodes a QuantizeLinear feeds).
Rows per model: optfuse FP16 (the base precision alone), optfuse FP8 with the GEMM fusions off
(TensorRT's Q/DQ pattern on the unfused GEMMs), the same with the attention fusion off too (plus
TensorRT's FP8 MHA pattern: ModelOpt's placement), optfuse FP8 fused (the optfuse GEMM nodes take FP8
directly once the GEMM spec has its FP8 form), the same with ``scale_steps`` 1 (amax / 448 exactly,
no grid-alignment search: ``optfuse.precision.calibrate``), ModelOpt FP8 with ``--calibration_method max`` (its
default op types, and only MatMul/Gemm: optfuse's placement) and with its default calibrator
(entropy). Prints a Markdown table; ``--json`` writes every number.

The max |diff| of a tiny model's output is one element: ``--seeds N`` verifies on N seeds (0 .. N-1,
``--iterations`` batches each) and reports the max |diff| as its mean over the seeds with the lowest
and highest, mean |diff| and cosine as their means; the default (one seed, 3 batches) is the
README's main table. ModelOpt 0.47's ONNX FP8 scale is not amax / 448: ``int8_to_fp8`` multiplies
onnxruntime's INT8 scale (amax / 127) by 448 / 127, so its scale is amax / 36.0 and its grid of E4M3
values sits at another place relative to the data (448 / 36 is no power of two); ``--scale-grid``
adds diagnostic rows, optfuse's Q/DQ + MHA placement with its activation and weight scales changed:
amax / 36 (ModelOpt's scales), amax / 288 (the same grid: 288 = 8 x 36, the same E4M3 rounding of
every value but the smallest, which go subnormal), amax / 224 (optfuse's grid, 2x headroom: values up
to twice the calibration amax do not saturate) and a few other non-power-of-two factors (another
rounding of the same data). They are not optfuse policy.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx

try:
    import optfuse  # noqa: F401
except ModuleNotFoundError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from optfuse import DOMAIN, models  # noqa: E402
from optfuse.fusions import available_families, fuse_model  # noqa: E402
from optfuse.pipeline.fp8 import calibration_feeds  # noqa: E402
from optfuse.pipeline.options import CalibrationSettings  # noqa: E402
from optfuse.precision import PrecisionOptions, apply_precision  # noqa: E402
from optfuse.precision.fp8 import PLUGIN_GEMMS, fp8_ready  # noqa: E402
from optfuse.verify import verify  # noqa: E402

FAMILIES = ("bert", "gpt2", "vit", "llama")
DIMS = {"batch": 2, "sequence": 16}


def qdq_placement(model: onnx.ModelProto) -> dict:
    """Q/DQ counts and where they sit: the op types each DequantizeLinear output feeds, the optfuse
    ops a QuantizeLinear output feeds directly."""
    consumers = collections.defaultdict(list)
    for n in model.graph.node:
        for i in n.input:
            consumers[i].append(n)
    fed = collections.Counter()
    direct = collections.Counter()
    for n in model.graph.node:
        for c in consumers[n.output[0]] if n.op_type == "DequantizeLinear" else ():
            fed[c.op_type] += 1
        for c in consumers[n.output[0]] if n.op_type == "QuantizeLinear" else ():
            if c.domain == DOMAIN:
                direct[c.op_type] += 1
    ops = collections.Counter(n.op_type for n in model.graph.node)
    return {"Q": ops["QuantizeLinear"], "DQ": ops["DequantizeLinear"], "dq_feeds": dict(fed),
            "q_feeds_optfuse": dict(direct)}


def _errors(original: Path, candidate: Path, iterations: int, seeds: int = 1, first_seed: int = 0) -> dict:
    """Per output: max / mean |diff| and cosine on `iterations` verify batches of seed `first_seed`
    (seeds == 1), else per seed (``per_seed``) and over the seeds: max |diff| mean / lowest / highest,
    the others' means."""
    runs = [verify(str(original), str(candidate), None, iterations=iterations, seed=s)
            for s in range(first_seed, first_seed + seeds)]
    out = {}
    for i, o in enumerate(runs[0].outputs):
        per = [{"max_abs": r.outputs[i].max_abs, "mean_abs": r.outputs[i].mean_abs, "cosine": r.outputs[i].cosine}
               for r in runs]
        if seeds == 1:
            out[o.name] = per[0]
            continue
        mx = [p["max_abs"] for p in per]
        out[o.name] = {"max_abs": float(np.mean(mx)), "max_abs_lowest": min(mx), "max_abs_highest": max(mx),
                       "mean_abs": float(np.mean([p["mean_abs"] for p in per])),
                       "cosine": float(np.mean([p["cosine"] for p in per])), "per_seed": per}
    return out


#: --scale-grid: what each diagnostic row maps amax to (scale = amax / target; weights per channel alike)
SCALE_GRID = ((36.0, "amax / 36: ModelOpt's scales"), (288.0, "amax / 288: ModelOpt's grid, 8x its range"),
              (224.0, "amax / 224: optfuse's grid, 2x headroom"), (400.0, "amax / 400"), (350.0, "amax / 350"),
              (300.0, "amax / 300"), (250.0, "amax / 250"))


@contextlib.contextmanager
def _scale_target(target: float):
    """Diagnostic only: optfuse's FP8 scales with amax mapped to `target` instead of 448 (activations
    and weights; the E4M3 saturation stays at +-448; no grid-alignment search: scale_steps 1)."""
    from optfuse.precision import calibrate as cal, fp8

    saved = cal.scale_of, cal.weight_scales, fp8.weight_scales
    factor = cal.E4M3_MAX / target

    def scale_of(amax: float) -> float:
        return float(amax) / target if amax > 0 and np.isfinite(amax) else 1.0

    def weight_scales(w: np.ndarray, axis: int, steps: int = 1, rounding=None) -> np.ndarray:
        s = (saved[1](w, axis, 1).astype(np.float64) * factor).astype(np.float32)
        return s if rounding is None else np.asarray(rounding(s), np.float32)

    cal.scale_of, cal.weight_scales, fp8.weight_scales = scale_of, weight_scales, weight_scales
    try:
        yield
    finally:
        cal.scale_of, cal.weight_scales, fp8.weight_scales = saved


def _modelopt(python: str, original: Path, npz: Path, out: Path, method: str | None, gemms_only: bool = False) -> str:
    cmd = [python, "-m", "modelopt.onnx.quantization", "--onnx_path", str(original), "--quantize_mode", "fp8",
           "--calibration_data_path", str(npz), "--calibration_eps", "cpu", "--high_precision_dtype", "fp16",
           "--output_path", str(out)]
    if method:
        cmd += ["--calibration_method", method]
    if gemms_only:
        cmd += ["--op_types_to_quantize", "MatMul", "Gemm"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0 or not out.is_file():
        tail = (run.stderr or run.stdout).strip().splitlines()[-3:]
        return "ModelOpt failed: " + " | ".join(tail)
    return ""


def compare(family: str, exporter: str, workdir: Path, python: str, batches: int, method: str,
            iterations: int, seeds: int = 1, scale_grid: bool = False, first_seed: int = 0) -> list[dict]:
    em = models.cached_export(family, exporter, "sdpa", None, cache_dir=Path.home() / ".cache" / "optfuse" / "models")
    # ModelOpt writes its shape-inferred model back over --onnx_path: it gets a copy, never the cached export
    source = workdir / f"{family}.fp32.onnx"
    shutil.copyfile(em.path, source)
    original = onnx.load(str(source))
    feeds = calibration_feeds(original, None, settings=CalibrationSettings(batches=batches, seed=1))
    npz = workdir / f"{family}.calibration.npz"
    np.savez(npz, **{k: np.concatenate([f[k] for f in feeds]) for k in feeds[0]})
    rows = []

    def row(label: str, model: onnx.ModelProto | None, path: Path, note: str = "") -> None:
        if model is not None:
            onnx.save(model, path)
        if note and not path.is_file():
            rows.append({"model": family, "candidate": label, "note": note})
            return
        m = onnx.load(str(path), load_external_data=False)
        rows.append({"model": family, "candidate": label, "errors": _errors(source, path, iterations, seeds, first_seed),
                     "qdq": qdq_placement(m), "note": note})

    options = PrecisionOptions(mode="fp8", calibrator=method)
    fused, _ = fuse_model(original, dims=DIMS)
    half, _ = apply_precision(fused, PrecisionOptions(mode="fp16"))
    row("optfuse FP16 (fused)", half, workdir / f"{family}.fp16.onnx")
    unfused, _ = fuse_model(original, dims=DIMS, families=[f for f in available_families() if f != "gemm"])
    qdq, _ = apply_precision(unfused, options, feeds)
    row(f"optfuse FP8 Q/DQ ({method})", qdq, workdir / f"{family}.fp8-qdq.onnx")
    bare, _ = fuse_model(original, dims=DIMS, families=[f for f in available_families() if f not in ("gemm", "attention")])
    mha, _ = apply_precision(bare, options, feeds)
    row(f"optfuse FP8 Q/DQ + MHA ({method})", mha, workdir / f"{family}.fp8-mha.onnx")
    plugin, res = apply_precision(fused, options, feeds)
    ready = all(fp8_ready(op) for op in PLUGIN_GEMMS)
    row(f"optfuse FP8 fused ({method})", plugin, workdir / f"{family}.fp8-fused.onnx",
        "" if ready else f"GEMM spec without FP8: {len(res.fp8['gemms'])} GEMM(s) quantized")
    exact, _ = apply_precision(fused, replace(options, scale_steps=1), feeds)
    row(f"optfuse FP8 fused ({method}), scale_steps 1: amax / 448, no grid alignment", exact,
        workdir / f"{family}.fp8-fused-steps1.onnx")
    for m, gemms_only in (("max", False), ("max", True), (None, False)):
        out = workdir / f"{family}.modelopt-{m or 'default'}{'-gemms' if gemms_only else ''}.onnx"
        note = _modelopt(python, source, npz, out, m, gemms_only)
        label = f"{m or 'default: entropy'}{', --op_types_to_quantize MatMul Gemm' if gemms_only else ''}"
        row(f"ModelOpt FP8 ({label})", None, out, note)
    for target, label in SCALE_GRID if scale_grid else ():
        with _scale_target(target):
            grid, _ = apply_precision(bare, replace(options, scale_steps=1), feeds)
        row(f"diagnostic: optfuse FP8 Q/DQ + MHA ({method}), {label}", grid,
            workdir / f"{family}.fp8-mha-amax{target:g}.onnx")
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| model | candidate | output | max abs | mean abs | cosine | Q | DQ | DQ feeds | Q feeds optfuse op | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "errors" not in r:
            lines.append(f"| {r['model']} | {r['candidate']} | - | - | - | - | - | - | - | - | {r['note']} |")
            continue
        q = r["qdq"]
        feeds = ", ".join(f"{k} {v}" for k, v in sorted(q["dq_feeds"].items())) or "-"
        direct = ", ".join(f"{k} {v}" for k, v in sorted(q["q_feeds_optfuse"].items())) or "-"
        for name, e in r["errors"].items():
            mx = f"{e['max_abs']:.3g}"
            if "per_seed" in e:
                mx += f" [{e['max_abs_lowest']:.3g}, {e['max_abs_highest']:.3g}]"
            lines.append(f"| {r['model']} | {r['candidate']} | {name} | {mx} | {e['mean_abs']:.3g} | "
                         f"{e['cosine']:.5f} | {q['Q']} | {q['DQ']} | {feeds} | {direct} | {r['note']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", action="append", choices=FAMILIES, help="model family (repeatable; default: all four)")
    p.add_argument("--exporter", choices=list(models.EXPORTERS), default="dynamo")
    p.add_argument("--modelopt-python", default=os.environ.get("OPTFUSE_MODELOPT_PYTHON", "/tmp/modelopt-venv/bin/python"))
    p.add_argument("--batches", type=int, default=8, help="calibration batches (default 8)")
    p.add_argument("--method", choices=["max", "percentile", "mse"], default="max",
                   help="optfuse's calibrator (ModelOpt runs max and its default, entropy)")
    p.add_argument("--iterations", type=int, default=3, help="verify batches per seed (default 3)")
    p.add_argument("--seeds", type=int, default=1,
                   help="verify seeds 0 .. N-1 (default 1); N > 1: max abs as mean [lowest, highest] over the seeds")
    p.add_argument("--first-seed", type=int, default=0, help="the first verify seed (default 0)")
    p.add_argument("--scale-grid", action="store_true",
                   help="diagnostic rows: the Q/DQ + MHA placement with amax mapped to 36, 288, 224, ... (not policy)")
    p.add_argument("--workdir", type=Path, help="where the candidates are written (default: a temporary folder)")
    p.add_argument("--markdown", type=Path, help="also write the table here")
    p.add_argument("--json", type=Path, help="write every number here")
    a = p.parse_args(argv)
    if a.seeds < 1 or a.iterations < 1 or a.first_seed < 0:
        p.error("--seeds and --iterations must be >= 1, --first-seed >= 0")
    if not Path(a.modelopt_python).is_file():
        print(f"error: --modelopt-python {a.modelopt_python} not found (see the module doc)", file=sys.stderr)
        return 2
    workdir = a.workdir or Path(tempfile.mkdtemp(prefix="optfuse-modelopt-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for family in a.family or FAMILIES:
        print(f"{family}: ...", file=sys.stderr)
        rows += compare(family, a.exporter, workdir, a.modelopt_python, a.batches, a.method, a.iterations, a.seeds,
                        a.scale_grid, a.first_seed)
    table = markdown(rows)
    print(table)
    if a.markdown:
        a.markdown.write_text(table)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
