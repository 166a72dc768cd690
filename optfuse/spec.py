"""The fused-op contract: one `plugins/<folder>/spec.yaml` per optfuse op.

A spec says everything the rest of optfuse needs to know about an op, once:
its name and version, ordered inputs/outputs with their dtypes, typed attributes,
shape rules and limits. The rewrite stage writes nodes from it, the TensorRT stage
generates plugins from it, and verify runs its reference (an ONNX function for
onnxruntime, a NumPy function for tests).

Plugin folders are imported as the package ``optfuse_plugins.<folder>`` (see
:mod:`optfuse.plugin_dirs`), so kernels, references and launch code live next to the spec.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from . import DOMAIN
from .plugin_dirs import PLUGINS_DIR, plugin_module  # noqa: F401  (re-exported)


DType = Literal["float32", "float16", "bfloat16", "int32", "int64", "bool"]
AttrType = Literal["float", "int", "string", "floats", "ints"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TensorSpec(_Strict):
    name: str
    dtypes: list[DType] = Field(min_length=1)
    optional: bool = False
    # Output shape/dtype rule: the output has the shape and dtype of this input.
    like: str | None = None
    doc: str = ""


class AttrSpec(_Strict):
    name: str
    type: AttrType
    default: Any = None
    doc: str = ""


class OpSpec(_Strict):
    op: str
    folder: str
    domain: str = DOMAIN
    version: int = 1
    doc: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    attributes: list[AttrSpec] = []
    # Limits of the kernel contract (e.g. max_hidden); fusions consult them before matching.
    limits: dict[str, Any] = {}

    @property
    def plugin_version(self) -> str:
        return str(self.version)

    def attr(self, name: str) -> AttrSpec:
        for a in self.attributes:
            if a.name == name:
                return a
        raise KeyError(f"{self.op} has no attribute {name!r}")

    def input_index(self, name: str) -> int:
        return [t.name for t in self.inputs].index(name)


@functools.cache
def load_specs() -> dict[str, OpSpec]:
    """All op specs, keyed by op name (discovered from plugins/*/spec.yaml)."""
    specs: dict[str, OpSpec] = {}
    for path in sorted(PLUGINS_DIR.glob("*/spec.yaml")):
        for raw in yaml.safe_load_all(path.read_text()):
            spec = OpSpec(folder=path.parent.name, **raw)
            if spec.op in specs:
                raise ValueError(f"op {spec.op} defined twice ({path})")
            specs[spec.op] = spec
    return specs


def get_spec(op: str) -> OpSpec:
    try:
        return load_specs()[op]
    except KeyError:
        raise KeyError(f"unknown optfuse op {op!r}; known: {sorted(load_specs())}") from None
