"""NumPy references and ONNX functions of GemmEpilogue / GatedGemm (see spec.yaml).

``reference`` computes in float64 and returns A's dtype. The activations, on the float32 (kernel)
or float64 (reference) pre-activation value x:

    relu        max(x, 0)
    gelu_erf    0.5 x (1 + erf(x / sqrt(2)))                          BERT, ViT, torch's default GELU
    gelu_tanh   0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))     GPT-2 NewGELU, FastGelu, Gemma
    quick_gelu  x sigmoid(1.702 x)                                    CLIP
    silu        x sigmoid(x)                                          LLaMA / Mistral / Qwen SwiGLU
    sigmoid, tanh, none

The ONNX functions compute in float32 and cast back to A's dtype. A string attribute cannot pick
nodes in a function body, so the body maps it to a number with ``ai.onnx.ml`` LabelEncoder: an
index that a chain of ``If`` nodes uses to pick the activation, and, for ``residual_position``, a
0/1 weight (``act(pre + w r) + (1 - w) r``). The functions need every input present:
``ABSENT_INPUTS`` says what a rewrite passes for an absent one (a scalar zero: the same result).
"""

from __future__ import annotations

import math

import numpy as np

from optfuse.functions import plugin_function
from optfuse.spec import plugin_specs

SPECS = plugin_specs(__file__)
OPS = tuple(SPECS)
ACTIVATIONS = {op: s.attr("activation").choices for op, s in SPECS.items()}
RESIDUAL_POSITIONS = SPECS["GemmEpilogue"].attr("residual_position").choices
#: What the ONNX function is fed for an absent optional input (a scalar zero adds nothing).
ABSENT_INPUTS = {"bias": 0.0, "residual": 0.0}

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # no overflow for large |x|


def activation64(name: str, x: np.ndarray) -> np.ndarray:
    """The activation ``name`` in float64."""
    from math import erf

    x = np.asarray(x, np.float64)
    if name == "none":
        return x
    if name == "relu":
        return np.maximum(x, 0.0)
    if name == "gelu_erf":
        return 0.5 * x * (1.0 + np.vectorize(erf, otypes=[np.float64])(x / math.sqrt(2.0)))
    if name == "gelu_tanh":
        return 0.5 * x * (1.0 + np.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x ** 3)))
    if name == "quick_gelu":
        return x * _sigmoid(1.702 * x)
    if name == "silu":
        return x * _sigmoid(x)
    if name == "sigmoid":
        return _sigmoid(x)
    if name == "tanh":
        return np.tanh(x)
    raise ValueError(f"unknown activation {name!r}")


def gemm_epilogue64(a, w, bias=None, residual=None, activation="none", alpha=1.0,
                    residual_position="after_activation") -> np.ndarray:
    """float64 GemmEpilogue: a [..., K], w [N, K]; bias [N] (or a scalar); residual broadcasting to [..., N]."""
    pre = float(alpha) * (np.asarray(a, np.float64) @ np.asarray(w, np.float64).T)
    if bias is not None:
        pre = pre + np.asarray(bias, np.float64)
    r = None if residual is None else np.asarray(residual, np.float64)
    if residual_position not in RESIDUAL_POSITIONS:
        raise ValueError(f"unknown residual_position {residual_position!r}")
    if r is not None and residual_position == "before_activation":
        return activation64(activation, pre + r)
    y = activation64(activation, pre)
    return y if r is None else y + r


def gated_gemm64(a, w_gate, w_up, activation="silu") -> np.ndarray:
    """float64 GatedGemm: act(a @ w_gate^T) * (a @ w_up^T)."""
    a = np.asarray(a, np.float64)
    return activation64(activation, a @ np.asarray(w_gate, np.float64).T) * (a @ np.asarray(w_up, np.float64).T)


def sample_inputs(op: str, rng: np.random.Generator) -> tuple[list[np.ndarray], dict]:
    """Random float32 inputs of ``op`` in spec order (A [2, 3, 16], N = 24) and the attributes
    without a default (none): what the contract test runs through the ONNX function and this reference."""
    a = rng.standard_normal((2, 3, 16)).astype(np.float32)
    w = (0.25 * rng.standard_normal((24, 16))).astype(np.float32)
    if op == "GemmEpilogue":
        bias = rng.standard_normal(24).astype(np.float32)
        residual = rng.standard_normal((2, 3, 24)).astype(np.float32)
        return [a, w, bias, residual], {}
    if op == "GatedGemm":
        return [a, w, (0.25 * rng.standard_normal((24, 16))).astype(np.float32)], {}
    raise ValueError(f"gemm plugin has no op {op!r}")


def reference(op: str, inputs: list, attrs: dict) -> list[np.ndarray]:
    spec = SPECS[op]
    get = lambda k: attrs.get(k, spec.attr(k).default)  # noqa: E731
    a = inputs[0]
    if op == "GemmEpilogue":
        w, bias, residual = (list(inputs[1:]) + [None, None])[:3]
        y = gemm_epilogue64(a, w, bias, residual, get("activation"), get("alpha"), get("residual_position"))
    elif op == "GatedGemm":
        y = gated_gemm64(a, inputs[1], inputs[2], get("activation"))
    else:
        raise ValueError(f"gemm plugin has no op {op!r}")
    return [y.astype(a.dtype)]


# -- ONNX functions --------------------------------------------------------------------------------
def _activation_nodes(name: str, x: str, y: str, tag: str) -> list:
    """Nodes computing ``y = name(x)`` in float32 (names prefixed with ``tag``)."""
    from onnx import helper

    mk = helper.make_node

    def const(n, v):
        return mk("Constant", [], [f"{tag}_{n}"], value_float=float(v))

    t = lambda n: f"{tag}_{n}"  # noqa: E731
    if name == "none":
        return [mk("Identity", [x], [y])]
    if name == "relu":
        return [mk("Relu", [x], [y])]
    if name == "sigmoid":
        return [mk("Sigmoid", [x], [y])]
    if name == "tanh":
        return [mk("Tanh", [x], [y])]
    if name == "silu":
        return [mk("Sigmoid", [x], [t("s")]), mk("Mul", [x, t("s")], [y])]
    if name == "quick_gelu":
        return [const("k", 1.702), mk("Mul", [x, t("k")], [t("kx")]), mk("Sigmoid", [t("kx")], [t("s")]),
                mk("Mul", [x, t("s")], [y])]
    if name == "gelu_erf":
        return [const("r", 1.0 / math.sqrt(2.0)), const("one", 1.0), const("half", 0.5),
                mk("Mul", [x, t("r")], [t("xr")]), mk("Erf", [t("xr")], [t("e")]), mk("Add", [t("e"), t("one")], [t("e1")]),
                mk("Mul", [x, t("half")], [t("hx")]), mk("Mul", [t("hx"), t("e1")], [y])]
    if name == "gelu_tanh":
        return [const("c", 0.044715), const("k", _SQRT_2_OVER_PI), const("one", 1.0), const("half", 0.5),
                mk("Mul", [x, x], [t("x2")]), mk("Mul", [t("x2"), x], [t("x3")]), mk("Mul", [t("x3"), t("c")], [t("cx3")]),
                mk("Add", [x, t("cx3")], [t("in")]), mk("Mul", [t("in"), t("k")], [t("kin")]),
                mk("Tanh", [t("kin")], [t("th")]), mk("Add", [t("th"), t("one")], [t("th1")]),
                mk("Mul", [x, t("half")], [t("hx")]), mk("Mul", [t("hx"), t("th1")], [y])]
    raise ValueError(f"unknown activation {name!r}")


def _select_activation(choices, code: str, x: str, y: str) -> list:
    """``y = choices[code](x)``: a chain of If nodes on the activation's index (a scalar int64)."""
    from onnx import TensorProto, helper

    mk = helper.make_node

    def branch(i: int):
        """A subgraph computing activation i (the last choice needs no test), or testing it."""
        out = f"act{i}_y"
        if i == len(choices) - 1:
            nodes = _activation_nodes(choices[i], x, out, f"act{i}")
        else:
            nodes = [
                mk("Constant", [], [f"is{i}_k"], value=helper.make_tensor(f"is{i}_k", TensorProto.INT64, [], [i])),
                mk("Equal", [code, f"is{i}_k"], [f"is{i}"]),
                mk("If", [f"is{i}"], [out],
                   then_branch=_graph(_activation_nodes(choices[i], x, f"act{i}_then", f"act{i}"), f"act{i}_then"),
                   else_branch=branch(i + 1)),
            ]
        return _graph(nodes, out)

    def _graph(nodes, out):
        return helper.make_graph(nodes, f"g_{out}", [], [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)])

    inner = branch(0)
    # the chain's outermost subgraph becomes the function's own nodes; its output is renamed y
    nodes = list(inner.node)
    nodes[-1].output[0] = y
    return nodes


def _string_code(attr: str, keys, values, out: str, floats: bool) -> list:
    """``out`` = the index (or a float weight) of string attribute ``attr`` among ``keys``."""
    import onnx
    from onnx import helper

    s = helper.make_node("Constant", [], [f"{attr}_s"])
    ref = onnx.AttributeProto()
    ref.name, ref.ref_attr_name, ref.type = "value_string", attr, onnx.AttributeProto.STRING
    s.attribute.append(ref)
    kw = {"values_floats": [float(v) for v in values]} if floats else {"values_int64s": [int(v) for v in values]}
    enc = helper.make_node("LabelEncoder", [f"{attr}_s"], [out], domain="ai.onnx.ml", keys_strings=list(keys),
                           **({"default_float": 0.0} if floats else {"default_int64": 0}), **kw)
    return [s, enc]


def onnx_function(op: str, opset: int = 17, dtype: str = "float32"):
    """``onnx.FunctionProto`` (domain ``optfuse``, name ``op``), computed in float32 for any I/O
    dtype. ``opset`` is the default-domain opset of the model it goes into (>= 13; below 15,
    which lacks ``CastLike``, the result is cast to ``dtype``, the model's I/O dtype)."""
    import onnx
    from onnx import TensorProto, helper

    if opset < 13:
        raise ValueError("optfuse ONNX functions need default-domain opset >= 13")
    mk = helper.make_node
    f32 = TensorProto.FLOAT
    nodes = [mk("Cast", ["A"], ["Af"], to=f32)]
    if op == "GemmEpilogue":
        alpha = mk("Constant", [], ["alpha_f"])
        ref = onnx.AttributeProto()
        ref.name, ref.ref_attr_name, ref.type = "value_float", "alpha", onnx.AttributeProto.FLOAT
        alpha.attribute.append(ref)
        nodes += [
            mk("Cast", ["W"], ["Wf"], to=f32), mk("Transpose", ["Wf"], ["Wt"], perm=[1, 0]),
            mk("MatMul", ["Af", "Wt"], ["mm"]), alpha, mk("Mul", ["mm", "alpha_f"], ["scaled"]),
            mk("Cast", ["bias"], ["bias_f"], to=f32), mk("Add", ["scaled", "bias_f"], ["pre"]),
            mk("Cast", ["residual"], ["res_f"], to=f32),
            *_string_code("residual_position", RESIDUAL_POSITIONS, [0.0, 1.0], "before_w", floats=True),
            mk("Constant", [], ["one_f"], value_float=1.0), mk("Sub", ["one_f", "before_w"], ["after_w"]),
            mk("Mul", ["res_f", "before_w"], ["res_before"]), mk("Mul", ["res_f", "after_w"], ["res_after"]),
            mk("Add", ["pre", "res_before"], ["pre2"]),
            *_string_code("activation", ACTIVATIONS[op], range(len(ACTIVATIONS[op])), "act_code", floats=False),
            *_select_activation(ACTIVATIONS[op], "act_code", "pre2", "acted"),
            mk("Add", ["acted", "res_after"], ["yf"]),
        ]
    elif op == "GatedGemm":
        nodes += [
            mk("Cast", ["W_gate"], ["Wgf"], to=f32), mk("Transpose", ["Wgf"], ["Wgt"], perm=[1, 0]),
            mk("Cast", ["W_up"], ["Wuf"], to=f32), mk("Transpose", ["Wuf"], ["Wut"], perm=[1, 0]),
            mk("MatMul", ["Af", "Wgt"], ["gate"]), mk("MatMul", ["Af", "Wut"], ["up"]),
            *_string_code("activation", ACTIVATIONS[op], range(len(ACTIVATIONS[op])), "act_code", floats=False),
            *_select_activation(ACTIVATIONS[op], "act_code", "gate", "acted"),
            mk("Mul", ["acted", "up"], ["yf"]),
        ]
    else:
        raise ValueError(f"gemm plugin has no op {op!r}")
    if opset >= 15:
        nodes.append(mk("CastLike", ["yf", "A"], ["y"]))
    else:
        to = TensorProto.BFLOAT16 if dtype == "bfloat16" else helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        nodes.append(mk("Cast", ["yf"], ["y"], to=to))
    fn = plugin_function(SPECS[op], nodes, opset)
    fn.opset_import.append(helper.make_opsetid("ai.onnx.ml", 2))
    return fn
