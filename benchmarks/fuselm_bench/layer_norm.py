"""Op suite: LayerNorm over the last dimension of ``[N, H]`` with weight and bias (all requiring grad)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fuselm.ops.layer_norm import layer_norm

from .harness import Inputs, Provider, Shape, Suite, bytes_cost, liger_provider, torch_providers

EPS = 1e-5


def make_inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> Inputs:
    """x ~ N(1, 1) ``[N, H]``, weight ~ U[0.5, 1.5) and bias ~ N(0, 1) ``[H]``, all requiring grad."""
    n, h = shape
    return {
        "x": (torch.randn(n, h, device=device, dtype=dtype) + 1).requires_grad_(True),
        "weight": (torch.rand(h, device=device) + 0.5).to(dtype).requires_grad_(True),
        "bias": torch.randn(h, device=device).to(dtype).requires_grad_(True),
    }


cost = bytes_cost({"fwd": 2, "bwd": 3, "full": 5})


def _torch_ln(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def _args(x: Inputs) -> tuple[torch.Tensor, ...]:
    return x["x"], x["weight"], x["bias"], EPS


SUITE = Suite(
    name="layer_norm",
    description="LayerNorm with weight and bias over the last dim of [N, H]",
    shape_dims=("N", "H"),
    gpu_shapes=((16384, 4096), (32768, 8192)),
    cpu_shapes=((256, 256),),
    providers=(
        *torch_providers(_torch_ln, _args, "F.layer_norm, eager"),
        Provider("fuselm", lambda device: lambda x: layer_norm(*_args(x)), "fuselm.layer_norm"),
        liger_provider("liger_kernel.ops.layer_norm", "LigerLayerNormFunction", _args),
    ),
    make_inputs=make_inputs,
    cost=cost,
    columns=("ms", "ms_eager", "tbps", "x_copy", "extra_mib"),
    cuda_graph=True,
    notes=(
        "Bytes counted: 2 per element per itemsize forward (read x, write y), 3 backward (read x, dy, "
        "write dx): 10 bytes per element fwd + bwd in bf16; parameters not counted.",
    ),
)
