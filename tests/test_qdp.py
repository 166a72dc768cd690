"""The QDP (TensorRT >= 10.9 AOT plugin) code path without TensorRT.

* CPU: :func:`optfuse.trt.qdp.aot_kernel` -- the whole body of every generated ``aot_impl`` --
  returns, for each op, PTX whose entry takes exactly QDP's parameters (inputs, int32 extras,
  outputs) and launch parameters that match it; with symbolic shapes it only uses ``+ - *`` and
  ``cdiv`` and needs the specialized dims static.
* CPU, when ``$OPTFUSE_TRT_PLUGIN_SRC`` names an unpacked ``tensorrt/plugin`` package (from the
  ``tensorrt-cu13-bindings`` wheel; .ci/run provides it): the generated register/autotune/aot_impl
  functions pass tensorrt.plugin's own validators and run through its TensorDesc / ShapeExpr /
  KernelLaunchParams / SymIntExprs types, over a stand-in for the native module (tests/fake_trt).
* GPU (``-m gpu``, H200): the QDP artifacts (PTX only, the exact QDP parameter list) are launched
  through optfuse's launcher -- the only thing TensorRT's runtime does differently is that call --
  and compared with the NumPy reference of each op.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from optfuse.kernels.testing import SymDim, sym_cdiv
from optfuse.trt.qdp import AotKernel, TensorInfo, aot_kernel, entry_params, strip_trailing_params

ROOT = Path(__file__).resolve().parents[1]

# (op, [(dtype, shape)...], attrs, output shapes)
CASES = {
    "LayerNorm": ([(2, 8, 64), (64,), (64,)], {"epsilon": 1e-5}),
    "SkipLayerNorm": ([(2, 8, 64), (2, 8, 64), (64,), (64,)], {"epsilon": 1e-5}),
    "RMSNorm": ([(2, 8, 64), (64,)], {"epsilon": 1e-6}),
    "SkipRMSNorm": ([(2, 8, 64), (2, 8, 64), (64,)], {"epsilon": 1e-6}),
    "FlashAttention": ([(2, 4, 16, 64), (2, 2, 16, 64), (2, 2, 16, 64)],
                       {"scale": 0.125, "causal": 0, "num_heads": 4, "num_kv_heads": 2}),
    "FlashAttention+bias": ([(2, 4, 16, 64), (2, 2, 16, 64), (2, 2, 16, 64), (2, 1, 1, 16)],
                            {"scale": 0.125, "causal": 1, "num_heads": 4, "num_kv_heads": 2}),
}


@pytest.fixture(autouse=True)
def _kernel_cache(tmp_path_factory, monkeypatch):
    # one cache for the session: compiles once per kernel
    root = os.environ.get("OPTFUSE_CACHE") or str(tmp_path_factory.getbasetemp() / "kcache")
    monkeypatch.setenv("OPTFUSE_CACHE", root)


def _op(case: str) -> str:
    return case.split("+")[0]


def _infos(case: str, dtype: str) -> list[TensorInfo]:
    shapes, _ = CASES[case]
    return [TensorInfo(dtype, s) for s in shapes]


@pytest.mark.parametrize("case", list(CASES))
def test_aot_kernel_returns_qdp_kernel(case):
    shapes, attrs = CASES[case]
    ak = aot_kernel(_op(case), _infos(case, "float16"), attrs, 0, arch=89)
    assert isinstance(ak, AotKernel)
    name, ptx, launch, extra = ak  # unpacks as QDP's 4-tuple
    art = ak.artifact
    params = entry_params(ptx, name)
    assert len(params) == art.n_inputs + art.n_extra + art.n_outputs, params
    assert art.n_inputs == len(shapes) or _op(case) == "FlashAttention"
    assert art.cubin is None and art.n_scratch == 0 and ".target sm_89" in ptx
    assert all(isinstance(v, int) and v >= 1 for v in launch.grid)
    assert int(np.prod(launch.block)) == art.threads
    assert len(extra) == art.n_extra and all(isinstance(v, int) and -(2**31) <= v < 2**31 for v in extra)
    # scalar extras are PTX .u32/.s32 params placed between the input and output pointers
    decl = re.search(rf"\.entry\s+{re.escape(name)}\s*\(([^)]*)\)", ptx).group(1).split(",")
    kinds = ["ptr" if ".ptr" in d or ".u64" in d else "int" for d in decl]
    assert kinds == ["ptr"] * art.n_inputs + ["int"] * art.n_extra + ["ptr"] * art.n_outputs


def test_aot_kernel_symbolic_shapes():
    B, S = SymDim("B"), SymDim("S")
    infos = [TensorInfo("float16", (B, S, 64), (-1, -1, 64)), TensorInfo("float16", (64,)), TensorInfo("float16", (64,))]
    ak = aot_kernel("LayerNorm", infos, {"epsilon": 1e-5}, 0, arch=90, cdiv=sym_cdiv)
    assert isinstance(ak.launch.grid[0], SymDim) and "cdiv((B*S)" in ak.launch.grid[0].e
    assert isinstance(ak.extra_args[0], SymDim) and ak.extra_args[0].e == "(B*S)"
    assert ak.launch.block[0] == ak.artifact.threads

    H = SymDim("H")
    q = TensorInfo("float16", (B, 4, S, 64), (-1, 4, -1, 64))
    kv = TensorInfo("float16", (B, 2, S, 64), (-1, 2, -1, 64))
    ak = aot_kernel("FlashAttention", [q, kv, kv], CASES["FlashAttention"][1], 0, arch=90, cdiv=sym_cdiv)
    assert [type(e) for e in ak.extra_args].count(SymDim) >= 2  # Sq, Sk are runtime values
    # sm_90 gets the CUDA (sm_90a) kernel: persistent grid, num_tiles as a fifth extra argument
    assert ak.artifact.arch_suffix == "a" and ak.artifact.n_extra == 5
    # D = 64 without a mask: three consumer warpgroups, 192-row tiles, 512 threads
    assert ak.launch.grid[0] == 132 and "cdiv(S,192)" in ak.extra_args[4].e
    assert ak.launch.block[0] == ak.artifact.threads == 512
    ak89 = aot_kernel("FlashAttention", [q, kv, kv], CASES["FlashAttention"][1], 0, arch=89, cdiv=sym_cdiv)
    assert ak89.artifact.arch_suffix == "" and ak89.artifact.n_extra == 4  # the Triton kernel

    dyn = [TensorInfo("float16", (B, S, H), (-1, -1, -1)), TensorInfo("float16", (H,), (-1,)), TensorInfo("float16", (H,), (-1,))]
    with pytest.raises(ValueError, match="must be static"):
        aot_kernel("LayerNorm", dyn, {"epsilon": 1e-5}, 0, arch=90, cdiv=sym_cdiv)


def test_float_attributes_are_compiled_in():
    a = aot_kernel("LayerNorm", _infos("LayerNorm", "float32"), {"epsilon": 1e-5}, arch=89)
    b = aot_kernel("LayerNorm", _infos("LayerNorm", "float32"), {"epsilon": 1e-3}, arch=89)
    assert a.image != b.image and a.extra_args == b.extra_args  # epsilon is not a kernel argument


PTX = """
.visible .entry k(
\t.param .u64 .ptr .global .align 1 k_param_0,
\t.param .u32 k_param_1,
\t.param .u64 .ptr .global .align 1 k_param_2,
\t.param .u64 .ptr .global .align 1 k_param_3,
\t.param .u64 .ptr .global .align 1 k_param_4
)
{
\tld.param.u64 %rd1, [k_param_0];
\tld.param.u32 %r1, [k_param_1];
\tld.param.u64 %rd2, [k_param_2];
}
"""


def test_strip_trailing_scratch_params():
    out = strip_trailing_params(PTX, "k", 2)
    assert entry_params(out, "k") == ["k_param_0", "k_param_1", "k_param_2"]
    assert "k_param_3" not in out and "ld.param.u64 %rd2, [k_param_2];" in out
    with pytest.raises(ValueError, match="used by the kernel"):
        strip_trailing_params(PTX, "k", 3)


# ------------------------------------------------------------------------------------------------
# tensorrt.plugin's own code over a stand-in native module
# ------------------------------------------------------------------------------------------------
def _plugin_src() -> Path | None:
    src = os.environ.get("OPTFUSE_TRT_PLUGIN_SRC")
    if not src:
        return None
    p = Path(src)
    return p if (p / "_lib.py").is_file() else None


@pytest.mark.skipif(_plugin_src() is None, reason="$OPTFUSE_TRT_PLUGIN_SRC (tensorrt/plugin sources) not set")
def test_generated_qdp_functions_pass_tensorrt_plugin(tmp_path):
    """Registers every spec through the real tensorrt.plugin package and drives aot_impl through
    its TensorDesc/ShapeExpr/KernelLaunchParams types (in a child: it installs a fake 'tensorrt')."""
    pkg = tmp_path / "tensorrt"
    pkg.mkdir()
    (pkg / "__init__.py").write_text((ROOT / "tests" / "fake_trt.py").read_text())
    os.symlink(_plugin_src(), pkg / "plugin")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "fake_trt.py"), "--drive"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from optfuse.spec import load_specs

    assert f"registered {len(load_specs())}" in proc.stdout and proc.stdout.count("aot_impl ok") >= 3, proc.stdout
    assert proc.stdout.count("register ok") == 2, proc.stdout  # the GEMMs' [..., N] outputs


def _fake_trtp(monkeypatch):
    """A stand-in ``<trt>.plugin`` module recording what register_spec registers."""
    import types

    pkg = types.ModuleType("fake_trt_for_qdp")
    mod = types.ModuleType("fake_trt_for_qdp.plugin")
    mod.registered = {}

    class AutoTuneCombination:
        def __init__(self, types_, layouts):
            self.types, self.layouts = types_, layouts

    def decorator(kind):
        return lambda pid: (lambda fn: mod.registered.setdefault(pid, {}).__setitem__(kind, fn) or fn)

    mod.TensorDesc, mod.AutoTuneCombination, mod.KernelLaunchParams, mod.SymIntExprs = object, AutoTuneCombination, object, object
    mod.register, mod.autotune, mod.aot_impl = decorator("register"), decorator("autotune"), decorator("aot_impl")
    mod.cdiv = lambda a, b: -(-a // b)
    monkeypatch.setitem(sys.modules, pkg.__name__, pkg)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return types.SimpleNamespace(trt=pkg), mod


def test_autotune_types_keep_the_int32_layout(monkeypatch):
    """BlockSparseAttention's block_offsets / block_indices are int32 in every type combination;
    the float tensors take each float dtype of the spec. FlashAttention with all its inputs is the
    FP8 form: E4M3 q, k, v, float32 scales, o (and the bias) in each output_dtype."""
    from optfuse.spec import get_spec
    from optfuse.trt import qdp

    be, mod = _fake_trtp(monkeypatch)
    want = {"float32": "FP32", "float16": "FP16", "bfloat16": "BF16"}
    for op in ("BlockSparseAttention", "FlashAttention"):
        spec = get_spec(op)
        pid = qdp.register_spec(be, spec, 90)
        n_in = len(spec.inputs)
        combos = mod.registered[pid]["autotune"](*[None] * n_in, [None])
        if op == "FlashAttention":
            expected = [", ".join(["FP8"] * 3 + [want[o]] + ["FP32"] * 3 + [want[o]])
                        for o in ("float16", "bfloat16", "float32")]
        else:
            expected = [", ".join(["INT32" if list(t.dtypes) == ["int32"] else want[d] for t in spec.inputs] + [want[d]])
                        for d in spec.inputs[0].dtypes]
        assert [c.types for c in combos] == expected
        assert all(c.layouts == "LINEAR" for c in combos)
    spec = get_spec("BlockSparseAttention")
    assert [t.name for t in spec.inputs if list(t.dtypes) == ["int32"]] == ["block_offsets", "block_indices"]


def test_register_with_real_tensorrt_plugin():
    """On a machine with TensorRT >= 10.9 (none here), the real registration."""
    from optfuse.trt import compat

    if compat.resolve_backend("auto") != "tensorrt":
        pytest.skip("standard TensorRT is not installed")
    be = compat.load("tensorrt")
    if not be.has_qdp_aot:
        pytest.skip(f"{be.label} has no AOT QDP")
    from optfuse.trt import qdp

    from optfuse.spec import load_specs

    assert len(qdp.register_all(be, arch=90)) == len(load_specs())


# ------------------------------------------------------------------------------------------------
# GPU: the QDP artifacts through the launcher, against the NumPy references
# ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("case", list(CASES))
def test_qdp_artifacts_on_gpu(case, dtype):
    from optfuse.kernels import launcher
    from optfuse.kernels.testing import gpu_run, np_dtype
    from optfuse.spec import get_spec, plugin_module

    try:
        arch = launcher.current_device_arch()
    except Exception as exc:  # no driver / no GPU
        pytest.skip(f"no CUDA device: {exc}")
    op = _op(case)
    shapes, attrs = CASES[case]
    spec = get_spec(op)
    rng = np.random.default_rng(0)
    ins = [rng.standard_normal(s).astype(np_dtype(dtype)) for s in shapes]
    ak = aot_kernel(op, _infos(case, dtype), attrs, 0, arch=arch)
    art = ak.artifact
    assert art.cubin is None  # TensorRT gets PTX: launch exactly that
    inputs = list(ins) + [None] * (len(spec.inputs) - len(ins))
    inputs = inputs[: art.n_inputs]
    outs = gpu_run(art, ak.launch, inputs, [(ins[0].shape, ins[0].dtype)] * len(spec.outputs), prefer="ptx")
    full_attrs = {a.name: a.default for a in spec.attributes if a.default is not None} | attrs
    ref = plugin_module(spec.folder, "reference").reference(op, list(ins) + [None] * (len(spec.inputs) - len(ins)), full_attrs)
    tol = {"float16": 2e-2, "float32": 1e-4}[dtype]
    for o, r in zip(outs, ref):
        err = float(np.abs(o.astype(np.float64) - r.astype(np.float64)).max())
        assert np.isfinite(o.astype(np.float64)).all() and err <= tol * max(1.0, float(np.abs(r.astype(np.float64)).max())), (case, err)
