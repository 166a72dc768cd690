"""Shared fixtures of the plugin tests. GPU tests are marked ``@pytest.mark.gpu`` (deselected by
default; run with ``-m gpu`` on a machine with a CUDA GPU) and take the ``cuda_torch`` fixture,
which skips them when torch or a GPU is missing. ``stub_cuda`` and ``classic_plugin`` run the
classic TensorRT plugin's enqueue on the CPU (compile and CUDA stubbed out)."""

import types

import pytest


@pytest.fixture(scope="session")
def cuda_torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    return torch


def _fake_artifact(src, arch=None, cache=None):
    """A KernelArtifact of ``src`` without code (what the stubbed build returns)."""
    from optfuse.kernels.artifact import KernelArtifact

    threads = src.threads if src.lang == "cuda" else 32 * src.num_warps
    return KernelArtifact(name=src.entry, arch=90, cubin=None, ptx=None, threads=threads, shared_mem=0,
                          n_inputs=src.n_inputs, n_extra=src.n_extra, n_outputs=src.n_outputs)


@pytest.fixture
def fake_artifact():
    """``make(source)``: the KernelArtifact the stubbed build returns for a KernelSource."""
    return _fake_artifact


@pytest.fixture
def stub_cuda(monkeypatch):
    """build_kernel -> a KernelArtifact without code; launcher.launch records (entry, params, inputs, outputs)."""
    import optfuse.kernels as kernels
    from optfuse.kernels import launcher

    calls = []
    monkeypatch.setattr(kernels, "build_kernel", _fake_artifact)
    monkeypatch.setattr(launcher, "launch", lambda art, params, ins, outs, stream=0, **kw:
                        calls.append((art.name, params, list(ins), list(outs))))
    monkeypatch.setattr(launcher, "current_device_arch", lambda: 90)
    return calls


@pytest.fixture
def classic_plugin():
    """``make(op, attrs)``: the classic IPluginV3 plugin of ``op`` over stand-in TensorRT bases."""
    from optfuse.spec import get_spec
    from optfuse.trt import plugins

    bases = {name: type(name, (), {"__init__": lambda self, *a, **k: None})
             for name in ("IPluginV3", "IPluginV3OneCore", "IPluginV3OneBuild", "IPluginV3OneRuntime")}
    fake = types.SimpleNamespace(**bases, DimsExprs=list)
    return lambda op, attrs: plugins._plugin_class(fake, get_spec(op))(attrs)
