"""Run a built engine through polygraphy's TensorRT runner and compare it with the FP32 original
(onnxruntime), on the same inputs verify uses. Needs a GPU the engine can run on; callers check
:attr:`BuildReport.runnable_here` first and report why not otherwise.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import VerificationError
from . import compat


def polygraphy_env(backend: str | None) -> None:
    """Point polygraphy at TensorRT-RTX (must happen before polygraphy imports a TensorRT)."""
    if compat.resolve_backend(backend) == "tensorrt_rtx":
        os.environ["POLYGRAPHY_USE_TENSORRT_RTX"] = "1"


def verify_engine(original: str | os.PathLike, engine: str | os.PathLike, recipe: Any = None, *,
                  backend: str | None = None, iterations: int = 3, seed: int = 0) -> Any:
    """VerifyResult of the engine against the FP32 original (onnxruntime CPU)."""
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx

    from ..ir import load_model
    from ..verify import InputInfo, VerifyResult, _tolerance, compare_arrays, make_feed, plan_inputs

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
    ref_model = load_model(original)
    plans = plan_inputs(ref_model, recipe)
    rng = np.random.default_rng(seed)
    feeds = [make_feed(plans, rng) for _ in range(iterations)]
    ref_runner = OnnxrtRunner(SessionFromOnnx(str(original), providers=["cpu"]), name="original")
    ref, got = [], []
    with ref_runner:
        for f in feeds:
            ref.append(ref_runner.infer(f))
    with TrtRunner(EngineFromBytes(Path(engine).read_bytes()), name="engine") as runner:
        for f in feeds:
            got.append({k: np.array(v) for k, v in runner.infer(f).items()})
    outputs = []
    for o in ref_model.graph.output:
        a, r = _tolerance(o.name, recipe, None, None, recipe.precision.mode if recipe else "fp32")
        outputs.append(compare_arrays(o.name, [x[o.name] for x in ref], [x[o.name] for x in got], a, r))
    infos = [InputInfo(p.name, np.dtype(p.dtype).name, list(p.shape), p.source) for p in plans]
    return VerifyResult(outputs, infos, len(feeds), seed, str(original), str(engine))
