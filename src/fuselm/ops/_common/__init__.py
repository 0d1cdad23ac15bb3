"""Shared helpers of the ops: device dispatch, input guards, launch heuristics, testing helpers."""
