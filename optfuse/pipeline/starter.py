"""``optfuse recipe init``: a starter recipe from a model's inputs.

It names every graph input with its dtype and shape (the model's symbolic dims, or
``<input>_<axis>`` for an axis with no name), marks token inputs (integer inputs that index a
``Gather`` table: ``kind: tokens`` with ``range: [0, rows)``) and mask inputs (``*mask*``:
``kind: mask``), and suggests a profile for every dim: the command line's shapes where given, else
batch ``1..8`` (opt 2) and ``1..128`` (opt 16) for the others. A dim the model names by an
expression over other dims (``past_sequence_length + 1``) stays that expression in the shape, and
the dims it reads are declared. The text is validated by the recipe schema before it is written, so
``optfuse recipe check`` accepts it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import yaml

from ..defaults import derived_dims, input_dim_names, is_batch_name, value_shape
from ..errors import InputError
from ..recipe import recipe_from_dict
from .model import load_checked
from .options import NO_OVERRIDES, Overrides, resolve_dims

_RECIPE_DTYPES = {"float32", "float16", "bfloat16", "int64", "int32", "int8", "uint8", "bool"}
_DIM_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")
SUGGESTED_BATCH = (1, 2, 8)
SUGGESTED_OTHER = (1, 16, 128)


@dataclass
class StarterRecipe:
    path: Path
    data: dict[str, Any]
    skipped: list[str]  # inputs a recipe cannot describe (their dtype), left to verify's inference


def starter_recipe(model: str | os.PathLike, output: str | os.PathLike | None = None, *, force: bool = False,
                   overrides: Overrides = NO_OVERRIDES) -> StarterRecipe:
    """Write a starter recipe for `model` to `output` (default ``<model>.recipe.yaml`` beside it)."""
    from ..verify import gather_table_rows

    model = Path(model)
    dest = Path(output) if output is not None else model.with_name(f"{model.stem}.recipe.yaml")
    if dest.exists() and not force:
        raise InputError(f"{dest} exists; pass --force to replace it or -o to write elsewhere")
    proto = load_checked(model)
    plan = resolve_dims(proto, None, overrides)  # checks the command line's shapes against the model
    rows = gather_table_rows(proto)
    inits = {t.name for t in proto.graph.initializer}
    inputs: dict[str, Any] = {}
    dims: dict[str, dict[str, int]] = {}
    derived: list[str] = []  # shape entries that are expressions over other dims (past_sequence_length + 1)
    derived_names = derived_dims(input_dim_names(proto))
    skipped: list[str] = []
    for inp in proto.graph.input:
        if inp.name in inits:
            continue
        dtype = _dtype_name(inp)
        raw = value_shape(inp)
        if dtype not in _RECIPE_DTYPES or raw is None:
            skipped.append(inp.name)
            continue
        shape: list[int | str] = []
        for axis, d in enumerate(raw):
            if isinstance(d, int):
                shape.append(d)
                continue
            if d in derived_names:  # an expression over other dims: spelled as is
                shape.append(d)
                derived.append(d)
                continue
            source = d if d is not None else f"{inp.name}.{axis}"
            name = d if d is not None and _DIM_NAME.match(d) else _dim_name(inp.name, axis, d)
            if plan.sources.get(source) == "command line":
                lo, mid, hi = plan.ranges[source]
            else:
                lo, mid, hi = SUGGESTED_BATCH if axis == 0 or is_batch_name(name) else SUGGESTED_OTHER
            dims.setdefault(name, {"min": lo, "opt": mid, "max": hi})
            shape.append(name)
        spec: dict[str, Any] = {"dtype": dtype, "shape": shape}
        if "mask" in inp.name.lower():
            spec["kind"] = "mask"
        elif inp.name in rows and dtype.startswith(("int", "uint")):
            spec.update(kind="tokens", range=[0, int(rows[inp.name])])
        inputs[inp.name] = spec
    for d in derived:  # the dims an expression reads are dims of the recipe too (an input skipped above held them)
        for n in sorted(derived_names[d][1] - set(dims)):
            lo, mid, hi = SUGGESTED_BATCH if is_batch_name(n) else SUGGESTED_OTHER
            dims[n] = {"min": lo, "opt": mid, "max": hi}
    rel = os.path.relpath(model.resolve(), dest.resolve().parent)
    data = {"name": _recipe_name(model.stem), "model": {"path": rel}, "inputs": inputs, "dims": dims,
            "fusions": {"layer_norm": True, "rms_norm": True, "skip_norm": True, "attention": True},
            "precision": {"mode": "fp32", "keep_fp32": [], "io_dtype": "keep"},
            "tolerances": {"atol": 1.0e-4, "rtol": 1.0e-3},
            "target": {"arch": "sm_90", "backend": "auto"}}
    text = render(data, model, skipped)
    recipe_from_dict(yaml.safe_load(text), label=f"recipe {dest}", base_dir=dest.resolve().parent)  # check first
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)
    except OSError as exc:
        raise InputError(f"cannot write {dest}: {exc.strerror or exc}") from None
    return StarterRecipe(dest, data, skipped)


def render(data: dict[str, Any], model: Path, skipped: list[str]) -> str:
    """The recipe as YAML, one flow mapping per input and dim, with comments saying what to edit."""
    lines = [f"# Starter recipe for {model.name} (optfuse recipe init). Set each dim's min/opt/max to the",
             "# shapes you serve: they become the engine profile; verify feeds the opt shapes.",
             f"name: {flow(data['name'])}", "model:", f"  path: {flow(data['model']['path'])}"]
    if data["inputs"]:
        lines.append("inputs:")
        lines += [f"  {flow(name)}: {flow(spec)}" for name, spec in data["inputs"].items()]
    for name in skipped:
        lines.append(f"# input {name!r}: a recipe cannot describe its dtype or shape; verify infers it")
    if data["dims"]:
        lines.append("dims:")
        lines += [f"  {flow(name)}: {flow(d)}" for name, d in data["dims"].items()]
    for key in ("fusions", "precision", "tolerances", "target"):
        lines.append(f"{key}: {flow(data[key])}")
    return "\n".join(lines) + "\n"


def flow(value: Any) -> str:
    """`value` as one line of flow-style YAML."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1000, sort_keys=False).strip()
    return text[: -len("...")].strip() if text.endswith("\n...") else text


def _dtype_name(inp: onnx.ValueInfoProto) -> str:
    elem = inp.type.tensor_type.elem_type
    if elem == onnx.TensorProto.BFLOAT16:
        return "bfloat16"
    try:
        name = onnx.helper.tensor_dtype_to_np_dtype(elem).name
    except Exception:  # noqa: BLE001
        return onnx.TensorProto.DataType.Name(elem).lower()
    return "bool" if name.startswith("bool") else name


def _dim_name(input_name: str, axis: int, given: str | None) -> str:
    base = re.sub(r"[^A-Za-z0-9_]", "_", given if given else f"{input_name}_{axis}")
    return base if re.match(r"^[A-Za-z_]", base) else f"d_{base}"


def _recipe_name(stem: str) -> str:
    return re.sub(r"\s+", "_", stem) or "model"
