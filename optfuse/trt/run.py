"""Run a built engine through polygraphy's TensorRT runner (optfuse's plugins registered first).

:func:`run_engine` takes feed dicts and returns the engine's outputs per feed; it knows nothing
about references or tolerances. The engine accuracy check is the verify stage's
:func:`optfuse.verify.verify_against` with this function as the candidate runner (the pipeline
wires the two). Needs a GPU the engine can run on; callers check
:attr:`~optfuse.trt.build.BuildReport.runnable_here` first and report why not otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from ..errors import VerificationError
from . import compat


def polygraphy_env(backend: str | None) -> None:
    """Point polygraphy at TensorRT-RTX (must happen before polygraphy imports a TensorRT)."""
    if compat.resolve_backend(backend) == "tensorrt_rtx":
        os.environ["POLYGRAPHY_USE_TENSORRT_RTX"] = "1"


def run_engine(engine: str | os.PathLike, feeds: Sequence[Mapping[str, np.ndarray]], *,
               backend: str | None = None) -> list[dict[str, np.ndarray]]:
    """The engine's outputs (name -> array) for every feed dict, in order."""
    be = compat.load(backend)
    polygraphy_env(be.name)
    import polygraphy.config as pgc

    if bool(getattr(pgc, "USE_TENSORRT_RTX", False)) != be.is_rtx:
        raise VerificationError("polygraphy was already set up for the other TensorRT backend in this process; "
                                "run the engine check in a fresh process")
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner

    if be.plugin_mode == "qdp":
        from . import qdp

        qdp.register_all(be)
    else:
        from . import plugins

        plugins.register_all(be)
    got = []
    with TrtRunner(EngineFromBytes(Path(engine).read_bytes()), name="engine") as runner:
        for f in feeds:
            got.append({k: np.array(v) for k, v in runner.infer(dict(f)).items()})
    return got
