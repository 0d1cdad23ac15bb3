"""Where the host time of one e2e training step goes (issue 24): cProfile over a few steps of the
``fuselm bench e2e`` model per provider, the functions with the most own time and the fuselm functions
with the most cumulative time, plus the torch.profiler CPU table (self CPU time per op / autograd node).

cProfile adds its own cost per Python call (the absolute times are inflated, more so for Python-heavy
code); compare providers by the shares and the call counts, and read the wall/CPU time per step
printed before profiling (measured without the profiler).

Usage (GPU, repo root):
    PYTHONPATH=src:benchmarks python benchmarks/scripts/host_profile_step.py [--providers hf,fuselm]
        [--model llama3.2-1b] [--shape 1x2048] [--steps 5] [--top 40] [--out DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch
from fuselm_bench import e2e, step_timing, training
from torch.profiler import ProfilerActivity, profile


def measure(provider: str, model: str, batch: int, seq: int, steps: int, top: int, out: Path | None) -> str:
    device = torch.device("cuda")
    built = e2e.build_model(e2e.GPU_PRESET, provider, torch.bfloat16, device, model=model)
    ids = torch.randint(0, built.config.vocab_size, (batch, seq), device=device)
    step = step_timing.optimizer_step(
        training.causal_lm_loss(built), list(built.parameters()), [ids], lr=1e-5, fused=True
    )
    for i in range(5):
        step(i)
    torch.cuda.synchronize()
    walls, cpus = [], []
    for i in range(steps * 2):
        t0, c0 = time.perf_counter(), time.process_time()
        step(i)
        c1 = time.process_time()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
        cpus.append(c1 - c0)
    walls.sort()
    cpus.sort()
    lines = [
        f"## {provider} {model} {batch}x{seq}: wall {1e3 * walls[len(walls) // 2]:.1f} ms, "
        f"CPU {1e3 * cpus[len(cpus) // 2]:.1f} ms per step (median of {len(walls)})"
    ]
    prof = cProfile.Profile()
    prof.enable()
    for i in range(steps):
        step(i)
    torch.cuda.synchronize()
    prof.disable()
    for sort, restrict in (("tottime", top), ("cumulative", top)):
        s = io.StringIO()
        stats = pstats.Stats(prof, stream=s)
        stats.sort_stats(sort).print_stats(restrict)
        lines.append(f"### cProfile by {sort} ({steps} steps)\n" + s.getvalue())
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats("fuselm", top)
    lines.append(f"### cProfile fuselm functions by cumulative ({steps} steps)\n" + s.getvalue())
    if out is not None:
        prof.dump_stats(str(out / f"{provider}_{model}_{batch}x{seq}.pstats"))
    with profile(activities=[ProfilerActivity.CPU]) as tp:
        for i in range(steps):
            step(i)
        torch.cuda.synchronize()
    table = tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    lines.append(f"### torch.profiler CPU, self time ({steps} steps)\n{table}")
    del built, step
    torch.cuda.empty_cache()
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--providers", default="hf,fuselm")
    p.add_argument("--model", default="llama3.2-1b")
    p.add_argument("--shape", default="1x2048")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    batch, seq = (int(v) for v in a.shape.split("x"))
    out = Path(a.out) if a.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    for provider in a.providers.split(","):
        text = measure(provider, a.model, batch, seq, a.steps, a.top, out)
        print(text, flush=True)
        if out is not None:
            (out / f"{provider}_{a.model}_{a.shape}.txt").write_text(text)


if __name__ == "__main__":
    main()
