"""A group of W spawned ranks running benchmark cases, watched by the parent: what
``fuselm bench linear_cross_entropy|linear_log_probs --world-size W`` (:mod:`fuselm_bench.vocab_parallel`)
and ``fuselm bench finetune --world-size W`` (:mod:`fuselm_bench.finetune`) share.

Each rank joins one process group (:func:`join_group`: NCCL with one GPU per rank on CUDA, gloo on a CPU;
``file://`` init in the group's temporary folder), runs its cases in order, and appends what each gave as
one JSON line to ``rank<r>.jsonl`` there. A case ends with an all-reduce of its status on every rank
(:func:`finish_case`: the worst of ok, skipped, OOM, error wins), so all ranks go on together and a
failure on one rank is the case's status on all. A rank that fails while the others are inside a
collective can leave them waiting: it first writes a record of its failure (``final: False``); the parent
(:class:`RankGroup`) reads the files as they grow and kills a group that makes no progress (``timeout_s``
without a case finishing; ``grace_s`` once a rank has reported a failure).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from .cases import STATUSES  # in order of precedence: the ranks agree on the worst
from .harness import free_memory

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
    """Join the group (NCCL on ``cuda:<rank>``, made the current device; gloo on a CPU): this rank's
    device."""
    cuda = device_type == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if cuda else None,
    )
    return device


def capture_output(out_dir: str | Path, rank: int) -> None:
    """Send this process's stdout and stderr (file descriptors 1 and 2) to ``rank<r>.log`` in the group's
    folder; :meth:`RankGroup.failure_with_output` quotes its tail."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(Path(out_dir) / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def append_record(path: Path, record: dict[str, Any]) -> None:
    """One JSON line appended to a rank's records (the parent reads only whole lines)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


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


def case_records(records: list[dict[str, Any]], index: int, final: bool = True) -> list[dict[str, Any]]:
    """The records of case ``index``: the final ones (after the agreement), or the failures said before it
    (``final=False``)."""
    return [r for r in records if r["kind"] == "case" and r["index"] == index and r["final"] == final]


def rank_error(record: dict[str, Any]) -> str:
    """A rank's error, naming the rank (the error first: an OOM stays an OOM in a table)."""
    return f"{record['error']} (rank {record['rank']})"


def failed_case(
    records: list[dict[str, Any]], index: int, world_size: int, failure: str | None = None
) -> dict[str, Any] | None:
    """None when every rank finished case ``index`` ok; else its ``status``, ``error`` and ``traceback``:
    the agreed status with the first failing rank's error, or, when not every rank finished it, the failure
    a rank said before it got stuck (else ``failure``: why the group stopped, else the missing ranks)."""
    finals = {r["rank"]: r for r in case_records(records, index)}
    if len(finals) < world_size:
        said = sorted(case_records(records, index, final=False), key=lambda r: r["rank"])
        if said:
            return {
                "status": said[0]["status"],
                "error": rank_error(said[0]),
                "traceback": said[0].get("traceback"),
            }
        missing = sorted(set(range(world_size)) - set(finals))
        return {"status": "error", "error": failure or f"no result from ranks {missing}", "traceback": None}
    agreed = finals[0]["agreed"]
    if agreed == "ok":
        return None
    first = min((r for r in finals.values() if r["status"] == agreed), key=lambda r: r["rank"])
    error = first["error"] if agreed == "skipped" else rank_error(first)
    return {"status": agreed, "error": error, "traceback": first.get("traceback")}


class RankGroup:
    """``world_size`` spawned processes ``entry(rank, *args, init_file, out_dir)`` (with ``env`` in their
    environment) running their cases in order, and the parent waiting for those cases one at a time
    (:meth:`wait_for`). A group with no case finished for ``timeout_s``, or for ``grace_s`` after a rank said
    the case failed, is killed; a stopped group stays stopped (:attr:`failure` says why). A context
    manager (:meth:`close`)."""

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
        with mock.patch.dict(os.environ, env or {}):  # what the spawned processes inherit
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
        """Every whole line the ranks have written so far (a line being written is read next time)."""
        records = []
        for path in sorted(self.folder.glob("rank*.jsonl")):
            records += [
                json.loads(line) for line in path.read_text().splitlines(keepends=True) if line[-1:] == "\n"
            ]
        return records

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
                lines = [line for line in str(e).strip().splitlines() if line.strip()]
                self.exited = True
                self.failure = f"a rank failed: {lines[-1].strip() if lines else type(e).__name__}"
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
        """:attr:`failure` with the last lines of each rank's captured output (:func:`capture_output`)."""
        if self.failure is None:
            return None
        parts = [self.failure]
        for path in sorted(self.folder.glob("rank*.log")):
            tail = [line for line in path.read_text(errors="replace").splitlines() if line.strip()][-6:]
            if tail:
                parts.append(f"{path.stem}'s last output:\n" + "\n".join(tail))
        return "\n".join(parts)

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
