"""The options several commands share, in the spelling of trtexec and polygraphy, and their parsing
into :class:`optfuse.pipeline.Overrides` (text only: the pipeline checks them against the model).

- shapes: ``--shapes name:1x128,...`` (min = opt = max), ``--min-shapes``/``--opt-shapes``/
  ``--max-shapes`` (trtexec: dims separated by ``x``, inputs by ``,``; each option repeatable). Given
  only an opt shape, min and max are the opt shape (as trtexec does);
- precision: ``--fp16``/``--bf16``/``--fp8``, ``--keep-fp32 PATTERN`` (repeatable);
- tolerances: ``--atol``/``--rtol`` ``VALUE`` (every output) or ``OUTPUT:VALUE`` (one output),
  repeatable, as in polygraphy.

Every malformed value is an InputError (exit 2) naming the option and what was expected.
"""

from __future__ import annotations

import math
import re
from typing import Optional

import typer

from ..errors import InputError

_DIMS = re.compile(r"^\d+(x\d+)*$")

SHAPES = typer.Option(None, "--shapes", help="Input shapes, min = opt = max: name:1x128[,name2:1x128] (repeatable).",
                      metavar="NAME:DIMS", show_default=False)
MIN_SHAPES = typer.Option(None, "--min-shapes", help="Minimum input shapes of the profile (trtexec syntax).",
                          metavar="NAME:DIMS", show_default=False)
OPT_SHAPES = typer.Option(None, "--opt-shapes", help="Opt input shapes: what verify feeds and estimates assume.",
                          metavar="NAME:DIMS", show_default=False)
MAX_SHAPES = typer.Option(None, "--max-shapes", help="Maximum input shapes of the profile (trtexec syntax).",
                          metavar="NAME:DIMS", show_default=False)
ATOL = typer.Option(None, "--atol", help="Absolute tolerance: VALUE for every output or OUTPUT:VALUE (repeatable).",
                    metavar="[OUT:]X", show_default=False)
RTOL = typer.Option(None, "--rtol", help="Relative tolerance: VALUE for every output or OUTPUT:VALUE (repeatable).",
                    metavar="[OUT:]X", show_default=False)
FP16 = typer.Option(False, "--fp16", help="Precision fp16 (over the recipe's precision.mode).")
BF16 = typer.Option(False, "--bf16", help="Precision bf16 (over the recipe's precision.mode).")
FP8 = typer.Option(False, "--fp8", help="Precision fp8: E4M3 GEMMs, calibrated; the rest in the recipe's "
                   "precision.fp8_base (default fp16).")
KEEP_FP32 = typer.Option(None, "--keep-fp32", help="Op type, node name or glob kept in FP32 (repeatable; "
                         "replaces the recipe's precision.keep_fp32).", metavar="PATTERN", show_default=False)
SAVE_INPUTS = typer.Option(None, "--save-inputs", help="Write the verify inputs (.npz, or .json: polygraphy's format).",
                           metavar="FILE", show_default=False)
LOAD_INPUTS = typer.Option(None, "--load-inputs", help="Verify on these inputs (.npz, or polygraphy .json; repeatable).",
                           metavar="FILE", show_default=False)
SAVE_OUTPUTS = typer.Option(None, "--save-outputs", help="Write both models' outputs (.npz, or .json: polygraphy's "
                            "RunResults).", metavar="FILE", show_default=False)
JSON = typer.Option(False, "--json", help="Print the result as JSON on stdout (progress stays on stderr).")


def parse_shapes(option: str, values: Optional[list[str]]) -> dict[str, tuple[int, ...]]:
    """``name:1x128,name2:2x16`` (repeatable) -> {name: (1, 128), ...}; a name may hold ``:``."""
    out: dict[str, tuple[int, ...]] = {}
    for value in values or []:
        for item in value.split(","):
            item = item.strip()
            name, sep, dims = item.rpartition(":")
            name = name.strip().strip("'\"")
            if not sep or not name or not _DIMS.match(dims.strip()):
                raise InputError(f"{option}: cannot parse {item!r}; expected name:DIMS with DIMS like 1x128 "
                                 f"(several inputs comma-separated)")
            shape = tuple(int(d) for d in dims.strip().split("x"))
            if any(d < 1 for d in shape):
                raise InputError(f"{option} {item}: every dim must be >= 1")
            if name in out and out[name] != shape:
                raise InputError(f"{option}: input {name!r} is given twice ({_text(out[name])} and {_text(shape)})")
            out[name] = shape
    return out


def shape_ranges(shapes: Optional[list[str]], min_shapes: Optional[list[str]], opt_shapes: Optional[list[str]],
                 max_shapes: Optional[list[str]]):
    """The four shape options -> {input: (min, opt, max)}; min <= opt <= max on every axis."""
    fixed = parse_shapes("--shapes", shapes)
    lo, mid, hi = (parse_shapes("--min-shapes", min_shapes), parse_shapes("--opt-shapes", opt_shapes),
                   parse_shapes("--max-shapes", max_shapes))
    out = {}
    for name, shape in fixed.items():
        if name in lo or name in mid or name in hi:
            raise InputError(f"--shapes {name}: give either --shapes or --min/--opt/--max-shapes for an input, not both")
        out[name] = (shape, shape, shape)
    for name in [*mid, *(n for n in [*lo, *hi] if n not in mid)]:
        if name not in mid:
            raise InputError(f"--min-shapes/--max-shapes {name}: needs --opt-shapes {name}:... too")
        o = mid[name]
        a, b = lo.get(name, o), hi.get(name, o)
        if not len(a) == len(o) == len(b):
            raise InputError(f"--min/--opt/--max-shapes {name}: ranks differ ({_text(a)}, {_text(o)}, {_text(b)})")
        for axis, (x, y, z) in enumerate(zip(a, o, b)):
            if not x <= y <= z:
                raise InputError(f"--min/--opt/--max-shapes {name}: axis {axis} needs min <= opt <= max, "
                                 f"got {x}, {y}, {z}")
        out[name] = (a, o, b)
    return out


def parse_tolerances(option: str, values: Optional[list[str]]) -> tuple[float | None, dict[str, float]]:
    """``--atol 1e-3`` / ``--atol out:1e-3`` (repeatable) -> (every output's value or None, per output)."""
    default: float | None = None
    per_output: dict[str, float] = {}
    for value in values or []:
        name, sep, number = value.rpartition(":")
        try:
            x = float(number)
        except ValueError:
            x = float("nan")
        if not math.isfinite(x) or x < 0 or (sep and not name):
            raise InputError(f"{option}: cannot parse {value!r}; expected a number >= 0 or OUTPUT:NUMBER (e.g. out:1e-3)")
        if sep:
            per_output[name] = x
        else:
            default = x
    return default, per_output


def precision_flag(fp16: bool, bf16: bool, fp8: bool) -> str | None:
    given = [flag for flag, on in (("--fp16", fp16), ("--bf16", bf16), ("--fp8", fp8)) if on]
    if len(given) > 1:
        raise InputError(f"{' and '.join(given)} exclude each other; give one")
    return "fp16" if fp16 else "bf16" if bf16 else "fp8" if fp8 else None


def overrides(*, shapes=None, min_shapes=None, opt_shapes=None, max_shapes=None, atol=None, rtol=None,
              fp16=False, bf16=False, fp8=False, keep_fp32=None):
    """Every shared option of a command -> Overrides (raises InputError on the first malformed value)."""
    from ..pipeline import Overrides

    a, a_out = parse_tolerances("--atol", atol)
    r, r_out = parse_tolerances("--rtol", rtol)
    return Overrides(shapes=shape_ranges(shapes, min_shapes, opt_shapes, max_shapes),
                     precision=precision_flag(fp16, bf16, fp8), keep_fp32=tuple(keep_fp32 or ()),
                     atol=a, rtol=r, output_atol=a_out, output_rtol=r_out)


def _text(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))
