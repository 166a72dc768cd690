"""What the GEMM rules match: the GEMM core (MatMul / Gemm, optionally between the Reshapes of a
2-D Conv1D), its bias, every spelling of each activation, the residual Add, the gated FFN and the
siblings that read one input.

A pattern that needs the same tensor in several places (``x * sigmoid(x)``) matches the producing
sub-pattern once (``Named``) and refers to it elsewhere by ``Var`` of the same name, so the GEMM
core is matched once per alternative.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import onnx_graphsurgeon as gs

from ...ir.query import const_value
from ...pattern import AnyOf, Const, Pattern, Var, match, op

_SQRT2 = math.sqrt(2.0)
_TANH_K = math.sqrt(2.0 / math.pi)
_RTOL = 1e-5  # float32 constants of the exported formulas


@dataclass(frozen=True)
class Named(Pattern):
    """``inner`` matched at a tensor that is also bound to ``name`` (so ``Var(name)`` elsewhere is that tensor)."""

    name: str
    inner: Pattern

    def match(self, tensor, state):
        for s in self.inner.match(tensor, state):
            s = s.fork()
            if s.bind(self.name, tensor):
                yield s

    def root_ops(self):
        return self.inner.root_ops()


def _c(value: float) -> Const:
    return Const(value, rtol=_RTOL)


def _not_const(t: gs.Tensor) -> bool:
    return const_value(t) is None


# -- the GEMM core ---------------------------------------------------------------------------------
def _mm(a: Pattern) -> Pattern:
    """MatMul(a, W) or Gemm(a, W [, C]); W and C are checked to be constants by the rule's check."""
    w = Var("w")
    return AnyOf(
        op.MatMul(a, w, capture="mm"),
        op.Gemm(a, w, capture="mm"),
        op.Gemm(a, w, Var("gemm_c"), capture="mm"),
    )


def _biased(a: Pattern) -> Pattern:
    return op.Add(_mm(a), Const(name="bias"), capture="bias_add")


def core() -> Pattern:
    """The pre-activation value, bound to ``pre``: [Reshape ∘] (MatMul | Gemm) [+ bias] [∘ + bias].

    The Reshape is the one after a 2-D GEMM over flattened rows (GPT-2's Conv1D: Reshape ->
    Gemm/addmm -> Reshape); a bias may sit before it or after it.
    """
    inner = AnyOf(_biased(Var("a")), _mm(Var("a")))
    flat = op.Reshape(inner, Var("out_shape"), capture="out_reshape")
    return Named("pre", AnyOf(op.Add(flat, Const(name="bias_out"), capture="bias_out_add"), flat, inner))


def biased_core() -> Pattern:
    """A GEMM and its bias, with nothing after: (MatMul | Gemm) + bias, or the bias after the
    Reshape of a 2-D GEMM (a trailing Reshape stays out of the match: nothing to fuse after it)."""
    flat = op.Reshape(_mm(Var("a")), Var("out_shape"), capture="out_reshape")
    return Named("pre", AnyOf(op.Add(flat, Const(name="bias_out"), capture="bias_out_add"), _biased(Var("a"))))


def bare_core() -> Pattern:
    """A MatMul or Gemm alone (its own C the only bias)."""
    return Named("pre", _mm(Var("a")))


# -- activations -----------------------------------------------------------------------------------
def _product3(x: Pattern, a: Pattern, b: Pattern) -> Pattern:
    """x * a * b in every association (Mul matches both operand orders itself)."""
    return AnyOf(op.Mul(op.Mul(x, a), b), op.Mul(op.Mul(x, b), a), op.Mul(x, op.Mul(a, b)))


def _gelu_erf(x: Pattern, v: Var) -> Pattern:
    erf_in = AnyOf(op.Div(v, _c(_SQRT2)), op.Mul(v, _c(1.0 / _SQRT2)))
    one_plus = op.Add(op.Erf(erf_in), _c(1.0))
    return AnyOf(_product3(x, _c(0.5), one_plus),
                 op.Gelu(x, approximate=lambda a: a in (None, "none", b"none")))


def _gelu_tanh(x: Pattern, v: Var) -> Pattern:
    cube = AnyOf(op.Pow(v, _c(3.0)), op.Mul(op.Mul(v, v), v))
    new_gelu = op.Mul(_c(_TANH_K), op.Add(v, op.Mul(_c(0.044715), cube)))  # GPT-2 NewGELU
    # FastGelu / Megatron: 0.7978845608 * x * (1 + 0.044715 * x * x)
    quad = AnyOf(op.Mul(op.Mul(_c(0.044715), v), v), op.Mul(_c(0.044715), op.Mul(v, v)))
    fast = AnyOf(op.Mul(op.Mul(_c(_TANH_K), v), op.Add(_c(1.0), quad)),
                 op.Mul(_c(_TANH_K), op.Mul(v, op.Add(_c(1.0), quad))))
    one_plus = op.Add(op.Tanh(AnyOf(new_gelu, fast)), _c(1.0))
    return AnyOf(_product3(x, _c(0.5), one_plus),
                 op.Gelu(x, approximate=lambda a: a in ("tanh", b"tanh")))


def square(t: Pattern, name: str = "squared") -> Pattern:
    """t ** 2: Pow(t, 2) (the exponent a constant of any float or int dtype) or Mul(t, t) (torch.square,
    ``x ** 2`` and ``x * x`` as the exporters write them); ``t`` is matched once and bound to ``name``."""
    return AnyOf(op.Pow(Named(name, t), _c(2.0)), op.Mul(Named(name, t), Var(name)))


def _relu2(x: Pattern, v: Var) -> Pattern:
    return square(op.Relu(x), "relu2_r")


def squared_by(t: gs.Tensor, graph: gs.Graph) -> gs.Node | None:
    """The node squaring ``t`` (a ``square`` of it) where that node is ``t``'s only reader and ``t``
    is no output of ``graph`` (so ``relu2`` can take the pair), else None. A tensor read twice by
    one ``Mul`` lists the node twice."""
    readers = {id(n): n for n in t.outputs}
    if len(readers) != 1 or any(o is t for o in graph.outputs):
        return None
    (node,) = readers.values()
    if len(node.outputs) != 1:
        return None
    return node if any(m["t"] is t for m in match(square(Var("x"), "t"), node.outputs[0])) else None


#: activation name (spec choices) -> the pattern of act(x), x matched once, ``v`` standing for it elsewhere
ACTIVATIONS: dict[str, Callable[[Pattern, Var], Pattern]] = {
    "relu": lambda x, v: op.Relu(x),
    "relu2": _relu2,
    "gelu_erf": _gelu_erf,
    "gelu_tanh": _gelu_tanh,
    "quick_gelu": lambda x, v: op.Mul(x, op.Sigmoid(op.Mul(v, _c(1.702)))),
    "silu": lambda x, v: op.Mul(x, op.Sigmoid(v)),
    "sigmoid": lambda x, v: op.Sigmoid(x),
    "tanh": lambda x, v: op.Tanh(x),
}


def activated(inner: Pattern, name: str, choices, bind: str = "act_in") -> Pattern:
    """act(inner) for each activation in ``choices`` (the op spec's; ``none`` is not an activation
    pattern): alternative i binds ``act:<name>`` so the check knows which one matched."""
    alts = []
    for act in choices:
        if act not in ACTIVATIONS:
            continue
        x = Named(bind, inner)
        alts.append(Named(f"act:{act}", ACTIVATIONS[act](x, Var(bind))))
    return AnyOf(*alts)


def residual_add(inner: Pattern) -> Pattern:
    """inner + residual (a tensor that is not a constant: a constant is a bias)."""
    return op.Add(inner, Var("residual", where=_not_const), capture="residual_add")


# -- the gated FFN ---------------------------------------------------------------------------------
def gated(choices) -> Pattern:
    """act(X @ W_gate) * (X @ W_up), both GEMMs reading the same X (a bias on either is matched,
    so the check can say why it is not fused)."""
    x = Var("a")

    def proj(tag: str) -> Pattern:
        mm = AnyOf(op.MatMul(x, Var(f"w_{tag}"), capture=f"mm_{tag}"),
                   op.Gemm(x, Var(f"w_{tag}"), capture=f"mm_{tag}"))
        return AnyOf(op.Add(mm, Var(f"bias_{tag}"), capture=f"bias_{tag}_add"), mm)

    return op.Mul(activated(proj("gate"), "gate", choices, bind="gate"), proj("up"), capture="gate_mul")


# -- siblings --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Siblings(Pattern):
    """Anchored at a shared input x: the MatMuls that read x as A with a constant weight, each with
    the bias Add that alone reads it, if any. Yields every group of at least two, largest first, so
    a group some of whose members another rule took still leaves the rest (``branches`` binding:
    tuple of (MatMul node, bias Add node or None), in graph order)."""

    max_branches: int = 8

    def match(self, tensor, state):
        branches = []
        for node in tensor.outputs:
            if node.op != "MatMul" or len(node.inputs) != 2 or node.inputs[0] is not tensor:
                continue
            if const_value(node.inputs[1]) is None or any(b[0] is node for b in branches):
                continue
            out = node.outputs[0]
            add = out.outputs[0] if len(out.outputs) == 1 and out.outputs[0].op == "Add" else None
            if add is not None and not any(const_value(t) is not None for t in add.inputs if t is not out):
                add = None
            branches.append((node, add))
        if not 2 <= len(branches) <= self.max_branches:
            return
        for size in range(len(branches), 1, -1):
            for group in itertools.combinations(branches, size):
                s = state.fork()
                s.bind("x", tensor)
                s.bind("branches", group)
                s.nodes.extend(node for pair in group for node in pair if node is not None)
                yield s
