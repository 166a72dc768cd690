"""What an export wrote: :class:`ExportedModel` (the ONNX path plus everything needed to use it),
its JSON sidecar, and :class:`ExportError` (an exporter failure as one line).

Next to ``<stem>.onnx`` an export writes ``<stem>.json`` (this record), ``<stem>.inputs.npz``
(the sample inputs, one array per input name) and ``<stem>.outputs.npz`` (torch's outputs for
them); :func:`load_exported` reads the record back without torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from .build import torch_outputs
from .inputs import InputInfo, OutputInfo, make_inputs


class ExportError(RuntimeError):
    """A torch exporter failed on a family; ``reason`` is one line naming the stage and the error."""

    def __init__(self, family: str, exporter: str, attn: str, reason: str):
        self.family, self.exporter, self.attn, self.reason = family, exporter, attn, reason
        super().__init__(f"{exporter} export of {family} (attn={attn}) failed: {reason}")


@dataclass
class ExportedModel:
    """What :func:`export_model` wrote, with everything a test or recipe needs to use it."""

    path: Path
    family: str
    exporter: str
    attn: str
    opset: int  # the default-domain opset in the file
    inputs: list[InputInfo]
    outputs: list[OutputInfo]
    counts: dict[str, int]
    dims: dict[str, dict[str, int]]  # symbolic dim -> {min, opt, max}
    meta: dict[str, Any]  # attention / norm / MLP facts: heads, kv heads, causal, activation, eps ...
    config: dict[str, Any]  # the transformers config, as config.to_dict()
    seed: int = 0
    overrides: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    export_seconds: float = 0.0  # wall time of torch.onnx.export
    export_cpu_seconds: float = 0.0  # process CPU time of torch.onnx.export (all threads)
    past: bool = False  # a decode graph over a KV cache (optfuse.models.decode)

    @property
    def sample_inputs_path(self) -> Path:
        return sidecar_path(self.path, ".inputs.npz")

    @property
    def sample_outputs_path(self) -> Path:
        return sidecar_path(self.path, ".outputs.npz")

    @property
    def json_path(self) -> Path:
        return sidecar_path(self.path, ".json")

    def input(self, name: str) -> InputInfo:
        for i in self.inputs:
            if i.name == name:
                return i
        raise KeyError(name)

    def make_inputs(self, dims: Mapping[str, int] | None = None, seed: int = 0) -> dict[str, np.ndarray]:
        """Random inputs in the declared ranges (see :func:`make_inputs`)."""
        return make_inputs(self.inputs, dims, seed)

    def sample(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """The inputs used at export time and torch's outputs for them."""
        with np.load(self.sample_inputs_path) as i, np.load(self.sample_outputs_path) as o:
            return {k: i[k] for k in i.files}, {k: o[k] for k in o.files}

    def torch_outputs(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Rebuild the torch model (same seed and overrides) and run it on ``feeds`` (needs torch)."""
        if self.past:
            from .decode import decode_torch_outputs

            return decode_torch_outputs(self.family, self.attn, feeds, seed=self.seed, **self.overrides)
        return torch_outputs(self.family, self.attn, feeds, seed=self.seed, **self.overrides)

    def recipe_inputs(self) -> dict[str, dict[str, Any]]:
        """The ``inputs`` section of a recipe for this model."""
        return {i.name: i.to_recipe() for i in self.inputs}

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["path"] = str(self.path)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=json_default)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ExportedModel:
        d = dict(d)
        d["path"] = Path(d["path"])
        d["inputs"] = [InputInfo(**i) for i in d["inputs"]]
        d["outputs"] = [OutputInfo(**o) for o in d["outputs"]]
        return cls(**d)


def load_exported(json_path: os.PathLike | str) -> ExportedModel:
    """Read a ``<stem>.json`` sidecar; the model path is taken relative to the sidecar's folder."""
    json_path = Path(json_path)
    d = json.loads(json_path.read_text())
    m = ExportedModel.from_dict(d)
    m.path = json_path.parent / m.path.name
    return m


def sidecar_path(path: Path, suffix: str) -> Path:
    """``<stem><suffix>`` next to the model ``<stem>.onnx``."""
    path = Path(path)
    stem = path.name[: -len(".onnx")] if path.name.endswith(".onnx") else path.name
    return path.with_name(stem + suffix)


def json_default(o: Any) -> Any:
    """JSON for what ``json.dumps`` cannot write itself (paths, NumPy scalars, configs)."""
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, (np.integer, np.floating)):
        return o.item()
    if hasattr(o, "to_dict"):
        return o.to_dict()
    return str(o)
