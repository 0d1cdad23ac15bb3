"""The README cannot drift: its runnable snippets run, its fine-tuning tables equal the committed JSON.

- Every ```python block of README.md whose first line is ``# runnable on CPU`` runs as written, each in
  a fresh Python process (a fresh namespace, and no process-wide state such as ``fuselm.hf.patch("qwen3")``
  leaking into other tests), on the CPU (``CUDA_VISIBLE_DEVICES=""``), in a temporary working directory.
- The fine-tuning tables (marked ``<!-- finetune.json: ... -->`` / ``<!-- finetune_1b.json: ... -->``)
  show, cell by cell, ``f"{ms:.0f} ms, {GiB:.2f} GiB"`` of the medians of the committed rows
  (``benchmarks/results/h200/finetune*.json``), the format ``fuselm bench finetune`` writes.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results" / "h200"
MARKER = "# runnable on CPU"


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, source) of every ```python block of ``text``."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start, body = i + 1, []
            i += 1
            while lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            blocks.append((start + 1, "\n".join(body) + "\n"))
        i += 1
    return blocks


def runnable_blocks() -> list[tuple[int, str]]:
    return [(line, src) for line, src in python_blocks(README.read_text()) if src.startswith(MARKER + "\n")]


def test_readme_has_runnable_blocks():
    # the API tour's first example, the Hugging Face example and the LoRA one-liner
    assert len(runnable_blocks()) >= 3


@pytest.mark.parametrize("line,source", [pytest.param(n, src, id=f"line{n}") for n, src in runnable_blocks()])
def test_runnable_block_runs_on_cpu(line, source, tmp_path):
    script = tmp_path / f"readme_line{line}.py"
    script.write_text(source)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"README.md block at line {line} failed:\n{proc.stderr[-4000:]}"
    # no README example falls back (fuselm's fallback warnings name "fuselm.hf.lora: <layer> runs ...")
    assert "fuselm.hf.lora:" not in proc.stderr, proc.stderr[-4000:]


# ---- the fine-tuning tables ----

SCENARIOS = {"QLoRA": "qlora", "bf16 LoRA": "lora"}
PROVIDERS = {"+ fuselm.hf.patch": "fuselm", "Unsloth": "unsloth", "HF + PEFT": "hf", "+ Liger": "liger"}


def table_after(marker: str) -> list[list[str]]:
    """The cells (bold stripped) of the markdown table right after the line ``marker``."""
    lines = README.read_text().splitlines()
    assert marker in lines, f"README.md has no line {marker!r}"
    rows = []
    for line in lines[lines.index(marker) + 1 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip().replace("**", "") for c in line.strip().strip("|").split("|")])
    assert len(rows) > 2, f"no table after {marker!r}"
    return rows


def expected_cell(rows: list[dict], model: str, scenario: str, batch: int, seq: int, provider: str) -> str:
    ok = [
        r
        for r in rows
        if (r["model"], r["scenario"], r["batch"], r["seq"], r["provider"])
        == (model, scenario, batch, seq, provider)
        and r["status"] == "ok"
    ]
    if not ok:
        return "not measured"
    ms = statistics.median(r["step_ms"] for r in ok)
    gib = statistics.median(r["peak_gib"] for r in ok)
    return f"{ms:.0f} ms, {gib:.2f} GiB"


def test_finetune_8b_table_equals_json():
    data = json.loads((RESULTS / "finetune.json").read_text())
    table = table_after("<!-- finetune.json: llama3-8b 4x2048 -->")
    head, body = table[0], table[2:]
    providers = [PROVIDERS[h] for h in head[1:]]
    assert sorted(providers) == sorted(data["providers"])
    assert {row[0].split(" (")[0] for row in body} == set(SCENARIOS)
    for row in body:
        scenario = SCENARIOS[row[0].split(" (")[0]]
        for provider, cell in zip(providers, row[1:], strict=True):
            assert cell == expected_cell(data["rows"], "llama3-8b", scenario, 4, 2048, provider), (
                scenario,
                provider,
            )
            assert cell != "not measured"


def test_finetune_1b_table_equals_json():
    data = json.loads((RESULTS / "finetune_1b.json").read_text())
    table = table_after("<!-- finetune_1b.json: llama3.2-1b -->")
    head, body = table[0], table[2:]
    providers = [PROVIDERS[h] for h in head[1:]]
    measured = set()
    for row in body:
        name, shape = row[0].split(", ")
        batch, seq = (int(v) for v in shape.split(" x "))
        for provider, cell in zip(providers, row[1:], strict=True):
            assert cell == expected_cell(data["rows"], "llama3.2-1b", SCENARIOS[name], batch, seq, provider)
            measured.add((SCENARIOS[name], batch, provider))
    ok = {(r["scenario"], r["batch"], r["provider"]) for r in data["rows"] if r["status"] == "ok"}
    assert ok <= measured, f"rows of finetune_1b.json missing from the README: {ok - measured}"


def test_readme_states_the_committed_demo_gap():
    # "losses within 1e-3 of HF's" was false; the README states the committed max abs difference
    demo = json.loads((RESULTS / "demo" / "fuselm_demo.json").read_text())
    gap = demo["comparison"]["max_abs"]
    claim = re.search(r"losses within ([0-9.e-]+) of HF's \(max abs difference", README.read_text())
    assert claim is not None
    assert claim.group(1) == f"{gap:.2g}"
