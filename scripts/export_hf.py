#!/usr/bin/env python
"""Export tiny random-weight HuggingFace models to ONNX (CLI over optfuse.models).

    python scripts/export_hf.py --family bert --exporter dynamo --attn sdpa -o models/
    python scripts/export_hf.py --all -o models/            # every family x exporter x attn
    python scripts/export_hf.py --list                      # families and their expected counts
    python scripts/export_hf.py --family llama --set num_hidden_layers=4 --opset 18

Prints a JSON list on stdout, one object per export: path, inputs (recipe form: dtype, shape,
range [low, high), kind), dims, counts, opset and export time. Progress and failures go to stderr;
the exit status is 1 when any export failed. No hub access: models are built from configs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

try:
    from optfuse import models
except ModuleNotFoundError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from optfuse import models


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", action="append", choices=list(models.FAMILIES),
                   help="model family (repeatable; default with --all: every family)")
    p.add_argument("--exporter", choices=[*models.EXPORTERS, "both"], default=None,
                   help="torch exporter (default: dynamo, or both with --all)")
    p.add_argument("--attn", choices=[*models.ATTNS, "both"], default=None,
                   help="transformers attention implementation (default: sdpa, or both with --all)")
    p.add_argument("--all", action="store_true", help="every family x exporter x attn (unless narrowed)")
    p.add_argument("-o", "--out-dir", type=Path, default=Path("models"), help="output folder (default: models/)")
    p.add_argument("--opset", type=int, default=None,
                   help=f"ONNX opset (default: {models.DEFAULT_TORCHSCRIPT_OPSET} for torchscript, the exporter's for dynamo)")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed for the weights (default 0)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, e.g. num_hidden_layers=4 (VALUE parsed as JSON when it can be)")
    p.add_argument("--no-optimize", action="store_true", help="dynamo: skip the exporter's ONNX optimizer")
    p.add_argument("--list", action="store_true", help="list families with their inputs and expected counts")
    args = p.parse_args(argv)

    if args.list:
        return _list()
    if not args.family and not args.all:
        p.error("give --family NAME (repeatable) or --all")
    families = args.family or list(models.FAMILIES)
    exporters = _expand(args.exporter, models.EXPORTERS, "dynamo", args.all)
    attns = _expand(args.attn, models.ATTNS, "sdpa", args.all)
    overrides = {}
    for item in args.overrides:
        key, sep, val = item.partition("=")
        if not sep:
            p.error(f"--set expects KEY=VALUE, got {item!r}")
        overrides[key] = _value(val)

    results, failed = [], 0
    for fam in families:
        for exp in exporters:
            for attn in attns:
                label = f"{fam} {exp} attn={attn}"
                known = models.KNOWN_FAILURES.get((fam, exp, attn))
                if known:
                    print(f"[export_hf] {label}: known failure, trying anyway ({known})", file=sys.stderr)
                try:
                    m = models.export_model(fam, exp, attn, args.out_dir, args.opset, seed=args.seed,
                                            optimize=not args.no_optimize, **overrides)
                except (models.ExportError, ValueError) as exc:
                    failed += 1
                    print(f"[export_hf] {label}: FAILED: {exc}", file=sys.stderr)
                    continue
                print(f"[export_hf] {label}: {m.path} (opset {m.opset}, {m.export_seconds:.1f}s)", file=sys.stderr)
                results.append({
                    "path": str(m.path), "family": m.family, "exporter": m.exporter, "attn": m.attn,
                    "opset": m.opset, "inputs": m.recipe_inputs(), "dims": m.dims, "counts": m.counts,
                    "outputs": [o.__dict__ for o in m.outputs], "export_seconds": m.export_seconds,
                    "sidecar": str(m.json_path),
                })
    print(json.dumps(results, indent=2))
    return 1 if failed else 0


def _expand(choice: str | None, options: tuple[str, ...], default: str, all_: bool) -> list[str]:
    if choice == "both" or (choice is None and all_):
        return list(options)
    return [choice or default]


def _list() -> int:
    out = {}
    for name, fam in models.FAMILIES.items():
        cfg = fam.config()
        out[name] = {
            "description": fam.description,
            "model_class": fam.model_class,
            "inputs": {i.name: i.to_recipe() for i in models.input_infos(name, cfg)},
            "counts": models.expected_counts(name, cfg),
        }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
