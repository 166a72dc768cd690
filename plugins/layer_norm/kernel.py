"""LayerNorm / SkipLayerNorm forward as Triton kernels (AOT-compiled by optfuse.kernels).

One program normalizes BLOCK_M rows held in registers as a [BLOCK_M, BLOCK_N] tile
(BLOCK_N = next power of two >= HIDDEN, masked): one read of x (and skip), one write of y
(and of the sum). Statistics in FP32 whatever the I/O dtype: two-pass mean / variance over the
registers, so FP16 inputs up to 65504 cannot overflow. HIDDEN and EPS are compile-time
constants (TensorRT AOT plugins get int32 extra args only), the row count is the one runtime
argument.

FP8_OUT (the ``*_fp8_fwd`` entries): y is float8e4m3fn, saturate(round(y / y_scale)) from the FP32
value: an IEEE division (``div_rn``, QuantizeLinear's float32 arithmetic), an explicit clamp to
+-448 that keeps NaN (Triton's fp32 -> fp8e4nv cast is not guaranteed to saturate), then the cast
(round to nearest even); Y is a byte pointer (``*u8``) taking the E4M3 bits. y_scale is a float32
[1] input after beta; the sum stays in the I/O dtype.

Parameter order is TensorRT QDP's: inputs, int32 extra args, outputs (Triton appends its two
scratch pointers).
"""

import triton
import triton.language as tl


E4M3_MAX = tl.constexpr(448.0)


@triton.jit
def _layer_norm_tile(
    X, SKIP, W, B, YS, Y, S, rows,
    HIDDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EPS: tl.constexpr,
    HAS_SKIP: tl.constexpr, X_EVICT: tl.constexpr, FP8_OUT: tl.constexpr,
):
    pid = tl.program_id(0)
    row = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    col = tl.arange(0, BLOCK_N)
    row_ok = row < rows
    col_ok = col < HIDDEN
    mask = row_ok[:, None] & col_ok[None, :]
    offs = row.to(tl.int64)[:, None] * HIDDEN + col[None, :]

    # X_EVICT: L2 priority of the streamed loads ("" or "evict_last"; README "Tried")
    x = tl.load(X + offs, mask=mask, other=0.0, eviction_policy=X_EVICT)
    if HAS_SKIP:
        k = tl.load(SKIP + offs, mask=mask, other=0.0, eviction_policy=X_EVICT)
        # The residual sum is rounded to the I/O dtype (as the unfused Add would), and the
        # normalization reads that rounded value.
        x = (x.to(tl.float32) + k.to(tl.float32)).to(S.dtype.element_ty)
        tl.store(S + offs, x, mask=mask)
    xf = x.to(tl.float32)
    mean = tl.sum(xf, axis=1) / HIDDEN
    xc = tl.where(mask, xf - mean[:, None], 0.0)
    var = tl.sum(xc * xc, axis=1) / HIDDEN
    rstd = 1.0 / tl.sqrt_rn(var + EPS)
    w = tl.load(W + col, mask=col_ok, other=0.0, eviction_policy="evict_last").to(tl.float32)
    b = tl.load(B + col, mask=col_ok, other=0.0, eviction_policy="evict_last").to(tl.float32)
    y = xc * rstd[:, None] * w[None, :] + b[None, :]
    if FP8_OUT:
        q = tl.math.div_rn(y, tl.load(YS))
        q = tl.clamp(q, -E4M3_MAX, E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
        tl.store(Y + offs, q.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=mask)
    else:
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def layer_norm_fwd(
    X, W, B, rows, Y,
    HIDDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EPS: tl.constexpr,
    X_EVICT: tl.constexpr,
):
    """LayerNorm: inputs (x, gamma, beta), extra (rows), outputs (y)."""
    _layer_norm_tile(X, X, W, B, X, Y, Y, rows, HIDDEN, BLOCK_M, BLOCK_N, EPS, False, X_EVICT, False)


@triton.jit
def skip_layer_norm_fwd(
    X, SKIP, W, B, rows, Y, S,
    HIDDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EPS: tl.constexpr,
    X_EVICT: tl.constexpr,
):
    """SkipLayerNorm: inputs (x, skip, gamma, beta), extra (rows), outputs (y, sum)."""
    _layer_norm_tile(X, SKIP, W, B, X, Y, S, rows, HIDDEN, BLOCK_M, BLOCK_N, EPS, True, X_EVICT, False)


@triton.jit
def layer_norm_fp8_fwd(
    X, W, B, YS, rows, Y,
    HIDDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EPS: tl.constexpr,
    X_EVICT: tl.constexpr,
):
    """LayerNorm, FP8 y: inputs (x, gamma, beta, y_scale), extra (rows), outputs (y: E4M3 bytes)."""
    _layer_norm_tile(X, X, W, B, YS, Y, Y, rows, HIDDEN, BLOCK_M, BLOCK_N, EPS, False, X_EVICT, True)


@triton.jit
def skip_layer_norm_fp8_fwd(
    X, SKIP, W, B, YS, rows, Y, S,
    HIDDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EPS: tl.constexpr,
    X_EVICT: tl.constexpr,
):
    """SkipLayerNorm, FP8 y: inputs (x, skip, gamma, beta, y_scale), extra (rows), outputs (y: E4M3 bytes, sum)."""
    _layer_norm_tile(X, SKIP, W, B, YS, Y, S, rows, HIDDEN, BLOCK_M, BLOCK_N, EPS, True, X_EVICT, True)
