"""The two torch exporters, run quietly, and their failures summarized in one line.

- ``torchscript``: ``torch.onnx.export(..., dynamo=False)`` with ``dynamic_axes``;
- ``dynamo``: ``torch.onnx.export(..., dynamo=True)`` with ``dynamic_shapes`` (one ``Dim`` per
  symbolic dim, bounded where the model has a limit) and no external data.

Both take the wrapped model, its positional example tensors and the input/output descriptions
(:class:`~optfuse.models.inputs.InputInfo`, :class:`~optfuse.models.inputs.OutputInfo`) and write
one ``.onnx`` file. torch is imported inside the functions only.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from pathlib import Path
from typing import Any, Mapping


def export_torchscript(model, args, path: Path, inputs, outputs, opset: int) -> None:
    """TorchScript export at ``opset``, every symbolic dim of the inputs and outputs dynamic."""
    import torch

    dynamic_axes = {}
    for info in [*inputs, *outputs]:
        axes = {a: s for a, s in enumerate(info.shape) if isinstance(s, str)}
        if axes:
            dynamic_axes[info.name] = axes
    torch.onnx.export(
        model, args, str(path), dynamo=False, opset_version=opset,
        input_names=[i.name for i in inputs], output_names=[o.name for o in outputs],
        dynamic_axes=dynamic_axes, do_constant_folding=True,
    )


def export_dynamo(model, args, path: Path, inputs, outputs, opset: int | None, optimize: bool,
                  dim_max: Mapping[str, int]) -> None:
    """Dynamo export (``opset`` None: the exporter's default), sequence-like dims bounded by ``dim_max``."""
    import torch
    from torch.export import Dim

    # One Dim per symbol, shared by every input that has it. The sequence Dim needs its max (the
    # position table's size): without it torch.export raises a constraint violation, and the ONNX
    # exporter silently exports a second time with the suggested fix (twice the time).
    dims: dict[str, Any] = {}
    specs = []
    for info in inputs:
        axes = {}
        for a, s in enumerate(info.shape):
            if isinstance(s, str):
                if s not in dims:
                    dims[s] = Dim(s, max=dim_max[s]) if s in dim_max else Dim(s)
                axes[a] = dims[s]
        specs.append(axes or None)
    torch.onnx.export(
        model, args, str(path), dynamo=True, opset_version=opset,
        input_names=[i.name for i in inputs], output_names=[o.name for o in outputs],
        dynamic_shapes=(tuple(specs),), external_data=False, optimize=optimize, verbose=False,
    )


@contextlib.contextmanager
def quiet():
    """Silence the exporters' tracer/deprecation warnings and progress prints (stdout)."""
    import io
    import logging

    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._export")]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for lg, lv in zip(loggers, levels):
                lg.setLevel(lv)


def summarize(exc: BaseException) -> str:
    """One line: the exporter's stage (if it says) and the innermost error's first line."""
    text = str(exc)
    stage = re.search(r"This is step (\d)/3", text)
    prefix = ""
    if stage:
        prefix = {"1": "torch.export (step 1/3): ", "2": "FX decomposition (step 2/3): ",
                  "3": "ONNX translation (step 3/3): "}.get(stage.group(1), "")
    summary = re.search(r"## Exception summary\s*\n\s*(.+)", text)
    if summary:
        line = summary.group(1)
    else:
        inner = exc
        while inner.__cause__ is not None:
            inner = inner.__cause__
        line = f"{type(inner).__name__}: {str(inner).strip().splitlines()[0] if str(inner).strip() else ''}"
    line = re.sub(r"\x1b\[[0-9;]*m", "", line).strip()
    return prefix + (line[:400] + " ..." if len(line) > 400 else line)
