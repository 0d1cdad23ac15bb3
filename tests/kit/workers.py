"""Run a function on W processes of one torch.distributed group and collect what each rank returns.

    results = run_workers(fn, world_size=2, backend="gloo", args=(...))   # [rank 0 result, rank 1 ...]

`fn(rank, world_size, *args)` runs in a fresh spawned process after init_process_group (gloo on CPU,
nccl with one GPU per rank); it must be importable (a module-level function). Its return value is
pickled back (keep it to CPU tensors and plain data). An exception in any rank fails the call with
that rank's traceback; a rank that hangs fails it after `timeout` seconds.
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def nccl_world_sizes() -> tuple[int, ...]:
    """World sizes the GPU tests can run: 2 when there are at least 2 CUDA devices."""
    return (2,) if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else ()


def backend_params(world_size: int = 2) -> tuple:
    """pytest params of the process-group backends a test runs on: "gloo" (CPU processes) always, "nccl"
    (one GPU per rank, marked gpu) where `world_size` CUDA devices are there, else skipped saying so."""
    import pytest

    nccl_marks = [
        pytest.mark.gpu,
        pytest.mark.skipif(world_size not in nccl_world_sizes(), reason=f"needs {world_size} CUDA devices"),
    ]
    return (
        pytest.param("gloo", id="gloo-cpu"),
        pytest.param("nccl", id="nccl-cuda", marks=nccl_marks),
    )


def _entry(rank, world_size, backend, init_file, out_dir, fn, args):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    result_path = Path(out_dir) / f"rank{rank}.pkl"
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        try:
            value = ("ok", fn(rank, world_size, *args))
        finally:
            dist.destroy_process_group()
    except BaseException:  # reported to the parent, which raises
        value = ("error", traceback.format_exc())
    with open(result_path, "wb") as f:
        pickle.dump(value, f)
    # Leave without interpreter finalization: there, gloo's worker threads can still hold tensors and
    # abort the process ("terminate called without an active exception", seen in CI with a DeviceMesh)
    # after the result is already written. Nothing else is left to run in this process.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    *,
    backend: str = "gloo",
    args: tuple = (),
    timeout: float = 600.0,
) -> list[Any]:
    """fn(rank, world_size, *args) on each of `world_size` processes; returns the per-rank results."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        ctx = mp.spawn(
            _entry,
            args=(world_size, backend, init_file, tmp, fn, args),
            nprocs=world_size,
            join=False,
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(max(0.0, deadline - time.monotonic())):  # True once every rank has exited
            if time.monotonic() >= deadline:
                alive = [i for i, p in enumerate(ctx.processes) if p.is_alive()]
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"ranks {alive} still running after {timeout:.0f} s")
        results, errors = [], []
        for rank in range(world_size):
            path = Path(tmp) / f"rank{rank}.pkl"
            if not path.exists():
                errors.append(f"rank {rank} wrote no result (crashed?)")
                continue
            status, value = pickle.loads(path.read_bytes())
            if status != "ok":
                errors.append(f"rank {rank} failed:\n{value}")
            results.append(value)
        if errors:  # every rank's error: the first one to fail is not always rank 0
            raise RuntimeError("\n".join(errors))
        return results


_CASE_RESULTS: dict = {}


def case_results(worker: Callable[..., Any], names, world: int, backend: str, dtype) -> list[Any]:
    """Per-rank results of ``worker(rank, world, names, dtype, device_kind)``, every case in one spawn,
    computed once per (worker, world size, backend, dtype, interpreter mode) in this test process."""
    key = (
        worker.__module__,
        worker.__qualname__,
        world,
        backend,
        dtype,
        os.environ.get("TRITON_INTERPRET", "0"),
    )
    if key not in _CASE_RESULTS:
        kind = "cuda" if backend == "nccl" else "cpu"
        _CASE_RESULTS[key] = run_workers(worker, world, backend=backend, args=(list(names), dtype, kind))
    return _CASE_RESULTS[key]
