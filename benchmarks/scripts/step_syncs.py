"""Issue 24: which calls of one e2e training step synchronize the host with the GPU, and what the fused
loss's sync costs.

    PYTHONPATH=src:benchmarks python benchmarks/scripts/step_syncs.py list [--providers hf,fuselm]
        [--model llama3.2-1b]
    PYTHONPATH=src:benchmarks python benchmarks/scripts/step_syncs.py ab [--rounds 6]

``list``: one step of each provider under ``torch.cuda.set_sync_debug_mode("warn")``, each synchronizing
call with its Python stack (a prototype of PyTorch's: it may miss some). ``ab``: the patched step with the
loss's ignored-row count (its one host sync) and with it skipped (as under capture), alternated in one
process, 10 steps a round; wall and process CPU time medians.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
import traceback
import warnings

import torch
from fuselm_bench import e2e, step_timing, training
from fuselm_bench.harness import blocking_sync

import fuselm.ops.linear_cross_entropy.op as lce_op


def patched_step(provider: str, model: str):
    built = e2e.build_model(e2e.GPU_PRESET, provider, torch.bfloat16, torch.device("cuda"), model=model)
    ids = torch.randint(0, built.config.vocab_size, (1, 2048), device="cuda")
    forward = training.causal_lm_loss(built)
    return step_timing.optimizer_step(forward, list(built.parameters()), [ids], lr=1e-5, fused=True)


def list_syncs(providers: list[str], model: str) -> None:
    for provider in providers:
        step = patched_step(provider, model)
        for i in range(3):
            step(i)
        torch.cuda.synchronize()
        seen: collections.Counter = collections.Counter()

        def record(message, category, filename, lineno, file=None, line=None, seen=seen):
            if "prototype" in str(message):  # set_sync_debug_mode's own notice
                return
            frames = [f for f in traceback.extract_stack()[:-2] if "warnings" not in f.filename][-6:]
            seen[" <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno}({f.name})" for f in frames[::-1])] += 1

        shown = warnings.showwarning
        warnings.showwarning = record
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            step(3)
            torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = shown
        print(f"== {provider}: {sum(seen.values())} synchronizing calls in one step")
        for where, n in seen.most_common():
            print(f"  {n}x {where}")


def ab(rounds: int, model: str) -> None:
    real = lce_op.compaction_allowed
    step = patched_step("fuselm", model)
    for i in range(5):
        step(i)
    wall: dict[str, list[float]] = {"loss sync": [], "no loss sync": []}
    cpu: dict[str, list[float]] = {k: [] for k in wall}
    for _ in range(rounds):
        for name in wall:
            lce_op.compaction_allowed = real if name == "loss sync" else (lambda device: False)
            step(0)
            torch.cuda.synchronize()
            for i in range(10):
                c, t = time.process_time(), time.perf_counter()
                step(i)
                torch.cuda.synchronize()
                wall[name].append((time.perf_counter() - t) * 1e3)
                cpu[name].append((time.process_time() - c) * 1e3)
    lce_op.compaction_allowed = real
    for name in wall:
        print(f"{name}: wall {statistics.median(wall[name]):.2f} ms (min {min(wall[name]):.2f}), "
              f"CPU {statistics.median(cpu[name]):.2f} ms")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("list", "ab"))
    p.add_argument("--providers", default="hf,fuselm")
    p.add_argument("--model", default="llama3.2-1b")
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    print("waits for the GPU:", blocking_sync())
    if args.what == "list":
        list_syncs(args.providers.split(","), args.model)
    else:
        ab(args.rounds, args.model)


if __name__ == "__main__":
    main()
