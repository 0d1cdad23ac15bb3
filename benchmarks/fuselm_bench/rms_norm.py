"""Op suite: RMSNorm (Llama casting) over the last dimension of ``[N, H]``, with and without the residual add
before it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fuselm.ops.rms_norm import rms_norm

from .harness import Cost, Inputs, Provider, Shape, SkipProvider, Suite, import_peer, torch_providers

EPS = 1e-6


def split_shape(shape: Shape) -> tuple[int, int, int]:
    """(N, H, S) from a suite shape; ``(N, H)`` means S = 1 (no residual)."""
    if len(shape) == 2:
        return int(shape[0]), int(shape[1]), 1
    if len(shape) != 3 or shape[2] not in (1, 2):
        raise ValueError(
            f"an rms_norm shape is N x H x S with S 1 (x) or 2 (x + residual), got {tuple(shape)}"
        )
    return int(shape[0]), int(shape[1]), int(shape[2])


def make_inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> Inputs:
    """x ~ N(0, 1) ``[N, H]`` and weight ~ U[0.5, 1.5) ``[H]``, both requiring grad; with S = 2 also a
    residual ~ N(0, 1) ``[N, H]`` requiring grad."""
    n, h, summed = split_shape(shape)
    inputs = {
        "x": torch.randn(n, h, device=device, dtype=dtype).requires_grad_(True),
        "weight": (torch.rand(h, device=device) + 0.5).to(dtype).requires_grad_(True),
    }
    if summed == 2:
        inputs["residual"] = torch.randn(n, h, device=device, dtype=dtype).requires_grad_(True)
    return inputs


def cost(shape: Shape, mode: str, dtype: torch.dtype) -> Cost:
    """Bytes per call, as the notes count them."""
    n, h, summed = split_shape(shape)
    per_element = ({"fwd": 4, "bwd": 4, "full": 8} if summed == 2 else {"fwd": 2, "bwd": 3, "full": 5})[mode]
    return Cost(bytes=float(n * h * per_element * dtype.itemsize))


def hf_llama_rms_norm(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """LlamaRMSNorm.forward as Hugging Face writes it."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    return weight * hidden_states.to(input_dtype)


def _add_then(norm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[[Inputs], Any]:
    """``norm(x, weight)``; with a residual (S = 2) an eager add first: ``(norm(s, weight), s)``."""

    def run(x: Inputs) -> Any:
        r = x.get("residual")
        s = x["x"] if r is None else x["x"] + r
        y = norm(s, x["weight"])
        return y if r is None else (y, s)

    return run


def setup_liger(device: torch.device) -> Callable[[Inputs], Any]:
    """Liger-Kernel's RMSNorm (CUDA, importable liger_kernel); with S = 2 an eager add first."""
    function = import_peer(device, "liger_kernel.ops.rms_norm", "LigerRMSNormFunction")
    return _add_then(lambda s, w: function.apply(s, w, EPS, 0.0, "llama", False))


def _only(name: str, residual: bool, fn: Callable[[Inputs], Any], description: str) -> Provider:
    """A provider of the S = 2 (``residual``) or the S = 1 shapes (skipped at the others)."""

    def run(x: Inputs) -> Any:
        if ("residual" in x) != residual:
            raise SkipProvider(f"{name} runs the S = {1 + int(residual)} shapes")
        return fn(x)

    return Provider(name, lambda device: run, description)


SUITE = Suite(
    name="rms_norm",
    description="RMSNorm (Llama casting) over the last dim of [N, H]; S = 2 adds a residual first",
    shape_dims=("N", "H", "S"),
    gpu_shapes=((16384, 4096, 1), (32768, 8192, 1), (16384, 4096, 2), (32768, 8192, 2)),
    cpu_shapes=((256, 256, 1), (256, 256, 2)),
    providers=(
        *torch_providers(_add_then(hf_llama_rms_norm), None, "Hugging Face LlamaRMSNorm code, eager"),
        Provider("liger", setup_liger, "liger_kernel LigerRMSNormFunction (in_place=False)"),
        _only("fuselm", False, lambda x: rms_norm(x["x"], x["weight"], EPS), "fuselm.rms_norm (S = 1)"),
        _only(
            "fuselm_residual",
            True,
            lambda x: rms_norm(x["x"], x["weight"], EPS, residual=x["residual"]),
            "fuselm.rms_norm(..., residual=) (S = 2)",
        ),
        _only(
            "torch_add_then_fuselm",
            True,
            _add_then(lambda s, w: rms_norm(s, w, EPS)),
            "x + residual, then fuselm.rms_norm",
        ),
    ),
    make_inputs=make_inputs,
    cost=cost,
    columns=("ms", "ms_eager", "tbps", "x_copy", "extra_mib"),
    cuda_graph=True,
    notes=(
        "S = 1: bytes counted are 2 per element per itemsize forward (read x, write y) and 3 backward "
        "(read x, dy, write dx): 10 bytes per element fwd + bwd in bf16.",
        "S = 2: a residual is added first and the sum is a second output; 4 per element per itemsize "
        "forward (read x, residual, write y, sum), 4 backward (read sum, dy, d sum, write dx = d residual).",
        "fuselm runs the S = 1 shapes, fuselm_residual and torch_add_then_fuselm the S = 2 shapes; "
        "the other providers run both.",
    ),
)
