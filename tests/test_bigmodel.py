"""Big models in bounded memory: fusing and verifying a model with > 2 GB of external data.

The model is written at test time: a residual chain of RMSNorm + MatMul layers whose weight
matrices live in one sparse (zero-filled) external data file, so making it costs no time and no
memory. Each flow runs as a child process; its peak RSS (``ru_maxrss`` from os.wait4) is held to
a fraction of the weights' size.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from graphs import Builder, io

REPO = Path(__file__).resolve().parent.parent
HIDDEN = 4096
LAYERS = 33  # 33 x 4096 x 4096 x 4 bytes = 2.21 GB


def big_model(folder: Path, hidden: int = HIDDEN, layers: int = LAYERS) -> tuple[Path, int]:
    """(model path, bytes of external weights): x -> [RMSNorm -> MatMul W_i -> + residual] x layers -> RMSNorm."""
    b = Builder(17)
    data_name = "big.onnx.data"
    x = "x"
    weights = []
    for i in range(layers):
        normed = _rms_norm(b, x, hidden, seed=i)
        w = TensorProto(name=f"w{i}", data_type=TensorProto.FLOAT, dims=[hidden, hidden])
        weights.append(w)
        x = b.node("Add", x, b.node("MatMul", normed, w.name))
    _rms_norm(b, x, hidden, seed=layers, out="y")
    model = b.model([io("x", ["b", "s", hidden])], [io("y", ["b", "s", hidden])])
    size = hidden * hidden * 4
    for i, w in enumerate(weights):
        for key, value in (("location", data_name), ("offset", str(i * size)), ("length", str(size))):
            entry = w.external_data.add()
            entry.key, entry.value = key, value
        w.data_location = TensorProto.EXTERNAL
    model.graph.initializer.extend(weights)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / data_name, "wb") as f:
        f.truncate(layers * size)  # sparse: zeros, no blocks written
    path = folder / "big.onnx"
    path.write_bytes(model.SerializeToString())
    return path, layers * size


def _rms_norm(b: Builder, x: str, hidden: int, seed: int, out: str | None = None) -> str:
    ms = b.reduce_mean(b.node("Pow", x, b.const(2.0)), (-1,))
    inv = b.node("Reciprocal", b.node("Sqrt", b.node("Add", ms, b.const(1e-6))))
    gamma = b.const(np.random.default_rng(seed).standard_normal(hidden))
    return b.node("Mul", gamma, b.node("Mul", x, inv), out=out)


def _peak_rss(cmd: list[str]) -> tuple[int, int, str]:
    """(exit code, peak RSS bytes, stderr) of `cmd` run as one child process."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    err = proc.stderr.read().decode(errors="replace")
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_maxrss * 1024, err


def test_small_big_model_fuses_like_in_memory(tmp_path):
    """The builder's graph (at a small size, weights still on disk) fuses: every MatMul with its
    residual Add into a GemmEpilogue (its weight transposed on export), every norm into an RMSNorm,
    and verifies."""
    from optfuse.pipeline import fuse

    path, _ = big_model(tmp_path / "m", hidden=256, layers=3)
    out = fuse(path, tmp_path / "o" / "big.fused.onnx", verify_after=True, iterations=1)
    counts = {k: v for k, v in out.report["counts"].items() if v}
    assert counts == {"GemmEpilogue": 3, "RMSNorm": 4}, counts
    assert out.verification is not None and out.verification.passed


@pytest.mark.slow
def test_fuse_and_verify_over_2gb_in_bounded_memory(tmp_path):
    folder = tmp_path / "big"
    try:
        path, weights = big_model(folder)
        assert weights > 2 * 1024**3
        fused = folder / "out" / "big.fused.onnx"
        rc, rss, err = _peak_rss([sys.executable, "-m", "optfuse", "fuse", str(path), "-o", str(fused)])
        assert rc == 0, err
        assert rss <= 1.0 * weights, f"fuse peaked at {rss / 1e9:.2f} GB for {weights / 1e9:.2f} GB of weights"
        report = json.loads((fused.parent / "big.fusion_report.json").read_text())
        assert {k: v for k, v in report["counts"].items() if v} == {"GemmEpilogue": LAYERS, "RMSNorm": LAYERS + 1}
        data = fused.parent / "big.fused.onnx.data"
        assert data.stat().st_size >= weights
        proto = onnx.load(str(fused), load_external_data=False)
        external = {t.name for t in proto.graph.initializer if t.data_location == TensorProto.EXTERNAL}
        gemm_weights = {n.input[1] for n in proto.graph.node if n.op_type == "GemmEpilogue"}
        assert len(gemm_weights) == LAYERS and gemm_weights <= external  # the [N, K] weights, streamed out
        shutil.rmtree(fused.parent)

        rc, rss, err = _peak_rss([sys.executable, "-m", "optfuse", "fuse", str(path), "-o", str(fused),
                                  "--verify"])
        assert rc == 0, err
        assert rss <= 1.5 * weights, f"fuse --verify peaked at {rss / 1e9:.2f} GB for {weights / 1e9:.2f} GB"
    finally:
        shutil.rmtree(folder, ignore_errors=True)
