"""Op suite: rotary position embedding of q and k, Hugging Face layout, forward and backward."""

from __future__ import annotations

import torch

from fuselm.ops.rope import apply_rotary

from .harness import Inputs, Provider, Shape, Suite, bytes_cost, liger_provider, torch_providers

ROPE_THETA = 500000.0  # Llama 3


def make_inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> Inputs:
    """q ``[B, Hq, T, D]``, k ``[B, Hkv, T, D]`` random normal (require grad); cos/sin ``[B, T, D]`` as
    Hugging Face's (default) rotary embedding returns them, in ``dtype``."""
    b, t, hq, hk, d = shape
    q = torch.randn(b, hq, t, d, device=device, dtype=dtype).requires_grad_(True)
    k = torch.randn(b, hk, t, d, device=device, dtype=dtype).requires_grad_(True)
    inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d)
    freqs = torch.arange(t, dtype=torch.float32, device=device)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1).expand(b, t, d)
    return {"q": q, "k": k, "cos": emb.cos().to(dtype), "sin": emb.sin().to(dtype)}


# fwd reads q, k and writes the outputs; bwd the same for the gradients; full both (cos/sin not counted)
cost = bytes_cost({"fwd": 2, "bwd": 2, "full": 4}, lambda s: s[0] * s[1] * (s[2] + s[3]) * s[4])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    return torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)


def hf_apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's Llama ``apply_rotary_pos_emb``."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)


def _args(x: Inputs) -> tuple[torch.Tensor, ...]:
    return x["q"], x["k"], x["cos"], x["sin"]


SUITE = Suite(
    name="rope",
    description="rotary position embedding of q [B, Hq, T, D] and k [B, Hkv, T, D] (Hugging Face layout)",
    shape_dims=("B", "T", "Hq", "Hkv", "D"),
    gpu_shapes=((4, 4096, 32, 8, 128), (1, 8192, 64, 8, 128)),
    cpu_shapes=((1, 16, 8, 2, 64),),  # small: under TRITON_INTERPRET=1 every (b, t) is a numpy program
    providers=(
        *torch_providers(hf_apply_rotary_pos_emb, _args, "Hugging Face apply_rotary_pos_emb, eager"),
        Provider("fuselm", lambda device: lambda x: apply_rotary(*_args(x)), "fuselm.apply_rotary"),
        liger_provider("liger_kernel.ops.rope", "LigerRopeFunction", _args),
    ),
    make_inputs=make_inputs,
    cost=cost,
    columns=("ms", "ms_eager", "tbps", "x_copy", "extra_mib"),
    cuda_graph=True,
    notes=(
        "Bytes counted: fwd reads q, k and writes q_embed, k_embed (4 B per q/k element in bf16); bwd the "
        "same for the gradients; full both (8 B per element in bf16). cos/sin are not counted.",
        "q and k are contiguous [B, H, T, D]; cos/sin [B, T, D] in the input dtype, theta 500000.",
    ),
)
