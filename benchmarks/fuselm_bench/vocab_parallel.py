"""The vocabulary split over ranks: ``fuselm bench linear_cross_entropy|linear_log_probs --world-size W``.

The classes of ``x @ W.T`` are split over W processes (one GPU each with NCCL; gloo processes on a CPU),
rank r holding the rows of W that ``torch.tensor_split`` gives it; shapes are ``N x H x V``, the inputs the
single-GPU suite's (:data:`OPS`), made from one seed and broadcast from rank 0. ``linear_log_probs`` times
``log_probs.sum()``: every token's upstream gradient is 1 (an RL loss with unit advantages), which no op
can use in its forward. Providers: ``fuselm_split`` (``fuselm.distributed``, no rank ever holding
``[N, V]``), ``allgather_logits`` (what users write today, Megatron's ColumnParallelLinear with
gather_output; not ``torch.distributed.nn.functional.all_gather``, whose backward sums the gradient over
the ranks, W times too much for a loss every rank computes in full) and ``fuselm_single`` (the whole W on
rank 0, the others waiting).

Per case: ``warmup`` steps (the first records loss and gradient norm, a cross-check of the providers), one
step for memory, a barrier, then ``steps`` steps between CUDA events: a fixed count, not
``triton.testing.do_bench``, which picks its repetitions per process (ranks could disagree on the number
of collectives and hang). A row's time is the slowest rank's median; FLOPs are per rank (6NHV/W split,
6NHV single). The ranks agree on each case's status (:mod:`fuselm_bench.rank_group`); a group that fails
or stalls (``CASE_TIMEOUT_S``) is killed and a fresh one runs the cases left.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fuselm
import fuselm.distributed

from . import linear_cross_entropy as lce
from . import linear_log_probs as llp
from . import rank_group
from .arguments import StepCounts, UsageError, pick_device, results_dir, warmup_steps_dtype
from .cases import run_cases
from .harness import (
    MIB,
    Ceilings,
    Cost,
    Inputs,
    OpRow,
    Provider,
    Report,
    Shape,
    Suite,
    _finish,
    call_times_ms,
    fresh_bytes,
    measure_ceilings,
    peak_extra_bytes,
    run_measured,
    sync,
)
from .report import collect_metadata, device_name, fmt_num, md_table, ratio, shape_label
from .runner import finish, plan_suite

PROVIDERS = ("fuselm_split", "allgather_logits", "fuselm_single")  # every op's, in this order
SPLIT_PROVIDERS = PROVIDERS[:2]  # the work spread over every rank
CPU_SHAPES: tuple[Shape, ...] = ((256, 64, 1001),)
SEED = 0
STEPS = {
    "cuda": StepCounts(3, 20, quick_warmup=2, quick_steps=3),
    "cpu": StepCounts(1, 5, quick_warmup=1, quick_steps=3),
}
CASE_TIMEOUT_S = {"cuda": 600.0, "cpu": 300.0}  # no case finished for this long: the group is killed


def vocab_split(v: int, world_size: int) -> list[int]:
    """Rows of the vocabulary per rank, as ``torch.tensor_split`` cuts them."""
    q, m = divmod(v, world_size)
    return [q + (r < m) for r in range(world_size)]


# ---- the baseline: all-gathered logits ----


class _CopyToShards(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient (each rank holds its rows' share of dx)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()  # the matmul's fresh dx: summed in place
        dist.all_reduce(grad)
        return grad


class _GatherVocab(torch.autograd.Function):
    """``[N, V_r]`` on each rank -> ``[N, V]`` (all-gather along V); backward: this rank's columns."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
        rank = dist.get_rank()
        ctx.start, ctx.size = sum(sizes[:rank]), sizes[rank]
        width = max(sizes)  # uneven splits travel padded to the largest slice
        send = F.pad(local, (0, width - local.shape[1])).contiguous()
        parts = [torch.empty_like(send) for _ in sizes]
        dist.all_gather(parts, send)
        return torch.cat([p[:, :s] for p, s in zip(parts, sizes, strict=True)], dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad[:, ctx.start : ctx.start + ctx.size].contiguous(), None


def gathered_logits(x: torch.Tensor, weight_rows: torch.Tensor, vocab_sizes: Sequence[int]) -> torch.Tensor:
    """The ``[N, V]`` logits on every rank from each rank's ``x @ weight_rows.T`` ``[N, V_r]``."""
    local = _CopyToShards.apply(x) @ weight_rows.T  # [N, V_r]
    return _GatherVocab.apply(local, tuple(vocab_sizes))


def allgather_logits_loss(
    x: torch.Tensor, weight_rows: torch.Tensor, target: torch.Tensor, vocab_sizes: Sequence[int]
) -> torch.Tensor:
    """The cross-entropy baseline: :func:`gathered_logits`, then ``F.cross_entropy(logits.float())``."""
    logits = gathered_logits(x, weight_rows, vocab_sizes)
    return F.cross_entropy(logits.float(), target, ignore_index=lce.IGNORE_INDEX)


def allgather_logits_log_probs(
    x: torch.Tensor, weight_rows: torch.Tensor, target: torch.Tensor, vocab_sizes: Sequence[int]
) -> torch.Tensor:
    """The log-probs baseline: :func:`gathered_logits`, fp32 log_softmax, gather; 0 at ignored targets."""
    logits = gathered_logits(x, weight_rows, vocab_sizes)
    kept = target != llp.IGNORE_INDEX
    log_probs = logits.float().log_softmax(-1).gather(-1, target.clamp(min=0)[:, None]).squeeze(-1)
    return torch.where(kept, log_probs, 0.0)


# ---- the ops: providers fn(inputs) -> the scalar loss timed; inputs: input, linear_weight (the rank's
# rows for the split providers, the whole W for fuselm_single), target, vocab_sizes (the split)


def _args(x: Inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return x["input"], x["linear_weight"], x["target"]


def llp_inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> Inputs:
    """The linear_log_probs suite's inputs at ``(N, H, V)``, 1/7 of the targets ignored, log_probs only."""
    n, h, v = shape
    return llp.make_inputs((n, h, v, lce.DEFAULT_IGNORE_K, llp.LOG_PROBS), dtype, device)


@dataclass(frozen=True)
class VocabParallelOp:
    """What one op brings to the runner (:func:`make_suite`)."""

    name: str  # the single-GPU suite's: the CLI's suite argument and the report's name prefix
    what: str  # the start of the suite's description
    loss: str  # what the providers return, for the description
    gpu_shapes: tuple[Shape, ...]
    make_inputs: Callable[[Shape, torch.dtype, torch.device], Inputs]  # the whole problem, from the seed
    cost: Callable[[Shape, str, torch.dtype], Cost]  # the whole problem's (one GPU's) FLOPs
    providers: tuple[Provider, ...]  # the names of PROVIDERS, in that order
    notes: tuple[str, ...] = ()


_INPUTS_NOTE = (
    "Inputs as the single-GPU suite's random ones: x ~ N(0, 1), W ~ N(0, 1/H), round(N/7) targets -100, "
    "made from one seed and broadcast from rank 0."
)

OPS: dict[str, VocabParallelOp] = {
    op.name: op
    for op in (
        VocabParallelOp(
            name=lce.SUITE.name,
            what="fused linear cross-entropy",
            loss="loss: the mean cross-entropy over the non-ignored targets",
            gpu_shapes=((8192, 4096, 128256), (8192, 4096, 256000)),
            make_inputs=lce.make_inputs,
            cost=lce.cost,
            providers=(
                Provider(
                    "fuselm_split",
                    lambda device: (
                        lambda x: fuselm.distributed.linear_cross_entropy(
                            *_args(x), vocab_sizes=x["vocab_sizes"], memory="auto"
                        )
                    ),
                    "fuselm.distributed.linear_cross_entropy, every rank",
                ),
                Provider(
                    "allgather_logits",
                    lambda device: lambda x: allgather_logits_loss(*_args(x), x["vocab_sizes"]),
                    "all-gathered [N, V] logits + F.cross_entropy",
                ),
                Provider("fuselm_single", lce.setup_fuselm, "fuselm.linear_cross_entropy, whole W on rank 0"),
            ),
            notes=(_INPUTS_NOTE,),
        ),
        VocabParallelOp(
            name=llp.NAME,
            what="per-token log-probs of the LM head",
            loss="loss: the sum of the N per-token log-probs (0 at ignored targets)",
            gpu_shapes=((8192, 4096, 128256), (16384, 4096, 151936)),
            make_inputs=llp_inputs,
            cost=llp.cost,
            providers=(
                Provider(
                    "fuselm_split",
                    lambda device: (
                        lambda x: fuselm.distributed.linear_log_probs(
                            *_args(x), vocab_sizes=x["vocab_sizes"], memory="auto"
                        ).log_probs.sum()
                    ),
                    "fuselm.distributed.linear_log_probs(...).log_probs.sum(), every rank",
                ),
                Provider(
                    "allgather_logits",
                    lambda device: lambda x: allgather_logits_log_probs(*_args(x), x["vocab_sizes"]).sum(),
                    "all-gathered [N, V] logits, .float().log_softmax(-1).gather(-1, target[:, None]), sum",
                ),
                Provider(
                    "fuselm_single",
                    lambda device: (
                        lambda x: fuselm.linear_log_probs(*_args(x), memory="auto").log_probs.sum()
                    ),
                    "fuselm.linear_log_probs(...).log_probs.sum(), whole W on rank 0",
                ),
            ),
            notes=(
                _INPUTS_NOTE + " log_probs only (no entropy).",
                "loss: the sum of the per-token log-probs (every token's upstream gradient 1); fuselm's "
                "backward recomputes the logits (8NHV: 1.33x floor bounds it), the gathered logits keep "
                "them.",
            ),
        ),
    )
}


def make_suite(op: str, world_size: int) -> Suite:
    """The suite of a run of ``op`` over ``world_size`` ranks (the report files: ``<op>_ws<world_size>``)."""
    spec = OPS[op]
    return Suite(
        name=f"{spec.name}_ws{world_size}",
        description=(
            f"{spec.what} with the vocabulary split over {world_size} ranks: x [N, H] and target [N] on "
            f"every rank, rank r holding W[V_r rows, H]; {spec.loss}; forward + backward"
        ),
        shape_dims=("N", "H", "V"),
        gpu_shapes=spec.gpu_shapes,
        cpu_shapes=CPU_SHAPES,
        providers=spec.providers,
        make_inputs=spec.make_inputs,
        cost=spec.cost,
        columns=("ms", "x_floor", "extra_mib"),
        forward_grad=True,
        notes=(
            "ms: the slowest rank's median step; extra MiB: the largest rank's (every rank's below and in "
            "the JSON).",
            f"FLOPs per rank: 6NHV/{world_size} for fuselm_split and allgather_logits, 6NHV for "
            "fuselm_single; x floor is the time over the GEMM floor of one GPU's share.",
            *spec.notes,
        ),
    )


# ---- one rank (a spawned process) ----


@dataclass(frozen=True)
class Case:
    """One (shape, provider) of a run; ``index`` orders the run's cases (what the ranks agree on)."""

    index: int
    shape: Shape
    provider: str
    repeat: int = 0  # one measurement per case (run_cases's field)


@dataclass(frozen=True)
class SplitRun:
    """What one group of ranks runs (pickled to every spawned process)."""

    op: str  # a key of OPS
    world_size: int
    device_type: str
    dtype: torch.dtype
    warmup: int
    steps: int
    quick: bool
    cases: tuple[Case, ...]
    ceilings: bool  # measure them on every rank first
    timeout_s: float


def _inputs(case: Case, plan: SplitRun, device: torch.device, rank: int) -> Inputs:
    """The whole problem from the seed; the split providers keep this rank's rows of W."""
    torch.manual_seed(SEED)
    x = OPS[plan.op].make_inputs(case.shape, plan.dtype, device)
    if case.provider not in SPLIT_PROVIDERS:
        return {**x, "vocab_sizes": [case.shape[2]]}
    for t in x.values():  # one problem on every rank, whatever each rank's RNG does
        if isinstance(t, torch.Tensor):  # (the log-probs inputs also carry plain entries)
            dist.broadcast(t.detach(), src=0)
    sizes = vocab_split(case.shape[2], plan.world_size)
    start = sum(sizes[:rank])
    rows = x["linear_weight"].detach()[start : start + sizes[rank]].clone().requires_grad_(True)
    return {**x, "linear_weight": rows, "vocab_sizes": sizes}


def _measure(case: Case, plan: SplitRun, device: torch.device, rank: int) -> dict[str, Any]:
    """One rank's share of one case: loss, gradient norm, memory (CUDA), step times (a fixed count, each
    between two CUDA events: :func:`harness.call_times_ms`)."""
    split = case.provider in SPLIT_PROVIDERS
    fn = make_suite(plan.op, plan.world_size).provider(case.provider).setup(device)  # before collectives
    inputs = _inputs(case, plan, device, rank)
    wrt = [inputs["input"], inputs["linear_weight"]]

    def step() -> tuple[torch.Tensor, ...]:
        loss = fn(inputs)
        return (loss.detach(), *torch.autograd.grad(loss, wrt))

    loss, dx, dw = step()
    dw_sq = dw.double().pow(2).sum()
    if split:  # dx is the whole gradient on every rank; dW is split
        dist.all_reduce(dw_sq)
    out: dict[str, Any] = {
        "loss": float(loss),
        "grad_norm": math.sqrt(float(dx.double().pow(2).sum()) + float(dw_sq)),
    }
    del loss, dx, dw
    for _ in range(plan.warmup - 1):
        step()
    sync(device)
    if device.type == "cuda":
        peak, _, result = peak_extra_bytes(step, device)
        tensors = [t for t in inputs.values() if isinstance(t, torch.Tensor)]
        out["grad_bytes"] = fresh_bytes(result[1:], tensors)
        out["peak_bytes"] = peak
        out["extra_bytes"] = max(peak - out["grad_bytes"], 0)
        del result
    if split:
        dist.barrier()
    out["times_ms"] = call_times_ms(lambda _: step(), plan.steps, device)
    out["ms"] = statistics.median(out["times_ms"])
    return out


def _worker(rank: int, plan: SplitRun, init_file: str, out_dir: str) -> None:
    """A spawned rank: join the group, the ceilings (if asked), the cases (the agreement after each is also
    the barrier of the ranks idle during fuselm_single), the records."""
    path = Path(out_dir) / f"rank{rank}.jsonl"
    if plan.device_type != "cuda":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // plan.world_size))
    device = rank_group.join_group(rank, plan.world_size, plan.device_type, init_file, plan.timeout_s)
    try:
        ceilings = measure_ceilings(device, quick=plan.quick) if plan.ceilings else None
        info = {"kind": "rank", "rank": rank, "device": device_name(device)}
        rank_group.append_record(path, {**info, "ceilings": None if ceilings is None else asdict(ceilings)})
        for case in plan.cases:
            record: dict[str, Any] = {"kind": "case", "index": case.index, "rank": rank, "status": "ok"}
            if case.provider in SPLIT_PROVIDERS or rank == 0:
                record.update(run_measured(lambda case=case: _measure(case, plan, device, rank), device))
            rank_group.finish_case(record, path, device)
    finally:
        dist.destroy_process_group()


# ---- rows, summary, report ----


@dataclass
class ParallelRow(OpRow):
    """A harness row plus what each rank measured and a cross-check of the providers."""

    ranks: int = 1  # ranks that did the work
    vocab_sizes: list[int] = field(default_factory=list)
    rank_ms: list[float | None] = field(default_factory=list)
    rank_extra_bytes: list[int | None] = field(default_factory=list)
    loss: float | None = None
    grad_norm: float | None = None


def case_row(
    suite: Suite,
    case: Case,
    records: list[dict[str, Any]],
    world_size: int,
    dtype: torch.dtype,
    ceilings: Ceilings,
    failure: str | None = None,
) -> ParallelRow:
    """The row of one case from its ranks' records (``failure``: why the group stopped)."""
    split = case.provider in SPLIT_PROVIDERS
    sizes = vocab_split(case.shape[2], world_size) if split else [case.shape[2]]
    row = ParallelRow(
        shape=case.shape, provider=case.provider, mode="full", ranks=len(sizes), vocab_sizes=sizes
    )
    failed = rank_group.failed_case(records, case.index, world_size, failure)
    if failed is not None:
        row.error = ("skipped: " if failed["status"] == "skipped" else "") + failed["error"]
        return row
    by_rank = {r["rank"]: r for r in rank_group.case_records(records, case.index)}
    working = [by_rank[r] for r in range(row.ranks)]
    row.rank_ms = [r["ms"] for r in working]
    row.rank_extra_bytes = [r.get("extra_bytes") for r in working]
    row.ms = max(row.rank_ms)
    if all(b is not None for b in row.rank_extra_bytes):
        row.extra_bytes = max(row.rank_extra_bytes)
        row.peak_bytes = max(r["peak_bytes"] for r in working)
        row.grad_bytes = max(r["grad_bytes"] for r in working)
    row.loss, row.grad_norm = working[0]["loss"], working[0]["grad_norm"]
    flops = suite.cost(case.shape, "full", dtype).flops
    return _finish(row, Cost(flops=flops / row.ranks), ceilings)


def summary(report: Report, world_size: int) -> list[dict[str, Any]]:
    """Per shape: the split against its GEMM floor, the single GPU and the all-gathered logits."""
    out = []
    names = {"split": "fuselm_split", "allgather": "allgather_logits", "single": "fuselm_single"}
    for shape in report.shapes:
        rows = {k: report.row(shape, p, "full") for k, p in names.items()}
        gemm = report.ceilings.gemm_tflops
        floor = report.suite.cost(shape, "full", report.dtype).flops / world_size
        ms = {k: None if r is None else r.ms for k, r in rows.items()}
        mem = {k: None if r is None else r.extra_bytes for k, r in rows.items()}
        out.append(
            {
                "shape": list(shape),
                "vocab_sizes": vocab_split(shape[2], world_size),
                "split_floor_ms": floor / (gemm * 1e9) if gemm else None,
                **{f"{k}_ms": v for k, v in ms.items()},
                **{f"{k}_extra_bytes": v for k, v in mem.items()},
                "split_vs_single": ratio(ms["split"], ms["single"]),
                "allgather_vs_split": ratio(ms["allgather"], ms["split"]),
                "split_extra_vs_allgather": ratio(mem["split"], mem["allgather"]),
                "split_extra_vs_single": ratio(mem["split"], mem["single"]),
            }
        )
    return out


def _mib(b: int | None) -> str:
    return "—" if b is None else fmt_num(b / MIB)


def extra_markdown(report: Report, world_size: int, rank_info: list[dict[str, Any]]) -> str:
    """The sections after the main table: split vs single and vs all-gathered logits, per rank, providers."""
    rows = [
        [
            shape_label(s["shape"]),
            " + ".join(map(str, s["vocab_sizes"])),
            *(fmt_num(s[k]) for k in ("split_ms", "split_floor_ms", "single_ms")),
            "—" if s["split_vs_single"] is None else f"{s['split_vs_single']:.2f}x",
            fmt_num(s["allgather_ms"]),
            "—" if s["allgather_vs_split"] is None else f"{s['allgather_vs_split']:.2f}x",
            " / ".join(_mib(s[f"{k}_extra_bytes"]) for k in ("split", "allgather", "single")),
        ]
        for s in summary(report, world_size)
    ]
    head = ["N, H, V", "V per rank", "split ms", "split GEMM floor ms", "single ms", "split / single"]
    head += ["allgather ms", "allgather / split", "extra MiB split / allgather / single"]
    lines = [
        f"## Split over {world_size} ranks vs one GPU and vs all-gathered logits",
        "",
        md_table(head, rows),
    ]
    per_rank = [
        [
            shape_label(r.shape),
            r.provider,
            " / ".join(fmt_num(m) for m in r.rank_ms) or "—",
            " / ".join(_mib(b) for b in r.rank_extra_bytes) or "—",
            "—" if r.loss is None else f"{r.loss:.6g}",
            "—" if r.grad_norm is None else f"{r.grad_norm:.6g}",
        ]
        for r in report.rows
    ]
    head = ["N, H, V", "provider", "ms per rank", "extra MiB per rank", "loss", "grad norm"]
    lines += ["", "### Per rank", "", md_table(head, per_rank), ""]
    for info in rank_info:
        c = Ceilings(**info["ceilings"]) if info.get("ceilings") else Ceilings()
        lines.append(
            f"- rank {info['rank']}: {info['device']}; copy {fmt_num(c.copy_tbps)} TB/s, GEMM "
            f"{fmt_num(c.gemm_tflops)} TFLOP/s"
        )
    lines += [
        "- V split as torch.tensor_split cuts it; ratios and x floor use rank 0's ceilings; grad norm = "
        "sqrt(|dx|^2 + sum over ranks |dW_r|^2), the same for every provider if they agree.",
        *(f"- {p.name}: {p.description}" for p in report.suite.providers if p.name in report.providers),
    ]
    return "\n".join(lines) + "\n"


def run(
    *,
    op: str,
    world_size: int,
    shapes: Sequence[Shape],
    providers: Sequence[str],
    dtype: torch.dtype,
    device_type: str,
    warmup: int,
    steps: int,
    quick: bool = False,
    metadata: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> tuple[Report, list[dict[str, Any]]]:
    """Every (shape, provider) of ``op`` on ``world_size`` ranks: the report and each rank's device and
    ceilings. A group that fails or hangs is replaced for the cases left (not when a fresh group failed at
    once, without a rank saying why: a fresh one would fail the same way)."""
    suite = make_suite(op, world_size)
    cases = [Case(i, tuple(s), p) for i, (s, p) in enumerate((s, p) for s in shapes for p in providers)]
    group: rank_group.RankGroup | None = None
    fresh = False  # the live group has finished no case yet
    rank_info: list[dict[str, Any]] = []  # what the first group said of the ranks (device, ceilings)
    ceilings = Ceilings()
    gave_up: str | None = None  # why the cases left are not run

    def execute(case: Case) -> ParallelRow:
        nonlocal group, fresh, rank_info, ceilings, gave_up
        if gave_up is not None:
            return case_row(suite, case, [], world_size, dtype, ceilings, f"not run: {gave_up}")
        if group is None:  # a fresh group for this case and the ones after it (the first measures ceilings)
            rest = tuple(cases[case.index :])
            plan = SplitRun(op, world_size, device_type, dtype, max(warmup, 1), steps, quick, rest,
                            not rank_info, CASE_TIMEOUT_S[device_type])  # fmt: skip
            group = rank_group.RankGroup(
                _worker,
                (plan,),
                world_size=world_size,
                timeout_s=plan.timeout_s,
                prefix="fuselm-vocab-parallel-",
            )
            fresh = True
        _, failure = group.wait_for(case.index)
        records = group.records()
        if not rank_info:
            ranks = (r for r in records if r["kind"] == "rank")
            rank_info = sorted(
                ({k: v for k, v in r.items() if k != "kind"} for r in ranks), key=lambda r: r["rank"]
            )
            if rank_info and rank_info[0]["ceilings"]:
                ceilings = Ceilings(**rank_info[0]["ceilings"])
        why = None if failure is None else group.failure_with_output() or "the ranks stopped early"
        row = case_row(suite, case, records, world_size, dtype, ceilings, why)
        said = rank_group.case_records(records, case.index, final=False)
        label = f"{shape_label(case.shape)} {case.provider}"
        tb = next((r["traceback"] for r in said if r.get("traceback")), None)
        if failure is None:
            fresh = False
            ok = f"{fmt_num(row.ms)} ms (slowest rank), loss {row.loss:.5f}" if row.error is None else None
            log(f"{label}: {ok or row.status + ': ' + row.error}" + (f"\n{tb}" if tb else ""))
            return row
        log(f"{label}: {row.error}" + (f"\n{tb}" if tb else ""))
        if fresh and not said:  # no progress and no reason: a fresh group would fail the same way
            gave_up = why
        group.close()
        group = None
        return row

    try:
        rows = run_cases(
            cases,
            execute,
            desc=f"{op} x{world_size}",
            describe=lambda c: f"{shape_label(c.shape)} {c.provider}",
            skipped={},
            skip_provider=False,  # the ranks agree per case; a provider skipped on one shape may run the next
            progress=False,
            log=None,  # each case logs its own line: the slowest rank, the loss
        )
    finally:
        if group is not None:
            group.close()
    report = Report(
        suite=suite,
        dtype=dtype,
        modes=("full",),
        shapes=tuple(tuple(s) for s in shapes),
        providers=tuple(providers),
        metadata=dict(metadata or {}),
        ceilings=ceilings,
        rows=rows,
    )
    for r in report.rows:
        if r.status == "skipped":
            report.skipped[r.provider] = r.error.removeprefix("skipped: ")
    return report, rank_info


def run_cli(args, argv: list[str]) -> int:
    """``fuselm bench <op> --world-size W``; the exit code. Raises ``UsageError``."""
    world_size = args.world_size
    suite = make_suite(args.suite, world_size)
    device = pick_device(args.device)
    cuda = device.type == "cuda"
    if cuda and torch.cuda.device_count() < world_size:
        raise UsageError(
            f"--world-size {world_size}: needs {world_size} CUDA devices, {torch.cuda.device_count()} visible"
        )
    shapes, providers = plan_suite(suite, args, device)
    for s in shapes:
        if s[2] < world_size:
            raise UsageError(f"shape {shape_label(s)}: V must be at least the world size ({world_size})")
    warmup, steps, dtype = warmup_steps_dtype(args, STEPS[device.type], cuda)
    meta = collect_metadata(torch.device("cpu"), argv)  # the device fields come from the ranks
    clock = "two CUDA events around each" if cuda else "time.perf_counter"
    timing = (
        f"fixed counts: {max(warmup, 1)} warmup steps, a barrier, {steps} timed steps ({clock}); a rank's "
        "median, the slowest rank's in the table"
    )
    meta.update(world_size=world_size, backend="nccl" if cuda else "gloo", timing=timing, quick=args.quick)
    if not cuda:
        print(
            f"No CUDA device in use: {world_size} gloo processes on the CPU, fp32, tiny shapes (no memory "
            "figures); a smoke test of the path, not comparable to GPU results."
        )
    print(
        f"{suite.name}: {len(shapes)} shapes x {len(providers)} providers on {world_size} ranks "
        f"({meta['backend']}), {max(warmup, 1)} warmup + {steps} timed steps; torch {meta['torch']}, "
        f"triton {meta['triton']}, fuselm @ {meta['commit']}",
        flush=True,
    )
    report, rank_info = run(
        op=args.suite, world_size=world_size, shapes=shapes, providers=providers, dtype=dtype,
        device_type=device.type, warmup=warmup, steps=steps, quick=args.quick, metadata=meta,
    )  # fmt: skip
    name = rank_info[0]["device"] if rank_info else device_name(torch.device(device.type, 0))
    meta = report.metadata
    meta.update(
        device_type=device.type,
        device=f"{world_size} x {name}" if cuda else f"{world_size} gloo processes on {name}",
        ranks=rank_info,
    )
    return finish(
        report,
        results_dir(args.out, name if cuda else None),
        extra_markdown=extra_markdown(report, world_size, rank_info),
        extra_json={"world_size": world_size, "summary": summary(report, world_size)},
        plot_metrics=("ms", "extra_mib") if cuda else ("ms",),
    )
