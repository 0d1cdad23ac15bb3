"""Launch heuristics of the row-wise kernels: the block of a one-row program, and persistent grids."""

from __future__ import annotations

import functools

import torch

from .dispatch import interpret_mode


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1); triton.next_power_of_2 on the host without its
    per-call cost (a few microseconds in Triton 3.9, where it is a constexpr function)."""
    return 1 << max(int(n) - 1, 0).bit_length()


@functools.lru_cache(maxsize=256)  # host time: called per launch
def row_launch(n_cols: int, max_block: int = 32768) -> tuple[int, int]:
    """Block size and warp count for a kernel that walks one row of `n_cols` elements.

    BLOCK is the next power of two of n_cols, capped at `max_block` (then the kernel loops);
    warps grow with the block so that each thread holds a few dozen values at most.
    Under the interpreter the block stays small: it is numpy, and huge blocks only cost time.
    """
    block = next_pow2(n_cols)
    if interpret_mode():
        max_block = min(max_block, 256)
    block = min(block, max_block)
    num_warps = min(32, max(4, block // 1024))
    return block, num_warps


@functools.lru_cache(maxsize=8)
def _sm_limits(index: int) -> tuple[int, int, int, int]:
    """(multiprocessors, registers, threads, shared memory bytes) per multiprocessor."""
    p = torch.cuda.get_device_properties(index)
    return (
        p.multi_processor_count,
        getattr(p, "regs_per_multiprocessor", 65536),
        getattr(p, "max_threads_per_multi_processor", 2048),
        getattr(p, "shared_memory_per_multiprocessor", 228 * 1024),
    )


def persistent_grid(n_items: int, device, programs_per_sm: int) -> int:
    """Programs of a persistent kernel over `n_items` rows: a few per multiprocessor, at most one a row."""
    if device.type != "cuda":
        return max(n_items, 1)
    return max(1, min(n_items, _sm_limits(device.index or 0)[0] * programs_per_sm))


_OCCUPANCY: dict[tuple, int] = {}


def _occupancy_key(kwargs: dict) -> tuple:
    """What decides a compiled variant's registers: tensor dtypes, the constexprs (UPPER_CASE names)
    and num_warps. The launch builds kwargs in a fixed order, so no sorting. Integer and alignment
    specializations are left out: they change the registers little, and a wrong guess costs time only."""
    return tuple(
        v.dtype if isinstance(v, torch.Tensor) else v
        for k, v in kwargs.items()
        if k[0].isupper() or k == "num_warps" or isinstance(v, torch.Tensor)
    )


def resident_programs(
    kernel,
    kwargs: dict,
    n_items: int,
    device: torch.device,
    per_sm: int,
    max_per_sm: int = 8,
    fallback_per_sm: int = 2,
) -> int:
    """Programs of a persistent `kernel` (launched with `kwargs`) over n_items row blocks: per_sm per
    multiprocessor if per_sm > 0, else as many as are resident at once (one wave), from the compiled
    kernel's register and shared memory use, at most max_per_sm per multiprocessor (fallback_per_sm
    when this Triton cannot say). The occupancy is computed once per kernel variant and device."""
    if device.type != "cuda":
        return max(n_items, 1)
    if per_sm <= 0:
        name = getattr(getattr(kernel, "fn", None), "__name__", type(kernel).__name__)
        key = (name, device.index, max_per_sm, _occupancy_key(kwargs))
        per_sm = _OCCUPANCY.get(key, 0)
        if not per_sm:
            try:
                compiled = kernel.warmup(grid=(1,), **kwargs)
                compiled._init_handles()
                _, regs, threads, smem = _sm_limits(device.index or 0)
                threads_per_program = 32 * kwargs["num_warps"]
                regs_per_thread = -(-max(1, compiled.n_regs) // 8) * 8  # allocated 256 per warp
                per_sm = min(
                    regs // (regs_per_thread * threads_per_program),
                    threads // threads_per_program,
                    smem // max(1, compiled.metadata.shared),
                )
                per_sm = max(1, min(per_sm, max_per_sm))
            except Exception:  # noqa: BLE001 - an older or newer Triton: use the fixed count
                per_sm = fallback_per_sm
            _OCCUPANCY[key] = per_sm
    return persistent_grid(n_items, device, per_sm)
