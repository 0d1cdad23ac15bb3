"""TRL integration: TRL's trainers compute their fused LM head with :func:`fuselm.linear_log_probs`.

    >>> import fuselm.trl
    >>> fuselm.trl.patch()          # every trainer: SFT, DPO, GRPO, KTO, RLOO, ...   # doctest: +SKIP
    >>> fuselm.trl.is_patched()                                                        # doctest: +SKIP
    True
    >>> fuselm.trl.unpatch()        # TRL's own kernel again                          # doctest: +SKIP

trl is an optional dependency, imported by :func:`patch`, not when this package is imported.
Supported: trl ``>=1.16,<2`` (``SUPPORTED``); tested with trl 1.16.0.
"""

from .patching import SUPPORTED, FusedLogProbs, is_patched, patch, unpatch

__all__ = ["patch", "unpatch", "is_patched", "FusedLogProbs", "SUPPORTED"]
