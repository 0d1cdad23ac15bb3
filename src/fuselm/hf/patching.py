"""``patch`` / ``unpatch`` / ``is_patched``: put fuselm's forwards into Hugging Face models, take them out.

Three targets:
- a model_type string (``"llama"``) or a model class: class patching (:mod:`fuselm.hf.class_patch`). The
  family's RMSNorm, MLP and CausalLM (and multimodal ConditionalGeneration) classes (with
  ``fused_residual=True`` also the decoder layer of Llama's layout: the residual add fused into the
  post-attention RMSNorm) get fuselm's ``forward`` as a class attribute and the modeling module's rotary
  function is replaced: every model of the family, built before or after, uses them.
- a built model (any ``nn.Module``: a PEFT wrapper, a bare decoder, a CausalLM, a multimodal wrapper):
  instance patching (here). Every submodule of a known family class gets fuselm's forward as an instance
  attribute (:func:`_instance_forward` decides which); other models of the same class are untouched.

Patch state lives on the patched modules themselves, so it follows them wherever they go: each instance
forward is an :class:`InstanceForward`, and the outermost module of each family in the model (its root)
holds an :class:`_InstancePatch` (the options, and the family's use of fuselm's RoPE). So
:func:`is_patched` and :func:`unpatch` tell the truth about any model holding patched modules (the model
``merge_and_unload`` returns from a patched PEFT model, a submodule), and a copy (``copy.deepcopy``,
pickle, ``torch.save`` / ``torch.load``) is patched for real, with the same options.

Patching a target again with other options replaces its patch (as ``unpatch`` then ``patch``).
``unpatch`` restores exactly what was there: the original class attributes (or their absence), the
original module function, no instance attributes left behind. The rotary function is module-level in HF
(:mod:`fuselm.hf.rotary`): it runs fuselm's RoPE while a class patch or a live patched model needs it.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable

import torch
from torch import nn

from . import offload
from ._common import INSTANCE_MARK, hf_class, is_peft_wrapper
from .class_patch import family_of_target, is_class_patched, original_forward, patch_family, unpatch_family
from .lora import is_lora_linear, keep_quant_states, lora_linear_forward, register_module_names
from .plan import Plan, forward_for, make_plan
from .registry import FamilySpec, family_of_module, generic_spec, is_lm_class_name, supported_model_types
from .rotary import add_user, has_rope, remove_user, sweep

# ---- instance patching ----


class InstanceForward(functools.partial):
    """``module.forward`` as instance patching sets it: ``forward``, one of fuselm's forwards, bound to
    ``module``, and standing for the bound method it is (``__func__``, ``__self__``, ``__qualname__``).
    ``forward`` is ``make(*how)``: how it was made, so that a copy of the module gets its own."""

    def __new__(cls, module: nn.Module, forward: Callable, make: Callable, how: tuple):
        self = super().__new__(cls, forward, module)
        self.make, self.how = make, how
        self.__name__, self.__qualname__ = self.func.__name__, self.func.__qualname__
        return self

    @property
    def __func__(self) -> Callable:
        return self.func

    @property
    def __self__(self) -> nn.Module:
        return self.args[0]

    def __repr__(self) -> str:
        return f"<fuselm forward {self.__qualname__} of {type(self.args[0]).__name__}>"

    def __reduce__(self):
        """Copied (``copy.deepcopy``) or pickled with its module: the copy's forward is made again and bound
        to the copy of the module."""
        return (_rebuilt_forward, (self.args[0], self.make, self.how))


def _rebuilt_forward(module: nn.Module, make: Callable, how: tuple) -> InstanceForward:
    """The forward of a copied or unpickled module (its state may not be restored yet: only its class is
    read). In a process whose transformers gives no fuselm forward for it (a decoder layer of another
    layout: warned), the copy runs HF's forward, through an InstanceForward that ``unpatch`` takes out."""
    forward = make(*how)
    if forward is None:
        forward = original_forward(hf_class(module))
    return InstanceForward(module, forward, make, how)


class _InstancePatch:
    """Held by the outermost module of a family in an instance-patched model (the family's root, attribute
    :data:`INSTANCE_MARK`): the family, and the options its modules were patched with. The root is the
    user of the family's RoPE (:func:`fuselm.hf.rotary.add_user`) while it holds this, and so is the root
    of a copy (``copy.deepcopy``, pickle): see :meth:`__reduce__`."""

    __slots__ = ("spec", "plan", "_root", "_peft_stamp")

    def __init__(self, root: nn.Module, spec: FamilySpec, plan: Plan):
        self.spec, self.plan, self._root = spec, plan, weakref.ref(root)
        self._peft_stamp = _peft_stamp(root)

    def sync(self) -> None:
        """Give fuselm's forward to the LoRA layers PEFT added to the root since it was patched
        (``get_peft_model`` or ``add_adapter`` after ``fuselm.hf.patch``), on the root's next forward.
        PEFT records its adapters in the root's ``peft_config`` dict: a changed dict (or size) is the cue,
        so a forward with nothing new costs one dictionary lookup."""
        root = self.root
        stamp = _peft_stamp(root) if root is not None else None
        if stamp == self._peft_stamp:
            return
        self._peft_stamp = stamp
        if "lora" in self.plan.blocks:
            register_module_names(root)
            keep_quant_states(root)
            for sub in root.modules():
                if "forward" not in vars(sub) and is_lora_linear(sub):
                    vars(sub)["forward"] = _lora_instance_forward(sub)

    @property
    def root(self) -> nn.Module | None:
        return self._root()

    def uses_rope(self) -> bool:
        return "rope" in self.plan.blocks and has_rope(self.spec)

    def __reduce__(self):
        return (_restored_patch, (self.root, self.spec, self.plan))


def _restored_patch(root: nn.Module, spec: FamilySpec, plan: Plan) -> _InstancePatch:
    """The record of a copied or unpickled root: the copy uses the family's RoPE too (the dispatcher is
    installed again when the process has none: loading a patched model is an explicit call)."""
    patch = _InstancePatch(root, spec, plan)
    if patch.uses_rope():
        add_user(spec, root)
    return patch


def _peft_stamp(root: nn.Module) -> tuple[int, int] | None:
    config = vars(root).get("peft_config")  # set by PEFT on the model it injects adapters into
    return None if config is None else (id(config), len(config))


def _lora_forward() -> Callable:
    return lora_linear_forward


def _lora_instance_forward(module: nn.Module) -> InstanceForward:
    return InstanceForward(module, lora_linear_forward, _lora_forward, ())


def _generic_lm(module: nn.Module, cls: type) -> bool:
    """A decoder-only language model with a head of a family without a spec (encoder-decoder models
    compute another loss: never touched; PEFT's wrappers are looked through: the model inside is patched)."""
    config = getattr(module, "config", None)
    return (
        is_lm_class_name(cls.__name__)
        and not is_peft_wrapper(module)
        and isinstance(getattr(module, "lm_head", None), nn.Module)
        and config is not None
        and not getattr(config, "is_encoder_decoder", False)
    )


def _family_spec(module: nn.Module, plan: Plan) -> FamilySpec | None:
    """The family of a module's class (a spec of the registry; the generic spec of a ``*ForCausalLM``
    without one, when ``plan`` has a loss), or None."""
    cls = hf_class(module)
    spec = family_of_module(cls.__module__)
    if spec is None and plan.loss is not None and _generic_lm(module, cls):
        spec = generic_spec(cls)
    return spec


def _family_forward(spec: FamilySpec, cls: type, plan: Plan) -> Callable | None:
    return forward_for(spec, cls, original_forward(cls), plan)


def _instance_forward(module: nn.Module, plan: Plan) -> InstanceForward | None:
    """The forward instance patching gives ``module`` under ``plan``, or None (it keeps its own): the one
    place that decides which submodules of a model get an instance forward, and which one. Here: fuselm's
    forward for the module's class when it is a class its family swaps (:func:`fuselm.hf.plan.forward_for`),
    or the fused loss of a ``*ForCausalLM`` without a spec, or :func:`fuselm.hf.lora.lora_linear_forward` for
    PEFT's LoRA Linear layers (``lora=True``)."""
    if "lora" in plan.blocks and is_lora_linear(module):
        return _lora_instance_forward(module)
    spec = _family_spec(module, plan)
    if spec is None:
        return None
    how = (spec, hf_class(module), plan)
    forward = _family_forward(*how)
    return None if forward is None else InstanceForward(module, forward, _family_forward, how)


def _family_roots(model: nn.Module, plan: Plan) -> dict[nn.Module, FamilySpec]:
    """The outermost module of each family in ``model`` (one per model of the family in it: a Llava's Llama
    text model is the root of the llama family, the Llava wrapper of the llava family)."""
    roots: dict[nn.Module, FamilySpec] = {}

    def visit(module: nn.Module, above: frozenset) -> None:
        spec = _family_spec(module, plan)
        if spec is not None and spec not in above:
            roots.setdefault(module, spec)
            above = above | {spec}
        for child in module.children():
            visit(child, above)

    visit(model, frozenset())
    return roots


def _instance_patches(model: nn.Module) -> list[_InstancePatch]:
    return [vars(m)[INSTANCE_MARK] for m in model.modules() if INSTANCE_MARK in vars(m)]


def _patch_instance(model: nn.Module, plan: Plan) -> None:
    current = _instance_patches(model)
    if current and all(p.plan == plan for p in current):
        return
    _unpatch_instance(model)  # other options: they replace the previous patch of this model
    forwards = []
    for sub in model.modules():
        forward = None if "forward" in vars(sub) else _instance_forward(sub, plan)  # not someone else's
        if forward is not None:
            forwards.append((sub, forward))
    patches = [_InstancePatch(root, spec, plan) for root, spec in _family_roots(model, plan).items()]
    if not forwards and not any(p.uses_rope() for p in patches):
        raise ValueError(
            f"{type(model).__name__}: nothing fuselm.hf can patch with these flags: no module of a family "
            f"it knows (supported model types: {', '.join(supported_model_types())}) and no decoder "
            "*ForCausalLM / *ForConditionalGeneration with an lm_head"
        )
    for sub, forward in forwards:
        vars(sub)["forward"] = forward
    if "lora" in plan.blocks:
        register_module_names(model)  # fallback warnings name the layer ("model.layers.0.self_attn.q_proj")
        keep_quant_states(model)  # found there once fully_shard has replaced the 4-bit weights
    for patch in patches:
        vars(patch.root)[INSTANCE_MARK] = patch
        if patch.uses_rope():
            add_user(patch.spec, patch.root)
    _warn_generic(patches, {sub for sub, _ in forwards})


def _warn_generic(patches: list[_InstancePatch], patched: set[nn.Module]) -> None:
    """One warning naming the ``*ForCausalLM`` models without a spec that got the fused loss."""
    roots = {p.root: p.spec for p in patches}
    generic = [(m, s) for m, s in roots.items() if family_of_module(s.module) is None and m in patched]
    if not generic:
        return
    inside = [s.model_type for s in dict.fromkeys(roots.values()) if s.components()]
    blocks = f"the {', '.join(inside)} blocks inside run fuselm's" if inside else "nothing else is swapped"
    names = ", ".join(f"{hf_class(m).__name__} ({s.model_type})" for m, s in generic)
    warnings.warn(
        f"fuselm.hf: no spec for {names}: its loss is fused; its norms, RoPE and MLP stay Hugging Face's "
        f"({blocks})",
        stacklevel=4,
    )


def _unpatch_instance(model: nn.Module) -> None:
    """Take out every instance forward and patch record fuselm put in ``model`` or its submodules."""
    for sub in model.modules():
        if isinstance(vars(sub).get("forward"), InstanceForward):
            del vars(sub)["forward"]
        patch = vars(sub).pop(INSTANCE_MARK, None)
        if patch is not None:
            remove_user(patch.spec, sub)


def _class_spec(cls: type) -> FamilySpec | None:
    spec = family_of_module(cls.__module__)
    if spec is None and cls.__name__.endswith("ForCausalLM"):
        return generic_spec(cls)
    return spec


# ---- the public functions ----


def _bad_target(target) -> TypeError:
    got = type(target).__name__
    return TypeError(f"target must be a model, a model class or a model_type string, got {got}")


def patch(
    target,
    *,
    rms_norm: bool = True,
    fused_residual: bool = False,
    rope: bool = True,
    swiglu: bool = True,
    lora: bool = True,
    linear_cross_entropy: bool = True,
    cross_entropy: bool = False,
    label_smoothing: float = 0.0,
    memory: str | int = "auto",
    accum_dtype: torch.dtype | None = None,
    checkpointing: str | None = None,
    mlp_chunk_tokens: int | None = None,
):
    """Run a Hugging Face model (or a whole model family) on fuselm's kernels.

    Args:
        target: a built model (``nn.Module``: a ``*ForCausalLM``, a multimodal
            ``*ForConditionalGeneration``, its base model, a PEFT wrapper of it; only this instance is
            patched), a model class (``LlamaForCausalLM``: its whole family is patched, models built
            before and after), or a ``model_type`` string (``"llama"``, the same as its class, usable
            before anything is imported). Supported model types: :func:`fuselm.hf.supported_model_types`
            (table in ``fuselm/hf/README.md``). A ``*ForCausalLM`` (model or class) of a family without a
            spec gets the fused loss only, with one warning naming what stays Hugging Face's.
        rms_norm: every RMSNorm of the family (including q/k norms) runs :func:`fuselm.rms_norm` with
            the family's casting (Llama's, Gemma's ``1 + weight``, OLMo 2's), HF's formula exactly.
        fused_residual: opt-in, with ``rms_norm``: in the families whose decoder layer is Llama's pre-norm
            layout (``FamilySpec.decoder_layer``), the layer's add after the attention runs inside the
            post-attention RMSNorm: ``hidden, residual = fuselm.rms_norm(attn_out, w, eps,
            residual=residual)``, one kernel instead of an add and a norm (and one in backward instead of
            the norm's backward and a gradient add). The sum is rounded to the activations' dtype as HF's
            add rounds it. Off by default: the layer forward it installs is built from the installed
            transformers' source (its syntax tree is checked against Llama's, its keyword-renaming
            wrappers are rebuilt around fuselm's code), which a transformers release can break, for
            -0.27% of a training step on an H100 (``benchmarks/results/h100/tuning/``
            ``e2e_fused_residual_ab.md``). With the default no source is read and the decoder layers
            stay HF's (their norms, attention and MLP inside run fuselm's forwards).
        rope: the attention's ``apply_rotary_pos_emb`` runs :func:`fuselm.apply_rotary` (GQA, partial
            rotary). Module-level in HF: while a class patch or a live instance-patched model of the
            family needs it, every model of that family runs it (the same math as HF's). With it, in the
            families whose attention starts with Llama's q, k, v and RoPE statements
            (``FamilySpec.attention``), those run as one autograd node (:mod:`fuselm.hf.attention`:
            HF's own forward with the five statements replaced, read from the installed source).
        swiglu: the gated MLP (also shared experts and dense layers of MoE models) runs the fused
            activation; with separate ``gate_proj``/``up_proj`` the down projection's input is recomputed
            in backward instead of saved, and plain ``nn.Linear`` projections run as one autograd node
            (:func:`fuselm.ops.swiglu.swiglu_mlp`). Activations without a fuselm kernel run HF's MLP.
            Projections that are PEFT LoRA layers or bitsandbytes 4/8-bit layers run
            :func:`fuselm.lora.lora_gated_mlp` (one autograd node saving x, the gate and up
            pre-activations and the rank-r products).
        lora: PEFT's LoRA ``Linear`` layers (attention projections, and any other target) run
            :func:`fuselm.lora.lora_linear` (instance patching): the update added into the base GEMM's
            output, adapters cast to the compute dtype once per call, bitsandbytes 4-bit / 8-bit bases
            dequantized into one shared buffer, PEFT's dropout masks. Patched before ``get_peft_model``,
            the layers PEFT adds get it at the model's next forward. What it does not cover (DoRA, LoRA
            bias, several active adapters, ...) runs PEFT's forward after one warning naming the layer.
        linear_cross_entropy: the ``*ForCausalLM`` / ``*ForConditionalGeneration`` forward with
            ``labels`` in training computes HF's causal-LM loss from the hidden states with
            :func:`fuselm.linear_cross_entropy` and returns ``logits=None``: no ``[B, T, V]`` tensor.
        cross_entropy: with ``linear_cross_entropy=False``: the forward with labels returns HF's logits
            and computes the loss on them with :func:`fuselm.cross_entropy`. At most one loss flag.
        label_smoothing: PyTorch's label smoothing inside the fused loss (the route to use instead of
            the Trainer's ``label_smoothing_factor``).
        memory: the ``memory=`` plan of :func:`fuselm.linear_cross_entropy`: ``"auto"``, ``"min"`` or a
            positive int (bytes).
        accum_dtype: :func:`fuselm.linear_cross_entropy`'s: None, or ``torch.float32`` (the lm_head's
            gradient summed in fp32 across chunks). The loss options are checked here, also when no
            loss flag is on.
        checkpointing: None (HF's gradient checkpointing as the model has it) or ``"offload"`` (built
            models only): gradient checkpointing with each decoder layer's input kept in pinned host
            memory between forward and backward (:func:`fuselm.hf.offload.enable`: turned on if it is off,
            kept through later ``gradient_checkpointing_enable()`` calls and Trainer's flag).
        mlp_chunk_tokens: None, or (with ``swiglu``) the gated MLP runs over chunks of this many tokens:
            no ``[tokens, intermediate]`` tensor is ever held, only x is saved, each chunk's gate and up
            projections are recomputed in backward (for the longest sequences, where those tensors
            decide what fits). Dense and LoRA / QLoRA MLPs; one with LoRA dropout on ``down_proj``,
            multipliers or hooked projections says so once and runs whole.

    Patching a target that is already patched with other options replaces its patch (the same as
    :func:`unpatch` then :func:`patch`); with the same options it does nothing. An instance patch
    overrides a class patch of the same classes for that model. The patch lives on the patched modules:
    a model holding them is patched (``peft_model.merge_and_unload()``), and a copy of a patched model
    (``copy.deepcopy``, pickle, ``torch.save`` / ``torch.load``) is patched for real, with the same
    options (loading it installs the family's RoPE dispatcher if the process has none).

    Returns:
        the target (so ``model = fuselm.hf.patch(model)`` reads naturally).

    Raises:
        ValueError: an unknown model type, a class of an unknown family that is no ``*ForCausalLM``, a
            model in which nothing can be patched with these flags (fuselm never patches silently
            nothing), both loss flags, a bad ``label_smoothing``, ``memory`` or ``accum_dtype`` (the
            message names the argument and its allowed values), ``fused_residual`` without
            ``rms_norm``.
        ImportError: transformers is missing, or too old for the family's modeling module.

    Example:
        >>> import fuselm.hf
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        ...                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
        >>> model = fuselm.hf.patch(LlamaForCausalLM(config))
        >>> fuselm.hf.is_patched(model), fuselm.hf.is_patched(LlamaForCausalLM(config))
        (True, False)
        >>> model.model.layers[0].mlp.forward.__qualname__
        'fuselm_LlamaMLP.forward'
        >>> import torch
        >>> ids = torch.randint(0, 300, (2, 16))
        >>> out = model(input_ids=ids, labels=ids)
        >>> out.loss.shape, out.logits is None
        (torch.Size([]), True)
        >>> _ = fuselm.hf.unpatch(model)
    """
    plan = make_plan(
        rms_norm=rms_norm,
        fused_residual=fused_residual,
        rope=rope,
        swiglu=swiglu,
        lora=lora,
        linear_cross_entropy=linear_cross_entropy,
        cross_entropy=cross_entropy,
        label_smoothing=label_smoothing,
        memory=memory,
        accum_dtype=accum_dtype,
        mlp_chunk_tokens=mlp_chunk_tokens,
    )
    if checkpointing not in (None, "offload"):
        raise ValueError(f"checkpointing must be None or 'offload', got {checkpointing!r}")
    if isinstance(target, nn.Module):
        _patch_instance(target, plan)
        if checkpointing == "offload":
            offload.enable(target)
    elif checkpointing is not None and isinstance(target, (str, type)):
        raise ValueError("checkpointing='offload' takes a built model, not a model class or model_type")
    elif isinstance(target, (str, type)):
        spec = family_of_target(target)
        patch_family(spec, plan)
        if family_of_module(spec.module) is None:
            warnings.warn(
                f"fuselm.hf: no spec for {spec.causal_lms[0]} ({spec.model_type}): its loss is fused; its "
                "norms, RoPE and MLP stay Hugging Face's",
                stacklevel=2,
            )
    else:
        raise _bad_target(target)
    sweep()
    return target


def unpatch(target):
    """Undo :func:`patch` on the same target: a built model loses every forward fuselm gave it or its
    submodules (also a model holding modules of a patched one: ``merge_and_unload``'s result, a copy); a
    class or model_type string gets its family's original classes back. Rotary functions no patch needs
    any more are restored. A target that was not patched is left as it is. Returns the target."""
    if isinstance(target, nn.Module):
        _unpatch_instance(target)
        if offload.is_enabled(target):
            offload.disable(target)
    elif isinstance(target, (str, type)):
        unpatch_family(family_of_target(target))
    else:
        raise _bad_target(target)
    sweep()
    return target


def is_patched(target) -> bool:
    """Whether fuselm's code runs in this target: for a built model, an instance patch of it or of its
    submodules (wherever they are now: inside a PEFT model, the model ``merge_and_unload`` returned, a
    copy), or a class patch of one of its classes' families (not another model's patch); for a
    model_type or class, a class patch of its family."""
    if isinstance(target, nn.Module):
        for m in target.modules():
            if INSTANCE_MARK in vars(m) or isinstance(vars(m).get("forward"), InstanceForward):
                return True
        return any(is_class_patched(_class_spec(hf_class(m))) for m in target.modules())
    if not isinstance(target, (str, type)):
        raise _bad_target(target)
    return is_class_patched(family_of_target(target))
