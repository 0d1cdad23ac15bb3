"""A/B of the fused residual add in fuselm's patched decoder layers: training steps of `fuselm bench e2e`'s
Llama-3.2-1B-shaped model (bf16, fused AdamW, SDPA) patched by fuselm.hf.patch with fused_residual=True
and =False, alternating A B A B ... in one process (same seed, same batch), median step time per arm.

Usage (GPU): PYTHONPATH=src:benchmarks python benchmarks/scripts/e2e_fused_residual_ab.py [BATCH] [ROUNDS] [STEPS]
"""

import statistics
import sys

import torch

import fuselm.hf
from fuselm_bench import e2e

from fuselm.demo import training


def step_ms(fused_residual: bool, batch: int, seq: int, steps: int) -> float:
    device = torch.device("cuda")
    model = e2e.build_model(e2e.GPU_PRESET, "hf", torch.bfloat16, device)
    fuselm.hf.patch(model, fused_residual=fused_residual)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen).to(device)
    warmup = 3
    run = training.train(
        training.causal_lm_loss(model),
        list(model.parameters()),
        [ids] * (warmup + steps),
        lr=e2e.LR,
        fused_adamw=True,
        warmup=warmup,
    )
    del model
    torch.cuda.empty_cache()
    return run.timed_s / steps * 1e3


if __name__ == "__main__":
    batch, rounds, steps = (int(a) for a in (sys.argv[1:] + ["8", "3", "10"][len(sys.argv[1:]) :]))
    seq = 4096
    times = {True: [], False: []}
    for r in range(rounds):
        for fused in (False, True):
            times[fused].append(step_ms(fused, batch, seq, steps))
            print(f"round {r} fused_residual={fused}: {times[fused][-1]:.1f} ms/step", flush=True)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"{torch.cuda.get_device_name()} batch {batch}x{seq}, {steps} steps x {rounds} rounds")
    change = (on - off) / off * 100
    print(f"median step: fused_residual=False {off:.1f} ms, True {on:.1f} ms ({change:+.2f}%)")
    print(f"tokens/s: False {batch * seq / off * 1e3:.0f}, True {batch * seq / on * 1e3:.0f}")
