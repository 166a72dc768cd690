"""GEMM with a fused epilogue in Triton (the matmul tutorial's schedule), for every arch.

    GemmEpilogue  y = act(ALPHA * (A @ W^T) + bias) + residual        (RESIDUAL_BEFORE = False)
                  y = act(ALPHA * (A @ W^T) + bias + residual)        (RESIDUAL_BEFORE = True)
    GatedGemm     y = act(A @ W^T) * (A @ W_up^T)                     (GATED; W is W_gate)

With FP8 (E4M3, ``tl.float8e4nv``) A and weights, each product is first scaled by
``a_scale * w_scale[n]`` (W_SCALE / W_UP_SCALE 1: one weight scale, 2: [N]; 0: no FP8, no scales),
then alpha, bias, activation and residual as above; y is stored in its own dtype (Y's element
type: the op's ``output_dtype``).

A: [M, K] rows contiguous (all leading dims of the op's A flattened: no copy); W, W_up: [N, K]
(torch.nn.Linear's layout, K contiguous); y: [M, N]. N and K are compile-time constants, M is the
int32 runtime argument. bias is absent (BIAS_MODE 0), one value (1: shape [] or [1]) or [N] (2);
residual is absent (RES_MODE 0), one value (1) or [M, N] (2). Absent inputs are ``None``
constexprs, so the runtime parameters are exactly TensorRT QDP's: the present inputs in spec order
(A, W, W_up, Bias, Residual, AScale, WScale, WUpScale), M, then y.

One program computes one BLOCK_M x BLOCK_N tile of y: it streams BLOCK_K slices of A and W through
shared memory (``num_stages`` deep, cp.async; the tensor cores by ``tl.dot``: mma on sm_80/sm_89,
wgmma on sm_90) into an FP32 accumulator, then applies the whole epilogue to the accumulator in
registers and stores y once: the pre-activation tensor never reaches HBM. GatedGemm keeps two
accumulators (gate and up) for the same tile of A, so A is read once for both products. With
EPILOGUE_SPLIT the epilogue runs on the two column halves of the tile in turn (the accumulator split
with ``tl.split``): half the residual tile and half the activation's temporaries are live at a time,
which keeps 128 x 256 tiles free of register spills.

Tile order: the 1-D grid walks GROUP_M row tiles per column tile before moving on (the tutorial's
grouped order), so programs running together share W's column panel and A's rows in L2.
Tails: rows past M and columns past N read clamped (wrapped) indices, which are valid addresses, and
are masked at the store; a K tail (K % BLOCK_K != 0) is masked at the loads (zeros).
FP16 / BF16 / FP8 operands run the tensor cores with FP32 accumulation (FP8: sm_89 mma, sm_90
wgmma); FP32 operands use IEEE FP32 dots
(``input_precision="ieee"``: no TF32 rounding). Row offsets are int64 (M * K may pass 2**31).
No TMA descriptors: device-side descriptors need global scratch, which the QDP launch cannot pass.
"""

import triton
import triton.language as tl


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))  # exp overflow gives 1/inf = 0: no NaN for large |x|


@triton.jit
def _tanh(x):
    # tanh(|x|) = (1 - e) / (1 + e), e = exp(-2|x|) <= 1: no overflow, full relative precision
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _activation(x, ACTIVATION: tl.constexpr):
    """The spec's activation (plugins/gemm/reference.py) on the FP32 tile ``x``."""
    if ACTIVATION == "relu":
        x = tl.maximum(x, 0.0)
    elif ACTIVATION == "gelu_erf":
        x = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACTIVATION == "gelu_tanh":
        # 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3)
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        x = x * _sigmoid(2.0 * u)
    elif ACTIVATION == "quick_gelu":
        x = x * _sigmoid(1.702 * x)
    elif ACTIVATION == "silu":
        x = x * _sigmoid(x)
    elif ACTIVATION == "sigmoid":
        x = _sigmoid(x)
    elif ACTIVATION == "tanh":
        x = _tanh(x)
    elif ACTIVATION == "relu2":
        x = tl.maximum(x, 0.0)
        x = x * x
    else:
        tl.static_assert(ACTIVATION == "none", "unknown activation")
    return x


@triton.jit
def _scaled(acc, AScale, WScale, cols, N: tl.constexpr, MODE: tl.constexpr):
    """``acc * a_scale * w_scale[cols]`` (MODE 2; MODE 1: one weight scale; 0: ``acc``)."""
    if MODE == 1:
        acc = acc * (tl.load(AScale) * tl.load(WScale))
    elif MODE == 2:
        acc = acc * (tl.load(AScale) * tl.load(WScale + cols % N))[None, :]
    else:
        tl.static_assert(MODE == 0, "unknown scale mode")
    return acc


@triton.jit
def _epilogue(acc, acc_up, Bias, Residual, AScale, WScale, WUpScale, Y, rows, cols, M, N: tl.constexpr,
              ALPHA: tl.constexpr, ACTIVATION: tl.constexpr, BIAS_MODE: tl.constexpr, RES_MODE: tl.constexpr,
              RESIDUAL_BEFORE: tl.constexpr, GATED: tl.constexpr, W_SCALE: tl.constexpr,
              W_UP_SCALE: tl.constexpr):
    """FP8 scales, alpha, bias, residual, activation (or the gate product), cast and store of the y
    tile at (rows, cols); rows past M and columns past N are not stored."""
    ok = (rows[:, None] < M) & (cols[None, :] < N)
    y_off = rows.to(tl.int64)[:, None] * N + cols[None, :]
    acc = _scaled(acc, AScale, WScale, cols, N, W_SCALE)
    if GATED:
        y = _activation(acc, ACTIVATION) * _scaled(acc_up, AScale, WUpScale, cols, N, W_UP_SCALE)
    else:
        y = acc
        if ALPHA != 1.0:
            y = y * ALPHA
        if BIAS_MODE == 1:
            y += tl.load(Bias).to(tl.float32)
        elif BIAS_MODE == 2:
            y += tl.load(Bias + cols % N).to(tl.float32)[None, :]
        if RES_MODE == 1:
            r = tl.load(Residual).to(tl.float32)
        elif RES_MODE == 2:
            r = tl.load(Residual + y_off, mask=ok, other=0.0).to(tl.float32)
        if RES_MODE != 0:
            if RESIDUAL_BEFORE:
                y += r
        y = _activation(y, ACTIVATION)
        if RES_MODE != 0:
            if not RESIDUAL_BEFORE:
                y += r
    tl.store(Y + y_off, y.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _gemm_epilogue_kernel(
        A, W, W_up, Bias, Residual, AScale, WScale, WUpScale, M, Y,
        N: tl.constexpr, K: tl.constexpr, ALPHA: tl.constexpr, ACTIVATION: tl.constexpr,
        BIAS_MODE: tl.constexpr, RES_MODE: tl.constexpr, RESIDUAL_BEFORE: tl.constexpr,
        GATED: tl.constexpr, W_SCALE: tl.constexpr, W_UP_SCALE: tl.constexpr, FP8_ACC: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EPILOGUE_SPLIT: tl.constexpr):
    # -- which tile: grouped order over a 1-D grid -------------------------------------------------
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    num_pid_in_group: tl.constexpr = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    # -- operand pointers: tail rows / columns wrap to valid ones (masked at the store) -------------
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows_a = (offs_m % M).to(tl.int64)
    cols_w = offs_n % N
    a_ptrs = A + rows_a[:, None] * K + offs_k[None, :]
    w_off = cols_w[None, :] * K + offs_k[:, None]  # W^T tile [BLOCK_K, BLOCK_N], K contiguous
    w_ptrs = W + w_off
    if GATED:
        u_ptrs = W_up + w_off
    IEEE: tl.constexpr = A.dtype.element_ty == tl.float32
    EVEN_K: tl.constexpr = K % BLOCK_K == 0

    # -- main loop: FP32 accumulation ---------------------------------------------------------------
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = offs_k < K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc, max_num_imprecise_acc=FP8_ACC)
        if GATED:
            if EVEN_K:
                u = tl.load(u_ptrs)
            else:
                u = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
            if IEEE:
                acc_up = tl.dot(a, u, acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(a, u, acc_up, max_num_imprecise_acc=FP8_ACC)
            u_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    # -- epilogue on the FP32 accumulator, in column halves when EPILOGUE_SPLIT ----------------------
    if EPILOGUE_SPLIT:
        HALF: tl.constexpr = BLOCK_N // 2
        acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF)), (0, 2, 1)))
        if GATED:
            up0, up1 = tl.split(tl.permute(tl.reshape(acc_up, (BLOCK_M, 2, HALF)), (0, 2, 1)))
        else:
            up0, up1 = acc0, acc1  # unused
        cols0 = pid_n * BLOCK_N + tl.arange(0, HALF)
        _epilogue(acc0, up0, Bias, Residual, AScale, WScale, WUpScale, Y, offs_m, cols0, M, N, ALPHA, ACTIVATION,
                  BIAS_MODE, RES_MODE, RESIDUAL_BEFORE, GATED, W_SCALE, W_UP_SCALE)
        _epilogue(acc1, up1, Bias, Residual, AScale, WScale, WUpScale, Y, offs_m, cols0 + HALF, M, N, ALPHA,
                  ACTIVATION, BIAS_MODE, RES_MODE, RESIDUAL_BEFORE, GATED, W_SCALE, W_UP_SCALE)
    else:
        if not GATED:
            acc_up = acc  # unused
        _epilogue(acc, acc_up, Bias, Residual, AScale, WScale, WUpScale, Y, offs_m, offs_n, M, N, ALPHA, ACTIVATION,
                  BIAS_MODE, RES_MODE, RESIDUAL_BEFORE, GATED, W_SCALE, W_UP_SCALE)
