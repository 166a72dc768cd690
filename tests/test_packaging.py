"""Issue 20 item 1: the wheel is the tool. Build it, list it (plugins in, nothing of the working
tree), install it with ``--no-deps`` into a fresh ``--system-site-packages`` venv and drive the
CLI from a folder outside the checkout: ``--version``, ``recipe check``, ``fuse --verify`` of a
small model (the fused model has optfuse nodes), ``kernels build -p rms_norm``."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import onnx
import pytest

import graphs

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # --no-build-isolation: setuptools of this interpreter (CI builds with isolation, see .ci/run)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                        "-q", "-w", str(out)], capture_output=True, text=True, cwd=out)
    assert r.returncode == 0, r.stderr[-3000:]
    (whl,) = out.glob("optfuse-*.whl")
    return whl


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
    """(venv python, env, a work folder outside the checkout)."""
    root = tmp_path_factory.mktemp("venv")
    env_dir = root / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False, symlinks=True).create(env_dir)
    py = env_dir / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["OPTFUSE_CACHE"] = str(root / "cache" / "kernels")
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index",
                        str(wheel)], capture_output=True, text=True, env=env)
    if r.returncode != 0 and "--python" in r.stderr:  # pip < 22.3: no --python
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                            "--prefix", str(env_dir), str(wheel)], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    work = root / "work"
    work.mkdir()
    return py, env, work


def test_wheel_holds_the_plugins_and_nothing_else(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"optfuse", "optfuse_plugins", "optfuse-0.1.0.dist-info"}, tops
    folders = sorted(p.parent.name for p in (ROOT / "plugins").glob("*/spec.yaml"))
    assert folders, "no plugin folders in the checkout"
    for f in folders:
        for part in ("spec.yaml", "reference.py", "launch.py", "__init__.py"):
            assert f"optfuse_plugins/{f}/{part}" in names, (f, part)
    expected = {f"optfuse_plugins/{p.relative_to(ROOT / 'plugins')}" for ext in ("*.cu", "*.cuh")
                for p in (ROOT / "plugins").rglob(ext)}
    assert expected and expected <= set(names), sorted(expected - set(names))
    leaks = [n for n in names if "/test_" in n or n.endswith(("conftest.py", ".pyc", ".md", ".json", ".onnx", ".data"))
             or "__pycache__" in n or "/results/" in n or "optfuse-demo" in n]
    assert not leaks, leaks
    # every optfuse module of the checkout is there, and report.html's template (nothing that is not in the checkout)
    src = {str(p.relative_to(ROOT)) for p in (ROOT / "optfuse").rglob("*.py") if "__pycache__" not in p.parts}
    src |= {str(p.relative_to(ROOT)) for p in (ROOT / "optfuse" / "report" / "templates").glob("*.j2")}
    assert "optfuse/report/templates/report.html.j2" in src
    assert {n for n in names if n.startswith("optfuse/")} == src


def _run(installed, *args, check=True):
    py, env, work = installed
    r = subprocess.run([str(py.parent / "optfuse"), *map(str, args)], capture_output=True, text=True, env=env, cwd=work,
                       timeout=600)
    if check:
        assert r.returncode == 0, f"optfuse {' '.join(map(str, args))}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


def test_installed_wheel_is_the_one_imported(installed):
    py, env, work = installed
    r = subprocess.run([str(py), "-c", "import optfuse, optfuse.plugin_dirs as d, optfuse.spec as s; "
                        "print(optfuse.__file__); print(d.PLUGINS_DIR); print(sorted(s.load_specs()))"],
                       capture_output=True, text=True, env=env, cwd=work)
    assert r.returncode == 0, r.stderr
    mod, plugins, ops = r.stdout.splitlines()
    venv_dir = str(py.parent.parent)
    assert mod.startswith(venv_dir) and plugins.startswith(venv_dir), (mod, plugins)
    assert Path(plugins).name == "optfuse_plugins"
    assert "LayerNorm" in ops and "RMSNorm" in ops


def test_installed_cli_smoke_and_fuse_verify(installed):
    _, _, work = installed
    assert _run(installed, "--version").stdout.strip()
    _run(installed, "recipe", "check", *sorted((ROOT / "recipes").glob("*.yaml")))
    onnx.save(graphs.residual_block(hidden=64, norm="layer_norm", n_layers=2), work / "block.onnx")
    _run(installed, "fuse", "block.onnx", "-o", "block.fused.onnx")
    _run(installed, "fuse", "block.onnx", "-o", "verified.fused.onnx", "--verify")
    for name in ("block.fused.onnx", "verified.fused.onnx"):
        m = onnx.load(str(work / name))
        assert sum(n.domain == "optfuse" for n in m.graph.node) == 4, name  # 2 GemmEpilogue + 2 LayerNorm
    bad = _run(installed, "kernels", "build", "-p", "nosuch", check=False)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_installed_kernels_build(installed):
    pytest.importorskip("triton")
    pytest.importorskip("cuda.bindings")
    r = _run(installed, "kernels", "build", "-p", "rms_norm", "--target", "sm_90", check=False)
    if r.returncode != 0 and "nvrtc" in (r.stderr + r.stdout).lower():
        pytest.skip("no NVRTC in this environment")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "kernels ready" in r.stdout
