"""fuselm's Axolotl plugin (fuselm.integrations.axolotl): the hooks in Axolotl's order (its model loader:
register, pre_model_load, build, post_model_build, pre_lora_load, adapters, post_lora_load,
post_model_load) on a tiny PEFT LoRA Llama give HF's loss and the adapters' gradients with fuselm's code
running; the options and the conflicts with Liger / Cut Cross-Entropy are refused naming the keys. Against
Axolotl's own PluginManager and BasePlugin when Axolotl is importable (skipped otherwise, with the reason);
always against the hook order read from its source (axolotl 0.19, src/axolotl/loaders/model.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from kit.hf_models import build

import fuselm.hf
from fuselm.integrations import axolotl as plugin_module
from fuselm.ops._common.testing import assert_numerics

peft = pytest.importorskip("peft")

PLUGIN = "fuselm.integrations.axolotl.FuselmPlugin"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _adapters(model):
    """PEFT LoRA on every linear, A and B random (the same draws for every call)."""
    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, init_lora_weights=False
    )
    torch.manual_seed(1)
    return peft.get_peft_model(model, config)


class _Hooks:
    """Axolotl's calls of one plugin, in its model loader's order (a stand-in for its PluginManager)."""

    def __init__(self, plugin):
        self.plugins = [plugin]

    def __getattr__(self, hook):  # BasePlugin's default hooks do nothing: a hook the plugin lacks is skipped
        return lambda *args: [getattr(p, hook)(*args) for p in self.plugins if hasattr(p, hook)]


def _load(hooks, cfg, dtype=torch.float32):
    """The model as Axolotl's loader builds it, the hooks called around each stage."""
    hooks.pre_model_load(cfg)
    model = build("llama", dtype)
    hooks.post_model_build(cfg, model)
    hooks.pre_lora_load(cfg, model)
    model = _adapters(model)
    hooks.post_lora_load(cfg, model)
    hooks.post_model_load(cfg, model)
    return model


def _step(model, dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 290, (2, 12), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100
    model.train()
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return out, grads


def _check_against_hf(model):
    out, grads = _step(model)
    assert fuselm.hf.is_patched(model) and out.logits is None, "fuselm's fused loss did not run"
    eager_out, eager = _step(_load(_Hooks(object()), {}))
    ref_out, ref = _step(_load(_Hooks(object()), {}, torch.float64))
    assert_numerics("loss", out.loss, eager_out.loss, ref_out.loss, torch.float32)
    assert grads.keys() == eager.keys() and all("lora_" in n for n in grads)
    for n in grads:
        assert_numerics(f"grad {n}", grads[n], eager[n], ref[n], torch.float32)
    fuselm.hf.unpatch(model)


def test_hooks_in_axolotls_order_patch_the_lora_model():
    plugin = plugin_module.FuselmPlugin()
    cfg = {"plugins": [PLUGIN], "fuselm_loss": "fused"}
    plugin.register(cfg)
    _check_against_hf(_load(_Hooks(plugin), cfg))


def test_with_axolotls_plugin_manager():
    base = pytest.importorskip("axolotl.integrations.base", reason="Axolotl is not installed here")
    manager = base.PluginManager.get_instance()
    manager.register(PLUGIN)
    try:
        plugin = manager.plugins[PLUGIN]
        assert isinstance(plugin, base.BasePlugin)
        assert manager.get_input_args() == ["fuselm.integrations.axolotl.FuselmArgs"]
        cfg = {"plugins": [PLUGIN]}
        plugin.register(cfg)  # what axolotl.cli.config does after loading the plugins
        _check_against_hf(_load(manager, cfg))
    finally:
        manager.plugins.pop(PLUGIN, None)


@pytest.mark.parametrize(
    "cfg, named",
    [
        ({"fuselm_loss": "chunked"}, "fuselm_loss"),
        ({"fuselm_kernels": "yes"}, "fuselm_kernels"),
        ({"fuselm_memory": "huge"}, "fuselm_memory"),
        ({"plugins": ["axolotl.integrations.liger.LigerPlugin"], "liger_rope": True}, "liger_rope"),
        (
            {"plugins": ["axolotl.integrations.liger.LigerPlugin"], "liger_fused_linear_cross_entropy": True},
            "liger_fused_linear_cross_entropy",
        ),
        ({"plugins": ["axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"]}, "cut_cross_entropy"),
    ],
)
def test_bad_options_and_two_patchers_are_refused_naming_the_keys(cfg, named):
    with pytest.raises(ValueError, match=named):
        plugin_module.FuselmPlugin().register(cfg)


def test_peers_on_other_components_are_fine():
    """Liger's loss with fuselm's kernels, or Cut Cross-Entropy with fuselm's loss off: no conflict."""
    liger = {"plugins": ["axolotl.integrations.liger.LigerPlugin"], "liger_fused_linear_cross_entropy": True}
    assert plugin_module.options({**liger, "fuselm_loss": "off"})["fuselm_kernels"] is True
    cce = {"plugins": ["axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"], "fuselm_loss": "off"}
    assert plugin_module.options(cce)["fuselm_loss"] == "off"


def test_args_model_validates_the_keys():
    pytest.importorskip("pydantic", reason="pydantic (Axolotl's dependency) is not installed here")
    args = plugin_module.FuselmArgs(fuselm_loss="logits", fuselm_memory=2**26)
    assert args.fuselm_loss == "logits" and args.fuselm_memory == 2**26
    with pytest.raises(ValueError, match="fuselm_loss"):
        plugin_module.FuselmArgs(fuselm_loss="chunked")


def test_imports_without_axolotl():
    """The module imports where Axolotl cannot be imported (its plugin class then has no base)."""
    code = (
        "import sys; sys.modules['axolotl'] = None\n"
        "from fuselm.integrations.axolotl import FuselmPlugin\n"
        "print(FuselmPlugin.__mro__[1].__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "object"


def test_fuselm_trl_patches_trl_before_the_model_loads():
    trl_patch = pytest.importorskip("fuselm.trl")
    pytest.importorskip("trl")
    plugin = plugin_module.FuselmPlugin()
    plugin.register({"fuselm_trl": True})
    try:
        plugin.pre_model_load({})
        assert trl_patch.is_patched()
    finally:
        trl_patch.unpatch()
