"""The pattern layer: alternatives, commutation, constants, captures, attribute-or-input."""

import numpy as np
import onnx_graphsurgeon as gs

from optfuse.ir import sanitize
from optfuse.pattern import AnyOf, Capture, Const, Var, match, maybe_cast, op

from graphs import Builder, io, layer_norm


def _graph(model):
    return sanitize(model)


def _out(graph, name="y"):
    return graph.tensors()[name]


def _sqrt_chain(opset=17):
    b = Builder(opset)
    s = b.node("Sqrt", b.node("Add", b.const(1.0), "x"))  # constant first: Add is commutative
    b.node("Mul", s, s, out="y")
    return b.model([io("x", [4])], [io("y", [4])])


def test_commutative_and_shared_operand():
    g = _graph(_sqrt_chain())
    x = Var("x")
    p = op.Mul(Var("s"), Var("s"))
    ms = list(match(p, _out(g)))
    assert ms and ms[0]["s"] is ms[0]["s"]
    p = op.Mul(op.Sqrt(op.Add(x, Const(1.0))), op.Sqrt(op.Add(x, Const(1.0))))
    ms = list(match(p, _out(g)))
    assert len(ms) >= 1
    assert ms[0]["x"].name == "x"
    # the same node reached twice is listed once
    assert len(ms[0].nodes) == len({id(n) for n in ms[0].nodes})


def test_const_value_must_agree():
    g = _graph(_sqrt_chain())
    assert not list(match(op.Mul(op.Sqrt(op.Add(Var("x"), Const(2.0))), Var("r")), _out(g)))
    ms = list(match(op.Mul(op.Sqrt(op.Add(Var("x"), Const(name="c"))), Var("r")), _out(g)))
    assert float(ms[0]["c"]) == 1.0


def test_a_var_bound_twice_must_be_the_same_tensor():
    b = Builder()
    b.node("Mul", b.node("Relu", "x"), "x", out="y")
    g = _graph(b.model([io("x", [4])], [io("y", [4])]))
    assert list(match(op.Mul(op.Relu(Var("a")), Var("a")), _out(g)))
    assert not list(match(op.Mul(op.Relu(Var("a")), op.Relu(Var("a"))), _out(g)))


def test_axes_attribute_or_input_and_alternatives():
    for opset in (17, 18):
        g = _graph(layer_norm(opset=opset, variant="mul_div", affine=False))
        x = Var("x")
        d = op.Sub(x, op.ReduceMean(x, axes=Capture("axes")))
        var = op.ReduceMean(AnyOf(op.Pow(d, Const(2.0)), op.Mul(d, d)), axes=Capture("axes"))
        p = op.Div(d, op.Sqrt(op.Add(var, Const(name="eps"))))
        ms = list(match(p, _out(g)))
        assert ms, f"opset {opset}"
        assert list(np.atleast_1d(ms[0]["axes"])) == [-1]
        assert np.isclose(float(ms[0]["eps"]), 1e-5)


def test_optional_cast_and_match_does_not_mutate():
    g = _graph(layer_norm(casts=True, affine=False))
    before = [(n.op, n.name) for n in g.nodes]
    x = Var("x")
    xs = maybe_cast(x)
    d = op.Sub(xs, op.ReduceMean(xs))
    p = maybe_cast(op.Div(d, op.Sqrt(op.Add(op.ReduceMean(op.Pow(d, Const(2.0))), Const(name="eps")))))
    ms = list(match(p, _out(g)))
    assert ms and ms[0]["x"].name == "x"
    assert [(n.op, n.name) for n in g.nodes] == before
    assert isinstance(ms[0].root, gs.Variable)


def test_apply_plan_checks_rewrites_against_the_spec():
    """A rewrite that does not fit its op's spec is a bug in the rule: caught before any node is made."""
    import pytest

    from optfuse.pattern import Rewrite
    from optfuse.rewrite import Accepted, FusionResult, apply_plan, check_rewrite
    from optfuse.spec import get_spec

    g = _graph(layer_norm())
    x, y = g.tensors()["x"], _out(g)
    gamma = beta = np.ones(x.shape[-1], np.float32)
    spec = get_spec("LayerNorm")
    check_rewrite(Rewrite("LayerNorm", [x, gamma, beta], [y], {"epsilon": 1e-5}), spec, "layer_norm.t")
    check_rewrite(Rewrite("LayerNorm", [x, gamma, beta], [y], {}), spec, "layer_norm.t")  # epsilon has a default
    bad = [
        (Rewrite("LayerNorm", [x, gamma, beta], [y], {"eps": 1e-5}), "attribute 'eps' is not in the spec (attributes: ['epsilon'])"),
        (Rewrite("LayerNorm", [x, gamma, beta], [y], {"epsilon": 1}), "attribute 'epsilon' = 1 is not of type float"),
        (Rewrite("LayerNorm", [x, gamma, beta, beta, beta], [y], {}), "5 inputs, the spec has 4"),  # 4th: y_scale
        (Rewrite("LayerNorm", [x, gamma], [y], {}), "required input 'beta' (#2) is missing"),
        (Rewrite("LayerNorm", [x, None, beta], [y], {}), "required input 'gamma' (#1) is missing"),
        (Rewrite("LayerNorm", [x, gamma, beta], [y, y], {}), "2 outputs, the spec has 1"),
    ]
    for rw, why in bad:
        with pytest.raises(ValueError) as e:
            check_rewrite(rw, spec, "layer_norm.t")
        assert str(e.value) == f"rule layer_norm.t writes an invalid LayerNorm node: {why}"
    # FlashAttention: num_heads has no default; bias is optional
    q = np.zeros((1, 2, 4, 8), np.float32)
    fa = get_spec("FlashAttention")
    attrs = {"scale": 0.5, "num_heads": 2, "num_kv_heads": 2}
    check_rewrite(Rewrite("FlashAttention", [x, x, x], [y], attrs), fa, "attention.t")
    check_rewrite(Rewrite("FlashAttention", [x, x, x, None], [y], attrs), fa, "attention.t")
    with pytest.raises(ValueError, match="rule attention.t .* FlashAttention .* 'num_heads' has no default"):
        check_rewrite(Rewrite("FlashAttention", [x, x, x, q], [y], {"scale": 0.5, "num_kv_heads": 2}), fa, "attention.t")
    with pytest.raises(ValueError, match="'causal' = True is not of type int"):
        check_rewrite(Rewrite("FlashAttention", [x, x, x], [y], {**attrs, "causal": True}), fa, "attention.t")
    # apply_plan runs the check before it touches the graph
    before = [n.name for n in g.nodes]
    plan = FusionResult([Accepted("layer_norm.t", "LayerNorm", ["ln"], bad[0][0])])
    with pytest.raises(ValueError, match="attribute 'eps' is not in the spec"):
        apply_plan(g, plan)
    assert [n.name for n in g.nodes] == before
