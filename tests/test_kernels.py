"""optfuse.kernels: targets, artifacts, the cache, PTX fitting, the registry and the CLI (CPU).

``test_every_kernel_compiles`` is the CI gate: every plugin kernel's prebuild set compiles for
sm_80 and sm_90 on a machine without a GPU.
"""

from __future__ import annotations

import os
import sys

import pytest

from optfuse.kernels import KernelArtifact, KernelCache, LaunchParams, arch_name, cdiv, parse_arch
from optfuse.kernels.launcher import fit_ptx_to_driver, max_ptx_isa
from optfuse.kernels.target import default_arch
from optfuse.kernels.util import norm_dtype, rows_of, static_int


@pytest.mark.parametrize("text,cc", [("sm_90", 90), ("90", 90), ("sm80", 80), ("8.6", 86), ("compute_89", 89), (90, 90), ("sm_90a", 90)])
def test_parse_arch(text, cc):
    assert parse_arch(text) == cc
    assert arch_name(cc) == f"sm_{cc}"


@pytest.mark.parametrize("bad", ["sm_x", "", "sm_900", 5])
def test_parse_arch_rejects(bad):
    with pytest.raises(ValueError):
        parse_arch(bad)


def test_default_arch(monkeypatch):
    monkeypatch.setenv("OPTFUSE_ARCH", "sm_86")
    assert default_arch() == 86
    monkeypatch.delenv("OPTFUSE_ARCH")
    from optfuse.kernels import target

    monkeypatch.setattr(target, "detect_arch", lambda: None)
    assert default_arch() == 90


def test_helpers():
    assert cdiv(10, 4) == 3 and cdiv(8, 4) == 2
    assert rows_of([2, 3, 768]) == 6 and rows_of([768]) == 1
    assert static_int(768) == 768
    for s in ("float16", "fp16", "torch.float16", "half"):
        assert norm_dtype(s) == "float16"
    assert norm_dtype("torch.bfloat16") == "bfloat16"
    with pytest.raises(ValueError):
        norm_dtype("int8")


def test_fit_ptx_to_driver():
    ptx = "//\n.version 9.4\n.target sm_90a\n.address_size 64\n"
    assert max_ptx_isa(13000) == 90 and max_ptx_isa(12080) == 87 and max_ptx_isa(12040) == 84
    assert ".version 9.0\n" in fit_ptx_to_driver(ptx, 13000)
    assert ".version 8.7\n" in fit_ptx_to_driver(ptx, 12080)
    assert fit_ptx_to_driver(ptx, 13050) == ptx  # new enough: untouched
    low = ptx.replace("9.4", "8.0")
    assert fit_ptx_to_driver(low, 12040) == low


def test_artifact_save_load(tmp_path):
    art = KernelArtifact(
        name="k", arch=90, cubin=b"\x7fELFxyz", ptx=".version 8.7\n", threads=128, shared_mem=70000,
        n_inputs=2, n_extra=1, n_outputs=1, n_scratch=2, key="abc", metadata={"op": "X"},
    )
    d = art.save(tmp_path / "a")
    back = KernelArtifact.load(d)
    assert back == art and back.n_params == 6
    art.save(tmp_path / "a")  # saving the same key again keeps a valid entry
    assert KernelArtifact.load(d) == art


def test_artifact_keeps_its_tensor_maps(tmp_path):
    from dataclasses import asdict

    from optfuse.kernels.artifact import TensorMapArg

    maps = [asdict(TensorMapArg(0, "float16", "extra:0", 768, 128, 64)), asdict(TensorMapArg(1, "bfloat16", 512, 768, 128, 64, pair=2))]
    art = KernelArtifact(name="k", arch=90, cubin=b"x", ptx=None, threads=384, shared_mem=0, n_inputs=3, n_extra=1,
                         n_outputs=1, tensor_maps=maps)
    back = KernelArtifact.load(art.save(tmp_path / "a"))
    assert back == art and back.n_params == 7
    assert back.tensor_map_args == (TensorMapArg(0, "float16", "extra:0", 768, 128, 64),
                                    TensorMapArg(1, "bfloat16", 512, 768, 128, 64, pair=2))


def test_tensor_map_args_are_checked():
    from optfuse.kernels import KernelSource
    from optfuse.kernels.artifact import TensorMapArg

    for bad in (dict(dtype="float32"), dict(rows="M"), dict(box_cols=32), dict(cols="extra:1+1"),
                dict(heads="extra:0*"), dict(heads=2, pair=1), dict(row_align=0)):
        with pytest.raises(ValueError):
            TensorMapArg(**{**dict(pointer=0, dtype="float16", rows="extra:0", cols=64, box_rows=128, box_cols=64), **bad})
    assert TensorMapArg(0, "uint8", 64, 256, 128, 128).box_cols == 128
    # the artifact keeps heads and row_align only where set: maps without them keep their keys
    assert TensorMapArg(0, "float16", 64, 64, 64, 64).spec() == dict(
        pointer=0, dtype="float16", rows=64, cols=64, box_rows=64, box_cols=64, pair=None)
    assert TensorMapArg(0, "uint8", 128, "extra:3", 128, 128, heads="extra:5*extra:1", row_align=16).spec()[
        "heads"] == "extra:5*extra:1"
    with pytest.raises(ValueError, match="CUDA kernels"):
        KernelSource("t", "triton", __file__, "k", 1, 0, 1, tensor_maps=(TensorMapArg(0, "float16", 64, 64, 64, 64),))
    # the cache key: unchanged without maps, and telling maps apart
    plain = KernelSource("c", "cuda", __file__, "k", 2, 1, 1, threads=128)
    one = KernelSource("c", "cuda", __file__, "k", 2, 1, 1, threads=128,
                       tensor_maps=(TensorMapArg(0, "float16", "extra:0", 64, 128, 64),))
    other = KernelSource("c", "cuda", __file__, "k", 2, 1, 1, threads=128,
                         tensor_maps=(TensorMapArg(0, "float16", "extra:0", 64, 64, 64),))
    assert "tensor_maps" not in plain.spec_dict()
    assert len({str(plain.spec_dict()), str(one.spec_dict()), str(other.spec_dict())}) == 3


def test_tensor_map_layout():
    """What cuTensorMapEncodeTiled gets: dims and box innermost first, byte strides of the outer dims;
    rows from an extra argument; a pair from the lower address, its third stride the distance."""
    from optfuse.kernels.artifact import TensorMapArg
    from optfuse.kernels.launcher import tensor_map_layout

    a = TensorMapArg(0, "float16", "extra:0", 768, 128, 64)
    assert tensor_map_layout(a, [0x1000, 0x9000], [512]) == (0x1000, (768, 512), (1536,), (64, 128))
    e4m3 = TensorMapArg(0, "uint8", "extra:0", 3072, 128, 128)
    assert tensor_map_layout(e4m3, [0x2000], [5]) == (0x2000, (3072, 5), (3072,), (128, 128))
    w = TensorMapArg(1, "bfloat16", 11008, 4096, 128, 64, pair=2)
    lo, hi = 0x100000, 0x100000 + 11008 * 4096 * 2 + 512
    assert tensor_map_layout(w, [0, lo, hi], [7]) == (lo, (4096, 11008, 2), (8192, hi - lo), (64, 128, 1))
    assert tensor_map_layout(w, [0, hi, lo], [7]) == (lo, (4096, 11008, 2), (8192, hi - lo), (64, 128, 1))
    assert tensor_map_layout(w, [0, lo, lo], [7])[2] == (8192, 11008 * 4096 * 2)  # one matrix as both
    assert tensor_map_layout({"pointer": 0, "dtype": "float16", "rows": 4, "cols": 64, "box_rows": 4, "box_cols": 64,
                              "pair": None}, [0x40], []) == (0x40, (64, 4), (128,), (64, 4))
    # heads: a third dimension of whole matrices, its extent a product of extra arguments
    q = TensorMapArg(0, "bfloat16", "extra:2", 128, 64, 64, heads="extra:5*extra:0")
    assert tensor_map_layout(q, [0x1000], [12, 4, 300, 517, 99, 2]) == (
        0x1000, (128, 300, 24), (256, 300 * 256), (64, 64, 1))
    # FP8's V^T: the keys are the columns (Sk of them), rows padded to 16 bytes (Skv)
    vt = TensorMapArg(2, "uint8", 128, "extra:3", 128, 128, heads="extra:5*extra:1", row_align=16)
    assert tensor_map_layout(vt, [0, 0, 0x4000], [8, 2, 300, 517, 99, 3]) == (
        0x4000, (517, 128, 6), (528, 128 * 528), (128, 128, 1))
    for ptrs, extra, arg in (([0x1008], [512], a), ([0x1000], [0], a), ([0, 0, 0x4000], [1, 1, 1, 0, 1, 1], vt),
                             ([0x1000], [8], TensorMapArg(0, "float16", "extra:0", 100, 128, 64)),
                             ([0, lo, lo + 8], [7], w)):
        with pytest.raises(ValueError, match="16-byte multiples"):
            tensor_map_layout(arg, ptrs, extra)
    with pytest.raises(ValueError, match="16-byte multiples"):  # 517 bytes a row without the padding
        tensor_map_layout(TensorMapArg(2, "uint8", 128, "extra:3", 128, 128), [0, 0, 0x4000], [8, 2, 300, 517])


def test_launch_params_defaults():
    p = LaunchParams(grid=(4, 1, 1), block=(128, 1, 1))
    assert p.shared_mem == 0 and p.extra_args == []


def test_launcher_module_imports_without_torch():
    """The launcher and the kernel modules never import torch."""
    code = (
        "import sys; import optfuse.kernels.launcher, optfuse.kernels.cache, optfuse.kernels.triton_aot, "
        "optfuse.kernels.nvrtc, optfuse.kernels.device, optfuse.kernels.testing;"
        "from optfuse.kernels.registry import plugin_module;"
        "[plugin_module(f, m) for f in ('layer_norm', 'rms_norm') for m in ('launch', 'reference')];"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'pydantic')]; assert not bad, bad"
    )
    import subprocess

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_registry_lists_norm_kernels():
    from optfuse.kernels.registry import all_sources, plugin_folders

    assert {"layer_norm", "rms_norm"} <= set(plugin_folders())
    names = [s.name for s in all_sources(["layer_norm", "rms_norm"])]
    for op in ("LayerNorm", "SkipLayerNorm", "RMSNorm", "SkipRMSNorm"):
        assert any(f"/{op}/" in n for n in names)


def test_script_module_imports_a_script_once():
    from optfuse.plugin_dirs import script_module

    bench = script_module("bench_attention")
    assert script_module("bench_attention") is bench and callable(bench.parse_variants)
    with pytest.raises(ImportError, match="no script"):
        script_module("no_such_script")


def test_cuda_source_inlines_local_includes(tmp_path):
    """A CUDA source's ``#include "relative"`` files are inlined (once each) into the text the
    compiler gets and the cache key hashes, so editing a shared header rebuilds its kernels."""
    from optfuse.kernels import KernelSource

    (tmp_path / "common").mkdir()
    (tmp_path / "op").mkdir()
    head = tmp_path / "common" / "h.cuh"
    head.write_text("#define FROM_HEADER 1\n")
    (tmp_path / "op" / "k.cu").write_text('#include "../common/h.cuh"  // a comment\n'
                                          '#include "../common/h.cuh"\n#include <cstdint>\nint x = FROM_HEADER;\n')

    def src(path, lang="cuda"):
        return KernelSource(name="t", lang=lang, path=str(path), entry="k", n_inputs=0, n_extra=0, n_outputs=0)

    text = src(tmp_path / "op" / "k.cu").source_text()
    assert text.count("#define FROM_HEADER 1") == 1 and "already included" in text
    assert "#include <cstdint>" in text  # system headers are the compiler's business
    key = src(tmp_path / "op" / "k.cu").spec_dict()["source_sha256"]
    head.write_text("#define FROM_HEADER 2\n")
    assert src(tmp_path / "op" / "k.cu").spec_dict()["source_sha256"] != key
    # a header reached twice through different files is still inlined once (one include guard per
    # translation unit)
    (tmp_path / "common" / "b.cuh").write_text('#include "h.cuh"\n')
    (tmp_path / "op" / "diamond.cu").write_text('#include "../common/b.cuh"\n#include "../common/h.cuh"\n')
    assert src(tmp_path / "op" / "diamond.cu").source_text().count("#define FROM_HEADER") == 1
    (tmp_path / "op" / "missing.cu").write_text('#include "nope.cuh"\n')
    with pytest.raises(FileNotFoundError, match="nope.cuh"):
        src(tmp_path / "op" / "missing.cu").source_text()
    (tmp_path / "a.cuh").write_text('#include "b.cuh"\n')
    (tmp_path / "b.cuh").write_text('#include "a.cuh"\n')
    with pytest.raises(ValueError, match="cycle"):
        src(tmp_path / "a.cuh").source_text()
    py = tmp_path / "k.py"
    py.write_text('# #include "nope.cuh"\n')
    assert src(py, "triton").source_text() == py.read_text()  # Triton sources are read as they are


def test_nvrtc_leaves_shared_bytes_alone(tmp_path):
    """NVRTC writes into the buffers it is given: with a clean compile its log is one NUL byte,
    and a `b" " * 1` buffer would be CPython's shared b" " itself (which then reads b"\\x00" in the
    whole process: `import torch` failed on the H200 after an in-process compile)."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from optfuse.kernels import KernelSource
    from optfuse.kernels.nvrtc import _compile_nvrtc

    (tmp_path / "k.cu").write_text('extern "C" __global__ void k(int* p) { *p = 1; }\n')
    src = KernelSource(name="k", lang="cuda", path=str(tmp_path / "k.cu"), entry="k", n_inputs=0, n_extra=0,
                       n_outputs=1, threads=32)
    cubin, ptx = _compile_nvrtc(src, 90)
    assert cubin[:4] == b"\x7fELF" and ".entry k(" in ptx and isinstance(cubin, bytes)
    space = bytes([32])
    assert (space * 1)[0] == 32 and eval('b" "') == space


def test_every_kernel_compiles(tmp_path, monkeypatch):
    """CI gate: ``optfuse kernels build --target sm_80,sm_90`` compiles every plugin kernel
    (no GPU), then ``list`` shows them; a second build is served from the cache."""
    from typer.testing import CliRunner

    from optfuse.cli.kernels import kernels_app
    from optfuse.kernels.registry import all_sources

    monkeypatch.setenv("OPTFUSE_CACHE", str(tmp_path))
    runner = CliRunner()
    r = runner.invoke(kernels_app, ["build", "--target", "sm_80,sm_90", "--jobs", str(min(8, os.cpu_count() or 1))])
    assert r.exit_code == 0, r.output + repr(r.exception)
    # per arch: a plugin may add arch-specific kernels (the FP8 GEMMs need sm_89 or later)
    n80, n90 = len(all_sources(arch=80)), len(all_sources(arch=90))
    entries = list(KernelCache(tmp_path).entries())
    assert len(entries) == n80 + n90
    assert {m["arch"] for _, m in entries} == {80, 90}
    assert all(m["has_cubin"] and m["has_ptx"] for _, m in entries)
    r = runner.invoke(kernels_app, ["list", "--target", "sm_90"])
    assert r.exit_code == 0 and f"{n90} kernels" in r.output and "rms_norm_fwd" in r.output
    import optfuse.kernels.cache as cache_mod

    monkeypatch.setattr(cache_mod, "compile_source", lambda *a: (_ for _ in ()).throw(AssertionError("recompiled")))
    r = runner.invoke(kernels_app, ["build", "--target", "90", "--jobs", "1"])
    assert r.exit_code == 0, r.output


def test_python_m_entry_point(tmp_path):
    import subprocess

    env = dict(os.environ, OPTFUSE_CACHE=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "optfuse", "kernels", "list"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "0 kernels" in r.stdout, r.stderr


def test_device_state_is_zeroed_grown_and_freed(monkeypatch):
    """launcher.DeviceState (a plan's state): allocated and zeroed (then synchronized: the memset
    is on the legacy stream) on first need, kept while big enough, reallocated and zeroed to grow,
    freed with the object."""
    driver = pytest.importorskip("cuda.bindings.driver")
    from optfuse.kernels import launcher

    ok = driver.CUresult.CUDA_SUCCESS
    calls = []
    monkeypatch.setattr(launcher, "ensure_context", lambda: None)
    monkeypatch.setattr(driver, "cuMemAlloc", lambda n: (calls.append(("alloc", n)), (ok, 0x1000 * len(calls)))[1])
    monkeypatch.setattr(driver, "cuMemsetD8", lambda p, v, n: (calls.append(("memset", int(p), v, n)), (ok,))[1])
    monkeypatch.setattr(driver, "cuCtxSynchronize", lambda: (calls.append(("sync",)), (ok,))[1])
    monkeypatch.setattr(driver, "cuMemFree", lambda p: (calls.append(("free", int(p))), (ok,))[1])
    state = launcher.DeviceState()
    assert state.ensure(0) == 0 and calls == []
    assert state.ensure(256) == 0x1000
    assert calls == [("alloc", 256), ("memset", 0x1000, 0, 256), ("sync",)]
    assert state.ensure(200) == 0x1000 and len(calls) == 3  # big enough: kept
    assert state.ensure(512) == 0x5000
    assert calls[3:] == [("free", 0x1000), ("alloc", 512), ("memset", 0x5000, 0, 512), ("sync",)]
    del state
    assert calls[-1] == ("free", 0x5000)
