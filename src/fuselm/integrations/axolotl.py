"""fuselm as an Axolotl plugin: the YAML names it, Axolotl calls it, no patch function in user code.

In the Axolotl config::

    plugins:
      - fuselm.integrations.axolotl.FuselmPlugin
    fuselm_kernels: true     # RMSNorm, RoPE, SwiGLU / GeGLU of the model's family (default true)
    fuselm_loss: fused       # fused: linear cross-entropy, no logits; logits: fuselm.cross_entropy on
                             # HF's logits; off: HF's loss (default fused)
    fuselm_memory: auto      # the loss's plan: auto, min or a byte budget (default auto)
    fuselm_lora: true        # PEFT LoRA / QLoRA layers through fuselm.lora's fused path (default true)
    fuselm_trl: false        # TRL trainers (DPO, GRPO, ...): their fused LM head on fuselm (default false)

Axolotl loads the class by its import path and calls its hooks in this order (its model loader): ``register``
(the config as read), ``pre_model_load``, ``post_model_build``, ``pre_lora_load``, ``post_lora_load``,
``post_model_load`` (the model with its adapters). The plugin checks the options and the conflicts at
``register`` (fuselm and Liger or Cut Cross-Entropy on the same component: a ValueError naming both keys),
patches TRL at ``pre_model_load`` and the model at ``post_model_load`` (after the adapters, as
:func:`fuselm.hf.patch` wants PEFT models). ``get_input_args`` names :class:`FuselmArgs`, the pydantic model
Axolotl merges into its config schema.

This module imports without Axolotl (the plugin then has no base class; Axolotl needs none to call it, and
inside Axolotl it subclasses ``axolotl.integrations.base.BasePlugin``); pydantic is imported only when
Axolotl asks for :class:`FuselmArgs`.
"""

from __future__ import annotations

from typing import Any

try:  # inside Axolotl: its base class (default hooks for everything the plugin leaves alone)
    from axolotl.integrations.base import BasePlugin as _Base
except ImportError:  # Axolotl not installed: the class still imports and runs its hooks
    _Base = object

LOSSES = ("fused", "logits", "off")
DEFAULTS = {
    "fuselm_kernels": True,
    "fuselm_loss": "fused",
    "fuselm_memory": "auto",
    "fuselm_lora": True,
    "fuselm_trl": False,
}
# Axolotl keys of the peers that patch the same components (their plugins' argument models)
_LIGER_KERNELS = ("liger_rms_norm", "liger_rope", "liger_glu_activation", "liger_swiglu", "liger_layer_norm")
_LIGER_LOSSES = ("liger_cross_entropy", "liger_fused_linear_cross_entropy")


def options(cfg: Any) -> dict[str, Any]:
    """The plugin's options from an Axolotl config (a mapping; missing or None keys take
    :data:`DEFAULTS`), checked: a ValueError names the key of a bad value, or both keys when Liger or Cut
    Cross-Entropy (their plugins listed in ``plugins``) patch a component fuselm also patches.

    Example:
        >>> options({"fuselm_loss": "logits"})["fuselm_loss"]
        'logits'
        >>> options({"plugins": ["axolotl.integrations.liger.LigerPlugin"], "liger_rms_norm": True})
        Traceback (most recent call last):
        ...
        ValueError: liger_rms_norm and fuselm_kernels both patch the model's kernels: set one of them to false
    """
    get = cfg.get
    opts = {k: (get(k) if get(k) is not None else v) for k, v in DEFAULTS.items()}
    for key in ("fuselm_kernels", "fuselm_lora", "fuselm_trl"):
        if not isinstance(opts[key], bool):
            raise ValueError(f"{key} must be true or false, got {opts[key]!r}")
    if opts["fuselm_loss"] not in LOSSES:
        raise ValueError(f"fuselm_loss must be one of {', '.join(LOSSES)}, got {opts['fuselm_loss']!r}")
    memory = opts["fuselm_memory"]
    if not (
        memory in ("auto", "min") or (isinstance(memory, int) and not isinstance(memory, bool) and memory > 0)
    ):
        raise ValueError(f"fuselm_memory must be auto, min or a positive number of bytes, got {memory!r}")
    plugins = " ".join(get("plugins") or ())
    if "liger" in plugins:
        for key in _LIGER_KERNELS:
            if get(key) and opts["fuselm_kernels"]:
                raise ValueError(
                    f"{key} and fuselm_kernels both patch the model's kernels: set one of them to false"
                )
        for key in _LIGER_LOSSES:
            if get(key) and opts["fuselm_loss"] != "off":
                raise ValueError(f"{key} and fuselm_loss both replace the loss: set one to false / off")
    if (
        "cut_cross_entropy" in plugins
        and get("cut_cross_entropy") is not False
        and opts["fuselm_loss"] != "off"
    ):
        raise ValueError(
            "cut_cross_entropy (on by default with its plugin) and fuselm_loss both replace the loss: set "
            "cut_cross_entropy: false or fuselm_loss: off"
        )
    return opts


class FuselmPlugin(_Base):
    """The Axolotl plugin (module docstring: the config keys and the hooks used)."""

    def __init__(self):
        super().__init__()
        self.options: dict[str, Any] | None = None

    def get_input_args(self) -> str:
        """The pydantic model of the plugin's config keys, by import path (Axolotl imports it)."""
        return f"{__name__}.FuselmArgs"

    def register(self, cfg) -> None:
        """Check the options and the conflicts with other plugins (ValueError naming the keys)."""
        self.options = options(cfg)

    def pre_model_load(self, cfg) -> None:
        """TRL's trainers on fuselm (``fuselm_trl``), before any trainer exists."""
        opts = self._options(cfg)
        if opts["fuselm_trl"]:
            import fuselm.trl

            fuselm.trl.patch(memory=opts["fuselm_memory"])

    def post_model_load(self, cfg, model) -> None:
        """:func:`fuselm.hf.patch` on the model, its adapters (PEFT) in place."""
        opts = self._options(cfg)
        kernels, loss = opts["fuselm_kernels"], opts["fuselm_loss"]
        if not (kernels or loss != "off" or opts["fuselm_lora"]):
            return
        import fuselm.hf

        fuselm.hf.patch(
            model,
            rms_norm=kernels,
            rope=kernels,
            swiglu=kernels,
            lora=opts["fuselm_lora"],
            linear_cross_entropy=loss == "fused",
            cross_entropy=loss == "logits",
            memory=opts["fuselm_memory"],
        )

    def _options(self, cfg) -> dict[str, Any]:
        if self.options is None:  # a caller that skipped register (Axolotl calls it first)
            self.options = options(cfg)
        return self.options


def __getattr__(name: str):
    """FuselmArgs, built on first use (pydantic is Axolotl's dependency, not fuselm's)."""
    if name == "FuselmArgs":
        globals()[name] = _make_args_model()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _make_args_model():
    from typing import Literal

    from pydantic import BaseModel, model_validator

    class FuselmArgs(BaseModel):
        """fuselm's keys in an Axolotl config (None: the plugin's default)."""

        fuselm_kernels: bool | None = None
        fuselm_loss: Literal["fused", "logits", "off"] | None = None
        fuselm_memory: Literal["auto", "min"] | int | None = None
        fuselm_lora: bool | None = None
        fuselm_trl: bool | None = None

        @model_validator(mode="before")
        @classmethod
        def _no_two_patchers(cls, data):
            if isinstance(data, dict):
                options(data)
            return data

    return FuselmArgs
