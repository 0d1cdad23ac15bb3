"""Probe: fuselm.linear_log_probs with its Triton kernels on a side CUDA stream under the GEMMs
(op.OVERLAP_STREAMS) against the same slabs on one stream, and against the single slab buffer of before.

Shapes (bf16, 1/7 of the targets ignored, outputs log_probs + entropy, random per-token upstream gradients
on both; the inputs of `fuselm bench linear_log_probs`): (8192, 4096, 128256) and (16384, 4096, 151936).
Variants:
- "1 buffer, 1 stream": SLAB_BUFFERS = 1, OVERLAP_STREAMS = False (the plan before the overlap: one slab
  buffer of the whole budget, wider slabs);
- "2 buffers, 1 stream": SLAB_BUFFERS = 2, OVERLAP_STREAMS = False (same slabs as the next, no overlap);
- "2 buffers, 2 streams": SLAB_BUFFERS = 2, OVERLAP_STREAMS = True (the default).
Times forward and forward + backward with triton.testing.do_bench (median), the bf16 GEMM rate on 8192^3
(torch.mm) in the same run, x floor = time / (2NHV fwd, 6NHV fwd+bwd FLOPs at that rate), the extra peak
memory of fwd+bwd (beyond the inputs and the returned gradients), and checks that the two 2-buffer
variants give bitwise the same outputs and gradients. Prints markdown tables. Under 4 minutes on an H100.

Usage (GPU): PYTHONPATH=src python benchmarks/scripts/llp_overlap_probe.py
"""

from __future__ import annotations

import torch
import triton

import fuselm
import fuselm.ops.linear_log_probs.op as llp_op
from fuselm.bench.linear_log_probs import make_inputs

SHAPES = [(8192, 4096, 128256), (16384, 4096, 151936)]
VARIANTS = {  # name: (SLAB_BUFFERS, OVERLAP_STREAMS)
    "1 buffer, 1 stream": (1, False),
    "2 buffers, 1 stream": (2, False),
    "2 buffers, 2 streams": (2, True),
}
WARMUP_MS, REP_MS = 100, 1500
MIB = 2**20


def bench(fn, grads=None) -> float:
    return float(
        triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, grad_to_none=grads, return_mode="median")
    )


def gemm_tflops() -> float:
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty_like(a)
    torch.mm(a, b, out=c)
    return 2 * 8192**3 / bench(lambda: torch.mm(a, b, out=c)) / 1e9


def set_variant(name: str) -> None:
    llp_op.SLAB_BUFFERS, llp_op.OVERLAP_STREAMS = VARIANTS[name]


def probe_shape(n: int, h: int, v: int, rate: float) -> tuple[list[str], str]:
    """(table rows, equality line) of one shape."""
    inputs = make_inputs((n, h, v, 7, 2), torch.bfloat16, torch.device("cuda"))
    x, w, t = inputs["input"], inputs["linear_weight"], inputs["target"]
    up_lp, up_ent = torch.randn(2, n, device="cuda")

    def fwd():
        return fuselm.linear_log_probs(x, w, t, outputs=("log_probs", "entropy"))

    def fwd_bwd():
        out = fwd()
        ((out.log_probs * up_lp).sum() + (out.entropy * up_ent).sum()).backward()
        return out

    floor_ms = 6 * n * h * v / rate / 1e9
    rows, results = [], {}
    for name in VARIANTS:
        set_variant(name)
        x.grad = w.grad = None
        fwd_bwd()  # compiles, warms up
        x.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = fwd_bwd()
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - before - x.grad.nbytes - w.grad.nbytes
        results[name] = (out.log_probs.detach(), out.entropy.detach(), x.grad.clone(), w.grad.clone())
        x.grad = w.grad = None
        ms_fwd = bench(fwd)
        ms_full = bench(fwd_bwd, grads=[x, w])
        x.grad = w.grad = None
        rows.append(
            f"| {n}, {h}, {v} | {name} | {ms_fwd:.2f} | {ms_fwd / (floor_ms / 3):.2f} "
            f"| {ms_full:.2f} | {ms_full / floor_ms:.2f} | {extra / MIB:.0f} |"
        )
    one, two = results["2 buffers, 1 stream"], results["2 buffers, 2 streams"]
    same = all(torch.equal(p, q) for p, q in zip(one, two, strict=True))
    diffs = ", ".join(
        f"{key} {(p.float() - q.float()).abs().max().item():.2e}"
        for key, p, q in zip(
            ("log_probs", "entropy", "dx", "dw"), results["1 buffer, 1 stream"], two, strict=True
        )
    )
    return (
        rows,
        f"- {n}, {h}, {v}: 2 streams == 1 stream bitwise: {same}; max abs(1 buffer - 2 buffers): {diffs}",
    )


def main() -> None:
    assert torch.cuda.is_available(), "needs a CUDA device"
    rate = gemm_tflops()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"bf16 GEMM rate (torch.mm 8192^3): {rate:.0f} TFLOP/s\n")
    rows, checks = [], []
    for shape in SHAPES:
        shape_rows, check = probe_shape(*shape, rate)
        rows += shape_rows
        checks.append(check)
        torch.cuda.empty_cache()
    set_variant("2 buffers, 2 streams")
    print("| N, H, V | variant | fwd ms | fwd x floor | fwd+bwd ms | fwd+bwd x floor | extra MiB |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(
        f"\nfloor: 2NHV (fwd) / 6NHV (fwd+bwd) FLOPs at {rate:.0f} TFLOP/s; do_bench median, "
        f"warmup {WARMUP_MS} ms, rep {REP_MS} ms\n"
    )
    print("\n".join(checks))


if __name__ == "__main__":
    main()
