from .op import linear_log_probs
from .reference import LogProbs, linear_log_probs_reference

__all__ = ["linear_log_probs", "LogProbs", "linear_log_probs_reference"]
