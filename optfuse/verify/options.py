"""The verify stage's typed options (what it needs from a recipe) and its results (plain data)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..defaults import DEFAULT_FP8_MIN_COSINE, DEFAULT_FP8_MIN_TOP1, DEFAULT_TOLERANCES

DEFAULT_ITERATIONS = 3


# ------------------------------------------------------------------------------------------------
# Options
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FeedSpec:
    """How to make one input, as a recipe's ``inputs.<name>`` describes it."""

    dtype: str  # float32 | float16 | bfloat16 | int64 | int32 | int8 | uint8 | bool
    shape: tuple[int, ...]  # concrete: every named dim at its opt value
    kind: str | None = None  # tokens | mask | float (None: inferred from the graph)
    range: tuple[float, float] | None = None  # [low, high)
    padding: str = "right"  # a mask's padding: right | left
    npz: Path | None = None  # values from this file (resolved path)
    npz_label: str = ""  # the file as the recipe spells it (for the inputs table)


@dataclass(frozen=True)
class Tolerances:
    """(atol, rtol) of every output of a candidate in one precision mode, with per-output overrides."""

    atol: float
    rtol: float
    outputs: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    def of(self, output: str) -> tuple[float, float]:
        return self.outputs.get(output, (self.atol, self.rtol))


def default_tolerances() -> dict[str, Tolerances]:
    return {mode: Tolerances(a, r) for mode, (a, r) in DEFAULT_TOLERANCES.items()}


@dataclass(frozen=True)
class Agreement:
    """Scale-free bars a candidate's outputs must also meet (None: reported, not required): the
    cosine similarity of each output to the original's, and the top-1 agreement of head outputs
    (the fraction of rows whose last-axis argmax is the original's)."""

    min_cosine: float | None = None
    min_top1: float | None = None


def default_agreement() -> dict[str, Agreement]:
    return {"fp8": Agreement(DEFAULT_FP8_MIN_COSINE, DEFAULT_FP8_MIN_TOP1)}


@dataclass(frozen=True)
class VerifyOptions:
    """What verify needs from a recipe: input specs, the opt value of each named dim, and the
    tolerances per precision mode (fp32 / fp16 / bf16 / fp8) of the candidate, with the agreement
    bars per mode (fp8 only by default)."""

    inputs: Mapping[str, FeedSpec] = field(default_factory=dict)
    dims: Mapping[str, int] = field(default_factory=dict)
    tolerances: Mapping[str, Tolerances] = field(default_factory=default_tolerances)
    agreement: Mapping[str, Agreement] = field(default_factory=default_agreement)


def tolerance(options: VerifyOptions | None, output: str, mode: str = "fp32", atol: float | None = None,
              rtol: float | None = None) -> tuple[float, float]:
    """(atol, rtol) for `output` of a candidate computed in `mode`: `atol`/`rtol` when given (they
    override everything), else the options' value for that output and mode, else the mode's default."""
    table = (options.tolerances if options is not None else {}).get(mode)
    a, r = table.of(output) if table is not None else DEFAULT_TOLERANCES[mode]
    return (a if atol is None else atol), (r if rtol is None else rtol)


# ------------------------------------------------------------------------------------------------
# Results
# ------------------------------------------------------------------------------------------------
@dataclass
class OutputResult:
    name: str
    passed: bool
    max_abs: float
    max_rel: float
    mean_abs: float
    atol: float
    rtol: float
    shape: list[int] | None = None
    note: str = ""  # why it failed other than by tolerance (missing output, shape mismatch, NaN)
    #: [p, q] pairs: q is the p-quantile of |diff| over the compared elements (see QUANTILE_LEVELS)
    abs_quantiles: list[list[float]] = field(default_factory=list)
    #: cosine similarity of the candidate's values to the original's over every iteration (None: not compared)
    cosine: float | None = None
    #: head outputs (logits): the fraction of rows whose last-axis argmax is the original's; else None
    top1: float | None = None
    #: the bars `cosine` / `top1` were held to (None: reported only)
    min_cosine: float | None = None
    min_top1: float | None = None


#: The levels of OutputResult.abs_quantiles (the report draws the |diff| CDF from them).
QUANTILE_LEVELS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999, 0.9999, 1.0)
#: Elements of one output per iteration that the quantiles are computed from (a seeded sample above it).
QUANTILE_SAMPLE = 1 << 20


@dataclass
class InputInfo:
    name: str
    dtype: str
    shape: list[int]
    source: str  # how the values were made, e.g. "tokens [0, 1000) (Gather table rows)"


@dataclass
class VerifyResult:
    outputs: list[OutputResult]
    inputs: list[InputInfo]
    iterations: int
    seed: int
    original: str = ""
    candidate: str = ""
    method: str = ""  # how the candidate ran when not as it is (e.g. BF16 emulated in FP32); "" otherwise
    #: what the comparison left out and why (padded query positions of a fused attention; padding.padded_positions);
    #: "" when every element was compared
    left_out: str = ""

    @property
    def passed(self) -> bool:
        return bool(self.outputs) and all(o.passed for o in self.outputs)

    @property
    def failed(self) -> list[OutputResult]:
        return [o for o in self.outputs if not o.passed]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("method", "left_out"):
            if not d[key]:
                del d[key]
        d["passed"] = self.passed
        return d


@dataclass(frozen=True)
class CheckError:
    """A verification that raised before it compared anything (e.g. the candidate does not load)."""

    error: str

    passed = False


@dataclass(frozen=True)
class NotExecuted:
    """A check that did not run its candidate here: `reason` (e.g. no GPU for the engine) or the
    `error` that stopped it."""

    reason: str = ""
    error: str = ""

    passed = False
