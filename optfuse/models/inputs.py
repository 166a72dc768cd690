"""Graph-input descriptions of the test models and random feeds for them.

:class:`InputInfo` is one graph input as a recipe declares it (dtype, shape with symbolic dims,
value range ``[low, high)``, kind); :func:`input_infos` derives a family's inputs from its config;
:func:`make_inputs` draws seeded feeds in the declared ranges (padding masks right-padded, never a
fully masked row). :data:`DEFAULT_DIMS` are the symbolic dims' values for the example inputs
(export, samples, verify).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence

import numpy as np

from .families import config_value, get_family

#: Concrete values of the symbolic dims for the example inputs (export, samples, verify).
DEFAULT_DIMS: dict[str, int] = {"batch": 2, "sequence": 16}


@dataclass(frozen=True)
class InputInfo:
    """One graph input. ``shape`` mixes ints and symbolic dim names; values lie in ``[low, high)``.

    ``kind`` is a recipe input kind: ``tokens`` (integers, uniform in the range), ``mask``
    (0/1, right-padded: ones then zeros per row) or ``float`` (uniform in the range).
    """

    name: str
    dtype: str
    shape: list[int | str]
    low: float
    high: float
    kind: Literal["tokens", "mask", "float"]
    doc: str = ""

    def concrete_shape(self, dims: Mapping[str, int] | None = None) -> list[int]:
        d = {**DEFAULT_DIMS, **(dims or {})}
        return [s if isinstance(s, int) else int(d[s]) for s in self.shape]

    def to_recipe(self) -> dict[str, Any]:
        """This input as a recipe ``inputs.<name>`` entry (dtype, shape, range, kind)."""
        return {"dtype": self.dtype, "shape": list(self.shape), "range": [self.low, self.high], "kind": self.kind}


@dataclass(frozen=True)
class OutputInfo:
    """One graph output (the wrapped models have one: ``last_hidden_state``)."""

    name: str
    dtype: str
    shape: list[int | str]


def input_infos(family: str, config: Any) -> list[InputInfo]:
    """The graph inputs of a family's model with this config."""
    fam = get_family(family)
    infos = []
    for name in fam.inputs:
        if name == "input_ids":
            vocab = int(config_value(config, "vocab_size"))
            infos.append(InputInfo(name, "int64", ["batch", "sequence"], 0, vocab, "tokens", "token ids"))
        elif name == "token_type_ids":
            n = int(config_value(config, "type_vocab_size"))
            infos.append(InputInfo(name, "int64", ["batch", "sequence"], 0, n, "tokens", "segment ids"))
        elif name == "attention_mask":
            infos.append(InputInfo(name, "int64", ["batch", "sequence"], 0, 2, "mask",
                                   "1 = attend, 0 = padding (right-padded)"))
        elif name == "pixel_values":
            c, s = int(config_value(config, "num_channels")), int(config_value(config, "image_size"))
            infos.append(InputInfo(name, "float32", ["batch", c, s, s], -1.0, 1.0, "float", "normalized image"))
        else:  # pragma: no cover - a family naming an input this table lacks
            raise AssertionError(f"no input description for {name!r}")
    return infos


def make_inputs(inputs: Sequence[InputInfo], dims: Mapping[str, int] | None = None,
                seed: int = 0) -> dict[str, np.ndarray]:
    """Random feeds in the declared ranges. Masks: row 0 all ones, row 1 right-padded to about half,
    later rows random lengths >= 1 (so padding paths run but no query row is fully masked)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for info in inputs:
        shape = info.concrete_shape(dims)
        if info.kind == "mask":
            arr = np.ones(shape, dtype=info.dtype)
            rows, length = arr.reshape(-1, shape[-1]), shape[-1]
            for r in range(1, rows.shape[0]):
                keep = max(1, length // 2) if r == 1 else int(rng.integers(1, length + 1))
                rows[r, keep:] = 0
        elif info.kind == "tokens":
            arr = rng.integers(int(info.low), int(info.high), size=shape).astype(info.dtype)
        else:
            arr = rng.uniform(info.low, info.high, size=shape).astype(info.dtype)
        feeds[info.name] = arr
    return feeds
