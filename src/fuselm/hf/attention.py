"""Attention of the patched models' training forwards: transformers' SDPA attention, except that a causal
call without a mask runs through :class:`KeptAttention`, the same SDPA kernels (cuDNN's on CUDA, the CPU's
flash kernel) called as autograd sees them: one node that saves q, k, v, the output and its softmax
statistics (the log-sum-exp of each query row). In the forward of an offloaded layer
(:func:`fuselm.offload.offloaded_checkpoint`) it keeps the output and the statistics for the layer's
recompute (:func:`fuselm.offload.keep_output`, within the call's ``kept_per_input``): the recompute then
runs no attention forward, only the backward (an H100 Llama-3.2-1B layer at 4 x 2048 tokens: 0.19 ms of
cuDNN's forward for 33 MiB kept).

A call goes to HF's SDPA function, unchanged, when anything makes it more than causal attention: a mask,
dropout, a position bias, a softcap, attention weights asked for, queries and keys of different lengths;
under ``torch.compile``'s tracing; or with a backend other than those two (SDPA's choice for the tensors:
flash or memory-efficient kernels on other GPUs, the math kernel for fp32 on CUDA), or whose ops failed
their check (:func:`_works`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.nn.attention import SDPBackend

from ..offload import keep_output, kept_output
from ..ops._common.dispatch import capturing
from ._common import warn_once

__all__ = ["KeptAttention", "plainly_causal", "sdpa_attention", "training_attention"]

# The names the patched training forward registers sdpa_attention under (transformers' AttentionInterface):
# KEEPING_SDPA has SDPA's mask function (transformers decides on the mask as for "sdpa"), CAUSAL_SDPA none.
# transformers decides whether SDPA needs a mask by reading the batch (any padding? packed sequences, i.e.
# positions that restart?); during a CUDA graph capture it cannot read data, so it builds the 4D causal
# mask and SDPA runs its masked kernels (slower than the causal ones that the eager step gets). A call whose
# only data are token ids and labels has neither padding nor packing whatever its values: its positions
# are 0..T-1. Such a call, in a model whose every layer is plainly causal, is captured under CAUSAL_SDPA:
# transformers makes no mask and attention runs causal, the eager step's kernels.
KEEPING_SDPA = "fuselm_sdpa"
CAUSAL_SDPA = "fuselm_causal_sdpa"


# the arguments a plain call may have (any other, e.g. attention_mask or position_ids, keeps HF's mask)
_PLAIN_CALL = frozenset(
    {"self", "input_ids", "inputs_embeds", "labels", "shift_labels", "use_cache", "return_dict"}
    | {"num_items_in_batch", "logits_to_keep", "kwargs"}
)


def plainly_causal(config, call: dict) -> bool:
    """Whether a call of a model with ``config`` and arguments ``call`` (by name) needs only the causal
    mask: SDPA attention, no sub-configs (multimodal masks), no sliding or chunked layers, and no
    argument that carries a mask, positions or a cache."""
    if getattr(config, "_attn_implementation", None) not in ("sdpa", KEEPING_SDPA):
        return False
    if getattr(config, "sub_configs", None):
        return False
    types_ = getattr(config, "layer_types", None)
    if types_ is not None and any(t != "full_attention" for t in types_):
        return False
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return False
    if getattr(config, "attention_chunk_size", None) is not None:
        return False
    given = {k for k, v in call.items() if v is not None and not (k == "kwargs" and not v)}
    extra = call.get("kwargs") or {}
    return given <= _PLAIN_CALL and set(extra) <= _PLAIN_CALL


def _backend(q: torch.Tensor, k: torch.Tensor, scale: float) -> str | None:
    """The kernel SDPA would run for causal attention on these tensors, if KeptAttention runs it too."""
    if q.device.type not in ("cuda", "cpu"):
        return None
    gqa = q.shape[1] != k.shape[1]
    choice = torch._fused_sdp_choice(q, k, k, None, 0.0, True, scale=scale, enable_gqa=gqa)
    if q.device.type == "cuda":
        backend = "cudnn" if choice == SDPBackend.CUDNN_ATTENTION.value else None
    else:
        backend = "cpu" if choice == SDPBackend.FLASH_ATTENTION.value else None
    return backend if backend is not None and _works(backend, q) else None


_CHECKED: dict[tuple, bool] = {}  # (backend, device, dtype) -> whether its ops gave SDPA's results


def _works(backend: str, q: torch.Tensor) -> bool:
    """Do the backend's forward and backward ops, called as KeptAttention calls them (torch's private
    ops), give SDPA's output and gradients on this device and dtype? Checked once, eagerly (a call made
    while a CUDA graph is captured before any check runs HF's SDPA); a failed check says so once and
    leaves the attention HF's."""
    key = (backend, q.device, q.dtype)
    if key not in _CHECKED:
        if capturing(q.device):
            return False
        _CHECKED[key] = _check(backend, q.device, q.dtype)
    return _CHECKED[key]


def _check(backend: str, device: torch.device, dtype: torch.dtype) -> bool:
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (
        torch.randn(shape, generator=gen).to(device, dtype)
        for shape in ((1, 4, 128, 64), (1, 2, 128, 64), (1, 2, 128, 64), (1, 4, 128, 64))
    )
    try:
        with torch.no_grad():  # (no autograd: a checkpoint's saved-tensor hooks may be on)
            out, lse = _forward(backend, q, k, v, 0.125)
            ours = (out, *_backward(backend, dout, q, k, v, out, lse, 0.125))
            theirs = _reference(q, k, v, dout, 0.125)
        bad = [i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if not _near(a, b)]
        reason = f"its {', '.join('output dq dk dv'.split()[i] for i in bad)} differ" if bad else None
    except (RuntimeError, TypeError, ValueError) as e:
        reason = f"{type(e).__name__}: {e}"
    if reason is not None:
        warn_once(
            f"kept-attention:{backend}:{device.type}:{dtype}",
            f"fuselm.hf.attention: {backend} SDPA ops failed their check on {device.type} {dtype} "
            f"({reason:.200}): attention runs HF's SDPA (its output is not kept for offloaded recomputes)",
        )
    return reason is None


def _reference(q, k, v, dout, scale: float) -> tuple[torch.Tensor, ...]:
    """(output, dq, dk, dv) of causal attention in fp32, written out (P = softmax(S), S = q k^T scale)."""
    groups = q.shape[1] // k.shape[1]
    q, k, v, dout = (t.float() for t in (q, _repeat(k, groups), _repeat(v, groups), dout))
    t = q.shape[2]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    p = (q @ k.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf")).softmax(-1)
    dp = dout @ v.transpose(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * scale
    dk, dv = _fold(ds.transpose(-1, -2) @ q, groups), _fold(p.transpose(-1, -2) @ dout, groups)
    return p @ v, ds @ k, dk, dv


def _near(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within 2% of the norm: a sanity check of how the ops are called (a wrong call gives garbage), not
    the numerics rule (tests hold KeptAttention to it)."""
    a, b = a.double(), b.double()
    return a.shape == b.shape and bool((a - b).norm() <= 0.02 * b.norm())


def _repeat(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Each key / value head repeated for the ``groups`` query heads that read it."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of :func:`_repeat`'s input: each head's, summed over its ``groups`` copies."""
    return grad if groups == 1 else grad.unflatten(1, (-1, groups)).sum(2)


def _forward(backend: str, q, k, v, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [B, Hq, T, D], log-sum-exp of each query row, fp32)."""
    if backend == "cudnn":
        attention = torch.ops.aten._scaled_dot_product_cudnn_attention
        out = attention(q, k, v, None, True, 0.0, True, False, scale=scale)
        return out[0], out[1]
    groups = q.shape[1] // k.shape[1]  # the CPU kernel wants as many key / value heads as query heads
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, _repeat(k, groups), _repeat(v, groups), 0.0, True, scale=scale
    )


def _backward(backend: str, dout, q, k, v, out, lse, scale: float) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) of causal attention from its saved output and statistics."""
    if backend == "cudnn":
        seed = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: the RNG state is unused
        t_q, t_k = q.shape[2], k.shape[2]
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse, seed, seed, None, None, None, t_q, t_k, 0.0, True, scale=scale
        )
    groups = q.shape[1] // k.shape[1]
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, _repeat(k, groups), _repeat(v, groups), out, lse, 0.0, True, scale=scale
    )
    return dq, _fold(dk, groups), _fold(dv, groups)


class KeptAttention(torch.autograd.Function):
    """Causal ``softmax(q k^T * scale) v`` for q ``[B, Hq, T, D]``, k and v ``[B, Hkv, T, D]`` (Hq a multiple
    of Hkv) on ``backend`` ("cudnn" or "cpu", see :func:`_backend`). The output and the log-sum-exp are kept
    under ``key`` for an offloaded layer's recompute, which returns them instead of computing them again."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, key: Any, backend: str):
        kept = kept_output(key)
        if kept is None:
            out, lse = _forward(backend, q, k, v, scale)
            # kept [B, T, H, D]: back in the layout of the output's gradient (the caller's output is that
            # transpose, made contiguous), as SDPA's kernels leave it
            keep_output(key, (out.transpose(1, 2), lse))
        else:
            out, lse = kept[0].transpose(1, 2), kept[1]
        ctx.scale, ctx.backend = scale, backend
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(ctx.backend, dout, q, k, v, out, lse, ctx.scale)  # as autograd passes it
        return dq, dk, dv, None, None, None


def sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    position_bias: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature (q ``[B, Hq, T, D]``, k / v ``[B, Hkv, S, D]``; returns
    ``([B, T, Hq, D], None)``): :class:`KeptAttention` for a causal call without a mask, HF's SDPA function
    (whatever is registered under "sdpa" when called) for any other.

    Example:
        >>> import torch
        >>> q, k = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8)
        >>> out, _ = sdpa_attention(torch.nn.Module(), q, k, k, None, scaling=0.25)
        >>> ref = torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True, scale=0.25,
        ...     enable_gqa=True)
        >>> torch.allclose(out, ref.transpose(1, 2), atol=1e-6)
        True
    """
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    t, heads, kv_heads, dim = query.shape[2], query.shape[1], key.shape[1], query.shape[3]
    scale = scaling if scaling is not None else dim**-0.5
    backend = None
    if (
        causal
        and attention_mask is None
        and not dropout
        and position_bias is None
        and kwargs.get("softcap") is None
        and not kwargs.get("output_attentions", False)
        and t > 1
        and key.shape[2] == t
        and value.shape[-1] == dim
        and heads % kv_heads == 0
        and not torch.compiler.is_compiling()  # (traced: SDPA, which dynamo knows)
    ):
        backend = _backend(query, key, scale)
    if backend is None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS["sdpa"](
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            position_bias=position_bias,
            **kwargs,
        )
    out = KeptAttention.apply(query, key, value, scale, ("attention", id(module)), backend)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name in (KEEPING_SDPA, CAUSAL_SDPA):
        if ALL_ATTENTION_FUNCTIONS.get(name) is not sdpa_attention:
            AttentionInterface.register(name, sdpa_attention)
    if KEEPING_SDPA not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(KEEPING_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


@contextlib.contextmanager
def training_attention(config: Any, call: dict):
    """Inside: a model with ``config`` whose attention is "sdpa" (and no sub-configs) runs
    :func:`sdpa_attention`: from the first such call on it is :data:`KEEPING_SDPA` (SDPA's masks), which it
    stays (the recompute of a checkpointed layer, in the backward, must run the attention its forward ran:
    the tensors they save are compared) until :func:`restore` (``unpatch`` of the model; after a class
    patch's unpatch, the models that trained keep it: SDPA's kernels either way); :data:`CAUSAL_SDPA` (no
    mask) inside the call while a CUDA graph is captured and the call with arguments ``call`` (by name) is
    :func:`plainly_causal`. Other models run as they are."""
    if getattr(config, "_attn_implementation", None) not in ("sdpa", KEEPING_SDPA) or getattr(
        config, "sub_configs", None
    ):
        yield
        return
    _register()
    config._attn_implementation = KEEPING_SDPA
    if not (capturing() and plainly_causal(config, call)):
        yield
        return
    config._attn_implementation = CAUSAL_SDPA
    try:
        yield
    finally:
        config._attn_implementation = KEEPING_SDPA


def restore(config: Any) -> None:
    """``config``'s attention back to "sdpa" if :func:`training_attention` made it :data:`KEEPING_SDPA`."""
    if getattr(config, "_attn_implementation", None) == KEEPING_SDPA:
        config._attn_implementation = "sdpa"
