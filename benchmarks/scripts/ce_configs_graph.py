"""Cross-entropy fwd+bwd (in place) per launch config, timed as CUDA-graph replays (device time, no host
path) and eagerly, next to torch.compile: which configs hold a row in registers (single block, read once)
pay off, and how much of the eager time is the host's.

Usage (GPU): PYTHONPATH=src:benchmarks python benchmarks/scripts/ce_configs_graph.py [NxV,...]
"""

import sys

import torch
import triton

import fuselm
from fuselm_bench.harness import capture_graph
from fuselm.ops._common.loss import rows as ce_rows

SHAPES = [(16384, 32000), (16384, 8192), (8192, 128256), (4096, 256000)]


def copy_tbps():
    src = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() * 2 / ms / 1e9


def configs_for(v):
    out = [None]  # the default
    if "--loop-only" in sys.argv:
        return out + [
            (False, b, w, p) for b, w, p in ((8192, 8, 2), (16384, 16, 2), (16384, 16, 4), (16384, 16, 3))
        ]
    if v <= 32768:
        for warps in (8, 16, 32):
            for per_sm in (1, 2, 4):
                if warps * 32 * per_sm <= 2048:
                    out.append((True, triton.next_power_of_2(v), warps, per_sm))
        for block, warps, per_sm in (
            (8192, 8, 2),
            (16384, 16, 2),
            (16384, 16, 4),
            (16384, 32, 1),
            (16384, 16, 1),
        ):
            out.append((False, block, warps, per_sm))
    return out


def main():
    bw = copy_tbps()
    print(f"{torch.cuda.get_device_name()} copy {bw:.2f} TB/s", flush=True)
    shapes = SHAPES
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if args:
        shapes = [tuple(int(s) for s in a.split("x")) for a in args[0].split(",")]
    default = ce_rows._fwd_config
    for n, v in shapes:
        run_shape(n, v, bw, default)
        torch.cuda.empty_cache()


def run_shape(n, v, bw, default):
    x = torch.randn(n, v, device="cuda", dtype=torch.bfloat16).mul_(2)
    t = torch.randint(0, v, (n,), device="cuda")
    t[::7] = -100
    tb = n * v * 4 / 1e12
    ref = torch.nn.functional.cross_entropy(x.float(), t)
    logits = x.clone().requires_grad_()

    def call():
        return torch.autograd.grad(fuselm.cross_entropy(logits, t, inplace_backward=True), logits)

    for cfg in configs_for(v):
        ce_rows._fwd_config = default if cfg is None else (lambda n_cols, cfg=cfg: cfg)
        try:
            got = fuselm.cross_entropy(x.clone(), t)
            err = abs(got.float().item() - ref.item())
            g = capture_graph(call, torch.device("cuda"))
            ms = triton.testing.do_bench(g.replay, warmup=25, rep=100, return_mode="median")
            eager = triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")
            print(
                f"{n}x{v} {str(cfg or 'default'):28s} graph {ms:.3f} ms {tb / ms * 1e3 / bw:.2f}x copy | "
                f"eager {eager:.3f} ms {tb / eager * 1e3 / bw:.2f}x | loss err {err:.1e}",
                flush=True,
            )
            del g
        except Exception as e:  # noqa: BLE001
            print(f"{n}x{v} {cfg} failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
    ce_rows._fwd_config = default
    compiled = torch.compile(lambda a, b: torch.nn.functional.cross_entropy(a.float(), b))
    xc = x.clone().requires_grad_()
    ms = triton.testing.do_bench(
        lambda: torch.autograd.grad(compiled(xc, t), xc), warmup=25, rep=100, return_mode="median"
    )
    print(f"{n}x{v} torch.compile eager {ms:.3f} ms {tb / ms * 1e3 / bw:.2f}x copy", flush=True)


if __name__ == "__main__":
    main()
