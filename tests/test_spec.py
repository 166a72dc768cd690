"""The spec reader (optfuse.spec): strict validation without pydantic, and the plugin-side API."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from optfuse.spec import PLUGINS_DIR, SpecError, get_spec, load_specs, plugin_spec, plugin_specs, read_specs, shared

LAYER_NORM = (PLUGINS_DIR / "layer_norm" / "spec.yaml").read_text()
ONE_OP = LAYER_NORM.split("---")[0]


def _read(tmp_path: Path, text: str, folder: str = "demo"):
    path = tmp_path / folder / "spec.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return read_specs([path])


def test_specs_load_as_before():
    specs = load_specs()
    assert {"LayerNorm", "SkipLayerNorm", "RMSNorm", "SkipRMSNorm", "FlashAttention"} <= set(specs)
    ln = get_spec("LayerNorm")
    assert (ln.op, ln.folder, ln.domain, ln.version, ln.plugin_version) == ("LayerNorm", "layer_norm", "optfuse", 1, "1")
    assert [t.name for t in ln.inputs] == ["x", "gamma", "beta"] and ln.outputs[0].like == "x"
    assert ln.attr("epsilon").type == "float" and ln.attr("epsilon").default == pytest.approx(1e-5)
    assert ln.input_index("beta") == 2 and ln.limits["max_hidden"] == 16384
    fa = get_spec("FlashAttention")
    assert fa.inputs[3].optional and fa.attr("scale").default is None and fa.attr("causal").default == 0
    with pytest.raises(KeyError, match="no attribute"):
        ln.attr("nope")
    with pytest.raises(KeyError, match="unknown optfuse op"):
        get_spec("NoSuchOp")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.replace("version: 1\n", "version: 1\nfoo: 2\n"), r"\(op LayerNorm\): unknown key 'foo'"),
        (lambda t: t.replace("{name: gamma,", "{name: gamma, shape: 1,"), r"inputs\[1\]: unknown key 'shape'"),
        (lambda t: t.replace("version: 1\n", "version: one\n"), r"version: expected int, got str"),
        (lambda t: t.replace("version: 1\n", "version: true\n"), r"version: expected int, got bool"),
        (lambda t: t.replace("dtypes: [float32, float16, bfloat16], doc: \"[..., hidden]\"",
                             "dtypes: [float32, float8], doc: \"\"", 1), r"inputs\[0\]\.dtypes\[1\]: unknown dtype 'float8'"),
        (lambda t: t.replace("like: x}", "like: z}"), r"outputs\[0\]\.like: 'z' names no input"),
        (lambda t: t.replace("1.0e-5", "1e-5"), r"attributes\[0\]\.default: expected float or int, got str '1e-5'"),
        (lambda t: t.replace("type: float", "type: double"), r"attributes\[0\]\.type: unknown attribute type 'double'"),
        (lambda t: t.replace("{name: beta,", "{name: gamma,"), r"inputs\[2\]\.name: duplicate name 'gamma'"),
        (lambda t: t.replace("doc: \"y = ", "docs: \"y = "), r"unknown key 'docs'"),
        (lambda t: t.replace("op: LayerNorm\n", ""), r"missing required key 'op'"),
        (lambda t: t.replace("limits: {min_hidden: 1,", "limits: {min_hidden: one,"),
         r"limits\.min_hidden: expected int or float"),
        (lambda t: t.replace("{name: epsilon,", "{name: plugin_version,"), r"'plugin_version' is set by optfuse"),
        (lambda t: t.replace("like: x}", "like: x, last_dim: {input: z, axis: 0}}"),
         r"outputs\[0\]\.last_dim\.input: 'z' names no input"),
        (lambda t: t.replace("like: x}", "last_dim: {input: x, axis: 0}}"), r"last_dim: needs a 'like' rule"),
        (lambda t: t.replace("type: float", "type: float, choices: [a]"), r"only string attributes take choices"),
    ],
)
def test_bad_specs_are_rejected_naming_file_and_field(tmp_path, edit, message):
    text = edit(ONE_OP)
    assert text != ONE_OP
    with pytest.raises(SpecError, match=message) as exc:
        _read(tmp_path, text)
    assert str(exc.value).startswith(str(tmp_path / "demo" / "spec.yaml"))


def test_duplicate_op_is_rejected(tmp_path):
    with pytest.raises(SpecError, match="op LayerNorm defined twice"):
        _read(tmp_path, ONE_OP + "---\n" + ONE_OP)
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "spec.yaml").write_text(ONE_OP)
    with pytest.raises(SpecError, match=r"b/spec.yaml: op LayerNorm defined twice \(also in plugins/a\)"):
        read_specs([tmp_path / "a" / "spec.yaml", tmp_path / "b" / "spec.yaml"])


def test_not_a_mapping_and_bad_yaml(tmp_path):
    with pytest.raises(SpecError, match="expected a mapping, got list"):
        _read(tmp_path, "- 1\n- 2\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        _read(tmp_path, "op: [unclosed\n")


def test_multi_document_errors_name_the_document(tmp_path):
    text = LAYER_NORM.replace("{name: skip, dtypes: [float32", "{name: skip, dtypes: [float64")
    with pytest.raises(SpecError, match=r"document 2 \(op SkipLayerNorm\): inputs\[1\]\.dtypes\[0\]: unknown dtype"):
        _read(tmp_path, text)


def test_plugin_specs_and_shared():
    specs = plugin_specs(PLUGINS_DIR / "layer_norm" / "launch.py")
    assert list(specs) == ["LayerNorm", "SkipLayerNorm"]
    assert shared(specs, lambda s: s.limits["max_hidden"], "max_hidden") == 16384
    with pytest.raises(SpecError, match="differ in inputs"):
        shared(specs, lambda s: len(s.inputs), "inputs")
    assert plugin_spec(PLUGINS_DIR / "flash_attention" / "launch.py", "FlashAttention") is get_spec("FlashAttention")
    with pytest.raises(KeyError, match="holds FlashAttention, BlockSparseAttention: name the op"):
        plugin_spec(PLUGINS_DIR / "flash_attention" / "launch.py")
    assert plugin_spec(PLUGINS_DIR / "layer_norm" / "x.py", "SkipLayerNorm") is get_spec("SkipLayerNorm")
    with pytest.raises(KeyError, match="holds LayerNorm, SkipLayerNorm: name the op"):
        plugin_spec(PLUGINS_DIR / "layer_norm" / "launch.py")
    with pytest.raises(KeyError, match="no op 'RMSNorm'"):
        plugin_spec(PLUGINS_DIR / "layer_norm" / "launch.py", "RMSNorm")
    with pytest.raises(KeyError, match="no spec.yaml"):
        plugin_specs(PLUGINS_DIR / "common" / "io_dtype.cuh")


def test_spec_and_plugin_code_import_without_pydantic():
    """Launch and reference code read their spec where only numpy/pyyaml/onnx are installed (the
    GPU image): here with pydantic made unimportable."""
    code = (
        "import sys; sys.modules['pydantic'] = None;"  # any `import pydantic` now raises ImportError
        "import optfuse.spec, optfuse.functions; from optfuse.spec import load_specs, plugin_module;"
        "[plugin_module(s.folder, m) for s in load_specs().values() for m in ('launch', 'reference')];"
        "bad = [m for m in sys.modules if m.split('.')[0] == 'torch']; assert not bad, bad"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_every_schema_dtype_maps_to_tensorrt():
    """Both plugin forms name every dtype a spec may list (classic V3: DataType, QDP: its strings)."""
    from optfuse.spec import DTYPES, FLOAT_DTYPES
    from optfuse.trt import glue, qdp

    assert set(FLOAT_DTYPES) <= set(DTYPES)
    assert set(glue.TRT_DTYPE.values()) == set(DTYPES) and set(qdp.TRTP_DTYPE) == set(DTYPES)
