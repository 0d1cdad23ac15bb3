"""``fuselm bench finetune --world-size W``: each case of :mod:`fuselm_bench.finetune` also on a group of W
spawned ranks (FSDP2: ``fully_shard`` per decoder layer, then the root; NCCL one GPU per rank, gloo
processes on a CPU), beside its one-GPU row: step time (slowest rank), tokens/s in all and per GPU, peak
memory per rank, tokens/s per GPU on W GPUs / on one (``finetune_ws<W>.{md,json,png}``). The ranks load
the saved model and apply the provider as the one-process worker does (finetune.train); the spawned group
and the ranks' status agreement are :mod:`fuselm_bench.rank_group`'s."""

from __future__ import annotations

import argparse
import os
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from . import e2e, finetune, fresh_process, rank_group
from .arguments import UsageError
from .cases import GIB, Case, Row, run_cases
from .finetune import (
    BENCH,
    DATA_PARALLEL_PROVIDERS,
    NAME,
    SEED,
    WORKER_TIMEOUT_S,
    FinetuneDefaults,
    FinetuneRow,
    _ok,
    base_env,
    detail_table,
    fused_paths_section,
    notes,
    train,
)
from .harness import blocking_sync
from .report import md_table, ratio
from .runner import print_written

GROUP_TIMEOUT_S = WORKER_TIMEOUT_S  # a group with no result for this long is killed


@dataclass
class DataParallelRow(FinetuneRow):
    """A :class:`FinetuneRow` whose configuration includes its number of GPUs (``world_size``): the rows
    of ``finetune_ws<W>``, where one GPU and W GPUs of the same (model, scenario, B x T) sit side by
    side."""

    SHAPE_FIELDS: ClassVar[tuple[str, ...]] = ("model", "scenario", "batch", "seq", "world_size")
    SHAPE_DIMS: ClassVar[tuple[str, ...]] = ("model", "scenario", "B", "T", "GPUs")
    SHAPE_TITLE: ClassVar[str] = "model scenario B x T (per GPU) GPUs"
    SHAPE_FORMAT: ClassVar[str] = "{} {} {}x{} x{}gpu"


def data_parallel_bench(world_size: int) -> fresh_process.Bench:
    """:data:`BENCH` as the report of a ``--world-size`` run sees it: its name ``finetune_ws<W>`` (the
    report's files), the providers that run under FSDP2, rows keyed by GPUs as well, fuselm / HF. (Its
    workers are :data:`BENCH`'s and :func:`run_group_case`'s: nothing starts a module of its name.)"""
    import dataclasses

    return dataclasses.replace(
        BENCH,
        name=f"{NAME}_ws{world_size}",
        description=f"LoRA / QLoRA fine-tuning steps (PEFT) on {world_size} GPUs with FSDP2 vs one GPU: "
        "HF vs + fuselm",
        providers=DATA_PARALLEL_PROVIDERS,
        row_type=DataParallelRow,
        peers={"hf": "HF"},
    )


@dataclass(frozen=True)
class GroupCase:
    """One (provider, configuration) on a group of ranks, pickled to each spawned rank: :func:`train`'s
    arguments (``options``: its keyword arguments from the command line, as a worker's ``--extra``)."""

    plan: FinetuneDefaults
    provider: str
    shape: tuple[str, str, int, int]
    world_size: int
    device_type: str
    dtype: torch.dtype
    warmup: int
    steps: int
    options: dict[str, Any]
    seed: int = SEED
    timeout_s: float = GROUP_TIMEOUT_S


def group_env(device_type: str) -> dict[str, str]:
    """What the ranks run with: :func:`base_env` (Unsloth's settings do not matter: it does not run here),
    and on CUDA NVLink multicast off (``NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    NVSHMEM_DISABLE_NVLS=1``) where the parent's environment does not set them."""
    env = base_env()
    if device_type == "cuda":
        env.update({k: v for k, v in rank_group.NCCL_ENV.items() if k not in os.environ})
    return env


def group_rank(rank: int, case: GroupCase, init_file: str, out_dir: str) -> None:
    """A spawned rank of :func:`run_group_case`: join the group, :func:`train` with ``data_parallel`` (its
    failure caught as a worker's), agree on the status with every rank, write the record, leave."""
    path = Path(out_dir) / f"rank{rank}.jsonl"
    rank_group.capture_output(out_dir, rank)  # HF's progress bars, the profiler's lines: quoted on failure
    record: dict[str, Any] = {"kind": "case", "index": 0, "rank": rank, "status": "ok"}
    if case.device_type == "cuda":  # before CUDA starts in this process
        record["gpu_wait"] = blocking_sync(rank)
    else:
        torch.set_num_threads(1)  # a tiny model, as the one-process worker runs it
    device = rank_group.join_group(rank, case.world_size, case.device_type, init_file, case.timeout_s)
    try:
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--device cuda but torch.cuda.is_available() is False")
        options = {"warmup": case.warmup, "steps": case.steps, "seed": case.seed, **case.options}

        def measure() -> dict[str, Any]:
            return train(
                case.plan, case.provider, *case.shape, dtype=case.dtype, device=device, data_parallel=True,
                **options,
            )  # fmt: skip

        rank_group.measure_into(record, measure, device)
        rank_group.finish_case(record, path, device)
    finally:
        torch.distributed.destroy_process_group()
    # Leave without interpreter finalization, where gloo's threads can still hold tensors and abort the
    # process after the record is written (tests/kit/workers.py saw it in CI).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def group_row(case: GroupCase, records: list[dict[str, Any]], failure: str | None, repeat: int = 0):
    """The :class:`DataParallelRow` of one group's records: every rank ok (step time the slowest rank's,
    tokens/s the group's, peak memory the largest rank's, the rest rank 0's, each rank's in the lists), or
    the agreed status with the first failing rank's error, or, when the group did not finish, the failure a
    rank said before it got stuck (else why the group stopped)."""
    bench = data_parallel_bench(case.world_size)
    shape = (*case.shape, case.world_size)
    finals = {r["rank"]: r for r in rank_group.case_records(records, 0)}
    if len(finals) < case.world_size:
        said = sorted(rank_group.case_records(records, 0, final=False), key=lambda r: r["rank"])
        if said:
            data = {"status": said[0]["status"], "error": rank_group.rank_error(said[0])}
            data["traceback"] = said[0].get("traceback")
        else:
            missing = sorted(set(range(case.world_size)) - set(finals))
            data = {"status": "error", "error": failure or f"no result from ranks {missing}"}
        return fresh_process.make_row(bench, case.provider, shape, data, repeat)
    agreed = finals[0]["agreed"]
    if agreed != "ok":
        first = min((r for r in finals.values() if r["status"] == agreed), key=lambda r: r["rank"])
        error = first["error"] if agreed == "skipped" else rank_group.rank_error(first)
        data = {"status": agreed, "error": error, "traceback": first.get("traceback")}
        return fresh_process.make_row(bench, case.provider, shape, data, repeat)
    ranks = [finals[r] for r in range(case.world_size)]
    slowest = max(ranks, key=lambda r: r["step_ms"] if r.get("step_ms") is not None else -1.0)
    data = dict(ranks[0])
    data.update(step_ms=slowest.get("step_ms"), step_ms_all=slowest.get("step_ms_all", []))
    tokens = case.world_size * case.shape[2] * case.shape[3]
    data["tokens_per_s"] = None if not data["step_ms"] else tokens / (data["step_ms"] / 1e3)
    for key in ("peak_bytes", "reserved_bytes"):
        values = [r.get(key) for r in ranks]
        data[key] = None if None in values else max(values)
    data.update(
        rank_step_ms=[r.get("step_ms") for r in ranks],
        rank_peak_bytes=[r.get("peak_bytes") for r in ranks],
        rank_first_losses=[r.get("first_loss") for r in ranks],
    )
    return fresh_process.make_row(bench, case.provider, shape, data, repeat)


def run_group_case(case: GroupCase, repeat: int = 0) -> DataParallelRow:
    """``case`` on a fresh group of ``case.world_size`` spawned ranks (:mod:`fuselm_bench.rank_group`);
    its row (never raises for a failure of a rank: the row says it)."""
    t0 = time.perf_counter()
    group = rank_group.RankGroup(
        group_rank,
        (case,),
        world_size=case.world_size,
        timeout_s=case.timeout_s,
        env=group_env(case.device_type),
        prefix="fuselm-finetune-group-",
    )
    with group:
        group.wait_for(0)
        records, failure = group.records(), group.failure_with_output()
    row = group_row(case, records, failure, repeat)
    row.wall_s = time.perf_counter() - t0
    return row


def one_gpu_rows(rows: list[FinetuneRow]) -> list[DataParallelRow]:
    """One-process rows as rows of the ``--world-size`` report (``world_size`` 1)."""
    import dataclasses

    return [DataParallelRow(**{f.name: getattr(r, f.name) for f in dataclasses.fields(r)}) for r in rows]


def scaling(report: fresh_process.CaseReport, provider: str, config: tuple[Any, ...], world_size: int):
    """One GPU against ``world_size`` GPUs for (provider, (model, scenario, B, T)): step times, tokens/s
    (the group's and per GPU), peak GiB, first losses (rank 0's batch is the one GPU's), and ``per_gpu``
    = tokens/s per GPU on W GPUs / on one (medians over the repeats; None where either failed)."""
    one = report.rows_of(provider, (*config, 1))
    many = report.rows_of(provider, (*config, world_size))
    first_one, first_many = _ok(one)[:1], _ok(many)[:1]
    loss_one = first_one[0].first_loss if first_one else None
    loss_many = first_many[0].first_loss if first_many else None
    return {
        **dict(zip(FinetuneRow.SHAPE_FIELDS, config, strict=True)),
        "provider": provider,
        "world_size": world_size,
        "one_gpu_step_ms": fresh_process.median_of(one, "step_ms"),
        "one_gpu_tokens_per_s": fresh_process.median_of(one, "tokens_per_s"),
        "one_gpu_peak_bytes": fresh_process.median_of(one, "peak_bytes"),
        "step_ms": fresh_process.median_of(many, "step_ms"),
        "tokens_per_s": fresh_process.median_of(many, "tokens_per_s"),
        "tokens_per_s_per_gpu": fresh_process.median_of(many, "tokens_per_s_per_gpu"),
        "peak_bytes_per_rank": first_many[0].rank_peak_bytes if first_many else [],
        "per_gpu": ratio(
            fresh_process.median_of(many, "tokens_per_s_per_gpu"),
            fresh_process.median_of(one, "tokens_per_s"),
        ),
        "one_gpu_first_loss": loss_one,
        "first_loss": loss_many,
        "first_loss_diff": None if loss_one is None or loss_many is None else abs(loss_many - loss_one),
        "status": None if first_many else (many[0].status if many else "not run"),
        "one_gpu_status": None if first_one else (one[0].status if one else "not run"),
    }


def _configs(report: fresh_process.CaseReport) -> list[tuple[Any, ...]]:
    return list(dict.fromkeys(tuple(s[:4]) for s in report.shapes))


def _failed(status: str | None) -> str:
    return {"oom": "OOM", "skipped": "skipped", "not run": "—"}.get(status or "", "error")


def scaling_table(report: fresh_process.CaseReport, world_size: int) -> str:
    """Per (configuration, provider): one GPU (ms, tokens/s, peak GiB), W GPUs (ms of the slowest rank,
    tokens/s in all and per GPU, peak GiB of each rank), tokens/s per GPU W / 1, and the first losses."""
    w = world_size
    head = ["model", "scenario", "B x T per GPU", "provider", "1 GPU ms/step", "1 GPU tokens/s"]
    head += ["1 GPU peak GiB", f"{w} GPUs ms/step (slowest rank)", f"{w} GPUs tokens/s", "tokens/s per GPU"]
    head += ["peak GiB per rank", f"tokens/s per GPU, {w} GPUs / 1 GPU", "first loss 1 GPU / rank 0"]
    lines = []
    for config in _configs(report):
        model, scenario, b, t = config
        for p in report.providers:
            if not report.rows_of(p, (*config, 1)) and not report.rows_of(p, (*config, w)):
                continue
            s = scaling(report, p, config, w)
            one_failed = _failed(s["one_gpu_status"]) if s["one_gpu_status"] else None
            many_failed = _failed(s["status"]) if s["status"] else None
            peak_one = s["one_gpu_peak_bytes"]
            peaks = s["peak_bytes_per_rank"]
            first = (
                "—"
                if s["one_gpu_first_loss"] is None and s["first_loss"] is None
                else " / ".join(
                    "—" if x is None else f"{x:.4f}" for x in (s["one_gpu_first_loss"], s["first_loss"])
                )
            )
            lines.append(
                [
                    model,
                    scenario,
                    f"{b}x{t}",
                    p,
                    one_failed or f"{s['one_gpu_step_ms']:.0f}",
                    one_failed or e2e.fmt_tokens(s["one_gpu_tokens_per_s"]),
                    one_failed or ("n/a" if peak_one is None else f"{peak_one / GIB:.2f}"),
                    many_failed or f"{s['step_ms']:.0f}",
                    many_failed or e2e.fmt_tokens(s["tokens_per_s"]),
                    many_failed or e2e.fmt_tokens(s["tokens_per_s_per_gpu"]),
                    many_failed
                    or ("n/a" if not peaks or None in peaks else " / ".join(f"{x / GIB:.2f}" for x in peaks)),
                    "—" if s["per_gpu"] is None else f"{s['per_gpu']:.2f}x",
                    first,
                ]
            )
    return md_table(head, lines)


def per_rank_table(report: fresh_process.CaseReport) -> str:
    """Every group row's ranks: median ms/step, peak allocated GiB, first loss (each rank's own batch)."""
    head = ["configuration", "provider", "ms/step per rank", "peak GiB per rank", "first loss per rank"]
    lines = []
    for r in report.rows:
        if r.world_size == 1 or r.status != "ok":
            continue
        lines.append(
            [
                r.label(r.shape),
                r.provider,
                " / ".join("—" if x is None else f"{x:.0f}" for x in r.rank_step_ms),
                " / ".join("n/a" if x is None else f"{x / GIB:.2f}" for x in r.rank_peak_bytes),
                " / ".join("—" if x is None else f"{x:.4f}" for x in r.rank_first_losses),
            ]
        )
    return md_table(head, lines)


def data_parallel_notes(report: fresh_process.CaseReport, world_size: int) -> list[str]:
    cuda = report.device_type == "cuda"
    backend = "NCCL, one GPU per rank" if cuda else "gloo, CPU processes"
    sharding = next((r.sharding for r in report.rows if r.sharding), None)
    return [
        f"{world_size} GPUs: each (configuration, provider) ran on a fresh group of {world_size} spawned "
        f"processes ({backend}); every rank loaded the same saved model, applied the provider and PEFT "
        "LoRA as the one-GPU worker does, then FSDP2: "
        + (sharding or "fully_shard on each decoder layer, then on the root CausalLM")
        + "; each rank trains on its own batch of B x T (rank 0's is the one-GPU batch), so the global "
        f"batch is {world_size} x B x T; FSDP averages the LoRA gradients over the ranks.",
        f"{world_size} GPUs ms/step: the slowest rank's median step (a step ends when the last rank's "
        f"does); tokens/s: {world_size} x B x T / that step; per GPU: / {world_size}; tokens/s per GPU, "
        f"{world_size} GPUs / 1 GPU: 1.00x is perfect scaling. Peak GiB per rank: each rank's "
        "torch.cuda.max_memory_allocated() (its shard of the weights included); CPU ms, GPU ms, launches, "
        "host memory and the fused paths of a group row are rank 0's.",
        "1 GPU rows: the one-process bench (fuselm bench finetune without --world-size) in the same run, "
        "same saved model, options and per-GPU batch.",
        "first loss 1 GPU / rank 0: the same batch and weights (the LoRA B matrices start at zero), so "
        "they agree to the sharded step's rounding; later losses differ (the group's optimizer steps "
        "average the gradients of every rank's batch).",
        f"Ranks' environment: {report.metadata.get('finetune', {}).get('group_env')}.",
    ]


def data_parallel_markdown(report: fresh_process.CaseReport, world_size: int) -> str:
    """The ``--world-size`` report: one GPU vs W GPUs per (configuration, provider), per-rank figures,
    the details (as the one-GPU report's), fused paths, fuselm / HF, notes."""
    extra = report.metadata.get("finetune", {})
    bench = data_parallel_bench(world_size)
    models = list(dict.fromkeys(s[0] for s in report.shapes))
    facts = [f"model {e2e.MODELS[m].describe(report.plan.tiny)}" for m in models if m in e2e.MODELS]
    facts.append(
        f"GPUs: 1 and {world_size} ({'NCCL' if report.device_type == 'cuda' else 'gloo processes'}), FSDP2"
    )
    facts.append(
        f"steps per run: {report.warmup} warmup, {report.steps} timed, {extra.get('profile_steps')} profiled"
    )
    facts.append(f"fuselm: offload {'on' if extra.get('offload') else 'off'}")
    facts += [
        f"merged rows of: `{m.get('command')}` ({m.get('date')}, {m.get('commit')})" for m in report.merged
    ]
    sections = [
        f"## tokens/s per GPU, {world_size} GPUs / 1 GPU\n\n" + scaling_table(report, world_size),
        "## Per rank\n\n" + per_rank_table(report),
        "## Details\n\n" + detail_table(report),
    ]
    fused = fused_paths_section(report)
    table = "\n\n".join(sections) + ("\n\n" + fused if fused else "")
    return fresh_process.markdown(
        bench,
        report,
        cpu_figures="**CPU figures** (no CUDA device): a tiny config, fp32, gloo processes; a smoke test of "
        "the path.",
        facts=facts,
        table=table,
        notes=[*data_parallel_notes(report, world_size), *notes(report)],
    )


def data_parallel_json(report: fresh_process.CaseReport, world_size: int) -> dict[str, Any]:
    """All raw numbers (every row, each rank's lists), the scaling per (configuration, provider), the
    metadata, JSON-ready."""
    bench = data_parallel_bench(world_size)
    rows = [
        scaling(report, p, config, world_size)
        for config in _configs(report)
        for p in report.providers
        if report.rows_of(p, (*config, world_size)) or report.rows_of(p, (*config, 1))
    ]
    plan = {
        "plan": report.plan.name,
        "world_size": world_size,
        "finetune": report.metadata.get("finetune", {}),
        "scaling": rows,
    }
    notes_ = [*data_parallel_notes(report, world_size), *notes(report)]
    return fresh_process.report_json(bench, report, plan, notes_)


def write_data_parallel_report(report: fresh_process.CaseReport, world_size: int, out_dir: str | Path):
    """Write ``finetune_ws<W>.md``, ``.json`` and ``.png`` (tokens/s per GPU and peak GiB of the largest
    rank, one group per (configuration, GPUs)) into ``out_dir``; return their paths."""
    bench = data_parallel_bench(world_size)

    def png(path: Path) -> None:
        fresh_process.write_bars(
            bench,
            report,
            path,
            panels=(
                ("tokens_per_s_per_gpu", "tokens/s per GPU", 1.0),
                ("peak_gib", "peak GiB (max rank)", 1.0),
            ),
            title=f" ({report.plan.name} plan)",
            width_per_shape=3.0,
            mark_failures=True,
        )

    return fresh_process.write_report(
        bench.name,
        out_dir,
        data_parallel_markdown(report, world_size),
        data_parallel_json(report, world_size),
        png,
    )


def check_data_parallel(c: fresh_process.CliRun, args: argparse.Namespace, world_size: int) -> None:
    """``--world-size W`` before anything runs: only the FSDP2 providers (the others named: UsageError;
    not named: left out), W CUDA devices on CUDA. Raises ``UsageError``."""
    if getattr(args, "providers", None):
        refused = [p for p in c.providers if p not in DATA_PARALLEL_PROVIDERS]
        if refused:
            raise UsageError(
                f"--world-size {world_size}: {', '.join(refused)} cannot run sharded (FSDP2 runs the PEFT "
                f"models of {' and '.join(DATA_PARALLEL_PROVIDERS)} only); leave {', '.join(refused)} out"
            )
    c.providers = [p for p in c.providers if p in DATA_PARALLEL_PROVIDERS]
    if c.device.type == "cuda" and torch.cuda.device_count() < world_size:
        raise UsageError(
            f"--world-size {world_size}: needs {world_size} CUDA devices, {torch.cuda.device_count()} visible"
        )


def run_data_parallel(c: fresh_process.CliRun, world_size: int, progress: bool) -> fresh_process.CaseReport:
    """The ``--world-size`` run: every configuration's one-GPU rows (:func:`fresh_process.run`, the
    one-process bench), then its W-GPU rows (:func:`run_group_case`, ``repeats`` each); the report is
    written after every row and at the end. ``--merge``: the rows of an earlier ``finetune_ws<W>.json``
    (same device and dtype) are joined, this run's configurations replacing theirs (a grid split over
    several commands)."""
    bench = data_parallel_bench(world_size)
    c.metadata.update(world_size=world_size, backend="nccl" if c.device.type == "cuda" else "gloo")
    shapes = [(*s, w) for s in c.shapes for w in (1, world_size)]
    report = fresh_process.CaseReport(
        c.plan, c.dtype, c.device.type, tuple(shapes), tuple(c.providers), c.warmup, c.steps, c.metadata,
        repeats=c.repeats,
    )  # fmt: skip
    where = c.out_dir if c.merge is True else Path(c.merge) if c.merge else None
    previous = fresh_process._previous_report(bench, where) if where is not None else None
    if previous is not None:  # a report that cannot be joined is refused before anything runs
        fresh_process.merge_previous(bench, fresh_process._copy(report), previous)

    def write() -> dict[str, Path]:
        sources = {r.host_pinned_source for r in report.rows if r.host_pinned_source}
        report.metadata["finetune"]["host_pinned_source"] = "; ".join(sorted(sources)) or None
        merged = report
        if previous is not None:
            merged = fresh_process.merge_previous(bench, fresh_process._copy(report), previous)
        return write_data_parallel_report(merged, world_size, c.out_dir)

    repeats = f" x {c.repeats} repeats" if c.repeats > 1 else ""
    print(
        f"{bench.name}: {len(c.shapes)} configurations x {len(c.providers)} providers{repeats}, on 1 GPU "
        f"(a fresh process each) then on {world_size} ({report.metadata['backend']}, a fresh group of "
        f"{world_size} each), {c.warmup} warmup + {c.steps} timed steps",
        flush=True,
    )

    def on_one_gpu_row(partial: fresh_process.CaseReport) -> None:
        report.rows[:] = one_gpu_rows(partial.rows)
        report.skipped.update(partial.skipped)
        write()

    one = fresh_process.run(
        BENCH, plan=c.plan, shapes=c.shapes, providers=c.providers, dtype=c.dtype, device=c.device,
        warmup=c.warmup, steps=c.steps, metadata=c.metadata, progress=progress, on_row=on_one_gpu_row,
        repeats=c.repeats, extra=c.extra,
    )  # fmt: skip
    report.rows[:] = one_gpu_rows(one.rows)
    report.skipped.update(one.skipped)
    one_gpu = list(report.rows)

    def execute(case: Case) -> DataParallelRow:
        group = GroupCase(
            c.plan, case.provider, case.shape, world_size, c.device.type, c.dtype, c.warmup, c.steps,
            dict(c.extra),
        )  # fmt: skip
        return run_group_case(group, case.repeat)

    def on_row(rows: list[Row]) -> None:
        report.rows[:] = one_gpu + rows
        write()

    run_cases(
        [Case(p, tuple(s), repeat=r) for s in c.shapes for r in range(c.repeats) for p in c.providers],
        execute,
        desc=f"{bench.name} x{world_size}",
        describe=lambda case: f"{case.provider} {FinetuneRow.label(case.shape)} #{case.repeat + 1}",
        skipped=report.skipped,
        repeats=c.repeats,
        skip_provider=False,  # a provider skipped on one GPU is not run; one that skips on W runs the next
        progress=progress,
        log=lambda line: print(line, flush=True),
        on_row=on_row,
    )
    written = write()
    if previous is not None:
        report = fresh_process.merge_previous(bench, fresh_process._copy(report), previous)
    print_written(data_parallel_markdown(report, world_size), written)
    return report


# what finetune.run_cli calls for --world-size > 1
GROUP = types.SimpleNamespace(check=check_data_parallel, env=group_env, run=run_data_parallel)


def run_cli(args: argparse.Namespace, argv: list[str]) -> int:
    """``fuselm bench finetune`` (one GPU, or ``--world-size`` GPUs): :func:`finetune.run_cli` with
    this module's data-parallel run."""
    return finetune.run_cli(args, argv, group=GROUP)
