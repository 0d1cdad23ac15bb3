"""Pure-PyTorch gated activations: the spec, the CPU fallback, the test oracle and the benchmark baseline.

For gate g and up u of the same shape [..., I] and an activation act:

    out   = act(g) * u
    dup   = dout * act(g)
    dgate = dout * u * act'(g)

with the activations (names as used across the op folder):

    "silu":      act(g) = g * s(g),                 act'(g) = s(g) * (1 + g * (1 - s(g)))
    "gelu_tanh": act(g) = g * s(z),  z = 2 * sqrt(2/pi) * (g + 0.044715 g^3)
                                     (the same as 0.5 g (1 + tanh(z / 2)), PyTorch's approximate="tanh")
                 act'(g) = s(z) + g * s(z) * (1 - s(z)) * 2 * sqrt(2/pi) * (1 + 3 * 0.044715 g^2)
    "gelu":      act(g) = 0.5 g (1 + erf(g / sqrt(2))),  act'(g) = 0.5 (1 + erf(g / sqrt(2))) + g * phi(g)

where s is the logistic sigmoid and phi the standard normal density. Everything is computed in fp32
(fp64 for fp64 inputs) and rounded once to the input dtype. The packed layout holds gate and up in
one [..., 2I] tensor: gate = gate_up[..., :I], up = gate_up[..., I:].
"""

from __future__ import annotations

import math

import torch

ACTIVATIONS = ("silu", "gelu_tanh", "gelu")

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_C = 0.044715


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def activation_reference(g: torch.Tensor, activation: str) -> torch.Tensor:
    """act(g) in g's dtype (call it on fp32/fp64 tensors); differentiable through autograd."""
    if activation == "silu":
        return g * torch.sigmoid(g)
    if activation == "gelu_tanh":
        return g * torch.sigmoid(2.0 * _SQRT_2_OVER_PI * (g + _GELU_C * g * g * g))
    if activation == "gelu":
        return 0.5 * g * (1.0 + torch.erf(g * math.sqrt(0.5)))
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def activation_grad_reference(g: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(act(g), act'(g)) by the closed forms of the module docstring (no autograd)."""
    if activation == "silu":
        s = torch.sigmoid(g)
        return g * s, s * (1.0 + g * (1.0 - s))
    if activation == "gelu_tanh":
        s = torch.sigmoid(2.0 * _SQRT_2_OVER_PI * (g + _GELU_C * g * g * g))
        dz = 2.0 * _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_C * g * g)
        return g * s, s + g * s * (1.0 - s) * dz
    if activation == "gelu":
        cdf = 0.5 * (1.0 + torch.erf(g * math.sqrt(0.5)))
        return g * cdf, cdf + g * torch.exp(-0.5 * g * g) / math.sqrt(2.0 * math.pi)
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def gated_reference(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """act(gate) * up computed in fp32 (fp64 for fp64 inputs), returned in the input dtype.

    Differentiable through autograd (it is the test oracle when run on fp64 copies).
    """
    c = _compute_dtype(gate)
    return (activation_reference(gate.to(c), activation) * up.to(c)).to(gate.dtype)


def gated_fwd_reference(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """The forward of the CPU fallback: like gated_reference, without recording autograd."""
    with torch.no_grad():
        return gated_reference(gate, up, activation)


def gated_bwd_reference(
    dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str, want_out: bool = False
) -> tuple[torch.Tensor, ...]:
    """(dgate, dup) by the closed forms, in the input dtype; with want_out also act(gate) * up."""
    c = _compute_dtype(gate)
    with torch.no_grad():
        g, u, d = gate.to(c), up.to(c), dout.to(c)
        a, da = activation_grad_reference(g, activation)
        grads = ((d * u * da).to(gate.dtype), (d * a).to(up.dtype))
        if want_out:
            return (*grads, (a * u).to(gate.dtype))
        return grads


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32, output in the input dtype. gate, up: [..., I]."""
    return gated_reference(gate, up, "silu")


def geglu_reference(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """gelu(gate, approximate) * up in fp32, output in the input dtype. gate, up: [..., I]."""
    return gated_reference(gate, up, "gelu_tanh" if approximate == "tanh" else "gelu")


def split_packed(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., 2I] -> (gate [..., I], up [..., I]) views: gate is the first half of the last dim."""
    half = gate_up.shape[-1] // 2
    return gate_up[..., :half], gate_up[..., half:]
