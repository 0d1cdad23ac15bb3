"""Op suite: fused linear cross-entropy, ``loss = cross_entropy(x @ W.T, target)``, fwd + bwd."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import fuselm

from .harness import Cost, Inputs, Provider, Shape, Suite, import_peer, torch_providers

IGNORE_INDEX = -100
RANDOM, PEAKED = 1, 2
INPUT_NAMES = {RANDOM: "random", PEAKED: "peaked"}
DEFAULT_IGNORE_K = 7  # 1/7 of the targets ignored, as in docs/peers.md

# Peaked inputs: the tail logits are N(0, PEAKED_TAIL_STD^2); the runner-ups sit these many nats
# below the target; the target logit is calibrated so that the mean softmax of the target is this.
PEAKED_TAIL_STD = 2.0
PEAKED_GAPS = (3.0, 4.0, 5.0, 6.0)
PEAKED_TARGET_PROB = 0.9
CALIBRATION_ROWS = 256  # rows the target logit is calibrated on
MAX_TARGET_LOGIT = 64  # upper end of the search for the target logit A
_SOLVE_CHUNK = 1024  # rows per batched solve when building peaked hidden states


def split_shape(shape: Shape) -> tuple[int, int, int, int, int]:
    """``(N, H, V[, inputs, k])`` -> ``(N, H, V, inputs, k)`` (defaults: random, 1/7)."""
    if len(shape) not in (3, 5):
        raise ValueError(f"expected (N, H, V, inputs, k), got {tuple(shape)}")
    n, h, v, inputs, k = (*shape, RANDOM, DEFAULT_IGNORE_K) if len(shape) == 3 else shape
    if inputs not in INPUT_NAMES:
        raise ValueError(f"inputs must be {RANDOM} (random) or {PEAKED} (peaked), got {inputs}")
    if k < 1:
        raise ValueError(f"k (1/k of the targets ignored) must be >= 1, got {k}")
    return int(n), int(h), int(v), int(inputs), int(k)


def describe(shape: Shape) -> str:
    """Human label of a shape: (8192, 4096, 128256, 2, 7) -> 'N=8192 H=4096 V=128256, peaked, 1/7 ignored'
    (k = 2: half, k = 1: all)."""
    n, h, v, inputs, k = split_shape(shape)
    share = "half" if k == 2 else ("all" if k == 1 else f"1/{k}")
    return f"N={n} H={h} V={v}, {INPUT_NAMES[inputs]}, {share} ignored"


# ---- inputs ----


def ignore_targets(target: torch.Tensor, k: int) -> torch.Tensor:
    """Set ``round(N / k)`` entries of ``target`` (random positions) to -100, in place; return it."""
    n = target.shape[0]
    n_ignored = round(n / k)
    if n_ignored:
        target[torch.randperm(n, device=target.device)[:n_ignored]] = IGNORE_INDEX
    return target


def _target_probs(z: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """softmax(z)[i, target_i] for fp32 logits z [M, V]."""
    return torch.exp(z.gather(1, target[:, None]).squeeze(1) - torch.logsumexp(z, dim=1))


def peaked_hidden(weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Hidden states ``x [N, H]`` (fp32) whose logits ``x @ weight.T`` look like a trained model's.

    Row i is ``noise_i + B_i^T alpha_i`` with ``noise_i ~ N(0, PEAKED_TAIL_STD^2 / |W_j|^2)`` (tail logits
    about N(0, PEAKED_TAIL_STD^2)) and ``B_i`` the rows of ``weight`` of the target and of the runner-up
    classes; ``alpha_i`` solves the small Gram system so that these logits are exactly ``A`` (target) and
    ``A - PEAKED_GAPS`` (runner-ups). ``A`` is one number for all rows, found by bisection on the first
    ``CALIBRATION_ROWS`` rows so that the mean softmax of the target is ``PEAKED_TARGET_PROB``. Targets must
    lie in ``[0, V)`` (ignore some afterwards). The other logits get cross-talk of std about
    ``A * sqrt((len(PEAKED_GAPS) + 1) / H)`` from the aligned part, so the target is reached for H >= 128 or
    so; at smaller H the ``A`` (up to 64) with the highest mean is taken.

    Example:
        >>> w = torch.randn(500, 128) / 128**0.5
        >>> t = torch.randint(0, 500, (128,))
        >>> x = peaked_hidden(w, t)
        >>> 0.85 < mean_target_prob(x, w, t) < 0.95
        True
    """
    v, h = weight.shape
    n = target.shape[0]
    k = len(PEAKED_GAPS)
    if v < k + 2:
        raise ValueError(f"peaked inputs need V >= {k + 2}, got {v}")
    dev = weight.device
    # the runner-ups: k classes per row, distinct and different from the target (uniform shifts)
    shifts = torch.randint(0, v - k, (n, k), device=target.device).sort(dim=1).values
    shifts = shifts + torch.arange(k, device=target.device)  # distinct, in [0, v - 2]
    classes = torch.cat([target[:, None], (target[:, None] + 1 + shifts) % v], dim=1)  # [N, k + 1]
    offsets = torch.tensor([0.0, *(-g for g in PEAKED_GAPS)], device=dev)  # logit - A, per class
    row_norm = weight[: min(v, 4096)].float().norm(dim=1).pow(2).mean().sqrt()
    noise = torch.randn(n, h, device=dev) * (PEAKED_TAIL_STD / row_norm)
    # x = x0 + A * u, where B x0 = offsets and B u = 1 (B: the k + 1 classes' rows of weight)
    x0, u = torch.empty(n, h, device=dev), torch.empty(n, h, device=dev)
    ones = torch.ones(k + 1, device=dev)
    for s in range(0, n, _SOLVE_CHUNK):
        e = min(s + _SOLVE_CHUNK, n)
        rows = weight[classes[s:e].reshape(-1)].float().view(e - s, k + 1, h)
        gram = rows @ rows.transpose(1, 2)
        rhs = torch.stack([offsets - (rows @ noise[s:e, :, None]).squeeze(-1), ones.expand(e - s, -1)], -1)
        alpha = torch.linalg.solve(gram, rhs)  # [c, k + 1, 2]
        both = alpha.transpose(1, 2) @ rows  # [c, 2, H]
        x0[s:e] = noise[s:e] + both[:, 0]
        u[s:e] = both[:, 1]
    m = min(n, CALIBRATION_ROWS)
    z0, z1 = ((y[:m].to(weight.dtype) @ weight.t()).float() for y in (x0, u))
    t = target[:m]

    def mean_prob(a: float) -> float:
        return float(_target_probs(z0 + a * z1, t).mean())

    # the first A on a coarse grid that reaches the target probability, refined by bisection; if none does
    # (a very small H, whose cross-talk widens the tail as A grows), the A with the highest mean probability
    grid = [float(a) for a in range(0, MAX_TARGET_LOGIT + 1, 4)]
    probs = [mean_prob(a) for a in grid]
    hit = next((i for i, p in enumerate(probs) if p >= PEAKED_TARGET_PROB), None)
    if hit is None:
        lo = hi = grid[max(range(len(grid)), key=probs.__getitem__)]
    elif hit == 0:
        lo = hi = 0.0
    else:
        lo, hi = grid[hit - 1], grid[hit]
        for _ in range(14):  # to 4 / 2^14 nats
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if mean_prob(mid) < PEAKED_TARGET_PROB else (lo, mid)
    return x0.add_(u, alpha=(lo + hi) / 2)


def mean_target_prob(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    max_rows: int | None = 2048,
    chunk_rows: int = 256,
) -> float:
    """Mean ``softmax(x @ weight.T)[i, target_i]`` over the first ``max_rows`` non-ignored rows (logits in
    ``weight``'s dtype, as the providers compute them; softmax in fp32)."""
    keep = (target != IGNORE_INDEX).nonzero().squeeze(1)
    if max_rows is not None:
        keep = keep[:max_rows]
    if keep.numel() == 0:
        return float("nan")
    total = 0.0
    with torch.no_grad():
        for s in range(0, keep.numel(), chunk_rows):
            idx = keep[s : s + chunk_rows]
            z = (x.detach()[idx].to(weight.dtype) @ weight.detach().t()).float()
            total += float(_target_probs(z, target[idx]).sum())
    return total / keep.numel()


def make_inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> Inputs:
    """x ``[N, H]`` and W ``[V, H]`` requiring grad, target ``[N]`` with ``round(N / k)`` entries -100."""
    n, h, v, inputs, k = split_shape(shape)
    weight = torch.randn(v, h, device=device, dtype=dtype).div_(math.sqrt(h))
    target = torch.randint(0, v, (n,), device=device)
    if inputs == PEAKED:
        x = peaked_hidden(weight, target).to(dtype)
    else:
        x = torch.randn(n, h, device=device, dtype=dtype)
    ignore_targets(target, k)
    return {"input": x.requires_grad_(True), "linear_weight": weight.requires_grad_(True), "target": target}


def cost(shape: Shape, mode: str, dtype: torch.dtype) -> Cost:
    """FLOPs of the GEMMs over all N rows: fwd 2NHV (logits), bwd 4NHV (dX, dW), full 6NHV."""
    n, h, v = shape[:3]  # never raises: a bad variant code is reported by make_inputs, row by row
    return Cost(flops=float({"fwd": 2, "bwd": 4, "full": 6}[mode] * n * h * v))


# ---- providers ----


def _torch_lce(x: torch.Tensor, w: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy((x @ w.T).float(), target, ignore_index=IGNORE_INDEX)


def _args(x: Inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return x["input"], x["linear_weight"], x["target"]


def setup_liger(device: torch.device) -> Callable[[Inputs], Any]:
    """Liger-Kernel's fused linear cross-entropy (needs CUDA and an importable liger_kernel)."""
    function = import_peer(
        device, "liger_kernel.ops.fused_linear_cross_entropy", "LigerFusedLinearCrossEntropyFunction"
    )

    def run(x: Inputs) -> torch.Tensor:
        # positional: input, weight, target, bias, ce_weight, ignore_index, lse_square_scale,
        # label_smoothing, reduction (the same order since Liger 0.5; later arguments keep defaults)
        out = function.apply(*_args(x), None, None, IGNORE_INDEX, 0.0, 0.0, "mean")
        return out[0] if isinstance(out, (tuple, list)) else out

    return run


def setup_cce(device: torch.device) -> Callable[[Inputs], Any]:
    """Cut Cross-Entropy (needs CUDA and an importable cut_cross_entropy)."""
    cce_lce = import_peer(device, "cut_cross_entropy", "linear_cross_entropy", "cut_cross_entropy")
    return lambda x: cce_lce(*_args(x), ignore_index=IGNORE_INDEX, reduction="mean", shift=False)


def _fuselm(memory: str) -> Provider:
    name = "fuselm" if memory == "auto" else f"fuselm_{memory}"
    run = lambda x: fuselm.linear_cross_entropy(*_args(x), memory=memory)
    return Provider(name, lambda device: run, f'fuselm.linear_cross_entropy(memory="{memory}")')


# N, H, V of Llama-3-8B, Gemma-2-2B, Llama-3-8B at twice the tokens, Qwen2-7B
_LLAMA3_8B = (8192, 4096, 128256)
_MODELS = (_LLAMA3_8B, (8192, 2304, 256000), (16384, 4096, 128256), (4096, 3584, 152064))
_K = DEFAULT_IGNORE_K

SUITE = Suite(
    name="linear_cross_entropy",
    description=(
        "fused linear cross-entropy: x [N, H] @ W [V, H]^T, cross-entropy over V, mean over the "
        "non-ignored of N targets; x and W require grad"
    ),
    shape_dims=("N", "H", "V", "inputs (1 random, 2 peaked)", "1/k ignored"),
    gpu_shapes=(
        *((*nhv, inputs, _K) for nhv in _MODELS for inputs in (RANDOM, PEAKED)),
        (*_LLAMA3_8B, RANDOM, 2),
    ),
    cpu_shapes=((256, 128, 1000, RANDOM, _K), (256, 128, 1000, PEAKED, _K), (256, 128, 1000, RANDOM, 2)),
    providers=(
        *torch_providers(_torch_lce, _args, "F.cross_entropy((x @ W.T).float(), target), eager"),
        Provider("liger", setup_liger, "Liger-Kernel LigerFusedLinearCrossEntropyFunction"),
        Provider("cce", setup_cce, "Cut Cross-Entropy linear_cross_entropy"),
        _fuselm("auto"),
        _fuselm("min"),
    ),
    make_inputs=make_inputs,
    cost=cost,
    columns=("ms", "x_floor", "extra_mib"),
    forward_grad=True,
    notes=(
        "Shapes are N x H x V x inputs x k: inputs 1 = random (logits about N(0, 1)), 2 = peaked (target "
        f"logit calibrated to a mean target softmax of {PEAKED_TARGET_PROB}, runner-ups {PEAKED_GAPS} "
        f"nats below it, tail N(0, {PEAKED_TAIL_STD:g}^2)); round(N/k) targets are -100 "
        "(k=7: 1/7, k=2: half).",
        "FLOPs counted over all N rows, ignored ones included: fwd 2NHV, bwd 4NHV, full 6NHV (the three "
        "GEMMs); designs that skip ignored rows or filtered gradient tiles can go below 1.0x floor.",
        "Loss: mean over non-ignored targets, ignore_index -100, no shift, no bias, for every provider; "
        "Liger accumulates dW in the input dtype (its default), CCE filters gradient tiles (its default).",
    ),
)
