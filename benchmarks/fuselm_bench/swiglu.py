"""Op suite: SwiGLU ``silu(gate) * up`` on ``[N, I]`` gate and up (both require grad)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fuselm.ops.swiglu import swiglu

from .harness import Inputs, Provider, Shape, Suite, bytes_cost, liger_provider, torch_providers

ACCESSES = {"fwd": 3, "bwd": 5, "full": 8}  # element reads + writes per mode
cost = bytes_cost(ACCESSES)


def make_inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> Inputs:
    """gate and up ``[N, I]``, random normal, both requiring grad."""
    return {k: torch.randn(*shape, device=device, dtype=dtype).requires_grad_(True) for k in ("gate", "up")}


def _args(x: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    return x["gate"], x["up"]


SUITE = Suite(
    name="swiglu",
    description="SwiGLU silu(gate) * up on [N, I] gate and up (I = Llama-3-8B's 14336)",
    shape_dims=("N", "I"),
    gpu_shapes=((16384, 14336), (8192, 14336), (16384, 11008)),
    cpu_shapes=((128, 512), (33, 1000)),
    providers=(
        *torch_providers(lambda gate, up: F.silu(gate) * up, _args, "F.silu(gate) * up, eager"),
        Provider("fuselm", lambda device: lambda x: swiglu(*_args(x)), "fuselm.swiglu"),
        liger_provider("liger_kernel.ops.swiglu", "LigerSiLUMulFunction", _args),
    ),
    make_inputs=make_inputs,
    cost=cost,
    columns=("ms", "ms_eager", "tbps", "x_copy", "extra_mib"),
    cuda_graph=True,
    notes=(
        "Bytes counted per element: fwd reads gate and up and writes out (6 B in bf16); bwd reads dout, "
        "gate and up and writes dgate and dup (10 B); full 16 B.",
        "liger writes dgate and dup into the saved gate and up buffers (no gradient allocation, the "
        "inputs are overwritten: its repeated timed calls run on finite overwritten values, same work); "
        "torch, torch_compile and fuselm allocate the gradients.",
    ),
)
