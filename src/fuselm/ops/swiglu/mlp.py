"""The gated MLP around the activation kernels: swiglu_linear (the down projection fused with the activation's
backward) and swiglu_mlp (the whole MLP as one autograd node, whole or over chunks of rows)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._common.dtensor import has_dtensor
from .._common.fp32_matmul import mm_fp32_into
from .._common.guard import cast_for_autocast, check_choice, check_chunk_rows, check_tensor, rows_view
from .op import _DTYPES, _check_pair, _run_bwd, _run_fwd, gated_backward
from .reference import ACTIVATIONS

# ---- autograd ----


class SwiGLULinearFunction(torch.autograd.Function):
    """F.linear(act(gate) * up, weight, bias) for [R, I] gate and up. Saves gate, up and weight: the
    product is recomputed in backward by the same kernel that writes dgate and dup."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias, activation):
        ctx.save_for_backward(gate, up, weight)
        ctx.activation = activation
        ctx.has_bias = bias is not None
        return F.linear(_run_fwd(gate, up, activation), weight, bias)

    @staticmethod
    def backward(ctx, dy):
        gate, up, weight = ctx.saved_tensors
        need_gate_up = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        need_weight = ctx.needs_input_grad[2]
        dgate = dup = dweight = dbias = None
        if need_gate_up:
            dh = dy @ weight  # [R, I], a fresh buffer owned here: dgate overwrites it
            res = _run_bwd(dh, gate, up, ctx.activation, want_out=need_weight, dgate_into_dout=True)
            dgate, dup, h = res if need_weight else (*res, None)
        elif need_weight:
            h = _run_fwd(gate, up, ctx.activation)
        if need_weight:
            dweight = dy.t() @ h  # [H, I]
        if ctx.has_bias and ctx.needs_input_grad[3]:
            dbias = dy.sum(0)
        return dgate, dup, dweight, dbias, None


class GatedMLPFunction(torch.autograd.Function):
    """down(act(gate(x)) * up(x)) for x [N, H] and trainable weights: one autograd node for the whole MLP
    (three GEMMs and the activation kernel forward, five GEMMs and one kernel backward), where eager
    PyTorch builds about fifteen (three linears of five nodes each) at a host cost of ~10 us each. Saves
    x and the pre-activations g, u [N, I]; the product h = act(g) * u is recomputed in backward by the
    kernel that writes dg (over dh), du (over u) and h (over g): three [N, I] buffers at the backward's
    peak, and the saved g and u are consumed (a second backward through the same graph raises)."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, b_gate, b_up, b_down, activation):
        g = F.linear(x, w_gate, b_gate)
        u = F.linear(x, w_up, b_up)
        y = F.linear(_run_fwd(g, u, activation), w_down, b_down)
        ctx.save_for_backward(x, g, u, w_gate, w_up, w_down)
        ctx.activation = activation
        ctx.consumed = False
        return y

    @staticmethod
    def backward(ctx, dy):
        x, g, u, w_gate, w_up, w_down = ctx.saved_tensors
        nx, nwg, nwu, nwd, nbg, nbu, nbd = ctx.needs_input_grad[:7]
        dx = dwg = dwu = dwd = dbg = dbu = dbd = None
        dy = rows_view(dy)
        if nx or nwg or nwu or nbg or nbu:
            if ctx.consumed:
                raise RuntimeError(
                    "fuselm gated MLP: backward through the same graph twice (retain_graph): the first "
                    "backward overwrote the saved gate and up projections; run the forward again"
                )
            ctx.consumed = True
            dh = torch.mm(dy, w_down)  # [N, I], owned here
            res = gated_backward(dh, g, u, ctx.activation, want_out=nwd, overwrite_inputs=True)
            dg, du, h = res if nwd else (*res, None)
            del dh, g, u
            if nwg:
                dwg = torch.mm(dg.t(), x)
            if nwu:
                dwu = torch.mm(du.t(), x)
            if nbg:
                dbg = dg.sum(0)
            if nbu:
                dbu = du.sum(0)
            if nx:
                dx = torch.mm(dg, w_gate).addmm_(du, w_up)  # one buffer, one rounding of the sum
            del dg, du
        else:
            h = _run_fwd(g, u, ctx.activation) if nwd else None
        if nwd:
            dwd = torch.mm(dy.t(), h)
        if nbd:
            dbd = dy.sum(0)
        return dx, dwg, dwu, dwd, dbg, dbu, dbd, None


# ---- the chunked MLP: one loop for the dense projections (below) and fuselm.lora's ----


def row_chunks(n_rows: int, chunk_rows: int) -> list[tuple[int, int]]:
    """(start, end) of the chunks of ``chunk_rows`` rows that cover ``n_rows`` (the last may be shorter)."""
    return [(s, min(s + chunk_rows, n_rows)) for s in range(0, n_rows, chunk_rows)]


class ChunkSums:
    """Parameter gradients summed over the row chunks of a backward in fp32 (fp64 stays fp64), each rounded
    to its parameter's dtype once, at the end. A sum starts as zeros made up front (:meth:`zeros`: the ones a
    GEMM accumulates into, :meth:`addmm`) or as its first chunk's gradient (:meth:`add`).

    Example:
        >>> sums = ChunkSums()
        >>> for t in (torch.ones(3, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16)):
        ...     sums.add("b", t)
        >>> sums.rounded({"a": None, "b": torch.ones(3, dtype=torch.bfloat16)})
        (None, tensor([2., 2., 2.], dtype=torch.bfloat16))
    """

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}

    def zeros(self, name: str, shape, dtype: torch.dtype, device: torch.device) -> None:
        self.sums[name] = torch.zeros(shape, dtype=dtype, device=device)

    def addmm(self, name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        """sum += a @ b, the product summed in the sum's dtype by the GEMM (:meth:`zeros` first)."""
        mm_fp32_into(self.sums[name], a, b, accumulate=True)

    def add(self, name: str, t: torch.Tensor | None) -> None:
        """sum += t, t cast to fp32 first (fp64 stays fp64); None adds nothing."""
        if t is not None:
            t = t.to(torch.promote_types(t.dtype, torch.float32))
            self.sums[name] = t if name not in self.sums else self.sums[name].add_(t)

    def rounded(self, like: dict) -> tuple:
        """For each name of ``like`` (name -> its parameter), the sum in the parameter's dtype, or None."""
        return tuple(self.sums[k].to(p.dtype) if k in self.sums else None for k, p in like.items())


class ChunkedMLP:
    """``down(act(gate(x)) * up(x))`` for x [N, H] over chunks of rows: never an [N, I] tensor, only
    [chunk, I] ones. The chunk loop, the order of each chunk's work and the activation kernel are here,
    for the dense projections (ChunkedGatedMLPFunction) and fuselm.lora's (ChunkedLoraGatedMLPFunction); a
    subclass runs its projections on one chunk of rows [s, e):

    - ``gate_up(xc, s, e)`` -> ``(g, u)`` [chunk, I] of x's rows xc, in forward and again in backward;
    - ``down(h)`` -> the chunk's output rows (forward);
    - ``grad_h(dyc)`` -> dh [chunk, I], a fresh buffer (backward: the kernel writes dg over it);
    - ``grads(s, e, xc, dyc, dg, du, h)`` takes the chunk's gradients: its rows of dx (:meth:`put_dx`), the
      parameters' sums over the chunks (:class:`ChunkSums`); h is None unless the backward was asked for it.
    """

    dx: torch.Tensor | None = None  # [N, H] after the backward, if dx was asked for
    rows = 0  # N, in the backward

    def put_dx(self, s: int, e: int, rows: torch.Tensor) -> None:
        """Rows [s, e) of dx: one chunk's rows are dx itself; with several, dx is allocated at the first
        chunk's write, not before the first chunk's [chunk, I] buffers (so a single chunk, a recompute's
        whole MLP, peaks no higher than the unchunked MLP)."""
        if s == 0 and e == self.rows:
            self.dx = rows
            return
        if self.dx is None:
            self.dx = rows.new_empty((self.rows, rows.shape[1]))
        self.dx[s:e] = rows

    def forward(self, x: torch.Tensor, chunk_rows: int, activation: str) -> torch.Tensor:
        """y [N, H]: per chunk g, u, then h = act(g) * u (g and u freed), then y's rows = down(h)."""
        y = x.new_empty(x.shape)  # an MLP maps H features to H
        for s, e in row_chunks(x.shape[0], chunk_rows):
            g, u = self.gate_up(x[s:e], s, e)
            h = _run_fwd(g, u, activation)
            del g, u
            y[s:e] = self.down(h)
            del h  # before the next chunk's g and u: never two chunks' tensors at once
        return y

    def backward(self, x: torch.Tensor, dy: torch.Tensor, chunk_rows: int, activation: str, want_h: bool):
        """Per chunk: g and u recomputed, dh, then one kernel writes dg over dh, du over u and (want_h) the
        product h over g; then grads."""
        self.rows = x.shape[0]
        for s, e in row_chunks(self.rows, chunk_rows):
            xc, dyc = x[s:e], dy[s:e]
            g, u = self.gate_up(xc, s, e)
            dh = self.grad_h(dyc)
            res = gated_backward(dh, g, u, activation, want_out=want_h, overwrite_inputs=True)
            dg, du, h = res if want_h else (*res, None)
            del dh, g, u
            self.grads(s, e, xc, dyc, dg, du, h)
            del res, dg, du, h  # before the next chunk's g, u and dh: three [chunk, I] tensors at most


class _DenseChunks(ChunkedMLP):
    """ChunkedGatedMLPFunction's projections on one chunk: F.linear forward, torch.mm backward, the weights'
    gradients summed over the chunks by the GEMMs in fp32 (fp64 for fp64 weights)."""

    def __init__(self, w_gate, w_up, w_down, b_gate, b_up, b_down=None, needs=(False,) * 7):
        self.w_gate, self.w_up, self.w_down = w_gate, w_up, w_down
        self.b_gate, self.b_up, self.b_down = b_gate, b_up, b_down
        self.needs = needs
        _, nwg, nwu, nwd, nbg, nbu, nbd = needs
        self.acc_dtype = torch.float64 if w_gate.dtype == torch.float64 else torch.float32
        self.sums = ChunkSums()
        for name, shape, need in (
            ("wg", w_gate.shape, nwg),
            ("wu", w_up.shape, nwu),
            ("wd", w_down.shape, nwd),
            ("bg", w_gate.shape[:1], nbg),
            ("bu", w_up.shape[:1], nbu),
            ("bd", w_down.shape[:1], nbd),
        ):
            if need:
                self.sums.zeros(name, shape, self.acc_dtype, w_gate.device)

    def gate_up(self, xc, s, e):
        return F.linear(xc, self.w_gate, self.b_gate), F.linear(xc, self.w_up, self.b_up)

    def down(self, h):
        return F.linear(h, self.w_down, self.b_down)

    def grad_h(self, dyc):
        return torch.mm(dyc, self.w_down)

    def grads(self, s, e, xc, dyc, dg, du, h):
        nx, nwg, nwu, nwd, nbg, nbu, nbd = self.needs
        sums, acc_dtype = self.sums, self.acc_dtype
        if nwd:
            sums.addmm("wd", dyc.t(), h)
        if nbd:
            sums.add("bd", dyc.sum(0, dtype=acc_dtype))
        if nwg:
            sums.addmm("wg", dg.t(), xc)
        if nwu:
            sums.addmm("wu", du.t(), xc)
        if nbg:
            sums.add("bg", dg.sum(0, dtype=acc_dtype))
        if nbu:
            sums.add("bu", du.sum(0, dtype=acc_dtype))
        if nx:
            self.put_dx(s, e, torch.mm(dg, self.w_gate).addmm_(du, self.w_up))


class ChunkedGatedMLPFunction(torch.autograd.Function):
    """GatedMLPFunction's math over chunks of ``chunk_rows`` rows (:class:`ChunkedMLP`): never an [N, I]
    tensor, only [chunk, I] ones. Saves x alone (and the weights): the backward recomputes each chunk's gate
    and up projections (two GEMMs more than the unchunked node, the price of O(N x H) activation memory) and
    sums the weights' gradients over the chunks in fp32, rounded to the weights' dtype once."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, b_gate, b_up, b_down, activation, chunk_rows):
        y = _DenseChunks(w_gate, w_up, w_down, b_gate, b_up, b_down).forward(x, chunk_rows, activation)
        ctx.save_for_backward(x, w_gate, w_up, w_down, b_gate, b_up)
        ctx.activation, ctx.chunk_rows = activation, chunk_rows
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w_gate, w_up, w_down, b_gate, b_up = ctx.saved_tensors
        needs = ctx.needs_input_grad[:7]
        dy = rows_view(dy)
        mlp = _DenseChunks(w_gate, w_up, w_down, b_gate, b_up, needs=needs)
        mlp.backward(x, dy, ctx.chunk_rows, ctx.activation, want_h=needs[3])
        like = {"wg": w_gate, "wu": w_up, "wd": w_down, "bg": w_gate, "bu": w_up, "bd": w_down}
        return mlp.dx, *mlp.sums.rounded(like), None, None


# ---- public functions ----


def swiglu_linear(
    gate: torch.Tensor,
    up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str = "silu",
) -> torch.Tensor:
    """The tail of a gated MLP: ``F.linear(act(gate) * up, weight, bias)``, saving less for backward.

    Autograd keeps ``gate``, ``up`` and ``weight`` only: the product ``act(gate) * up`` (the input of
    the down projection, ``[..., I]``) is not kept but recomputed in backward by the kernel that
    writes ``dgate`` and ``dup`` (it reads gate and up there anyway). Eager PyTorch keeps four
    ``[..., I]`` tensors per MLP (gate, act(gate), up, product), a separate fused activation three;
    this keeps two. Under autocast the operands are cast to the autocast dtype first, as
    ``nn.Linear`` does.

    Args:
        gate: ``[..., I]`` float32 / float16 / bfloat16 (float64 runs the PyTorch reference).
        up: same shape, dtype and device as ``gate``.
        weight: ``[H, I]`` (the ``down_proj.weight``), same dtype and device as ``gate``.
        bias: optional ``[H]``.
        activation: ``"silu"`` (SwiGLU), ``"gelu_tanh"`` or ``"gelu"`` (GeGLU).

    Returns:
        ``[..., H]`` in the dtype of ``gate``.

    Example:
        >>> import torch, fuselm
        >>> from fuselm.ops.swiglu import swiglu_linear
        >>> gate, up = torch.randn(4, 32, requires_grad=True), torch.randn(4, 32, requires_grad=True)
        >>> down = torch.nn.Linear(32, 8, bias=False)
        >>> y = swiglu_linear(gate, up, down.weight)
        >>> torch.allclose(y, down(fuselm.swiglu(gate, up)), atol=1e-5)
        True
        >>> y.sum().backward()
        >>> down.weight.grad.shape
        torch.Size([8, 32])
    """
    check_choice("activation", activation, ACTIVATIONS)
    if has_dtensor(gate, up, weight, bias):
        raise ValueError(
            "swiglu_linear does not take DTensors (gate, up, weight, bias): call swiglu / geglu on the "
            "DTensors and then torch.nn.functional.linear, or pass .to_local() of every input"
        )
    _check_pair(gate, up)
    device_type = gate.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        gate, up, weight = gate.to(dtype), up.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    check_tensor("weight", weight, dtypes=(gate.dtype,), ndim=2, device=gate.device)
    if weight.shape[1] != gate.shape[-1]:
        raise ValueError(
            f"weight must have shape [H, {gate.shape[-1]}] (I columns, like gate), got {tuple(weight.shape)}"
        )
    if bias is not None:
        check_tensor("bias", bias, dtypes=(gate.dtype,), ndim=1, device=gate.device)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias must have shape [{weight.shape[0]}], got {tuple(bias.shape)}")
    y = SwiGLULinearFunction.apply(rows_view(gate), rows_view(up), weight, bias, activation)
    return y.reshape(*gate.shape[:-1], weight.shape[0])


def swiglu_mlp(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    gate_bias: torch.Tensor | None = None,
    up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    *,
    activation: str = "silu",
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """A whole gated MLP, ``F.linear(act(F.linear(x, Wg, bg)) * F.linear(x, Wu, bu), Wd, bd)``, as one
    autograd node.

    The math and the GEMMs are eager PyTorch's (the same ``F.linear`` forward, ``mm`` backward); what
    changes is the host path and the memory: one node instead of the ~15 that three ``nn.Linear`` and
    the activation build (each costs host time per step: what bounds a small-batch step), the product
    ``act(gate) * up`` recomputed in backward instead of saved, and the backward's ``[N, I]`` buffers
    reused (dgate over dh, dup over up, the product over gate: three at the peak, not five). dX is
    ``dgate Wg + dup Wu`` accumulated in one GEMM epilogue (one rounding of the sum). Under autocast
    the operands are cast to the autocast dtype first, as ``nn.Linear`` does.

    The saved gate and up are overwritten by the backward: a second backward through the same graph
    (``retain_graph=True``) raises instead of returning wrong gradients.

    Args:
        x: ``[..., H]`` float32 / float16 / bfloat16 (float64 runs the PyTorch reference).
        gate_weight: ``[I, H]`` (``gate_proj.weight``), x's dtype and device.
        up_weight: ``[I, H]`` (``up_proj.weight``).
        down_weight: ``[H, I]`` (``down_proj.weight``).
        gate_bias, up_bias: optional ``[I]``; down_bias: optional ``[H]``.
        activation: ``"silu"`` (SwiGLU), ``"gelu_tanh"`` or ``"gelu"`` (GeGLU).
        chunk_rows: None, or run the MLP over chunks of this many rows (tokens) when x has more: no
            ``[N, I]`` tensor is ever held, only ``[chunk_rows, I]`` ones, and only x is saved for
            backward, which recomputes each chunk's gate and up projections (two more GEMMs, five
            instead of three forward ones) and sums the weights' gradients over the chunks in fp32
            (rounded once). For sequences so long that the MLP's ``[N, I]`` tensors decide what fits.

    Returns:
        ``[..., H]`` in x's dtype (the autocast dtype under autocast).

    Example:
        >>> import torch, torch.nn.functional as F
        >>> from fuselm.ops.swiglu import swiglu_mlp
        >>> x = torch.randn(2, 5, 16, requires_grad=True)
        >>> wg, wu, wd = torch.randn(32, 16), torch.randn(32, 16), torch.randn(16, 32, requires_grad=True)
        >>> y = swiglu_mlp(x, wg, wu, wd)
        >>> torch.allclose(y, F.linear(F.silu(x @ wg.T) * (x @ wu.T), wd), atol=1e-4)
        True
        >>> y.sum().backward(); wd.grad.shape
        torch.Size([16, 32])
    """
    check_choice("activation", activation, ACTIVATIONS)
    if has_dtensor(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias):
        raise ValueError(
            "swiglu_mlp does not take DTensors: run the projections as modules and swiglu / geglu on "
            "their outputs, or pass .to_local() of every input"
        )
    check_tensor("x", x, dtypes=_DTYPES, min_ndim=1)
    (x, *cast), _ = cast_for_autocast(
        x.device.type, x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias
    )
    weights = dict(zip(("gate_weight", "up_weight", "down_weight"), cast[:3], strict=True))
    biases = dict(zip(("gate_bias", "up_bias", "down_bias"), cast[3:], strict=True))
    hidden = x.shape[-1]
    for name, w in weights.items():
        check_tensor(name, w, dtypes=(x.dtype,), ndim=2, device=x.device)
    inter = weights["gate_weight"].shape[0]
    shapes = {"gate_weight": (inter, hidden), "up_weight": (inter, hidden), "down_weight": (hidden, inter)}
    for name, want in shapes.items():
        if tuple(weights[name].shape) != want:
            raise ValueError(
                f"{name} must have shape {list(want)} (x has H={hidden}, gate_weight I={inter}), "
                f"got {list(weights[name].shape)}"
            )
    for name, size in (("gate_bias", inter), ("up_bias", inter), ("down_bias", hidden)):
        if biases[name] is not None:
            check_tensor(name, biases[name], dtypes=(x.dtype,), ndim=1, device=x.device)
            if biases[name].shape[0] != size:
                raise ValueError(f"{name} must have shape [{size}], got {list(biases[name].shape)}")
    check_chunk_rows("chunk_rows", chunk_rows)
    x2 = rows_view(x)
    if chunk_rows is not None and x2.shape[0] > chunk_rows:
        y = ChunkedGatedMLPFunction.apply(x2, *weights.values(), *biases.values(), activation, chunk_rows)
    else:
        y = GatedMLPFunction.apply(x2, *weights.values(), *biases.values(), activation)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], hidden)
