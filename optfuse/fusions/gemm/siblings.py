"""Sibling GEMMs -> one GemmEpilogue over the concatenated weight, then a Split on the last axis.

MatMuls that read the same input with constant weights, each with at most a bias Add (Q/K/V
projections): one [sum N, K] weight, one [sum N] bias (zeros where a sibling has none), and a
standard ``Split`` that writes each sibling's original output tensor. A reads HBM once instead of
once per sibling, and one GEMM launch replaces several.
"""

from __future__ import annotations

import numpy as np

from ...ir.weights import DerivedValues
from ...ir.query import const_value
from ...pattern import After, Context, FusedOutput, Match
from .common import EPILOGUE, Reject, absent, check_a, check_limits, need, np_dtype, vector, weight
from .epilogue import GemmPlan


def plan_siblings(m: Match, ctx: Context) -> GemmPlan:
    x, branches = m["x"], m["branches"]
    outs, weights, biases = [], [], []
    dt = None
    for mm, add in branches:
        out = add.outputs[0] if add is not None else mm.outputs[0]
        dt = check_a(EPILOGUE, x, out)
        wt = weight(mm, mm.inputs[1], x, dt)
        bias = np.zeros(wt.n)
        if add is not None:
            b = next(t for t in add.inputs if t is not mm.outputs[0])
            bias = vector(const_value(b), wt.n, f"bias of {mm.name!r}")
        outs.append(out)
        weights.append(wt.w)
        biases.append(bias)
    ks = {w.shape[1] for w in weights}
    need(len(ks) == 1, f"siblings of {x.name!r} have different K {sorted(ks)}")
    sizes = [int(w.shape[0]) for w in weights]
    check_limits(EPILOGUE, ks.pop(), sum(sizes), f"siblings of {x.name!r}")
    any_bias = any(add is not None for _, add in branches)
    bias_in = np.concatenate(biases).astype(np_dtype(dt)) if any_bias else absent("bias", dt)
    split = After("Split", [FusedOutput(0), np.array(sizes, np.int64)], outs, {"axis": -1})
    info = {"activation": "none", "packed": len(branches), "N": sizes, "bias": any_bias,
            "gemms": f"{len(branches)} -> 1"}
    return GemmPlan(EPILOGUE, [x, _packed(weights, dt), bias_in, absent("residual", dt)], [None],
                    {"activation": "none"}, info, [split])


def check_siblings(m: Match, ctx: Context):
    try:
        return plan_siblings(m, ctx)
    except Reject as r:
        return str(r)


def _packed(weights: list, dt: str):
    """The siblings' weights stacked along N: in memory, or derived on export where any is on disk."""
    if not any(isinstance(w, DerivedValues) for w in weights):
        return np.concatenate(weights, axis=0)
    parts = []
    for w in weights:
        parts += w.parts if isinstance(w, DerivedValues) else [(w, False)]
    return DerivedValues(parts, np_dtype(dt))
