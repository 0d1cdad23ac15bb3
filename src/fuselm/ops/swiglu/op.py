"""fuselm.swiglu / geglu and the packed forms: launchers -> custom ops -> autograd -> public (the MLP
functions built on them, swiglu_linear and swiglu_mlp, are in mlp.py)."""

from __future__ import annotations

import functools

import torch

from .._common.dispatch import compiled_or_launcher, kernels_run
from .._common.dtensor import has_dtensor, leading_dims_only, run_local
from .._common.guard import FLOAT_DTYPES, check_choice, check_tensor, rows_view
from .._common.launch import cdiv, launcher, next_pow2
from .kernels import swiglu_bwd_kernel, swiglu_fwd_kernel
from .reference import gated_bwd_reference, gated_fwd_reference, split_packed

# Launch configs (elements per program, warps). 4096 bf16 elements = 8 KiB per operand per program,
# 16 elements (two 16-byte vectors) per thread with 8 warps. Tune here (benchmarks: `fuselm bench swiglu`).
FWD_BLOCK, FWD_WARPS = 4096, 8
BWD_BLOCK, BWD_WARPS = 4096, 8
# Strided rows (row tiles): the column block is a power of two between MIN_BLOCK_C and the block,
# the largest that wastes at most MAX_COL_WASTE of a row in masked lanes; rows fill the rest of the block.
MIN_BLOCK_C = 256
MAX_COL_WASTE = 0.125

# cached launch bindings of the kernels (ops/_common/launch.py)
swiglu_fwd_launch = launcher(swiglu_fwd_kernel)
swiglu_bwd_launch = launcher(swiglu_bwd_kernel)

ACTIVATION_CODE = {"silu": 0, "gelu_tanh": 1, "gelu": 2}  # kernels.SILU, GELU_TANH, GELU


def _rows_contiguous(t: torch.Tensor) -> bool:
    return t.shape[0] <= 1 or t.stride(0) == t.shape[1]


def _config(n_rows: int, n_cols: int, tensors, block: int) -> tuple[bool, int, int, int]:
    """(FLAT, BLOCK_R, BLOCK_C, programs) for a [n_rows, n_cols] problem over `tensors`."""
    if all(_rows_contiguous(t) for t in tensors):
        return True, 1, block, cdiv(n_rows * n_cols, block)
    return _strided_config(n_rows, n_cols, block)


@functools.lru_cache(maxsize=256)  # host time: once per shape
def _strided_config(n_rows: int, n_cols: int, block: int) -> tuple[bool, int, int, int]:
    block_c = min(block, next_pow2(n_cols))
    candidate = block_c
    while candidate >= min(MIN_BLOCK_C, block_c):
        if cdiv(n_cols, candidate) * candidate - n_cols <= MAX_COL_WASTE * n_cols:
            block_c = candidate
            break
        candidate //= 2
    block_r = min(block // block_c, next_pow2(n_rows))
    return False, block_r, block_c, cdiv(n_rows, block_r) * cdiv(n_cols, block_c)


# the kernels' argument names of an operand (host time: no f-strings per launch)
_ARG_NAMES = {n: (f"{n}_ptr", f"{n}_row_stride") for n in ("gate", "up", "out", "dout", "dgate", "dup")}


def _launch(kernel, operands: dict, shape: tuple[int, int], block: int, num_warps: int, **meta) -> None:
    """Launch `kernel` (a launcher of ops/_common/launch.py) over `operands` (name -> tensor, or None for
    an unused one) of a [R, C] problem (`shape`): every operand contiguous, of any shape with R * C
    elements (a flat launch), or every operand [R, C] with stride(-1) == 1 (rows may be strided). The
    kernel's arguments are `<name>_ptr` and `<name>_row_stride` for each, then n_rows, n_cols and its
    constexprs. A flat size that is not a multiple of 16 gets a main launch over whole blocks and a
    one-program tail, because a mask bound divisible by 16 is what keeps Triton's masked accesses 16-byte
    vectors."""
    n_rows, n_cols = shape
    used = [t for t in operands.values() if t is not None]
    flat = True
    for t in used:
        flat = flat and t.is_contiguous()
        assert t.numel() == n_rows * n_cols, (tuple(t.shape), shape)
    if flat:
        block_r, block_c = 1, block
    else:
        for t in used:
            assert t.dim() == 2 and (t.stride(1) == 1 or n_cols == 1), (tuple(t.shape), t.stride())
        _, block_r, block_c, programs = _strided_config(n_rows, n_cols, block)
    kwargs = {}
    for name, t in operands.items():
        ptr, stride = _ARG_NAMES[name]
        kwargs[ptr] = t if t is not None else used[0]
        kwargs[stride] = t.stride(0) if t is not None and not flat else 0
    config = dict(meta, FLAT=flat, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=num_warps)
    if not flat:
        kernel((programs,), **kwargs, n_rows=n_rows, n_cols=n_cols, **config)
        return
    numel = n_rows * n_cols
    split = numel - numel % block if numel % 16 and numel > block else numel
    # flat pointers: the operands themselves (rows contiguous), elements 0 .. split
    kernel((cdiv(split, block),), **kwargs, n_rows=1, n_cols=split, **config)
    if split < numel:  # the tail: pointers moved to element `split` (an unused operand: the first's)
        tails = {name: t.reshape(-1)[split:] for name, t in operands.items() if t is not None}
        first = next(iter(tails.values()))
        for name in operands:
            kwargs[_ARG_NAMES[name][0]] = tails.get(name, first)
        tail = numel - split
        kernel((cdiv(tail, block),), **kwargs, n_rows=1, n_cols=tail, **config)


def _problem(t: torch.Tensor) -> tuple[int, int]:
    """(R, C) of the rows of t [..., C]."""
    n_cols = t.shape[-1]
    return (t.numel() // n_cols if n_cols else 0), n_cols


def _rows_operands(*tensors):
    """The operands as the launchers take them: unchanged when every one is contiguous (a flat launch,
    any shape, no view), else their [R, C] rows views (rows_view: a copy only where no strided view
    exists)."""
    for t in tensors:
        if not t.is_contiguous():
            return tuple(rows_view(t) for t in tensors)
    return tensors


def swiglu_fwd(gate, up, activation, out=None):
    """out = act(gate) * up (into `out` when given): gate, up (and out) contiguous of any shape, or [R, I]
    with stride(-1) == 1."""
    if out is None:
        out = torch.empty_like(gate, memory_format=torch.contiguous_format)
    if out.numel() == 0:
        return out
    _launch(
        swiglu_fwd_launch,
        dict(gate=gate, up=up, out=out),
        _problem(gate),
        FWD_BLOCK,
        FWD_WARPS,
        ACTIVATION=ACTIVATION_CODE[activation],
    )
    return out


def swiglu_bwd(dout, gate, up, activation, dgate, dup, out=None):
    """Writes dgate = dout * up * act'(gate), dup = dout * act(gate) (and out = act(gate) * up when
    given) in one pass. All contiguous of one shape, or all [R, I] with stride(-1) == 1; dgate may be
    dout itself."""
    if gate.numel() == 0:
        return
    _launch(
        swiglu_bwd_launch,
        dict(dout=dout, gate=gate, up=up, dgate=dgate, dup=dup, out=out),
        _problem(gate),
        BWD_BLOCK,
        BWD_WARPS,
        ACTIVATION=ACTIVATION_CODE[activation],
        HAS_OUT=out is not None,
    )


def swiglu_bwd_alloc(dout, gate, up, activation, want_out=False, dgate_into_dout=False):
    """(dgate, dup[, out]) freshly allocated; dgate_into_dout writes dgate over dout's buffer."""
    dgate = dout if dgate_into_dout else torch.empty_like(gate, memory_format=torch.contiguous_format)
    dup = torch.empty_like(up, memory_format=torch.contiguous_format)
    out = torch.empty_like(gate, memory_format=torch.contiguous_format) if want_out else None
    swiglu_bwd(dout, gate, up, activation, dgate, dup, out)
    return (dgate, dup, out) if want_out else (dgate, dup)


def _bwd_any_shape(dout, gate, up, activation, want_out=False):
    """swiglu_bwd_alloc for dout, gate, up of one shape, any strides: (dgate, dup[, out]) in gate's shape."""
    d, g, u = _rows_operands(dout, gate, up)
    res = swiglu_bwd_alloc(d, g, u, activation, want_out)
    return res if g is gate else tuple(r.view(gate.shape) for r in res)


def swiglu_packed_fwd(gate_up, activation):
    """out [R, I] from gate_up [R, 2I] (gate = first half of each row, up = second half)."""
    gate, up = split_packed(gate_up)
    return swiglu_fwd(gate, up, activation)


def swiglu_packed_bwd(dout, gate_up, activation):
    """d gate_up [R, 2I] (dgate in the first half, dup in the second), written by one kernel."""
    gate, up = split_packed(gate_up)
    grad = torch.empty(tuple(gate_up.shape), dtype=gate_up.dtype, device=gate_up.device)
    dgate, dup = split_packed(grad)
    swiglu_bwd(dout, gate, up, activation, dgate, dup)
    return grad


# ---- custom ops: torch.compile sees one opaque node per launch, no graph break ----


def _unit_col(t: torch.Tensor) -> torch.Tensor:
    """The kernels need stride(-1) == 1; a compiled graph may hand a custom op other strides."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


@torch.library.custom_op("fuselm::swiglu_fwd", mutates_args=())
def _swiglu_fwd_op(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    g, u = _rows_operands(_unit_col(gate), _unit_col(up))
    return swiglu_fwd(g, u, activation).view(gate.shape)


@_swiglu_fwd_op.register_fake
def _(gate, up, activation):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("fuselm::swiglu_bwd", mutates_args=())
def _swiglu_bwd_op(
    dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str, want_out: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    res = _bwd_any_shape(_unit_col(dout), _unit_col(gate), _unit_col(up), activation, want_out)
    return res if want_out else (*res, gate.new_empty(0))


@_swiglu_bwd_op.register_fake
def _(dout, gate, up, activation, want_out):
    out = gate.new_empty(gate.shape) if want_out else gate.new_empty(0)
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape), out


@torch.library.custom_op("fuselm::swiglu_packed_fwd", mutates_args=())
def _swiglu_packed_fwd_op(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    return swiglu_packed_fwd(_unit_col(gate_up), activation)


@_swiglu_packed_fwd_op.register_fake
def _(gate_up, activation):
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


@torch.library.custom_op("fuselm::swiglu_packed_bwd", mutates_args=())
def _swiglu_packed_bwd_op(dout: torch.Tensor, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    return swiglu_packed_bwd(_unit_col(dout), _unit_col(gate_up), activation)


@_swiglu_packed_bwd_op.register_fake
def _(dout, gate_up, activation):
    return gate_up.new_empty(gate_up.shape)


# Eager calls launch directly (a custom op costs tens of microseconds of host time per call);
# under torch.compile the custom ops above stand in. Tensors that do not take the Triton path
# (CPU without TRITON_INTERPRET=1, float64) run the closed forms of reference.py.


_fwd = compiled_or_launcher(_swiglu_fwd_op, swiglu_fwd)


def _run_fwd(gate, up, activation):
    if not kernels_run(gate):
        return gated_fwd_reference(gate, up, activation)
    return _fwd(gate, up, activation)


def _run_bwd(dout, gate, up, activation, want_out=False, dgate_into_dout=False):
    dout = rows_view(dout)
    if not kernels_run(gate):
        return gated_bwd_reference(dout, gate, up, activation, want_out)
    if torch.compiler.is_compiling():
        dgate, dup, out = _swiglu_bwd_op(dout, gate, up, activation, want_out)
        return (dgate, dup, out) if want_out else (dgate, dup)
    return swiglu_bwd_alloc(dout, gate, up, activation, want_out, dgate_into_dout)


def _run_fwd_any(gate, up, activation):
    """act(gate) * up for gate and up of one shape, any strides (the autograd Function's forward)."""
    if not kernels_run(gate):
        return gated_fwd_reference(gate, up, activation)
    if torch.compiler.is_compiling():
        return _swiglu_fwd_op(gate, up, activation)
    g, u = _rows_operands(gate, up)
    out = swiglu_fwd(g, u, activation)
    return out if g is gate else out.view(gate.shape)


def _run_bwd_any(dout, gate, up, activation):
    """(dgate, dup) in gate's shape for dout, gate, up of one shape, any strides (the Function's backward)."""
    if not kernels_run(gate):
        return gated_bwd_reference(dout, gate, up, activation, False)
    if torch.compiler.is_compiling():
        dgate, dup, _ = _swiglu_bwd_op(dout, gate, up, activation, False)
        return dgate, dup
    return _bwd_any_shape(dout, gate, up, activation)


_packed_fwd = compiled_or_launcher(_swiglu_packed_fwd_op, swiglu_packed_fwd)
_packed_bwd = compiled_or_launcher(_swiglu_packed_bwd_op, swiglu_packed_bwd)


def _run_packed_fwd(gate_up, activation):
    if not kernels_run(gate_up):
        return gated_fwd_reference(*split_packed(gate_up), activation)
    return _packed_fwd(gate_up, activation)


def _run_packed_bwd(dout, gate_up, activation):
    dout = rows_view(dout)
    if not kernels_run(gate_up):
        return torch.cat(gated_bwd_reference(dout, *split_packed(gate_up), activation), dim=-1)
    return _packed_bwd(dout, gate_up, activation)


def gated_forward(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` for ``[R, I]`` gate and up (stride(-1) == 1), no autograd: the forward kernel
    (or the reference on the CPU) for compositions that write their own backward (``fuselm.lora``).
    ``activation`` is ``"silu"``, ``"gelu_tanh"`` or ``"gelu"``.

    Example:
        >>> g, u = torch.randn(4, 8), torch.randn(4, 8)
        >>> torch.allclose(gated_forward(g, u, "silu"), torch.nn.functional.silu(g) * u, atol=1e-6)
        True
    """
    return _run_fwd(gate, up, activation)


def gated_backward(
    dout: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    *,
    want_out: bool = False,
    dgate_into_dout: bool = False,
    overwrite_inputs: bool = False,
) -> tuple[torch.Tensor, ...]:
    """``(dgate, dup)`` of ``act(gate) * up`` for ``[R, I]`` tensors, no autograd; with ``want_out`` also
    the recomputed product (one kernel writes all three). ``dgate_into_dout=True`` lets the kernel write
    dgate into ``dout``'s storage (the caller owns ``dout`` and no longer needs it).
    ``overwrite_inputs=True`` (the caller owns all three buffers and needs none of them afterwards): dgate
    goes into ``dout``, dup into ``up`` and the product into ``gate``, so nothing is allocated (each
    element is read before it is written, in the same program). Under ``torch.compile`` and on the
    reference path the results are fresh tensors.

    Example:
        >>> g, u, d = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8)
        >>> dg, du = gated_backward(d, g, u, "silu")
        >>> torch.allclose(du, d * torch.nn.functional.silu(g), atol=1e-6)
        True
    """
    if overwrite_inputs and kernels_run(gate) and not torch.compiler.is_compiling():
        for name, t in (("dout", dout), ("gate", gate), ("up", up)):
            if t.dim() != 2 or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous [R, I] tensor to be overwritten")
        swiglu_bwd(dout, gate, up, activation, dout, up, gate if want_out else None)
        return (dout, up, gate) if want_out else (dout, up)
    return _run_bwd(dout, gate, up, activation, want_out=want_out, dgate_into_dout=dgate_into_dout)


# ---- autograd: save gate and up (or gate_up) only; the activation is recomputed in backward ----


class SwiGLUFunction(torch.autograd.Function):
    """act(gate) * up for gate and up of one shape [..., I], any strides (contiguous ones are launched flat,
    others as [R, I] rows views, made inside the Function: no view nodes in the graph). Saves gate and up
    only."""

    @staticmethod
    def forward(ctx, gate, up, activation):
        ctx.save_for_backward(gate, up)
        ctx.activation = activation
        return _run_fwd_any(gate, up, activation)

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        dgate, dup = _run_bwd_any(dout, gate, up, ctx.activation)
        return dgate, dup, None


class SwiGLUPackedFunction(torch.autograd.Function):
    """act(gate_up[:, :I]) * gate_up[:, I:] for [R, 2I] gate_up. Saves gate_up only."""

    @staticmethod
    def forward(ctx, gate_up, activation):
        ctx.save_for_backward(gate_up)
        ctx.activation = activation
        return _run_packed_fwd(gate_up, activation)

    @staticmethod
    def backward(ctx, dout):
        (gate_up,) = ctx.saved_tensors
        return _run_packed_bwd(dout, gate_up, ctx.activation), None


# ---- public functions ----

_DTYPES = (*FLOAT_DTYPES, torch.float64)
_APPROXIMATE = {"tanh": "gelu_tanh", "none": "gelu"}


def _check_pair(gate: object, up: object) -> None:
    check_tensor("gate", gate, dtypes=_DTYPES, min_ndim=1)
    check_tensor("up", up, dtypes=_DTYPES, device=gate.device)
    if up.dtype != gate.dtype:
        raise ValueError(f"up must have the dtype of gate ({gate.dtype}), got {up.dtype}")
    if tuple(up.shape) != tuple(gate.shape):
        raise ValueError(f"up must have the shape of gate {tuple(gate.shape)}, got {tuple(up.shape)}")


def _gated(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    return SwiGLUFunction.apply(gate, up, activation)


def _check_packed(gate_up: object) -> None:
    check_tensor("gate_up", gate_up, dtypes=_DTYPES, min_ndim=1)
    if gate_up.shape[-1] % 2 != 0:
        raise ValueError(
            f"gate_up must have an even last dimension (gate and up concatenated), got {tuple(gate_up.shape)}"
        )


def _gated_packed(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    out = SwiGLUPackedFunction.apply(rows_view(gate_up), activation)
    return out.reshape(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


_PACKED_HINT = (
    "the last dimension holds [gate | up] and must be whole on each rank: redistribute gate_up to "
    "Replicate() or Shard() of a leading dimension, or pass gate_up.to_local() (a tensor-parallel "
    "fused projection whose local block is [gate_i | up_i] is computed right from its local tensor)"
)


def _any_dim(dim: int, ndim: int) -> bool:
    return True


def _gated_dtensor(op, fn, gate, up):
    """swiglu / geglu on DTensors: elementwise, so any placements (the same for gate and up)."""
    return run_local(op, fn, {"gate": gate, "up": up}, {}, shardable=_any_dim, hint="")


def _gated_packed_dtensor(op, fn, gate_up):
    return run_local(op, fn, {"gate_up": gate_up}, {}, shardable=leading_dims_only, hint=_PACKED_HINT)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: ``silu(gate) * up``, fused in one kernel forward and one kernel backward.

    The activation of the Llama / Mistral / Qwen MLP: ``down_proj(swiglu(gate_proj(x), up_proj(x)))``.
    Computed in fp32, rounded once to the input dtype. The backward saves only ``gate`` and ``up``
    (never ``silu(gate)`` nor the product) and recomputes the activation; one kernel writes both
    gradients. The math is in ops/swiglu/README.md.

    Args:
        gate: ``[..., I]`` float32 / float16 / bfloat16 (float64 runs the PyTorch reference). Rows may
            be strided (e.g. a slice ``x[..., :I]``); the last dimension must have stride 1, else it
            is copied.
        up: same shape, dtype and device as ``gate``.

    Returns:
        ``[..., I]`` in the dtype of ``gate``.

    DTensor: gate and up may be DTensors with the same mesh and placements, sharded on any dimension
    (tensor parallel: ``Shard(-1)`` of the column-parallel projections) or replicated; each rank
    computes its shard, the output has their placements. The same holds for :func:`fuselm.geglu`.
    :func:`fuselm.swiglu_packed` / :func:`fuselm.geglu_packed` take a DTensor sharded on a leading
    dimension or replicated; sharded on the last (``[gate | up]``) dimension raises ValueError.

    Raises:
        ValueError: naming the argument, for a non-tensor, an unsupported dtype, or ``up`` whose
            shape, dtype or device differs from ``gate``'s.

    Example:
        >>> import torch, fuselm
        >>> gate = torch.randn(2, 3, 8, requires_grad=True)
        >>> up = torch.randn(2, 3, 8, requires_grad=True)
        >>> out = fuselm.swiglu(gate, up)
        >>> out.shape
        torch.Size([2, 3, 8])
        >>> torch.allclose(out, torch.nn.functional.silu(gate) * up, atol=1e-6)
        True
        >>> out.sum().backward()
        >>> gate.grad.shape, up.grad.shape
        (torch.Size([2, 3, 8]), torch.Size([2, 3, 8]))
    """
    if has_dtensor(gate, up):
        return _gated_dtensor("swiglu", swiglu, gate, up)
    _check_pair(gate, up)
    return _gated(gate, up, "silu")


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """GeGLU: ``gelu(gate, approximate) * up``, fused in one kernel forward and one backward.

    Gemma's MLP uses ``approximate="tanh"`` (Hugging Face ``hidden_act="gelu_pytorch_tanh"``).
    Same contract as :func:`fuselm.swiglu`: fp32 math, output in the input dtype, only ``gate`` and
    ``up`` saved for backward, one kernel writes both gradients.

    Args:
        gate: ``[..., I]`` float32 / float16 / bfloat16 (float64 runs the PyTorch reference); rows
            may be strided.
        up: same shape, dtype and device as ``gate``.
        approximate: ``"tanh"`` (default: ``0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))``) or
            ``"none"`` (exact: ``0.5 g (1 + erf(g / sqrt(2)))``), as in ``torch.nn.functional.gelu``.

    Returns:
        ``[..., I]`` in the dtype of ``gate``.

    Example:
        >>> import torch, fuselm
        >>> import torch.nn.functional as F
        >>> gate, up = torch.randn(4, 16), torch.randn(4, 16)
        >>> out = fuselm.geglu(gate, up)
        >>> torch.allclose(out, F.gelu(gate, approximate="tanh") * up, atol=1e-6)
        True
        >>> torch.allclose(fuselm.geglu(gate, up, approximate="none"), F.gelu(gate) * up, atol=1e-6)
        True
    """
    check_choice("approximate", approximate, tuple(_APPROXIMATE))
    if has_dtensor(gate, up):
        return _gated_dtensor("geglu", lambda gate, up: geglu(gate, up, approximate), gate, up)
    _check_pair(gate, up)
    return _gated(gate, up, _APPROXIMATE[approximate])


def swiglu_packed(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused gate/up projection: ``silu(gate_up[..., :I]) * gate_up[..., I:]``.

    Layout: the first half of the last dimension is ``gate``, the second half ``up`` — what a fused
    ``gate_up_proj`` whose weight is ``torch.cat([gate_proj.weight, up_proj.weight])`` produces
    (Phi-3's ``gate_up_proj``, vLLM's merged column-parallel layer). The gradient ``[..., 2I]`` is
    written by one kernel (no concatenation); only ``gate_up`` is saved for backward.

    Args:
        gate_up: ``[..., 2I]`` float32 / float16 / bfloat16 (float64 runs the PyTorch reference); the
            last dimension must be even. Rows may be strided.

    Returns:
        ``[..., I]`` in the dtype of ``gate_up``.

    Example:
        >>> import torch, fuselm
        >>> gate_up = torch.randn(3, 10, requires_grad=True)
        >>> out = fuselm.swiglu_packed(gate_up)
        >>> out.shape
        torch.Size([3, 5])
        >>> gate, up = gate_up.chunk(2, dim=-1)
        >>> torch.allclose(out, torch.nn.functional.silu(gate) * up, atol=1e-6)
        True
        >>> out.sum().backward()
        >>> gate_up.grad.shape
        torch.Size([3, 10])
    """
    if has_dtensor(gate_up):
        return _gated_packed_dtensor("swiglu_packed", swiglu_packed, gate_up)
    _check_packed(gate_up)
    return _gated_packed(gate_up, "silu")


def geglu_packed(gate_up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """GeGLU on a fused gate/up projection: ``gelu(gate_up[..., :I], approximate) * gate_up[..., I:]``.

    Same layout as :func:`fuselm.swiglu_packed` (gate first, up second), same activation choices as
    :func:`fuselm.geglu`.

    Args:
        gate_up: ``[..., 2I]`` float32 / float16 / bfloat16 (float64 runs the PyTorch reference); the
            last dimension must be even. Rows may be strided.
        approximate: ``"tanh"`` (default) or ``"none"``, as in ``torch.nn.functional.gelu``.

    Returns:
        ``[..., I]`` in the dtype of ``gate_up``.

    Example:
        >>> import torch, fuselm
        >>> gate_up = torch.randn(3, 10)
        >>> gate, up = gate_up.chunk(2, dim=-1)
        >>> want = torch.nn.functional.gelu(gate, approximate="tanh") * up
        >>> torch.allclose(fuselm.geglu_packed(gate_up), want, atol=1e-6)
        True
    """
    check_choice("approximate", approximate, tuple(_APPROXIMATE))
    if has_dtensor(gate_up):
        fn = lambda gate_up: geglu_packed(gate_up, approximate)  # noqa: E731
        return _gated_packed_dtensor("geglu_packed", fn, gate_up)
    _check_packed(gate_up)
    return _gated_packed(gate_up, _APPROXIMATE[approximate])
