"""dW += G^T X for one token chunk of the chunked linear-cross-entropy plan: cuBLAS addmm (beta = 1: the
epilogue reads dW back) against Triton GEMMs that load the dW tile first and accumulate on it.

G [C, V] (the chunk's gradient, row-major), X [C, H], dW [V, H] bf16. K = C is short (512 rows at
Gemma-2's head under a 256 MiB budget), so each output tile does little math per byte of dW moved
(2 C FLOPs per 4 bytes of dW read and written): the GEMM is close to the ridge point and the dW traffic
decides. Tiles are ordered H-fastest so that a [C, BLOCK_V] column block of G is read from DRAM once.

Usage (GPU): PYTHONPATH=src python benchmarks/experiments/dw_accumulate.py
"""

import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _tile_coords(tile, n_h_tiles):
    return tile // n_h_tiles, tile % n_h_tiles


@triton.jit
def dw_accumulate_kernel(
    g_ptr, x_ptr, dw_ptr, c, v, h, n_tiles,
    BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, PERSISTENT: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, STAGES: tl.constexpr,
):
    n_h_tiles = tl.cdiv(h, BLOCK_H)
    start = tl.program_id(0)
    step = NUM_PROGRAMS if PERSISTENT else n_tiles
    for tile in range(start, n_tiles, step):
        vt, ht = _tile_coords(tile, n_h_tiles)
        offs_v = vt * BLOCK_V + tl.arange(0, BLOCK_V)
        offs_h = ht * BLOCK_H + tl.arange(0, BLOCK_H)
        v_mask = offs_v < v
        h_mask = offs_h < h
        dw_ptrs = dw_ptr + offs_v[:, None].to(tl.int64) * h + offs_h[None, :]
        tile_mask = v_mask[:, None] & h_mask[None, :]
        acc = tl.load(dw_ptrs, mask=tile_mask, other=0.0).to(tl.float32)  # [BV, BH], issued first
        offs_k = tl.arange(0, BLOCK_K)
        g_ptrs = g_ptr + offs_k[None, :].to(tl.int64) * v + offs_v[:, None]  # [BV, BK] view of G^T
        x_ptrs = x_ptr + offs_k[:, None].to(tl.int64) * h + offs_h[None, :]  # [BK, BH]
        for k in tl.range(0, tl.cdiv(c, BLOCK_K), num_stages=STAGES):
            k_mask = offs_k < c - k * BLOCK_K
            a = tl.load(g_ptrs, mask=v_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(x_ptrs, mask=k_mask[:, None] & h_mask[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
            g_ptrs += BLOCK_K * v
            x_ptrs += BLOCK_K * h
        tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=tile_mask)


def triton_addmm(dw, g, x, block_v, block_h, block_k, warps, stages, persistent, programs_per_sm=1):
    c, v = g.shape
    h = x.shape[1]
    n_tiles = triton.cdiv(v, block_v) * triton.cdiv(h, block_h)
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count if dw.is_cuda else 4
    programs = min(n_tiles, n_sm * programs_per_sm) if persistent else n_tiles
    dw_accumulate_kernel[(programs,)](
        g, x, dw, c, v, h, n_tiles, BLOCK_V=block_v, BLOCK_H=block_h, BLOCK_K=block_k,
        PERSISTENT=persistent, NUM_PROGRAMS=programs, STAGES=stages, num_warps=warps,
    )


CONFIGS = [
    (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 4, 4), (128, 128, 64, 8, 4),
    (256, 128, 64, 8, 3), (128, 256, 32, 8, 4),
]


def main():
    if "--cpu-check" in sys.argv:
        g = torch.randn(40, 200, dtype=torch.float16)
        x = torch.randn(40, 72, dtype=torch.float16)
        dw = torch.randn(200, 72, dtype=torch.float16)
        ref = dw.float() + g.float().t() @ x.float()
        for persistent in (False, True):
            out = dw.clone()
            triton_addmm(out, g, x, 32, 32, 16, 4, 2, persistent)
            print("persistent" if persistent else "grid", (out.float() - ref).abs().max().item())
        return
    gemm_a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: gemm_a @ gemm_a, warmup=25, rep=100, return_mode="median")
    print(f"{torch.cuda.get_device_name()} bf16 GEMM 8192^3 {2 * 8192**3 / ms / 1e9:.0f} TFLOP/s")
    del gemm_a
    for c, h, v in ((512, 2304, 256000), (976, 4096, 128256)):
        g = torch.randn(c, v, device="cuda", dtype=torch.bfloat16) * 1e-3
        x = torch.randn(c, h, device="cuda", dtype=torch.bfloat16)
        dw0 = torch.randn(v, h, device="cuda", dtype=torch.bfloat16) * 1e-2
        ref = dw0.float().addmm(g.float().t(), x.float())
        flop = 2 * c * h * v
        dw = dw0.clone()
        ms = triton.testing.do_bench(lambda: dw.addmm_(g.t(), x), warmup=25, rep=100, return_mode="median")
        base = ms
        print(f"C={c} H={h} V={v} cuBLAS addmm_          {ms:7.3f} ms {flop / ms / 1e9:6.0f} TFLOP/s", flush=True)
        for cfg in CONFIGS:
            for persistent, per_sm in ((False, 1), (True, 1), (True, 2)):
                try:
                    out = dw0.clone()
                    triton_addmm(out, g, x, *cfg, persistent, per_sm)
                    err = (out.float() - ref).abs().max().item()
                    out = dw0.clone()
                    ms = triton.testing.do_bench(
                        lambda cfg=cfg, p=persistent, s=per_sm: triton_addmm(out, g, x, *cfg, p, s),
                        warmup=25, rep=100, return_mode="median",
                    )
                    kind = f"persistent x{per_sm}" if persistent else "grid"
                    print(f"C={c} H={h} V={v} triton {cfg} {kind:14s} {ms:7.3f} ms {flop / ms / 1e9:6.0f} TFLOP/s "
                          f"{base / ms:5.2f}x cuBLAS  max err {err:.1e}", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"C={c} {cfg} persistent={persistent}: {type(e).__name__} {str(e)[:120]}", flush=True)
        del g, x, dw0, dw, ref, out
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
