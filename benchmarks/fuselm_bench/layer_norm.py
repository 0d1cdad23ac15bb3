"""Op suite: LayerNorm over the last dimension of ``[N, H]`` with weight and bias (all requiring grad)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fuselm.ops.layer_norm import layer_norm

from .harness import Cost, Inputs, Provider, Shape, Suite, compiled_setup, peer_apply

EPS = 1e-5


def make_inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> Inputs:
    """x ~ N(1, 1) ``[N, H]``, weight ~ U[0.5, 1.5) and bias ~ N(0, 1) ``[H]``, all requiring grad."""
    n, h = shape
    return {
        "x": (torch.randn(n, h, device=device, dtype=dtype) + 1).requires_grad_(True),
        "weight": (torch.rand(h, device=device) + 0.5).to(dtype).requires_grad_(True),
        "bias": torch.randn(h, device=device).to(dtype).requires_grad_(True),
    }


def cost(shape: Shape, mode: str, dtype: torch.dtype) -> Cost:
    """Bytes per call: fwd 2, bwd 3, full 5 times itemsize per element."""
    n, h = shape
    return Cost(bytes=float(n * h * {"fwd": 2, "bwd": 3, "full": 5}[mode] * dtype.itemsize))


def _torch_fn(x: Inputs) -> torch.Tensor:
    return F.layer_norm(x["x"], (x["x"].shape[-1],), x["weight"], x["bias"], EPS)


def _args(x: Inputs) -> tuple[torch.Tensor, ...]:
    return x["x"], x["weight"], x["bias"], EPS


SUITE = Suite(
    name="layer_norm",
    description="LayerNorm with weight and bias over the last dim of [N, H]",
    shape_dims=("N", "H"),
    gpu_shapes=((16384, 4096), (32768, 8192)),
    cpu_shapes=((256, 256),),
    providers=(
        Provider("torch", lambda device: _torch_fn, "F.layer_norm, eager"),
        Provider("torch_compile", compiled_setup(_torch_fn), "torch.compile of F.layer_norm"),
        Provider("fuselm", lambda device: lambda x: layer_norm(*_args(x)), "fuselm.layer_norm"),
        Provider(
            "liger",
            peer_apply("liger_kernel.ops.layer_norm", "LigerLayerNormFunction", _args),
            "liger_kernel LigerLayerNormFunction",
        ),
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
