"""A group of W spawned ranks running benchmark cases, watched by the parent: what
``fuselm bench linear_cross_entropy|linear_log_probs --world-size W`` (:mod:`fuselm_bench.vocab_parallel`)
and ``fuselm bench finetune --world-size W`` (:mod:`fuselm_bench.finetune`) share.

Each rank joins one process group (:func:`join_group`: NCCL with one GPU per rank on CUDA, gloo on a CPU;
``file://`` init in the group's temporary folder), runs the cases it is given in order, and appends what
each case gave as one JSON line to ``rank<r>.jsonl`` in that folder (:func:`append_record`). A case ends
with an all-reduce of its status on every rank (:func:`finish_case`: the worst of ok, skipped, OOM, error
wins), so all ranks go on to the next case together and a failure on one rank becomes the case's status
on all. A rank that fails while the others are inside a collective can leave them waiting there: it first
writes a record of its failure (``final: False``), the parent (:class:`RankGroup`) reads the files as they
grow, and kills a group that makes no progress (``timeout_s`` without a case finishing; ``grace_s`` once a
rank has reported a failure).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .harness import SkipProvider, error_text, free_memory

STATUSES = ("ok", "skipped", "oom", "error")  # in order of precedence: the ranks agree on the worst
FAILED_GRACE_S = 60.0  # a rank reported a failure: how long the others may take to reach the agreement
POLL_S = 0.2
NCCL_ENV = {  # NVLink multicast (NVLS) off: not every lent machine has it working
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


# ---- in a rank ----


def join_group(
    rank: int, world_size: int, device_type: str, init_file: str, timeout_s: float
) -> torch.device:
    """Join the group (NCCL on ``cuda:<rank>``, made the current device; gloo on a CPU) and return this
    rank's device."""
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        backend, device_id = "nccl", device
    else:
        device, backend, device_id = torch.device("cpu"), "gloo", None
    dist.init_process_group(
        backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device_id,
    )
    return device


def capture_output(out_dir: str | Path, rank: int) -> None:
    """Send this process's stdout and stderr (file descriptors 1 and 2: Python's, C libraries') to
    ``rank<r>.log`` in the group's folder; :class:`RankGroup` quotes its tail when the group fails."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(Path(out_dir) / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def output_tails(out_dir: Path, lines: int = 6) -> str:
    """The last ``lines`` lines of each rank's captured output (:func:`capture_output`), '' if none."""
    parts = []
    for path in sorted(Path(out_dir).glob("rank*.log")):
        tail = [line for line in path.read_text(errors="replace").splitlines() if line.strip()][-lines:]
        if tail:
            parts.append(f"{path.stem}'s last output:\n" + "\n".join(tail))
    return "\n".join(parts)


def append_record(path: Path, record: dict[str, Any]) -> None:
    """One JSON line appended to a rank's records (the parent reads only whole lines)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def measure_into(record: dict[str, Any], measure: Callable[[], dict[str, Any]], device: torch.device) -> None:
    """``record.update(measure())``, or the failure in ``record``: ``skipped`` (:class:`SkipProvider`, its
    message the reason), ``oom`` (``torch.cuda.OutOfMemoryError``, with the peak allocated so far), or
    ``error`` (the exception and the tail of its traceback)."""
    try:
        record.update(measure())
    except SkipProvider as e:
        record.update(status="skipped", error=str(e))
    except torch.cuda.OutOfMemoryError as e:
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        record.update(status="oom", error=error_text(e, 200), peak_bytes=peak)
    except Exception as e:  # noqa: BLE001 - reported in the row; the group goes on
        record.update(status="error", error=error_text(e, 200), traceback=traceback.format_exc()[-3000:])


def finish_case(record: dict[str, Any], path: Path, device: torch.device) -> str:
    """End a case on this rank: a failure is written at once (``final: False``: the other ranks may be
    stuck in a collective), memory is freed, the ranks agree on the worst status and on the case index
    (an all-reduce, which is also the case's barrier), and the record is written with ``agreed`` and
    ``final: True``. Returns the agreed status. Raises ``RuntimeError`` if the ranks are at different
    cases."""
    if record["status"] != "ok":
        append_record(path, {**record, "final": False})
    free_memory(device)
    index = record["index"]
    mine = torch.tensor([STATUSES.index(record["status"]), index, -index], dtype=torch.int64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    status, hi, neg_lo = mine.tolist()
    if hi != -neg_lo:
        raise RuntimeError(f"ranks out of step: cases {-neg_lo} to {hi} at one agreement")
    append_record(path, {**record, "agreed": STATUSES[status], "final": True})
    return STATUSES[status]


# ---- the parent ----


def read_records(out_dir: Path) -> list[dict[str, Any]]:
    """Every whole line of every rank's records (a line being written is read next time)."""
    records = []
    for path in sorted(Path(out_dir).glob("rank*.jsonl")):
        for line in path.read_text().splitlines(keepends=True):
            if line.endswith("\n"):
                records.append(json.loads(line))
    return records


def case_records(records: list[dict[str, Any]], index: int, final: bool = True) -> list[dict[str, Any]]:
    """The case records of case ``index``: the final ones (after the agreement), or the failures said
    before it (``final=False``)."""
    return [r for r in records if r["kind"] == "case" and r["index"] == index and r["final"] == final]


def rank_error(record: dict[str, Any]) -> str:
    """A rank's error, naming the rank (the error first: an OOM stays an OOM in a table)."""
    return f"{record['error']} (rank {record['rank']})"


def failure_text(e: BaseException) -> str:
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return f"a rank failed: {lines[-1].strip()}" if lines else f"a rank failed: {type(e).__name__}"


@contextlib.contextmanager
def environment(extra: dict[str, str] | None) -> Iterator[None]:
    """``os.environ`` with ``extra`` set (what spawned processes inherit), restored afterwards."""
    saved = {k: os.environ.get(k) for k in extra or {}}
    os.environ.update(extra or {})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class RankGroup:
    """``world_size`` spawned processes ``entry(rank, *args, init_file, out_dir)`` (with ``env`` set in their
    environment) that run their cases in order, and the parent waiting for those cases one at a time
    (:meth:`wait_for`): the process-group way of running :func:`cases.run_cases`'s cases. A group with no
    case finished for ``timeout_s``, or for ``grace_s`` after a rank said the case failed, is killed; a
    stopped group stays stopped (:attr:`failure` says why). Use it as a context manager (:meth:`close`)."""

    def __init__(
        self,
        entry: Callable[..., None],
        args: tuple[Any, ...],
        *,
        world_size: int,
        timeout_s: float,
        grace_s: float = FAILED_GRACE_S,
        env: dict[str, str] | None = None,
        prefix: str = "fuselm-rank-group-",
    ) -> None:
        import torch.multiprocessing as mp

        self.world_size, self.timeout_s, self.grace_s = world_size, timeout_s, grace_s
        self._tmp = tempfile.TemporaryDirectory(prefix=prefix)
        self.folder = Path(self._tmp.name)
        with environment(env):
            self._ctx = mp.start_processes(
                entry,
                args=(*args, str(self.folder / "init"), self._tmp.name),
                nprocs=world_size,
                join=False,
                start_method="spawn",
            )
        self._progress_at = time.monotonic()  # when the group last finished a case (or started)
        self.exited = False
        self.failure: str | None = None

    def records(self) -> list[dict[str, Any]]:
        """Every record the ranks have written so far (:func:`read_records`)."""
        return read_records(self.folder)

    def wait_for(self, index: int) -> tuple[list[dict[str, Any]], str | None]:
        """Wait until case ``index`` is final on every rank: its final records and None; or, when the group
        stopped first (exited, a rank died, killed for no progress), the records so far and why."""
        from torch.multiprocessing.spawn import ProcessException

        noticed_at: float | None = None  # when a rank first said this case failed
        while True:
            records = self.records()
            finished = case_records(records, index)
            if len(finished) >= self.world_size:
                self._progress_at = time.monotonic()
                return finished, None
            if self.exited or self.failure is not None:
                self.failure = self.failure or f"the ranks exited before case {index} finished"
                return records, self.failure
            try:
                self.exited = self._ctx.join(POLL_S)
            except ProcessException as e:  # join() has ended the other ranks
                self.exited, self.failure = True, failure_text(e)
            now = time.monotonic()
            if noticed_at is None and case_records(records, index, final=False):
                noticed_at = now
            limit, since = (
                (self.timeout_s, self._progress_at) if noticed_at is None else (self.grace_s, noticed_at)
            )
            if not self.exited and now - since > limit:
                self.failure = f"no progress for {limit:.0f} s (ranks stuck, e.g. in a collective); killed"
                self._kill()

    def failure_with_output(self) -> str | None:
        """:attr:`failure` with the tail of each rank's captured output (:func:`capture_output`)."""
        if self.failure is None:
            return None
        tails = output_tails(self.folder)
        return self.failure + (f"\n{tails}" if tails else "")

    def _kill(self) -> None:
        for p in self._ctx.processes:
            if p.is_alive():
                p.kill()
        for p in self._ctx.processes:
            p.join()
        self.exited = True

    def close(self) -> None:
        """Wait for ranks that are finishing (``timeout_s`` at most), kill what is left, remove the folder."""
        deadline = time.monotonic() + self.timeout_s
        while not self.exited and time.monotonic() < deadline:
            try:
                self.exited = self._ctx.join(POLL_S)
            except Exception:  # noqa: BLE001 - a rank failing while it ends: what it wrote stays read
                break
        self._kill()
        self._tmp.cleanup()

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
