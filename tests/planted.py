"""Models with a planted accuracy fault, for the per-node and debug tests.

- :func:`plant_layer_norm_eps`: the ``layer_norm.native`` rule writes a wrong epsilon for the named
  original LayerNormalization nodes (a fused node that adds error; every other fusion is exact);
- :func:`overflow_model`: a residual block whose activation is scaled by 1e5 and back, finite in
  FP32 and past 65504 (inf) in FP16.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import graphs

#: residual_block(n_layers=3)'s LayerNormalization nodes, in graph order
LAYER_NORMS = ("LayerNormalization_3", "LayerNormalization_7", "LayerNormalization_11")


def plant_layer_norm_eps(monkeypatch, eps_by_node: dict[str, float]) -> None:
    from optfuse.fusions import layer_norm

    index = next(i for i, r in enumerate(layer_norm.RULES) if r.id == "layer_norm.native")
    rule = layer_norm.RULES[index]

    def rewrite(match, bindings):
        rw = rule.rewrite(match, bindings)
        for n in match.nodes:
            if n.name in eps_by_node:
                rw.attrs["epsilon"] = float(eps_by_node[n.name])
        return rw

    rules = list(layer_norm.RULES)
    rules[index] = dataclasses.replace(rule, rewrite=rewrite)
    monkeypatch.setattr(layer_norm, "RULES", rules)


def overflow_model(hidden=64, scale=1e5):
    """y = x + (x @ W) * scale * (1 / scale): ``Mul_2`` writes values past the FP16 range."""
    rng = np.random.default_rng(0)
    b = graphs.Builder(17)
    h = b.node("MatMul", "x", b.const(rng.standard_normal((hidden, hidden)) / np.sqrt(hidden)))
    a = b.node("Mul", h, b.const(np.float32(scale)))
    c = b.node("Mul", a, b.const(np.float32(1.0 / scale)))
    b.node("Add", c, "x", out="y")
    return b.model([graphs.io("x", ["b", "s", hidden])], [graphs.io("y", ["b", "s", hidden])])
