"""What is alive at a LoRA step's memory peak (lab script, not the library).

A random-init Llama (1B or 8B shape) with PEFT LoRA r=16 on every linear, fuselm.hf.patch(checkpointing=
"offload"), fused AdamW; after two warm steps one step runs under torch.cuda.memory's history, which is
replayed to the moment of the peak: the tensors alive then (above what was alive at the step's start),
each with the frames that allocated it. Variants switch library paths off by monkeypatching:

    PYTHONPATH=src:/tmp/site python benchmarks/scripts/step_memory_peak.py --shape llama3.2-1b \
        --variant base --variant no-kept-attention --variant no-mlp-defer --out /tmp/peak.json

Each variant runs in its own process (the model is built in each).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter

import torch
from lora_step_profile import SHAPES, lora_model


def apply_variant(name: str) -> None:
    import fuselm.hf.attention
    import fuselm.hf.blocks

    for part in name.split("+"):
        if part == "no-kept-attention":
            fuselm.hf.attention._backend = lambda *a, **k: None
        elif part == "no-mlp-defer":
            fuselm.hf.blocks.output_may_go_unread = lambda: False
        elif part != "base":
            raise SystemExit(f"unknown variant {part!r}")


def where(frames: list[dict]) -> str:
    keep = [f for f in frames if any(s in f["filename"] for s in ("fuselm", "transformers", "peft"))]
    return " < ".join(f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in keep[:4]) or "?"


def run_one(args) -> dict:
    apply_variant(args.variant[0])
    model, cfg, opt = lora_model(args.shape, 16, {"checkpointing": "offload"})
    b, t = args.batch
    ids = torch.randint(0, cfg.vocab_size, (b, t), device="cuda", generator=torch.Generator("cuda").manual_seed(0))

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    live: dict[int, tuple[int, str]] = {}
    cur = best = 0
    at_peak: dict[int, tuple[int, str]] = {}
    peak_event = ""
    for ev in snap["device_traces"][0]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], where(ev.get("frames", [])))
            cur += ev["size"]
            if cur > best:
                best, at_peak, peak_event = cur, dict(live), live[ev["addr"]][1]
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            cur -= live.pop(ev["addr"])[0]
    groups = Counter()
    for size, w in at_peak.values():
        groups[w] += size
    return {
        "variant": args.variant[0],
        "peak_allocated": torch.cuda.max_memory_allocated(),
        "start_allocated": start,
        "trace_peak_above_start": best,
        "peak_allocation": peak_event,
        "alive_at_peak_MiB": {w: round(s / 2**20, 2) for w, s in groups.most_common(25)},
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama3.2-1b", choices=sorted(SHAPES))
    p.add_argument("--batch", default="4x2048", type=lambda s: tuple(int(v) for v in s.split("x")))
    p.add_argument("--variant", action="append", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--worker", action="store_true")
    args = p.parse_args()
    if args.worker:
        print(json.dumps(run_one(args)))
        return
    results = []
    for v in args.variant or ["base"]:
        cmd = [sys.executable, __file__, "--worker", "--shape", args.shape, "--variant", v,
               "--batch", "x".join(map(str, args.batch))]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            results.append({"variant": v, "error": proc.stderr[-3000:]})
        else:
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1], indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
