"""The frozen base weight of a LoRA layer, as the fused functions see it.

A base weight is either a dense ``torch.Tensor`` ``[out, in]`` or a :class:`FrozenWeight`, an object
that makes the dense ``[out, in]`` matrix on demand:

- :class:`Bnb4bitWeight`: a bitsandbytes ``Params4bit`` (NF4 or FP4, with or without double
  quantization), dequantized by ``bitsandbytes.functional.dequantize_4bit`` itself;
- :class:`Bnb8bitWeight`: the int8 rows ``CB`` and fp32 row scales ``SCB`` of a bitsandbytes
  ``Linear8bitLt`` (LLM.int8()), dequantized as ``bitsandbytes.functional.int8_vectorwise_dequant``.

Dequantized weights are written into ONE scratch buffer per (device, dtype), shared by every layer
and grown to the largest weight asked for: a model never holds a persistent 16-bit copy of its
quantized layers. The tensor :func:`dense` returns for a quantized weight is therefore valid only
until the next dequantization on the same (device, dtype): use it at once, never save it for
backward (backward dequantizes again). On CUDA the reuse is safe without synchronization because
every dequantization and every GEMM reading its result run in order on the current stream. Inside
:func:`holding_dense` (a checkpointed layer's recompute and backward, where a memory budget has room) each
weight is made once, in a tensor of its own, and every later :func:`dense` of it in the scope returns that
tensor: the backward does not dequantize again what the recompute just did. A 4-bit weight made
:func:`keep_resident` keeps its dense matrix across steps (where a memory budget has room for it).

A 4-bit weight dequantizes in one launch of :func:`fuselm.ops.dequantize_4bit.dequantize_4bit` (bit-equal
to bitsandbytes' ``dequantize_4bit``; a double-quantized weight's block scales are made inside that launch,
where bitsandbytes takes three) on CUDA, else through bitsandbytes.

bitsandbytes is imported lazily, in this module only, when a quantized weight is dequantized by it.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from ..ops.dequantize_4bit import dequantize_4bit

# bitsandbytes' int8 dequantization constant (1/127 rounded as it writes it): CB * SCB * this.
INT8_INV_SCALE = 7.874015718698502e-3
# Elements of the fp32 row-chunk temporary of an 8-bit dequantization into a 16-bit buffer.
INT8_CHUNK_ELEMENTS = 1 << 23

_SCRATCH: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
# Device types whose bitsandbytes backend has no ``dequantize_4bit.out`` kernel (CPU in 0.50): there
# ``dequantize_4bit`` returns a fresh tensor per call instead (still no persistent copy).
_NO_OUT_KERNEL: set[str] = set()


class _Holding(threading.local):
    def __init__(self) -> None:
        self.weights: dict | None = None  # inside holding_dense: (weight's identity, dtype) -> its dense


_HOLDING = _Holding()


@contextlib.contextmanager
def holding_dense():
    """Inside this scope :func:`dense` makes each quantized weight's dense matrix once, in a tensor of its
    own (not the shared scratch), and returns that tensor to every later call for the same weight and
    dtype until the scope ends (nested scopes share the outermost one's). A checkpointed layer's recompute
    and backward in one scope dequantize its weights once instead of twice, for the memory of the layer's
    dense weights while its backward runs.

    Example:
        >>> w = Bnb8bitWeight(torch.ones(2, 3, dtype=torch.int8), torch.full((2,), 127.0))
        >>> with holding_dense():
        ...     dense(w) is dense(w)
        True
        >>> dense(w).data_ptr() == scratch(6, "cpu", torch.float32).data_ptr()   # outside: the scratch
        True
    """
    outer = _HOLDING.weights
    if outer is None:
        _HOLDING.weights = {}
    try:
        yield
    finally:
        _HOLDING.weights = outer


_RESIDENT = "_fuselm_resident_dense"  # on a quantized parameter: {(dtype, data address): its dense matrix}


def keep_resident(param: torch.Tensor, keep: bool = True) -> None:
    """Keep (``keep=False``: stop keeping) the dense matrix of a bitsandbytes 4-bit weight (its
    ``Params4bit``) on its device once :func:`dense` has made it: later calls return that tensor instead of
    dequantizing again, for every step until this is undone (or the parameter is gone, or its data is
    replaced). The matrix is the one dequantization makes, so results are bit for bit the same; it costs the
    weight's dense size for as long as it is kept. A planner that has memory to spare spends it here
    (:mod:`fuselm.hf.activation_plan`).

    Example:
        >>> import bitsandbytes as bnb
        >>> layer = bnb.nn.Linear4bit(64, 32, bias=False, quant_type="nf4").to("cpu")  # quantizes
        >>> keep_resident(layer.weight)
        >>> w = Bnb4bitWeight(layer.weight)
        >>> dense(w) is dense(w)
        True
        >>> keep_resident(layer.weight, False)
        >>> dense(w) is dense(w)
        False
    """
    if keep:
        param.__dict__.setdefault(_RESIDENT, {})
    else:
        param.__dict__.pop(_RESIDENT, None)


_OWN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what fuselm's 4-bit kernel writes
_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}  # the 16 values of each 4-bit code, per device
_OFFSET = "_fuselm_offset"  # on a QuantState: its offset as the fp32 device tensor the kernel reads


def _operands(qs, device: torch.device) -> tuple[torch.Tensor, dict]:
    """(the code values [16] fp32, the double quantization's keyword operands) of a 4-bit ``QuantState``."""
    table = _TABLES.get((qs.quant_type, device))
    if table is None:
        import bitsandbytes.functional as bnbf

        table = bnbf.get_4bit_type(qs.quant_type, device=device).float().contiguous()
        _TABLES[(qs.quant_type, device)] = table
    if not qs.nested:
        return table, {}
    offset = qs.__dict__.get(_OFFSET)  # made once per offset tensor (a load may give a CPU one)
    if offset is None or offset[0] is not qs.offset:
        offset = (qs.offset, torch.as_tensor(qs.offset, dtype=torch.float32).reshape(1).to(device))
        qs.__dict__[_OFFSET] = offset
    state2 = qs.state2
    return table, {
        "absmax_code": state2.code,
        "absmax_scale": state2.absmax,
        "absmax_blocksize": state2.blocksize,
        "absmax_offset": offset[1],
    }


def scratch(numel: int, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """A flat ``[numel]`` view of the shared scratch buffer of ``(device, dtype)``, grown when too small.

    Its content is undefined and is overwritten by the next user of the same (device, dtype).

    Example:
        >>> a = scratch(6, "cpu", torch.float32)
        >>> b = scratch(4, "cpu", torch.float32)
        >>> a.data_ptr() == b.data_ptr()
        True
    """
    device = torch.device(device)
    if device.index is None and device.type == "cuda":  # "cuda" and "cuda:0" are one buffer
        device = torch.device("cuda", torch.cuda.current_device())
    if _HOLDING.weights is not None:  # a dense weight held for the scope: a tensor of its own
        return torch.empty(numel, dtype=dtype, device=device)
    key = (device, dtype)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        _SCRATCH.pop(key, None)  # free the old one first: peak memory = the new buffer only
        buf = torch.empty(numel, dtype=dtype, device=device)
        _SCRATCH[key] = buf
    return buf[:numel]


def release_scratch() -> None:
    """Drop every scratch buffer (the next dequantization allocates again).

    Example:
        >>> release_scratch(); scratch_bytes()
        0
    """
    _SCRATCH.clear()


def scratch_bytes() -> int:
    """Bytes held by the scratch buffers, all devices and dtypes together.

    Example:
        >>> release_scratch(); _ = scratch(8, "cpu", torch.float64); scratch_bytes()
        64
    """
    return sum(t.numel() * t.element_size() for t in _SCRATCH.values())


class FrozenWeight:
    """A frozen ``[out, in]`` base weight stored in another form than a dense tensor.

    Subclasses set ``shape`` (``torch.Size([out, in])``), ``device`` and ``dtype`` (the dtype
    :meth:`dense` returns by default) and implement :meth:`dense`. ``requires_grad`` is always False:
    the fused functions never produce a gradient for the base weight.
    """

    shape: torch.Size
    device: torch.device
    dtype: torch.dtype
    requires_grad = False

    def dense(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense ``[out, in]`` weight in ``dtype`` (default ``self.dtype``); see the module docstring
        for how long it stays valid."""
        raise NotImplementedError

    def identity(self) -> int:
        """What tells this weight from another while both live (:func:`holding_dense` keys on it): the
        address of the stored data (two objects over the same parameter are one weight)."""
        raise NotImplementedError

    def resident(self) -> dict | None:
        """The cache of this weight's dense matrix where :func:`keep_resident` keeps it, else None."""
        return None

    def __repr__(self) -> str:
        shape = "x".join(str(s) for s in self.shape)
        return f"{type(self).__name__}({shape}, {self.dtype}, {self.device})"


class Bnb4bitWeight(FrozenWeight):
    """A bitsandbytes 4-bit weight (``bitsandbytes.nn.Params4bit``: NF4 or FP4, double quantization on
    or off), dequantized on demand into the shared scratch buffer of ``(device, quant_state.dtype)``:
    by :func:`fuselm.ops.dequantize_4bit.dequantize_4bit` (one launch) on CUDA, else by
    ``bitsandbytes.functional.dequantize_4bit(param.data, quant_state, out=...)``; the two are bit-equal
    (bitsandbytes' CPU kernel reads a row that is not a whole number of blocks as if blocks restarted at
    each row, unlike its quantization: on the CPU fuselm keeps bitsandbytes' result).

    ``quant_state`` defaults to ``param.quant_state`` read at each :meth:`dense` call. The dense
    weight has bitsandbytes' dtype ``quant_state.dtype`` (what the layer was quantized from); asking
    :meth:`dense` for another dtype casts that result (one temporary ``[out, in]`` tensor).
    On a bitsandbytes backend without an ``out=`` kernel (its CPU backend), bitsandbytes allocates the
    result itself: a fresh tensor per call, freed after use.

    Args:
        param: the ``Params4bit`` (``layer.weight`` of a ``bitsandbytes.nn.Linear4bit``).
        quant_state: its ``QuantState`` when it is not ``param.quant_state`` (bitsandbytes keeps a copy
            on the layer, ``layer.quant_state``, for weights loaded before quantization metadata).

    Example:
        >>> import bitsandbytes as bnb
        >>> layer = bnb.nn.Linear4bit(64, 32, bias=False, quant_type="nf4").to("cpu")  # quantizes
        >>> ref = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
        >>> torch.equal(Bnb4bitWeight(layer.weight).dense(), ref)
        True
    """

    def __init__(self, param: torch.Tensor, quant_state: object | None = None):
        qs = quant_state if quant_state is not None else getattr(param, "quant_state", None)
        if qs is None:
            raise ValueError("param must be a bitsandbytes Params4bit with a quant_state (quantized)")
        shape = tuple(getattr(qs, "shape", ()))
        if len(shape) != 2:
            raise ValueError(f"param's quant_state must describe a 2-D [out, in] weight, got shape {shape}")
        self.param = param
        self._quant_state = quant_state
        self.shape = torch.Size(shape)
        self.dtype = qs.dtype
        self.device = param.device

    @property
    def quant_state(self):
        return self._quant_state if self._quant_state is not None else self.param.quant_state

    def identity(self) -> int:
        return self.param.data_ptr()

    def resident(self) -> dict | None:
        return self.param.__dict__.get(_RESIDENT)

    def dense(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        qs = self.quant_state
        data = self.param.data
        w = None
        if data.is_cuda and qs.dtype in _OWN_DTYPES and qs.quant_type in ("nf4", "fp4"):
            buf = scratch(self.shape.numel(), data.device, qs.dtype).view(self.shape)
            table, nested = _operands(qs, data.device)
            w = dequantize_4bit(data, qs.absmax, table, qs.blocksize, self.shape, qs.dtype, **nested, out=buf)
        else:
            import bitsandbytes.functional as bnbf

            if data.device.type not in _NO_OUT_KERNEL:
                buf = scratch(self.shape.numel(), data.device, qs.dtype).view(self.shape)
                try:
                    w = bnbf.dequantize_4bit(data, qs, out=buf)
                except NotImplementedError:  # no out= kernel on this backend: remember, and allocate
                    _NO_OUT_KERNEL.add(data.device.type)
            if w is None:
                w = bnbf.dequantize_4bit(data, qs)
        if dtype is not None and w.dtype != dtype:
            w = w.to(dtype)
        return w


class Bnb8bitWeight(FrozenWeight):
    """A bitsandbytes LLM.int8() weight: int8 rows ``CB`` ``[out, in]`` and fp32 row scales ``SCB``
    ``[out]``, dequantized on demand into the shared scratch buffer of ``(device, dtype)``.

    The dense weight is, element for element, bitsandbytes' own dequantization
    ``bitsandbytes.functional.int8_vectorwise_dequant(CB, SCB)`` (``CB * SCB[:, None] * (1/127)``,
    computed in fp32: two roundings, in that order; PEFT's ``dequantize_bnb_weight`` uses the same
    function to merge adapters into 8-bit layers) rounded once to the requested dtype, i.e. bit-equal
    to ``int8_vectorwise_dequant(CB, SCB).to(dtype)``. (bitsandbytes' CPU training matmul,
    ``MatMul8bitFp``, associates the product the other way, ``CB * (SCB / 127)``, which can differ in
    the last bit; its CUDA matmul quantizes the activations to int8 too. Both are dequantize-then-GEMM
    approximations of the same weight; fuselm computes the GEMM on the dequantized weight.)
    A 16-bit dense weight is made in row chunks through an fp32 temporary of at most
    ``INT8_CHUNK_ELEMENTS`` elements.

    Args:
        CB: int8 ``[out, in]`` (``layer.weight.data`` of a quantized ``bitsandbytes.nn.Linear8bitLt``).
        SCB: float ``[out]`` row scales (``layer.weight.SCB``, or ``layer.state.SCB`` after the first
            forward, which moves them there).

    Example:
        >>> CB = torch.randint(-127, 128, (4, 6), dtype=torch.int8)
        >>> SCB = torch.rand(4) * 3
        >>> w = Bnb8bitWeight(CB, SCB).dense(torch.bfloat16)
        >>> torch.equal(w, (CB * SCB.view(-1, 1) * 7.874015718698502e-3).to(torch.bfloat16))
        True
    """

    def __init__(self, CB: torch.Tensor, SCB: torch.Tensor):
        if not isinstance(CB, torch.Tensor) or CB.dtype != torch.int8 or CB.dim() != 2:
            got = f"{CB.dtype} {tuple(CB.shape)}" if isinstance(CB, torch.Tensor) else type(CB).__name__
            raise ValueError(f"CB must be a 2-D int8 tensor [out, in], got {got}")
        if not isinstance(SCB, torch.Tensor) or not SCB.dtype.is_floating_point:
            raise ValueError(f"SCB must be a floating tensor [{CB.shape[0]}], got {SCB!r:.60}")
        if tuple(SCB.shape) != (CB.shape[0],):
            raise ValueError(f"SCB must have shape [{CB.shape[0]}] (CB's rows), got {tuple(SCB.shape)}")
        if SCB.device != CB.device:
            raise ValueError(f"SCB must be on CB's device {CB.device}, got {SCB.device}")
        self.CB, self.SCB = CB, SCB
        self.shape = CB.shape
        self.device = CB.device
        self.dtype = torch.promote_types(CB.dtype, SCB.dtype)  # bitsandbytes' result dtype (fp32)

    def identity(self) -> int:
        return self.CB.data_ptr()

    def dense(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.dtype
        out, inp = self.shape
        buf = scratch(out * inp, self.device, dtype).view(out, inp)
        scale = self.SCB.view(-1, 1)
        if dtype == self.dtype:
            torch.mul(self.CB, scale, out=buf)
            return buf.mul_(INT8_INV_SCALE)
        rows = max(1, INT8_CHUNK_ELEMENTS // max(inp, 1))
        tmp = torch.empty((min(rows, out), inp), dtype=self.dtype, device=self.device)
        for r0 in range(0, out, rows):
            r1 = min(out, r0 + rows)
            part = tmp[: r1 - r0]
            torch.mul(self.CB[r0:r1], scale[r0:r1], out=part)
            part.mul_(INT8_INV_SCALE)
            buf[r0:r1].copy_(part)
        return buf


def dense(weight: torch.Tensor | FrozenWeight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The dense ``[out, in]`` matrix of a base weight, in ``dtype`` (default: the weight's own).

    A tensor is returned as it is (cast when ``dtype`` differs); a :class:`FrozenWeight` is dequantized
    (into the shared scratch buffer: valid until the next dequantization on that device and dtype).

    Example:
        >>> w = torch.randn(3, 5)
        >>> dense(w) is w
        True
        >>> dense(Bnb8bitWeight(torch.ones(2, 3, dtype=torch.int8), torch.full((2,), 127.0)))
        tensor([[1., 1., 1.],
                [1., 1., 1.]])
    """
    if isinstance(weight, torch.Tensor):
        return weight if dtype is None or weight.dtype == dtype else weight.to(dtype)
    resident = weight.resident()
    if resident is not None:
        key = (dtype, weight.identity())
        if key not in resident:  # one dense matrix per weight: another dtype or new data replaces it
            resident.clear()
            resident[key] = weight.dense(dtype).clone()
        return resident[key]
    held = _HOLDING.weights
    if held is None:
        return weight.dense(dtype)
    key = (type(weight), weight.identity(), dtype)
    if key not in held:
        held[key] = weight.dense(dtype)
    return held[key]
