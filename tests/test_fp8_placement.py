"""FP8 Q/DQ placement on the test models (BERT, GPT-2, ViT, LLaMA; both exporters): every GEMM with
a constant weight runs FP8 with its scales, norms and softmax stay in the base precision, and the
fake-quant candidate stays within the FP8 tolerances of the FP32 original in onnxruntime.

Two forms: with the GEMM fusions off, unfused MatMul/Gemm get TensorRT's explicit-quantization
pattern (activation Q -> DQ, per-channel weight DQ of an FP8 initializer); with them on, the optfuse
GEMM nodes take the FP8 tensors and their scales directly (no DQ in front of the node), once the
GEMM spec has its FP8 form. A norm whose y only FP8 GEMMs read writes E4M3 itself (its Q folded
in: optfuse.precision.fp8_norm), so such a GEMM's A comes from the norm instead of a Q."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

from optfuse import DOMAIN  # noqa: E402
from optfuse.fusions import available_families, fuse_model  # noqa: E402
from optfuse.pipeline.fp8 import calibration_feeds  # noqa: E402
from optfuse.precision import PrecisionOptions, apply_precision  # noqa: E402
from optfuse.precision.fp8 import FP8_OPSET, KEPT_BY_POLICY, PLUGIN_GEMMS, fp8_ready  # noqa: E402
from optfuse.report import precision_markdown  # noqa: E402
from optfuse.spec import get_spec  # noqa: E402
from optfuse.verify import verify  # noqa: E402

CASES = [(f, e) for f in ("bert", "gpt2", "vit", "llama") for e in ("dynamo", "torchscript")]
NORM_OPS = ("LayerNorm", "SkipLayerNorm", "RMSNorm", "SkipRMSNorm")
DIMS = {"batch": 2, "sequence": 16}


def _quantized(exported_model, family, exporter, families):
    em = exported_model(family, exporter, "sdpa")
    model = onnx.load(str(em.path))
    fused, _ = fuse_model(model, dims=DIMS, families=families)
    feeds = calibration_feeds(fused, None)
    out, res = apply_precision(fused, PrecisionOptions(mode="fp8"), feeds)
    return em, fused, out, res


def _producers(model):
    return {o: n for n in model.graph.node for o in n.output}


def _inits(model):
    return {t.name: t for t in model.graph.initializer}


def _constant_gemms(fused):
    inits = _inits(fused)
    return [n.name for n in fused.graph.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in inits]


def _check_policy(fused, out, res):
    """Norms / softmax / attention untouched: as many as before, none reads a Q or DQ output --
    except optfuse FlashAttention nodes in their FP8 form (tests/test_fp8_flash_attention.py)."""
    prod = _producers(out)
    fp8_flash = {a["name"] for a in res.fp8.get("flash_attention", [])}
    for op in KEPT_BY_POLICY:
        before = sum(n.op_type == op for n in fused.graph.node)
        nodes = [n for n in out.graph.node if n.op_type == op]
        assert len(nodes) == before
        for n in nodes:
            assert n.name in fp8_flash or all(
                prod.get(i) is None or prod[i].op_type not in ("QuantizeLinear", "DequantizeLinear") for i in n.input), n.name
    assert {op: c for op, (c, _) in res.fp8["kept"].items()} == {
        op: c for op in KEPT_BY_POLICY if (c := sum(n.op_type == op and n.name not in fp8_flash for n in fused.graph.node))}
    assert any(o.domain in ("", "ai.onnx") and o.version >= FP8_OPSET for o in out.opset_import)


def _check_accuracy(em, out, tmp_path):
    path = tmp_path / "fp8.onnx"
    onnx.save(out, path)
    v = verify(str(em.path), str(path), None)
    assert v.passed, [(o.name, o.max_abs, o.cosine, o.note) for o in v.outputs]
    assert all(o.cosine >= 0.99 and o.min_cosine == 0.99 for o in v.outputs)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_grid_alignment_lowers_the_mean_error(family, exported_model, tmp_path):
    """The scales aligned to their data (calibrate.SCALE_STEPS) against amax / 448 (scale_steps 1),
    everything else the same: the fused model's mean |error| against FP32 is lower on the same verify
    batches (README "Against ModelOpt": 4-6 % over 10 seeds x 30 batches)."""
    em = exported_model(family, "dynamo", "sdpa")
    fused, _ = fuse_model(onnx.load(str(em.path)), dims=DIMS)
    feeds = calibration_feeds(fused, None)
    errors = {}
    for steps in (1, 8):
        out, _ = apply_precision(fused, PrecisionOptions(mode="fp8", scale_steps=steps), feeds)
        onnx.save(out, tmp_path / f"fp8-{steps}.onnx")
        errors[steps] = verify(str(em.path), str(tmp_path / f"fp8-{steps}.onnx"), None, iterations=3).outputs[0].mean_abs
    assert errors[8] < errors[1], errors


@pytest.mark.slow
@pytest.mark.parametrize("family, exporter", CASES)
def test_qdq_on_unfused_gemms(family, exporter, exported_model, tmp_path):
    em, fused, out, res = _quantized(exported_model, family, exporter,
                                     [f for f in available_families() if f != "gemm"])
    wanted = _constant_gemms(fused)
    assert wanted and sorted(g["name"] for g in res.fp8["gemms"]) == sorted(wanted)
    assert all(g["form"] == "qdq" for g in res.fp8["gemms"])
    prod, inits = _producers(out), _inits(out)
    by_name = {n.name: n for n in out.graph.node}
    for name in wanted:
        n = by_name[name]
        act, wdq = prod[n.input[0]], prod[n.input[1]]
        assert act.op_type == "DequantizeLinear" and prod[act.input[0]].op_type == "QuantizeLinear"
        q = prod[act.input[0]]
        assert inits[q.input[2]].data_type == TensorProto.FLOAT8E4M3FN  # the zero point picks E4M3
        assert inits[q.input[1]].data_type == TensorProto.FLOAT16 and not inits[q.input[1]].dims  # per tensor
        assert wdq.op_type == "DequantizeLinear" and inits[wdq.input[0]].data_type == TensorProto.FLOAT8E4M3FN
        w = inits[wdq.input[0]]
        axis = helper.get_attribute_value(next(a for a in wdq.attribute if a.name == "axis"))
        trans_b = any(a.name == "transB" and a.i for a in n.attribute)
        assert axis == (0 if n.op_type == "Gemm" and trans_b else 1)
        assert list(inits[wdq.input[1]].dims) == [w.dims[axis]]  # per output channel
    skipped = {s["op"] for s in res.fp8["skipped"]}
    assert skipped <= {"MatMul"}  # only activation x activation MatMuls (unfused attention), if any
    _check_policy(fused, out, res)
    _check_accuracy(em, out, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("family, exporter", CASES)
def test_optfuse_gemms_take_fp8_directly(family, exporter, exported_model, tmp_path):
    em, fused, out, res = _quantized(exported_model, family, exporter, None)
    gemms = [n for n in fused.graph.node if n.domain == DOMAIN and n.op_type in PLUGIN_GEMMS]
    assert gemms
    if not all(fp8_ready(op) for op in PLUGIN_GEMMS):
        assert {s["name"] for s in res.fp8["skipped"]} >= {n.name for n in gemms}
        assert all("has no FP8 inputs" in s["reason"] for s in res.fp8["skipped"] if s["op"] in PLUGIN_GEMMS)
        pytest.skip("the GEMM spec has no FP8 form yet: optfuse GEMM nodes stay in the base precision")
    assert sorted(g["name"] for g in res.fp8["gemms"] if g["form"] == "plugin") == sorted(n.name for n in gemms)
    prod, inits = _producers(out), _inits(out)
    for n in out.graph.node:
        if n.domain != DOMAIN or n.op_type not in PLUGIN_GEMMS:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        assert attrs["plugin_version"] == str(get_spec(n.op_type).version).encode() and attrs["output_dtype"] == b"float16"
        a = prod[n.input[0]]  # no DQ in front of the plugin: a Q, or a norm writing FP8 itself (fp8_norm)
        assert a.op_type == "QuantizeLinear" or (a.op_type in NORM_OPS and a.overload == "fp8")
        n_w = 2 if n.op_type == "GatedGemm" else 1
        for w in n.input[1:1 + n_w]:
            assert inits[w].data_type == TensorProto.FLOAT8E4M3FN
        a_scale, *w_scales = n.input[-(1 + n_w):]
        assert inits[a_scale].data_type == TensorProto.FLOAT and list(inits[a_scale].dims) == [1]
        for w, s in zip(n.input[1:1 + n_w], w_scales):
            assert inits[s].data_type == TensorProto.FLOAT and list(inits[s].dims) == [inits[w].dims[0]]
        q_scale = onnx.numpy_helper.to_array(inits[a.input[1] if a.op_type == "QuantizeLinear" else a.input[-1]])
        assert q_scale.astype(np.float32).reshape(-1)[0] == onnx.numpy_helper.to_array(inits[a_scale])[0]  # they agree
    assert not any(n.op_type == "DequantizeLinear" for n in out.graph.node)
    _check_policy(fused, out, res)
    _check_accuracy(em, out, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("family, exporter", CASES)
def test_mha_pattern_on_unfused_attention(family, exporter, exported_model, tmp_path):
    """Attention left unfused: TensorRT's FP8 MHA pattern, Q -> DQ on Q and K (the first MatMul's
    inputs) and on the softmax output and V (the second's), one block per layer."""
    em, fused, out, res = _quantized(exported_model, family, exporter,
                                     [f for f in available_families() if f != "attention"])
    blocks = res.fp8["attention"]
    assert len(blocks) == em.counts["attention"] == sum(n.op_type == "Softmax" for n in fused.graph.node)
    assert not [s for s in res.fp8["skipped"] if s["op"] == "MatMul"]
    prod = _producers(out)
    by_name = {n.name: n for n in out.graph.node}
    for a in blocks:
        assert [t["role"] for t in a["tensors"]] == list("QKPV")
        assert 0 < a["tensors"][2]["amax"] <= 1.0 + 1e-6  # softmax probabilities: max |p|, not grid-aligned
        for name in a["matmuls"]:
            for i in by_name[name].input:
                dq = prod[i]
                assert dq.op_type == "DequantizeLinear" and prod[dq.input[0]].op_type == "QuantizeLinear"
    assert f"TensorRT's FP8 MHA pattern (Q/DQ on Q, K, softmax output P, V): {len(blocks)} block(s)" in \
        precision_markdown(res)
    _check_policy(fused, out, res)
    _check_accuracy(em, out, tmp_path)


# ------------------------------------------------------------------------------------------------
# FP8 norm outputs (optfuse.precision.fp8_norm): a norm whose y feeds only FP8 GEMMs writes E4M3
# ------------------------------------------------------------------------------------------------
NORM_CASES = [(f, e) for f in ("bert", "llama") for e in ("dynamo", "torchscript")]


def _readers(model):
    out = {}
    for n in model.graph.node:
        for i in n.input:
            out.setdefault(i, []).append(n)
    return out


def _expected_folds(unfolded):
    """From the model without the fold: {norm name: its Q} for each optfuse norm whose y only Qs
    read (and is no graph output), and the names of the norms a Q and another node read."""
    readers, outputs = _readers(unfolded), {o.name for o in unfolded.graph.output}
    fold, kept = {}, []
    for n in unfolded.graph.node:
        if n.domain != DOMAIN or n.op_type not in NORM_OPS:
            continue
        rs = [r for r in readers.get(n.output[0], []) if r.op_type not in ("Shape", "Size")]  # shape only
        qs = [r for r in rs if r.op_type == "QuantizeLinear"]
        if qs and len(qs) == len(rs) and n.output[0] not in outputs:
            fold[n.name] = qs[0]
        elif qs:
            kept.append(n.name)
    return fold, sorted(kept)


def _e4m3_ordinal(bits):
    """E4M3 bit patterns as integers in value order (+0 and -0 both 0): adjacent values differ by 1."""
    b = np.asarray(bits).view(np.uint8).astype(np.int16)
    return np.where(b & 0x80, -(b & 0x7F), b & 0x7F)


def _unfolded_witness(out, folded, unfolded_q):
    """`out` plus, next to each folded norm, the unfolded chain on the same inputs: the norm in the
    base precision (no y_scale) -> the placement's QuantizeLinear; both FP8 tensors as outputs."""
    from optfuse.rewrite import add_functions

    m = onnx.ModelProto()
    m.CopyFrom(out)
    g, inits = m.graph, _inits(out)
    uinits = {t.name: t for t in unfolded_q["inits"]}
    pairs = []
    for n in [n for n in g.node if n.name in folded]:
        q = unfolded_q["qs"][n.name]
        base = helper.make_node(n.op_type, list(n.input[:-1]), [f"{n.output[0]}/base", *[f"{o}/base" for o in n.output[1:]]],
                                name=f"{n.name}/base", domain=n.domain)
        base.attribute.extend(n.attribute)
        for name in q.input[1:]:
            if name not in inits:
                g.initializer.append(uinits[name])
                inits[name] = uinits[name]
        requant = helper.make_node("QuantizeLinear", [f"{n.output[0]}/base", *q.input[1:]], [f"{n.output[0]}/unfolded"])
        g.node.extend([base, requant])
        for y in (n.output[0], f"{n.output[0]}/unfolded"):
            g.output.append(helper.make_tensor_value_info(y, TensorProto.FLOAT8E4M3FN, None))
        pairs.append((n.output[0], f"{n.output[0]}/unfolded"))
    return add_functions(m), pairs


def _run(model, feeds):
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


@pytest.mark.slow
@pytest.mark.parametrize("family, exporter", NORM_CASES)
def test_norms_feeding_fp8_gemms_write_fp8(family, exporter, exported_model, monkeypatch, tmp_path):
    """Each norm whose y only FP8 GEMMs read (through the placement's Q) takes y_scale and writes
    E4M3 itself, its Q gone: LLaMA's pre-norm RMSNorms. A norm whose y is read in the base precision
    too keeps its Q: BERT's post-LN LayerNorms, whose y is the next residual. On the same inputs the
    folded norm's E4M3 y is the unfolded norm -> Q's within one E4M3 ulp (the Q rounded y to fp16
    first: double rounding, only near an E4M3 rounding boundary), and the candidate stays within the
    FP8 tolerances of the FP32 model and agrees with the unfolded candidate."""
    import optfuse.precision.fp8 as fp8_module
    from optfuse.precision.fp8_norm import KEPT_READ

    em, fused, out, res = _quantized(exported_model, family, exporter, None)
    with monkeypatch.context() as m:
        m.setattr(fp8_module, "fold_norm_quantize", lambda model, result: model)
        _, _, unfolded, _ = _quantized(exported_model, family, exporter, None)
    fold, kept = _expected_folds(unfolded)
    norms = res.fp8["norms"]
    assert sorted(x["name"] for x in norms if x["form"] == "fp8_output") == sorted(fold)
    assert sorted(x["name"] for x in norms if x["form"] == "quantize_kept") == kept
    if family == "llama":  # pre-norm: every norm in front of FP8 GEMMs now writes FP8
        assert fold and not kept
    else:  # post-LN: y is the residual stream as well
        assert kept and not fold and all(x["reason"].startswith(KEPT_READ) for x in norms)
    note = next(n for n in res.notes if n.startswith("FP8 norm outputs:"))
    assert f"{len(fold)} of {len(norms)} norm(s)" in note and ("keep the QuantizeLinear" in note) == bool(kept)

    prod, inits, readers = _producers(out), _inits(out), _readers(out)
    n_q = sum(n.op_type == "QuantizeLinear" for n in unfolded.graph.node)
    assert sum(n.op_type == "QuantizeLinear" for n in out.graph.node) == n_q - len(fold)
    fns = {(f.name, f.overload) for f in out.functions}
    for n in out.graph.node:
        if n.name not in fold:
            continue
        y_scale = inits[n.input[-1]]
        assert y_scale.data_type == TensorProto.FLOAT and list(y_scale.dims) == [1] and n.overload == "fp8"
        q_scale = onnx.numpy_helper.to_array(_inits(unfolded)[fold[n.name].input[1]]).astype(np.float32)
        assert onnx.numpy_helper.to_array(y_scale)[0] == q_scale  # the Q's scale, exactly
        assert n.output[0] == fold[n.name].output[0] and (n.op_type, "fp8") in fns
        rs = readers[n.output[0]]  # its shape readers read x now (y's shape)
        assert rs and all(r.domain == DOMAIN and r.op_type in PLUGIN_GEMMS and r.input[0] == n.output[0] for r in rs)
        assert all(prod.get(i) is not n for r in out.graph.node if r.op_type == "QuantizeLinear" for i in r.input)

    feeds = calibration_feeds(fused, None)[0]
    if fold:
        witness, pairs = _unfolded_witness(out, fold, {"qs": fold, "inits": list(unfolded.graph.initializer)})
        got = _run(witness, feeds)
        for folded_y, unfolded_y in pairs:
            diff = np.abs(_e4m3_ordinal(got[folded_y]) - _e4m3_ordinal(got[unfolded_y]))
            assert diff.max() <= 1, (folded_y, int(diff.max()))
            assert (diff > 0).mean() < 0.02, (folded_y, float((diff > 0).mean()))  # near a boundary only
    a, b = _run(out, feeds), _run(unfolded, feeds)
    for k in a:
        p, q = a[k].astype(np.float64).ravel(), b[k].astype(np.float64).ravel()
        if not fold:
            np.testing.assert_array_equal(p, q)  # nothing folded: the same model
        else:
            assert p @ q / (np.linalg.norm(p) * np.linalg.norm(q)) >= 0.999, k
    _check_accuracy(em, out, tmp_path)
