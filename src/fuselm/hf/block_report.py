""":func:`report`: what each block of a model that fuselm patches runs: fuselm's forward, a hub kernel
(transformers >= 5.25's ``kernels``), Hugging Face's, or another forward, and why where fuselm's does not."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ._common import fallbacks, hf_class, is_fuselm_forward, module_name, register_module_names
from .activation_plan import ActivationPlan
from .activation_plan import current as current_activation_plan
from .hub_kernels import meant_for_fuselm, what_runs
from .installs import has_rope, rope_in_module, rope_runs_fuselm
from .peft_operands import is_lora_linear
from .registry import FamilySpec, family_of_module


@dataclass(frozen=True)
class BlockRun:
    """One block: ``module`` (its qualified name in the model, or ``<modeling module>.<function>`` for a
    family's rotary function), its class (or ``"function"``), what ``runs`` (``"fuselm"``, ``"hub kernel
    <repo>"``, ``"Hugging Face's"``, ``"another forward (<name>)"``) and ``why`` fuselm's forward does not
    run or fell back at run time (empty when it runs)."""

    module: str
    cls: str
    runs: str
    why: str = ""

    def __str__(self) -> str:
        why = f"  ({self.why})" if self.why else ""
        return f"{self.module}  [{self.cls}]  {self.runs}{why}"


class Report(list):
    """A list of :class:`BlockRun`; ``activations``: the model's activation plan
    (:class:`~fuselm.hf.activation_plan.ActivationPlan`, with ``checkpointing="auto"``), else None.
    ``str()`` gives one line per block, a count per implementation and the plan."""

    activations: ActivationPlan | None = None

    def __str__(self) -> str:
        counts: dict[str, int] = {}
        for row in self:
            counts[row.runs] = counts.get(row.runs, 0) + 1
        summary = ", ".join(f"{n} {runs}" for runs, n in counts.items())
        plan = [] if self.activations is None else [f"activations: {self.activations}"]
        return "\n".join([*map(str, self), f"{len(self)} blocks: {summary}", *plan])


def _is_block(module: nn.Module) -> bool:
    """A module fuselm patches or would patch: one that runs (or was given) fuselm's forward, a PEFT LoRA
    layer, or a norm, MLP or CausalLM class of a family fuselm knows."""
    if meant_for_fuselm(module) or is_lora_linear(module):
        return True
    spec = family_of_module(hf_class(module).__module__)
    return spec is not None and hf_class(module).__name__ in (spec.rms_norm, spec.mlp, *spec.causal_lms)


def _rope_row(spec: FamilySpec, model: nn.Module) -> BlockRun:
    name = f"{spec.module}.{spec.rope}"
    if rope_runs_fuselm(spec):
        return BlockRun(name, "function", "fuselm")
    for module in model.modules():  # transformers >= 5.25: each attention's own wrapper of the function
        wrapper = getattr(module, "_kernel_funcs", {}).get(spec.rope)
        if wrapper is not None:
            return BlockRun(name, "function", what_runs(wrapper))
    runs = "fuselm" if is_fuselm_forward(rope_in_module(spec)) else "Hugging Face's"
    return BlockRun(name, "function", runs)


def report(model: nn.Module) -> Report:
    """What each block of ``model`` that fuselm patches (or would) runs: per module, fuselm's forward, a hub
    kernel that ``kernelize`` installed, Hugging Face's forward or another one; and per family, its rotary
    function; with ``checkpointing="auto"``, the activation plan of the decoder layers. ``why`` gives the
    reasons fuselm recorded for a block that runs something else (an attribute its forward reads is
    missing, an activation without a kernel, a LoRA layer PEFT runs itself). A block
    fuselm patched that runs something else is also said once, as a warning, at the first training
    forward of a patched ``*ForCausalLM``.

    What a block runs is what its forward resolves to now: what ran in its last forward, unless the model
    was changed since.

    Args:
        model: any ``nn.Module`` (patched or not: an unpatched model reports Hugging Face's everywhere).

    Returns:
        a :class:`Report` (a list of :class:`BlockRun`); ``print(report)`` gives a table.

    Example:
        >>> import fuselm.hf
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        ...                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
        >>> model = fuselm.hf.patch(LlamaForCausalLM(config))
        >>> rows = fuselm.hf.report(model)
        >>> sorted({row.runs for row in rows})
        ['fuselm']
        >>> print(rows[1])
        model.layers.0.mlp  [LlamaMLP]  fuselm
        >>> _ = fuselm.hf.unpatch(model)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    register_module_names(model)
    rows, families = Report(), {}
    for module in model.modules():
        spec = family_of_module(hf_class(module).__module__)
        if spec is not None and spec.rope is not None and has_rope(spec):
            families.setdefault(spec, None)
        if not _is_block(module):
            continue
        why = "; ".join(f"{what}: {reason}" for reason, what in fallbacks(module).items())
        rows.append(BlockRun(module_name(module), hf_class(module).__name__, what_runs(module), why))
    rows.extend(_rope_row(spec, model) for spec in families)
    rows.activations = current_activation_plan(model)
    return rows
