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
