"""A stand-in for TensorRT's *native* module, so that the pure-Python ``tensorrt.plugin`` package
(copied from a tensorrt bindings wheel; see tests/test_qdp.py) imports and runs without libnvinfer.

Used two ways by ``test_generated_qdp_functions_pass_tensorrt_plugin``: as ``tensorrt/__init__.py``
of a temporary package (next to the real ``plugin/`` sources), and as a script (``--drive``) that
registers optfuse's generated QDP functions and drives them the way ``_TemplateAOTPlugin`` does:
``register`` for output descs, ``autotune`` for type combinations, ``aot_impl`` for the kernel.
Only symbolic-expression plumbing is faked: an expression builder that computes strings.
"""

__version__ = "11.4.0.106"


class _Meta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _make(name)


_cache = {}


def _make(name):
    if name not in _cache:
        _cache[name] = _Meta(name, (object,), {"__init__": lambda self, *a, **k: None})
    return _cache[name]


class Logger(metaclass=_Meta):
    WARNING = 2

    def __init__(self, *a):
        pass

    def log(self, *a):
        pass


class Dims(metaclass=_Meta):
    MAX_DIMS = 8

    def __init__(self, t=()):
        self.t = (0,) * t if isinstance(t, int) else tuple(t)

    def __iter__(self):
        return iter(self.t)

    def __len__(self):
        return len(self.t)

    def __getitem__(self, i):
        return self.t[i]


class _Registry:
    def __init__(self):
        self.creators = []

    def register_creator(self, c, ns):
        self.creators.append((c, ns))
        return True

    def get_creator(self, name, ver, ns):
        return [c for c, n in self.creators if n == ns][-1]


_reg = _Registry()


def get_plugin_registry():
    return _reg


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _make(name)


def _drive() -> int:
    import tensorrt as trt
    from tensorrt.plugin import _tensor as T
    from tensorrt.plugin._lib import QDP_REGISTRY

    from optfuse.trt import compat, qdp

    be = compat.Backend(name="tensorrt", trt=trt, version=trt.__version__, is_rtx=False, has_qdp_aot=True,
                        has_add_plugin_v3=True, has_plugin_v3=True, has_fp16_flag=False, has_strongly_typed_flag=True)
    print("registered", len(qdp.register_all(be, arch=90)))

    class Expr(trt.IDimensionExpr):
        def __init__(self, v):
            self.v = v

        def is_constant(self):
            return isinstance(self.v, int)

        def get_constant_value(self):
            return self.v

    class Builder:
        def constant(self, v):
            return Expr(v)

        def operation(self, op, a, b):
            return Expr(f"({a.v} {op} {b.v})")

    T.SymIntExpr._exprBuilder = Builder()

    class DT:
        name = "HALF"

    def desc(dims, static):
        t = T.TensorDesc(T.ShapeExprs.from_tuple([T.ShapeExpr(Expr(d)) if isinstance(d, str) else T.ShapeExpr(d) for d in dims]), dtype=DT())
        t._shape = T.Shape(tuple(static))
        return t

    cases = [
        ("LayerNorm", [(("B", "S", 64), (-1, -1, 64)), ((64,), (64,)), ((64,), (64,))], [1e-5]),
        ("SkipRMSNorm", [(("B", "S", 64), (-1, -1, 64))] * 2 + [((64,), (64,))], [1e-6]),
        ("FlashAttention", [(("B", 4, "S", 64), (-1, 4, -1, 64))] + [(("B", 2, "S", 64), (-1, 2, -1, 64))] * 2, [0.125, 1, 4, 2]),
    ]
    # GEMMs: y is [..., N] with N from W's dim 0 (spec last_dim); their aot_impl needs plugins/gemm/launch.py
    from optfuse.spec import plugin_module

    try:
        plugin_module("gemm", "launch")
        gemm_aot = True
    except ModuleNotFoundError:
        gemm_aot = False
    gemm_cases = [
        ("GemmEpilogue", [(("B", "S", 64), (-1, -1, 64)), ((192, 64), (192, 64)), ((192,), (192,)),
                          (("B", "S", 192), (-1, -1, 192))], ["gelu_erf", 1.0, "after_activation"]),
        ("GatedGemm", [(("B", "S", 64), (-1, -1, 64)), ((128, 64), (128, 64)), ((128, 64), (128, 64))], ["silu"]),
    ]
    for op, ins, attrs in gemm_cases:
        d = QDP_REGISTRY["optfuse::" + op]
        descs = [desc(*i) for i in ins]
        out = d.register_func(*descs, **dict(zip(d.input_attrs, attrs)))
        assert len(out.shape_expr) == 3 and out.shape_expr[2] is descs[1].shape_expr[0], out.shape_expr
        assert out.shape_expr[0] is descs[0].shape_expr[0] and descs[0].shape_expr[2] is not descs[1].shape_expr[0]
        print("register ok", op)
        if gemm_aot:
            cases.append((op, ins, attrs))
    for op, ins, attrs in cases:
        d = QDP_REGISTRY["optfuse::" + op]
        descs = [desc(*i) for i in ins]
        outs = d.register_func(*descs, **dict(zip(d.input_attrs, attrs)))
        outs = outs if isinstance(outs, tuple) else (outs,)
        combos = d.autotune_func(*descs, outs)
        assert len(combos) == 3, combos
        name, ptx, lp, extra = d.aot_impl_func(*descs, *attrs, outs, 0)
        assert isinstance(lp, T.KernelLaunchParams) and isinstance(extra, T.SymIntExprs)
        text = ptx.decode() if isinstance(ptx, bytes) else ptx
        assert len(qdp.entry_params(text, name.decode() if isinstance(name, bytes) else name)) >= 3
        print("aot_impl ok", op, name, len(extra))
    return 0


if __name__ == "__main__":
    import sys

    if "--drive" in sys.argv:
        sys.exit(_drive())
