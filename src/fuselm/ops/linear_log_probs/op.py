"""fuselm.linear_log_probs: launchers -> custom ops -> autograd Function -> public function.

Forward: token chunks. Per chunk of C rows, cuBLAS writes the fp32 logits into one reused [C, V] buffer
and one Triton kernel reads each row once, computing every requested statistic online over column blocks.
Backward: vocabulary slabs. Per slab of Vs classes, cuBLAS recomputes the slab's logits for every kept
row into one reused [N, Vs] buffer, one Triton kernel overwrites them with d/dlogits in place, and cuBLAS
writes d linear_weight[slab] = G^T X (one product over all N rows: summed in fp32, rounded once), while
d input is summed over the slabs in an fp32 [N, H] accumulator. The math and the costs are in README.md.
"""

from __future__ import annotations

import torch

from .._common.dispatch import use_triton
from .._common.guard import FLOAT_DTYPES, check_tensor
from ..linear_cross_entropy.op import linear_operands, memory_budget
from .reference import OUTPUT_NAMES, LogProbs, linear_log_probs_reference

MIN_BUDGET = 8 * 2**20  # memory="min": bytes of the chunk / slab buffers (the fp32 d input sum comes on top)


# ---- plan ----


def _validate_memory(memory) -> None:
    if memory in ("auto", "min"):
        return
    if isinstance(memory, int) and not isinstance(memory, bool) and memory > 0:
        return
    raise ValueError(f"memory must be 'auto', 'min' or a positive int (bytes), got {memory!r}")


def _budget(memory, device: torch.device) -> int:
    return MIN_BUDGET if memory == "min" else memory_budget(memory, device)


def _capturing(device: torch.device) -> bool:
    """Is a CUDA graph being captured on the stream that work for `device` goes to?"""
    if device.type != "cuda":
        return False
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def _compaction_allowed(device: torch.device) -> bool:
    """Finding the kept rows costs one host sync: only in eager mode, outside CUDA graph capture."""
    return not torch.compiler.is_compiling() and not _capturing(device)


def kept_rows(target: torch.Tensor, n_classes: int, ignore_index: int) -> torch.Tensor | None:
    """Eager only, one host sync: int64 indices of the rows of target [N] that are not ignore_index, or None
    when every row is kept. Raises ValueError if a target is outside [0, n_classes) and not ignore_index."""
    valid = target != ignore_index
    bad = valid & ((target < 0) | (target >= n_classes))
    n_kept, n_bad = torch.stack([valid.sum(), bad.sum()]).tolist()  # the one host sync
    if n_bad:
        value = target[bad][0].item()
        raise ValueError(
            f"target holds {value}, outside [0, {n_classes}) and not ignore_index={ignore_index} "
            f"({n_bad} such tokens)"
        )
    if n_kept == target.shape[0]:
        return None
    return torch.nonzero_static(valid, size=n_kept).reshape(-1)


# ---- public function ----


def _check_outputs(outputs) -> tuple[str, ...]:
    names = (outputs,) if isinstance(outputs, str) else outputs
    try:
        names = tuple(names)
    except TypeError:
        raise ValueError(
            f"outputs must be a sequence of names among {OUTPUT_NAMES}, got {outputs!r}"
        ) from None
    for name in names:
        if name not in OUTPUT_NAMES:
            raise ValueError(f"outputs: unknown name {name!r}; the names are {OUTPUT_NAMES}")
    return names


def _check_float(name: str, value, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not (value == value and abs(value) != float("inf")):
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def linear_log_probs(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    outputs=("log_probs",),
    memory: str | int = "auto",
) -> LogProbs:
    """Per-token log-probabilities of ``target`` (and, on request, entropy and other statistics) under the
    logits of a linear layer, without ever materializing the ``[N, V]`` logits.

    The logits of a token are ``z = (input @ linear_weight.T + linear_bias) * logit_scale``, then
    ``softcap * tanh(z / softcap)`` if ``softcap`` is set, then ``z / temperature`` (the order of TRL's
    fused head). With ``p = softmax(z)`` over the V classes, per token:

    - ``log_probs = z[target] - lse`` (always computed)
    - ``entropy = lse - sum_j p_j z_j``
    - ``lse = logsumexp(z)``
    - ``log_sum_sq_probs = log(sum_j p_j**2)``
    - ``mean_logits = mean_j z_j``
    - ``is_top1 = argmax_j z_j == target`` (the first of tied maxima counts, as ``torch.argmax``)

    ``log_probs``, ``entropy`` and ``lse`` are differentiable with respect to ``input``, ``linear_weight``
    and ``linear_bias`` under any per-token upstream gradients, on one, two or all three of them (e.g. a
    policy-gradient loss on log_probs with per-token advantages plus an entropy bonus); the other
    statistics are not differentiable. The backward recomputes the logits (8NHV FLOPs in all: the forward
    GEMM, and the logits GEMM and the two gradient GEMMs of the backward).

    Args:
        input: hidden states ``[..., H]`` (e.g. ``[B, T, H]``), float32 / float16 / bfloat16 (float64 runs
            the PyTorch reference).
        linear_weight: ``[V, H]``, same dtype and device as ``input`` (e.g. the lm_head weight).
        target: class indices of shape ``input.shape[:-1]``, int32 or int64.
        linear_bias: optional ``[V]``, same dtype as ``input``.
        ignore_index: target value of tokens to skip (any int): every output is 0 (False for ``is_top1``)
            there and they get no gradient; in eager mode they also cost no FLOPs (see below). A target
            outside ``[0, V)`` that is not ``ignore_index`` raises ValueError in eager mode (found during
            the same host sync); under ``torch.compile`` and CUDA graph capture, where nothing syncs, such a
            token gets a NaN ``log_probs``, 0 elsewhere and no gradient.
        temperature: the logits are divided by it (``> 0``).
        softcap: if set (``> 0``), ``softcap * tanh(z / softcap)`` is applied before the temperature
            (Gemma 2's final logit softcapping).
        logit_scale: the raw logits are multiplied by it first (a finite float; Cohere's ``logit_scale``,
            Granite's ``1 / logits_scaling``).
        outputs: names of the statistics to compute among ``"log_probs"``, ``"entropy"``, ``"lse"``,
            ``"log_sum_sq_probs"``, ``"mean_logits"``, ``"is_top1"`` (a sequence, or one name);
            ``log_probs`` is computed in any case. Each costs a little in the forward's pass over the
            logits; the others are returned as None.
        memory: how much memory the plan may take.

            - ``"auto"`` (default): ``min(256 MiB, a quarter of the free device memory)`` for the forward's
              ``[C, V]`` fp32 chunk buffer, and in the backward for the ``[N, Vs]`` slab buffer together with
              the fp32 ``[N, H]`` accumulator of the input gradient (the accumulator comes first; the slab
              then gets what is left, at least 1024 classes; README.md counts it).
            - an int: that many bytes, the same way.
            - ``"min"``: 8 MiB for the chunk and slab buffers (at least 16 rows / 128 classes), plus the
              fp32 ``[N, H]`` accumulator: O(N) memory besides what the gradient of ``input`` itself takes.

    Ignored tokens: in eager mode (not under ``torch.compile``, not while capturing a CUDA graph) the kept
    rows are found first, at the cost of one host synchronization, and only they go through the GEMMs.
    Under ``torch.compile`` and CUDA graph capture every row is computed (no sync) and the ignored ones are
    zeroed.

    Autocast: under ``torch.autocast``, ``input``, ``linear_weight`` and ``linear_bias`` are cast to the
    autocast dtype first, as ``F.linear`` would (the gradients flow back to their own dtypes).

    Precision: the forward's logits are cuBLAS products accumulated and kept in fp32 (never rounded to
    16 bits), and every statistic is computed in fp32. In the backward, the recomputed logits and the
    gradient written over them are in the input dtype (as eager PyTorch's), ``d linear_weight`` of each
    slab is one cuBLAS product over all tokens (fp32 inside, rounded once to its dtype, never summed in
    16 bits), ``d input`` is summed over the slabs in fp32 and ``d linear_bias`` in fp32.

    Returns:
        :class:`fuselm.LogProbs` ``(log_probs, entropy, lse, log_sum_sq_probs, mean_logits, is_top1)``: each
        of ``target``'s shape, float32 (float64 for float64 input; bool for ``is_top1``), or None when not
        asked for (``log_probs`` always there).

    Example:
        >>> import torch
        >>> from fuselm.ops.linear_log_probs import linear_log_probs
        >>> hidden = torch.randn(2, 5, 16, requires_grad=True)
        >>> lm_head = torch.randn(100, 16, requires_grad=True)
        >>> target = torch.randint(0, 100, (2, 5))
        >>> target[:, :2] = -100  # prompt tokens
        >>> out = linear_log_probs(hidden, lm_head, target, temperature=0.7, outputs=("entropy",))
        >>> advantages = torch.randn(2, 5)
        >>> loss = -(advantages * out.log_probs).sum() - 0.01 * out.entropy.sum()
        >>> loss.backward()
        >>> out.log_probs.shape, out.lse is None, hidden.grad.shape
        (torch.Size([2, 5]), True, torch.Size([2, 5, 16]))
    """
    input, linear_weight, linear_bias = linear_operands(
        input, linear_weight, linear_bias, dtypes=(*FLOAT_DTYPES, torch.float64)
    )
    device = input.device
    v = linear_weight.shape[0]
    if v == 0:
        raise ValueError("linear_weight must have at least one row (one class)")
    check_tensor("target", target, dtypes=(torch.int64, torch.int32), device=device)
    if tuple(target.shape) != tuple(input.shape[:-1]):
        raise ValueError(
            f"target must have shape input.shape[:-1] = {tuple(input.shape[:-1])}, got {tuple(target.shape)}"
        )
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise ValueError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    temperature = _check_float("temperature", temperature, positive=True)
    if softcap is not None:
        softcap = _check_float("softcap", softcap, positive=True)
    logit_scale = _check_float("logit_scale", logit_scale, positive=False)
    names = _check_outputs(outputs)
    _validate_memory(memory)

    t1 = target.reshape(-1)
    rows = kept_rows(t1, v, ignore_index) if _compaction_allowed(device) else None
    budget = _budget(memory, device)
    if input.dtype == torch.float64 or not use_triton(input):
        stats = linear_log_probs_reference(
            input,
            linear_weight,
            target,
            linear_bias=linear_bias,
            ignore_index=ignore_index,
            temperature=temperature,
            softcap=softcap,
            logit_scale=logit_scale,
            budget=budget,
            rows=rows,
        )
    else:  # the Triton path comes with the kernels
        stats = linear_log_probs_reference(
            input,
            linear_weight,
            target,
            linear_bias=linear_bias,
            ignore_index=ignore_index,
            temperature=temperature,
            softcap=softcap,
            logit_scale=logit_scale,
            budget=budget,
            rows=rows,
        )
    wanted = {"log_probs", *names}
    return LogProbs(*(s if name in wanted else None for name, s in zip(OUTPUT_NAMES, stats, strict=True)))
