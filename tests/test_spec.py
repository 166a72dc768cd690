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
    # y_scale: the optional FP8-output scale (issue 18's FP8 norm output)
    assert [t.name for t in ln.inputs] == ["x", "gamma", "beta", "y_scale"] and ln.outputs[0].like == "x"
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


GEMM_ONE_OP = (PLUGINS_DIR / "gemm" / "spec.yaml").read_text().split("---")[0]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.replace("dtype_from: output_dtype", "dtype_from: out_dtype"),
         r"outputs\[0\]\.dtype_from: 'out_dtype' names no attribute"),
        (lambda t: t.replace("dtype_from: output_dtype", "dtype_from: alpha"),
         r"outputs\[0\]\.dtype_from: attribute 'alpha' must be a string with choices and a default"),
        (lambda t: t.replace("default: like_input, choices: [like_input,", "choices: [like_input,"),
         r"outputs\[0\]\.dtype_from: attribute 'output_dtype' must be a string with choices and a default"),
        (lambda t: t.replace("choices: [like_input, float16, bfloat16, float32]",
                             "choices: [like_input, float16, float8e4m3fn]"),
         r"outputs\[0\]\.dtype_from: choice 'float8e4m3fn' of 'output_dtype' is neither 'like_input' nor one of "
         r"the output's dtypes"),
        (lambda t: t.replace("choices: [like_input, float16, bfloat16, float32]", "choices: [like_input, float64]"),
         r"choice 'float64' of 'output_dtype' is neither"),
        (lambda t: t.replace("like: A, last_dim: {input: W, axis: 0}, ", ""),
         r"outputs\[0\]\.dtype_from: choice 'like_input' of 'output_dtype' needs a 'like' rule"),
        (lambda t: t.replace('{name: W, dtypes:', '{name: W, dtype_from: output_dtype, dtypes:'),
         r"inputs\[1\]\.dtype_from: only outputs take a 'dtype_from' rule"),
        (lambda t: t.replace("dtype_from: output_dtype", "dtype_from: [output_dtype]"),
         r"outputs\[0\]\.dtype_from: expected str, got list"),
        (lambda t: t.replace("with_dtypes: [float8e4m3fn]", "with_dtypes: [float16, float64]", 1),
         r"inputs\[4\]\.with_dtypes\[1\]: 'float64' is not a dtype of A"),
        (lambda t: t.replace("{name: W, dtypes:", "{name: W, with_dtypes: [float8e4m3fn], dtypes:"),
         r"inputs\[1\]\.with_dtypes: only optional inputs after the first take a 'with_dtypes' rule"),
        (lambda t: t.replace("dtype_from: output_dtype", "dtype_from: output_dtype, with_dtypes: [float16]"),
         r"outputs\[0\]\.with_dtypes: only optional inputs take a 'with_dtypes' rule"),
    ],
)
def test_bad_output_dtype_rules_are_rejected(tmp_path, edit, message):
    text = edit(GEMM_ONE_OP)
    assert text != GEMM_ONE_OP
    with pytest.raises(SpecError, match=message):
        _read(tmp_path, text)


def test_output_dtype_rule():
    """y's dtype: ``output_dtype``'s value, or (``like_input``, the default) A's; a value not among
    y's dtypes (an FP8 A with like_input) or not among the choices is a ValueError."""
    from optfuse.spec import FP8_DTYPES, LIKE_INPUT

    gemm, ln = get_spec("GemmEpilogue"), get_spec("LayerNorm")
    assert FP8_DTYPES == ("float8e4m3fn",) and gemm.attr("output_dtype").default == LIKE_INPUT
    assert gemm.outputs[0].dtype_from == "output_dtype" and ln.outputs[0].dtype_from is None
    fp8 = ["float8e4m3fn", "float8e4m3fn", None, None, "float32", "float32"]
    assert gemm.output_dtype(0, ["float16"] * 2) == "float16"
    assert gemm.output_dtype(0, ["bfloat16"] * 2, {"output_dtype": "like_input"}) == "bfloat16"
    assert gemm.output_dtype(0, ["float16"] * 2, {"output_dtype": "float32"}) == "float32"
    assert gemm.output_dtype(0, fp8, {"output_dtype": b"bfloat16"}) == "bfloat16"  # ONNX strings are bytes
    with pytest.raises(ValueError, match=r"would be float8e4m3fn \(output_dtype like_input: the dtype of A\)"):
        gemm.output_dtype(0, fp8)
    with pytest.raises(ValueError, match="output_dtype 'float64' is not one of"):
        gemm.output_dtype(0, ["float16"] * 2, {"output_dtype": "float64"})
    assert ln.output_dtype(0, ["float16"] * 3) == "float16"
    assert get_spec("GatedGemm").output_dtype(0, ["float8e4m3fn"] * 3, {"output_dtype": "float16"}) == "float16"
    # the scales come exactly with FP8 operands (with_dtypes)
    assert gemm.presence_error(fp8) is None and gemm.presence_error(["float16"] * 4) is None
    assert "'a_scale' is absent with A float8e4m3fn" in gemm.presence_error(fp8[:4])
    assert "'w_scale' is present with A float16" in gemm.presence_error(["float16"] * 4 + [None, "float32"])


def test_quantized_by_rule():
    """A norm's y is float8e4m3fn exactly when y_scale is present (``quantized_by``), else like x;
    its sum stays like x; the TensorRT I/O combinations follow the number of inputs given."""
    from optfuse.trt import glue

    for op, n in (("LayerNorm", 3), ("SkipLayerNorm", 4), ("RMSNorm", 2), ("SkipRMSNorm", 3)):
        spec = get_spec(op)
        assert spec.outputs[0].quantized_by == "y_scale" and spec.inputs[n].name == "y_scale"
        assert spec.output_dtype(0, ["bfloat16"] * n + [None]) == "bfloat16"
        assert spec.output_dtype(0, ["bfloat16"] * n + ["float32"]) == "float8e4m3fn"
        assert spec.output_dtype(0, ["float16"] * n) == "float16"  # a trailing absent input left out
        if len(spec.outputs) == 2:
            assert spec.output_dtype(1, ["float16"] * n + ["float32"]) == "float16"
        fp8 = glue.io_dtype_combinations(spec, n + 1)
        assert ("float16",) * n + ("float32", "float8e4m3fn") + (("float16",) if len(spec.outputs) == 2 else ()) in fp8
        assert all(c[n + 1] == "float8e4m3fn" for c in fp8)
        assert all("float8e4m3fn" not in c for c in glue.io_dtype_combinations(spec, n))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.replace("quantized_by: y_scale", "quantized_by: scale"), r"'scale' names no input"),
        (lambda t: t.replace("{name: y_scale, dtypes: [float32], optional: true,", "{name: y_scale, dtypes: [float32],"),
         r"input 'y_scale' must be optional and float32"),
        (lambda t: t.replace("[float32, float16, bfloat16, float8e4m3fn], quantized_by", "[float32, float16], quantized_by"),
         r"outputs\[0\]\.quantized_by: the output must list exactly one of float8e4m3fn"),
        (lambda t: t.replace("{name: gamma,", "{name: gamma, quantized_by: y_scale,"),
         r"inputs\[1\]\.quantized_by: only outputs take a 'quantized_by' rule"),
    ],
)
def test_bad_quantized_by_rules_are_rejected(tmp_path, edit, message):
    text = edit(ONE_OP)
    assert text != ONE_OP
    with pytest.raises(SpecError, match=message):
        _read(tmp_path, text)


def test_plugin_forms_follow_the_output_dtype_rule_and_fp8_combinations():
    """Both TensorRT plugin forms, from the spec: y's dtype from output_dtype (classic
    get_output_data_types), the accepted formats (classic supports_format_combination: FP8 A / W
    with float32 scales and y of output_dtype; no scales without FP8) and QDP's autotune types."""
    import types

    from optfuse.trt import glue, plugins, qdp

    data_type = types.SimpleNamespace(**{k: types.SimpleNamespace(name=k) for k in glue.TRT_DTYPE})
    bases = {name: type(name, (), {"__init__": lambda self, *a, **k: None})
             for name in ("IPluginV3", "IPluginV3OneCore", "IPluginV3OneBuild", "IPluginV3OneRuntime")}
    fake = types.SimpleNamespace(**bases, DataType=data_type, TensorFormat=types.SimpleNamespace(LINEAR="linear"))
    spec = get_spec("GemmEpilogue")
    plugin = plugins._plugin_class(fake, spec)({"output_dtype": "bfloat16"})
    fp8, f32 = data_type.FP8, data_type.FLOAT
    assert plugin.get_output_data_types([fp8, fp8, f32, f32, f32, f32]) == [data_type.BF16]
    with pytest.raises(ValueError, match="would be float8e4m3fn"):
        plugins._plugin_class(fake, spec)({}).get_output_data_types([fp8, fp8])

    def accepts(*names):
        io = [types.SimpleNamespace(desc=types.SimpleNamespace(format="linear", type=getattr(data_type, n))) for n in names]
        return all(plugins._supports_format(fake, spec, [0], p, io, len(names) - 1) for p in range(len(names)))

    assert accepts("FP8", "FP8", "BF16", "BF16", "FLOAT", "FLOAT", "BF16")
    assert accepts("HALF", "HALF", "HALF", "HALF", "HALF") and accepts("HALF", "HALF", "FLOAT", "FLOAT", "FLOAT")
    assert not accepts("FP8", "FP8", "BF16", "BF16", "FLOAT", "FLOAT", "HALF")  # bias / residual have y's dtype
    assert not accepts("FP8", "HALF", "HALF", "HALF", "FLOAT", "FLOAT", "HALF")  # A and W both FP8 or neither
    assert not accepts("FP8", "FP8", "HALF", "HALF", "HALF")  # FP8 without its scales
    assert not accepts("HALF", "HALF", "HALF", "HALF", "FLOAT", "FLOAT", "HALF")  # scales without FP8
    assert not accepts("FP8", "FP8", "FLOAT", "FLOAT", "HALF", "FLOAT", "FLOAT")  # scales are float32
    gated = get_spec("GatedGemm")
    assert qdp.autotune_combinations(gated, 6, ["float16"]) == [("float8e4m3fn",) * 3 + ("float32",) * 3 + ("float16",)]
    assert qdp.autotune_combinations(gated, 3, ["float16"]) == [
        ("float32",) * 3 + ("float16",), ("float16",) * 4, ("bfloat16",) * 3 + ("float16",)]
    assert qdp.TRTP_DTYPE["float8e4m3fn"] == "FP8" and glue.TRT_DTYPE["FP8"] == "float8e4m3fn"


FLASH = (PLUGINS_DIR / "flash_attention" / "spec.yaml").read_text().split("---")[0]
FLASH_D64 = ("{arch: sm_90, head_dim: 64, bias: [none], kernel: triton, speedup: [0.71, 0.94], against: bfloat16,\n"
             "     device: H200, results: results/h200_fp8_bench.json}")
FLASH_D128_PADDED = "{arch: sm_90, head_dim: 128, bias: [key_padding], kernel: triton, speedup: [0.63, 1.17]"


def test_fp8_speedup_entries(tmp_path):
    """FlashAttention's fp8_speedup: typed entries per (arch, head dim, bias forms), the arch in
    any spelling parse_arch reads; FP8 pays where even the lowest speedup is above 1; an arch, head
    dim or bias form not listed has no entry."""
    spec = get_spec("FlashAttention")
    d128, d64 = spec.fp8_speedup_at(90, 128), spec.fp8_speedup_at(90, 64)
    assert (d128.kernel, d128.speedup, d128.pays) == ("cuda", (1.20, 1.37), True)
    assert (d64.kernel, d64.speedup, d64.pays) == ("triton", (0.71, 0.94), False)
    assert d64.describe("attention") == ("FP8 attention at head dim 64 on sm_90 runs the Triton FP8 branch, "
                                         "0.71-0.94x the bf16 kernel (H200)")
    padded = spec.fp8_speedup_at(90, 128, "key_padding")
    assert (padded.kernel, padded.speedup, padded.pays, padded.bias) == ("triton", (0.63, 1.17), False, ("key_padding",))
    assert padded.describe("attention", "key_padding") == (
        "FP8 attention at head dim 128 with a key-padding bias on sm_90 runs the Triton FP8 branch, 0.63-1.17x "
        "the bf16 kernel (H200; timed without a mask)")
    assert spec.fp8_speedup_at(90, 64, "key_padding").speedup == (0.71, 0.94)
    assert spec.fp8_speedup_at(90, 128, "other") is None and spec.fp8_speedup_at(90, 64, "other") is None
    assert spec.fp8_speedup_at(89, 64) is None and spec.fp8_speedup_at(90, 32) is None
    assert spec.fp8_speedup_at(None, 64) is None and spec.fp8_speedup_at(90, None) is None
    assert get_spec("BlockSparseAttention").fp8_speedup == () and get_spec("LayerNorm").fp8_speedup == ()
    text = FLASH.replace("arch: sm_90, head_dim: 64, bias: [none]", "arch: '9.0', head_dim: 64, bias: [none]").replace(
        "arch: sm_90, head_dim: 128, bias: [none]", "arch: sm_89, head_dim: 128, bias: [none, other]")
    (one,) = _read(tmp_path, text).values()
    assert [(m.arch, m.head_dim, m.bias) for m in one.fp8_speedup] == [
        (89, 128, ("none", "other")), (90, 128, ("key_padding",)), (90, 64, ("none",)), (90, 64, ("key_padding",))]


def _d64(old: str, new: str):
    """An edit of the spec text: the D = 64 no-bias entry (fp8_speedup[2]) with `old` replaced."""
    return lambda t: t.replace(FLASH_D64, FLASH_D64.replace(old, new))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_d64("kernel: triton", "kernel: cudnn"), r"fp8_speedup\[2\]\.kernel: unknown kernel 'cudnn'"),
        (_d64("head_dim: 64", "head_dim: 72"), r"fp8_speedup\[2\]\.head_dim: 72 is not one of the op's head_dims"),
        (_d64("arch: sm_90", "arch: sm_91"), r"fp8_speedup\[2\]\.arch: unknown GPU arch"),
        (_d64("[0.71, 0.94]", "[0.94, 0.71]"), r"fp8_speedup\[2\]\.speedup: expected 0 < lowest <= highest"),
        (_d64("[0.71, 0.94]", "[0.71]"), r"fp8_speedup\[2\]\.speedup: expected \[lowest, highest\]"),
        (_d64(", results: results/h200_fp8_bench.json", ""), r"fp8_speedup\[2\]: missing required key 'results'"),
        (_d64("bias: [none], ", ""), r"fp8_speedup\[2\]: missing required key 'bias'"),
        (_d64("bias: [none]", "bias: [padding]"), r"fp8_speedup\[2\]\.bias\[0\]: unknown bias form 'padding'"),
        (_d64("bias: [none]", "bias: []"), r"fp8_speedup\[2\]\.bias: expected distinct bias forms"),
        (_d64("bias: [none]", "bias: [none, none]"), r"fp8_speedup\[2\]\.bias: expected distinct bias forms"),
        (_d64("bias: [none]", "bias: [none, key_padding]"),
         r"fp8_speedup\[3\]: sm_90, head dim 64, bias key_padding listed twice"),
        (lambda t: t.replace(FLASH_D128_PADDED, FLASH_D128_PADDED.replace("[key_padding]", "[none]")),
         r"fp8_speedup\[1\]: sm_90, head dim 128, bias none listed twice"),
        (_d64("kernel: triton", "kernel: triton, pays: true"), r"fp8_speedup\[2\]: unknown key 'pays'"),
        (lambda t: t.replace("{name: q, dtypes: [float32, float16, bfloat16, float8e4m3fn]", "{name: q, dtypes: [float32]")
         .replace("{name: q_scale, dtypes: [float32], optional: true, with_dtypes: [float8e4m3fn]", "{name: q_scale, dtypes: [float32], optional: true")
         .replace("{name: k_scale, dtypes: [float32], optional: true, with_dtypes: [float8e4m3fn]", "{name: k_scale, dtypes: [float32], optional: true")
         .replace("{name: v_scale, dtypes: [float32], optional: true, with_dtypes: [float8e4m3fn]", "{name: v_scale, dtypes: [float32], optional: true"),
         r"fp8_speedup: FlashAttention has no FP8 form"),
    ],
)
def test_bad_fp8_speedup_entries_are_rejected(tmp_path, edit, message):
    assert FLASH_D64 in FLASH and FLASH_D128_PADDED in FLASH
    text = edit(FLASH)
    assert text != FLASH
    with pytest.raises(SpecError, match=message):
        _read(tmp_path, text)
