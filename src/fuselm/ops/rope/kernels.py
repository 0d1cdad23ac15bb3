"""Triton kernels of rotary position embedding (Hugging Face's rotate_half convention). The math is in
README.md.

rope_fwd_kernel_dense (q, k and the outputs dense, in [B, H, T, D] or [B, T, H, D] memory order: what
attention layers pass): one launch over q's rows (heads at one position) then k's, BLOCK_ROWS
consecutive rows a program, each element rotated with its rotate_half partner (a second load of the
same lines, from L1) and its position's cos/sin (from L1/L2). Every DRAM access streams.

rope_fwd_kernel (any strides, e.g. slices of a fused qkv projection): one program per (b, t) position:
it loads that position's cos/sin row once, then rotates every head of q and then every head of k (one
launch for both; GQA head counts may differ) in [BLOCK_H, BLOCK_R] tiles of the two halves of the rotary
part, and copies the pass-through columns (partial rotary).

Each kernel does the backward too, with IS_BWD=True: the transpose of the rotation by theta is the
rotation by -theta, i.e. sin negated with its two halves swapped (the swap only matters when the two
halves of sin differ; Hugging Face's cat(freqs, freqs) tables have equal halves).
"""

import triton
import triton.language as tl


@triton.jit
def _table_rows(
    b,
    t,
    mask,
    cos_ptr,
    cos_stride_b,
    cos_stride_t,
    sin_ptr,
    sin_stride_b,
    sin_stride_t,
    pos_ptr,
    pos_stride_b,
    pos_stride_t,
    n_pos,
    HAS_POS: tl.constexpr,
):
    """(cos row, sin row, position in range) of position (b, t) (int64, scalars or vectors; mask: which
    are read): row (b, t) of [B, T, R] tables, or with HAS_POS row position_ids[b, t] of [P, R] tables,
    row 0 when that is out of range (the caller writes NaN there: never an out-of-bounds read)."""
    if HAS_POS:
        p = tl.load(pos_ptr + b * pos_stride_b + t * pos_stride_t, mask=mask, other=0).to(tl.int64)
        in_range = (p >= 0) & (p < n_pos)
        p = tl.where(in_range, p, 0)
        c_row = cos_ptr + p * cos_stride_t
        s_row = sin_ptr + p * sin_stride_t
    else:
        in_range = True
        c_row = cos_ptr + b * cos_stride_b + t * cos_stride_t
        s_row = sin_ptr + b * sin_stride_b + t * sin_stride_t
    return c_row, s_row, in_range


@triton.jit
def _load_tile(
    x_row,
    x_head_stride,
    y_row,
    y_head_stride,
    h0,
    N_HEADS: tl.constexpr,
    ROT_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Heads h0.. of one position (x_row / y_row point at head 0, column 0): the two rotary halves
    [BH, BR] of x in fp32, the pointers to the first half of y, and the mask."""
    heads = tl.cast(h0, tl.int64) + tl.arange(0, BLOCK_H)  # int64: heads * stride may pass 2^31
    cols = tl.arange(0, BLOCK_R)
    if BLOCK_R == ROT_HALF:
        mask = tl.broadcast_to((heads < N_HEADS)[:, None], (BLOCK_H, BLOCK_R))
    else:
        mask = (heads < N_HEADS)[:, None] & (cols < ROT_HALF)[None, :]
    x_ptrs = x_row + heads[:, None] * x_head_stride + cols[None, :]
    x1 = tl.load(x_ptrs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    x2 = tl.load(x_ptrs + ROT_HALF, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    return x1, x2, y_row + heads[:, None] * y_head_stride + cols[None, :], mask


@triton.jit
def _rotate_store(y_ptrs, mask, x1, x2, c1, c2, s1, s2, ROT_HALF: tl.constexpr):
    """[x1, x2] * [c1, c2] + [-x2, x1] * [s1, s2], each product rounded (as eager fp32 PyTorch)."""
    y1 = x1 * c1[None, :] - x2 * s1[None, :]
    y2 = x2 * c2[None, :] + x1 * s2[None, :]
    tl.store(y_ptrs, y1.to(y_ptrs.dtype.element_ty), mask=mask)
    tl.store(y_ptrs + ROT_HALF, y2.to(y_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _copy_pass(
    x_row,
    x_head_stride,
    y_row,
    y_head_stride,
    h0,
    N_HEADS: tl.constexpr,
    ROT_HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Partial rotary: copy columns [R, D) of heads h0.. unchanged."""
    heads = tl.cast(h0, tl.int64) + tl.arange(0, BLOCK_H)
    pcols = tl.arange(0, BLOCK_P)
    for p0 in range(2 * ROT_HALF, HEAD_DIM, BLOCK_P):
        pc = p0 + pcols
        mask = (heads < N_HEADS)[:, None] & (pc < HEAD_DIM)[None, :]
        xp = tl.load(x_row + heads[:, None] * x_head_stride + pc[None, :], mask=mask)
        tl.store(y_row + heads[:, None] * y_head_stride + pc[None, :], xp, mask=mask)


@triton.jit
def _rope_heads(
    x_row,
    x_head_stride,
    y_row,
    y_head_stride,
    c1,
    c2,
    s1,
    s2,
    N_HEADS: tl.constexpr,
    ROT_HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """All heads of one position, tile after tile."""
    for h0 in range(0, N_HEADS, BLOCK_H):
        x1, x2, y_ptrs, mask = _load_tile(
            x_row, x_head_stride, y_row, y_head_stride, h0, N_HEADS, ROT_HALF, BLOCK_H, BLOCK_R
        )
        _rotate_store(y_ptrs, mask, x1, x2, c1, c2, s1, s2, ROT_HALF)
        if 2 * ROT_HALF < HEAD_DIM:
            _copy_pass(
                x_row, x_head_stride, y_row, y_head_stride, h0, N_HEADS, ROT_HALF, HEAD_DIM, BLOCK_H, BLOCK_P
            )


@triton.jit
def rope_fwd_kernel(
    q_ptr,
    q_stride_b,
    q_stride_t,
    q_stride_h,
    k_ptr,
    k_stride_b,
    k_stride_t,
    k_stride_h,
    q_out_ptr,
    q_out_stride_b,
    q_out_stride_t,
    q_out_stride_h,
    k_out_ptr,
    k_out_stride_b,
    k_out_stride_t,
    k_out_stride_h,
    cos_ptr,
    cos_stride_b,
    cos_stride_t,
    sin_ptr,
    sin_stride_b,
    sin_stride_t,
    pos_ptr,
    pos_stride_b,
    pos_stride_t,
    n_pos,
    seq_len,
    N_QH: tl.constexpr,
    N_KH: tl.constexpr,
    ROT_HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_POS: tl.constexpr,
    IS_BWD: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """q/k (and outputs) indexed [b, t, h, d] through their strides (d stride 1). Without HAS_POS,
    cos/sin are [B, T, R] (stride_b 0 when broadcast); with HAS_POS they are tables [P, R] (row stride in
    stride_t) read at position_ids[b, t]. IS_BWD: q/k are the output gradients, the outputs dq/dk."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // seq_len
    t = pid - b * seq_len
    cols = tl.arange(0, BLOCK_R)
    cmask = cols < ROT_HALF
    c_row, s_row, in_range = _table_rows(
        b,
        t,
        b >= 0,
        cos_ptr,
        cos_stride_b,
        cos_stride_t,
        sin_ptr,
        sin_stride_b,
        sin_stride_t,
        pos_ptr,
        pos_stride_b,
        pos_stride_t,
        n_pos,
        HAS_POS,
    )
    c1 = tl.load(c_row + cols, mask=cmask, other=0.0).to(tl.float32)  # [BR]
    c2 = tl.load(c_row + ROT_HALF + cols, mask=cmask, other=0.0).to(tl.float32)
    s1 = tl.load(s_row + cols, mask=cmask, other=0.0).to(tl.float32)
    s2 = tl.load(s_row + ROT_HALF + cols, mask=cmask, other=0.0).to(tl.float32)
    if HAS_POS:
        c1 = tl.where(in_range, c1, float("nan"))
        c2 = tl.where(in_range, c2, float("nan"))
        s1 = tl.where(in_range, s1, float("nan"))
        s2 = tl.where(in_range, s2, float("nan"))
    if IS_BWD:
        # rotation by -theta: [g1, g2] * [c1, c2] + [-g2, g1] * [-s2, -s1]
        s_tmp = s1
        s1 = -s2
        s2 = -s_tmp

    q_row = q_ptr + b * q_stride_b + t * q_stride_t
    k_row = k_ptr + b * k_stride_b + t * k_stride_t
    q_out_row = q_out_ptr + b * q_out_stride_b + t * q_out_stride_t
    k_out_row = k_out_ptr + b * k_out_stride_b + t * k_out_stride_t
    if N_QH <= BLOCK_HQ and N_KH <= BLOCK_HK:
        # one tile each (the usual case): every load is issued before the first store
        q1, q2, q_out_ptrs, q_mask = _load_tile(
            q_row, q_stride_h, q_out_row, q_out_stride_h, 0, N_QH, ROT_HALF, BLOCK_HQ, BLOCK_R
        )
        k1, k2, k_out_ptrs, k_mask = _load_tile(
            k_row, k_stride_h, k_out_row, k_out_stride_h, 0, N_KH, ROT_HALF, BLOCK_HK, BLOCK_R
        )
        _rotate_store(q_out_ptrs, q_mask, q1, q2, c1, c2, s1, s2, ROT_HALF)
        _rotate_store(k_out_ptrs, k_mask, k1, k2, c1, c2, s1, s2, ROT_HALF)
        if 2 * ROT_HALF < HEAD_DIM:
            _copy_pass(
                q_row, q_stride_h, q_out_row, q_out_stride_h, 0, N_QH, ROT_HALF, HEAD_DIM, BLOCK_HQ, BLOCK_P
            )
            _copy_pass(
                k_row, k_stride_h, k_out_row, k_out_stride_h, 0, N_KH, ROT_HALF, HEAD_DIM, BLOCK_HK, BLOCK_P
            )
    else:
        _rope_heads(
            q_row,
            q_stride_h,
            q_out_row,
            q_out_stride_h,
            c1,
            c2,
            s1,
            s2,
            N_QH,
            ROT_HALF,
            HEAD_DIM,
            BLOCK_HQ,
            BLOCK_R,
            BLOCK_P,
        )
        _rope_heads(
            k_row,
            k_stride_h,
            k_out_row,
            k_out_stride_h,
            c1,
            c2,
            s1,
            s2,
            N_KH,
            ROT_HALF,
            HEAD_DIM,
            BLOCK_HK,
            BLOCK_R,
            BLOCK_P,
        )


@triton.jit
def _rotate_dense_rows(
    x_ptr,
    y_ptr,
    block,
    n_rows,
    seq_len,
    cos_ptr,
    cos_stride_b,
    cos_stride_t,
    sin_ptr,
    sin_stride_b,
    sin_stride_t,
    pos_ptr,
    pos_stride_b,
    pos_stride_t,
    n_pos,
    N_HEADS: tl.constexpr,
    HEAD_MAJOR: tl.constexpr,
    ROT_HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_POS: tl.constexpr,
    IS_BWD: tl.constexpr,
    INDEX_64: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Rows block*BLOCK_ROWS.. of one dense tensor x seen as [rows, HEAD_DIM] (memory order [B, H, T, D]
    if HEAD_MAJOR, else [B, T, H, D]) rotated into y (the same order): consecutive rows, so the tile is
    one contiguous run of memory when HEAD_DIM == BLOCK_D. (b, t) is found per row, not per element."""
    if INDEX_64:
        rows = tl.cast(block, tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # [BR]
    else:
        rows = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < n_rows
    if HEAD_MAJOR:
        bh = rows // seq_len
        t = rows - bh * seq_len
        b = bh // N_HEADS
    else:
        bt = rows // N_HEADS
        b = bt // seq_len
        t = bt - b * seq_len
    b = b.to(tl.int64)
    t = t.to(tl.int64)
    cols = tl.arange(0, BLOCK_D)  # [BD]
    first = cols < ROT_HALF
    partner_col = tl.where(first, cols + ROT_HALF, cols - ROT_HALF)
    mask = row_ok[:, None] & (cols < HEAD_DIM)[None, :]  # [BR, BD]
    rot_mask = row_ok[:, None] & (cols < 2 * ROT_HALF)[None, :]
    x_row = x_ptr + rows[:, None] * HEAD_DIM
    x = tl.load(x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(x_row + partner_col[None, :], mask=rot_mask, other=0.0).to(tl.float32)  # from L1
    c_row, s_row, in_range = _table_rows(
        b,
        t,
        row_ok,
        cos_ptr,
        cos_stride_b,
        cos_stride_t,
        sin_ptr,
        sin_stride_b,
        sin_stride_t,
        pos_ptr,
        pos_stride_b,
        pos_stride_t,
        n_pos,
        HAS_POS,
    )
    c = tl.load(c_row[:, None] + cols[None, :], mask=rot_mask, other=0.0).to(tl.float32)
    if IS_BWD:
        # transpose: dx1 = g1 * c1 + g2 * s2, dx2 = g2 * c2 - g1 * s1 (the partner's sin)
        s = tl.load(s_row[:, None] + partner_col[None, :], mask=rot_mask, other=0.0).to(tl.float32)
        rotated = tl.where(first[None, :], partner, -partner)
    else:
        # y1 = x1 * c1 - x2 * s1, y2 = x2 * c2 + x1 * s2
        s = tl.load(s_row[:, None] + cols[None, :], mask=rot_mask, other=0.0).to(tl.float32)
        rotated = tl.where(first[None, :], -partner, partner)
    y = x * c + rotated * s
    if HAS_POS:
        y = tl.where(in_range[:, None], y, float("nan"))
    y = tl.where((cols < 2 * ROT_HALF)[None, :], y, x)  # pass-through columns (partial rotary) copied
    tl.store(y_ptr + rows[:, None] * HEAD_DIM + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rope_fwd_kernel_dense(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    q_rows,
    k_rows,
    q_blocks,
    seq_len,
    cos_ptr,
    cos_stride_b,
    cos_stride_t,
    sin_ptr,
    sin_stride_b,
    sin_stride_t,
    pos_ptr,
    pos_stride_b,
    pos_stride_t,
    n_pos,
    N_QH: tl.constexpr,
    N_KH: tl.constexpr,
    Q_HEAD_MAJOR: tl.constexpr,
    K_HEAD_MAJOR: tl.constexpr,
    ROT_HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_POS: tl.constexpr,
    IS_BWD: tl.constexpr,
    INDEX_64: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Programs 0 .. q_blocks - 1 rotate q's elements, the others k's; cos/sin and position_ids as in
    rope_fwd_kernel. IS_BWD: q/k are the output gradients, the outputs dq/dk."""
    pid = tl.program_id(0)
    if pid < q_blocks:
        _rotate_dense_rows(
            q_ptr,
            q_out_ptr,
            pid,
            q_rows,
            seq_len,
            cos_ptr,
            cos_stride_b,
            cos_stride_t,
            sin_ptr,
            sin_stride_b,
            sin_stride_t,
            pos_ptr,
            pos_stride_b,
            pos_stride_t,
            n_pos,
            N_QH,
            Q_HEAD_MAJOR,
            ROT_HALF,
            HEAD_DIM,
            HAS_POS,
            IS_BWD,
            INDEX_64,
            BLOCK_ROWS,
            BLOCK_D,
        )
    else:
        _rotate_dense_rows(
            k_ptr,
            k_out_ptr,
            pid - q_blocks,
            k_rows,
            seq_len,
            cos_ptr,
            cos_stride_b,
            cos_stride_t,
            sin_ptr,
            sin_stride_b,
            sin_stride_t,
            pos_ptr,
            pos_stride_b,
            pos_stride_t,
            n_pos,
            N_KH,
            K_HEAD_MAJOR,
            ROT_HALF,
            HEAD_DIM,
            HAS_POS,
            IS_BWD,
            INDEX_64,
            BLOCK_ROWS,
            BLOCK_D,
        )
