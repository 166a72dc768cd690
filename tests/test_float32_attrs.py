"""Float attributes compiled into a kernel are taken at float32, what an ONNX attribute and a
TensorRT plugin field hold: the kernel ``optfuse kernels build`` prebuilds from a Python float
(1 / sqrt(128), 1e-5, 0.1) has the cache key an engine's plugin asks for with the stored float32."""

import struct

import pytest

from optfuse.kernels.cache import cache_key
from optfuse.kernels.registry import plugin_module


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


CASES = [
    ("flash_attention", "FlashAttention", "bfloat16", {"scale": 128 ** -0.5, "causal": 1}, "scale",
     {"head_dim": 128, "bias_shape": (), "arch": 90}),
    ("flash_attention", "FlashAttention", "float16", {"scale": 128 ** -0.5, "causal": 0}, "scale",
     {"head_dim": 128, "bias_shape": None, "arch": None}),
    ("flash_attention", "FlashAttention", "bfloat16", {"scale": 0.1, "causal": 1, "softcap": 30.1}, "softcap",
     {"head_dim": 64, "bias_shape": None, "arch": 90}),
    ("layer_norm", "LayerNorm", "float16", {"epsilon": 1e-5}, "epsilon", {"hidden": 768}),
    ("rms_norm", "RMSNorm", "bfloat16", {"epsilon": 1e-6}, "epsilon", {"hidden": 4096}),
    ("gemm", "GemmEpilogue", "float16", {"activation": "gelu_erf", "alpha": 0.1}, "alpha",
     {"N": 3072, "K": 768, "bias_mode": "vector", "residual_mode": "none", "arch": 90}),
]


@pytest.mark.parametrize("plugin,op,dtype,attrs,attr,static", CASES, ids=lambda c: c if isinstance(c, str) else None)
def test_float_attribute_at_float32_keeps_the_cache_key(plugin, op, dtype, attrs, attr, static):
    L = plugin_module(plugin, "launch")
    x = attrs[attr]
    assert _f32(x) != x  # the case is one where the two differ
    src_py = L.kernel_config(op, dtype, attrs, static)
    src_f32 = L.kernel_config(op, dtype, {**attrs, attr: _f32(x)}, static)
    assert src_py.name == src_f32.name
    assert cache_key(src_py, 90) == cache_key(src_f32, 90)
