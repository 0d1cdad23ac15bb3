"""The shared core of the cross-entropy family (cross_entropy, linear_cross_entropy, linear_log_probs and
their vocabulary-split variants in fuselm.distributed).

- ``options``: :class:`LossOptions`, the one options object from a public function to the kernels (flattened
  only at the torch.library boundary), and :func:`loss_scales`, the device scalars a reduction needs.
- ``row_math``: the per-row math as ``@triton.jit`` helpers (logit transform, online log-sum-exp, gradient
  coefficients, d loss / d logits); every kernel of the family calls them.
- ``reference``: the same per-row math in PyTorch, for the reference paths and the tests.
- ``row_kernels`` / ``rows``: the kernels that turn rows of logits into losses and gradients, their
  launchers, and :class:`LocalRows`, the row backend of one device (a vocabulary shard is the other
  implementation, in fuselm.distributed).
- ``budget``: what ``memory=`` means for the ops that walk a buffer of many classes.
- ``compaction``: eager mode's one host sync, the kept rows and the out-of-range target error.
"""
