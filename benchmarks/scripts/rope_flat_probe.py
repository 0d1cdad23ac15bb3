"""Experiment: a flat elementwise RoPE kernel over contiguous [B, H, T, D] (the layout torch.compile's
kernels stream) against fuselm's per-position kernel, forward only, Llama-3-8B shapes, device time.
Usage (GPU): PYTHONPATH=src python benchmarks/scripts/rope_flat_probe.py"""

import itertools

import torch
import triton
import triton.language as tl

import fuselm

B, T, HQ, HK, D = 4, 4096, 32, 8, 128


@triton.jit
def flat_rope(
    x_ptr, y_ptr, cos_ptr, sin_ptr, n, T, H, D: tl.constexpr, XBLOCK: tl.constexpr, EVICT: tl.constexpr
):
    off = tl.program_id(0).to(tl.int64) * XBLOCK + tl.arange(0, XBLOCK)
    mask = off < n
    d = off % D
    row = off // D
    t = row % T
    b = row // (H * T)
    first = d < D // 2
    if EVICT:
        x = tl.load(x_ptr + off, mask=mask, eviction_policy="evict_first").to(tl.float32)
    else:
        x = tl.load(x_ptr + off, mask=mask).to(tl.float32)
    xp = tl.load(x_ptr + tl.where(first, off + D // 2, off - D // 2), mask=mask).to(tl.float32)
    cs = (b * T + t) * D + d
    c = tl.load(cos_ptr + cs, mask=mask, eviction_policy="evict_last").to(tl.float32)
    s = tl.load(sin_ptr + cs, mask=mask, eviction_policy="evict_last").to(tl.float32)
    y = x * c + tl.where(first, -xp, xp) * s
    tl.store(y_ptr + off, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rows_rope(x_ptr, y_ptr, cos_ptr, sin_ptr, n_rows, T, H, D: tl.constexpr, BLOCK_T: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < n_rows
    t = rows % T
    b = rows // (H * T)
    cols = tl.arange(0, D // 2)
    m = rmask[:, None]
    xp = x_ptr + rows[:, None] * D + cols[None, :]
    x1 = tl.load(xp, mask=m, eviction_policy="evict_first").to(tl.float32)
    x2 = tl.load(xp + D // 2, mask=m, eviction_policy="evict_first").to(tl.float32)
    cp = ((b * T + t) * D)[:, None] + cols[None, :]
    c1 = tl.load(cos_ptr + cp, mask=m).to(tl.float32)
    c2 = tl.load(cos_ptr + cp + D // 2, mask=m).to(tl.float32)
    s1 = tl.load(sin_ptr + cp, mask=m).to(tl.float32)
    s2 = tl.load(sin_ptr + cp + D // 2, mask=m).to(tl.float32)
    yp = y_ptr + rows[:, None] * D + cols[None, :]
    tl.store(yp, (x1 * c1 - x2 * s1).to(y_ptr.dtype.element_ty), mask=m)
    tl.store(yp + D // 2, (x2 * c2 + x1 * s2).to(y_ptr.dtype.element_ty), mask=m)


def main():
    torch.manual_seed(0)
    dev = "cuda"
    q = torch.randn(B, HQ, T, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, HK, T, D, device=dev, dtype=torch.bfloat16)
    ang = torch.randn(B, T, D // 2, device=dev)
    cos = torch.cat([ang.cos(), ang.cos()], -1).bfloat16()
    sin = torch.cat([ang.sin(), ang.sin()], -1).bfloat16()
    ref_q, ref_k = fuselm.apply_rotary(q, k, cos, sin)
    bench = lambda fn: min(triton.testing.do_bench(fn, warmup=25, rep=100) for _ in range(3))  # noqa: E731
    ms = bench(lambda: fuselm.apply_rotary(q, k, cos, sin))
    print(f"fuselm per-position kernel q+k fwd: {ms * 1e3:.1f} us (eager, host may show)")
    yq, yk = torch.empty_like(q), torch.empty_like(k)
    for xb, w, ev in itertools.product((512, 1024, 2048, 4096), (4, 8), (False, True)):

        def run(xb=xb, w=w, ev=ev):
            for x, y, h in ((q, yq, HQ), (k, yk, HK)):
                n = x.numel()
                flat_rope[(triton.cdiv(n, xb),)](
                    x, y, cos, sin, n, T, h, D, xb, ev, num_warps=w, enable_fp_fusion=False
                )

        run()
        ok = torch.equal(yq, ref_q) and torch.equal(yk, ref_k)
        print(f"flat XBLOCK {xb} warps {w} evict_first {ev}: {bench(run) * 1e3:.1f} us  equal={ok}")
    for bt, w in itertools.product((8, 16, 32, 64), (2, 4, 8)):

        def run(bt=bt, w=w):
            for x, y, h in ((q, yq, HQ), (k, yk, HK)):
                nr = x.numel() // D
                rows_rope[(triton.cdiv(nr, bt),)](
                    x, y, cos, sin, nr, T, h, D, bt, num_warps=w, enable_fp_fusion=False
                )

        run()
        ok = torch.equal(yq, ref_q) and torch.equal(yk, ref_k)
        print(f"rows BLOCK_T {bt} warps {w}: {bench(run) * 1e3:.1f} us  equal={ok}")


if __name__ == "__main__":
    main()
