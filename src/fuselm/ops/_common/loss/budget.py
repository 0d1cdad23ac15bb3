"""What ``memory=`` means for the linear ops of the family (linear_cross_entropy, linear_log_probs and their
vocabulary-split variants): the bytes their buffer of many classes may take.

- ``"auto"``: AUTO_BUDGET (256 MiB), capped by a quarter of the free device memory on a single device.
- ``"min"``: temporaries within MIN_BUDGET (8 MiB) whatever the number of tokens: each path runs its
  plan of least memory that fits (the fused tile plan of linear_cross_entropy, O(N) bytes, where it runs;
  chunks or slabs of 8 MiB elsewhere).
- an int: that many bytes.

The CPU reference paths, which hold fp32 temporaries, size their chunks with the same budgets.
"""

from __future__ import annotations

import torch

from ..dispatch import capturing

AUTO_BUDGET = 256 * 2**20
MIN_BUDGET = 8 * 2**20


def memory_budget(memory, device: torch.device, query_free: bool = True) -> int:
    """Bytes allowed for the buffer of many classes. "auto": min(AUTO_BUDGET, a quarter of the free device
    memory; asked every call on CUDA when query_free, skipped under torch.compile and CUDA graph capture);
    "min": MIN_BUDGET; int: itself."""
    if memory == "min":
        return MIN_BUDGET
    if memory != "auto":
        return int(memory)
    budget = AUTO_BUDGET
    if query_free and device.type == "cuda" and not torch.compiler.is_compiling() and not capturing(device):
        free, _ = torch.cuda.mem_get_info(device)  # asked every call: nothing cached across devices
        budget = min(budget, free // 4)
    return budget
