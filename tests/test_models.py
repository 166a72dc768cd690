"""The exported test models (optfuse.models): valid ONNX, onnxruntime == torch, counts as declared.

The export matrix (family x exporter x attn) is ``slow`` except one quick BERT case. Exports are
cached on disk by the ``exported_model`` fixture (tests/conftest.py); set
``OPTFUSE_MODEL_CACHE=tmp`` to export afresh.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from optfuse import models

QUICK = ("bert", "torchscript", "sdpa")
COMBOS = [(f, e, a) for f in models.FAMILIES for e in models.EXPORTERS for a in models.ATTNS]
ATOL = RTOL = 1e-4
# Shapes fed besides the export-time ones: another batch and sequence, and a single row / token.
OTHER_DIMS = [{"batch": 3, "sequence": 7}, {"batch": 1, "sequence": 1}]


def _combo(c, *, quick=False):
    marks = [] if quick or c == QUICK else [pytest.mark.slow]
    return pytest.param(*c, id="-".join(c), marks=marks)


MATRIX = [_combo(c) for c in COMBOS]


# ------------------------------------------------------------------------------------------------
# Without torch: the declarations themselves
# ------------------------------------------------------------------------------------------------
def test_families_declared():
    assert {"bert", "gpt2", "vit", "llama", "t5"} <= set(models.FAMILIES)
    for fam in models.FAMILIES.values():
        assert fam.inputs and fam.norm in ("layer_norm", "rms_norm")
    llama = models.FAMILIES["llama"].defaults
    assert llama["num_key_value_heads"] < llama["num_attention_heads"]  # GQA


def test_recipe_schema_knows_the_same_families():
    """The recipe validates export families against optfuse.model_families, not optfuse.models."""
    import subprocess
    import sys

    from optfuse.model_families import EXPORT_FAMILIES

    assert set(EXPORT_FAMILIES) <= set(models.FAMILIES)
    code = ("import sys; from optfuse.recipe import recipe_from_dict; "
            "recipe_from_dict({'name': 'x', 'model': {'export': {'family': 't5'}}}); "
            "assert 'optfuse.models' not in sys.modules and 'optfuse.kernels' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("family,layers,expected", [
    ("bert", 2, {"attention": 2, "layer_norm": 5, "skip_layer_norm": 4, "embed_layer_norm": 1, "rms_norm": 0}),
    ("bert", 3, {"attention": 3, "layer_norm": 7, "skip_layer_norm": 6, "embed_layer_norm": 1}),
    ("gpt2", 2, {"attention": 2, "layer_norm": 5, "rms_norm": 0}),
    ("vit", 2, {"attention": 2, "layer_norm": 5, "rms_norm": 0}),
    ("llama", 2, {"attention": 2, "layer_norm": 0, "rms_norm": 5, "skip_rms_norm": 4}),
    ("t5", 2, {"attention": 2, "layer_norm": 0, "rms_norm": 5, "skip_rms_norm": 4}),
])
def test_expected_counts(family, layers, expected):
    counts = models.expected_counts(family, {"num_hidden_layers": layers})
    assert set(counts) == set(models.COUNT_KEYS)
    assert {k: counts[k] for k in expected} == expected
    assert counts["skip_layer_norm"] + counts["embed_layer_norm"] == counts["layer_norm"]


def test_input_infos_and_generated_ranges():
    cfg = {"vocab_size": 1000, "type_vocab_size": 2}
    infos = models.input_infos("bert", cfg)
    assert [i.name for i in infos] == ["input_ids", "attention_mask", "token_type_ids"]
    assert infos[0].to_recipe() == {"dtype": "int64", "shape": ["batch", "sequence"], "range": [0, 1000], "kind": "tokens"}
    assert (infos[1].low, infos[1].high, infos[1].kind) == (0, 2, "mask")
    feeds = models.make_inputs(infos, {"batch": 4, "sequence": 9}, seed=3)
    for info in infos:
        x = feeds[info.name]
        assert x.shape == (4, 9) and x.dtype == np.dtype(info.dtype)
        assert x.min() >= info.low and x.max() < info.high
    mask = feeds["attention_mask"]
    assert mask[0].all() and not mask[1].all()  # row 0 full, row 1 padded
    assert (mask[:, 0] == 1).all() and (np.diff(mask, axis=1) <= 0).all()  # right padding, no empty row
    pix = models.input_infos("vit", {"num_channels": 3, "image_size": 32})[0]
    assert pix.shape == ["batch", 3, 32, 32] and pix.dtype == "float32"


def test_unknown_names_are_errors():
    with pytest.raises(ValueError, match="unknown model family 'nope'"):
        models.expected_counts("nope", {})
    with pytest.raises(ValueError, match="unknown exporter"):
        models.cached_export("bert", "onnxscript")  # type: ignore[arg-type]


def test_export_cache_key_follows_the_family_definition(monkeypatch):
    """A family registered outside the package (a test module's) changes its export's cache key
    when its config defaults change: a stale export is never reused for another config."""
    import dataclasses

    from optfuse.models.cache import cache_key

    base = models.FAMILIES["bert"]
    key = cache_key("bert", "dynamo", "sdpa")
    monkeypatch.setitem(models.FAMILIES, "bert", dataclasses.replace(base, defaults={**base.defaults, "num_hidden_layers": 3}))
    assert cache_key("bert", "dynamo", "sdpa") != key
    monkeypatch.setitem(models.FAMILIES, "bert", base)
    assert cache_key("bert", "dynamo", "sdpa") == key


# ------------------------------------------------------------------------------------------------
# Exports
# ------------------------------------------------------------------------------------------------
def _graph_inputs(proto):
    out = {}
    for vi in proto.graph.input:
        t = vi.type.tensor_type
        out[vi.name] = (t.elem_type, [d.dim_param or d.dim_value for d in t.shape.dim])
    return out


def _structure(proto) -> dict[str, int]:
    """Counts of the exported structures, to compare with ExportedModel.counts."""
    producer = {o: n for n in proto.graph.node for o in n.output}

    def src(name):
        n = producer.get(name)
        while n is not None and n.op_type in ("Identity", "Cast"):
            n = producer.get(n.input[0])
        return n

    ops = Counter(n.op_type for n in proto.graph.node)
    ln_after_add = sum(1 for n in proto.graph.node
                       if n.op_type == "LayerNormalization" and getattr(src(n.input[0]), "op_type", "") == "Add")
    rms_after_add = 0
    for n in proto.graph.node:  # RMS norm: ReduceMean(Pow(x, 2)); a skip one has x = Add(...)
        if n.op_type == "ReduceMean":
            pw = src(n.input[0])
            if pw is not None and pw.op_type == "Pow" and getattr(src(pw.input[0]), "op_type", "") == "Add":
                rms_after_add += 1
    return {"layer_norm": ops["LayerNormalization"], "ln_after_add": ln_after_add, "attention": ops["Softmax"],
            "rms_norm": ops["ReduceMean"], "skip_rms_norm": rms_after_add}


def _check_export(m, onnx, ort):
    proto = onnx.load(str(m.path))
    onnx.checker.check_model(proto, full_check=True)
    assert m.opset == next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))

    # The declared inputs are the graph's inputs: names, order, dtypes, symbolic dims.
    graph_inputs = _graph_inputs(proto)
    assert list(graph_inputs) == [i.name for i in m.inputs]
    for info in m.inputs:
        elem, shape = graph_inputs[info.name]
        assert elem == onnx.helper.np_dtype_to_tensor_dtype(np.dtype(info.dtype)), info.name
        assert shape == info.shape, f"{info.name}: graph {shape} vs declared {info.shape}"
    assert [o.name for o in proto.graph.output] == [o.name for o in m.outputs]

    # Structure counts from the config match the graph.
    s = _structure(proto)
    c = m.counts
    assert s["layer_norm"] == c["layer_norm"], s
    assert s["ln_after_add"] == c["skip_layer_norm"] + c["embed_layer_norm"], s
    assert s["attention"] == c["attention"], s
    assert s["rms_norm"] == c["rms_norm"], s
    assert s["skip_rms_norm"] == c["skip_rms_norm"], s

    # onnxruntime == torch: at the export-time sample, and at other shapes (dynamic axes).
    sess = ort.InferenceSession(str(m.path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    feeds, want = m.sample()
    got = dict(zip(names, sess.run(None, feeds)))
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=ATOL, rtol=RTOL, err_msg=f"{m.path.name} sample {k}")
    dyn = {d for i in m.inputs for d in i.shape if isinstance(d, str)}
    for seed, dims in enumerate(OTHER_DIMS, start=1):
        dims = {k: v for k, v in dims.items() if k in dyn}
        feeds = m.make_inputs(dims, seed=seed)
        for info in m.inputs:
            x = feeds[info.name]
            assert x.dtype == np.dtype(info.dtype) and list(x.shape) == info.concrete_shape(dims)
            assert info.low <= x.min() and x.max() < info.high, f"{info.name} outside [{info.low}, {info.high})"
        got = dict(zip(names, sess.run(None, feeds)))
        want = m.torch_outputs(feeds)
        for k in want:
            assert got[k].shape == want[k].shape
            np.testing.assert_allclose(got[k], want[k], atol=ATOL, rtol=RTOL, err_msg=f"{m.path.name} {dims} {k}")


@pytest.mark.parametrize("family,exporter,attn", MATRIX)
def test_export_matches_torch(exported_model, family, exporter, attn):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    m = exported_model(family, exporter, attn)
    assert (m.family, m.exporter, m.attn) == (family, exporter, attn)
    if exporter == "torchscript":
        assert m.opset == models.DEFAULT_TORCHSCRIPT_OPSET
    else:
        assert m.opset >= 18
    _check_export(m, onnx, ort)


@pytest.mark.slow
@pytest.mark.parametrize("family,exporter,opset", [("bert", "dynamo", 17), ("llama", "torchscript", 18)])
def test_export_other_opset(exported_model, family, exporter, opset):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    m = exported_model(family, exporter, "sdpa", opset=opset)
    assert m.opset == opset
    _check_export(m, onnx, ort)


@pytest.mark.slow
def test_config_overrides_change_counts(exported_model):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    m = exported_model("llama", "torchscript", "eager", num_hidden_layers=3, num_key_value_heads=1)
    assert m.counts["rms_norm"] == 7 and m.counts["attention"] == 3
    assert m.meta["num_kv_heads"] == 1 and m.meta["num_heads"] == 4
    assert m.overrides == {"num_hidden_layers": 3, "num_key_value_heads": 1}
    _check_export(m, onnx, ort)


@pytest.mark.slow
def test_unknown_config_field_is_an_error(tmp_path):
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match="unknown BertConfig field"):
        models.export_model("bert", "torchscript", "sdpa", tmp_path, num_layerz=3)


@pytest.mark.slow
def test_cli_exports_and_prints_json(tmp_path):
    for mod in ("torch", "transformers"):
        pytest.importorskip(mod)
    script = Path(__file__).resolve().parent.parent / "scripts" / "export_hf.py"
    proc = subprocess.run([sys.executable, str(script), "--family", "vit", "--exporter", "torchscript",
                           "--attn", "eager", "-o", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (out,) = json.loads(proc.stdout)
    assert Path(out["path"]) == tmp_path / "vit_torchscript_eager.onnx" and Path(out["path"]).is_file()
    assert out["inputs"]["pixel_values"] == {"dtype": "float32", "shape": ["batch", 3, 32, 32],
                                             "range": [-1.0, 1.0], "kind": "float"}
    assert out["counts"]["layer_norm"] == 5 and out["dims"] == {"batch": {"min": 1, "opt": 2, "max": 8}}
    m = models.load_exported(out["sidecar"])
    assert m.path == Path(out["path"]) and m.counts == out["counts"]


@pytest.mark.skipif(importlib.util.find_spec("onnx") is None, reason="needs onnx")
def test_sidecar_round_trip(tmp_path):
    m = models.ExportedModel(
        path=tmp_path / "x.onnx", family="bert", exporter="dynamo", attn="sdpa", opset=18,
        inputs=models.input_infos("bert", {"vocab_size": 10, "type_vocab_size": 2}),
        outputs=[models.OutputInfo("last_hidden_state", "float32", ["batch", "sequence", 64])],
        counts=models.expected_counts("bert", {"num_hidden_layers": 2}),
        dims={"batch": {"min": 1, "opt": 2, "max": 8}}, meta={}, config={"a": 1},
    )
    m.json_path.write_text(m.to_json())
    back = models.load_exported(m.json_path)
    assert back == m


@pytest.mark.slow
def test_recipe_exports_come_from_the_cache(tmp_path, monkeypatch):
    """A recipe's export (pipeline.export_model) exports once into the cache and copies it to each run's
    folder; OPTFUSE_MODEL_CACHE=off exports into place and leaves the cache alone."""
    for mod in ("torch", "transformers"):
        pytest.importorskip(mod)
    from optfuse.models import cache
    from optfuse.pipeline import export_model

    calls = []
    real = cache.export_model
    monkeypatch.setattr(cache, "export_model", lambda *a, **k: calls.append(a) or real(*a, **k))
    monkeypatch.setenv("OPTFUSE_MODEL_CACHE", str(tmp_path / "cache"))
    first = export_model("bert", tmp_path / "a" / "bert.onnx", exporter="torchscript", config={"num_hidden_layers": 1})
    second = export_model("bert", tmp_path / "b" / "bert.onnx", exporter="torchscript", config={"num_hidden_layers": 1})
    assert len(calls) == 1 and first.read_bytes() == second.read_bytes()
    key = cache.cache_key("bert", "torchscript", "sdpa", num_hidden_layers=1)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [f"bert-torchscript-sdpa-{key}"]
    monkeypatch.setenv("OPTFUSE_MODEL_CACHE", "off")
    third = export_model("bert", tmp_path / "c" / "bert.onnx", exporter="torchscript", config={"num_hidden_layers": 1})
    assert len(calls) == 1 and third.is_file() and len(list((tmp_path / "cache").iterdir())) == 1
