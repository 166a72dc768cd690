"""GEMM fusions (optfuse.fusions.gemm): every activation spelling, Gemm and Conv1D layouts, residuals
and the SkipNorm decision, gated FFNs, sibling packing, boundaries with their reasons, the HBM
estimate, and the exported models (slow) fused and equal to the originals in onnxruntime."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import graphs
from optfuse.estimate import estimate_traffic
from optfuse.fusions import fuse_model
from optfuse.report import build_report, render_markdown
from optfuse.spec import get_spec

K, N = 32, 48
GEMM_OPS = ("GemmEpilogue", "GatedGemm")
ACTIVATION_OPS = {"Erf", "Tanh", "Sigmoid", "Relu", "Gelu", "HardSwish"}


# ------------------------------------------------------------------------------------------------
# hand-built graphs
# ------------------------------------------------------------------------------------------------
def _act(b: graphs.Builder, x: str, form: str) -> str:
    """act(x) spelled as `form` (how an exporter writes it)."""
    c = b.const
    if form == "relu":
        return b.node("Relu", x)
    if form.startswith("relu2_"):  # torch.square(relu(x)) / relu(x) ** 2 as the exporters write it
        r = b.node("Relu", x)
        if form == "relu2_mul":
            return b.node("Mul", r, r)
        exponent = {"relu2_pow": lambda: c(2.0), "relu2_pow_int": lambda: c(2, dtype=np.int64),
                    "relu2_pow_node": lambda: b.node("Constant", value=onnx.numpy_helper.from_array(
                        np.array([2.0], np.float32), "two"))}[form]()
        return b.node("Pow", r, exponent)
    if form in ("sigmoid", "tanh"):
        return b.node(form.capitalize(), x)
    if form == "silu":
        return b.node("Mul", b.node("Sigmoid", x), x)
    if form == "quick_gelu":
        return b.node("Mul", x, b.node("Sigmoid", b.node("Mul", c(1.702), x)))
    if form.startswith("gelu_erf"):  # gelu_erf_<assoc>_<div|mul>
        _, _, assoc, how = form.split("_")
        arg = b.node("Div", x, c(math.sqrt(2.0))) if how == "div" else b.node("Mul", x, c(1 / math.sqrt(2.0)))
        e = b.node("Add", b.node("Erf", arg), c(1.0))
        if assoc == "a":  # (x * 0.5) * (1 + erf)
            return b.node("Mul", b.node("Mul", x, c(0.5)), e)
        if assoc == "b":  # (x * (1 + erf)) * 0.5  (BERT's export)
            return b.node("Mul", b.node("Mul", x, e), c(0.5))
        return b.node("Mul", x, b.node("Mul", c(0.5), e))
    if form in ("gelu_tanh_pow", "gelu_tanh_cube"):  # GPT-2 NewGELU
        cube = b.node("Pow", x, c(3.0)) if form.endswith("pow") else b.node("Mul", b.node("Mul", x, x), x)
        inner = b.node("Mul", c(math.sqrt(2 / math.pi)), b.node("Add", x, b.node("Mul", c(0.044715), cube)))
        return b.node("Mul", b.node("Mul", c(0.5), x), b.node("Add", c(1.0), b.node("Tanh", inner)))
    if form == "gelu_tanh_fast":  # x * 0.5 * (1 + tanh(0.79788456 * x * (1 + 0.044715 * x * x)))
        quad = b.node("Mul", b.node("Mul", c(0.044715), x), x)
        inner = b.node("Mul", b.node("Mul", c(0.79788456), x), b.node("Add", c(1.0), quad))
        return b.node("Mul", b.node("Mul", x, c(0.5)), b.node("Add", c(1.0), b.node("Tanh", inner)))
    if form == "onnx_gelu":
        return b.node("Gelu", x)
    if form == "onnx_gelu_tanh":
        return b.node("Gelu", x, approximate="tanh")
    if form == "hardswish":
        return b.node("HardSwish", x)
    raise ValueError(form)


def linear(form="none", k=K, n=N, bias="after", residual=None, opset=17, shape=("b", "s"), seed=0,
           extra_output=False, weight_input=False, dtype=np.float32):
    """y = [residual +] act(X @ W [+ b] [+ residual]); bias 'after' (Add(mm, b)), 'before' (Add(b, mm)) or None;
    residual None, 'after' (after the activation), 'before' (before it) or 'broadcast'."""
    rng = np.random.default_rng(seed)
    b = graphs.Builder(opset)
    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    w = "w_in" if weight_input else b.const((rng.standard_normal((k, n)) / np.sqrt(k)).astype(dtype), "W", dtype)
    y = b.node("MatMul", "x", w)
    if bias:
        bv = b.const(rng.standard_normal(n).astype(dtype), "B", dtype)
        y = b.node("Add", y, bv) if bias == "after" else b.node("Add", bv, y)
    if residual == "before":
        y = b.node("Add", y, "r")
    pre = y
    if form != "none":
        y = _act(b, y, form)
    if residual in ("after", "broadcast"):
        y = b.node("Add", "r", y)
    b.nodes[-1].output[0] = "y"
    inputs = [graphs.io("x", [*shape, k], elem)]
    if residual:
        inputs.append(graphs.io("r", [1, shape[1], n] if residual == "broadcast" else [*shape, n], elem))
    if weight_input:
        inputs.append(graphs.io("w_in", [k, n], elem))
    outputs = [graphs.io("y", [*shape, n], elem)]
    if extra_output:
        outputs.append(graphs.io(pre, None, elem))
    return b.model(inputs, outputs)


def _run(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in feeds.items() if k in names})


def _feeds(model, dims=(2, 5), seed=1):
    rng = np.random.default_rng(seed)
    out = {}
    for vi in model.graph.input:
        shape = [d.dim_value or dims[i] for i, d in enumerate(vi.type.tensor_type.shape.dim)]
        dt = onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
        out[vi.name] = rng.standard_normal(shape).astype(dt)
    return out


def _assert_same(model, fused, atol=1e-4, dims=(2, 5)):
    feeds = _feeds(model, dims)
    for want, got in zip(_run(model, feeds), _run(fused, feeds)):
        assert want.shape == got.shape
        assert float(np.max(np.abs(want.astype(np.float64) - got))) <= atol


def _gemm(res):
    return [a for a in res.accepted if a.op in GEMM_OPS]


def _fuse_one(model):
    fused, res = fuse_model(model, dims={"b": 2, "s": 5})
    ops = [n.op_type for n in fused.graph.node]
    return fused, res, ops


# ------------------------------------------------------------------------------------------------
# activations and layouts
# ------------------------------------------------------------------------------------------------
FORMS = {
    "relu": "relu", "sigmoid": "sigmoid", "tanh": "tanh", "silu": "silu", "quick_gelu": "quick_gelu",
    "gelu_erf_a_div": "gelu_erf", "gelu_erf_b_div": "gelu_erf", "gelu_erf_c_mul": "gelu_erf",
    "gelu_tanh_pow": "gelu_tanh", "gelu_tanh_cube": "gelu_tanh", "gelu_tanh_fast": "gelu_tanh",
    "relu2_pow": "relu2", "relu2_pow_int": "relu2", "relu2_pow_node": "relu2", "relu2_mul": "relu2",
}


@pytest.mark.parametrize("bias", ["after", "before", None])
@pytest.mark.parametrize("form", list(FORMS))
def test_every_activation_spelling_fuses(form, bias):
    model = linear(form, bias=bias)
    fused, res, ops = _fuse_one(model)
    (acc,) = _gemm(res)
    assert acc.rule == "gemm.act" and acc.rewrite.attrs["activation"] == FORMS[form]
    assert acc.rewrite.info["bias"] == (bias is not None)
    assert ops == ["GemmEpilogue"], ops
    _assert_same(model, fused)


@pytest.mark.parametrize("form,act", [("onnx_gelu", "gelu_erf"), ("onnx_gelu_tanh", "gelu_tanh")])
def test_onnx_gelu_opset20(form, act):
    model = linear(form, opset=20)
    fused, res, ops = _fuse_one(model)
    assert ops == ["GemmEpilogue"] and _gemm(res)[0].rewrite.attrs["activation"] == act
    _assert_same(model, fused)


def test_activation_choices_come_from_the_spec():
    from optfuse.fusions.gemm.patterns import ACTIVATIONS

    assert set(ACTIVATIONS) | {"none"} == set(get_spec("GemmEpilogue").attr("activation").choices)


def test_hardswish_is_no_activation_the_gemm_and_bias_fuse():
    model = linear("hardswish", opset=17)
    fused, res, ops = _fuse_one(model)
    (acc,) = _gemm(res)
    assert acc.rule == "gemm.bias" and acc.rewrite.attrs["activation"] == "none"
    assert ops == ["GemmEpilogue", "HardSwish"]
    _assert_same(model, fused)


@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("alpha,beta", [(1.0, 1.0), (0.5, 2.0)])
def test_gemm_2d_transb_alpha_beta(trans_b, alpha, beta):
    rng = np.random.default_rng(0)
    b = graphs.Builder(17)
    w = rng.standard_normal((K, N)).astype(np.float32) / np.sqrt(K)
    y = b.node("Gemm", "x", b.const(w.T.copy() if trans_b else w), b.const(rng.standard_normal(N)),
               alpha=alpha, beta=beta, transB=trans_b)
    b.node("Relu", y, out="z")
    model = b.model([graphs.io("x", ["m", K])], [graphs.io("z", ["m", N])])
    fused, res, ops = _fuse_one(model)
    (acc,) = _gemm(res)
    assert ops == ["GemmEpilogue"] and acc.rewrite.attrs["activation"] == "relu"
    assert acc.rewrite.attrs.get("alpha", 1.0) == alpha
    w_fused = acc.rewrite.inputs[1]
    assert w_fused.shape == (N, K) and np.allclose(w_fused, w.T)  # [N, K] whatever transB was
    _assert_same(model, fused, dims=(6,))


def test_weight_through_transpose_and_cast_of_the_initializer():
    """MatMul(x, Cast(Transpose(W))): sanitize folds the constant chain, the GEMM fuses on it."""
    w = np.random.default_rng(0).standard_normal((N, K)).astype(np.float32)
    b = graphs.Builder(17)
    wt = b.node("Cast", b.node("Transpose", b.const(w, "W"), perm=[1, 0]), to=onnx.TensorProto.FLOAT)
    b.node("Relu", b.node("MatMul", "x", wt), out="y")
    model = b.model([graphs.io("x", ["b", "s", K])], [graphs.io("y", ["b", "s", N])])
    fused, res, ops = _fuse_one(model)
    (acc,) = _gemm(res)
    assert ops == ["GemmEpilogue"] and np.array_equal(acc.rewrite.inputs[1], w)
    _assert_same(model, fused)


def conv1d(form="gelu_tanh_pow", residual=False, shared_rows=False):
    """GPT-2's Conv1D: Reshape(x, [-1, K]) -> Gemm(., W [K, N], b) -> Reshape([B, S, N]) -> act [+ r]."""
    rng = np.random.default_rng(0)
    b = graphs.Builder(17)
    rows = b.node("Reshape", "x", b.const(np.array([-1, K]), dtype=np.int64))
    shape = b.node("Concat", b.node("Slice", b.node("Shape", "x"), b.const(np.array([0]), dtype=np.int64),
                                    b.const(np.array([2]), dtype=np.int64)),
                   b.const(np.array([N]), dtype=np.int64), axis=0)
    g = b.node("Gemm", rows, b.const(rng.standard_normal((K, N)) / np.sqrt(K)), b.const(rng.standard_normal(N)))
    y = _act(b, b.node("Reshape", g, shape), form)
    if residual:
        y = b.node("Add", y, "r")
    b.nodes[-1].output[0] = "y"
    outputs = [graphs.io("y", ["b", "s", N])]
    if shared_rows:  # the flattened rows are read by a second GEMM too
        b.node("MatMul", rows, b.const(rng.standard_normal((K, 16))), out="y2")
        outputs.append(graphs.io("y2", ["m", 16]))
    inputs = [graphs.io("x", ["b", "s", K])] + ([graphs.io("r", ["b", "s", N])] if residual else [])
    return b.model(inputs, outputs)


@pytest.mark.parametrize("residual", [False, True])
def test_conv1d_activation_after_the_reshape_fuses(residual):
    model = conv1d(residual=residual)
    fused, res, ops = _fuse_one(model)
    (acc,) = _gemm(res)
    assert acc.rule == ("gemm.act_residual" if residual else "gemm.act")
    assert acc.rewrite.attrs["activation"] == "gelu_tanh"
    # the fused node runs on the rows; the Reshape stays after it (and the residual is flattened)
    assert Counter(ops)["GemmEpilogue"] == 1 and "Gemm" not in ops and "Tanh" not in ops
    node = next(n for n in fused.graph.node if n.op_type == "GemmEpilogue")
    (reader,) = [n for n in fused.graph.node if node.output[0] in n.input]
    assert reader.op_type == "Reshape" and reader.output[0] == "y"
    assert Counter(ops)["Reshape"] == 2 + residual  # rows, the one after the GEMM, [the residual's]
    _assert_same(model, fused)


def test_conv1d_rows_read_by_another_gemm_too():
    """The flattened rows stay outside every match (A of each GEMM), so both GEMMs fuse."""
    model = conv1d(shared_rows=True)
    fused, res, ops = _fuse_one(model)
    assert sorted(a.rule for a in _gemm(res)) == ["gemm.act", "gemm.linear"]
    assert "Gemm" not in ops and "MatMul" not in ops
    _assert_same(model, fused)


# ------------------------------------------------------------------------------------------------
# residuals, and the residual vs SkipNorm decision
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("position,rule", [("after", "gemm.act_residual"), ("before", "gemm.residual_act")])
def test_residual_after_or_before_the_activation(position, rule):
    model = linear("gelu_erf_b_div", residual=position)
    fused, res, ops = _fuse_one(model)
    (acc,) = _gemm(res)
    assert acc.rule == rule and ops == ["GemmEpilogue"]
    assert acc.rewrite.attrs["residual_position"] == f"{position}_activation"
    _assert_same(model, fused)


@pytest.mark.parametrize("form", ["relu2_pow", "relu2_mul"])
@pytest.mark.parametrize("position,rule", [("after", "gemm.act_residual"), ("before", "gemm.residual_act")])
def test_relu2_with_a_residual(form, position, rule):
    model = linear(form, residual=position)
    fused, res, ops = _fuse_one(model)
    (acc,) = _gemm(res)
    assert acc.rule == rule and ops == ["GemmEpilogue"] and acc.rewrite.attrs["activation"] == "relu2"
    assert acc.rewrite.attrs["residual_position"] == f"{position}_activation"
    _assert_same(model, fused)


def test_broadcasting_residual_is_rejected_and_the_rest_fuses():
    model = linear("relu", residual="broadcast")
    fused, res, ops = _fuse_one(model)
    (acc,) = _gemm(res)
    assert acc.rule == "gemm.act" and ops == ["GemmEpilogue", "Add"]
    _assert_same(model, fused)


def _post_norm(n_layers=2, hidden=64):
    """Post-norm (BERT): s = f(x) + x is read only by the norm."""
    rng = np.random.default_rng(0)
    b = graphs.Builder(17)
    x = "x"
    for _ in range(n_layers):
        f = b.node("Add", b.node("MatMul", x, b.const(rng.standard_normal((hidden, hidden)) / 8)),
                   b.const(rng.standard_normal(hidden)))
        x = b.node("LayerNormalization", b.node("Add", f, x), b.const(rng.standard_normal(hidden)),
                   b.const(rng.standard_normal(hidden)), axis=-1, epsilon=1e-5)
    b.nodes[-1].output[0] = "y"
    return b.model([graphs.io("x", ["b", "s", hidden])], [graphs.io("y", ["b", "s", hidden])])


def test_pre_norm_residual_goes_to_the_gemm():
    """The sum is read by the norm and the next residual Add: the GEMM takes it (4 [M, N] tensors
    moved instead of SkipLayerNorm's 5); the norm stays a plain LayerNorm."""
    model = graphs.residual_block(n_layers=2)
    fused, res, ops = _fuse_one(model)
    assert res.counts() == {"GemmEpilogue": 2, "LayerNorm": 2}, res.counts()
    for acc in _gemm(res):
        assert acc.rule == "gemm.residual"
        assert acc.rewrite.info["residual"] == ("residual taken by the GEMM, not SkipLayerNorm: "
                                                "GEMM + LayerNorm move 4 [M, N] tensors, SkipLayerNorm 5")
    # per layer the MatMul's output is no longer written and read; the fused node reads a scalar zero bias
    saved = estimate_traffic(fused, res).saved_bytes
    assert [saved[a.node_name] for a in _gemm(res)] == [2 * (2 * 5 * 64 * 4) - 4] * 2
    _assert_same(model, fused)


def test_post_norm_residual_goes_to_the_gemm_while_skip_norm_writes_its_sum():
    """The norm is the sum's only reader, but SkipLayerNorm writes its sum output anyway (5 tensors)."""
    model = _post_norm()
    fused, res, ops = _fuse_one(model)
    assert res.counts() == {"GemmEpilogue": 2, "LayerNorm": 2}, res.counts()
    assert all(a.rule == "gemm.residual" and "SkipLayerNorm 5" in a.rewrite.info["residual"] for a in _gemm(res))
    _assert_same(model, fused)


def test_post_norm_residual_stays_with_skip_norm_on_a_tie(monkeypatch):
    """With an optional sum output the Skip op would move 4 tensors too: a tie keeps the SkipNorm."""
    from dataclasses import replace

    from optfuse.fusions.gemm import epilogue

    real = epilogue.get_spec

    def optional_sum(op):
        spec = real(op)
        if not op.startswith("Skip"):
            return spec
        return replace(spec, outputs=type(spec.outputs)([spec.outputs[0], replace(spec.outputs[1], optional=True)]))

    monkeypatch.setattr(epilogue, "get_spec", optional_sum)
    model = _post_norm()
    fused, res, ops = _fuse_one(model)
    assert res.counts() == {"GemmEpilogue": 2, "SkipLayerNorm": 2}, res.counts()
    for acc in _gemm(res):
        assert acc.rule == "gemm.bias" and "residual_position" not in acc.rewrite.attrs
        assert acc.rewrite.info["residual"] == ("residual left to SkipLayerNorm: "
                                                "GEMM + LayerNorm move 4 [M, N] tensors, SkipLayerNorm 4")
    # the pre-norm residual still goes to the GEMM (the sum has another reader)
    _, res = fuse_model(graphs.residual_block(n_layers=2))
    assert res.counts() == {"GemmEpilogue": 2, "LayerNorm": 2}
    _assert_same(model, fused)


# ------------------------------------------------------------------------------------------------
# gated FFN and siblings
# ------------------------------------------------------------------------------------------------
def gated_ffn(form="silu", bias=False, k=K, n=N, down=True):
    rng = np.random.default_rng(0)
    b = graphs.Builder(17)
    g = b.node("MatMul", "x", b.const(rng.standard_normal((k, n)) / np.sqrt(k)))
    if bias:
        g = b.node("Add", g, b.const(rng.standard_normal(n)))
    u = b.node("MatMul", "x", b.const(rng.standard_normal((k, n)) / np.sqrt(k)))
    h = b.node("Mul", _act(b, g, form), u)
    if down:
        b.node("MatMul", h, b.const(rng.standard_normal((n, k)) / np.sqrt(n)))
    b.nodes[-1].output[0] = "y"
    return b.model([graphs.io("x", ["b", "s", k])], [graphs.io("y", ["b", "s", k if down else n])])


@pytest.mark.parametrize("form,act", [("silu", "silu"), ("gelu_tanh_pow", "gelu_tanh"), ("gelu_erf_b_div", "gelu_erf")])
def test_gated_ffn_is_one_gated_gemm(form, act):
    model = gated_ffn(form)
    fused, res, ops = _fuse_one(model)
    assert res.counts() == {"GatedGemm": 1, "GemmEpilogue": 1}
    gated = next(a for a in res.accepted if a.op == "GatedGemm")
    assert gated.rule == "gemm.gated" and gated.rewrite.attrs["activation"] == act
    assert res.summary["gemm"] == {"gemms": {"before": 3, "after": 2}}
    _assert_same(model, fused)


def test_gated_ffn_with_a_bias_is_rejected_with_the_reason():
    """The gated rule says why; its GEMMs then fuse one by one (so the report, which lists a
    rejection only where no fusion took its nodes, shows those fusions instead)."""
    from optfuse.fusions.gemm import RULES
    from optfuse.ir import sanitize
    from optfuse.pattern import Context
    from optfuse.rewrite import plan_family

    model = gated_ffn(bias=True, down=False)
    plan = plan_family(graph := sanitize(model), [r for r in RULES if r.id == "gemm.gated"], Context(graph))
    assert not plan.accepted
    assert [r.reason for r in plan.rejected] == ["the gate projection has a bias Add; GatedGemm has no bias input"]
    fused, res, ops = _fuse_one(model)
    assert "GatedGemm" not in ops and sorted(a.rule for a in _gemm(res)) == ["gemm.act", "gemm.linear"]
    _assert_same(model, fused)


def siblings(biases=(True, True, True), sizes=(32, 32, 16), k=K):
    rng = np.random.default_rng(0)
    b = graphs.Builder(17)
    h = b.node("Relu", "x")  # a node the projections share (the pattern is anchored at its output)
    outs = []
    for i, (has_bias, n) in enumerate(zip(biases, sizes)):
        y = b.node("MatMul", h, b.const(rng.standard_normal((k, n)) / np.sqrt(k)))
        if has_bias:
            y = b.node("Add", y, b.const(rng.standard_normal(n)))
        b.nodes[-1].output[0] = f"y{i}"
        outs.append(graphs.io(f"y{i}", ["b", "s", n]))
    return b.model([graphs.io("x", ["b", "s", k])], outs)


@pytest.mark.parametrize("biases", [(True, True, True), (False, False, False), (True, False, True)])
def test_siblings_pack_into_one_gemm_and_a_split(biases):
    model = siblings(biases)
    fused, res, ops = _fuse_one(model)
    (acc,) = _gemm(res)
    assert acc.rule == "gemm.siblings" and acc.rewrite.info["packed"] == 3
    assert acc.rewrite.inputs[1].shape == (80, K)
    assert Counter(ops) == {"Relu": 1, "GemmEpilogue": 1, "Split": 1}
    split = next(n for n in fused.graph.node if n.op_type == "Split")
    assert list(split.output) == ["y0", "y1", "y2"]
    assert res.summary["gemm"] == {"gemms": {"before": 3, "after": 1}}
    report = build_report(res, estimate=estimate_traffic(fused, res))
    assert report["summary"]["gemm"] == {"gemms": {"before": 3, "after": 1}}
    assert "| gemm | gemms | 3 | 1 |" in render_markdown(report)
    _assert_same(model, fused)


# ------------------------------------------------------------------------------------------------
# boundaries
# ------------------------------------------------------------------------------------------------
def test_pre_activation_read_elsewhere_fuses_the_gemm_and_bias_only():
    model = linear("gelu_erf_b_div", extra_output=True)
    fused, res, ops = _fuse_one(model)
    (acc,) = _gemm(res)
    assert acc.rule == "gemm.bias" and acc.rewrite.attrs["activation"] == "none"
    assert "Erf" in ops
    _assert_same(model, fused)


def _relu_read_elsewhere(form: str, reader: str):
    """y = square(r) and r = Relu(X @ W + b) read by something else too: a graph output, an Add
    with the square (r + r^2: r would be a residual the match itself computes) or a second Relu2."""
    rng = np.random.default_rng(0)
    b = graphs.Builder(17)
    pre = b.node("Add", b.node("MatMul", "x", b.const(rng.standard_normal((K, N)) / np.sqrt(K))),
                 b.const(rng.standard_normal(N)))
    r = b.node("Relu", pre)
    sq = (lambda: b.node("Mul", r, r)) if form == "relu2_mul" else (lambda: b.node("Pow", r, b.const(2.0)))
    y = sq()
    outputs = [graphs.io("y", ["b", "s", N])]
    if reader == "output":
        outputs.append(graphs.io(r, ["b", "s", N]))
    elif reader == "add":
        y = b.node("Add", y, r)
    else:  # "second_square"
        y = b.node("Add", y, sq())
    b.nodes[-1].output[0] = "y"
    return b.model([graphs.io("x", ["b", "s", K])], outputs)


@pytest.mark.parametrize("reader", ["output", "add", "second_square"])
@pytest.mark.parametrize("form", ["relu2_pow", "relu2_mul"])
def test_relu_read_elsewhere_fuses_as_relu_and_the_square_stays(form, reader):
    """Fusion boundary: relu2 may not absorb a Relu whose output another reader needs; the GEMM,
    bias and ReLU fuse (relu) and the square stays, as without relu2."""
    model = _relu_read_elsewhere(form, reader)
    fused, res, ops = _fuse_one(model)
    (acc,) = _gemm(res)
    assert acc.rule == "gemm.act" and acc.rewrite.attrs["activation"] == "relu", (acc.rule, acc.rewrite.attrs)
    square_op = "Mul" if form == "relu2_mul" else "Pow"
    assert ops.count("GemmEpilogue") == 1 and "Relu" not in ops and "MatMul" not in ops
    assert ops.count(square_op) == (2 if reader == "second_square" else 1), ops
    _assert_same(model, fused)


@pytest.mark.parametrize("exponent", [3.0, 2.5])
def test_relu_to_another_power_is_relu_and_a_pow(exponent):
    b = graphs.Builder(17)
    w = np.random.default_rng(0).standard_normal((K, N)).astype(np.float32) / np.sqrt(K)
    b.node("Pow", b.node("Relu", b.node("MatMul", "x", b.const(w))), b.const(exponent), out="y")
    model = b.model([graphs.io("x", ["b", "s", K])], [graphs.io("y", ["b", "s", N])])
    fused, res, ops = _fuse_one(model)
    (acc,) = _gemm(res)
    assert acc.rewrite.attrs["activation"] == "relu" and ops == ["GemmEpilogue", "Pow"]
    _assert_same(model, fused)


@pytest.mark.parametrize("kw,reason", [
    ({"weight_input": True}, "is not a constant"),
    ({"k": 36}, "K = 36 is not a multiple of 8"),
    ({"n": 44}, "N = 44 is not a multiple of 8"),
    ({"dtype": np.float64}, "dtype float64"),
])
def test_rejected_with_a_reason(kw, reason):
    model = linear("relu", **kw)
    fused, res, ops = _fuse_one(model)
    assert not _gemm(res) and "MatMul" in ops
    reasons = [r.reason for r in res.rejected if r.op == "GemmEpilogue"]
    assert reasons and all(reason in r for r in reasons), reasons
    assert len(reasons) == 1  # one reason per candidate, not one per rule
    _assert_same(model, fused)


def test_k_over_max_k_is_rejected():
    max_k = get_spec("GemmEpilogue").limits["max_k"]
    model = linear("none", k=max_k + 8, n=8, bias=None)
    _, res, ops = _fuse_one(model)
    assert not _gemm(res)
    assert any(f"K = {max_k + 8} is over" in r.reason for r in res.rejected), res.rejected


def test_unfused_attention_matmuls_are_reported_once_each():
    """Q.K^T and P.V with attention disabled: a MatMul of two activations, one reason each."""
    b = graphs.Builder(17)
    p = b.node("Softmax", b.node("MatMul", "q", b.node("Transpose", "k", perm=[0, 2, 1])), axis=-1)
    b.node("MatMul", p, "v", out="y")
    io = [graphs.io(n, ["b", "s", 32]) for n in ("q", "k", "v")]
    model = b.model(io, [graphs.io("y", ["b", "s", 32])])
    _, res = fuse_model(model, families=["gemm"])
    reasons = [r.reason for r in res.rejected]
    assert len(reasons) == 2 and all("is not a constant" in r for r in reasons), reasons


# ------------------------------------------------------------------------------------------------
# HBM estimate
# ------------------------------------------------------------------------------------------------
def test_hbm_estimate_bert_base_ffn():
    """BERT-base, B = 32, S = 512: the [16384, 3072] pre-activation (MatMul out, then bias-Add out)
    is no longer written and read twice; the fused node reads one scalar zero (the absent residual)."""
    model = linear("onnx_gelu", k=768, n=3072, opset=20)
    fused, res = fuse_model(model, dims={"b": 32, "s": 512})
    (acc,) = _gemm(res)
    saved = estimate_traffic(fused, res).saved_bytes[acc.node_name]
    assert saved == 2 * 2 * (16384 * 3072 * 4) - 4


# ------------------------------------------------------------------------------------------------
# exported models (slow)
# ------------------------------------------------------------------------------------------------
FFN = {"bert": ("gemm.act", "gelu_erf"), "gpt2": ("gemm.act", "gelu_tanh"), "vit": ("gemm.act", "gelu_erf"),
       "llama": ("gemm.gated", "silu"), "t5": ("gemm.act", "relu")}
PACKED_QKV = {"bert", "vit", "llama", "t5"}  # GPT-2 writes Q/K/V as one Conv1D already
MODEL_CASES = [pytest.param(f, e, a, id=f"{f}-{e}-{a}", marks=pytest.mark.slow)
               for f in FFN for e in ("torchscript", "dynamo") for a in ("sdpa", "eager")]


@pytest.mark.parametrize("family,exporter,attn", MODEL_CASES)
def test_exported_models_fuse_every_gemm(exported_model, family, exporter, attn):
    em = exported_model(family, exporter, attn)
    layers = em.counts["attention"]
    model = onnx.load(str(em.path))
    fused, res = fuse_model(model, dims={d: r["opt"] for d, r in em.dims.items()})
    ops = Counter(n.op_type for n in fused.graph.node)
    gemm_rejects = [r.reason for r in res.rejected if r.op in GEMM_OPS]
    assert not ops["MatMul"] and not ops["Gemm"], gemm_rejects
    assert not ACTIVATION_OPS & set(ops), ops
    rule, act = FFN[family]
    ffn = [a for a in res.accepted if a.rule == rule]
    assert len(ffn) == layers and all(a.rewrite.attrs["activation"] == act for a in ffn)
    assert ops["FlashAttention"] == layers  # attention still fuses everywhere
    packed = [a for a in res.accepted if a.rule == "gemm.siblings"]
    assert len(packed) == (layers if family in PACKED_QKV else 0)
    summary = res.summary["gemm"]["gemms"]
    assert summary["after"] == ops["GemmEpilogue"] + ops["GatedGemm"] < summary["before"] + (family == "gpt2")
    saved = estimate_traffic(fused, res).saved_bytes
    assert all(saved[a.node_name] is not None for a in _gemm(res))
    feeds = em.make_inputs(seed=3)
    for want, got in zip(_run(model, feeds), _run(fused, feeds)):
        assert float(np.max(np.abs(want.astype(np.float64) - got))) <= 1e-4
