"""Per-token log-probability module: holds the options, calls the op."""

from __future__ import annotations

import torch

from ..ops.linear_log_probs import LogProbs, linear_log_probs


class LinearLogProbs(torch.nn.Module):
    """Module form of :func:`fuselm.linear_log_probs`: per-token log-probabilities (and, on request, entropy
    and other statistics) of ``target`` under the logits ``input @ linear_weight.T + linear_bias``.

    The projection weight is an argument of ``forward`` (usually the model's ``lm_head.weight``), so tied
    embeddings and existing modules keep their parameters. The options are those of the function.

    Example:
        >>> import torch, fuselm
        >>> head = fuselm.nn.LinearLogProbs(outputs=("entropy",), temperature=0.9)
        >>> hidden, lm_head = torch.randn(6, 16), torch.randn(50, 16)
        >>> out = head(hidden, lm_head, torch.tensor([1, 2, 3, -100, 4, 49]))
        >>> out.log_probs.shape, out.entropy.shape, out.is_top1
        (torch.Size([6]), torch.Size([6]), None)
    """

    def __init__(
        self,
        *,
        outputs=("log_probs",),
        temperature: float = 1.0,
        softcap: float | None = None,
        logit_scale: float = 1.0,
        ignore_index: int = -100,
        memory: str | int = "auto",
    ) -> None:
        super().__init__()
        self.outputs = (outputs,) if isinstance(outputs, str) else tuple(outputs)
        self.temperature = temperature
        self.softcap = softcap
        self.logit_scale = logit_scale
        self.ignore_index = ignore_index
        self.memory = memory

    def forward(
        self,
        input: torch.Tensor,
        linear_weight: torch.Tensor,
        target: torch.Tensor,
        linear_bias: torch.Tensor | None = None,
    ) -> LogProbs:
        return linear_log_probs(
            input,
            linear_weight,
            target,
            linear_bias=linear_bias,
            ignore_index=self.ignore_index,
            temperature=self.temperature,
            softcap=self.softcap,
            logit_scale=self.logit_scale,
            outputs=self.outputs,
            memory=self.memory,
        )

    def extra_repr(self) -> str:
        return (
            f"outputs={self.outputs!r}, temperature={self.temperature}, softcap={self.softcap}, "
            f"logit_scale={self.logit_scale}, ignore_index={self.ignore_index}, memory={self.memory!r}"
        )
