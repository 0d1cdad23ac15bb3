"""One line of benchmarks/results/history.jsonl from a finetune report.

Usage: python benchmarks/scripts/history_line.py REPORT.json SUITE "the command" [provider/scenario,...] \
           >> benchmarks/results/history.jsonl
The headline cells are the rows of REPORT (only the listed provider/scenario pairs when given: rows merged
from earlier runs are left out), each with its time, peak, host and GPU time and activation plan.
"""

import json
import sys

VERSIONS = ("torch", "triton", "cuda", "python", "fuselm", "transformers", "peft", "bitsandbytes", "unsloth",
            "unsloth_zoo")  # fmt: skip


def main(path: str, suite: str, command: str, only: str | None = None) -> None:
    data = json.load(open(path))
    meta = data["metadata"]
    chosen = set(only.split(",")) if only else None
    cells: dict[str, dict] = {}
    for r in data["rows"]:
        if chosen is not None and f"{r['provider']}/{r['scenario']}" not in chosen:
            continue
        cell = {"ms": round(r["step_ms"], 1), "gib": round(r["peak_gib"], 2), "cpu_ms": round(r["cpu_ms"], 1),
                "gpu_ms": round(r["gpu_ms"], 1)}  # fmt: skip
        if r.get("activation_plan"):
            cell["plan"] = r["activation_plan"]
        cells.setdefault(f"{r['model']} {r['scenario']} {r['batch']}x{r['seq']}", {})[r["provider"]] = cell
    line = {
        "date": meta["date"],
        "commit": meta["commit"],
        "gpu": meta["device"],
        "versions": {k: meta[k] for k in VERSIONS if k in meta},
        "suite": suite,
        "report": path,
        "command": command,
        "headline": {"unit": "one run, median of the timed steps", "cells": cells},
    }
    print(json.dumps(line))


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
