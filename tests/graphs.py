"""Small ONNX graphs written by hand, one builder per exporter variant of a fusion.

Each builder returns a ModelProto with input "x" ([2, 8, H] by default, dims named b/s) and one
output "y"; options select the variant (how the exporter spelled each step).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

F32 = TensorProto.FLOAT


class Builder:
    def __init__(self, opset: int = 17):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.opset = opset
        self.n = 0

    def const(self, value, name=None, dtype=np.float32) -> str:
        name = name or f"c{len(self.inits)}"
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def node(self, op, *inputs, out=None, **attrs) -> str:
        self.n += 1
        out = out or f"{op.lower()}_{self.n}"
        self.nodes.append(helper.make_node(op, list(inputs), [out], name=f"{op}_{self.n}", **attrs))
        return out

    def reduce_mean(self, x, axes, out=None):
        if self.opset >= 18:
            return self.node("ReduceMean", x, self.const(np.array(axes, dtype=np.int64), dtype=np.int64), out=out)
        return self.node("ReduceMean", x, axes=list(axes), out=out)

    def model(self, inputs, outputs, elem=F32) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, "g", inputs, outputs, self.inits)
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)])
        m.ir_version = 9
        return m


#: The norm families alone: the GEMM family would take the residual Add of ``residual_block`` (its
#: sum is read again, so the GEMM's epilogue saves more than a SkipNorm; see fusions/gemm/epilogue).
NORM_FAMILIES = ["layer_norm", "rms_norm", "skip_norm"]


def io(name, shape, elem=F32):
    return helper.make_tensor_value_info(name, elem, shape)


def layer_norm(hidden=64, variant="pow_div", opset=17, axes=(-1,), eps=1e-5, affine=True, casts=False,
               extra_output=None, seed=0, shape=None):
    """Decomposed LayerNorm; variant in pow_div, mul_div, pow_reciprocal, pow_div_one (d * (1 / std):
    TorchScript's rsqrt)."""
    rng = np.random.default_rng(seed)
    b = Builder(opset)
    x = "x"
    xs = b.node("Cast", x, to=F32) if casts else x
    mean = b.reduce_mean(xs, axes)
    d = b.node("Sub", xs, mean)
    sq = b.node("Mul", d, d) if variant.startswith("mul") else b.node("Pow", d, b.const(2.0))
    var = b.reduce_mean(sq, axes)
    std = b.node("Sqrt", b.node("Add", var, b.const(eps)))
    if variant.endswith("reciprocal"):
        normed = b.node("Mul", d, b.node("Reciprocal", std))
    elif variant.endswith("div_one"):
        normed = b.node("Mul", d, b.node("Div", b.const(1.0), std))
    else:
        normed = b.node("Div", d, std)
    if casts:
        normed = b.node("Cast", normed, to=F32)
    if affine:
        b.node("Add", b.node("Mul", normed, b.const(rng.standard_normal(hidden))), b.const(rng.standard_normal(hidden)))
    b.nodes[-1].output[0] = "y"
    shape = shape or ["b", "s", hidden]
    outputs = [io("y", shape)]
    if extra_output == "variance":
        outputs.append(io(var, None))
    return b.model([io("x", shape)], outputs)


def rms_norm(hidden=64, variant="reciprocal", opset=17, eps=1e-6, casts=True, gamma_first=True, seed=0):
    """HF LlamaRMSNorm as exported: variant in reciprocal (dynamo), div_one (TorchScript), div."""
    rng = np.random.default_rng(seed)
    b = Builder(opset)
    h = b.node("Cast", "x", to=F32) if casts else "x"
    ms = b.reduce_mean(b.node("Pow", h, b.const(2.0)), (-1,))
    denom = b.node("Sqrt", b.node("Add", ms, b.const(eps)))
    if variant == "reciprocal":
        normed = b.node("Mul", h, b.node("Reciprocal", denom))
    elif variant == "div_one":
        normed = b.node("Mul", h, b.node("Div", b.const(1.0), denom))
    else:
        normed = b.node("Div", h, denom)
    if casts:
        normed = b.node("Cast", normed, to=F32)
    g = b.const(rng.standard_normal(hidden))
    b.node("Mul", g, normed, out="y") if gamma_first else b.node("Mul", normed, g, out="y")
    return b.model([io("x", ["b", "s", hidden])], [io("y", ["b", "s", hidden])])


def residual_block(hidden=64, norm="layer_norm", n_layers=2, seed=0, opset=17):
    """Post-norm residual chain: s_i = x_i + f(x_i); x_{i+1} = Norm(s_i); the sum is read again."""
    rng = np.random.default_rng(seed)
    b = Builder(opset)
    x = "x"
    for _ in range(n_layers):
        w = b.const(rng.standard_normal((hidden, hidden)) / np.sqrt(hidden))
        f = b.node("MatMul", x, w)
        s = b.node("Add", f, x)
        if norm == "layer_norm":
            y = b.node("LayerNormalization", s, b.const(rng.standard_normal(hidden)),
                       b.const(rng.standard_normal(hidden)), axis=-1, epsilon=1e-5)
        else:
            ms = b.reduce_mean(b.node("Pow", s, b.const(2.0)), (-1,))
            r = b.node("Reciprocal", b.node("Sqrt", b.node("Add", ms, b.const(1e-6))))
            y = b.node("Mul", b.node("Mul", s, r), b.const(rng.standard_normal(hidden)))
        # pre-norm style re-use of the sum keeps it alive after the norm
        x = b.node("Add", y, s)
    b.nodes[-1].output[0] = "y"
    return b.model([io("x", ["b", "s", hidden])], [io("y", ["b", "s", hidden])])


def run(model, feeds):
    """Run ``model`` (a ModelProto) in onnxruntime (CPU, warnings off) on the feeds its inputs name."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in feeds.items() if k in names})


def without_metadata(model, key: str):
    """A copy of `model` whose nodes no longer hold the metadata entry `key` (e.g. a fused node's
    optfuse.padded_queries_inexact)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for n in out.graph.node:
        kept = [p for p in n.metadata_props if p.key != key]
        del n.metadata_props[:]
        n.metadata_props.extend(kept)
    return out
