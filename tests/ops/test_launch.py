"""ops/_common/launch.py: the host-side helpers every launcher calls."""

from __future__ import annotations

import triton

from fuselm.ops._common.dispatch import interpret_mode
from fuselm.ops._common.launch import next_pow2, row_launch


def test_next_pow2_matches_triton():
    for n in [*range(0, 70), 127, 128, 129, 4095, 4096, 4097, 32000, 128256, 2**31 - 1, 2**31, 2**31 + 1]:
        assert next_pow2(n) == triton.next_power_of_2(max(n, 1)), n
    assert next_pow2(-5) == 1


def test_row_launch_blocks_and_warps():
    """The next power of two of the row, capped (256 under the interpreter), and warps that grow with it."""
    cap = 256 if interpret_mode() else 4096
    block, warps = row_launch(3000, max_block=4096)
    assert block == min(4096, cap) and 4 <= warps <= 32
    assert row_launch(3000, max_block=4096) == (block, warps)  # cached: the same answer again
    assert row_launch(1) == (1, 4)
