"""One row-launch heuristic for every row-wise kernel."""

from __future__ import annotations

import functools

import triton

from .dispatch import interpret_mode


def row_launch(n_cols: int, max_block: int = 32768) -> tuple[int, int]:
    """Block size and warp count for a kernel that walks one row of `n_cols` elements.

    BLOCK is the next power of two of n_cols, capped at `max_block` (then the kernel loops);
    warps grow with the block so that each thread holds a few dozen values at most.
    Under the interpreter the block stays small: it is numpy, and huge blocks only cost time.
    """
    block = triton.next_power_of_2(max(int(n_cols), 1))
    if interpret_mode():
        max_block = min(max_block, 256)
    block = min(block, max_block)
    num_warps = min(32, max(4, block // 1024))
    return block, num_warps


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def persistent_grid(n_items: int, device, programs_per_sm: int) -> int:
    """Programs of a persistent kernel over `n_items` rows: a few per multiprocessor, at most one a row."""
    if device.type != "cuda":
        return max(n_items, 1)
    return max(1, min(n_items, _sm_count(device.index or 0) * programs_per_sm))
