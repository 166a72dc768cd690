"""Recipe schema: the shipped recipes load, and every kind of mistake is one line naming the field."""

import json
from pathlib import Path

import pytest
import yaml

from optfuse.defaults import DEFAULT_TOLERANCES
from optfuse.errors import InputError
from optfuse.pipeline.options import verify_options
from optfuse.recipe import Recipe, load_recipe, recipe_from_dict

RECIPES = sorted((Path(__file__).resolve().parent.parent / "recipes").glob("*.yaml"))

GOOD = {
    "name": "tiny",
    "model": {"path": "model.onnx"},
    "inputs": {
        "input_ids": {"dtype": "int64", "shape": ["batch", "seq"], "kind": "tokens", "range": [0, 100]},
        "attention_mask": {"dtype": "int64", "shape": ["batch", "seq"], "kind": "mask"},
    },
    "dims": {"batch": {"min": 1, "opt": 2, "max": 8}, "seq": {"min": 1, "opt": 16, "max": 128}},
    "fusions": {"attention": False},
    "precision": {"mode": "fp16", "keep_fp32": ["LayerNorm"], "io_dtype": "keep"},
    "tolerances": {"atol": 1e-3, "outputs": {"logits": {"rtol": 0.05}}},
    "target": {"arch": "sm_89", "backend": "tensorrt_rtx"},
}


def _write(tmp_path, data, name="r.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def _errors(tmp_path, data) -> list[str]:
    with pytest.raises(InputError) as exc:
        load_recipe(_write(tmp_path, data))
    assert exc.value.exit_code == 2
    return str(exc.value).splitlines()


def _with(**changes):
    import copy

    data = copy.deepcopy(GOOD)
    for dotted, value in changes.items():
        node = data
        *head, last = dotted.split("__")
        for k in head:
            node = node.setdefault(k, {})
        if value is _DELETE:
            del node[last]
        else:
            node[last] = value
    return data


_DELETE = object()


def test_shipped_recipes_cover_the_families():
    names = {p.stem for p in RECIPES}
    assert {"bert", "gpt2", "vit", "llama"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_shipped_recipes_validate(path):
    r = load_recipe(path)
    assert r.name
    for name in r.inputs:
        assert all(v >= 1 for v in r.opt_shape(name))
    # their reduced-precision tolerances are FP16's: `convert --bf16` / `--fp8` holds the candidate to that
    # mode's own default, not to FP16's bar (a bf16 tiny LLaMA is ~0.03 off, an fp8 one ~0.3)
    for mode in ("bf16", "fp8"):
        assert r.tolerance(None, mode) == DEFAULT_TOLERANCES[mode], mode


def test_good_recipe_and_derived_values(tmp_path):
    r = load_recipe(_write(tmp_path, GOOD))
    assert r.opt_dims() == {"batch": 2, "seq": 16}
    assert r.opt_shape("input_ids") == [2, 16]
    # FP32 candidates (the fused model): top-level tolerances, per-output override on top
    assert r.tolerance("logits") == (1e-3, 0.05)
    assert r.tolerance("other") == (1e-3, 1e-3)  # rtol from the fp32 default
    # reduced-precision candidates: precision.tolerances, else the mode's default
    assert r.tolerance("other", "fp16") == (1e-2, 1e-2)
    r2 = load_recipe(_write(tmp_path, _with(precision__tolerances={"atol": 0.02, "outputs": {"logits": {"rtol": 0.1}}})))
    assert r2.tolerance("logits", "fp16") == (0.02, 0.1)
    assert r2.tolerance("logits") == (1e-3, 0.05)
    assert r.fusions.enabled() == ["layer_norm", "rms_norm", "gemm", "skip_norm"]
    assert r.resolve_path(r.model.path) == tmp_path / "model.onnx"  # relative to the recipe file
    assert r.target.arch == "sm_89"


def test_precision_tolerances_per_mode(tmp_path):
    """precision.tolerances: the flat atol / rtol / outputs hold for every reduced mode, a mode's own table
    goes over them (its outputs too), and what neither sets is the mode's default; fp32 candidates keep the
    top-level table."""
    r = load_recipe(_write(tmp_path, _with(precision__tolerances={
        "rtol": 0.03, "outputs": {"logits": {"atol": 0.2}},
        "fp8": {"atol": 0.4, "outputs": {"hidden": {"rtol": 0.5}}},
        "bf16": {"rtol": 0.07}})))
    assert r.tolerance("other", "fp16") == (1e-2, 0.03)
    assert r.tolerance("logits", "fp16") == (0.2, 0.03)
    assert r.tolerance("other", "bf16") == (5e-2, 0.07)
    assert r.tolerance("other", "fp8") == (0.4, 0.03)
    assert r.tolerance("logits", "fp8") == (0.4, 0.03)  # the mode's atol goes over the flat output's
    assert r.tolerance("hidden", "fp8") == (0.4, 0.5)
    assert r.tolerance("hidden", "fp16") == (1e-2, 0.03)
    assert r.tolerance("logits") == (1e-3, 0.05)
    opts = verify_options(r)
    assert opts.tolerances["fp8"].outputs == {"logits": (0.4, 0.03), "hidden": (0.4, 0.5)}
    assert opts.tolerances["fp16"].outputs == {"logits": (0.2, 0.03)}
    lines = _errors(tmp_path, _with(precision__tolerances={"fp8": {"atoll": 1}}))
    assert lines == [f"recipe {tmp_path / 'r.yaml'}: field 'precision.tolerances.fp8.atoll': unknown key; "
                     "expected one of: atol, rtol, outputs"], lines


def test_export_config_overrides():
    r = Recipe.model_validate({"name": "x", "model": {"export": {"family": "llama", "config": {
        "num_attention_heads": 2, "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": True}}}})
    assert r.model.export.config == {"num_attention_heads": 2, "rope_theta": 500000.0, "hidden_act": "silu",
                                     "tie_word_embeddings": True}
    assert type(r.model.export.config["tie_word_embeddings"]) is bool
    with pytest.raises(InputError, match="field 'model.export.family': expected one of the model families"):
        recipe_from_dict({"name": "x", "model": {"export": {"family": "resnet"}}})


def test_defaults_fp32():
    r = Recipe.model_validate({"name": "x", "model": {"export": {"family": "bert"}}})
    assert r.tolerance("y") == (1e-4, 1e-3)
    assert r.model.export.exporter == "dynamo" and r.target.backend == "auto"


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"inputs__input_ids__shape": ["batch", "sequence"]},
         "field 'inputs.input_ids.shape': dim 'sequence' is not declared in 'dims'"),
        ({"inputs__input_ids__shape": _DELETE}, "field 'inputs.input_ids.shape': missing (required)"),
        ({"inputs__input_ids__shape": ["batch", 1.5]},
         "field 'inputs.input_ids.shape': expected a positive int or a dim name at position 1, got 1.5"),
        ({"inputs__input_ids__shape": "batch"}, "field 'inputs.input_ids.shape': expected a list"),
        ({"inputs__input_ids__dtype": "int65"}, "field 'inputs.input_ids.dtype': expected 'float32'"),
        ({"inputs__input_ids__colour": "red"}, "field 'inputs.input_ids.colour': unknown key; expected one of: dtype"),
        ({"inputs__input_ids__range": [5, 1]}, "field 'inputs.input_ids.range': expected [low, high) with low < high"),
        ({"inputs__input_ids__kind": "ids"}, "field 'inputs.input_ids.kind': expected 'tokens', 'mask' or 'float'"),
        ({"inputs__input_ids__padding": "left"}, "field 'inputs.input_ids': padding applies to kind: mask, not kind: tokens"),
        ({"inputs__attention_mask__padding": "both"}, "field 'inputs.attention_mask.padding': expected 'right' or 'left'"),
        ({"dims__seq__opt": 500}, "field 'dims.seq': expected min <= opt <= max, got 1, 500, 128"),
        ({"dims__seq__opt": "x"}, "field 'dims.seq.opt': expected a valid integer"),
        ({"dims__seq__max": _DELETE}, "field 'dims.seq.max': missing (required)"),
        ({"fusions__flash": True}, "field 'fusions.flash': unknown key; expected one of: layer_norm, rms_norm"),
        ({"fusions__layer_norm": "maybe"}, "field 'fusions.layer_norm': expected a valid boolean"),
        ({"precision__mode": "int4"}, "field 'precision.mode': expected 'fp32', 'fp16', 'bf16' or 'fp8' (got 'int4')"),
        ({"precision__io_dtype": "fp32"}, "field 'precision.io_dtype': expected 'keep' or 'fp16'"),
        ({"tolerances__atol": -1}, "field 'tolerances.atol': expected greater than or equal to 0"),
        ({"tolerances__outputs__logits__btol": 1}, "field 'tolerances.outputs.logits.btol': unknown key"),
        ({"target__arch": "ampere"}, "field 'target.arch': expected an arch like 'sm_80'"),
        ({"target__backend": "onnxruntime"}, "field 'target.backend': expected 'auto', 'tensorrt' or 'tensorrt_rtx'"),
        ({"model__export": {"family": "bert"}}, "field 'model': expected exactly one of 'path' or 'export'"),
        ({"model": {"export": {"family": "bert", "exporter": "onnx"}}},
         "field 'model.export.exporter': expected 'torchscript' or 'dynamo' (got 'onnx')"),
        ({"model": {"export": {"family": "bert", "past": True}}},
         "field 'model.export': past: true needs a decode family (gpt2, llama), got 'bert'"),
        ({"name": _DELETE}, "field 'name': missing (required)"),
        ({"extra": 1}, "field 'extra': unknown key; expected one of: name, model, inputs"),
    ],
    ids=lambda v: None if isinstance(v, dict) else v.split(":")[0],
)
def test_errors_name_field_and_expectation(tmp_path, changes, expected):
    lines = _errors(tmp_path, _with(**changes))
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"recipe {tmp_path / 'r.yaml'}: ")
    assert expected in lines[0], lines[0]


def test_several_errors_one_line_each(tmp_path):
    lines = _errors(tmp_path, _with(precision__mode="int4", target__arch="x", inputs__input_ids__dtype="str"))
    assert len(lines) == 3
    assert all(ln.startswith("recipe ") and "field '" in ln for ln in lines)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("name: [a\n", "not valid YAML at line 2"),
        ("- a\n- b\n", "expected a mapping of recipe fields, got a list"),
        ("", "expected a mapping of recipe fields, got an empty document"),
    ],
)
def test_not_a_recipe(tmp_path, text, expected):
    assert expected in _errors(tmp_path, text)[0]


def test_missing_recipe_file(tmp_path):
    with pytest.raises(InputError, match="file not found"):
        load_recipe(tmp_path / "nope.yaml")


def test_recipe_from_dict_in_code():
    r = recipe_from_dict({"name": "x", "model": {"path": "/abs/m.onnx"}})
    assert r.resolve_path(r.model.path) == Path("/abs/m.onnx")
    with pytest.raises(InputError, match="field 'model': missing"):
        recipe_from_dict({"name": "x"}, label="recipe x")


def _past(spec) -> dict:
    """exported_model's keyword for a decode export (absent otherwise: the other exports' cache keys)."""
    return {"past": True} if spec.past else {}


@pytest.mark.slow
@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_shipped_recipes_match_their_exported_models(path, exported_model):
    """Each recipe describes the model its export spec produces: input names, dtypes, shapes, ranges."""
    import onnx

    from optfuse.pipeline import verify_options
    from optfuse.verify import plan_inputs

    recipe = load_recipe(path)
    spec = recipe.model.export
    if spec is None:
        pytest.skip("recipe names a model file")
    m = exported_model(spec.family, spec.exporter, spec.attn, spec.opset, **spec.config, **_past(spec))
    assert set(recipe.inputs) == {i.name for i in m.inputs}
    for info in m.inputs:
        ours = recipe.inputs[info.name]
        assert ours.dtype == info.dtype and ours.shape == info.shape and ours.kind == info.kind
        if ours.range is not None:
            assert ours.range == [info.low, info.high]
    for name, rng in m.dims.items():
        assert recipe.dims[name].model_dump() == rng
    plan_inputs(onnx.load(m.path), verify_options(recipe))  # agrees with the graph's inputs


def test_attention_full_mask_reaches_the_fusion_options(tmp_path):
    from optfuse.pipeline import fusion_options

    r = load_recipe(_write(tmp_path, _with(fusions__attention_full_mask=True)))
    assert fusion_options(r).attention_full_mask is True
    assert "attention_full_mask" not in r.fusions.enabled()
    assert fusion_options(load_recipe(_write(tmp_path, GOOD, "g.yaml"))).attention_full_mask is False


# -------------------------------------------------------------------------------------------------
# optfuse recipe init: a starter recipe from a model's inputs
# -------------------------------------------------------------------------------------------------
def _token_model(path):
    """input_ids (Gather over a 50-row table) and attention_mask, [batch, seq]; an input with an unnamed axis."""
    import numpy as np
    import onnx
    from onnx import TensorProto

    import graphs

    b = graphs.Builder(17)
    emb = b.node("Gather", b.const(np.ones((50, 8)), "word_emb"), "input_ids")
    m = b.node("Cast", b.node("Unsqueeze", "attention_mask", b.const(np.array([2]), dtype=np.int64)),
               to=TensorProto.FLOAT)
    b.node("Mul", emb, m, out="y")
    b.node("Identity", "extra", out="z")
    extra = onnx.helper.make_tensor_value_info("extra", TensorProto.FLOAT, [None, 8])
    model = b.model([graphs.io("input_ids", ["batch", "seq"], TensorProto.INT64),
                     graphs.io("attention_mask", ["batch", "seq"], TensorProto.INT64), extra],
                    [graphs.io("y", ["batch", "seq", 8]), onnx.helper.make_tensor_value_info("z", TensorProto.FLOAT, [None, 8])])
    onnx.save(model, path)
    return path


def test_recipe_init_describes_the_inputs(tmp_path):
    from cli_checks import invoke

    model = _token_model(tmp_path / "m.onnx")
    res = invoke("recipe", "init", model, "-o", tmp_path / "recipes" / "m.yaml")
    assert res.exit_code == 0, res.stderr
    recipe = load_recipe(tmp_path / "recipes" / "m.yaml")
    assert recipe.resolve_path(recipe.model.path).resolve() == model.resolve()
    ids, mask, extra = recipe.inputs["input_ids"], recipe.inputs["attention_mask"], recipe.inputs["extra"]
    assert (ids.dtype, ids.shape, ids.kind, ids.range) == ("int64", ["batch", "seq"], "tokens", [0, 50])
    assert (mask.kind, mask.shape) == ("mask", ["batch", "seq"])
    assert extra.shape == ["extra_0", 8] and extra.kind is None  # an axis with no name gets one
    assert {k: (v.min, v.opt, v.max) for k, v in recipe.dims.items()} == {
        "batch": (1, 2, 8), "seq": (1, 16, 128), "extra_0": (1, 2, 8)}
    check = invoke("recipe", "check", tmp_path / "recipes" / "m.yaml")
    assert check.exit_code == 0 and "ok:" in check.stdout
    # the recipe works: verify the model against itself with it
    assert invoke("verify", model, model, "-r", tmp_path / "recipes" / "m.yaml").exit_code == 0


def test_recipe_init_takes_the_profile_from_the_command_line(tmp_path):
    import json

    from cli_checks import invoke

    model = _token_model(tmp_path / "m.onnx")
    res = invoke("recipe", "init", model, "--min-shapes", "input_ids:1x1", "--opt-shapes", "input_ids:4x64",
                 "--max-shapes", "input_ids:8x256", "--json")
    assert res.exit_code == 0, res.stderr
    made = json.loads(res.stdout)
    assert made["recipe"] == str(tmp_path / "m.recipe.yaml")
    assert made["dims"]["seq"] == {"min": 1, "opt": 64, "max": 256}
    assert load_recipe(tmp_path / "m.recipe.yaml").dims["batch"].opt == 4


@pytest.mark.slow
@pytest.mark.parametrize("mode", [None, "bf16", "fp8"])
@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_shipped_recipes_convert(path, mode, exported_model, tmp_path):
    """`optfuse convert -r recipes/<model>.yaml [--bf16 | --fp8]` as shipped (its verify inputs and tolerances)
    fuses every attention block and passes the onnxruntime check (the engine build left out)."""
    from optfuse.pipeline import Overrides, convert

    recipe = load_recipe(path)
    spec = recipe.model.export
    em = exported_model(spec.family, spec.exporter, spec.attn, spec.opset, **spec.config, **_past(spec))
    res = convert(em.path, recipe, tmp_path / "out", skip_build=True, overrides=Overrides(precision=mode))
    assert res.passed, [(s.name, s.state, s.detail) for s in res.steps]
    report = json.loads(next((tmp_path / "out").glob("*.fusion_report.json")).read_text())
    attention = sum(n for op, n in report["counts"].items() if op in ("FlashAttention", "BlockSparseAttention"))
    assert attention == em.counts["attention"] and not [r for r in report["rejected"] if "Attention" in r["op"]]


# -------------------------------------------------------------------------------------------------
# dims named by an expression over other dims (HF optimum's past_sequence_length + 1, torch.onnx's s0 + s1)
# -------------------------------------------------------------------------------------------------
def test_dim_expressions():
    from optfuse.defaults import derived_dims, dim_expression

    values = {"past_sequence_length": 5, "sequence": 3, "s0": 4}
    for text, names, value in (("past_sequence_length + 1", {"past_sequence_length"}, 6),
                               ("past_sequence_length + sequence", {"past_sequence_length", "sequence"}, 8),
                               ("2*s0 - 1", {"s0"}, 7), ("s0 // 2", {"s0"}, 2)):
        evaluate, got = dim_expression(text)
        assert got == names and evaluate(values) == value, text
    for plain in ("batch", "seq.len", "x ** 2", "s0 + 1.5", "3", "f(x)", ""):
        assert dim_expression(plain) is None, plain
    # derived only over names that are dims themselves: a hyphenated name stays a name
    assert set(derived_dims(["batch", "seq-len", "past", "seq", "past + seq"])) == {"past + seq"}


def _cache_model(path):
    """A decode-like graph: the cache [batch, past, 8] and the new rows [batch, sequence, 8] concatenated, times
    a mask over both ([batch, past + sequence]), which onnxruntime refuses unless the dims agree."""
    import numpy as np
    import onnx
    from onnx import TensorProto

    import graphs

    b = graphs.Builder()
    both = b.node("Concat", "cache", "x", axis=1)
    m = b.node("Cast", b.node("Unsqueeze", "mask", b.const(np.array([2], np.int64), dtype=np.int64)), to=TensorProto.FLOAT)
    b.node("Mul", both, m, out="y")
    model = b.model([graphs.io("x", ["batch", "sequence", 8]), graphs.io("cache", ["batch", "past", 8]),
                     graphs.io("mask", ["batch", "past + sequence"], TensorProto.INT64)],
                    [graphs.io("y", ["batch", "past + sequence", 8])])
    onnx.save(model, path)
    return path


def test_a_dim_named_by_an_expression_follows_its_dims(tmp_path):
    """Verify feeds the mask past + sequence wide without a recipe; the engine profile derives its range from
    the dims it reads; recipe init spells it as the expression (declaring the dims it reads), the schema
    takes it and names an undeclared one, and the recipe verifies."""
    import onnx

    from cli_checks import invoke
    from optfuse.defaults import concrete_dims
    from optfuse.pipeline import Overrides, resolve_dims

    model = _cache_model(tmp_path / "m.onnx")
    proto = onnx.load(model)
    assert concrete_dims(proto) == {"batch": 2, "sequence": 16, "past": 16, "past + sequence": 32}
    plan = resolve_dims(proto, None, Overrides(shapes={"x": ((1, 1, 8), (2, 3, 8), (4, 7, 8))}))
    assert plan.ranges["past + sequence"] == (2, 19, 23) and plan.sources["past + sequence"] == "derived"
    assert invoke("verify", model, model).exit_code == 0
    res = invoke("recipe", "init", model, "-o", tmp_path / "m.yaml")
    assert res.exit_code == 0, res.stderr
    recipe = load_recipe(tmp_path / "m.yaml")
    assert recipe.inputs["mask"].shape == ["batch", "past + sequence"] and set(recipe.dims) == {"batch", "sequence", "past"}
    assert recipe.opt_shape("mask") == [2, 32]
    assert invoke("verify", model, model, "-r", tmp_path / "m.yaml").exit_code == 0
    lines = _errors(tmp_path, _with(inputs__attention_mask__shape=["batch", "seq + pad"]))
    assert any("field 'inputs.attention_mask.shape': dim 'pad' is not declared in 'dims'" in ln for ln in lines), lines
