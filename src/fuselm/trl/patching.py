"""``patch`` / ``unpatch``: TRL's fused LM head computed by :func:`fuselm.linear_log_probs`.

TRL (1.16 and later 1.x) computes the LM head of its trainers (SFT, DPO, GRPO, KTO, RLOO, and the
experimental ones built on them) through ``trl.trainer.utils.add_fused_lm_head``. The forward that
function installs calls ``_ChunkedLogProbFunction.apply(...)``, a global of ``trl.trainer.utils`` read
at every call. ``patch`` puts :class:`FusedLogProbs` in its place: the same ``apply`` signature and
outputs, computed by fuselm. ``unpatch`` puts TRL's class back (the same object). Because the global is
read at call time, patching works before or after the trainer (and its models) are built.
"""

from __future__ import annotations

import inspect
import sys
from contextlib import contextmanager, nullcontext

import torch

from ..ops._common.guard import validate_memory
from ..ops.linear_log_probs import linear_log_probs

SUPPORTED = ">=1.16,<2"  # the trl versions with the global and the signature below
_FIRST, _END = (1, 16), (2,)
TRL_MODULE = "trl.trainer.utils"
TRL_GLOBAL = "_ChunkedLogProbFunction"
# ChunkedLogProbFunction.forward's parameters in trl 1.16 (the contract this adapter implements)
TRL_PARAMETERS = (
    "ctx",
    "hidden",
    "weight",
    "bias",
    "targets",
    "temperature",
    "chunk_size",
    "final_logit_softcapping",
    "logit_scale",
    "outputs",
)
# The per-token outputs, in the order TRL's kernel returns them
TRL_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")

_original: type | None = None  # TRL's class while patched
_memory: str | int = "auto"  # the plan FusedLogProbs asks linear_log_probs for


class FusedLogProbs:
    """Stands in for TRL's ``ChunkedLogProbFunction`` while :func:`patch` is in force.

    ``FusedLogProbs.apply`` takes TRL's arguments and returns TRL's 5-tuple
    ``(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)`` of ``[N]`` tensors (``None`` where
    not in ``outputs``): fp32, ``is_top1`` bool; ``log_probs`` and ``entropy`` differentiable with respect
    to ``hidden``, ``weight`` and ``bias``. The math is :func:`fuselm.linear_log_probs`'s, which follows
    TRL's order: ``z = (hidden @ weight.T + bias) * logit_scale``, then ``softcap * tanh(z / softcap)``,
    then ``z / temperature``.

    Where it differs from TRL's kernel:

    - ``chunk_size`` (TRL's vocabulary tile width) is ignored: fuselm picks its own plan within the
      memory budget given to :func:`patch` (``memory=``).
    - The compute dtype is TRL's (the autocast dtype when autocast is on, else ``hidden``'s): ``hidden``,
      ``weight`` and ``bias`` are cast to it before the call (no copy when they already have it). When the
      head's weight is fp32 under bf16 autocast, that cast is one bf16 copy of the weight, and its
      gradient, accumulated in fp32 by fuselm, is rounded to bf16 once before autograd adds it to the
      fp32 ``.grad`` (TRL's returns its fp32 accumulator as is).
    - Outputs of float64 inputs are float64 (TRL's are fp32 whatever the inputs).
    - A target equal to ``-100`` gives 0 log-prob and 0 entropy (TRL's kernel is never called with one:
      ``add_fused_lm_head`` drops or clamps ignored labels and zeroes their outputs afterwards); an
      out-of-range target raises ``ValueError``.
    - An unknown name in ``outputs`` raises ``ValueError`` (TRL's kernel ignores it).
    - DeepSpeed ZeRO-3 partitioned weights are refused with a clear error: the backward recomputes the
      logits from ``weight``, which ZeRO-3 has partitioned again by then.

    Example (what ``add_fused_lm_head``'s forward does, on CPU):

        >>> import torch
        >>> hidden, weight = torch.randn(5, 16), torch.randn(40, 16)
        >>> targets = torch.tensor([1, 2, 3, 4, 5])
        >>> outputs = ("log_probs", "entropy")
        >>> out = FusedLogProbs.apply(hidden, weight, None, targets, 1.0, 32768, None, 1.0, outputs)
        >>> [None if t is None else tuple(t.shape) for t in out]
        [(5,), (5,), None, None, None]
    """

    @staticmethod
    def apply(
        hidden: torch.Tensor,  # [N, H]
        weight: torch.Tensor,  # [V, H]
        bias: torch.Tensor | None,  # [V]
        targets: torch.Tensor,  # [N]
        temperature: float,
        chunk_size: int,
        final_logit_softcapping: float | None = None,
        logit_scale: float = 1.0,
        outputs: tuple[str, ...] = TRL_OUTPUTS,
    ) -> tuple[torch.Tensor | None, ...]:
        del chunk_size  # fuselm's plan comes from the memory budget
        unknown = [name for name in outputs if name not in TRL_OUTPUTS]
        if unknown:
            raise ValueError(f"outputs: unknown {unknown}, expected names among {TRL_OUTPUTS}")
        if any(hasattr(p, "ds_status") for p in (weight, bias) if p is not None):
            raise NotImplementedError(
                "fuselm.trl does not support DeepSpeed ZeRO-3 (the backward recomputes the logits from "
                "lm_head.weight, which ZeRO-3 partitions again after the forward): call fuselm.trl.unpatch() "
                "to use TRL's kernel, or shard with FSDP2"
            )
        device = hidden.device.type
        autocast = torch.is_autocast_enabled(device)
        dtype = torch.get_autocast_dtype(device) if autocast else hidden.dtype
        with torch.autocast(device, enabled=False) if autocast else nullcontext():
            out = linear_log_probs(
                hidden.to(dtype),
                weight.to(dtype),
                targets,
                linear_bias=None if bias is None else bias.to(dtype),
                temperature=temperature,
                softcap=final_logit_softcapping,
                logit_scale=logit_scale,
                outputs=tuple(name for name in TRL_OUTPUTS if name == "log_probs" or name in outputs),
                memory=_memory,
            )
        return out.log_probs, out.entropy, out.log_sum_sq_probs, out.mean_logits, out.is_top1


def _supported(version: str) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(version).release
    except InvalidVersion:
        return False
    return _FIRST <= release < _END


def _trl_utils():
    """``trl.trainer.utils`` after checking the installed trl: version and the global's contract."""
    try:
        import trl
    except ImportError as e:
        raise ImportError(f'fuselm.trl needs trl {SUPPORTED}: pip install "trl{SUPPORTED}"') from e
    version = getattr(trl, "__version__", "unknown")
    if not _supported(version):
        raise RuntimeError(
            f"fuselm.trl supports trl {SUPPORTED} (1.16 and later 1.x releases); trl {version} is installed"
        )
    import trl.trainer.utils as utils

    trl_class = _original or getattr(utils, TRL_GLOBAL, None)
    forward = getattr(trl_class, "forward", None)
    found = tuple(inspect.signature(forward).parameters) if forward is not None else None
    if not hasattr(utils, "add_fused_lm_head") or found != TRL_PARAMETERS:
        raise RuntimeError(
            f"trl {version}: {TRL_MODULE}.{TRL_GLOBAL} is {trl_class!r} with forward parameters {found}; "
            f"fuselm.trl expects TRL's ChunkedLogProbFunction with {TRL_PARAMETERS} (trl {SUPPORTED}) and "
            "add_fused_lm_head; nothing was patched"
        )
    return utils


def patch(*, memory: str | int = "auto") -> None:
    """Make TRL's fused LM head (``add_fused_lm_head``, used by every TRL trainer) run on fuselm.

    Args:
        memory: the plan :func:`fuselm.linear_log_probs` uses: ``"auto"`` (the fastest within a small
            budget), ``"min"`` (O(N) extra memory) or a byte budget (int). Calling ``patch`` again only
            updates it.

    Raises ImportError without trl, RuntimeError for a trl outside ``SUPPORTED`` (``>=1.16,<2``) or
    whose kernel contract differs. Idempotent; works before or after the trainer is built.

        >>> import fuselm.trl
        >>> fuselm.trl.patch()                  # doctest: +SKIP
        >>> trainer = GRPOTrainer(...)          # doctest: +SKIP
        >>> trainer.train()                     # doctest: +SKIP
        >>> fuselm.trl.unpatch()                # doctest: +SKIP
    """
    global _original, _memory
    validate_memory(memory)
    utils = _trl_utils()
    _memory = memory
    current = getattr(utils, TRL_GLOBAL)
    if current is FusedLogProbs:
        return
    _original = current
    setattr(utils, TRL_GLOBAL, FusedLogProbs)


def unpatch() -> None:
    """Put TRL's own kernel back (the very object :func:`patch` replaced). A no-op when not patched."""
    global _original, _memory
    utils = sys.modules.get(TRL_MODULE)
    if utils is not None and getattr(utils, TRL_GLOBAL, None) is FusedLogProbs and _original is not None:
        setattr(utils, TRL_GLOBAL, _original)
    _original, _memory = None, "auto"


def is_patched() -> bool:
    """Whether TRL's fused LM head currently runs on fuselm (never imports trl)."""
    utils = sys.modules.get(TRL_MODULE)
    return utils is not None and getattr(utils, TRL_GLOBAL, None) is FusedLogProbs


# the global add_fused_lm_head's forward asks whether to score only the rows with a label (trl 1.16)
TRL_COMPACT = "_use_triton"


@contextmanager
def every_position():
    """While inside: TRL's fused LM head scores every position (its own path for devices without Triton)
    instead of only those with a label, which it finds with a boolean mask: a host synchronization and a
    data-dependent shape, which a CUDA graph capture refuses. The same log-probs (zero where the label is
    -100). :func:`fuselm.integrations.trainer.capture_training_steps` captures TRL's steps inside it. A
    no-op when trl is not imported or has no such switch; never imports trl."""
    utils = sys.modules.get(TRL_MODULE)
    original = getattr(utils, TRL_COMPACT, None) if utils is not None else None
    if original is None:
        yield
        return
    setattr(utils, TRL_COMPACT, _never_compact)
    try:
        yield
    finally:
        setattr(utils, TRL_COMPACT, original)


def _never_compact(device) -> bool:
    return False
