"""Loading (external data, bad files) and atomic saving."""

import numpy as np
import onnx
import pytest

from optfuse.errors import InputError
from optfuse.ir import load_model, sanitize, save_model
from optfuse.ir.sanitize import remove_noop_casts

import graphs


def _save_external(model, path):
    model = onnx.ModelProto.FromString(model.SerializeToString())  # onnx.save_model moves weights out
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=0)


def test_external_data_round_trip(tmp_path):
    model = graphs.layer_norm(hidden=256)
    _save_external(model, tmp_path / "m.onnx")
    loaded = load_model(tmp_path / "m.onnx")
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in loaded.graph.initializer}
    ref = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    assert all(np.array_equal(weights[k], ref[k]) for k in ref)
    out = save_model(loaded, tmp_path / "out" / "m2.onnx", external_data=True)
    assert (tmp_path / "out" / "m2.onnx.data").is_file()
    again = load_model(out)
    assert len(again.graph.initializer) == len(model.graph.initializer)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["m2.onnx", "m2.onnx.data"]
    # the caller's model keeps its weights in memory
    assert all(np.array_equal(onnx.numpy_helper.to_array(t), ref[t.name]) for t in loaded.graph.initializer)


@pytest.mark.parametrize("external", [True, False])
def test_disk_weights_stay_on_disk_and_are_streamed_on_save(tmp_path, external):
    """weights="disk" reads only the small tensors; graphsurgeon reads a big one memory-mapped and
    exports its file reference again; save_model copies (external) or reads in (inline) the bytes."""
    from onnx.external_data_helper import uses_external_data

    from optfuse.ir.weights import SMALL_TENSOR_BYTES, export_graph, import_graph

    b = graphs.Builder()
    big = np.random.default_rng(0).standard_normal((64, SMALL_TENSOR_BYTES // 64)).astype(np.float32)
    small = np.arange(16, dtype=np.float32)
    y = b.node("MatMul", b.node("Add", "x", b.const(small, "small")), b.const(big, "big"), out="y")
    model = b.model([graphs.io("x", ["b", 64])], [graphs.io(y, ["b", big.shape[1]])])
    _save_external(model, tmp_path / "m.onnx")
    loaded = load_model(tmp_path / "m.onnx", weights="disk")
    inits = {t.name: t for t in loaded.graph.initializer}
    assert uses_external_data(inits["big"]) and not uses_external_data(inits["small"])
    assert loaded.ByteSize() < big.nbytes // 4

    graph = import_graph(loaded, tmp_path)
    const = graph.tensors()["big"]
    assert np.array_equal(const.values, big)  # read from the file
    exported = export_graph(graph)
    assert uses_external_data(next(t for t in exported.graph.initializer if t.name == "big"))

    out = save_model(exported, tmp_path / "out" / "m2.onnx", external_data=external, weights_dir=tmp_path)
    again = load_model(out)
    values = {t.name: onnx.numpy_helper.to_array(t) for t in again.graph.initializer}
    assert np.array_equal(values["big"], big) and np.array_equal(values["small"], small)
    assert (tmp_path / "out" / "m2.onnx.data").is_file() == external
    assert uses_external_data(next(t for t in exported.graph.initializer if t.name == "big"))  # left as it was
    data = onnx.load(str(out), load_external_data=False)
    if external:
        info = {e.key: e.value for e in next(t for t in data.graph.initializer if t.name == "big").external_data}
        assert int(info["offset"]) % 4096 == 0  # page-aligned (onnxruntime maps it)


@pytest.mark.parametrize("case", ["missing", "not_onnx", "truncated", "missing_data", "short_data"])
def test_bad_models_raise_input_error(tmp_path, case):
    path = tmp_path / "m.onnx"
    model = graphs.layer_norm(hidden=256)
    if case == "not_onnx":
        path.write_text("this is not a protobuf\n" * 10)
    elif case == "truncated":
        data = model.SerializeToString()
        path.write_bytes(data[: len(data) // 2])
    elif case in ("missing_data", "short_data"):
        _save_external(model, path)
        data = tmp_path / "m.onnx.data"
        if case == "missing_data":
            data.unlink()
        else:
            data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(InputError) as err:
        load_model(path)
    assert "\n" not in str(err.value)
    assert str(path.name) in str(err.value) or "external data" in str(err.value)


def test_noop_cast_is_bypassed():
    b = graphs.Builder()
    c = b.node("Cast", "x", to=onnx.TensorProto.FLOAT)
    b.node("Relu", c, out="y")
    g = sanitize(b.model([graphs.io("x", [4])], [graphs.io("y", [4])]))
    assert [n.op for n in g.nodes] == ["Relu"]
    assert remove_noop_casts(g) == 0


def test_sanitize_keeps_symbolic_dims_and_folds_constants():
    b = graphs.Builder()
    two = b.node("Add", b.const(1.0), b.const(1.0))
    b.node("Mul", "x", two, out="y")
    g = sanitize(b.model([graphs.io("x", ["batch", 4])], [graphs.io("y", ["batch", 4])]))
    assert [n.op for n in g.nodes] == ["Mul"]
    assert g.outputs[0].shape[0] == "batch"


def _head_split(stale: bool):
    """x [b, s, 128] -> Reshape(x, Concat(Shape(x)[:2], [-1, 32])) -> Transpose: y [b, -1 = 4, s, 32].
    stale: the model as saved after an ONNX inference without data propagation (value_info ``unk__N``)."""
    b = graphs.Builder(17)
    i64 = lambda v: b.const(v, dtype=np.int64)  # noqa: E731
    target = b.node("Concat", b.node("Slice", b.node("Shape", "x"), i64([0]), i64([2])), i64([-1, 32]), axis=0)
    b.node("Transpose", b.node("Reshape", "x", target), perm=[0, 2, 1, 3], out="y")
    model = b.model([graphs.io("x", ["b", "s", 128])], [graphs.io("y", None)])
    return onnx.shape_inference.infer_shapes(model) if stale else model


def test_sanitize_infers_afresh_over_stale_value_info():
    """ONNX keeps a stored symbolic dim over the one it propagates: sanitize forgets the stored
    ``unk__N`` dims, so they do not hide the batch, sequence and head dims."""
    stale = _head_split(stale=True)
    kept = [d.dim_param for vi in stale.graph.value_info for d in vi.type.tensor_type.shape.dim if d.dim_param]
    assert kept and all(p.startswith("unk__") for p in kept)  # the stale names the test is about
    before = stale.SerializeToString()
    fresh, again = sanitize(_head_split(stale=False)), sanitize(stale)
    assert stale.SerializeToString() == before  # the caller's proto is left as it was
    for g in (fresh, again):
        (r,) = [n.outputs[0] for n in g.nodes if n.op == "Reshape"]
        assert r.shape[:2] == ["b", "s"] and r.shape[3] == 32, r.shape
        assert g.outputs[0].shape[0] == "b" and g.outputs[0].shape[2] == "s", g.outputs[0].shape


def test_stored_shapes_fill_what_inference_leaves_open():
    """A tensor inference cannot follow (an op of another domain) keeps its stored shape, less a
    stored ``unk__N`` name; the stored names it keeps are the exporter's ("b")."""
    from optfuse.ir.shapes import infer_shapes

    b = graphs.Builder(17)
    b.node("Relu", b.node("Custom", "x", domain="vendor", out="c"), out="y")
    model = b.model([graphs.io("x", ["b", 8])], [graphs.io("y", None)])
    model.opset_import.append(onnx.helper.make_opsetid("vendor", 1))
    model.graph.value_info.append(onnx.helper.make_tensor_value_info("c", onnx.TensorProto.FLOAT, ["b", "unk__0", 8]))
    got = {vi.name: [d.dim_param or d.dim_value or None for d in vi.type.tensor_type.shape.dim]
           for vi in infer_shapes(model).graph.value_info}
    assert got["c"] == ["b", None, 8]
    assert [d.dim_param for d in model.graph.value_info[0].type.tensor_type.shape.dim][1] == "unk__0"  # left as it was


def test_concrete_shapes_resolve_symbols_and_write_nothing(tmp_path, monkeypatch):
    import onnx_graphsurgeon as gs

    from optfuse.ir.shapes import concrete_shapes

    monkeypatch.chdir(tmp_path)
    b = graphs.Builder()
    s = b.node("Add", "x", "x2")  # broadcasting Add: ONNX names the result dims with fresh symbols
    b.node("Relu", s, out="y")
    g = sanitize(b.model([graphs.io("x", ["batch", 1, 4]), graphs.io("x2", [1, "seq", 4])],
                         [graphs.io("y", None)]))
    shapes = concrete_shapes(gs.export_onnx(g), {"batch": 3, "seq": 5})
    assert shapes["y"] == (3, 5, 4)
    assert list(tmp_path.iterdir()) == []


def test_derived_weights_are_computed_once_into_aligned_scratch_tensors():
    """A DerivedValues constant (a GEMM's transposed / packed weight) spilled on export: the values
    are the transform of its sources, each tensor starts on a page, a second export reuses it."""
    import ml_dtypes

    from optfuse.ir import weights as W

    a = np.arange(15, dtype=np.float32).reshape(3, 5)
    b = np.arange(35, dtype=np.float32).reshape(7, 5) + 100
    for dt in (np.float32, ml_dtypes.bfloat16):
        packed = W.DerivedValues([(np.ascontiguousarray(a.T), True), (b, False)], dt)  # [5, 3]^T, then [7, 5]
        assert list(packed.shape) == [10, 5]
        first = W._spill("packed", packed)
        second = W._spill("b", W.DerivedValues([(b, False)], dt))
        assert W._spill("packed", packed) is first and packed.parts == []
        want = np.concatenate([a, b]).astype(dt).astype(np.float32)
        assert np.array_equal(np.asarray(first.load(), np.float32), want)
        assert np.array_equal(np.asarray(packed.load(), np.float32), want)
        assert np.array_equal(np.asarray(second.load(), np.float32), b.astype(dt).astype(np.float32))
        for v in (first, second):
            offset = int(next(e.value for e in v.tensor.external_data if e.key == "offset"))
            assert offset % 4096 == 0


def test_static_dims_through_slice_and_split_along_their_axis():
    """Where shape inference leaves a sliced / split axis symbolic (Falcon's TorchScript export:
    qkv viewed as [B, S, Hkv, G + 2, D], q = [..., :-2, :], or [B, S, H + 2, D] split [H, 1, 1]),
    the static dims follow from the constant starts / ends / steps and split sizes."""
    import onnx_graphsurgeon as gs

    from optfuse.ir.static import StaticEval

    f32 = np.float32
    x = gs.Variable("x", f32, ["b", "s", 2, 4, 32])
    i64 = lambda name, v: gs.Constant(name, np.array(v, np.int64))  # noqa: E731
    q, k = gs.Variable("q", f32, ["b", "s", 2, "u0", 32]), gs.Variable("k", f32, ["b", "s", 2, "u1", 32])
    every2 = gs.Variable("every2", f32, ["b", "s", 2, "u2", 32])
    nodes = [gs.Node("Slice", inputs=[x, i64("st", [0]), i64("en", [-2]), i64("ax", [3])], outputs=[q]),
             gs.Node("Slice", inputs=[x, i64("st1", [-2]), i64("en1", [-1]), i64("ax1", [-2])], outputs=[k]),
             gs.Node("Slice", inputs=[x, i64("st2", [0]), i64("en2", [99]), i64("ax2", [3]), i64("sp2", [2])],
                     outputs=[every2])]
    y = gs.Variable("y", f32, ["b", "s", 4, 32])
    parts = [gs.Variable(f"p{i}", f32, ["b", "s", f"v{i}", 32]) for i in range(3)]
    halves = [gs.Variable(f"h{i}", f32, ["b", "s", f"w{i}", 32]) for i in range(2)]
    computed = gs.Variable("computed_sizes", np.int64, [2])
    unknown = [gs.Variable(f"u{i}", f32, ["b", "s", f"z{i}", 32]) for i in range(2)]
    nodes += [gs.Node("Split", inputs=[y, i64("sizes", [2, 1, 1])], outputs=parts, attrs={"axis": 2}),
              gs.Node("Split", inputs=[y], outputs=halves, attrs={"axis": -2, "num_outputs": 2}),
              gs.Node("Split", inputs=[y, computed], outputs=unknown, attrs={"axis": 2})]
    gs.Graph(nodes=nodes, inputs=[x, y, computed], outputs=[q, k, every2, *parts, *halves, *unknown], opset=18)
    st = StaticEval()
    assert [st.dim(t, 3) for t in (q, k, every2)] == [2, 1, 2]
    assert [st.dim(t, 2) for t in parts] == [2, 1, 1]
    assert [st.dim(t, 2) for t in halves] == [2, 2]
    assert [st.dim(t, 2) for t in unknown] == [None, None]  # sizes computed at run time
    assert st.dim(q, 0) is None  # the batch stays symbolic
