"""The benchmark lab of fuselm's ops and training steps against torch eager, torch.compile and peers
(``fuselm bench <suite>``, ``python -m fuselm_bench``): not in the wheel, it runs from a clone.

- ``cli``: the command line; ``registry``: the suites, imported lazily; ``runner``: an op suite's run.
- ``harness``: the op suites' interface (:class:`~fuselm_bench.harness.Suite`), timing, peak memory, the
  card's ceilings and ratios; one module per op suite (``cross_entropy``, ``rms_norm``, ...).
- ``cases``: the one row type and the one case loop, whatever runs a case: this process (``harness``), a
  fresh worker process (``fresh_process``: ``e2e``, ``finetune``, ``grpo_step``) or a group of ranks
  (``rank_group``: ``vocab_parallel``, ``finetune --world-size``).
- ``report``: run metadata and the markdown / JSON / PNG writers.
"""
