"""The benchmark lab of fuselm's ops and training steps against torch eager, torch.compile and peers
(``python -m fuselm_bench``, or ``fuselm bench`` with it importable): not in the wheel, it runs from a clone.

- ``cli``, ``registry`` (the suites, imported lazily), ``runner`` (an op suite's run); ``harness``: the op
  suites' interface, timing, memory, ceilings; one module per op suite (``cross_entropy``, ...).
- ``cases``: the one row type and case loop, whatever runs a case: this process (``harness``), a fresh
  worker (``fresh_process``: ``e2e``, ``finetune``, ``grpo_step``).
- ``report``: run metadata and the markdown / JSON / PNG writers.
"""
