"""Vocabulary-parallel losses on torch.distributed: the classes (lm_head rows) split across the ranks of
a process group, per-token statistics exchanged instead of logits. See README.md."""

from .log_probs import linear_log_probs
from .losses import cross_entropy, linear_cross_entropy
from .shard import VocabShard

__all__ = ["cross_entropy", "linear_cross_entropy", "linear_log_probs", "VocabShard"]
