"""What the flows take: a recipe (read from a file), turned into the typed options each stage
needs. No stage reads a Recipe; these functions are the only place that looks inside one.

- fuse: :func:`enabled_families`, :func:`analysis_dims` (dims for the HBM estimate), :func:`fusion_options`;
- verify: :func:`verify_options` (input specs at the opt dims, tolerances per precision mode);
- precision: :func:`precision_options`;
- build: :func:`build_profile` (the optimization profile).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import onnx

from ..defaults import DEFAULT_BATCH, DEFAULT_DIM, DEFAULT_TOLERANCES, concrete_dims
from ..pattern import FusionOptions
from ..precision import PrecisionOptions
from ..recipe import Recipe, load_recipe
from ..trt.build import BuildProfile
from ..verify import FeedSpec, Tolerances, VerifyOptions

#: Progress callback of every flow: called with a short text of what runs now.
Status = Callable[[str], None]


def noop(_: str) -> None:
    pass


def read_recipe(path: str | os.PathLike | None) -> Recipe | None:
    return None if path is None else load_recipe(path)


def recipe_label(recipe: Recipe | None) -> str | None:
    if recipe is None:
        return None
    return str(recipe.source) if recipe.source is not None else recipe.name


# ------------------------------------------------------------------------------------------------
# fuse
# ------------------------------------------------------------------------------------------------
def enabled_families(recipe: Recipe | None) -> list[str]:
    from ..fusions import available_families

    avail = available_families()
    if recipe is None:
        return avail
    on = set(recipe.fusions.enabled())
    return [f for f in avail if f in on]


def analysis_dims(model: onnx.ModelProto, recipe: Recipe | None) -> tuple[dict[str, int], str]:
    """Symbolic dims for size estimates: the recipe's opt values, else the defaults."""
    dims = concrete_dims(model, recipe.opt_dims() if recipe is not None else None)
    if recipe is not None and recipe.dims:
        return dims, "recipe opt shapes"
    return dims, f"defaults: batch {DEFAULT_BATCH}, other dims {DEFAULT_DIM}"


def fusion_options(recipe: Recipe | None) -> FusionOptions:
    if recipe is None:
        return FusionOptions()
    return FusionOptions(attention_full_mask=recipe.fusions.attention_full_mask)


# ------------------------------------------------------------------------------------------------
# verify / precision / build
# ------------------------------------------------------------------------------------------------
def verify_options(recipe: Recipe | None) -> VerifyOptions:
    """The recipe's inputs (shapes at the opt dims, npz paths resolved), opt dims and tolerances."""
    if recipe is None:
        return VerifyOptions()
    inputs = {}
    for name, spec in recipe.inputs.items():
        inputs[name] = FeedSpec(
            dtype=spec.dtype, shape=tuple(recipe.opt_shape(name)), kind=spec.kind,
            range=(spec.range[0], spec.range[1]) if spec.range is not None else None,
            npz=recipe.resolve_path(spec.npz) if spec.npz is not None else None,
            npz_label=str(spec.npz) if spec.npz is not None else "",
        )
    tolerances = {}
    for mode in DEFAULT_TOLERANCES:
        section = recipe.tolerances if mode == "fp32" else recipe.precision.tolerances
        overrides = {o: recipe.tolerance(o, mode) for o in section.outputs}
        tolerances[mode] = Tolerances(*recipe.tolerance(None, mode), outputs=overrides)
    return VerifyOptions(inputs=inputs, dims=recipe.opt_dims(), tolerances=tolerances)


def precision_options(recipe: Recipe | None) -> PrecisionOptions:
    if recipe is None:
        return PrecisionOptions()
    p = recipe.precision
    return PrecisionOptions(mode=p.mode, keep_fp32=tuple(p.keep_fp32), io_dtype=p.io_dtype)


def build_profile(recipe: Recipe | None, model_path: Path | None = None) -> BuildProfile:
    """The recipe's min/opt/max dims and input shapes; without a recipe every symbolic dim of the
    model gets min 1 and opt = max = its default value."""
    if recipe is not None and recipe.dims:
        dims = {k: (v.min, v.opt, v.max) for k, v in recipe.dims.items()}
        shapes = {k: list(v.shape) for k, v in recipe.inputs.items()} or None
        return BuildProfile(dims, shapes, "recipe min/opt/max")
    if model_path is None:
        return BuildProfile({}, None, "static shapes")
    m = onnx.load(str(model_path), load_external_data=False)
    dims = {k: (1, int(v), int(v)) for k, v in concrete_dims(m).items()}
    return BuildProfile(dims, None, "defaults (no recipe): min 1, opt = max = verify's default")
