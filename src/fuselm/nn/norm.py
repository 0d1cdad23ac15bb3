"""Normalization modules: hold the parameters (named as in Hugging Face / torch.nn), call the ops."""

from __future__ import annotations

import torch

from ..ops._common.guard import check_bool, check_choice
from ..ops.layer_norm import layer_norm
from ..ops.rms_norm import rms_norm
from ..ops.rms_norm.reference import CASTINGS


class RMSNorm(torch.nn.Module):
    """Module form of :func:`fuselm.rms_norm`, a drop-in for Hugging Face's ``LlamaRMSNorm``
    (``casting="llama"``) and ``GemmaRMSNorm`` (``offset=1.0, casting="gemma"``).

    The parameter is ``weight`` ``[hidden_size]`` and the epsilon is ``variance_epsilon`` (also
    readable as ``eps``, Gemma's name), so state dicts load both ways. The weight starts at
    ``1 - offset``: ones for Llama, zeros for Gemma's ``(1 + weight)``; the scale starts at 1.

    ``forward(x, residual=None)``: x ``[..., hidden_size]``; returns y, or ``(y, x + residual)``
    when a residual is given (the pre-norm residual stream: the sum is normalized and returned).

    ``in_place=True`` (Liger-Kernel's ``in_place``; off by default): the backward writes the gradient of
    x over the gradient of y, one ``[N, hidden_size]`` allocation less. It is a promise that nothing
    reads the gradient of y afterwards (not a gradient you pass to ``backward``, not another branch of
    the graph fed the same gradient); what fuselm can check it still checks (see
    :func:`fuselm.rms_norm`, argument ``in_place``). The attribute can be changed after construction.

    Example:
        >>> import torch, fuselm
        >>> norm = fuselm.nn.RMSNorm(64, eps=1e-6)
        >>> sorted(norm.state_dict())
        ['weight']
        >>> x, res = torch.randn(2, 3, 64), torch.randn(2, 3, 64)
        >>> norm(x).shape
        torch.Size([2, 3, 64])
        >>> y, new_res = norm(x, residual=res)
        >>> torch.equal(new_res, x + res)
        True
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        offset: float = 0.0,
        casting: str = "llama",
        in_place: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_choice("casting", casting, CASTINGS)
        check_bool("in_place", in_place)
        self.weight = torch.nn.Parameter(torch.full((hidden_size,), 1.0 - offset, device=device, dtype=dtype))
        self.variance_epsilon = eps
        self.offset = offset
        self.casting = casting
        self.in_place = in_place

    @property
    def eps(self) -> float:
        return self.variance_epsilon

    @eps.setter
    def eps(self, value: float) -> None:
        self.variance_epsilon = value

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return rms_norm(
            x,
            self.weight,
            self.variance_epsilon,
            offset=self.offset,
            residual=residual,
            casting=self.casting,
            in_place=self.in_place,
        )

    def extra_repr(self) -> str:
        offset = f", offset={self.offset}" if self.offset else ""
        in_place = ", in_place=True" if self.in_place else ""
        options = f"{offset}, casting={self.casting!r}{in_place}"
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}{options}"


class LayerNorm(torch.nn.Module):
    """Module form of :func:`fuselm.layer_norm` over the last dimension, a drop-in for
    ``torch.nn.LayerNorm(hidden_size, eps, bias=bias)``: same parameter names (``weight``, ``bias``)
    and attributes (``normalized_shape``, ``eps``, ``elementwise_affine``), so state dicts load both
    ways.

    ``forward(x, residual=None)``: x ``[..., hidden_size]``; returns y, or ``(y, x + residual)``
    when a residual is given.

    Example:
        >>> import torch, fuselm
        >>> norm = fuselm.nn.LayerNorm(64)
        >>> sorted(norm.state_dict())
        ['bias', 'weight']
        >>> ref = torch.nn.LayerNorm(64)
        >>> ref.load_state_dict(norm.state_dict())
        <All keys matched successfully>
        >>> x = torch.randn(4, 64)
        >>> torch.allclose(norm(x), ref(x), atol=1e-5)
        True
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        bias: bool = True,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.normalized_shape = (int(hidden_size),)
        self.eps = eps
        self.elementwise_affine = True
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return layer_norm(x, self.weight, self.bias, self.eps, residual=residual)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, bias={self.bias is not None}"
