"""Gated MLP modules (Llama / Mistral / Qwen SwiGLU, Gemma GeGLU) with Hugging Face parameter names."""

from __future__ import annotations

import torch
from torch import nn

from ..ops._common.dtensor import has_dtensor
from ..ops._common.guard import check_choice
from ..ops.swiglu import geglu, geglu_packed, swiglu, swiglu_linear, swiglu_mlp, swiglu_packed

# Hugging Face `hidden_act` names (and fuselm's own) -> the activation of ops/swiglu.
ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu": "gelu",
}


def is_plain_linear(m: nn.Module) -> bool:
    """An nn.Linear whose forward nobody intercepts (no adapter, no hooks): its matmul may be fused with
    what comes before or after it (the MLP activation, the loss of an lm_head)."""
    return type(m) is nn.Linear and not m._forward_hooks and not m._forward_pre_hooks


def gated_mlp(
    x: torch.Tensor,
    gate_proj: nn.Module,
    up_proj: nn.Module,
    down_proj: nn.Module,
    activation: str,
    *,
    gate_multiplier: float = 1.0,
    down_multiplier: float = 1.0,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """``down_proj(act(gate_proj(x) * gate_multiplier) * up_proj(x)) * down_multiplier`` with the
    activation fused and, when ``down_proj`` is a plain ``nn.Linear``, the product recomputed in backward
    instead of saved (``swiglu_linear``).

    ``activation`` is a key of ``ACTIVATIONS`` (a Hugging Face ``hidden_act`` name). Shared by
    :class:`SwiGLUMLP` and the Hugging Face patches (``fuselm.hf``).

    The multipliers (Falcon-H1's ``config.mlp_multipliers``, muP scalings) are the same PyTorch
    multiplications by a Python number as Hugging Face's, around the fused op, each skipped when it is 1
    (``t * 1.0`` is ``t`` exactly): the gate one reads and writes the ``[..., I]`` gate once more (a
    temporary; nothing more is saved for backward, the fused op saves the scaled gate in place of the
    projection's output, and a product with a Python number saves nothing), the down one reads and writes
    the ``[..., H]`` output once more, forward and backward.

    ``chunk_rows``: the one-node MLP of plain linears runs over chunks of that many rows
    (:func:`fuselm.ops.swiglu.swiglu_mlp`); the other paths ignore it (the caller says so).
    """
    act = ACTIVATIONS[activation]
    projections = (gate_proj, up_proj, down_proj)
    if gate_multiplier == 1 and all(is_plain_linear(p) for p in projections):
        weights = [p.weight for p in projections]
        if not has_dtensor(x, *weights):  # one autograd node for the whole MLP
            out = swiglu_mlp(
                x, *weights, *(p.bias for p in projections), activation=act, chunk_rows=chunk_rows
            )
            return out * down_multiplier if down_multiplier != 1 else out
    gate, up = gate_proj(x), up_proj(x)
    if gate_multiplier != 1:
        gate = gate * gate_multiplier
    if is_plain_linear(down_proj):
        out = swiglu_linear(gate, up, down_proj.weight, down_proj.bias, activation=act)
    else:
        out = down_proj(gated(gate, up, act))
    return out * down_multiplier if down_multiplier != 1 else out


def gated(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """``act(gate) * up`` for an activation of ops/swiglu (``"silu"``, ``"gelu_tanh"``, ``"gelu"``)."""
    if act == "silu":
        return swiglu(gate, up)
    return geglu(gate, up, approximate="tanh" if act == "gelu_tanh" else "none")


def gated_packed(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """``act(gate_up[..., :I]) * gate_up[..., I:]`` (a fused ``gate_up_proj``'s output, Phi-3's layout)."""
    if act == "silu":
        return swiglu_packed(gate_up)
    return geglu_packed(gate_up, approximate="tanh" if act == "gelu_tanh" else "none")


class SwiGLUMLP(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``: the MLP of Llama, Mistral, Qwen (SwiGLU) and,
    with ``activation="gelu_pytorch_tanh"``, Gemma (GeGLU).

    Parameter names are those of Hugging Face's ``LlamaMLP`` (``gate_proj``, ``up_proj``,
    ``down_proj``, each an ``nn.Linear``), so state dicts load both ways. For backward, autograd
    keeps the input ``x`` and the two projections ``gate`` and ``up`` (``[..., I]`` each) and nothing
    else of size ``I``: the activation and the product feeding ``down_proj`` are recomputed in the
    backward by the kernel that writes ``dgate`` and ``dup`` (see :func:`fuselm.ops.swiglu.swiglu_linear`).
    Eager PyTorch keeps four ``[..., I]`` tensors. When ``down_proj`` is not a plain ``nn.Linear``
    (e.g. wrapped by an adapter) or has forward hooks, it is called as a module on the product instead.

    Args:
        hidden_size: ``H``, the model width (input and output features).
        intermediate_size: ``I``, the width of ``gate_proj`` and ``up_proj``.
        bias: give the three projections a bias (Hugging Face ``mlp_bias``).
        activation: ``"silu"`` (default; also ``"swish"``), ``"gelu_pytorch_tanh"`` (also
            ``"gelu_tanh"``, ``"gelu_new"``: the tanh approximation) or ``"gelu"`` (exact), as in a
            Hugging Face config's ``hidden_act``.
        device, dtype: of the parameters, as for ``nn.Linear``.

    Shapes: ``x`` is ``[..., H]``; the output is ``[..., H]`` in the dtype of the projections.

    Example:
        >>> import torch, fuselm
        >>> mlp = fuselm.nn.SwiGLUMLP(16, 64)
        >>> sorted(mlp.state_dict())
        ['down_proj.weight', 'gate_proj.weight', 'up_proj.weight']
        >>> x = torch.randn(2, 5, 16, requires_grad=True)
        >>> y = mlp(x)
        >>> y.shape
        torch.Size([2, 5, 16])
        >>> want = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        >>> torch.allclose(y, want, atol=1e-5)
        True
        >>> y.sum().backward()
        >>> mlp.gate_proj.weight.grad.shape
        torch.Size([64, 16])
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        activation: str = "silu",
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_choice("activation", activation, ACTIVATIONS)
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gated_mlp(x, self.gate_proj, self.up_proj, self.down_proj, self.activation)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
            f"activation={self.activation!r}"
        )


class GeGLUMLP(SwiGLUMLP):
    """:class:`SwiGLUMLP` with a GELU gate: Gemma's MLP (``hidden_act="gelu_pytorch_tanh"``).

    Args:
        hidden_size, intermediate_size, bias, device, dtype: as for :class:`SwiGLUMLP`.
        approximate: ``"tanh"`` (default, Gemma) or ``"none"`` (exact GELU), as in ``F.gelu``.

    Example:
        >>> import torch, fuselm
        >>> mlp = fuselm.nn.GeGLUMLP(16, 64)
        >>> x = torch.randn(3, 16)
        >>> act = torch.nn.functional.gelu(mlp.gate_proj(x), approximate="tanh")
        >>> want = mlp.down_proj(act * mlp.up_proj(x))
        >>> torch.allclose(mlp(x), want, atol=1e-5)
        True
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        approximate: str = "tanh",
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        check_choice("approximate", approximate, ("tanh", "none"))
        activation = "gelu_pytorch_tanh" if approximate == "tanh" else "gelu"
        super().__init__(hidden_size, intermediate_size, bias, activation, device=device, dtype=dtype)
