"""Op suite: cross-entropy on given logits ``[N, V]`` (mean over tokens, no ignored targets)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import fuselm

from .harness import Inputs, Provider, Shape, Suite, bytes_cost, import_peer, torch_providers


def make_inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> Inputs:
    """Random normal logits ``[N, V]`` (requires grad) and targets uniform in ``[0, V)``."""
    n, v = shape
    logits = torch.randn(n, v, device=device, dtype=dtype).requires_grad_(True)
    return {"logits": logits, "target": torch.randint(0, v, (n,), device=device)}


# fwd reads the logits, full also writes the gradient, bwd is the difference
cost = bytes_cost({"fwd": 1, "bwd": 1, "full": 2})


def _torch_ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), target)


def _args(x: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    return x["logits"], x["target"]


def setup_liger(device: torch.device) -> Callable[[Inputs], Any]:
    """Liger-Kernel's cross-entropy (needs CUDA and an importable liger_kernel)."""
    liger_cross_entropy = import_peer(device, "liger_kernel.transformers.functional", "liger_cross_entropy")

    def run(x: Inputs) -> torch.Tensor:
        out = liger_cross_entropy(*_args(x), ignore_index=-100, reduction="mean")
        out = out[0] if isinstance(out, (tuple, list)) else out
        return getattr(out, "loss", out)

    return run


SUITE = Suite(
    name="cross_entropy",
    description="cross-entropy on given logits [N, V], mean over N tokens, targets uniform in [0, V)",
    shape_dims=("N", "V"),
    gpu_shapes=((8192, 128256), (16384, 32000), (4096, 256000), (16384, 8192)),
    cpu_shapes=((256, 4096), (512, 1000)),
    providers=(
        *torch_providers(_torch_ce, _args, "F.cross_entropy(logits.float(), target), eager"),
        Provider("fuselm", lambda device: lambda x: fuselm.cross_entropy(*_args(x)), "fuselm.cross_entropy"),
        Provider(
            "fuselm_inplace",
            lambda device: lambda x: fuselm.cross_entropy(*_args(x), inplace_backward=True),
            "fuselm.cross_entropy(inplace_backward=True)",
        ),
        Provider("liger", setup_liger, "liger_kernel liger_cross_entropy"),
    ),
    make_inputs=make_inputs,
    cost=cost,
    notes=(
        "Bytes counted: fwd reads each logit once (2 B in bf16), full also writes its gradient once "
        "(4 B in bf16), bwd the difference.",
        "torch upcasts the logits to fp32 first (as Hugging Face does); fuselm_inplace and liger write "
        "the gradient into the logits buffer, so their repeated timed calls run on overwritten (finite) "
        "logits: same shapes, same work.",
    ),
)
