"""Shared pytest fixtures and hooks.

- ``exported_model(family, exporter="dynamo", attn="sdpa", opset=None, **config_overrides)``:
  a session-scoped factory returning an :class:`optfuse.models.ExportedModel` (tiny random-weight
  HuggingFace model exported by torch). Exports are cached on disk, keyed by the request, the
  torch/transformers/onnx/onnxscript versions and the source of optfuse/models/, under
  ``$OPTFUSE_MODEL_CACHE`` (default ``~/.cache/optfuse/models``; ``OPTFUSE_MODEL_CACHE=tmp`` uses
  the session's temp folder). Skips when torch/transformers (or onnxscript, for dynamo) are
  missing, and for the combinations listed in ``optfuse.models.KNOWN_FAILURES`` (with the reason);
  any other exporter failure raises, so a regression shows up as an error, not a skip.
- ``gpu`` marker: tests marked ``gpu`` skip unless a CUDA driver with a device answers
  (cuda-python ``cuInit``) or ``torch.cuda.is_available()``.

Nothing heavy is imported at module level: torch only when a fixture or a gpu test needs it.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

_EXPORT_NEEDS = {"torchscript": ("torch", "transformers", "onnx"),
                 "dynamo": ("torch", "transformers", "onnx", "onnxscript")}


def _missing(modules) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


@pytest.fixture(scope="session")
def model_cache_dir(tmp_path_factory) -> Path:
    from optfuse.models.cache import cache_disabled, default_cache_dir  # no torch at import

    return tmp_path_factory.mktemp("optfuse-models") if cache_disabled() else default_cache_dir()


@pytest.fixture(scope="session")
def exported_model(model_cache_dir):
    """Factory: ``exported_model("bert", "dynamo", "sdpa")`` -> ExportedModel (cached; see module doc)."""
    memo: dict = {}

    def get(family: str, exporter: str = "dynamo", attn: str = "sdpa", opset: int | None = None, **overrides):
        missing = _missing(_EXPORT_NEEDS.get(exporter, _EXPORT_NEEDS["dynamo"]))
        if missing:
            pytest.skip(f"exporting {family} with {exporter} needs {', '.join(missing)} (not installed)")
        from optfuse import models

        reason = models.KNOWN_FAILURES.get((family, exporter, attn))
        if reason and not os.environ.get("OPTFUSE_RETRY_KNOWN_FAILURES"):
            pytest.skip(f"known {exporter} export failure for {family} (attn={attn}): {reason}")
        key = (family, exporter, attn, opset, tuple(sorted(overrides.items())))
        if key not in memo:
            memo[key] = models.cached_export(family, exporter, attn, opset, cache_dir=model_cache_dir, **overrides)
        return memo[key]

    return get


# ------------------------------------------------------------------------------------------------
# gpu marker: skip without a CUDA device
# ------------------------------------------------------------------------------------------------
_CUDA: tuple[bool, str] | None = None


def cuda_status() -> tuple[bool, str]:
    """(available, why): a CUDA driver with >= 1 device (cuda-python), else torch.cuda.is_available()."""
    global _CUDA
    if _CUDA is not None:
        return _CUDA
    why = []
    try:
        try:
            from cuda.bindings import driver as cu
        except ImportError:
            from cuda import cuda as cu  # cuda-python < 12.6
        (err,) = cu.cuInit(0)
        if int(err) == 0:
            err, count = cu.cuDeviceGetCount()
            if int(err) == 0 and count > 0:
                _CUDA = (True, f"CUDA driver, {count} device(s)")
                return _CUDA
            why.append(f"cuDeviceGetCount: {err}, {count} device(s)")
        else:
            why.append(f"cuInit: {err}")
    except Exception as exc:  # noqa: BLE001 - no cuda-python, no libcuda, ...
        why.append(f"cuda-python: {type(exc).__name__}: {str(exc).strip()[:160]}")
    if importlib.util.find_spec("torch") is not None:
        try:
            import torch

            if torch.cuda.is_available():
                _CUDA = (True, "torch.cuda.is_available()")
                return _CUDA
            why.append("torch.cuda.is_available() is False")
        except Exception as exc:  # noqa: BLE001
            why.append(f"torch: {type(exc).__name__}: {exc}")
    _CUDA = (False, "; ".join(why) or "no CUDA")
    return _CUDA


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    ok, why = cuda_status()
    if not ok:
        skip = pytest.mark.skip(reason=f"needs a CUDA GPU ({why})")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def fused_export(exported_model):
    """Factory: ``fused_export("llama", "dynamo", "eager", **FusionOptions fields)`` -> (export, model,
    fused model, fusion result) at batch 2, sequence 16 (memoized for the session)."""
    import onnx

    from optfuse.fusions import fuse_model
    from optfuse.pattern import FusionOptions

    memo: dict = {}

    def get(family, exporter, attn, **options):
        key = (family, exporter, attn, tuple(sorted(options.items())))
        if key not in memo:
            em = exported_model(family, exporter, attn)
            model = onnx.load(str(em.path))
            fused, res = fuse_model(model, dims={"batch": 2, "sequence": 16}, options=FusionOptions(**options))
            memo[key] = (em, model, fused, res)
        return memo[key]

    return get
