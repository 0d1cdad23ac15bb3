"""RoPE kernel designs against torch.compile, forward direction, H100/H200, Llama-3-8B shapes (q [4, 32, 4096,
128], k [4, 8, 4096, 128] contiguous, cos/sin [4, 4096, 128] bf16), each launch timed as CUDA-graph replays.

- library: fuselm's per-position kernel (one program per (b, t), all q and k heads).
- flat: one launch over q then k as flat [B, H, T, D] element ranges, XBLOCK elements a program; the
  rotate-half partner loaded again (from L1), as inductor's pointwise kernel does.
- rows: one launch, a program per [BLOCK_T, D] tile of one (b, head) of q or k; the two halves loaded as
  [BLOCK_T, D/2] tiles.

Usage (GPU): PYTHONPATH=src:benchmarks python benchmarks/experiments/rope_variants.py
"""

import torch
import triton
import triton.language as tl

from fuselm_bench.harness import capture_graph
from fuselm_bench.rope import hf_apply_rotary_pos_emb
from fuselm.ops.rope.op import _launch

B, T, HQ, HK, D = 4, 4096, 32, 8, 128


@triton.jit
def _flat_block(
    x_ptr,
    o_ptr,
    cos_ptr,
    sin_ptr,
    block,
    T: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    XBLOCK: tl.constexpr,
    EVICT: tl.constexpr,
):
    idx = block.to(tl.int64) * XBLOCK + tl.arange(0, XBLOCK)
    d = idx % D
    t = (idx // D) % T
    b = idx // (D * T * H)
    cs = (b * T + t) * D + d
    half: tl.constexpr = D // 2
    first = d < half
    x = tl.load(x_ptr + idx, eviction_policy=EVICT).to(tl.float32)
    partner = tl.load(x_ptr + tl.where(first, idx + half, idx - half)).to(tl.float32)
    c = tl.load(cos_ptr + cs, eviction_policy="evict_last").to(tl.float32)
    s = tl.load(sin_ptr + cs, eviction_policy="evict_last").to(tl.float32)
    rot = tl.where(first, -partner, partner)
    tl.store(o_ptr + idx, (x * c + rot * s).to(o_ptr.dtype.element_ty))


@triton.jit
def rope_flat_kernel(
    q_ptr,
    k_ptr,
    qo_ptr,
    ko_ptr,
    cos_ptr,
    sin_ptr,
    q_blocks,
    T: tl.constexpr,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    D: tl.constexpr,
    XBLOCK: tl.constexpr,
    EVICT: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < q_blocks:
        _flat_block(q_ptr, qo_ptr, cos_ptr, sin_ptr, pid, T, HQ, D, XBLOCK, EVICT)
    else:
        _flat_block(k_ptr, ko_ptr, cos_ptr, sin_ptr, pid - q_blocks, T, HK, D, XBLOCK, EVICT)


@triton.jit
def _rows_tile(
    x_ptr,
    o_ptr,
    cos_ptr,
    sin_ptr,
    tile,
    T: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    tiles_per_head: tl.constexpr = T // BLOCK_T
    bh = (tile // tiles_per_head).to(tl.int64)
    t0 = (tile % tiles_per_head) * BLOCK_T
    b = bh // H
    half: tl.constexpr = D // 2
    ts = t0 + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, half)
    x_off = (bh * T + ts)[:, None] * D + cols[None, :]
    cs_off = (b * T + ts)[:, None] * D + cols[None, :]
    x1 = tl.load(x_ptr + x_off).to(tl.float32)
    x2 = tl.load(x_ptr + x_off + half).to(tl.float32)
    c1 = tl.load(cos_ptr + cs_off).to(tl.float32)
    c2 = tl.load(cos_ptr + cs_off + half).to(tl.float32)
    s1 = tl.load(sin_ptr + cs_off).to(tl.float32)
    s2 = tl.load(sin_ptr + cs_off + half).to(tl.float32)
    tl.store(o_ptr + x_off, (x1 * c1 - x2 * s1).to(o_ptr.dtype.element_ty))
    tl.store(o_ptr + x_off + half, (x2 * c2 + x1 * s2).to(o_ptr.dtype.element_ty))


@triton.jit
def rope_rows_kernel(
    q_ptr,
    k_ptr,
    qo_ptr,
    ko_ptr,
    cos_ptr,
    sin_ptr,
    q_tiles,
    T: tl.constexpr,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < q_tiles:
        _rows_tile(q_ptr, qo_ptr, cos_ptr, sin_ptr, pid, T, HQ, D, BLOCK_T)
    else:
        _rows_tile(k_ptr, ko_ptr, cos_ptr, sin_ptr, pid - q_tiles, T, HK, D, BLOCK_T)


def graph_us(fn):
    g = capture_graph(fn, torch.device("cuda"))
    ms = sorted(triton.testing.do_bench(g.replay, warmup=25, rep=200) for _ in range(3))
    return ms[1] * 1e3


def main():
    torch.manual_seed(0)
    q = torch.randn(B, HQ, T, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, HK, T, D, device="cuda", dtype=torch.bfloat16)
    ang = torch.randn(B, T, D // 2, device="cuda")
    cos = torch.cat([ang.cos(), ang.cos()], -1).bfloat16()
    sin = torch.cat([ang.sin(), ang.sin()], -1).bfloat16()
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    ref_q, ref_k = hf_apply_rotary_pos_emb(q, k, cos, sin)
    mb = (q.numel() + k.numel()) * 4 / 1e6
    src = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy = 2 * src.numel() * 2 / 1e6 / triton.testing.do_bench(lambda: dst.copy_(src)) / 1e3
    del src, dst
    print(f"{torch.cuda.get_device_name()} copy {copy:.2f} TB/s; {mb:.0f} MB per direction")

    def report(name, fn):
        fn()
        err = max(
            (qo.float() - ref_q.float()).abs().max().item(), (ko.float() - ref_k.float()).abs().max().item()
        )
        us = graph_us(fn)
        print(
            f"{name:44s} {us:7.1f} us  {mb / us:5.2f} TB/s  {mb / us / copy:5.3f}x copy  max err {err:.1e}",
            flush=True,
        )

    qv, kv, qov, kov = (t.transpose(1, 2) for t in (q, k, qo, ko))
    report(
        "library _launch (flat kernel for these inputs)",
        lambda: _launch(qv, kv, qov, kov, cos, sin, None, False),
    )
    wide_q = torch.empty(B, T, HQ, 2 * D, device="cuda", dtype=torch.bfloat16)[..., :D]
    wide_k = torch.empty(B, T, HK, 2 * D, device="cuda", dtype=torch.bfloat16)[..., :D]
    wide_q.copy_(qv)
    wide_k.copy_(kv)
    report(
        "library _launch, per-position kernel (not-dense input)",
        lambda: _launch(wide_q, wide_k, qov, kov, cos, sin, None, False),
    )
    compiled = torch.compile(hf_apply_rotary_pos_emb)
    for _ in range(3):
        compiled(q, k, cos, sin)

    us = graph_us(lambda: compiled(q, k, cos, sin))
    print(
        f"{'torch.compile (two kernels)':44s} {us:7.1f} us  {mb / us:5.2f} TB/s  {mb / us / copy:5.3f}x copy"
    )
    n_q, n_k = q.numel(), k.numel()
    for xblock, warps in ((512, 4), (1024, 4), (1024, 8), (2048, 8), (4096, 8), (2048, 16)):
        for evict in ("", "evict_first"):
            qb = n_q // xblock
            grid = (qb + n_k // xblock,)
            report(
                f"flat XBLOCK={xblock} warps={warps} {evict or 'no hint'}",
                lambda xblock=xblock, warps=warps, evict=evict, qb=qb, grid=grid: rope_flat_kernel[grid](
                    q,
                    k,
                    qo,
                    ko,
                    cos,
                    sin,
                    qb,
                    T=T,
                    HQ=HQ,
                    HK=HK,
                    D=D,
                    XBLOCK=xblock,
                    EVICT=evict,
                    num_warps=warps,
                    enable_fp_fusion=False,
                ),
            )
    for block_t, warps in ((8, 4), (16, 4), (32, 4), (32, 8), (64, 8)):
        q_tiles = B * HQ * (T // block_t)
        grid = (q_tiles + B * HK * (T // block_t),)
        report(
            f"rows BLOCK_T={block_t} warps={warps}",
            lambda block_t=block_t, warps=warps, q_tiles=q_tiles, grid=grid: rope_rows_kernel[grid](
                q,
                k,
                qo,
                ko,
                cos,
                sin,
                q_tiles,
                T=T,
                HQ=HQ,
                HK=HK,
                D=D,
                BLOCK_T=block_t,
                num_warps=warps,
                enable_fp_fusion=False,
            ),
        )


if __name__ == "__main__":
    main()
