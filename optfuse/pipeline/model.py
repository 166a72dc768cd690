"""Where a flow's model comes from (the argument, the recipe's path, or an export through
:mod:`optfuse.models`) and how it is loaded: :func:`load_checked` adds a structural check, so a
graph that does not hold together is bad input (exit 2) before any stage runs; and
:func:`discard_staging`, how a failed build or fuse leaves nothing behind."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import onnx

from ..errors import InputError, OptfuseError
from ..recipe import Recipe
from .options import Status, noop

EXPORT_HINT = "pip install -e '.[export]' torch==2.13.0"


def resolve_model(model: str | os.PathLike | None, recipe: Recipe | None, workdir: Path | None = None,
                  status: Status = noop) -> Path:
    """The model file to work on: the argument, else the recipe's path, else exported per the recipe."""
    if model is not None:
        return Path(model)
    if recipe is None:
        raise InputError("no model given: pass MODEL.onnx or a recipe (-r) that names one")
    if recipe.model.path is not None:
        return recipe.resolve_path(recipe.model.path)
    spec = recipe.model.export
    out_dir = Path(workdir) if workdir is not None else Path.cwd()
    dest = out_dir / f"{recipe.name}.onnx"
    status(f"exporting {spec.family} ({spec.exporter}, attn={spec.attn}{', past' if spec.past else ''})")
    return export_model(spec.family, dest, exporter=spec.exporter, attn=spec.attn, opset=spec.opset, config=spec.config,
                        past=spec.past)


def export_model(family: str, dest: Path, exporter: str = "dynamo", attn: str = "sdpa", opset: int | None = None,
                 config: dict | None = None, past: bool = False) -> Path:
    """A tiny model of `family` (`past`: its decode step over a KV cache) exported through optfuse.models
    (needs torch + transformers) at `dest`: a copy of its entry in the export cache
    (``$OPTFUSE_MODEL_CACHE``, else ``~/.cache/optfuse/models``; keyed by the request, the library
    versions and the exporter's source), made on the first request; exported into place where the
    cache is off (``models.cache_disabled``) or cannot be written."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        raise InputError(f"exporting a model needs torch and transformers ({exc.name} is missing): {EXPORT_HINT}") from None
    try:
        from .. import models
    except ModuleNotFoundError as exc:
        if exc.name == "optfuse.models":
            raise InputError("this optfuse has no model exporter (optfuse.models)") from None
        raise InputError(f"exporting a model needs {exc.name}: {EXPORT_HINT}") from None
    if family not in models.FAMILIES:
        raise InputError(f"unknown model family {family!r}; known: {', '.join(models.FAMILIES)}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        cached = None
        if not models.cache_disabled():  # the export cache (models.default_cache_dir): one export a request
            try:
                cached = models.cached_export(family, exporter, attn, opset, past=past, **(config or {})).path
            except OSError:  # a cache folder that cannot be written
                pass
        if cached is None:
            return Path(models.export(family, dest, exporter=exporter, attn=attn, opset=opset, past=past,
                                      **(config or {})))
    except models.ExportError as exc:
        raise OptfuseError(str(exc)) from None
    except ValueError as exc:
        raise InputError(str(exc)) from None
    shutil.copyfile(cached, dest)  # one file: the exporter writes no external data
    return dest


def load_checked(path: Path, weights: str = "memory") -> onnx.ModelProto:
    """load_model plus a structural check: a graph that does not hold together is bad input (exit 2).

    Not onnx.checker: it rejects models onnxruntime runs (outputs without shapes, unsorted nodes).
    `weights`: as ``ir.load_model`` (``"disk"`` leaves the big tensors in their files).
    """
    from ..ir import load_model

    proto = load_model(path, weights=weights)
    problem = graph_problem(proto.graph)
    if problem:
        raise InputError(f"{path} is not a valid ONNX graph: {problem}")
    return proto


def graph_problem(graph: onnx.GraphProto) -> str | None:
    """The first structural defect of a top-level graph, or None: dangling inputs, tensors produced
    twice, graph outputs nothing produces, standard-domain ops ONNX does not define."""
    known = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    known |= {t.name for t in graph.sparse_initializer}
    produced: set[str] = set()
    for n in graph.node:
        for o in n.output:
            if o and o in produced:
                return f"tensor {o!r} is produced twice (node {n.name or n.op_type})"
            produced.add(o)
    available = known | produced
    for n in graph.node:
        for i in n.input:
            if i not in available:
                return f"node {n.name or n.op_type!r} ({n.op_type}) reads {i!r}, which no node, input or initializer provides"
        if n.domain in ("", "ai.onnx", "ai.onnx.ml") and not onnx.defs.has(n.op_type, n.domain):
            return f"node {n.name or n.op_type!r} uses {n.op_type!r}, which is not an ONNX operator"
    for o in graph.output:
        if o.name not in available:
            return f"graph output {o.name!r} is not produced by any node"
    return None


def discard_staging(staging: Path, directory: Path, created: bool) -> None:
    """A failed run leaves nothing: its staging folder goes, and `directory` too when the run made it
    (only if empty)."""
    shutil.rmtree(staging, ignore_errors=True)
    if created:
        try:
            directory.rmdir()
        except OSError:
            pass
