"""verify: inputs that mean what the model expects, per-output comparison, pass and fail."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from optfuse.errors import InputError, VerificationError
from optfuse.fusions import fuse_model
from optfuse.pipeline import verify_options
from optfuse.recipe import recipe_from_dict
from optfuse.verify import compare_arrays, gather_table_rows, make_feed, plan_inputs, right_padded_mask, verify

import graphs

VOCAB, TYPES, HIDDEN = 50, 2, 32


def bert_like(perturb=0.0, vocab=VOCAB, reshape_ids=False):
    """Embeddings (word + token type) masked by attention_mask, then a residual LayerNorm block."""
    rng = np.random.default_rng(0)
    b = graphs.Builder(17)
    ids = "input_ids"
    if reshape_ids:  # GPT-2 style: ids go through a Reshape before the Gather
        ids = b.node("Reshape", ids, b.const(np.array([-1, 0], dtype=np.int64), dtype=np.int64), allowzero=0)
        ids = b.node("Reshape", ids, b.const(np.array([2, -1], dtype=np.int64), dtype=np.int64))
    emb = b.node("Add", b.node("Gather", b.const(rng.standard_normal((vocab, HIDDEN)), "word_emb"), ids),
                 b.node("Gather", b.const(rng.standard_normal((TYPES, HIDDEN)), "type_emb"), "token_type_ids"))
    m = b.node("Cast", b.node("Unsqueeze", "attention_mask", b.const(np.array([2]), dtype=np.int64)), to=TensorProto.FLOAT)
    h = b.node("Mul", emb, m)
    f = b.node("MatMul", h, b.const(rng.standard_normal((HIDDEN, HIDDEN)) / np.sqrt(HIDDEN)))
    s = b.node("Add", f, h)
    b.node("LayerNormalization", s, b.const(rng.standard_normal(HIDDEN)),
           b.const(rng.standard_normal(HIDDEN) + perturb), axis=-1, epsilon=1e-5, out="y")
    return b.model([graphs.io("input_ids", ["batch", "seq"], TensorProto.INT64),
                    graphs.io("token_type_ids", ["batch", "seq"], TensorProto.INT64),
                    graphs.io("attention_mask", ["batch", "seq"], TensorProto.INT64)],
                   [graphs.io("y", ["batch", "seq", HIDDEN])])


def test_inputs_inferred_from_the_graph():
    plans = {p.name: p for p in plan_inputs(bert_like())}
    ids, types, mask = plans["input_ids"], plans["token_type_ids"], plans["attention_mask"]
    assert (ids.kind, ids.low, ids.high) == ("tokens", 0, VOCAB)
    assert (types.kind, types.low, types.high) == ("tokens", 0, TYPES)
    assert mask.kind == "mask"
    assert ids.shape == [2, 16]  # default batch 2, other dims 16


def test_gather_rows_through_reshape():
    assert gather_table_rows(bert_like(reshape_ids=True)) == {"input_ids": VOCAB, "token_type_ids": TYPES}


def test_recipe_shapes_and_ranges_win():
    recipe = recipe_from_dict({
        "name": "t", "model": {"path": "m.onnx"},
        "inputs": {"input_ids": {"dtype": "int64", "shape": ["b", "s"], "range": [3, 7]}},
        "dims": {"b": {"min": 1, "opt": 3, "max": 4}, "s": {"min": 1, "opt": 5, "max": 8}},
    })
    model = bert_like()
    # the model names its dims batch/seq; the recipe's shapes decide the input_ids shape
    plans = {p.name: p for p in plan_inputs(model, verify_options(recipe))}
    assert plans["input_ids"].shape == [3, 5] and (plans["input_ids"].low, plans["input_ids"].high) == (3, 7)


def test_npz_inputs(tmp_path):
    x = np.arange(2 * 4 * 64, dtype=np.float32).reshape(2, 4, 64)
    np.savez(tmp_path / "x.npz", x=x)
    recipe = recipe_from_dict({"name": "t", "model": {"path": "m.onnx"},
                               "inputs": {"x": {"dtype": "float32", "shape": [2, 4, 64], "npz": "x.npz"}}},
                              base_dir=tmp_path)
    (plan,) = plan_inputs(graphs.layer_norm(), verify_options(recipe))
    assert plan.kind == "npz" and np.array_equal(plan.npz, x)
    recipe.inputs["x"].npz = tmp_path / "missing.npz"
    with pytest.raises(InputError, match="npz file not found"):
        plan_inputs(graphs.layer_norm(), verify_options(recipe))


@pytest.mark.parametrize("shape", [(2, 16), (1, 8), (4, 1, 5), (3, 2)])
def test_masks_are_right_padded(shape):
    m = right_padded_mask(shape, np.random.default_rng(0))
    rows = m.reshape(-1, shape[-1])
    for r in rows:  # ones then zeros, never empty
        n = int(r.sum())
        assert n >= 1 and (r[:n] == 1).all() and (r[n:] == 0).all()
    if shape[-1] > 1:
        assert (rows.sum(axis=1) < shape[-1]).any(), "at least one row is padded"
        assert rows[0].all() or rows.shape[0] == 1


def test_a_recipe_mask_padded_on_the_left():
    """A recipe's `padding: left` mask: zeros then ones per row (never empty, one row padded), said in the
    input table; the default stays right."""
    from optfuse.verify.inputs import left_padded_mask

    m = left_padded_mask((3, 9), np.random.default_rng(0))
    for r in m:
        n = int(r.sum())
        assert n >= 1 and (r[9 - n:] == 1).all() and (r[:9 - n] == 0).all()
    assert (m.sum(axis=1) < 9).any()
    model = bert_like()
    spec = {"dtype": "int64", "shape": ["batch", "seq"], "kind": "mask"}
    for padding, real_end in (("left", -1), (None, 0)):
        r = recipe_from_dict({"name": "t", "model": {"path": "m.onnx"}, "dims": {"batch": {"min": 1, "opt": 3, "max": 4},
                              "seq": {"min": 1, "opt": 9, "max": 9}},
                              "inputs": {"attention_mask": {**spec, **({"padding": padding} if padding else {})}}})
        plan = {p.name: p for p in plan_inputs(model, verify_options(r))}["attention_mask"]
        assert plan.source == f"{padding or 'right'}-padded 0/1 mask"
        mask = make_feed(list(plan_inputs(model, verify_options(r))), np.random.default_rng(1))["attention_mask"]
        assert (mask[:, real_end] == 1).all() and (mask[:, -1 - real_end] == 0).any()  # the real end, a padded row


def test_fused_model_passes():
    model = bert_like()
    fused, res = fuse_model(model, families=graphs.NORM_FAMILIES)
    assert res.counts() == {"SkipLayerNorm": 1}
    r = verify(model, fused, iterations=2, seed=1)
    assert r.passed and r.iterations == 2
    (out,) = r.outputs
    assert out.name == "y" and out.shape == [2, 16, HIDDEN] and out.max_abs <= 1e-4
    assert {i.name: i.source for i in r.inputs}["input_ids"] == f"tokens [0, {VOCAB}) (Gather table rows)"


def test_perturbed_candidate_fails(tmp_path):
    onnx.save(bert_like(), tmp_path / "a.onnx")
    onnx.save(bert_like(perturb=1e-3), tmp_path / "b.onnx")
    r = verify(tmp_path / "a.onnx", tmp_path / "b.onnx")
    assert not r.passed
    (out,) = r.failed
    assert out.max_abs == pytest.approx(1e-3, rel=1e-2) and out.mean_abs == pytest.approx(1e-3, rel=1e-2)
    # a looser tolerance accepts the same difference
    assert verify(tmp_path / "a.onnx", tmp_path / "b.onnx", atol=2e-3).passed


def test_tolerance_per_output_from_recipe(tmp_path):
    recipe = recipe_from_dict({"name": "t", "model": {"path": "a.onnx"},
                               "tolerances": {"outputs": {"y": {"atol": 5e-3}}}})
    assert verify(bert_like(), bert_like(perturb=1e-3), verify_options(recipe)).passed


def test_missing_output_and_bad_candidate(tmp_path):
    a = graphs.layer_norm()
    b = graphs.layer_norm()
    b.graph.output[0].name = "z"
    b.graph.node[-1].output[0] = "z"
    r = verify(a, b)
    assert not r.passed and r.outputs[0].note == "missing from the candidate"
    broken = graphs.layer_norm()
    broken.graph.node[0].op_type = "NoSuchOp"
    with pytest.raises(VerificationError, match="cannot load the candidate"):
        verify(a, broken)
    with pytest.raises(InputError, match="cannot load the original"):
        verify(broken, a)


def test_a_run_that_fails_names_the_side_and_the_shapes():
    """The original failing on its inputs is bad input (exit 2: the shapes it got, what to change); the
    candidate failing where the original ran is a failed verification (exit 1)."""
    b = graphs.Builder()
    b.node("Add", "x", b.node("Reshape", "y", b.const(np.array([4, 8], np.int64), dtype=np.int64)), out="z")
    model = b.model([graphs.io("x", ["n", 8]), graphs.io("y", [32])], [graphs.io("z", ["n", 8])])
    bad_rows = [{"x": np.zeros((3, 8), np.float32), "y": np.zeros(32, np.float32)}]  # [3, 8] + [4, 8]
    with pytest.raises(InputError, match=r"could not run the original model on its inputs \(x:3x8, y:32\): .*--shapes"):
        verify(model, model, feeds=bad_rows)
    c = graphs.Builder()
    c.node("Add", "x", c.node("Reshape", "y", c.const(np.array([2, 8], np.int64), dtype=np.int64)), out="z")
    candidate = c.model([graphs.io("x", ["n", 8]), graphs.io("y", [32])], [graphs.io("z", ["n", 8])])
    good = [{"x": np.zeros((4, 8), np.float32), "y": np.zeros(32, np.float32)}]
    with pytest.raises(VerificationError, match="could not run the models"):
        verify(model, candidate, feeds=good)


def test_compare_arrays_edge_cases():
    ref = [np.array([1.0, 0.0, np.inf], np.float32)]
    assert compare_arrays("o", ref, [np.array([1.0, 0.0, np.inf], np.float32)], 0, 0).passed
    nan = compare_arrays("o", ref, [np.array([np.nan, 0.0, np.inf], np.float32)], 1, 1)
    assert not nan.passed and "NaN" in nan.note
    shape = compare_arrays("o", ref, [np.zeros(2, np.float32)], 1, 1)
    assert not shape.passed and "shape" in shape.note
    # isclose semantics: |d| <= atol + rtol * |ref|
    assert compare_arrays("o", [np.array([100.0])], [np.array([100.5])], 0, 0.01).passed
    assert not compare_arrays("o", [np.array([100.0])], [np.array([102.0])], 0, 0.01).passed


@pytest.mark.parametrize(
    "inputs, fragment",
    [
        ({"nope": {"dtype": "float32", "shape": [2]}}, "recipe input(s) 'nope' are not inputs of the model"),
        ({"x": {"dtype": "int64", "shape": [2, 8, 64]}}, "recipe input 'x' is int64, but the model's is float32"),
        ({"x": {"dtype": "float32", "shape": [2, 64]}}, "recipe input 'x' has rank 2, but the model's has rank 3"),
        ({"x": {"dtype": "float32", "shape": [2, 8, 32]}}, "axis 2 is 32, but the model fixes it to 64"),
    ],
)
def test_recipe_must_match_the_model(inputs, fragment):
    recipe = recipe_from_dict({"name": "t", "model": {"path": "m.onnx"}, "inputs": inputs})
    with pytest.raises(InputError) as exc:
        plan_inputs(graphs.layer_norm(), verify_options(recipe))
    assert fragment in str(exc.value)


def test_candidate_precision_picks_the_tolerance():
    from onnx import TensorProto, helper, numpy_helper

    from optfuse.verify import precision_of

    def model(dtype):
        w = numpy_helper.from_array(np.ones(4, dtype=dtype), "w")
        g = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], [w])
        return helper.make_model(g)

    assert precision_of(model(np.float32)) == "fp32"
    assert precision_of(model(np.float16)) == "fp16"


def test_verify_against_a_runner_matches_verify(tmp_path):
    """verify_against (the engine check's path) with onnxruntime as the candidate runner agrees with verify."""
    import onnxruntime as ort

    from optfuse.verify import verify_against

    onnx.save(bert_like(), tmp_path / "a.onnx")
    onnx.save(bert_like(perturb=1e-3), tmp_path / "b.onnx")
    sess = ort.InferenceSession(str(tmp_path / "b.onnx"), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    seen = []

    def run(feeds):
        seen.append(len(feeds))
        return [dict(zip(names, sess.run(None, f))) for f in feeds]

    want = verify(tmp_path / "a.onnx", tmp_path / "b.onnx", iterations=2, seed=3)
    got = verify_against(tmp_path / "a.onnx", run, iterations=2, seed=3, candidate_label="runner")
    assert seen == [2] and got.candidate == "runner" and got.iterations == 2
    assert [(o.name, o.passed, o.max_abs, o.mean_abs) for o in got.outputs] == \
        [(o.name, o.passed, o.max_abs, o.mean_abs) for o in want.outputs]
    assert not got.passed  # the perturbation is outside the fp32 tolerance
    assert verify_against(tmp_path / "a.onnx", run, mode="fp16").passed  # inside fp16's default
    strict = verify_options(recipe_from_dict({"name": "t", "model": {"path": "a.onnx"},
                                              "precision": {"tolerances": {"atol": 1e-5, "rtol": 0}}}))
    assert not verify_against(tmp_path / "a.onnx", run, strict, mode="fp16").passed  # the recipe's fp16 tolerances


def test_verify_options_carry_the_recipe_tolerances():
    from optfuse.verify import tolerance

    r = recipe_from_dict({"name": "t", "model": {"path": "a.onnx"},
                          "tolerances": {"atol": 1e-3, "outputs": {"y": {"rtol": 0.5}}},
                          "precision": {"mode": "fp16", "tolerances": {"rtol": 0.2, "outputs": {"z": {"atol": 0.3}}}}})
    opts = verify_options(r)
    for mode in ("fp32", "fp16", "bf16"):
        for out in ("y", "z", "other"):
            assert tolerance(opts, out, mode) == r.tolerance(out, mode), (mode, out)
    assert tolerance(opts, "y", "fp32", atol=7.0) == (7.0, 0.5)  # an explicit atol wins, the rtol stays
    assert tolerance(None, "y", "bf16") == (5e-2, 5e-2)


def test_padded_queries_left_out_where_no_real_key_is_seen():
    """The positions verify leaves out of an output [batch, sequence, ...]: a padded query whose causal / window
    view of the mask holds no real key (one per key view of the mask's fused nodes); nothing where the output's
    leading dims are not the mask's named dims, or the mask is not fed."""
    from optfuse.verify.padding import named_shapes, padded_positions

    def vi(name, dims):
        return onnx.helper.make_tensor_value_info(name, TensorProto.FLOAT, dims)

    graph = onnx.helper.make_graph([], "g", [vi("attention_mask", ["batch", "sequence"])],
                                   [vi("y", ["batch", "sequence", 4]), vi("pooled", ["batch", 4])])
    model = onnx.helper.make_model(graph)
    mask = np.array([[1, 1, 1, 0, 0, 0, 0, 0],    # right padding
                     [0, 0, 0, 0, 0, 1, 1, 1],    # left padding
                     [0, 0, 0, 0, 0, 0, 0, 0]])   # no real key at all
    feed = {"attention_mask": mask}
    y = np.zeros((3, 8, 4))

    def left_out(views, output="y", arr=y):
        keep, masks, axis = padded_positions(named_shapes(model), output, {"attention_mask": views}, [feed], [arr], [arr])
        return None if keep is None else (~keep[0]).astype(int).tolist()

    # causal: right padding keeps key 0 in view; left-padded queries before the first real key see none
    assert left_out([(1, -1, "")]) == [[0] * 8, [1] * 5 + [0] * 3, [1] * 8]
    # window_left 2 (keys i-2..i): right-padded queries from 3 + 2 on lose the real keys too
    assert left_out([(1, 2, "")]) == [[0] * 5 + [1] * 3, [1] * 5 + [0] * 3, [1] * 8]
    # both views (a global and a local layer): the union
    assert left_out([(1, -1, ""), (1, 2, "")]) == left_out([(1, 2, "")])
    # a non-causal left window sees every later key: left padding keeps a real key in every view
    assert left_out([(0, 2, "")]) == [[0] * 5 + [1] * 3, [0] * 8, [1] * 8]
    assert left_out([(1, -1, "")], "pooled", np.zeros((3, 4))) is None  # not indexed by the mask's dims
    assert padded_positions(named_shapes(model), "y", {"attention_mask": [(1, -1, "")]}, [{}], [y], [y]) == (None, [], 0)
    # per node, by size: an intermediate whose dims shape inference left unnamed, [B, 4, S]: its one S-long axis
    shapes = {"attention_mask": ["batch", "sequence"], "t": ["unk__1", 4, None], "square": [None, None, None]}
    t, square = np.zeros((3, 4, 8)), np.zeros((3, 8, 8))
    views = {"attention_mask": [(1, -1, "")]}
    keep, _, axis = padded_positions(shapes, "t", views, [feed], [t], [t], by_size=True)
    assert axis == 2 and (~keep[0]).astype(int).tolist() == left_out([(1, -1, "")])
    assert padded_positions(shapes, "t", views, [feed], [t], [t])[0] is None  # verify: named dims only
    assert padded_positions(shapes, "square", views, [feed], [square], [square], by_size=True)[0] is None  # 2 S axes
    # two masks over other dims (an encoder's and a decoder's): each tensor takes the one over its own dims
    two = {**named_shapes(model), "dec_mask": ["batch", "target"], "z": ["batch", "target", 4]}
    dec = np.array([[1, 0], [1, 1], [0, 1]])
    both = {"attention_mask": [(1, -1, "")], "dec_mask": [(1, -1, "")]}
    keep, masks, _ = padded_positions(two, "y", both, [{**feed, "dec_mask": dec}], [y], [y])
    assert masks == ["attention_mask"] and (~keep[0]).astype(int).tolist() == left_out([(1, -1, "")])
    z = np.zeros((3, 2, 4))
    keep, masks, _ = padded_positions(two, "z", both, [{**feed, "dec_mask": dec}], [z], [z])
    assert masks == ["dec_mask"] and (~keep[0]).astype(int).tolist() == [[0, 0], [0, 0], [1, 0]]
    # a KV cache: the mask spans past + new keys ([batch, total]), the output the new queries ([batch, new]),
    # which are the mask's last positions (the query-length dim the fused node's output names)
    cache = {"attention_mask": ["batch", "total"], "h": ["batch", "new", 4]}
    new3 = np.zeros((3, 3, 4))
    keep, masks, axis = padded_positions(cache, "h", {"attention_mask": [(1, -1, "new")]}, [feed], [new3], [new3])
    assert axis == 1 and (~keep[0]).astype(int).tolist() == [[0, 0, 0], [0, 0, 0], [1, 1, 1]]
    keep, _, _ = padded_positions(cache, "h", {"attention_mask": [(1, 2, "new")]}, [feed], [new3], [new3])
    assert (~keep[0]).astype(int).tolist() == [[1, 1, 1], [0, 0, 0], [1, 1, 1]]  # window 2 past the real keys 0-2
    assert padded_positions(cache, "h", {"attention_mask": [(1, -1, "")]}, [feed], [new3], [new3])[0] is None
