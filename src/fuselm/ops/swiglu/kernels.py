"""Triton kernels of the gated activations (SwiGLU, GeGLU). The math is in README.md.

Pure streaming kernels: every element is read once and written once, no reductions. A program
owns a [BLOCK_R, BLOCK_C] tile of the [n_rows, n_cols] problem (1-D grid, column blocks fastest).
When every operand's rows are contiguous the launcher passes FLAT: the tensors are one row of
n_rows * n_cols elements and a program owns BLOCK_C consecutive elements (no division, no row
stride, all loads 16-byte vectors). Offsets are int64 throughout.
"""

import triton
import triton.language as tl

SILU = tl.constexpr(0)
GELU_TANH = tl.constexpr(1)
GELU = tl.constexpr(2)

TWO_SQRT_2_OVER_PI = tl.constexpr(1.5957691216057308)  # 2 * sqrt(2 / pi)
GELU_C = tl.constexpr(0.044715)
THREE_GELU_C = tl.constexpr(0.134145)
INV_SQRT2 = tl.constexpr(0.7071067811865476)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _act(g, ACTIVATION: tl.constexpr):
    """act(g), g in fp32."""
    if ACTIVATION == SILU:
        a = g * _sigmoid(g)
    elif ACTIVATION == GELU_TANH:
        # 0.5 g (1 + tanh(y)) == g * sigmoid(2y): no tanh needed
        a = g * _sigmoid((g + g * g * g * GELU_C) * TWO_SQRT_2_OVER_PI)
    else:
        a = 0.5 * g * (1.0 + tl.erf(g * INV_SQRT2))
    return a


@triton.jit
def _act_and_grad(g, ACTIVATION: tl.constexpr):
    """(act(g), act'(g)), g in fp32."""
    if ACTIVATION == SILU:
        s = _sigmoid(g)
        a = g * s
        da = s * (1.0 + g * (1.0 - s))
    elif ACTIVATION == GELU_TANH:
        s = _sigmoid((g + g * g * g * GELU_C) * TWO_SQRT_2_OVER_PI)
        a = g * s
        da = s + a * (1.0 - s) * ((1.0 + g * g * THREE_GELU_C) * TWO_SQRT_2_OVER_PI)
    else:
        cdf = 0.5 * (1.0 + tl.erf(g * INV_SQRT2))
        a = g * cdf
        da = cdf + g * tl.exp(-0.5 * g * g) * INV_SQRT_2PI
    return a, da


@triton.jit
def _tile(
    n_rows, n_cols, FLAT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, REVERSE: tl.constexpr
):
    """Row indices [BLOCK_R, 1], column indices [1, BLOCK_C] (int64) and the mask of this program's tile.
    REVERSE walks the tiles last to first."""
    pid = tl.program_id(0).to(tl.int64)
    if REVERSE:
        pid = tl.num_programs(0).to(tl.int64) - 1 - pid
    if FLAT:
        rows = tl.zeros((1, 1), dtype=tl.int64)
        cols = (pid * BLOCK_C + tl.arange(0, BLOCK_C))[None, :]
        mask = cols < n_cols
    else:
        n_col_blocks = tl.cdiv(n_cols, BLOCK_C)
        rows = ((pid // n_col_blocks) * BLOCK_R + tl.arange(0, BLOCK_R))[:, None]
        cols = ((pid % n_col_blocks) * BLOCK_C + tl.arange(0, BLOCK_C))[None, :]
        mask = (rows < n_rows) & (cols < n_cols)
    return rows, cols, mask


@triton.jit
def _ptrs(base, rows, cols, row_stride, FLAT: tl.constexpr):
    if FLAT:
        p = base + cols
    else:
        p = base + rows * row_stride + cols
    return p


@triton.jit
def swiglu_fwd_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    gate_row_stride,
    up_row_stride,
    out_row_stride,
    n_rows,
    n_cols,
    ACTIVATION: tl.constexpr,
    FLAT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """out = act(gate) * up: reads gate and up once, writes out once."""
    rows, cols, mask = _tile(n_rows, n_cols, FLAT, BLOCK_R, BLOCK_C, False)  # [BLOCK_R, BLOCK_C] tile
    g = tl.load(_ptrs(gate_ptr, rows, cols, gate_row_stride, FLAT), mask=mask, other=0.0).to(tl.float32)
    u = tl.load(_ptrs(up_ptr, rows, cols, up_row_stride, FLAT), mask=mask, other=0.0).to(tl.float32)
    out = _act(g, ACTIVATION) * u
    tl.store(_ptrs(out_ptr, rows, cols, out_row_stride, FLAT), out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_bwd_kernel(
    dout_ptr,
    gate_ptr,
    up_ptr,
    dgate_ptr,
    dup_ptr,
    out_ptr,
    dout_row_stride,
    gate_row_stride,
    up_row_stride,
    dgate_row_stride,
    dup_row_stride,
    out_row_stride,
    n_rows,
    n_cols,
    ACTIVATION: tl.constexpr,
    HAS_OUT: tl.constexpr,
    FLAT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """dgate = dout * up * act'(gate), dup = dout * act(gate), the activation recomputed from gate;
    with HAS_OUT also out = act(gate) * up. dgate may alias dout (each element is read, then written,
    by the same thread). Tiles go last to first: the end of gate and up, read last by the forward
    (or of dout, written last by the GEMM before), is what may still sit in L2."""
    rows, cols, mask = _tile(n_rows, n_cols, FLAT, BLOCK_R, BLOCK_C, True)  # [BLOCK_R, BLOCK_C] tile
    d = tl.load(_ptrs(dout_ptr, rows, cols, dout_row_stride, FLAT), mask=mask, other=0.0).to(tl.float32)
    g = tl.load(_ptrs(gate_ptr, rows, cols, gate_row_stride, FLAT), mask=mask, other=0.0).to(tl.float32)
    u = tl.load(_ptrs(up_ptr, rows, cols, up_row_stride, FLAT), mask=mask, other=0.0).to(tl.float32)
    a, da = _act_and_grad(g, ACTIVATION)
    dgate = d * u * da
    dup = d * a
    tl.store(
        _ptrs(dgate_ptr, rows, cols, dgate_row_stride, FLAT), dgate.to(dgate_ptr.dtype.element_ty), mask=mask
    )
    tl.store(_ptrs(dup_ptr, rows, cols, dup_row_stride, FLAT), dup.to(dup_ptr.dtype.element_ty), mask=mask)
    if HAS_OUT:
        tl.store(
            _ptrs(out_ptr, rows, cols, out_row_stride, FLAT), (a * u).to(out_ptr.dtype.element_ty), mask=mask
        )
