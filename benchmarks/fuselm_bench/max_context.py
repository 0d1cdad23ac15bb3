"""``fuselm bench max-context``: the longest sequence (batch 1) for which one LoRA / QLoRA training step runs
under a GPU memory cap, per provider. ``fuselm`` offloads every layer keeping no outputs for the recomputes
(``fuselm.offload.set_kept_output_room(0)``: the least device memory); ``fuselm@<GiB>`` plans under that
budget (``checkpointing="auto"``)."""

from __future__ import annotations

import argparse
import functools
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import arguments, finetune, fresh_process
from .arguments import UsageError, parse_list
from .report import bar_chart, collect_metadata, document, md_table, write_files

NAME = "max-context"
GRAIN = 256  # probed lengths are multiples of this many tokens
DEFAULT_CAPS = (16.0, 40.0, 80.0)
DEFAULT_SEQ_RANGE = {"cuda": (1024, 524288), "cpu": (16, 64)}
DEFAULT_PROVIDERS = ("fuselm", "hf", "unsloth")


@dataclass
class Search:
    """The search of one (provider, cap): ``longest`` (None: nothing fitted, or ``stopped`` says why), the row
    at that length, every probe as (length, status, step ms, peak GiB)."""

    provider: str
    cap_gib: float | None
    longest: int | None = None
    best: dict[str, Any] | None = None
    probes: list[tuple[int, str, float | None, float | None]] = field(default_factory=list)
    stopped: str | None = None


def longest_fitting(
    probe: Callable[[int], Any],
    lo: int,
    hi: int,
    *,
    rel_tol: float = 0.05,
    max_probes: int = 12,
    known: bool = False,
) -> tuple[int | None, Any, list[tuple[int, Any]], str | None]:
    """(longest length that fitted, its row, every (length, row) probed, why it stopped early or None).
    ``known``: LO fits and HI does not (an earlier run said so): neither is probed again (the row is None
    where no length between them fits)."""
    if not 0 < lo <= hi:
        raise ValueError(f"the sequence range must be 0 < LO <= HI, got {lo}:{hi}")
    probes: list[tuple[int, Any]] = []

    def run(t: int):
        row = probe(t)
        probes.append((t, row))
        return row

    best = None
    if not known:
        top = run(hi)
        if top.status == "ok":
            return hi, top, probes, None
        if top.status != "oom":
            return None, None, probes, _why_stopped(hi, top)
        best = run(lo) if lo < hi else top  # one length: probed once
        if best.status != "ok":
            return None, None, probes, None if best.status == "oom" else _why_stopped(lo, best)
    while hi / lo > 1 + rel_tol and len(probes) < max_probes:
        mid = max(round(math.sqrt(lo * hi) / GRAIN) * GRAIN, lo + GRAIN)  # the grain: the search's resolution
        if mid >= hi:
            break
        row = run(mid)
        if row.status == "ok":
            lo, best = mid, row
        elif row.status == "oom":
            hi = mid
        else:
            return lo, best, probes, _why_stopped(mid, row)
    return lo, best, probes, None


def _why_stopped(tokens: int, row: Any) -> str:
    """Why a probe ended the search: its status and its error's last line."""
    error = (getattr(row, "error", None) or "").strip()
    return f"{tokens} tokens: {row.status}" + (f" ({error.splitlines()[-1]})" if error else "")


def markdown(searches: list[Search], metadata: dict[str, Any]) -> str:
    head = ["provider", "cap GiB", "longest tokens", "first step s", "peak GiB", "probes", "note"]
    rows = []
    for s in searches:
        step, peak = ((s.best or {}).get(k) for k in ("step_ms", "peak_bytes"))
        cells = [s.provider, str(s.cap_gib if s.cap_gib is not None else "none")]
        cells.append(str(s.longest if s.longest is not None else "none fits"))
        cells += ["" if step is None else f"{step / 1e3:.1f}", "" if peak is None else f"{peak / 2**30:.2f}"]
        rows.append([*cells, str(len(s.probes)), s.stopped or ""])

    def probe(tokens: int, status: str, ms: float | None, gib: float | None) -> str:
        return f"{tokens}: {status}" + ("" if ms is None or gib is None else f", {ms:.0f} ms, {gib:.2f} GiB")

    probes = [f"{s.provider}, cap {s.cap_gib}: " + "; ".join(probe(*p) for p in s.probes) for s in searches]
    about = "The longest sequence (batch 1) for which one LoRA / QLoRA training step runs under a memory cap."
    notes = [f"{k}: {v}" for k, v in metadata.items() if not isinstance(v, dict)]
    tables = [md_table(head, rows), "Probes (tokens: status, step ms, peak GiB):"]
    return document(NAME, about, None, notes, tables, probes, {})


def write_png(searches: list[Search], metadata: dict[str, Any], path: Path) -> None:
    """Bars: the longest length (thousands of tokens) under each cap, one per provider ("none fits" at the
    foot of a search where nothing fitted; no bar where a provider was not searched under that cap)."""
    caps, providers = (list(dict.fromkeys(getattr(s, k) for s in searches)) for k in ("cap_gib", "provider"))
    value = {(s.provider, s.cap_gib): "none fits" if s.longest is None else s.longest / 1e3 for s in searches}
    bars = [(p, [value.get((p, c), float("nan")) for c in caps]) for p in providers]
    title = f"fuselm bench {NAME}, {metadata['model']} {metadata['scenario']}, {metadata['device']}"
    labels = [f"cap {c:g} GiB" if c is not None else "no cap" for c in caps]
    panels = [("longest sequence one step fits", bars)]
    bar_chart(path, title, labels, panels, 2.0 + 2.0 * len(caps), ylabel="thousand tokens", values=True)


def side_by_side(jobs: list[tuple[str, float | None]], gpus: list[int] | None) -> list[tuple]:
    """(provider, cap, GPU) of each search: the GPUs of ``gpus`` in turn (None each without ``gpus``)."""
    return [(p, c, gpus[i % len(gpus)] if gpus else None) for i, (p, c) in enumerate(jobs)]


def run_cli(args: argparse.Namespace, argv: list[str]) -> int:
    """``fuselm bench max-context``: each (provider, cap) searched, side by side with ``--gpus``."""
    device = arguments.pick_device(args.device)
    cuda = device.type == "cuda"
    plan = finetune.GPU_PLAN if cuda else finetune.CPU_PLAN
    models = parse_list(args.models, list(finetune.e2e.MODELS), "model", default=["llama3-8b"])
    scenarios = parse_list(args.scenarios, finetune.SCENARIOS, "scenario", default=["qlora"])
    if len(models) != 1 or len(scenarios) != 1:
        raise UsageError("max-context searches one --models and one --scenarios at a time")
    model, scenario = models[0], scenarios[0]
    if not cuda and scenario == "qlora" and finetune.bnb_cpu_4bit_works() is not None:
        raise UsageError("qlora needs bitsandbytes' 4-bit on this CPU: use --scenarios lora")
    providers = parse_list(
        args.providers, finetune.PROVIDERS, "provider", variants=True, default=DEFAULT_PROVIDERS
    )
    for provider in providers:  # fuselm@<GiB> (checkpointing="auto": it offloads what the host holds)
        finetune.split_provider(provider)
    caps = (arguments.parse_caps(args.caps) if args.caps else list(DEFAULT_CAPS)) if cuda else [None]
    lo, hi = arguments.parse_seq_range(args.seq_range) if args.seq_range else DEFAULT_SEQ_RANGE[device.type]
    gpus = arguments.parse_gpus(args.gpus, cuda) if args.gpus else None
    rel_tol, max_probes, rank = args.rel_tol or 0.05, args.max_probes or 12, args.rank or 32
    if args.bounds_known and not lo < hi:
        raise UsageError(f"--bounds-known probes between LO and HI: --seq-range needs LO < HI, got {lo}:{hi}")
    chunk = args.mlp_chunk_tokens
    metadata = collect_metadata(device, argv, ("transformers", *finetune.VERSIONS))
    metadata.update(
        model=model, scenario=scenario, rank=rank, mlp_chunk_tokens=chunk, grain=GRAIN, rel_tol=rel_tol
    )
    if args.bounds_known:
        metadata["bounds"] = f"{lo} fits and {hi} does not (an earlier run; --bounds-known): neither probed"
    out_dir = arguments.results_dir(args.out, metadata["device"] if cuda else None)
    dtype = torch.bfloat16 if cuda else torch.float32
    jobs = side_by_side([(provider, cap) for provider in providers for cap in caps], gpus)
    if gpus:
        metadata["gpus"] = ", ".join(f"{p} cap {c}: GPU {g}" for p, c, g in jobs)

    def run_search(provider: str, cap: float | None, gpu: int | None, model_dir: Path) -> Search:
        extra = {"model_dir": str(model_dir), "rank": rank, "profile_steps": 0, "memory_cap_gib": cap}
        if finetune.split_provider(provider)[0] == "fuselm":
            extra.update(mlp_chunk_tokens=chunk, keep_outputs=False)  # the least device memory
        extra = {k: v for k, v in {**extra, "gpu": gpu}.items() if v is not None}

        def probe(seq: int):
            shape = (model, scenario, 1, seq)
            case = fresh_process.WorkerCase(provider, shape, plan, dtype, device, 0, 1, extra=extra)
            row = fresh_process.run_case(finetune.BENCH, case)
            print(f"  {provider} cap {cap} GiB, {seq} tokens: {row.status}", flush=True)
            if row.status not in ("ok", "oom") and (row.error or "").strip():
                print(row.error.strip(), flush=True)
            return row

        longest, best, probes, stopped = longest_fitting(
            probe, lo, hi, rel_tol=rel_tol, max_probes=max_probes, known=args.bounds_known
        )
        rows = [(t, r.status, r.step_ms, r.peak_gib) for t, r in probes]
        found = Search(provider, cap, longest, asdict(best) if best is not None else None, rows, stopped)
        print(f"{provider}, cap {cap} GiB: longest {found.longest} tokens", flush=True)
        return found

    with finetune.models_folder(args.model_dir, "fuselm-max-context-") as model_dir:
        finetune.ensure_saved_model(model_dir, model, plan.tiny, dtype, device)
        if gpus:  # every search at once, each on its GPU (probes are fresh processes: threads only wait)
            with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
                searches = list(pool.map(lambda job: run_search(*job, model_dir), jobs))
        else:
            searches = [run_search(*job, model_dir) for job in jobs]
    data = {"suite": NAME, "metadata": metadata, "searches": [asdict(s) for s in searches]}
    png = functools.partial(write_png, searches, metadata)
    paths = write_files("max_context", out_dir, markdown(searches, metadata), data, png)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 1 if any(s.stopped for s in searches) else 0
