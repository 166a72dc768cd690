"""NumPy references and ONNX functions of GemmEpilogue / GatedGemm (see spec.yaml).

``reference`` computes in float64 and returns y's dtype (``output_dtype``; ``like_input``: A's).
With FP8 (float8e4m3fn) A and weights the product of the FP8 values (exact in float64) is scaled by
``a_scale * w_scale[n]`` before alpha, bias, activation and residual. The activations, on the
float32 (kernel) or float64 (reference) pre-activation value x:

    relu        max(x, 0)
    relu2       max(x, 0)^2 (squared ReLU)                            Primer, Persimmon, Nemotron
    gelu_erf    0.5 x (1 + erf(x / sqrt(2)))                          BERT, ViT, torch's default GELU
    gelu_tanh   0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))     GPT-2 NewGELU, FastGelu, Gemma
    quick_gelu  x sigmoid(1.702 x)                                    CLIP
    silu        x sigmoid(x)                                          LLaMA / Mistral / Qwen SwiGLU
    sigmoid, tanh, none

The ONNX functions compute in float32. A string attribute cannot pick nodes in a function body, so
the body maps it to a number with ``ai.onnx.ml`` LabelEncoder: an index that a chain of ``If`` nodes
uses to pick the activation, and, for ``residual_position``, a 0/1 weight
(``act(pre + w r) + (1 - w) r``). The functions need every input that the body reads:
``ABSENT_INPUTS`` says what a rewrite passes for an absent bias or residual (a scalar zero of y's
dtype: the same result).

Neither y's dtype nor the presence of the scales can be picked inside one body, so an op has one
function per variant, told apart by the ONNX function ``overload`` (IR >= 10):
:func:`function_overload` names a node's variant from its inputs and ``output_dtype``:

    ""                 A, W and y one dtype (v1's function, ``CastLike(y, A)``)
    "to_<dtype>"       A and W one float dtype, y ``<dtype>``
    "fp8_to_<dtype>"   FP8 A and W, ``DequantizeLinear`` with the scales (W per output channel,
                       axis 0), FP32 math, y ``<dtype>``; default-domain opset >= 19 (FP8 types)
"""

from __future__ import annotations

import math

import numpy as np

from optfuse.functions import plugin_function
from optfuse.spec import FP8_DTYPES, LIKE_INPUT, plugin_specs

SPECS = plugin_specs(__file__)
OPS = tuple(SPECS)
ACTIVATIONS = {op: s.attr("activation").choices for op, s in SPECS.items()}
RESIDUAL_POSITIONS = SPECS["GemmEpilogue"].attr("residual_position").choices
OUTPUT_DTYPES = {op: s.attr("output_dtype").choices for op, s in SPECS.items()}
#: What the ONNX function is fed for an absent bias or residual (a scalar zero of y's dtype adds nothing).
ABSENT_INPUTS = {"bias": 0.0, "residual": 0.0}
#: Per op: the FP8 operands (A and the weights) and their scales, in spec order.
OPERANDS = {"GemmEpilogue": ("A", "W"), "GatedGemm": ("A", "W_gate", "W_up")}
SCALES = {"GemmEpilogue": ("a_scale", "w_scale"), "GatedGemm": ("a_scale", "w_gate_scale", "w_up_scale")}
#: The lowest default-domain opset of an FP8 node (ONNX's float8 types, Cast / DequantizeLinear 19).
FP8_MIN_OPSET = 19

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
    if name == "relu2":
        return np.square(np.maximum(x, 0.0))
    raise ValueError(f"unknown activation {name!r}")


def np_dtype(name: str):
    """The NumPy dtype of a spec dtype name (bfloat16 and float8e4m3fn from ml_dtypes, an onnx dependency)."""
    if name in ("bfloat16", "float8e4m3fn"):
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16 if name == "bfloat16" else ml_dtypes.float8_e4m3fn)
    return np.dtype(name)


def dtype_of(x) -> str | None:
    """The spec dtype name of an array (None for None)."""
    if x is None:
        return None
    name = np.asarray(x).dtype.name
    return {"float8_e4m3fn": "float8e4m3fn"}.get(name, name)


def check_fp8(op: str, dtypes, present) -> bool:
    """Whether an instance is FP8, from its inputs' dtypes and presence (spec order): A and the
    weights both FP8 or neither, the scales present exactly with FP8. ValueError otherwise."""
    names = [t.name for t in SPECS[op].inputs]
    by = dict(zip(names, dtypes))
    fp8 = [by[n] in FP8_DTYPES for n in OPERANDS[op]]
    if any(fp8) and not all(fp8):
        raise ValueError(f"{op}: {', '.join(OPERANDS[op])} must all be FP8 or none "
                         f"(got {', '.join(str(by[n]) for n in OPERANDS[op])})")
    have = dict(zip(names, present))
    wrong = [n for n in SCALES[op] if bool(have.get(n)) != fp8[0]]
    if wrong:
        raise ValueError(f"{op}: {wrong[0]} must be {'present with FP8' if fp8[0] else 'absent without FP8'} "
                         f"{OPERANDS[op][0]} and weights")
    return fp8[0]


def _scale(s) -> np.ndarray:
    """A scale as a float64 vector (one value or per channel); None is 1."""
    return np.reshape(np.asarray(1.0 if s is None else s, np.float64), (-1,))


def gemm_epilogue64(a, w, bias=None, residual=None, activation="none", alpha=1.0,
                    residual_position="after_activation", a_scale=None, w_scale=None) -> np.ndarray:
    """float64 GemmEpilogue: a [..., K], w [N, K] (any float dtype, FP8 included); bias [N] (or a
    scalar); residual broadcasting to [..., N]; a_scale one value, w_scale [N] or one value (None: 1)."""
    acc = np.asarray(a).astype(np.float64) @ np.asarray(w).astype(np.float64).T
    pre = float(alpha) * (acc * _scale(a_scale) * _scale(w_scale))
    if bias is not None:
        pre = pre + np.asarray(bias).astype(np.float64)
    r = None if residual is None else np.asarray(residual).astype(np.float64)
    if residual_position not in RESIDUAL_POSITIONS:
        raise ValueError(f"unknown residual_position {residual_position!r}")
    if r is not None and residual_position == "before_activation":
        return activation64(activation, pre + r)
    y = activation64(activation, pre)
    return y if r is None else y + r


def gated_gemm64(a, w_gate, w_up, activation="silu", a_scale=None, w_gate_scale=None, w_up_scale=None) -> np.ndarray:
    """float64 GatedGemm: act(a @ w_gate^T * a_scale * w_gate_scale) * (a @ w_up^T * a_scale * w_up_scale)."""
    a = np.asarray(a).astype(np.float64)
    gate = a @ np.asarray(w_gate).astype(np.float64).T * _scale(a_scale) * _scale(w_gate_scale)
    up = a @ np.asarray(w_up).astype(np.float64).T * _scale(a_scale) * _scale(w_up_scale)
    return activation64(activation, gate) * up


def sample_inputs(op: str, rng: np.random.Generator, dtype: str = "float32") -> tuple[list[np.ndarray], dict]:
    """Random inputs of ``op`` in spec order (A [2, 3, 16], N = 24; None: absent) and the
    attributes the case needs (float32: none, the scales absent; float8e4m3fn: FP8 A and weights
    rounded from random values, float32 scales, and ``output_dtype`` float32): what the contract
    test runs through the ONNX function and this reference. bias and residual are float32."""
    if op not in OPS:
        raise ValueError(f"gemm plugin has no op {op!r}")
    if dtype not in ("float32", *FP8_DTYPES):
        raise ValueError(f"sample_inputs: dtype {dtype!r} (float32 or {', '.join(FP8_DTYPES)})")
    fp8 = dtype in FP8_DTYPES
    a = rng.standard_normal((2, 3, 16)) * (4.0 if fp8 else 1.0)
    weights = [0.25 * rng.standard_normal((24, 16)) * (16.0 if fp8 else 1.0) for _ in OPERANDS[op][1:]]
    operands = [x.astype(np.float32).astype(np_dtype(dtype)) for x in [a, *weights]]
    if op == "GemmEpilogue":
        rest = [rng.standard_normal(24).astype(np.float32), rng.standard_normal((2, 3, 24)).astype(np.float32)]
    else:
        rest = []
    if not fp8:
        return operands + rest + [None] * len(SCALES[op]), {}
    scales = [np.array(0.25 + rng.random(), np.float32)]
    scales += [(0.01 + 0.05 * rng.random(24)).astype(np.float32) for _ in OPERANDS[op][1:]]
    return operands + rest + scales, {"output_dtype": "float32"}


def reference(op: str, inputs: list, attrs: dict) -> list[np.ndarray]:
    if op not in OPS:
        raise ValueError(f"gemm plugin has no op {op!r}")
    spec = SPECS[op]
    get = lambda k: attrs.get(k, spec.attr(k).default)  # noqa: E731
    inputs = list(inputs) + [None] * (len(spec.inputs) - len(inputs))
    dtypes = [dtype_of(x) for x in inputs]
    check_fp8(op, dtypes, [x is not None for x in inputs])
    out = np_dtype(spec.output_dtype(0, dtypes, attrs))
    by = {t.name: x for t, x in zip(spec.inputs, inputs)}
    if op == "GemmEpilogue":
        y = gemm_epilogue64(by["A"], by["W"], by["bias"], by["residual"], get("activation"), get("alpha"),
                            get("residual_position"), by["a_scale"], by["w_scale"])
    else:
        y = gated_gemm64(by["A"], by["W_gate"], by["W_up"], get("activation"), by["a_scale"], by["w_gate_scale"],
                         by["w_up_scale"])
    return [y.astype(out)]


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
    if name == "relu2":
        return [mk("Relu", [x], [t("r")]), mk("Mul", [t("r"), t("r")], [y])]
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


def function_overload(op: str, inputs, attrs: dict | None = None) -> str:
    """The function variant (ONNX ``overload``) of a node of ``op``: ``inputs`` are its input names
    in spec order ("" or missing: absent), ``attrs`` its attributes (``output_dtype``). FP8 is told by
    the presence of ``a_scale``; an FP8 node with ``output_dtype`` like_input is a ValueError."""
    if op not in OPS:
        raise ValueError(f"gemm plugin has no op {op!r}")
    out = (attrs or {}).get("output_dtype", SPECS[op].attr("output_dtype").default)
    out = out.decode() if isinstance(out, bytes) else str(out)
    if out not in OUTPUT_DTYPES[op]:
        raise ValueError(f"{op}: output_dtype {out!r} not in {OUTPUT_DTYPES[op]}")
    i = SPECS[op].input_index("a_scale")
    fp8 = i < len(inputs) and bool(inputs[i])
    if fp8:
        if out == LIKE_INPUT:
            raise ValueError(f"{op}: an FP8 node (a_scale present) needs output_dtype, not {LIKE_INPUT}")
        return f"fp8_to_{out}"
    return "" if out == LIKE_INPUT else f"to_{out}"


def function_overloads(op: str) -> tuple[str, ...]:
    """Every variant :func:`function_overload` names for ``op``."""
    dts = [d for d in OUTPUT_DTYPES[op] if d != LIKE_INPUT]
    return ("", *(f"to_{d}" for d in dts), *(f"fp8_to_{d}" for d in dts))


def _float_attr(name: str, out: str):
    """A Constant node whose ``value_float`` is the function's float attribute ``name``."""
    import onnx
    from onnx import helper

    node = helper.make_node("Constant", [], [out])
    ref = onnx.AttributeProto()
    ref.name, ref.ref_attr_name, ref.type = "value_float", name, onnx.AttributeProto.FLOAT
    node.attribute.append(ref)
    return node


def _operands(op: str, fp8: bool) -> list:
    """Nodes giving the float32 operands ``Af`` and ``<W>t`` (the weights [K, N]): Cast, or with FP8
    DequantizeLinear of A with its per-tensor scale and of each weight per output channel (axis 0;
    a one-value weight scale is expanded to [N])."""
    from onnx import TensorProto, helper

    mk = helper.make_node
    f32 = TensorProto.FLOAT
    weights = OPERANDS[op][1:]
    if not fp8:
        nodes = [mk("Cast", ["A"], ["Af"], to=f32)]
        for w in weights:
            nodes += [mk("Cast", [w], [f"{w}f"], to=f32), mk("Transpose", [f"{w}f"], [f"{w}t"], perm=[1, 0])]
        return nodes
    a_scale, *w_scales = SCALES[op]
    nodes = [mk("Constant", [], ["scalar_shape"], value=helper.make_tensor("scalar_shape", TensorProto.INT64, [0], [])),
             mk("Reshape", [a_scale, "scalar_shape"], ["a_scale_s"]),
             mk("DequantizeLinear", ["A", "a_scale_s"], ["Af"]),
             mk("Shape", [weights[0]], ["n_shape"], end=1)]
    for w, ws in zip(weights, w_scales):
        nodes += [mk("Expand", [ws, "n_shape"], [f"{ws}_n"]),
                  mk("DequantizeLinear", [w, f"{ws}_n"], [f"{w}f"], axis=0),
                  mk("Transpose", [f"{w}f"], [f"{w}t"], perm=[1, 0])]
    return nodes


def _output_cast(overload: str, opset: int, dtype: str) -> list:
    """``y`` from the float32 ``yf``: CastLike to A (v1), or Cast to the overload's dtype."""
    from onnx import TensorProto, helper

    def onnx_type(name):
        return TensorProto.BFLOAT16 if name == "bfloat16" else helper.np_dtype_to_tensor_dtype(np.dtype(name))

    if overload:
        return [helper.make_node("Cast", ["yf"], ["y"], to=onnx_type(overload.split("to_")[-1]))]
    if opset >= 15:
        return [helper.make_node("CastLike", ["yf", "A"], ["y"])]
    return [helper.make_node("Cast", ["yf"], ["y"], to=onnx_type(dtype))]


def onnx_function(op: str, opset: int = 17, dtype: str = "float32", overload: str = ""):
    """``onnx.FunctionProto`` (domain ``optfuse``, name ``op``, ONNX ``overload`` as given: see
    :func:`function_overload`), computed in float32. ``opset`` is the default-domain opset of the
    model it goes into (>= 13; an ``fp8_to_*`` variant needs >= 19, ``FP8_MIN_OPSET``); without an
    overload below opset 15, which lacks ``CastLike``, the result is cast to ``dtype``, the model's
    I/O dtype."""
    from onnx import TensorProto, helper

    if opset < 13:
        raise ValueError("optfuse ONNX functions need default-domain opset >= 13")
    if op not in OPS:
        raise ValueError(f"gemm plugin has no op {op!r}")
    if overload not in function_overloads(op):
        raise ValueError(f"{op}: no function overload {overload!r} (have {function_overloads(op)})")
    fp8 = overload.startswith("fp8_")
    if fp8 and opset < FP8_MIN_OPSET:
        raise ValueError(f"{op}: an FP8 node needs default-domain opset >= {FP8_MIN_OPSET} (float8e4m3fn "
                         f"DequantizeLinear); the model has opset {opset}")
    mk = helper.make_node
    f32 = TensorProto.FLOAT
    nodes = _operands(op, fp8)
    if op == "GemmEpilogue":
        nodes += [
            mk("MatMul", ["Af", "Wt"], ["mm"]), _float_attr("alpha", "alpha_f"),
            mk("Mul", ["mm", "alpha_f"], ["scaled"]),
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
    else:
        nodes += [
            mk("MatMul", ["Af", "W_gatet"], ["gate"]), mk("MatMul", ["Af", "W_upt"], ["up"]),
            *_string_code("activation", ACTIVATIONS[op], range(len(ACTIVATIONS[op])), "act_code", floats=False),
            *_select_activation(ACTIVATIONS[op], "act_code", "gate", "acted"),
            mk("Mul", ["acted", "up"], ["yf"]),
        ]
    nodes += _output_cast(overload, opset, dtype)
    fn = plugin_function(SPECS[op], nodes, opset)
    fn.opset_import.append(helper.make_opsetid("ai.onnx.ml", 2))
    if overload:
        fn.overload = overload
    return fn
