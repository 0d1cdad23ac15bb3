"""Hugging Face's ``Trainer`` (and TRL's trainers, its subclasses) with each training step's forward and
backward replayed from CUDA graphs: one call, :func:`capture_training_steps`.

At a few thousand tokens a step the GPU waits for Python (docs/host-time.md). The switch installs a
``training_step`` on the trainer instance that runs Trainer's own (so its loss scaling, gradient accumulation,
``num_items_in_batch``, logging and whatever a subclass adds stay as they are) with one difference: while it
runs, the model's training forward goes through a :class:`fuselm.graph_step.GraphCache`. The forward of
each batch shape is captured once and then replayed; autograd replays the captured backward with the
gradients Trainer's loss arithmetic gives it, and the backward adds the parameters' gradients into their
``.grad``. The optimizer, gradient clipping, the scheduler and the loss arithmetic stay eager, outside the
graphs. Imports neither transformers nor TRL.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from .. import graph_step
from ..graph_step import GraphCache, check_count
from ..trl.patching import every_position

__all__ = ["capture_training_steps", "CapturedTrainingSteps"]

# Why an attention implementation cannot be captured (a host synchronization in its forward); SDPA can.
_ATTENTION = {
    "eager": "Hugging Face's eager attention makes its mask from a host value",
    "flash_attention_2": "flash attention unpads the batch after reading its lengths on the host (.item())",
    "flash_attention_3": "flash attention unpads the batch after reading its lengths on the host (.item())",
    "flex_attention": "flex attention compiles its block mask on the host",
}


class CapturedTrainingSteps:
    """What :func:`capture_training_steps` installs as ``trainer.training_step``: Trainer's own step with the
    model's training forward routed through CUDA graphs (:attr:`graphs`: the graphs and their counters,
    ``replays``, ``eager`` and ``signatures``)."""

    def __init__(self, original, *, max_graphs: int, warmup: int) -> None:
        self.original = original  # the training_step the trainer had (its class's, or a wrapper)
        self.graphs = GraphCache(
            max_graphs=max_graphs,
            warmup=warmup,
            owner="fuselm capture_training_steps",
            capture_context=every_position,  # TRL's fused LM head without its host sync; else a no-op
        )
        self._checked = weakref.WeakSet()  # the models checked at their first step

    def __call__(self, model, inputs, *args, **kwargs):
        if model not in self._checked:
            check_model(model)
            self._checked.add(model)
        with self._routed(model):
            return self.original(model, inputs, *args, **kwargs)

    @contextlib.contextmanager
    def _routed(self, model):
        """``model.forward`` through the graphs while Trainer's step runs (an instance attribute, taken out
        again after: evaluation, generation and saving see the model as it was)."""
        had = "forward" in vars(model)
        own = vars(model).get("forward")
        inner = model.forward

        def params():
            return [p for p in model.parameters() if p.requires_grad]

        def forward(*args, **kwargs):
            if not model.training:
                return inner(*args, **kwargs)
            items = kwargs.get("num_items_in_batch")
            if isinstance(items, (int, float)) and not isinstance(items, bool):
                # a host number would be captured as a constant: a tensor is an input of the graph
                device = next(iter(params())).device
                kwargs["num_items_in_batch"] = torch.full((), items, device=device)
            return self.graphs(inner, params, args, kwargs)

        model.forward = forward
        try:
            yield
        finally:
            if had:
                model.forward = own
            else:
                del model.forward


def capture_training_steps(trainer, *, max_graphs: int = 4, warmup: int = 3):
    """Replay each training step's forward and backward from CUDA graphs in a ``transformers.Trainer``
    (or a subclass: TRL's ``SFTTrainer``, ``DPOTrainer``, ...): less host time per step at small batches.

    Call it after building the trainer, before ``trainer.train()``. It installs a ``training_step`` on this
    trainer instance (other trainers are untouched) that runs the trainer's own step, whose model forward in
    training is captured once per batch shape and then replayed:

    - a batch of a shape (and dtype, and value of each non-tensor argument) not captured yet is captured:
      ``warmup`` eager forward + backward passes on a side stream, then the forward and the backward are
      captured as two CUDA graphs; at most ``max_graphs`` shapes are, their graphs kept (sharing one memory
      pool: about one step's activations at the largest shape). A batch of a further new shape runs eagerly,
      said once by a warning. Pad batches to few shapes (``pad_to_multiple_of``, fixed ``max_length``).
    - gradient accumulation: each micro-batch's gradients are added into the parameters' ``.grad`` (zeroed
      first where Trainer's ``zero_grad()`` left None), as ``backward()`` adds them; eager and replayed
      micro-batches mix.
    - the loss scaling stays Trainer's: the graph computes the model's forward and the gradient of its
      outputs; ``num_items_in_batch`` (a host value that changes with each batch) is an input tensor of the
      graph, copied in like the token ids (a Python number is made a 0-dim tensor); the division by the
      accumulation steps, accelerate's backward and fp16 loss scaling run eagerly on the loss and reach the
      graph as the gradient of its output.
    - the loss Trainer returns and logs is computed from the replayed forward as Trainer computes it.
    - gradient clipping, the optimizer and the scheduler run eagerly, between steps, on ``.grad``.
    - ``model.train()`` mode: dropout draws new masks on every replay. A forward in eval mode or without
      grad (evaluation, generation) runs eagerly.
    - LoRA / QLoRA (PEFT) models: the trainable parameters are read when a shape is captured.

    Checked here (ValueError naming the cause): a CUDA device, one process on one GPU (no DataParallel,
    DDP, FSDP or DeepSpeed), no gradient checkpointing but fuselm's ``checkpointing="recompute"`` or
    ``"offload"`` (checked to recompute exactly inside a graph; offloaded inputs are copied out and back by
    the graphs), no ``torch_compile``, no TRL ``activation_offloading``,
    and a model on SDPA attention (eager attention makes its mask from a host value, flash attention reads
    the batch's lengths on the host); the model again at its first step. A step that still cannot be
    captured (a host synchronization in the model, a data-dependent shape) raises RuntimeError naming the
    cause at its capture. Argument types a graph cannot hold (lists, caches) run eagerly, said once.

    Args:
        trainer: a ``transformers.Trainer`` (or a subclass) to train on a CUDA device.
        max_graphs: batch shapes captured at most (an int >= 1); later new shapes run eagerly.
        warmup: eager forward + backward passes before each capture (an int >= 1); they compile the kernels.

    Returns:
        the trainer. ``trainer.training_step.graphs`` holds the graphs and their counters (``replays``,
        ``eager``, ``signatures``). Calling this again replaces the graphs and the options.

    Shapes: whatever the model takes; each distinct set of input shapes (``input_ids`` ``[B, T]``, ...) is
    one captured signature.

    Example (on a GPU; here the CPU trainer is refused):
        >>> import tempfile, torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
        >>> from fuselm.integrations.trainer import capture_training_steps
        >>> config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        ...                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
        >>> model = LlamaForCausalLM(config)
        >>> args = TrainingArguments(tempfile.mkdtemp(), use_cpu=True, report_to="none")
        >>> trainer = Trainer(model=model, args=args)
        >>> capture_training_steps(trainer, max_graphs=2)
        Traceback (most recent call last):
        ValueError: capture_training_steps: the trainer runs on cpu; CUDA graphs hold GPU work only

    On a GPU, with the model patched by fuselm (SDPA attention: what ``from_pretrained`` gives):
        >>> model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)       # doctest: +SKIP
        >>> model = fuselm.hf.patch(model)                                                  # doctest: +SKIP
        >>> args = SFTConfig(..., pad_to_multiple_of=256, gradient_checkpointing=False)     # doctest: +SKIP
        >>> capture_training_steps(SFTTrainer(model=model, args=args, ...)).train()        # doctest: +SKIP
    """
    if not (callable(getattr(trainer, "training_step", None)) and hasattr(trainer, "args")):
        raise ValueError(
            f"trainer must be a transformers.Trainer (or a subclass), got {type(trainer).__name__}"
        )
    check_count("max_graphs", max_graphs)
    check_count("warmup", warmup)
    check_trainer(trainer)
    if getattr(trainer, "model", None) is not None:
        check_model(trainer.model)
    current = trainer.training_step
    original = current.original if isinstance(current, CapturedTrainingSteps) else current
    trainer.training_step = CapturedTrainingSteps(original, max_graphs=max_graphs, warmup=warmup)
    return trainer


def check_trainer(trainer) -> None:
    """ValueError naming why the trainer's steps cannot be captured (its device, processes, arguments)."""
    args = trainer.args
    device = args.device
    if device.type not in graph_step.CAPTURE_DEVICES:
        _refuse(f"the trainer runs on {device.type}; CUDA graphs hold GPU work only")
    if getattr(args, "world_size", 1) > 1 or getattr(args, "n_gpu", 1) > 1:
        _refuse(
            "the trainer runs on several GPUs or processes; captured steps are for one process on one GPU "
            "(DataParallel and DDP reduce the gradients inside the backward)"
        )
    for flag, what in (("is_deepspeed_enabled", "DeepSpeed"), ("is_fsdp_enabled", "FSDP")):
        if getattr(trainer, flag, False):
            _refuse(f"the trainer runs {what}; captured steps are for one process on one GPU")
    flags = ("activation_checkpointing", "gradient_checkpointing")
    _refuse_checkpointing(args, flags, getattr(trainer, "model", None))
    if getattr(args, "torch_compile", False):
        _refuse("torch_compile=True: a compiled model and a captured step do not combine (pick one)")
    if getattr(args, "activation_offloading", False):
        _refuse("activation_offloading=True copies activations to the host inside the step: turn it off")


def _refuse_checkpointing(owner, flags: tuple[str, str], model) -> None:
    """ValueError when gradient checkpointing is on and ``model`` does not run fuselm's recompute, offloading
    or not (which a graph captures): ``flags`` are its names in transformers 5.25 and 5.17 (the first one
    ``owner`` has is read: the old name warns in 5.25)."""
    from ..hf.activation_plan import checkpoints_capturably

    for flag in flags:
        on = getattr(owner, flag, None)
        if on is not None:
            if on and not (model is not None and checkpoints_capturably(model)):
                _refuse(
                    "gradient checkpointing is on: only fuselm's is checked to recompute exactly inside a "
                    "CUDA graph; patch the model with fuselm.hf.patch(model, checkpointing='recompute' or "
                    "'offload') or train without it (gradient_checkpointing=False: TRL's configs turn it on "
                    "by default)"
                )
            return


def check_model(model) -> None:
    """ValueError naming why this model's training step cannot be captured: its attention implementation
    (SDPA or a model without one is needed), gradient checkpointing, trainable parameters off the GPU."""
    config = getattr(model, "config", None)
    configs = [config]
    text = getattr(config, "get_text_config", None)
    if callable(text):
        configs.append(text())
    from ..hf.attention import KEEPING_SDPA  # (what a patched model's training steps switch "sdpa" to)

    for c in configs:
        attention = getattr(c, "_attn_implementation", None)
        if attention not in (None, "sdpa", KEEPING_SDPA):
            why = _ATTENTION.get(attention, "only SDPA attention is known to capture")
            _refuse(f"the model's attention is {attention!r}: {why}; load it with attn_implementation='sdpa'")
    _refuse_checkpointing(model, ("is_activation_checkpointing", "is_gradient_checkpointing"), model)
    for name, p in model.named_parameters():
        if p.requires_grad and p.device.type not in graph_step.CAPTURE_DEVICES:
            _refuse(f"trainable parameter {name} is on {p.device}; CUDA graphs hold GPU work only")


def _refuse(why: str):
    raise ValueError(f"capture_training_steps: {why}")
