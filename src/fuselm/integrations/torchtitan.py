"""fuselm's fused linear cross-entropy as a torchtitan loss: the LM head and the loss in one op, no logits.

torchtitan hands the LM head to a loss only when the loss subclasses its ``ChunkedLossWrapper``: the model
then runs with ``_skip_lm_head=True`` and the loss gets the hidden states [B, L, D] and, once, the
``lm_head`` module. :class:`FuselmLinearCrossEntropy` (such a subclass, built on first use: torchtitan is
not a dependency of fuselm) computes ``sum of the token losses / global_valid_tokens`` with
:func:`fuselm.linear_cross_entropy` (``ignore_index`` -100, torchtitan's), returning an ordinary
differentiable loss (no per-chunk backward, no [chunk, V] logits); in a torchtitan config-registry
function (``torchtitan.train --module my_configs --config llama3_8b_fuselm``)::

    from fuselm.integrations.torchtitan import FuselmLinearCrossEntropy
    from torchtitan.models.llama3.config_registry import llama3_8b

    def llama3_8b_fuselm():
        config = llama3_8b()
        config.loss = FuselmLinearCrossEntropy.Config(memory="auto")  # or --loss.memory min / BYTES
        return config

The ``positions`` that torchtitan's trainer passes to its loss are ignored (as its CrossEntropyLoss does);
any other loss input is refused.

The LM head may be a plain module or FSDP2-sharded: the loss runs as the head's own forward, so FSDP
gathers its weight and reduce-scatters its gradient as for any forward. Hidden states that are DTensors,
or a head whose weight stays a DTensor in its forward (tensor or sequence parallel), are refused with a
ValueError: the vocabulary-parallel form (fuselm.distributed) is not wired here yet.
"""

from __future__ import annotations

import torch

from ..ops._common.guard import validate_memory
from ..ops.linear_cross_entropy import linear_cross_entropy

IGNORE_INDEX = -100  # torchtitan's (components/loss.py)


def fused_head_loss(hidden, lm_head, labels, global_valid_tokens=None, memory="auto") -> torch.Tensor:
    """``sum over the kept tokens of cross_entropy(lm_head(hidden), labels) / global_valid_tokens`` (the
    sum alone without it), fp32, computed by :func:`fuselm.linear_cross_entropy` without the logits.

    The computation runs as ``lm_head``'s own forward (its ``forward`` replaced for the call), so an
    FSDP2-sharded head does what it does for any forward: its hooks gather the weight before, and after
    the backward reduce-scatter its gradient with the module's own settings (what torchtitan's
    ChunkedLossWrapper gets by calling ``lm_head`` on each chunk).

    Shapes: hidden ``[B, L, D]``, ``lm_head`` an ``nn.Linear(D, V)``, labels ``[B, L]`` (``-100``: no
    target); returns a scalar.

    Example:
        >>> head = torch.nn.Linear(8, 11, bias=False)
        >>> hidden, labels = torch.randn(2, 3, 8), torch.tensor([[1, 2, -100], [4, 5, 6]])
        >>> loss = fused_head_loss(hidden, head, labels, torch.tensor(5.0))
        >>> logits = head(hidden).flatten(0, 1)
        >>> ref = torch.nn.functional.cross_entropy(logits, labels.flatten(), reduction="sum")
        >>> torch.allclose(loss, ref / 5, atol=1e-5)
        True
    """
    from torch.distributed.tensor import DTensor

    if isinstance(hidden, DTensor):
        raise ValueError(
            "hidden states must be a plain tensor (data parallel / FSDP); DTensor hidden states (tensor or "
            "sequence parallel) are not supported by fuselm's torchtitan loss yet"
        )

    def summed_loss(h, target):  # lm_head's forward for this call: its parameters as FSDP unshards them
        weight, bias = lm_head.weight, lm_head.bias
        if isinstance(weight, DTensor):
            raise ValueError(
                "lm_head.weight is a DTensor inside its forward (tensor parallel): not supported yet"
            )
        return linear_cross_entropy(
            h.flatten(0, 1),
            weight,
            target.flatten(),
            linear_bias=bias,
            ignore_index=IGNORE_INDEX,
            reduction="sum",
            memory=memory,
            loss_dtype=torch.float32,
        )

    lm_head.forward = summed_loss  # an instance attribute over the class's forward, for this call only
    try:
        loss = lm_head(hidden, labels)
    finally:
        del lm_head.forward
    return loss if global_valid_tokens is None else loss / global_valid_tokens


def __getattr__(name: str):
    """FuselmLinearCrossEntropy, built on first use (it subclasses torchtitan's ChunkedLossWrapper)."""
    if name == "FuselmLinearCrossEntropy":
        globals()[name] = _make_loss_class()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _make_loss_class():
    from dataclasses import dataclass

    from torchtitan.components.loss import ChunkedLossWrapper

    class FuselmLinearCrossEntropy(ChunkedLossWrapper):
        """torchtitan's chunked LM-head loss, computed by fuselm's fused linear cross-entropy (module
        docstring). ``Config.memory``: the plan of :func:`fuselm.linear_cross_entropy` (``"auto"``,
        ``"min"`` or a byte budget); the wrapper's ``num_chunks`` and ``loss_fn`` are not used."""

        @dataclass(kw_only=True, slots=True)
        class Config(ChunkedLossWrapper.Config):
            memory: str | int = "auto"
            """fuselm.linear_cross_entropy's memory plan."""

        def __init__(self, config: Config, *, compile_config=None):
            super().__init__(config, compile_config=compile_config)
            memory = config.memory
            if isinstance(memory, str) and memory.isdigit():  # torchtitan's CLI: --loss.memory 268435456
                memory = int(memory)
            validate_memory(memory)  # refused when the trainer is built, not at its first step
            self.memory = memory

        def __call__(self, pred, labels, global_valid_tokens=None, **loss_inputs):
            if self.lm_head is None:
                raise RuntimeError("FuselmLinearCrossEntropy: set_lm_head(lm_head) before the first call")
            # torchtitan's trainer passes the batch's ``positions`` (per-document token positions, which
            # its text dataloader always yields) to the loss; cross-entropy does not use them (neither
            # does torchtitan's CrossEntropyLoss). Any other per-token input would change the loss.
            loss_inputs.pop("positions", None)
            if loss_inputs:
                raise ValueError(f"loss inputs {sorted(loss_inputs)} are not supported by the fused loss")
            loss = fused_head_loss(pred, self.lm_head, labels, global_valid_tokens, self.memory)
            return loss, {}

    return FuselmLinearCrossEntropy
