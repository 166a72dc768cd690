"""FP8 FlashAttention only where it pays on the target (optfuse/precision/fp8_attention.py,
``precision.fp8_attention``), on one hand-built attention block (tests/test_attention_fusion.py's
builder, a key-padding mask or none) fused into a FlashAttention node:

- auto: sm_90 at head dim 64 keeps the node in the base precision, the reason the spec's
  measurement; sm_90 at head dim 128 puts it in FP8 without a bias and keeps it with a key-padding
  bias (the Triton FP8 branch); a target or head dim the spec does not list (sm_89, no target,
  D = 32) keeps today's FP8;
- on / off: every node / none;
- the decision follows the spec's ``fp8_speedup`` (a changed entry changes it);
- the recipe key, its validation, and the options the run records."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest

import optfuse.spec
from optfuse import DOMAIN
from optfuse.fusions import fuse_model
from optfuse.pipeline.options import Overrides, options_record, precision_options
from optfuse.precision import PrecisionOptions, apply_precision
from optfuse.precision.fp8_attention import flash_targets
from optfuse.recipe import recipe_from_dict
from optfuse.report import precision_markdown
from optfuse.spec import get_spec
from test_attention_fusion import attention_graph

H, S = 2, 16
D64_SM90 = ("FP8 attention at head dim 64 with a key-padding bias on sm_90 runs the Triton FP8 branch, "
            "0.71-0.94x the bf16 kernel (H200; timed without a mask)")
D128_PADDED_SM90 = ("FP8 attention at head dim 128 with a key-padding bias on sm_90 runs the Triton FP8 branch, "
                    "0.63-1.17x the bf16 kernel (H200; timed without a mask)")
#: the builder's mask of each bias form the spec's entries cover
MASK = {"key_padding": "padding_min", "none": None}


def _fused(D: int, mask: str | None = "padding_min") -> onnx.ModelProto:
    fused, _ = fuse_model(attention_graph(H=H, D=D, S=S, mask=mask), dims={"b": 2})
    assert len(_flash(fused)) == 1
    return fused


def _flash(model):
    return [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == "FlashAttention"]


def _feeds(D: int, n: int = 2, mask: str | None = "padding_min"):
    rng = np.random.default_rng(0)
    return [{**{x: rng.standard_normal((2, H, S, D)).astype(np.float32) for x in "qkv"},
             **({"attention_mask": np.ones((2, S), np.int64)} if mask else {})} for _ in range(n)]


def _fp8(D: int, mask: str | None = "padding_min", **options):
    fused = _fused(D, mask)
    return apply_precision(fused, PrecisionOptions(mode="fp8", **options), _feeds(D, mask=mask))


def _in_fp8(node) -> bool:
    return len(node.input) == 7 and node.overload.startswith("fp8_to_")


def test_head_dim_64_on_sm90_stays_in_the_base_precision():
    out, res = _fp8(64, target_arch=90)
    (node,) = _flash(out)
    assert not _in_fp8(node) and len(node.input) == 4
    assert res.fp8["flash_attention_kept"] == [{"name": node.name, "op": "FlashAttention", "reason": D64_SM90}]
    assert "flash_attention" not in res.fp8
    assert res.fp8["kept"]["FlashAttention"] == [1, "attention: " + D64_SM90]
    assert f"FlashAttention x1 (attention: {D64_SM90})" in precision_markdown(res)
    assert res.fp8["gemms"] == []  # the block has no GEMM with a constant weight


def test_head_dim_128_on_sm90_goes_fp8_without_a_bias():
    out, res = _fp8(128, None, target_arch=90)
    (node,) = _flash(out)
    assert _in_fp8(node)
    assert [a["name"] for a in res.fp8["flash_attention"]] == [node.name] and res.fp8["flash_attention_kept"] == []
    assert "FlashAttention" not in res.fp8["kept"]


def test_head_dim_128_with_key_padding_on_sm90_stays_in_the_base_precision():
    """The FP8 form with a key-padding bias runs the Triton FP8 branch, the bf16 form the CUDA kernel."""
    out, res = _fp8(128, target_arch=90)
    (node,) = _flash(out)
    assert not _in_fp8(node)
    assert res.fp8["flash_attention_kept"] == [{"name": node.name, "op": "FlashAttention", "reason": D128_PADDED_SM90}]


def test_bias_forms():
    from optfuse.precision.fp8_attention import bias_form

    assert bias_form([]) == bias_form([1, 1, 1, 1]) == bias_form([1]) == "none"
    assert bias_form(["b", 1, 1, "s"]) == bias_form([None, 1, 1, 16]) == bias_form([1, 1, 16]) == "key_padding"
    assert bias_form([None, 4, 16, 16]) == bias_form([1, 1, 16, 16]) == bias_form([1, None, 1, 16]) == "other"


@pytest.mark.parametrize("arch, D", [(89, 64), (None, 64), (90, 32), (80, 64)])
def test_a_target_or_head_dim_the_spec_does_not_list_keeps_fp8(arch, D):
    assert get_spec("FlashAttention").fp8_speedup_at(arch, D) is None
    targets, kept = flash_targets(_fused(D), arch=arch)
    assert len(targets) == 1 and kept == []


@pytest.mark.parametrize("D", [64, 128])
def test_override_on_puts_every_node_in_fp8_and_off_none(D):
    on, _ = flash_targets(_fused(D), mode="on", arch=90)
    assert len(on) == 1
    targets, kept = flash_targets(_fused(D), mode="off", arch=90)
    assert targets == [] and [k["reason"] for k in kept] == ["precision.fp8_attention is off"]


def test_override_on_places_fp8_at_head_dim_64_on_sm90():
    out, res = _fp8(64, target_arch=90, fp8_attention="on")
    assert _in_fp8(_flash(out)[0]) and res.fp8["flash_attention_kept"] == []


def test_override_off_keeps_head_dim_128_on_sm90():
    out, res = _fp8(128, target_arch=90, fp8_attention="off")
    assert not _in_fp8(_flash(out)[0])
    assert res.fp8["kept"]["FlashAttention"] == [1, "attention: precision.fp8_attention is off"]


def test_exclude_and_an_unknown_head_dim():
    fused = _fused(64)
    _, kept = flash_targets(fused, ("FlashAttention",), arch=90)
    assert kept[0]["reason"] == "excluded by precision.fp8_exclude ('FlashAttention')"
    shapeless = onnx.ModelProto()
    shapeless.CopyFrom(fused)
    for vi in [*shapeless.graph.input, *shapeless.graph.value_info, *shapeless.graph.output]:
        dims = vi.type.tensor_type.shape.dim
        if len(dims) == 4:
            dims[-1].dim_param = "d"
    targets, kept = flash_targets(shapeless, arch=90)  # head dim unknown: not listed, FP8
    assert len(targets) == 1 and kept == []


def test_bad_mode_is_an_input_error():
    from optfuse.errors import InputError

    with pytest.raises(InputError, match=r"precision.fp8_attention 'maybe': expected auto, on, off"):
        flash_targets(_fused(64), mode="maybe")
    with pytest.raises(InputError, match=r"precision.fp8_attention 'maybe'"):
        _fp8(64, fp8_attention="maybe")


def test_the_decision_follows_the_spec(monkeypatch):
    """Each fp8_speedup entry decides its (arch, head dim); an entry changed to a loss keeps that node."""
    spec = get_spec("FlashAttention")
    for m in spec.fp8_speedup:
        for bias in m.bias:
            targets, kept = flash_targets(_fused(m.head_dim, MASK[bias]), arch=m.arch)
            assert (len(targets), len(kept)) == ((1, 0) if m.pays else (0, 1)), (m, bias)
    d128 = spec.fp8_speedup_at(90, 128)
    slower = dataclasses.replace(spec, fp8_speedup=(dataclasses.replace(d128, speedup=(0.8, 1.1)),))
    real = optfuse.spec.get_spec
    monkeypatch.setattr(optfuse.spec, "get_spec", lambda op: slower if op == "FlashAttention" else real(op))
    assert len(flash_targets(_fused(128), arch=90)[0]) == 1  # key padding: no entry left, FP8
    targets, kept = flash_targets(_fused(128, None), arch=90)
    assert targets == [] and kept[0]["reason"] == ("FP8 attention at head dim 128 on sm_90 runs the CUDA kernel's "
                                                   "FP8 path, 0.80-1.10x the bf16 kernel (H200)")
    assert len(flash_targets(_fused(64), arch=90)[0]) == 1  # no entry left for D = 64: FP8


# -- the recipe key and the options the run records ---------------------------------------------
def _recipe(precision: dict, **more):
    return recipe_from_dict({"name": "r", "model": {"path": "m.onnx"}, "precision": {"mode": "fp8", **precision},
                             **more}, label="recipe r.yaml")


def test_recipe_fp8_attention_and_target_reach_the_precision_stage():
    r = _recipe({}, target={"arch": "sm_89"})
    p = precision_options(r)
    assert (p.fp8_attention, p.target_arch) == ("auto", 89)
    assert precision_options(r, Overrides(target="sm_90")).target_arch == 90  # convert --target wins
    assert precision_options(_recipe({"fp8_attention": "off"})).fp8_attention == "off"
    assert precision_options(None).target_arch is None  # no recipe: no target
    rec = options_record(r, Overrides())["precision"]
    assert (rec["fp8_attention"], rec["fp8_attention_target"], rec["fp8_attention_target_source"]) == \
        ("auto", "sm_89", "recipe")
    rec = options_record(_recipe({"fp8_attention": "on"}), Overrides(target="sm_90"))["precision"]
    assert (rec["fp8_attention"], rec["fp8_attention_target"], rec["fp8_attention_target_source"]) == \
        ("on", "sm_90", "command line")
    assert options_record(_recipe({}), Overrides())["precision"]["fp8_attention_target_source"] == "default"


def test_recipe_fp8_attention_values():
    import yaml

    for text, want in (("on", "on"), ("off", "off"), ("'on'", "on"), ("auto", "auto")):
        value = yaml.safe_load(f"v: {text}")["v"]  # YAML 1.1: a bare on / off is a bool
        assert _recipe({"fp8_attention": value}).precision.fp8_attention == want
    with pytest.raises(Exception) as exc:
        _recipe({"fp8_attention": "sometimes"})
    assert str(exc.value) == ("recipe r.yaml: field 'precision.fp8_attention': expected 'auto', 'on' or 'off' "
                              "(got 'sometimes')")


# -- the reports ------------------------------------------------------------------------------------
def test_reports_list_the_fp8_attention_nodes_and_the_kept_ones(tmp_path):
    """report.md and report.html list each FlashAttention node in FP8 with its q, k, v amax and
    scale, and each one kept with why."""
    from optfuse.report import missing_extra, render_html
    from optfuse.report.facts import convert_facts

    out, placed = _fp8(128, None, target_arch=90)
    _, kept = _fp8(64, target_arch=90)
    (a,) = placed.fp8["flash_attention"]
    t = {x["role"]: x for x in a["tensors"]}
    md = precision_markdown(placed)
    assert "FlashAttention nodes taking E4M3 q, k, v: 1" in md
    assert f"| {a['name']} | " + " | ".join(f"{t[r]['amax']:.4g} / {t[r]['scale']:.4g}" for r in "qkv") + " |" in md
    md = precision_markdown(kept)
    assert "FlashAttention nodes taking E4M3 q, k, v: 0" in md
    assert f"| {kept.fp8['flash_attention_kept'][0]['name']} | {D64_SM90} |" in md
    if missing_extra() is not None:
        pytest.skip("the report extra (jinja2, matplotlib) is not installed")
    for res, want in ((placed, f"{t['q']['amax']:.3g} / {t['q']['scale']:.3g}"), (kept, D64_SM90)):
        facts = convert_facts("block", tmp_path / "m.onnx", tmp_path, [], {}, res, {}, None)
        html = render_html(facts)
        assert "FlashAttention node" in html and want in html, want
    assert "Kept in fp16 by policy: FlashAttention x1" in render_html(convert_facts(
        "block", tmp_path / "m.onnx", tmp_path, [], {}, kept, {}, None))
