"""Join finetune reports of several invocations (e.g. one provider each, on one GPU machine) into one.

Usage: PYTHONPATH=src:benchmarks python benchmarks/scripts/merge_finetune_reports.py OUT_DIR NAME \
           earliest.json ... latest.json
writes OUT_DIR/NAME.{md,json,png}. A later report's rows replace an earlier one's for every provider x
configuration the later one ran (``fuselm bench finetune --merge``'s rule, applied from the latest back);
the metadata is the latest report's, and ``merged`` lists the earlier commands.
"""

import functools
import json
import sys
from pathlib import Path

import torch
from fuselm_bench import finetune, fresh_process
from fuselm_bench.report import write_files


def load(data: dict) -> fresh_process.CaseReport:
    known = set(finetune.BENCH.row_type.__dataclass_fields__)
    return fresh_process.CaseReport(
        plan=finetune.GPU_PLAN,
        dtype=torch.bfloat16,
        device_type="cuda",
        shapes=tuple(tuple(s) for s in data["shapes"]),
        providers=tuple(data["providers"]),
        warmup=data["warmup"],
        steps=data["steps"],
        metadata=data["metadata"],
        rows=[finetune.BENCH.row_type(**{k: v for k, v in r.items() if k in known}) for r in data["rows"]],
        skipped=data.get("skipped", {}),
        repeats=data.get("repeats", 1),
        merged=data.get("merged", []),
    )


def main(out_dir: str, name: str, *files: str) -> None:
    reports = [json.loads(Path(f).read_text()) for f in files]
    report = load(reports[-1])
    for earlier in reversed(reports[:-1]):
        report = fresh_process.merge_previous(finetune.BENCH, report, earlier)
    bench = finetune.BENCH
    plot = bench.plot or functools.partial(fresh_process.write_bars, bench)
    md, data = fresh_process.markdown(bench, report), fresh_process.report_json(bench, report)
    print(write_files(name, out_dir, md, data, lambda p: plot(report, p)))
    for shape, provider, rows in report.groups():
        for r in rows:
            print(shape, provider, f"{r.step_ms or 0:.1f} ms", f"{r.peak_gib or 0:.2f} GiB")


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
