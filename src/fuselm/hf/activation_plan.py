"""``checkpointing="auto"``: per decoder layer, what a training step keeps, recomputes or offloads, so that
the step's peak stays under a memory budget and it recomputes as little as the budget allows.

A decoder layer runs in one of three modes (:data:`MODES`):

- ``"keep"``: its activations stay on the device from forward to backward, but for its norms' outputs,
  which the backward makes again from the norms' inputs (:func:`fuselm.offload.selective_checkpoint`: an
  elementwise pass instead of 2 of a Llama layer's ~14 hidden-sized tensors); no GEMM is recomputed: the
  fastest, ``K`` bytes per token, measured;
- ``"recompute"``: gradient checkpointing (:func:`fuselm.offload.recompute_checkpoint`); only its input
  stays (``I = H x itemsize`` bytes per token), its forward runs again in the backward (without the MLP's
  down projection, whose output the recompute does not read: see :func:`fuselm.offload.output_may_go_unread`);
- ``"offload"``: checkpointing with the input in pinned host memory
  (:func:`fuselm.offload.offloaded_checkpoint`): nothing of it stays on the device (the newest call's
  input until the next one starts: in the backward, where the plan's peak is, it is back anyway); where
  the budget has room (below), its attention projections' outputs wait there too and its recompute skips
  their GEMMs.

The plan (:func:`plan_layers`) spends the budget on kept layers first (each saves a whole recompute), then on
recomputed ones (each saves a host round trip), and offloads the rest: ``peak ~ base + n_keep K T +
n_recompute I T + (K + R) T`` (the last term: one layer's activations, its norm outputs ``R`` included, while
a checkpointed layer's backward runs; none when every layer is kept), where ``base`` is what the device holds
when the first layer starts (weights, optimizer state, the embeddings' output) plus the gradients of the
trainable parameters not allocated yet and the adapters every layer keeps cast to the compute dtype until
its backward. Offloaded layers also keep their projections' outputs in host memory for their recomputes
(:func:`fuselm.offload.keep_output`: the recompute skips their GEMMs) where the budget holds
:data:`PREFETCH` layers' worth of them and of their inputs on the device (the layers before the one whose
backward runs, brought back early; what the first layer's forward offers, counted when ``K`` is) and that
plan recomputes less (:meth:`_Planner._keep_outputs`): in
the forward's order, at least q, k and v, and up to every projection's output and the attention's
(:mod:`fuselm.hf.attention`; o, gate and up too: three quarters of a Llama layer's recompute) where the host
link copies them in time: out during the forward,
back while the next layer's backward runs (:func:`kept_shares`, :data:`HOST_COPY_BYTES_PER_FLOP`). Where the
budget then still holds a layer's dense base weights (a quantized model's), the checkpointed layers' backward
reuses the ones their recompute dequantized (:func:`fuselm.lora.holding_dense`) instead of dequantizing again,
and what it holds beyond that (less :data:`RESIDENT_SPARE`) keeps whole layers' 4-bit base weights dense
across steps (:func:`fuselm.lora.keep_resident`, checkpointed layers first).
Offloaded inputs take pinned host memory: the plan offloads no more of them than :func:`host_room` holds (the
rest stay on the device, recomputed, with fewer layers kept to make room for them; over the budget only if
even no kept layer leaves room, said in a warning). The offloaded layers
are the first ones (their inputs come back last in the backward: the most time for the copies), the kept ones
the last.

``K`` is measured, not guessed: when a plan is made (the first training forward, and again whenever a
batch has more tokens than the plan was made for) the first decoder layer's forward runs once more on its
real inputs with the bytes it saves for backward counted (parameters excluded), under a forked RNG (the
dropout masks of the step stay the ones HF would draw). Every plan computes the same loss and gradients:
checkpointing recomputes exactly (the forward's RNG states are restored).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import math
import warnings
from typing import Any

import torch

from .. import offload as checkpoints
from ..lora import frozen
from . import offload

MODES = ("keep", "recompute", "offload")
_FUNCTIONS = {
    "keep": checkpoints.selective_checkpoint,
    "recompute": checkpoints.recompute_checkpoint,
    "offload": checkpoints.offloaded_checkpoint,
}
GIB = 1 << 30
DEFAULT_DEVICE_FRACTION = 0.9  # checkpointing="auto" without memory_budget: this much of the GPU's memory
# The share of the budget dense weights kept across steps leave unspent: the estimate leaves out the loss's
# and the dequantization's transient buffers (a kept 8B plan at 8192 tokens peaked 0.6 GiB over it).
RESIDENT_SPARE = 0.05
_PLANNER = "_fuselm_activation_planner"  # on the top PreTrainedModel: its _Planner
_log = logging.getLogger("fuselm.hf")


@dataclasses.dataclass(frozen=True)
class ActivationPlan:
    """The modes of the decoder layers (first to last) for batches of up to ``tokens`` tokens, with the
    figures they were chosen from (bytes)."""

    tokens: int
    modes: tuple[str, ...]
    budget: int
    base: int
    keep_bytes_per_token: int
    input_bytes_per_token: int
    remade_bytes_per_token: int = 0  # the norm outputs a kept layer makes again in its backward
    kept_output_bytes: int = 0  # reserved for the outputs offloaded layers keep for their recomputes
    kept_per_input: tuple[float, ...] = ()  # per layer: the offloaded call's kept_per_input (0: none kept)
    held_dense_bytes: int = 0  # a checkpointed layer's dense base weights, held from recompute to backward
    resident_layers: tuple[int, ...] = ()  # the layers whose 4-bit base weights stay dense across steps
    resident_bytes: int = 0  # their dense weights

    @property
    def estimated_peak(self) -> int:
        return (
            self.kept_output_bytes
            + self.held_dense_bytes
            + self.resident_bytes
            + _peak(
                self.modes,
                self.tokens,
                self.base,
                self.keep_bytes_per_token,
                self.input_bytes_per_token,
                self.remade_bytes_per_token,
            )
        )

    @property
    def host_bytes(self) -> int:
        """Pinned host memory the offloaded layers' inputs take."""
        return self.modes.count("offload") * self.input_bytes_per_token * self.tokens

    def __str__(self) -> str:
        counts = ", ".join(f"{self.modes.count(m)} {m}" for m in MODES if m in self.modes)
        host = f"; {_size(self.host_bytes)} of host memory" if self.host_bytes else ""
        if self.kept_output_bytes:
            shares = collections.Counter(s for s in self.kept_per_input if s)
            each = ", ".join(f"{n} at {s:.3g} inputs" for s, n in sorted(shares.items()))
            reserved = _size(self.kept_output_bytes)
            host += f"; offloaded layers keep their projections' outputs: {each} ({reserved} reserved)"
        if self.held_dense_bytes:
            held = _size(self.held_dense_bytes)
            host += f"; recomputes keep their dense base weights for the backward ({held})"
        if self.resident_layers:
            n, size = len(self.resident_layers), _size(self.resident_bytes)
            host += f"; {n} layers keep their 4-bit base weights dense across steps ({size})"
        return (
            f"{len(self.modes)} decoder layers at {self.tokens} tokens: {counts} (estimated peak "
            f"{_size(self.estimated_peak)} of {_size(self.budget)}; a kept layer "
            f"{_size(self.keep_bytes_per_token * self.tokens)}{host})"
        )


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"


def _peak(modes: tuple[str, ...], tokens: int, base: int, keep: int, inp: int, remade: int = 0) -> int:
    held = sum(keep if m == "keep" else inp if m == "recompute" else 0 for m in modes) * tokens
    transient = 0 if all(m == "keep" for m in modes) else (keep + remade) * tokens  # a recompute's
    return base + held + transient


def plan_layers(
    n_layers: int,
    tokens: int,
    budget: int,
    base: int,
    keep: int,
    inp: int,
    remade: int = 0,
    host: int | None = None,
) -> tuple[str, ...]:
    """The modes of ``n_layers`` decoder layers for ``tokens`` tokens under ``budget`` bytes, from ``base``
    bytes held anyway, ``keep`` bytes per token of a kept layer, ``inp`` of a layer's input and ``remade``
    of the outputs a kept layer makes again (a recomputed layer holds them too while its backward runs):
    as many kept layers as fit, then recomputed ones, the rest offloaded (all offloaded when even that
    is over). ``host``: the bytes of host memory the offloaded inputs may take (None: no limit); the
    inputs that do not fit there stay on the device (recomputed), kept layers giving way to them, over the
    budget only if they must.

    Example (a kept layer holds 200 bytes here, an input 20):
        >>> plan_layers(4, 10, budget=1000, base=200, keep=20, inp=2)
        ('keep', 'keep', 'keep', 'keep')
        >>> plan_layers(4, 10, budget=700, base=200, keep=20, inp=2)
        ('recompute', 'recompute', 'recompute', 'keep')
        >>> plan_layers(4, 10, budget=450, base=200, keep=20, inp=2)
        ('offload', 'offload', 'recompute', 'recompute')
        >>> plan_layers(4, 10, budget=450, base=200, keep=20, inp=2, host=25)  # one input fits the host
        ('offload', 'recompute', 'recompute', 'recompute')
        >>> plan_layers(6, 10, budget=820, base=200, keep=20, inp=2)
        ('offload', 'offload', 'offload', 'recompute', 'keep', 'keep')
        >>> plan_layers(6, 10, budget=820, base=200, keep=20, inp=2, host=25)  # a kept layer gives way
        ('recompute', 'recompute', 'recompute', 'recompute', 'recompute', 'keep')
    """
    if _peak(("keep",) * n_layers, tokens, base, keep, inp, remade) <= budget:
        return ("keep",) * n_layers
    keep_t, inp_t = max(keep * tokens, 1), max(inp * tokens, 1)
    room = budget - base - (keep + remade) * tokens  # one checkpointed layer's backward at a time
    hostable = n_layers if host is None else max(0, host) // inp_t  # inputs the host can take

    def staying(n_keep: int) -> int:  # the inputs that must stay on the device beside n_keep kept layers
        return max(0, n_layers - n_keep - hostable)

    n_keep = max(0, min(n_layers - 1, room // keep_t))
    while n_keep and n_keep * keep_t + staying(n_keep) * inp_t > room:
        n_keep -= 1
    n_recompute = max(staying(n_keep), min(n_layers - n_keep, (room - n_keep * keep_t) // inp_t))
    n_offload = n_layers - n_keep - n_recompute
    return ("offload",) * n_offload + ("recompute",) * n_recompute + ("keep",) * n_keep


# Bytes of pinned host copies one way per FLOP of the decoder layers' forward GEMMs that they overlap. An
# H100 host copies 55 GB/s while a Llama-3-8B layer's forward runs at ~600 TFLOP/s (9e-5); with each
# offloaded layer's backward bringing back the two before it (PREFETCH), a copy that runs late has a second
# layer's time, and the 8B bf16 LoRA step at 4 x 2048 under 24 GiB measured (H100, 10 steps) 588 ms at
# 8e-5, 568 ms at 1.2e-4 and 586 ms at 1.6e-4 (there the backward waited on the copies).
HOST_COPY_BYTES_PER_FLOP = 1.2e-4
# How many offloaded layers before it the backward of an offloaded layer that keeps outputs brings back
# (fuselm.offload.offloaded_checkpoint's prefetch): the budget reserves that many layers' inputs and kept
# outputs on the device.
PREFETCH = 2


def _recomputes(modes: tuple[str, ...], saved: tuple[float, ...] = ()) -> float:
    """The layer recomputes ``modes`` cost, in whole layers; ``saved``: per layer, the share of its
    recompute its kept outputs save."""
    saved = saved or (0.0,) * len(modes)
    return sum(0 if m == "keep" else 1 - s for m, s in zip(modes, saved, strict=True))


def kept_shares(
    modes: tuple[str, ...], inp: int, levels: dict[float, tuple[int, float]], unit: float, host: int
) -> tuple[float, ...]:
    """Per layer, the ``kept_per_input`` of an offloaded layer (0 for the others), from ``levels`` (share:
    (bytes a layer keeps at it, the share of its recompute that saves)). Each offloaded layer, last first,
    takes the largest share whose copies the host link makes in time, the smallest one otherwise: ``unit``
    is what it copies one way while a layer's forward GEMMs run, so a kept layer's backward has time for
    ``unit`` bytes, a recomputed one's for ``2 unit``, an offloaded one's ``(2 - saved) unit``. In the
    backward a layer's input and kept outputs (``inp`` + kept) come back while the layer after it runs its
    backward; in the forward all of them go out while the layers run (``n unit``); the host holds ``host``
    bytes of kept outputs.

    Example (inputs of 10 bytes; 15 kept at share 1.5, saving 10% of a recompute, 95 at 9.5, saving 70%):
        >>> levels = {1.5: (15, 0.1), 9.5: (95, 0.7)}
        >>> kept_shares(("offload",) * 4 + ("keep",), 10, levels, unit=100, host=10**6)
        (9.5, 9.5, 9.5, 1.5, 0.0)
    """
    shares = [0.0] * len(modes)
    off = [i for i, m in enumerate(modes) if m == "offload"]
    if not off or not levels:
        return tuple(shares)
    order = sorted(levels)
    low = order[0]

    def backward_time(k: int) -> float:  # in copied bytes
        if k >= len(modes) or modes[k] == "keep":
            return unit
        return unit * (2 - (levels[shares[k]][1] if modes[k] == "offload" else 0.0))

    copied, held = 0, 0
    for n_left, j in enumerate(reversed(off)):
        left = len(off) - n_left - 1  # offloaded layers still to choose (at least the smallest share each)
        shares[j] = low
        for share in reversed(order):
            kept, saved = levels[share]
            fits = (
                inp + kept <= backward_time(j + 1)
                and (j == 0 or modes[j - 1] != "offload" or inp + levels[low][0] <= unit * (2 - saved))
                and copied + inp + kept + left * (inp + levels[low][0]) <= unit * len(modes)
                and held + kept + left * levels[low][0] <= host
            )
            if fits:
                shares[j] = share
                break
        copied += inp + levels[shares[j]][0]
        held += levels[shares[j]][0]
    return tuple(shares)


def check_budget(memory_budget: object) -> float:
    """``memory_budget`` (GiB) as a float: a finite number > 0, else ValueError naming it."""
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float)):
        raise ValueError(f"memory_budget must be a number of GiB, got {type(memory_budget).__name__}")
    if not (math.isfinite(memory_budget) and memory_budget > 0):
        raise ValueError(f"memory_budget must be a finite number of GiB > 0, got {memory_budget!r}")
    return float(memory_budget)


# ---- measuring ----


def _saved_bytes(layer: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[int, int, Any]:
    """(bytes ``layer``'s forward keeps for backward when it is kept, bytes of the outputs it makes again
    then, the probe of what it offers to keep for its recompute when offloaded:
    :func:`fuselm.offload.count_kept_outputs`) on these inputs: its parameters and buffers excluded, each
    storage counted once, the hidden states taken as a tensor that needs grad (a middle layer's), under
    :func:`selective_checkpoint`'s saving."""
    own = {t.untyped_storage().data_ptr() for t in (*layer.parameters(), *layer.buffers())}
    seen: dict[int, int] = {}
    remade: dict[int, int] = {}

    def count(packed):
        if isinstance(packed, tuple):
            storage = packed[0].untyped_storage()
            if storage.data_ptr() not in own:
                seen[storage.data_ptr()] = storage.nbytes()
        else:  # a recipe: made again in the backward
            remade[id(packed.recipe)] = packed.recipe.nbytes
        return packed

    hidden = args[0].detach().requires_grad_(True)
    checkpointing = layer.gradient_checkpointing
    devices = [args[0].device] if args[0].is_cuda else []
    try:
        layer.gradient_checkpointing = False
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            with checkpoints._selective_scope(then=count):
                with checkpoints.count_kept_outputs(hidden.numel() * hidden.element_size()) as probe:
                    out = layer.forward(hidden, *args[1:], **kwargs)
        del out
    finally:
        layer.gradient_checkpointing = checkpointing
    return sum(seen.values()), sum(remade.values()), probe


def _forward_flops(layer: torch.nn.Module, tokens: int) -> int:
    """2 x the multiply-adds of ``layer``'s linear layers (quantized ones included) for ``tokens`` tokens."""
    macs = sum(m.in_features * m.out_features for m in layer.modules() if isinstance(m, torch.nn.Linear))
    return 2 * macs * tokens


def _quantized_linears(layer: torch.nn.Module, kinds: tuple[str, ...]) -> list[torch.nn.Linear]:
    """``layer``'s linear layers whose weights are of the bitsandbytes parameter types named ``kinds``."""
    return [m for m in layer.modules() if isinstance(m, torch.nn.Linear) and type(m.weight).__name__ in kinds]


QUANTIZED = ("Params4bit", "Int8Params")  # what fuselm.lora.holding_dense holds dense
RESIDENT = ("Params4bit",)  # what fuselm.lora.keep_resident may keep dense


def _dense_bytes(layer: torch.nn.Module, dtype: torch.dtype, kinds: tuple[str, ...] = QUANTIZED) -> int:
    """Bytes of ``layer``'s quantized linear weights (of ``kinds``) made dense in ``dtype``: by default what
    :func:`fuselm.lora.holding_dense` holds through a checkpointed layer's backward."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(m.in_features * m.out_features * size for m in _quantized_linears(layer, kinds))


def _cast_bytes(layer: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes a layer holds from its forward to its backward in any mode besides activations: its trainable
    parameters of another dtype cast to the compute dtype (fp32 LoRA adapters in bf16: kept for the
    backward, and, checkpointed, for the recompute too: :func:`fuselm.offload.call_memo`)."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(
        p.numel() * size
        for p in layer.parameters()
        if p.requires_grad and p.is_floating_point() and p.dtype != dtype
    )


HOST_FRACTION = 0.9  # of the host's available memory, what offloaded layer inputs may take


def host_room() -> int | None:
    """The host memory a plan may give offloaded layer inputs: :data:`HOST_FRACTION` of what the host has
    available (:func:`fuselm.offload.host_available`) plus the buffers fuselm's pool holds already
    (reused); None where the host does not say."""
    available = checkpoints.host_available()
    if available is None:
        return None
    pool = checkpoints.host_memory_stats()
    return int(HOST_FRACTION * available) + pool["pinned_bytes"] + pool["pageable_bytes"]


def _allocated(model: torch.nn.Module) -> int:
    """The bytes of the model's own tensors (each storage once): what the CPU holds for it."""
    tensors = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.parameters()}
    tensors.update({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.buffers()})
    return sum(tensors.values())


def _pending_grads(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad and p.grad is None)


def _tokens(args: tuple, kwargs: dict) -> int | None:
    ids = kwargs.get("input_ids", args[0] if args else None)
    if torch.is_tensor(ids):
        return ids.numel()
    embeds = kwargs.get("inputs_embeds")
    return embeds.shape[:-1].numel() if torch.is_tensor(embeds) else None


# ---- the planner on a model ----


class _Planner:
    """A model's budget, its plan, and the hooks that make and apply it."""

    def __init__(self, top: torch.nn.Module, budget: int | None, every_layer: str | None = None):
        self.top, self.budget, self.plan = top, budget, None
        self.every_layer = every_layer  # a mode of MODES for every layer instead of a plan
        self.layers = offload._layers(top)
        self.pending: tuple[int, int, int] | None = None  # tokens, the model's bytes, gradients to come
        self.handles = [
            top.register_forward_pre_hook(self.before_model, with_kwargs=True),
            self.layers[0].register_forward_pre_hook(self.before_first_layer, with_kwargs=True),
        ]

    def before_model(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        if self.every_layer is not None:
            self.apply(ActivationPlan(0, (self.every_layer,) * len(self.layers), 0, 0, 0, 0))
            return
        tokens = _tokens(args, kwargs)
        if tokens is not None and (self.plan is None or tokens > self.plan.tokens):
            # measured and planned when the first layer sees its inputs; the model's tensors counted now,
            # before its forward (the fused loss lends the lm_head out during it), without the dense
            # weights the last plan kept
            self._keep_resident(())
            own = _allocated(module)
            self.pending = (tokens, own, _pending_grads(module))
        elif self.plan is not None:
            self.apply(self.plan)  # again: HF's switches set all layers alike

    def before_first_layer(self, layer: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self.pending is None:
            return
        (tokens, own, grads), self.pending = self.pending, None
        hidden = args[0]
        device = hidden.device
        budget = self.budget
        if budget is None:
            budget = (
                int(DEFAULT_DEVICE_FRACTION * torch.cuda.mem_get_info(device)[1])
                if device.type == "cuda"
                else 1 << 62  # no device memory to spend on the CPU: every layer is kept
            )
        kept, remade, probe = _saved_bytes(layer, args, kwargs)
        kept, remade = math.ceil(kept / tokens), math.ceil(remade / tokens)
        inp = hidden.shape[-1] * hidden.element_size()
        base = (torch.cuda.memory_allocated(device) if device.type == "cuda" else own) + grads
        base += len(self.layers) * _cast_bytes(layer, hidden.dtype)
        figures = (len(self.layers), tokens, budget, base, kept, inp, remade)
        host = host_room()
        modes = plan_layers(*figures, host)
        self.plan = ActivationPlan(tokens, modes, budget, base, kept, inp, remade)
        if host is not None:
            self._keep_outputs(figures, host, probe, _forward_flops(layer, tokens), hidden.shape[-1])
        held = _dense_bytes(layer, hidden.dtype)  # recomputes dequantize once where the budget holds it
        if held and set(self.plan.modes) - {"keep"} and self.plan.estimated_peak + held <= budget:
            self.plan = dataclasses.replace(self.plan, held_dense_bytes=held)
        self._plan_resident(budget, hidden.dtype)
        room = self.plan.kept_output_bytes and max(0, host - self.plan.host_bytes)
        checkpoints.set_kept_output_room(room)
        modes = self.plan.modes
        unlimited = plan_layers(*figures[:2], budget - self.plan.kept_output_bytes, *figures[3:])
        stay = unlimited.count("offload") - modes.count("offload")  # no room on the host
        if stay:
            warnings.warn(
                f"fuselm.hf: the host has room for {modes.count('offload')} offloaded layer input(s) "
                f"({_size(host)} of its available memory), so {stay} more stay on the device: {self.plan}; "
                "a shorter sequence or a model on more GPUs needs less",
                stacklevel=2,
            )
        elif self.plan.estimated_peak > budget:
            _log.warning("fuselm.hf: %s: over memory_budget even with every layer offloaded", self.plan)
        else:
            _log.info("fuselm.hf: activation plan: %s", self.plan)
        self.apply(self.plan)

    def _keep_outputs(self, figures: tuple, host: int, probe: Any, flops: int, width: int) -> None:
        """Offloaded layers keep their projections' outputs in host memory for their recomputes
        (:func:`fuselm.offload.keep_output`) where the plan then recomputes less: the outputs the first
        layer's forward offers, in its order, from q, k and v (:data:`fuselm.offload.KEPT_PER_INPUT`) up to
        all of them, as many in each offloaded layer as the host link copies in time (:func:`kept_shares`,
        :data:`HOST_COPY_BYTES_PER_FLOP`); the budget reserves :data:`PREFETCH` layers' inputs and kept
        outputs on the device (the layers before the one whose backward runs, brought back early)."""
        n_layers, tokens, budget, base, kept, inp, remade = figures
        inp_bytes = inp * tokens
        # the shares that keep a prefix of the offered outputs; the share of a layer's recompute each saves:
        # the kept outputs' GEMM multiply-adds (projections of the hidden states: width inputs an element;
        # the attention's output, 2 T an element for T tokens of causal attention, counted alike: at T ~
        # width, as the 2048-token steps planned for)
        prefixes = itertools.accumulate(probe.offered)
        shares = sorted({checkpoints.KEPT_PER_INPUT, *(n / inp_bytes for n in prefixes)})
        kept_at = {s: probe.kept(s) for s in shares if s >= checkpoints.KEPT_PER_INPUT}
        levels = {s: (n, 2 * n * width * width / (inp * flops)) for s, n in kept_at.items() if n}
        unit = HOST_COPY_BYTES_PER_FLOP * flops
        best = self.plan, _recomputes(self.plan.modes)
        for top in levels:  # the largest share any layer may take, whose kept outputs the budget reserves
            extra = PREFETCH * (levels[top][0] + inp_bytes)
            modes = plan_layers(n_layers, tokens, budget - extra, base, kept, inp, remade, host)
            room = host - modes.count("offload") * inp_bytes
            upto = {s: v for s, v in levels.items() if s <= top}
            shares = kept_shares(modes, inp_bytes, upto, unit, room)
            if top not in shares:  # reserved for, not kept: a smaller share's plan, with less room
                continue
            plan = ActivationPlan(tokens, modes, budget, base, kept, inp, remade, extra, shares)
            cost = _recomputes(modes, tuple(upto[s][1] if s else 0.0 for s in shares))
            if plan.estimated_peak <= budget and cost < best[1]:
                best = plan, cost
        self.plan = best[0]

    def _plan_resident(self, budget: int, dtype: torch.dtype) -> None:
        """Spend what the budget still holds (but :data:`RESIDENT_SPARE` of it) on 4-bit base weights kept
        dense across steps (each layer's saves its dequantizations: two a step where it is kept, three
        where it is checkpointed, which go first), and keep them (:func:`fuselm.lora.keep_resident`)."""
        each = [_dense_bytes(layer, dtype, RESIDENT) for layer in self.layers]
        order = sorted(range(len(self.layers)), key=lambda i: self.plan.modes[i] == "keep")
        room, chosen = int((1 - RESIDENT_SPARE) * budget) - self.plan.estimated_peak, []
        for i in order:
            if 0 < each[i] <= room:
                chosen.append(i)
                room -= each[i]
        if chosen:
            total = sum(each[i] for i in chosen)
            self.plan = dataclasses.replace(
                self.plan, resident_layers=tuple(sorted(chosen)), resident_bytes=total
            )
        self._keep_resident(self.plan.resident_layers)

    def _keep_resident(self, layers: tuple[int, ...]) -> None:
        for i, layer in enumerate(self.layers):
            for m in _quantized_linears(layer, RESIDENT):
                frozen.keep_resident(m.weight, i in layers)

    def apply(self, plan: ActivationPlan) -> None:
        """Set each layer's checkpointing function to its mode's, with the offloaded layers'
        ``kept_per_input`` (none: the default, within the kept-output room) and the recomputes holding
        their dense base weights for the backward where the plan does."""
        shares = plan.kept_per_input
        for i, (layer, mode) in enumerate(zip(self.layers, plan.modes, strict=True)):
            layer.gradient_checkpointing = True  # a kept layer's function: the selective one
            want = _FUNCTIONS[mode]
            kept = mode == "offload" and shares
            options = {"kept_per_input": shares[i], "prefetch": PREFETCH} if kept else {}
            if plan.held_dense_bytes and mode != "keep":
                options["backward_context"] = frozen.holding_dense
            func, keywords = offload._unpartial(layer.__dict__.get("_gradient_checkpointing_func"))
            if func is not want or any(keywords.get(k) != v for k, v in options.items()):
                hf_func = layer.__dict__.get(offload._HF_FUNC)
                function = functools.partial(want, **options)
                layer._gradient_checkpointing_func = offload._fuselm_checkpointing(hf_func, layer, function)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self._keep_resident(())


def enable(
    model: torch.nn.Module, memory_budget: float | None = None, every_layer: str | None = None
) -> torch.nn.Module:
    """``checkpointing="auto"`` on ``model`` (:func:`fuselm.hf.patch` calls it): offloading installed
    (:func:`fuselm.hf.offload.enable`), then the layers' modes planned at the first training forward and
    whenever a batch has more tokens. ``memory_budget``: GiB for the step's peak; None: 90% of the GPU's
    memory (every layer kept on the CPU). ``every_layer``: a mode of :data:`MODES` that every layer runs in
    instead of a plan (``checkpointing="recompute"``: ``"recompute"``), set again at each training forward."""
    budget = None if memory_budget is None else int(check_budget(memory_budget) * GIB)
    if every_layer is not None and (every_layer not in MODES or memory_budget is not None):
        raise ValueError(f"every_layer must be one of {MODES} (without a memory_budget), got {every_layer!r}")
    disable(model)
    offload.enable(model)
    top = offload._pretrained(model)[0]
    top.__dict__[_PLANNER] = _Planner(top, budget, every_layer)
    return model


def disable(model: torch.nn.Module) -> None:
    """Take the planner out of ``model`` (the layers stay as the last plan set them until offloading or
    HF's checkpointing is switched)."""
    for m in model.modules():
        planner = m.__dict__.pop(_PLANNER, None)
        if planner is not None:
            planner.remove()


def checkpoints_capturably(model: torch.nn.Module) -> bool:
    """Whether ``model`` checkpoints its decoder layers as a CUDA graph captures them exactly: every layer
    recomputed (``checkpointing="recompute"``: :func:`fuselm.offload.recompute_checkpoint`) or offloaded
    (``checkpointing="offload"``: :func:`fuselm.offload.offloaded_checkpoint`), not by a plan
    (``"auto"``, whose kept layers and re-planning a capture is not checked for)."""
    planners = [m.__dict__[_PLANNER] for m in model.modules() if _PLANNER in m.__dict__]
    if planners:
        return all(p.every_layer == "recompute" for p in planners)
    return offload.is_enabled(model)


def current(model: torch.nn.Module) -> ActivationPlan | None:
    """The activation plan of ``model`` (None: no ``checkpointing="auto"``, or no training forward yet)."""
    for m in model.modules():
        planner = m.__dict__.get(_PLANNER)
        if planner is not None:
            return planner.plan
    return None
