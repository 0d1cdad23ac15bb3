"""Compare fuselm bench JSON results of two source trees measured in the same GPU session.

    python benchmarks/scripts/compare_trees.py BEFORE_DIR [BEFORE_DIR2 ...] -- AFTER_DIR [AFTER_DIR2 ...]

Each DIR holds <suite>.json files written by `fuselm bench --out DIR`. Runs of the same tree are
combined by taking the median time per (suite, shape, provider, mode) (alternate the trees, A B A B, so
that clock and thermal drift fall on both). Prints a markdown table of after / before time ratios and
extra memory, and the largest time ratio.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def load(dirs):
    times, mem = {}, {}
    for d in dirs:
        for path in sorted(Path(d).glob("*.json")):
            data = json.loads(path.read_text())
            for row in data.get("rows", []):
                if row.get("ms") is None:
                    continue
                key = (data["suite"], "x".join(str(s) for s in row["shape"]), row["provider"], row["mode"])
                times.setdefault(key, []).append(row["ms"])
                mem[key] = row.get("extra_mib")
    return {k: statistics.median(v) for k, v in times.items()}, mem


def main(argv):
    split = argv.index("--")
    before, before_mem = load(argv[:split])
    after, after_mem = load(argv[split + 1 :])
    print(
        "| suite | shape | provider | mode | before ms | after ms | after / before | MiB before | MiB after |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    worst = None
    for key in sorted(set(before) & set(after)):
        ratio = after[key] / before[key]
        if worst is None or ratio > worst[0]:
            worst = (ratio, key)
        mib = ["" if m is None else f"{m:.0f}" for m in (before_mem.get(key), after_mem.get(key))]
        cells = [*key, f"{before[key]:.4g}", f"{after[key]:.4g}", f"{ratio:.3f}", *mib]
        print("| " + " | ".join(cells) + " |")
    if worst:
        print(f"\nlargest after / before: {worst[0]:.3f} at {worst[1]}")


if __name__ == "__main__":
    main(sys.argv[1:])
