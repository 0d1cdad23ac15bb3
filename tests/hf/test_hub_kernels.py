"""fuselm.hf with the ``kernels`` package transformers uses to swap layer forwards per instance: a patched
model runs fuselm's forwards through kernelize (at load, on every train() / eval() switch, called again by
hand), fuselm's layers as kernels layers (fuselm.hf.kernel_config), fuselm.hf.report, the attribute checks
of the swapped forwards. kernelize runs on the CPU here with a ``cpu`` mapping to stand-in layers (no Hub):
what transformers' default mapping does on a GPU."""

from __future__ import annotations

import gc
import importlib
import warnings

import pytest
import torch
from kit.hf_models import build

import fuselm.hf
from fuselm.hf import _common, blocks
from fuselm.hf.installs import rope_in_module
from fuselm.hf.registry import family
from fuselm.ops._common.testing import assert_numerics

transformers = pytest.importorskip("transformers")
try:
    import kernels
except ImportError:  # transformers < 5.25 without the optional kernels package: fuselm's own checks only
    kernels = None
needs_kernels = pytest.mark.skipif(kernels is None, reason="needs the kernels package (transformers >= 5.25)")

HUB_RUNS: list[str] = []  # the stand-in hub layers append their name when they run


class StandInRMSNorm(torch.nn.Module):
    """A hub RMSNorm stand-in (a kernels layer: stateless, HF's signature): Llama's formula, counted."""

    def forward(self, hidden_states):
        HUB_RUNS.append("RMSNorm")
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(hidden_states.dtype)


class StandInRotary(torch.nn.Module):
    """A hub rotary stand-in for ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``, counted."""

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        HUB_RUNS.append("rotary")
        return type(self).forward(self, q, k, cos, sin, unsqueeze_dim)


class _Repo:
    """A kernels repository (``RepositoryProtocol``) serving one stand-in layer, without the Hub."""

    def __init__(self, layer):
        self.layer, self.layer_name = layer, layer.__name__

    def load(self):
        return self.layer


STAND_INS = {"RMSNorm": {"cpu": _Repo(StandInRMSNorm)}, "rotary_pos_emb": {"cpu": _Repo(StandInRotary)}}


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    """Hub kernels on, the stand-in mapping for the CPU, fresh one-time warnings; nothing left patched."""
    monkeypatch.setenv("USE_HUB_KERNELS", "1")
    monkeypatch.setattr(_common, "_warned", set())
    HUB_RUNS.clear()
    if kernels is None:
        yield
    else:
        with kernels.use_kernel_mapping(STAND_INS):
            yield
    gc.collect()  # models patched by the test leave the families' weak sets
    for model_type in ("llama", "qwen3"):
        fuselm.hf.unpatch(model_type)  # and the installs no patch needs are undone


@pytest.fixture
def fuselm_norms(monkeypatch) -> list:
    """Records every call of fuselm's RMSNorm made by fuselm.hf's forwards and layers."""
    calls = []

    def spy(*args, _fn=blocks.rms_norm, **kwargs):
        calls.append(1)
        return _fn(*args, **kwargs)

    monkeypatch.setattr(blocks, "rms_norm", spy)
    return calls


def _step(model, train=True):
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0)).to(model.device)
    model.train(train)
    out = model(input_ids=ids, labels=ids)
    if train:
        out.loss.backward()
    return out


def _kernelized(model_type="llama"):
    """A tiny model kernelized as ``from_pretrained`` does (the default mapping, plus the stand-ins)."""
    model = build(model_type)
    model.set_use_kernels(True)
    return model


def _norms(model) -> list:
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]


@needs_kernels
def test_the_stand_ins_are_what_kernelize_installs_unpatched():
    model = _kernelized()
    assert all(fuselm.hf.report(model)) and {r.runs for r in fuselm.hf.report(model)} >= {
        f"hub kernel {STAND_INS['RMSNorm']['cpu']}"
    }
    _step(model)
    assert HUB_RUNS.count("RMSNorm") == len(_norms(model))  # train(): kernelized again, still the hub's
    assert "rotary" in HUB_RUNS


@needs_kernels
@pytest.mark.parametrize("when", ["before", "after"], ids=["patch-then-kernelize", "kernelize-then-patch"])
def test_instance_patch_runs_fuselm_through_every_kernelize(when, fuselm_norms):
    model = build("llama")
    if when == "before":
        fuselm.hf.patch(model)
        model.set_use_kernels(True)
    else:
        model.set_use_kernels(True)
        fuselm.hf.patch(model)
    n = len(_norms(model))
    for train in (True, False, True):  # each switch kernelizes again
        fuselm_norms.clear()
        _step(model, train)
        assert len(fuselm_norms) == n and not HUB_RUNS
    kernels.kernelize(model, mode=kernels.Mode.TRAINING, device="cpu")  # by hand, the mapping again
    _step(model)
    assert not HUB_RUNS
    assert {r.runs for r in fuselm.hf.report(model)} == {"fuselm"}


@needs_kernels
def test_unpatch_gives_the_hub_forward_back():
    model = _kernelized()
    norm = _norms(model)[0]
    hub = vars(norm)["forward"]
    fuselm.hf.patch(model)
    assert vars(norm)["forward"] is not hub
    fuselm.hf.unpatch(model)
    assert vars(norm)["forward"] is hub
    _step(model, train=False)
    assert "RMSNorm" in HUB_RUNS


@needs_kernels
def test_class_patch_then_load_runs_fuselm(fuselm_norms):
    fuselm.hf.patch("llama")
    model = _kernelized()
    for train in (True, False):
        fuselm_norms.clear()
        _step(model, train)
        assert len(fuselm_norms) == len(_norms(model)) and not HUB_RUNS


@needs_kernels
def test_kernelized_before_a_class_patch_is_said_and_taken_back_at_the_next_kernelize(fuselm_norms):
    model = _kernelized()
    model.train()
    fuselm.hf.patch("llama")
    with pytest.warns(UserWarning, match=r"model\.norm \(LlamaRMSNorm\) runs hub kernel .* not fuselm's"):
        _step(model)
    assert HUB_RUNS and not fuselm_norms  # shadowed, and said so
    HUB_RUNS.clear()
    model.eval()  # kernelize again: the guard drops the hub forwards
    _step(model, train=False)
    assert not HUB_RUNS and len(fuselm_norms) == len(_norms(model))


@needs_kernels
def test_a_kernel_mapped_after_patching_is_said_once_not_to_run(fuselm_norms):
    model = fuselm.hf.patch(build("llama"))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model.set_use_kernels(True)
        model.train()
        model.eval()
    said = [str(w.message) for w in record if "kernelize leaves" in str(w.message)]
    assert len(said) == 1 and "'RMSNorm'" in said[0] and "fuselm.hf.unpatch" in said[0]


@needs_kernels
def test_guards_are_on_the_classes_only_while_a_patch_needs_them():
    cls = importlib.import_module(family("llama").module).LlamaRMSNorm
    before = dict(vars(cls))
    model = fuselm.hf.patch(build("llama"))
    assert "kernel_condition" in vars(cls) and vars(cls)["kernel_condition"] is not before.get(
        "kernel_condition"
    )
    fuselm.hf.patch("llama")
    fuselm.hf.unpatch(model)
    assert vars(cls)["kernel_condition"] is not before.get("kernel_condition")  # the class patch needs it
    fuselm.hf.unpatch("llama")
    assert vars(cls).get("kernel_condition") is before.get("kernel_condition")


@needs_kernels
@pytest.mark.parametrize("how", ["pickle", "torch.save", "deepcopy"])
def test_a_kernelized_patched_model_copies(how, tmp_path):
    import copy
    import pickle

    model = fuselm.hf.patch(_kernelized())
    want = _step(model).loss
    if how == "deepcopy":
        loaded = copy.deepcopy(model)
    elif how == "pickle":
        loaded = pickle.loads(pickle.dumps(model))
    else:
        torch.save(model, tmp_path / "m.pt")
        loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    HUB_RUNS.clear()
    assert torch.equal(_step(loaded).loss, want) and not HUB_RUNS


# ---- fuselm.hf.kernel_config ----


def _saved(tmp_path, model_type="llama") -> str:
    path = tmp_path / model_type
    build(model_type).save_pretrained(path)
    return str(path)


@needs_kernels
def test_kernel_config_makes_fuselm_the_kernels_layers(tmp_path, fuselm_norms, monkeypatch):
    """from_pretrained(use_kernels=True, kernel_config=fuselm.hf.kernel_config()): fuselm's layers in every
    tagged norm and rotary function, in both modes, from the wheel's local repository (offline); the loss
    and gradients are HF's under the numerics rule."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = _saved(tmp_path)
    auto = transformers.AutoModelForCausalLM
    ours = auto.from_pretrained(
        path, use_kernels=True, kernel_config=fuselm.hf.kernel_config(devices=("cpu",))
    )
    ref = auto.from_pretrained(path, use_kernels=False, dtype=torch.float64)
    eager = auto.from_pretrained(path, use_kernels=False)
    assert {r.runs for r in fuselm.hf.report(ours) if r.cls == "LlamaRMSNorm"} == {"fuselm"}
    for train in (False, True):
        fuselm_norms.clear()
        outs = [_step(m, train) for m in (ours, eager, ref)]
        assert len(fuselm_norms) == len(_norms(ours)) and not HUB_RUNS
        assert_numerics("loss", outs[0].loss, outs[1].loss, outs[2].loss, torch.float32)
    for (name, p), q, r in zip(ours.named_parameters(), eager.parameters(), ref.parameters(), strict=True):
        assert_numerics(name, p.grad, q.grad, r.grad, torch.float32)


@needs_kernels
def test_kernel_config_on_another_device_keeps_hf_forwards(tmp_path, fuselm_norms):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        _saved(tmp_path), use_kernels=True, kernel_config=fuselm.hf.kernel_config()
    )
    _step(model)
    assert not fuselm_norms and not HUB_RUNS  # CUDA only: the CPU model runs its own forwards, no Hub
    assert {r.runs for r in fuselm.hf.report(model) if r.cls == "LlamaRMSNorm"} == {"Hugging Face's"}


@needs_kernels
@pytest.mark.parametrize("bad", ["cuda", (), ("tpu",), None, ("cuda", 3)])
def test_kernel_config_bad_devices_are_named(bad):
    with pytest.raises(ValueError, match="^devices must be a non-empty tuple"):
        fuselm.hf.kernel_config(devices=bad)


# ---- what runs, and the attributes a swapped forward reads ----


def test_a_module_without_an_attribute_keeps_hf_forward_said_once(monkeypatch):
    """A transformers version whose norm keeps its epsilon under a name fuselm does not read (here: fuselm
    made to read another name for one module's class): that module stays on HF's forward, one warning
    naming the attribute, the report says why; the rest runs fuselm's."""
    model = build("qwen3")  # q/k norms and layer norms: one RMSNorm class, so all of them are kept
    monkeypatch.setattr(blocks, "EPS_NAMES", ("epsilon_v2",))
    with pytest.warns(
        UserWarning, match=r"^fuselm.hf: \S+ and \d+ more run Hugging Face's forward: .*epsilon_v2"
    ):
        fuselm.hf.patch(model)
    rows = fuselm.hf.report(model)
    kept = [r for r in rows if r.cls == "Qwen3RMSNorm"]
    assert kept and all(r.runs == "Hugging Face's" and "epsilon_v2" in r.why for r in kept)
    assert {r.runs for r in rows if r.cls != "Qwen3RMSNorm"} == {"fuselm"}
    monkeypatch.undo()
    _step(model)  # HF's norms run: no AttributeError
    fuselm.hf.unpatch(model)


def test_a_class_patched_module_without_an_attribute_runs_hf_forward_said_once(monkeypatch, fuselm_norms):
    fuselm.hf.patch("llama")
    model = build("llama")
    monkeypatch.setattr(blocks, "EPS_NAMES", ("epsilon_v2",))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _step(model)
        _step(model)
    said = [str(w.message) for w in record if "epsilon_v2" in str(w.message)]
    assert len(said) == len(_norms(model))  # once per module, not per call
    assert all(" runs Hugging Face's forward: LlamaRMSNorm has no epsilon attribute" in m for m in said)
    assert not fuselm_norms


def test_an_activation_without_a_kernel_is_said(monkeypatch):
    model = build("llama")
    model.config.hidden_act = "relu"
    with pytest.warns(
        UserWarning, match=r"run Hugging Face's forward: activation 'relu' has no fuselm kernel"
    ):
        fuselm.hf.patch(model)
    assert {r.runs for r in fuselm.hf.report(model) if r.cls == "LlamaMLP"} == {"Hugging Face's"}
    fuselm.hf.unpatch(model)


def test_report_of_an_unpatched_model_and_its_text():
    model = build("llama")
    rows = fuselm.hf.report(model)
    assert {r.runs for r in rows} == {"Hugging Face's"}
    assert rows[-1].module == f"{family('llama').module}.apply_rotary_pos_emb"
    assert str(rows).splitlines()[-1] == f"{len(rows)} blocks: {len(rows)} Hugging Face's"
    with pytest.raises(TypeError, match="^model must be an nn.Module"):
        fuselm.hf.report("llama")


@needs_kernels
def test_rope_of_a_patched_family_runs_fuselm_under_kernels():
    model = fuselm.hf.patch(_kernelized())
    assert _common.is_fuselm_forward(rope_in_module(family("llama")))
    _step(model)
    assert "rotary" not in HUB_RUNS
    row = [r for r in fuselm.hf.report(model) if r.cls == "function"]
    assert [r.runs for r in row] == ["fuselm"]


# ---- on a GPU: transformers' own default mapping, its hub repositories stood in for locally ----

_STAND_IN_REPO = """
import torch

RUNS = []


class {layer}(torch.nn.Module):
    def forward(self, {args}):
        RUNS.append(1)
        return type(self).forward(self, {call})
"""


def _stand_in_repo(root, name: str, layer: str, args: str, call: str) -> str:
    """A kernels-format repository (one universal build) whose layer counts its runs, then runs the
    module's own forward: what a hub kernel is to fuselm, without the Hub."""
    build = root / name / "torch-universal"
    build.mkdir(parents=True)
    meta = {"name": name, "id": f"standin_{name}", "version": 1, "license": "Apache-2.0"}
    meta |= {"python-depends": [], "backend": {"type": "universal"}}
    (build / "metadata.json").write_text(__import__("json").dumps(meta))
    body = _STAND_IN_REPO.format(layer=layer, args=args, call=call)
    (build / "__init__.py").write_text(body + f"\n\nclass layers:\n    {layer} = {layer}\n")
    return str(root / name)


@needs_kernels
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: transformers maps hub kernels on GPUs")
def test_on_the_gpu_fuselm_runs_under_transformers_default_hub_kernels(tmp_path, monkeypatch, fuselm_norms):
    """from_pretrained on a GPU with kernels on (transformers' default mapping: Liger's RMSNorm, the rotary
    kernel, the SiLU of eval; their repositories stood in for by counting local ones through LOCAL_KERNELS,
    as offline nothing else loads): unpatched, the
    hub layers run; patched (instance, or class before loading), fuselm's run in every norm and the
    rotary function, in eval, after train() + backward, and after kernelize by hand; and the
    kernel_config() route runs fuselm's layers, offline."""
    import sys

    liger = _stand_in_repo(tmp_path, "liger", "LigerRMSNorm", "hidden_states", "hidden_states")
    rope = _stand_in_repo(
        tmp_path,
        "rotary",
        "apply_rotary_transformers",
        "q, k, cos, sin, unsqueeze_dim=1",
        "q, k, cos, sin, unsqueeze_dim",
    )
    silu = _stand_in_repo(tmp_path, "activation", "Silu", "input", "input")  # eval: the MLP's activation
    local = f"kernels-community/liger-kernels={liger}:kernels-community/rotary={rope}"
    local += f":kernels-community/activation={silu}"
    monkeypatch.setenv("LOCAL_KERNELS", local)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = _saved(tmp_path)

    def load(**kwargs):
        return transformers.AutoModelForCausalLM.from_pretrained(path, device_map="cuda", **kwargs)

    def hub_runs() -> int:
        return sum(
            len(sys.modules[f"standin_{n}"].RUNS)
            for n in ("liger", "rotary", "activation")
            if f"standin_{n}" in sys.modules
        )

    def clear() -> None:
        fuselm_norms.clear()
        for n in ("liger", "rotary", "activation"):
            if f"standin_{n}" in sys.modules:
                sys.modules[f"standin_{n}"].RUNS.clear()

    model = load()
    _step(model, train=False)
    assert hub_runs() > 0 and not fuselm_norms  # the default mapping is in effect
    fuselm.hf.patch(model)
    for how in ("eval", "train", "kernelize"):
        clear()
        if how == "kernelize":
            kernels.kernelize(model, mode=kernels.Mode.TRAINING)
        _step(model, train=how != "eval")
        assert hub_runs() == 0 and len(fuselm_norms) == len(_norms(model)), how
    assert {r.runs for r in fuselm.hf.report(model)} == {"fuselm"}
    fuselm.hf.unpatch(model)
    fuselm.hf.patch("llama")
    clear()
    model = load()
    _step(model)
    assert hub_runs() == 0 and len(fuselm_norms) == len(_norms(model))
    fuselm.hf.unpatch("llama")
    clear()
    model = load(use_kernels=True, kernel_config=fuselm.hf.kernel_config())
    for train in (False, True):
        _step(model, train)
        assert hub_runs() == 0 and len(fuselm_norms) == len(_norms(model))
        fuselm_norms.clear()


def test_fuselm_layers_on_a_class_they_do_not_know_run_its_own_forward_said_once():
    """fuselm's kernels layers bound to a module of a family fuselm has no spec for (transformers maps
    every class tagged "RMSNorm" / "rotary_pos_emb"): the module's own forward runs, one warning."""
    import types

    from fuselm.hf import hub_kernels

    norm = torch.nn.RMSNorm(8, eps=1e-6)
    x = torch.randn(2, 8)
    with pytest.warns(UserWarning, match="RMSNorm is no RMSNorm fuselm knows: its own forward runs"):
        out = types.MethodType(hub_kernels.RMSNorm.forward, norm)(x)
    assert torch.equal(out, norm(x))

    class OtherRotary(torch.nn.Module):
        def forward(self, q, k, cos, sin, unsqueeze_dim=1):
            return q + 1, k + 1

    OtherRotary.__module__ = "somewhere.modeling_other"
    q, k, cos = torch.randn(1, 2, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 4, 8)
    with pytest.warns(UserWarning, match="rotary function of somewhere.modeling_other is not one fuselm"):
        got = types.MethodType(hub_kernels.ApplyRotary.forward, OtherRotary())(q, k, cos, cos)
    assert torch.equal(got[0], q + 1) and torch.equal(got[1], k + 1)


@pytest.mark.skipif(kernels is not None, reason="the kernels package is installed here")
def test_kernel_config_without_kernels_says_what_to_install():
    with pytest.raises(ImportError, match="needs transformers with KernelConfig and the kernels package"):
        fuselm.hf.kernel_config()
