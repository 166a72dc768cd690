"""Running the original and the candidate on the same feeds and comparing every output."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

import numpy as np
import onnx

from ..errors import InputError, VerificationError
from .inputs import InputPlan, make_feed, plan_inputs
from .options import (DEFAULT_ITERATIONS, QUANTILE_LEVELS, QUANTILE_SAMPLE, Agreement, InputInfo, OutputResult,
                      VerifyOptions, VerifyResult, default_agreement, tolerance)
from .padding import KeyView, at_positions, named_shapes, padded_positions, padded_query_inputs

# ------------------------------------------------------------------------------------------------
# Running and comparing
# ------------------------------------------------------------------------------------------------
def _prepare_polygraphy() -> None:
    """Quiet polygraphy's and onnxruntime's loggers, and keep polygraphy from importing torch on every inference.

    polygraphy's ``util.array.is_torch`` imports torch (seconds) just to ask whether a NumPy feed is a
    torch tensor; an object can only be one if torch is already imported, so ask sys.modules instead.
    """
    import sys

    import onnxruntime
    from polygraphy.logger import G_LOGGER
    from polygraphy.util import array as parray

    G_LOGGER.module_severity = G_LOGGER.ERROR
    # onnxruntime's own log lines (graph-optimizer warnings; a failed run's error, which the exception
    # raised here carries and the CLI prints as its one line) stay off the console
    onnxruntime.set_default_logger_severity(4)
    if not getattr(parray.is_torch, "_optfuse", False):
        def is_torch(obj) -> bool:
            torch = sys.modules.get("torch")
            return torch is not None and isinstance(obj, torch.Tensor)

        is_torch._optfuse = True
        parray.is_torch = is_torch


def compare_arrays(name: str, ref: list[np.ndarray], got: list[np.ndarray], atol: float, rtol: float,
                   agreement: Agreement | None = None, head: bool = False) -> OutputResult:
    """Elementwise isclose over every iteration, plus max abs / max rel / mean abs error, the cosine
    similarity and (a `head`: logits over the last axis) the top-1 agreement. With `agreement`, the
    output also fails below its ``min_cosine`` / ``min_top1``."""
    result = _elementwise(name, ref, got, atol, rtol)
    if result.note.startswith("shape"):
        return result
    result.cosine = cosine_similarity(ref, got)
    result.top1 = top1_agreement(ref, got) if head else None
    if agreement is not None:
        result.min_cosine, result.min_top1 = agreement.min_cosine, agreement.min_top1 if head else None
        if result.min_cosine is not None and not result.cosine >= result.min_cosine:
            result.passed = False
            result.note = result.note or f"cosine similarity {result.cosine:.5f} < {result.min_cosine:g}"
        if result.min_top1 is not None and result.top1 is not None and result.top1 < result.min_top1:
            result.passed = False
            result.note = result.note or f"top-1 agreement {result.top1:.4f} < {result.min_top1:g}"
    return result


def cosine_similarity(ref: list[np.ndarray], got: list[np.ndarray]) -> float:
    """cos(ref, got) over every element of every iteration (float64; NaN/inf elements left out);
    1.0 when both are all zeros, 0.0 when only one is."""
    dot = nr = ng = 0.0
    for r, g in zip(ref, got):
        r64, g64 = np.asarray(r, np.float64).ravel(), np.asarray(g, np.float64).ravel()
        ok = np.isfinite(r64) & np.isfinite(g64)
        r64, g64 = r64[ok], g64[ok]
        dot += float(r64 @ g64)
        nr += float(r64 @ r64)
        ng += float(g64 @ g64)
    if nr == 0.0 and ng == 0.0:
        return 1.0
    if nr == 0.0 or ng == 0.0:
        return 0.0
    return dot / (nr ** 0.5 * ng ** 0.5)


def top1_agreement(ref: list[np.ndarray], got: list[np.ndarray]) -> float | None:
    """The fraction of rows (every index but the last axis, every iteration) whose argmax over the
    last axis is the original's; None for a scalar or a last axis of one."""
    same = total = 0
    for r, g in zip(ref, got):
        r, g = np.asarray(r), np.asarray(g)
        if r.ndim == 0 or r.shape[-1] < 2:
            return None
        same += int((np.argmax(r, axis=-1) == np.argmax(g, axis=-1)).sum())
        total += int(np.prod(r.shape[:-1], dtype=np.int64))
    return same / total if total else None


def head_outputs(model: onnx.ModelProto) -> set[str]:
    """Outputs that are classifier or LM heads (top-1 agreement applies): named ``*logits*``, or
    whose last dim is the row count of the table the token ids index (the vocabulary)."""
    from ..defaults import value_shape
    from .inputs import gather_table_rows

    vocab = set(gather_table_rows(model).values())
    heads = set()
    for o in model.graph.output:
        shape = value_shape(o) or []
        last = shape[-1] if shape else None
        if "logit" in o.name.lower() or (isinstance(last, int) and last > 2 and last in vocab and len(shape) >= 2):
            heads.add(o.name)
    return heads


def _elementwise(name: str, ref: list[np.ndarray], got: list[np.ndarray], atol: float, rtol: float) -> OutputResult:
    max_abs = max_rel = 0.0
    abs_sum, count = 0.0, 0
    samples: list[np.ndarray] = []  # |diff| (a seeded sample of a large output) per iteration, for the quantiles
    passed, note, shape = True, "", None
    for r, g in zip(ref, got):
        r = np.asarray(r)
        g = np.asarray(g)
        shape = list(r.shape)
        if r.shape != g.shape:
            return OutputResult(name, False, float("inf"), float("inf"), float("inf"), atol, rtol, shape,
                                f"shape {list(g.shape)} differs from the original's {list(r.shape)}")
        r64, g64 = r.astype(np.float64), g.astype(np.float64)
        nan_r, nan_g = np.isnan(r64), np.isnan(g64)
        if (nan_r != nan_g).any():
            passed, note = False, "NaN where the original has none" if (nan_g & ~nan_r).any() else "NaN mismatch"
        ok = ~(nan_r | nan_g)
        with np.errstate(invalid="ignore"):  # inf - inf: handled just below
            diff = np.abs(r64 - g64)[ok]
        ref_abs = np.abs(r64)[ok]
        if diff.size:
            inf_r, inf_g = np.isinf(r64[ok]), np.isinf(g64[ok])
            same_inf = inf_r & inf_g & (r64[ok] == g64[ok])
            diff = np.where(same_inf, 0.0, diff)
            max_abs = max(max_abs, float(diff.max()))
            with np.errstate(divide="ignore", invalid="ignore"):
                rel = np.where(diff == 0, 0.0, diff / np.where(ref_abs == 0, np.finfo(np.float64).tiny, ref_abs))
            max_rel = max(max_rel, float(rel.max()))
            abs_sum += float(diff.sum())
            count += diff.size
            samples.append(_sample(diff))
            if not bool((diff <= atol + rtol * np.where(np.isinf(ref_abs), 0, ref_abs)).all()):
                passed = False
    mean_abs = abs_sum / count if count else 0.0
    return OutputResult(name, passed, max_abs, max_rel, mean_abs, atol, rtol, shape, note, _quantiles(samples, max_abs))


def _sample(diff: np.ndarray) -> np.ndarray:
    if diff.size <= QUANTILE_SAMPLE:
        return diff
    return diff[np.random.default_rng(0).integers(0, diff.size, QUANTILE_SAMPLE)]


def _quantiles(samples: list[np.ndarray], max_abs: float) -> list[list[float]]:
    """[p, q] for each of QUANTILE_LEVELS over the pooled samples; the 1.0 level is the exact max."""
    if not samples:
        return []
    qs = np.quantile(np.concatenate(samples), QUANTILE_LEVELS)
    return [[p, max_abs if p == 1.0 else float(q)] for p, q in zip(QUANTILE_LEVELS, qs)]


ModelSource = Union[str, os.PathLike, onnx.ModelProto]
Feeds = list[dict[str, np.ndarray]]
#: Runs a candidate on every feed dict and returns its outputs (name -> array) per feed.
CandidateRunner = Callable[[Feeds], Feeds]


def verify(original: ModelSource, candidate: ModelSource,
           options: VerifyOptions | None = None, iterations: int = DEFAULT_ITERATIONS, seed: int = 0,
           atol: float | None = None, rtol: float | None = None,
           feeds: Feeds | None = None,
           on_iteration: Callable[[int], None] | None = None,
           on_outputs: Callable[[Mapping[str, Feeds]], None] | None = None) -> VerifyResult:
    """Run both models in onnxruntime on the same seeded inputs and compare every output of the original.

    `atol`/`rtol` override the options for every output. `feeds` replaces input generation.
    `on_outputs` receives every output of both runs (``{"original": [...], "candidate": [...]}``,
    one name -> array dict per iteration), e.g. to save them.
    Models given as paths run from their files (weights read by onnxruntime, not loaded here), one
    session at a time: the original on every feed, then the candidate.
    """
    ref_model = original if isinstance(original, onnx.ModelProto) else _load_graph(original)
    cand_model = candidate if isinstance(candidate, onnx.ModelProto) else _load_graph(candidate)
    plans, feeds = _plans_and_feeds(ref_model, options, iterations, seed, feeds)
    _check_candidate_inputs(plans, cand_model)

    _prepare_polygraphy()
    # A model onnxruntime rejects is named: the original is bad input (exit 2), a candidate that
    # does not load has failed verification (exit 1).
    ref = _run_all("original", original, InputError, feeds, on_iteration)
    runnable, method = _runnable(candidate, cand_model)
    got = _run_all("candidate", runnable, VerificationError, feeds, None)
    if on_outputs is not None:
        on_outputs({"original": [dict(it) for it in ref], "candidate": [dict(it) for it in got]})
    result = _result(ref_model, plans, ref, got, options, precision_of(cand_model),
                     seed, _label(original), _label(candidate), atol, rtol, feeds, padded_query_inputs(cand_model))
    result.method = method
    return result


def _runnable(candidate: ModelSource, model: onnx.ModelProto) -> tuple[ModelSource, str]:
    """What onnxruntime runs for `candidate`, and how that differs from running it as it is
    ("" when it runs unchanged): a BF16 model runs as its FP32 emulation (verify.emulate)."""
    from .emulate import BF16_METHOD, emulate_bf16, uses_bf16

    if not uses_bf16(model):
        return candidate, ""
    if not isinstance(candidate, onnx.ModelProto):
        from ..ir import load_model

        model = load_model(candidate)  # the emulation rewrites the weights (BF16 -> FP32 values)
    return emulate_bf16(model), BF16_METHOD


def _load_graph(path: str | os.PathLike) -> onnx.ModelProto:
    """The model's graph and small constants; its big weights stay in their files (onnxruntime reads them)."""
    from ..ir import load_model

    return load_model(path, weights="disk")


def _run_all(label: str, src: ModelSource, load_error: type[Exception], feeds: Feeds,
             on_iteration: Callable[[int], None] | None) -> Feeds:
    """Every feed through one onnxruntime session of `src`; the session is gone when this returns."""
    from polygraphy.backend.onnxrt import OnnxrtRunner

    session = _session(label, src, load_error)
    outputs: Feeds = []
    i = 0
    try:
        with OnnxrtRunner(session, name=label) as runner:
            for i, feed in enumerate(feeds):
                if on_iteration is not None:
                    on_iteration(i)
                outputs.append(dict(runner.infer(feed)))
    except Exception as exc:
        if label == "original":  # the model or its inputs are wrong, not the candidate
            shapes = ", ".join(f"{k}:{'x'.join(map(str, np.shape(v)))}" for k, v in feeds[i].items())
            raise InputError(f"onnxruntime could not run the original model on its inputs ({shapes}): "
                             f"{_first_line(exc)}; give shapes the model accepts (--shapes, or a recipe's dims)"
                             ) from None
        raise VerificationError(f"onnxruntime could not run the models: {_first_line(exc)}") from None
    finally:
        del session
    return outputs


def verify_against(original: str | os.PathLike, run_candidate: CandidateRunner, options: VerifyOptions | None = None,
                   *, mode: str = "fp32", iterations: int = DEFAULT_ITERATIONS, seed: int = 0,
                   candidate_label: str = "",
                   padded_queries: Mapping[str, Sequence[KeyView]] | None = None) -> VerifyResult:
    """The original in onnxruntime vs `run_candidate` (e.g. a TensorRT engine) on the same seeded
    inputs; the candidate is held to the tolerances of precision `mode`. `padded_queries`: the
    padded_query_inputs of the ONNX model the candidate was built from."""
    from polygraphy.backend.onnxrt import OnnxrtRunner

    from ..ir import load_model

    ref_model = load_model(original, weights="disk")
    plans, feeds = _plans_and_feeds(ref_model, options, iterations, seed, None)
    _prepare_polygraphy()
    ref = []
    with OnnxrtRunner(_session("original", original, InputError), name="original") as runner:
        for f in feeds:
            ref.append(runner.infer(f))
    got = run_candidate(feeds)
    return _result(ref_model, plans, ref, got, options, mode, seed, str(original), candidate_label,
                   feeds=feeds, padded=padded_queries)


def _plans_and_feeds(ref_model: onnx.ModelProto, options: VerifyOptions | None, iterations: int, seed: int,
                     feeds: Feeds | None) -> tuple[list[InputPlan], Feeds]:
    if iterations < 1:
        raise InputError(f"iterations must be >= 1, got {iterations}")
    plans = plan_inputs(ref_model, options)
    if feeds is None:
        rng = np.random.default_rng(seed)
        feeds = [make_feed(plans, rng) for _ in range(iterations)]
    return plans, feeds


def _session(label: str, src: ModelSource, err: type[Exception]):
    from polygraphy.backend.onnxrt import SessionFromOnnx

    try:
        return SessionFromOnnx(_bytes_or_path(src), providers=["cpu"])()
    except Exception as exc:
        raise err(f"onnxruntime cannot load the {label} model: {_first_line(exc)}") from None


def _result(ref_model: onnx.ModelProto, plans: list[InputPlan], ref_iters: Sequence[Mapping[str, Any]],
            cand_iters: Sequence[Mapping[str, Any]], options: VerifyOptions | None, mode: str, seed: int,
            original: str, candidate: str, atol: float | None = None, rtol: float | None = None,
            feeds: Feeds | None = None, padded: Mapping[str, Sequence[KeyView]] | None = None) -> VerifyResult:
    """Compare every output of the original over all iterations (a missing one fails with a note),
    each at the positions padded_positions keeps."""
    outputs = []
    agreement = (options.agreement if options is not None else default_agreement()).get(mode)
    heads = head_outputs(ref_model)
    left_out = []
    shapes = named_shapes(ref_model) if padded else {}
    for o in ref_model.graph.output:
        a, r = tolerance(options, o.name, mode, atol, rtol)
        if any(o.name not in it for it in cand_iters):
            outputs.append(OutputResult(o.name, False, float("inf"), float("inf"), float("inf"), a, r, None,
                                        "missing from the candidate"))
            continue
        ref, got = [it[o.name] for it in ref_iters], [it[o.name] for it in cand_iters]
        keep, masks, axis = padded_positions(shapes, o.name, padded or {}, feeds, ref, got)
        if keep is not None:
            dropped, total = sum(int((~k).sum()) for k in keep), sum(k.size for k in keep)
            if dropped:
                left_out.append(f"{o.name} at {dropped} of {total} positions")
            ref = [at_positions(x, k, axis) for x, k in zip(ref, keep)]
            got = [at_positions(x, k, axis) for x, k in zip(got, keep)]
        result = compare_arrays(o.name, ref, got, a, r, agreement, o.name in heads)
        if keep is not None:
            result.shape = list(np.shape(ref_iters[-1][o.name]))
        outputs.append(result)
    infos = [InputInfo(p.name, np.dtype(p.dtype).name, list(p.shape), p.source) for p in plans]
    note = ""
    if left_out:
        note = ("not compared: " + "; ".join(left_out) + f" (over {len(ref_iters)} iteration(s)): padded queries "
                f"that see no real key of {' or '.join(sorted(padded or {}))} through a fused causal or sliding-window "
                "attention, where the fused node averages the keys it sees and the original all keys "
                "(fusions.attention_full_mask makes them exact)")
    return VerifyResult(outputs, infos, len(ref_iters), seed, original, candidate, left_out=note)


def precision_of(model: onnx.ModelProto) -> str:
    """'fp8' when the model holds E4M3 weights, else 'fp16' / 'bf16' when it keeps floating weights
    in that type, else 'fp32': the tolerance a candidate is held to follows the precision it computes in."""
    kinds = {t.data_type for t in model.graph.initializer}
    if onnx.TensorProto.FLOAT8E4M3FN in kinds:
        return "fp8"
    if onnx.TensorProto.BFLOAT16 in kinds:
        return "bf16"
    if onnx.TensorProto.FLOAT16 in kinds:
        return "fp16"
    return "fp32"


def _check_candidate_inputs(plans: list[InputPlan], cand: onnx.ModelProto) -> None:
    init = {t.name for t in cand.graph.initializer}
    want = {i.name for i in cand.graph.input if i.name not in init}
    have = {p.name for p in plans}
    if want - have:
        raise InputError(f"the candidate needs inputs the original does not have: {', '.join(sorted(want - have))}")


def _bytes_or_path(src: ModelSource) -> str | bytes:
    # a path keeps external data readable by onnxruntime; in-memory models go as bytes
    return str(src) if isinstance(src, (str, os.PathLike)) else src.SerializeToString()


def _label(src: ModelSource) -> str:
    return str(src) if isinstance(src, (str, os.PathLike)) else "<in memory>"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
