"""checkpointing="auto": the memory-budgeted activation plan of the decoder layers (keep / recompute /
offload), its choice under a budget, re-planning when batches grow, the plan in fuselm.hf.report, the
checks of memory_budget, and that every plan gives HF + PEFT's loss and gradients (numerics rule; dropout
masks included). On the CPU the device holds the model's own tensors, so budgets are exact here."""

from __future__ import annotations

import collections
import doctest

import pytest
import torch
from kit.hf_models import build, clone

import fuselm.hf
from fuselm.hf import activation_plan, blocks, offload
from fuselm.hf.activation_plan import GIB, plan_layers
from fuselm.lora import functions as lora_functions
from fuselm.offload import host_memory_stats, offloaded_checkpoint, recompute_checkpoint, selective_checkpoint
from fuselm.ops._common.testing import assert_numerics

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LAYERS = 4
FUNCTIONS = {"keep": selective_checkpoint, "recompute": recompute_checkpoint, "offload": offloaded_checkpoint}


def _batch(t: int, b: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 300, (b, t), generator=torch.Generator().manual_seed(seed))


def _step(model, ids):
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss


def _peft(model, dropout=0.1):
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear")
    return peft.get_peft_model(model, config)


def _hf_checkpointing(model) -> None:
    """HF's gradient checkpointing on (non-reentrant), under the name this transformers version has."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _model(lora: bool, dtype=torch.float32, base=None):
    model = clone(base, dtype) if base is not None else build("llama", layers=LAYERS)
    if lora:
        torch.manual_seed(0)  # the same LoRA initialization for every copy
        model = _peft(model)
    return model


def _figures(lora: bool = False, t: int = 16) -> activation_plan.ActivationPlan:
    """The measured figures of a plan with no limit (every layer kept), for 2 x t tokens."""
    model = fuselm.hf.patch(_model(lora), checkpointing="auto", memory_budget=1e6)
    _step(model, _batch(t))
    plan = activation_plan.current(model)
    assert plan.modes == ("keep",) * LAYERS
    return plan


def _gib(nbytes: int) -> float:
    """A budget of ``nbytes`` in GiB, 64 bytes over (no plan boundary is that close)."""
    return (nbytes + 64) / GIB


def test_plan_layers_spends_the_budget_on_kept_layers_first():
    args = dict(tokens=10, base=100, keep=20, inp=2)  # a kept layer: 200 bytes, an input: 20
    assert plan_layers(4, budget=900, **args) == ("keep",) * 4  # 100 + 4 x 200 fits: no recompute at all
    assert plan_layers(4, budget=899, **args) == ("recompute", "recompute", "keep", "keep")  # + 200 transient
    assert plan_layers(4, budget=100 + 200 + 60, **args) == ("offload",) + ("recompute",) * 3
    assert plan_layers(4, budget=100 + 200 + 80, **args) == ("recompute",) * 4
    assert plan_layers(4, budget=100 + 200 + 20, **args) == ("offload",) * 3 + ("recompute",)
    assert plan_layers(4, budget=50, **args) == ("offload",) * 4  # over anyway: the least it can hold
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner()
    for test in finder.find(activation_plan.plan_layers):
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0


def test_plan_layers_under_a_host_limit_stays_within_the_budget_where_any_plan_does():
    """Inputs the host has no room for stay on the device; kept layers give way to them, so the plan is
    over the budget only where even no kept layer and every input the host takes offloaded is."""
    args = dict(tokens=10, base=200, keep=20, inp=2, remade=3)  # a kept layer 200 bytes, an input 20
    for n in (1, 3, 6, 12):
        for budget in range(0, 200 + n * 200 + 300, 7):
            for host in (None, 0, 19, 20, 45, 60, 10**6):
                modes = plan_layers(n, budget=budget, host=host, **args)
                hostable = n if host is None else min(n, host // 20)
                assert modes.count("offload") <= hostable, (n, budget, host, modes)
                peak = activation_plan._peak(modes, **args)
                least = ("offload",) * hostable + ("recompute",) * (n - hostable)
                least = activation_plan._peak(least, **args)
                assert peak <= budget or least > budget, (n, budget, host, modes, peak)
                if host is None or hostable == n:  # no limit that binds: the plan without one
                    assert modes == plan_layers(n, budget=budget, **args)


def test_the_plan_follows_the_budget_from_measured_figures(monkeypatch):
    """Budgets made from the measured figures give the plans plan_layers says, with estimated peaks
    within them, and each layer checkpoints as its mode says (offloaded or not). (No host figure: no
    kept outputs, tested below.)"""
    monkeypatch.setattr(activation_plan, "host_room", lambda: None)
    f = _figures()
    kept, inp = f.keep_bytes_per_token * f.tokens, f.input_bytes_per_token * f.tokens
    transient = kept + f.remade_bytes_per_token * f.tokens  # a checkpointed layer's backward
    assert 4 * inp < kept
    for budget, want in [
        (f.base + 4 * kept, ("keep",) * 4),
        (f.base + 2 * kept + transient + inp, ("offload", "recompute", "keep", "keep")),
        (f.base + transient + 4 * inp, ("recompute",) * 4),
        (f.base + transient, ("offload",) * 4),
    ]:
        model = fuselm.hf.patch(_model(False), checkpointing="auto", memory_budget=_gib(budget))
        _step(model, _batch(16))
        plan = activation_plan.current(model)
        assert plan.modes == want and plan.estimated_peak <= budget
        for layer, mode in zip(model.model.layers, want, strict=True):
            assert layer.gradient_checkpointing
            assert vars(layer).get("_gradient_checkpointing_func").func is FUNCTIONS[mode]


def test_a_kept_layer_makes_its_norm_outputs_again(monkeypatch):
    """A kept layer saves neither norm's output (2 x H per token fewer bytes): its backward makes each
    again from the norm's input, once however many projections saved it (q, k and v save one)."""
    f = _figures(lora=True)
    hidden = build("llama", layers=1).config.hidden_size
    assert f.remade_bytes_per_token == 2 * hidden * 4  # fp32: input_layernorm's, post_attention_layernorm's
    model = fuselm.hf.patch(_model(True), checkpointing="auto", memory_budget=1e6)
    _step(model, _batch(16))
    assert activation_plan.current(model).modes == ("keep",) * LAYERS
    calls = []
    real = blocks.rms_norm

    def counting(*args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(blocks, "rms_norm", counting)
    model.train()
    ids = _batch(16)
    loss = model(input_ids=ids, labels=ids).loss
    assert calls == [True] * (2 * LAYERS + 1)  # every layer's two norms and the final one
    loss.backward()
    assert calls[2 * LAYERS + 1 :] == [False] * (2 * LAYERS)  # made again, without grad, once each


@pytest.mark.parametrize("plan", ["keep", "mixed", "offload"])
def test_every_plan_gives_hf_peft_loss_and_gradients(plan):
    """PEFT LoRA (dropout 0.1) on all linears: fuselm with checkpointing="auto" under a budget that keeps
    every layer, mixes the three modes, or offloads every layer, against HF + PEFT with HF's gradient
    checkpointing: the same loss and LoRA gradients under the numerics rule (the dropout masks are the
    same: checkpointing replays the forward's RNG, the plan's probe runs under a forked RNG)."""
    f = _figures(lora=True)
    kept, inp = f.keep_bytes_per_token * f.tokens, f.input_bytes_per_token * f.tokens
    transient = kept + f.remade_bytes_per_token * f.tokens
    budget = {"keep": 1e6 * GIB, "mixed": f.base + kept + transient + inp, "offload": 1}[plan]
    model = _against_hf_peft(checkpointing="auto", memory_budget=_gib(budget))
    modes = activation_plan.current(model).modes
    assert ("keep" in modes, "offload" in modes) == {"keep": (True, False), "offload": (False, True)}.get(
        plan, (True, True)
    )


def _against_hf_peft(**patch):
    """PEFT LoRA (dropout 0.1) on a Llama: one step of fuselm.hf.patch(model, **patch) against HF + PEFT
    with HF's gradient checkpointing (fp32, and a float64 reference): loss and LoRA gradients under the
    numerics rule. Returns the patched model."""
    base = build("llama", layers=LAYERS)
    ids = _batch(16)
    results = []
    for dtype, ours in ((torch.float64, False), (torch.float32, False), (torch.float32, True)):
        model = _model(True, dtype, base)
        if ours:
            fuselm.hf.patch(model, **patch)
        else:
            _hf_checkpointing(model)
        torch.manual_seed(1)
        loss = _step(model, ids)
        results.append((loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (ref, ref_g), (eager, eager_g), (got, got_g) = results
    assert_numerics("loss", got, eager, ref, torch.float32)
    assert got_g.keys() == eager_g.keys() and got_g
    for name in got_g:
        assert_numerics(name, got_g[name], eager_g[name], ref_g[name], torch.float32)
    return model


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_a_checkpointed_layer_recomputes_without_the_mlp_down_projection(family, monkeypatch):
    """PEFT LoRA, every layer checkpointed: the recompute skips the MLP's down projection when nothing
    after it in the layer saves a tensor (Llama: the residual add reads none of its values), so a step
    reads each down weight twice (forward, the backward's dX), not three times. In Gemma 2 a norm after
    the MLP saves its output: the recompute runs in full (said once). HF + PEFT's loss and gradients
    either way."""
    import fuselm.offload
    from fuselm.lora import functions

    monkeypatch.setattr(fuselm.offload, "_OUTPUTS_READ", set())  # what earlier tests taught it: forgotten
    monkeypatch.setattr(fuselm.offload, "_warned", set())
    base = build(family, layers=2)
    ids = _batch(16)
    results, reads = [], []
    for dtype, ours in ((torch.float64, False), (torch.float32, False), (torch.float32, True)):
        model = _model(True, dtype, base)
        if ours:
            fuselm.hf.patch(model, checkpointing="auto", memory_budget=1e-9)
            downs = {
                id(layer.mlp.down_proj.base_layer.weight) for layer in model.base_model.model.model.layers
            }
            reads = []

            def counted(w, dtype, dense=functions.dense, downs=downs, reads=reads):
                reads.append(id(w) in downs)
                return dense(w, dtype)

            monkeypatch.setattr(functions, "dense", counted)
        else:
            _hf_checkpointing(model)
        torch.manual_seed(1)
        if ours and family == "gemma2":
            with pytest.warns(
                UserWarning, match=r"Gemma2DecoderLayer\S* saves a tensor after an output it skipped"
            ):
                loss = _step(model, ids)
        else:
            loss = _step(model, ids)
        results.append((loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    assert activation_plan.current(model).modes == ("offload",) * 2
    # per layer: forward + dX (llama), + the full recompute's read (gemma2); + the plan's probe of layer 0
    assert reads.count(True) == {"llama": 2 * 2, "gemma2": 3 * 2}[family] + 1
    (ref, ref_g), (eager, eager_g), (got, got_g) = results
    assert_numerics("loss", got, eager, ref, torch.float32)
    assert got_g.keys() == eager_g.keys() and got_g
    for name in got_g:
        assert_numerics(name, got_g[name], eager_g[name], ref_g[name], torch.float32)


def test_a_chunked_mlp_leaves_its_recompute_to_the_chunked_backward(monkeypatch):
    """mlp_chunk_tokens (long sequences): the forward runs the MLP chunked; the recompute asks for no
    output, so the MLP's chunked backward makes gate and up (never a [tokens, I] tensor)."""
    from fuselm.hf import lora

    calls = []

    def spy(*args, _fn=lora.lora_gated_mlp, **kwargs):
        calls.append((kwargs.get("chunk_rows"), kwargs.get("output", True)))
        return _fn(*args, **kwargs)

    monkeypatch.setattr(lora, "lora_gated_mlp", spy)
    model = _peft(build("llama", layers=LAYERS), dropout=0.0)  # (down_proj dropout would refuse chunks)
    fuselm.hf.patch(model, checkpointing="offload", mlp_chunk_tokens=8)
    _step(model, _batch(16))
    assert calls == [(8, True)] * LAYERS + [(8, False)] * LAYERS  # forward, then the recomputes


def test_the_last_layers_backward_takes_its_tensors_and_kept_outputs_from_the_device(monkeypatch):
    """checkpointing="offload" on a PEFT LoRA Llama: the last decoder layer's input and the projection
    outputs its forward kept stay on the device, unwritten, until its backward (the first) takes them there;
    every earlier layer's come back from the host."""
    import fuselm.offload as core

    taken = []

    def fetch(self, prefetch=False, _fetch=core._Stash.fetch):
        if self.saved is not None:  # (a stash already fetched returns at once)
            on_device = self.on_device is not None and all(t._version == v for t, v in self.on_device)
            taken.append((on_device, len(self.on_device or ())))
        return _fetch(self, prefetch)

    monkeypatch.setattr(core._Stash, "fetch", fetch)
    core.set_kept_output_room(None)  # process-wide: a plan made by another test may have set it
    model = _peft(build("llama", layers=LAYERS), dropout=0.0)
    fuselm.hf.patch(model, checkpointing="offload")
    _step(model, _batch(16))
    assert [device for device, _ in taken] == [True] + [False] * (LAYERS - 1)
    assert taken[0][1] > 1  # the input and kept outputs


def test_full_fine_tuning_counts_the_gradients_to_come():
    """No PEFT: the parameters' gradients are not allocated at the first forward; the plan's base counts
    them (what the backward will hold) besides the model's tensors."""
    model = fuselm.hf.patch(build("llama", layers=LAYERS), checkpointing="auto", memory_budget=1.0)
    _step(model, _batch(16))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert activation_plan.current(model).base >= 2 * params


def test_a_batch_with_more_tokens_is_planned_again():
    model = fuselm.hf.patch(build("llama", layers=LAYERS), checkpointing="auto", memory_budget=1.0)
    _step(model, _batch(32))
    first = activation_plan.current(model)
    _step(model, _batch(16))
    assert activation_plan.current(model) is first  # fewer tokens: the plan holds
    _step(model, _batch(64))
    again = activation_plan.current(model)
    assert again is not first and again.tokens == 128  # measured again: not every saved tensor is O(T)


def test_hf_checkpointing_switches_keep_the_plan():
    """Trainer switches HF's checkpointing on at train(): every layer alike; the plan is applied again at
    the next training forward."""
    f = _figures()
    transient = (2 * f.keep_bytes_per_token + f.remade_bytes_per_token) * f.tokens
    budget = f.base + transient + f.input_bytes_per_token * f.tokens
    model = fuselm.hf.patch(_model(False), checkpointing="auto", memory_budget=_gib(budget))
    _step(model, _batch(16))
    modes = activation_plan.current(model).modes
    assert "keep" in modes and "offload" in modes

    def functions():
        return [vars(layer).get("_gradient_checkpointing_func").func for layer in model.model.layers]

    assert functions() == [FUNCTIONS[m] for m in modes]
    _hf_checkpointing(model)
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    assert functions() == [offloaded_checkpoint] * LAYERS  # what offloading installs over HF's
    _step(model, _batch(16))
    assert functions() == [FUNCTIONS[m] for m in modes]


def test_recompute_checkpoints_every_layer_on_the_device_and_gives_hf_peft_results():
    """checkpointing="recompute": every layer runs recompute_checkpoint (also after HF's checkpointing
    switches), nothing goes to the host, the loss and LoRA gradients are HF + PEFT's (dropout 0.1: the
    masks are replayed); patching again without it takes it out."""
    model = _against_hf_peft(checkpointing="recompute")
    layers = model.base_model.model.model.layers

    def functions():
        return [vars(layer).get("_gradient_checkpointing_func").func for layer in layers]

    assert functions() == [recompute_checkpoint] * LAYERS and activation_plan.checkpoints_capturably(model)
    assert activation_plan.current(model) is None  # nothing planned
    _hf_checkpointing(model)
    offloads = host_memory_stats()["offloads"]
    _step(model, _batch(16))
    assert functions() == [recompute_checkpoint] * LAYERS and host_memory_stats()["offloads"] == offloads
    fuselm.hf.patch(model)
    assert not activation_plan.checkpoints_capturably(model) and not offload.is_enabled(model)


def test_the_plan_is_reported_and_follows_the_patch():
    model = fuselm.hf.patch(build("llama", layers=LAYERS), checkpointing="auto", memory_budget=1.0)
    assert fuselm.hf.report(model).activations is None  # no training forward yet
    _step(model, _batch(16))
    text = str(fuselm.hf.report(model))
    assert text.splitlines()[-1] == f"activations: {activation_plan.current(model)}"
    assert "4 decoder layers at 32 tokens: 4 keep" in text
    fuselm.hf.patch(model)  # another plan: no checkpointing="auto"
    assert activation_plan.current(model) is None and not offload.is_enabled(model)
    fuselm.hf.patch(model, checkpointing="auto")
    fuselm.hf.unpatch(model)
    assert activation_plan.current(model) is None and not offload.is_enabled(model)


@pytest.mark.parametrize(
    ("budget", "message"),
    [
        (-1, "must be a finite number of GiB > 0"),
        (0, "must be a finite number of GiB > 0"),
        (float("nan"), "must be a finite number of GiB > 0"),
        (float("inf"), "must be a finite number of GiB > 0"),
        ("8", "must be a number of GiB, got str"),
        (True, "must be a number of GiB, got bool"),
    ],
)
def test_bad_memory_budgets_are_named_at_patch_time(budget, message):
    model = build("llama", layers=1)
    with pytest.raises(ValueError, match=f"^memory_budget {message}"):
        fuselm.hf.patch(model, checkpointing="auto", memory_budget=budget)
    assert not fuselm.hf.is_patched(model)


def test_memory_budget_needs_auto_and_auto_needs_a_model():
    with pytest.raises(ValueError, match="^memory_budget is the budget of checkpointing='auto'"):
        fuselm.hf.patch(build("llama", layers=1), checkpointing="offload", memory_budget=8)
    with pytest.raises(ValueError, match="^checkpointing='auto' takes a built model"):
        fuselm.hf.patch("llama", checkpointing="auto")
    with pytest.raises(ValueError, match="^checkpointing must be one of"):
        fuselm.hf.patch(build("llama", layers=1), checkpointing="budget")
    with pytest.raises(ValueError, match="^every_layer must be one of"):
        activation_plan.enable(build("llama", layers=1), every_layer="offloaded")
    with pytest.raises(ValueError, match="^every_layer must be one of"):
        activation_plan.enable(build("llama", layers=1), memory_budget=8, every_layer="recompute")


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_keeps_its_own_planner(how):
    import copy
    import pickle

    model = fuselm.hf.patch(build("llama", layers=LAYERS), checkpointing="auto", memory_budget=1.0)
    want = _step(model, _batch(16))
    other = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    planner = vars(other)[activation_plan._PLANNER]
    assert planner.top is other and all(
        a is b for a, b in zip(planner.layers, other.model.layers, strict=True)
    )
    assert torch.equal(_step(other, _batch(16)), want)
    _step(other, _batch(32))
    assert activation_plan.current(other).tokens == 64 and activation_plan.current(model).tokens == 32


def test_a_plan_offloads_no_more_than_the_host_holds(monkeypatch):
    """Offloaded inputs take pinned host memory: with room for one input on the host, the plan offloads
    one and keeps the others on the device (recomputed, over the budget), and says so; where the host
    does not say what it has, nothing limits the offloads."""
    f = _figures()
    one = f.input_bytes_per_token * f.tokens
    transient = (f.keep_bytes_per_token + f.remade_bytes_per_token) * f.tokens
    budget = _gib(f.base + transient)  # every input offloaded
    model = fuselm.hf.patch(_model(False), checkpointing="auto", memory_budget=budget)
    monkeypatch.setattr(activation_plan, "host_room", lambda: one + one // 2)
    with pytest.warns(
        UserWarning, match=r"room for 1 offloaded layer input\(s\) .* so 3 more stay on the device"
    ):
        _step(model, _batch(16))
    plan = activation_plan.current(model)
    assert plan.modes == ("offload",) + ("recompute",) * 3
    assert plan.host_bytes == one and "of host memory" in str(plan)
    monkeypatch.undo()
    monkeypatch.setattr(activation_plan.checkpoints, "host_available", lambda: None)
    other = fuselm.hf.patch(_model(False), checkpointing="auto", memory_budget=budget)
    _step(other, _batch(16))
    assert activation_plan.current(other).modes == ("offload",) * 4


def test_kept_layers_give_way_to_the_inputs_the_host_cannot_take(monkeypatch):
    """A budget that holds one kept layer and offloads the rest, on a host with room for one input: the
    three inputs left on the device would go over it beside the kept layer, so no layer is kept and the
    plan stays within the budget."""
    f = _figures()
    one = f.input_bytes_per_token * f.tokens
    transient = (f.keep_bytes_per_token + f.remade_bytes_per_token) * f.tokens
    budget = _gib(f.base + transient + f.keep_bytes_per_token * f.tokens)
    monkeypatch.setattr(activation_plan, "host_room", lambda: None)
    free = fuselm.hf.patch(_model(False), checkpointing="auto", memory_budget=budget)
    _step(free, _batch(16))
    assert activation_plan.current(free).modes == ("offload",) * 3 + ("keep",)
    monkeypatch.setattr(activation_plan, "host_room", lambda: one + one // 2)
    model = fuselm.hf.patch(_model(False), checkpointing="auto", memory_budget=budget)
    with pytest.warns(UserWarning, match="more stay on the device"):
        _step(model, _batch(16))
    plan = activation_plan.current(model)
    assert "keep" not in plan.modes and plan.modes.count("offload") <= 1
    assert plan.estimated_peak <= budget * GIB


def test_host_room_is_a_share_of_what_the_host_has_plus_the_pool(monkeypatch):
    monkeypatch.setattr(activation_plan.checkpoints, "host_available", lambda: 1000)
    pool = {"pinned_bytes": 64, "pageable_bytes": 8}
    monkeypatch.setattr(activation_plan.checkpoints, "host_memory_stats", lambda: pool)
    assert activation_plan.host_room() == int(activation_plan.HOST_FRACTION * 1000) + 72
    monkeypatch.setattr(activation_plan.checkpoints, "host_available", lambda: None)
    assert activation_plan.host_room() is None
    monkeypatch.undo()


def test_offloaded_layers_keep_outputs_where_the_budget_has_room_for_them(monkeypatch):
    """Offloaded LoRA layers keep their projections' outputs in host memory for the recompute where the
    budget holds PREFETCH layers' inputs and kept outputs on the device (brought back early) and that
    recomputes less: the outputs in the forward's order, up to all of them (q, k, v, o, gate, up: 8 inputs
    here) where the host link copies them in time, at least q and k (KEPT_PER_INPUT inputs); fewer where
    the budget holds no more; none where it holds nothing, or a kept layer would be given up for them, or
    nothing would be kept (no fused LoRA projection). The host room for them is what the offloaded inputs
    leave."""
    f = _figures(lora=True)
    kept, inp = f.keep_bytes_per_token * f.tokens, f.input_bytes_per_token * f.tokens
    transient = kept + f.remade_bytes_per_token * f.tokens
    share = activation_plan.checkpoints.KEPT_PER_INPUT
    monkeypatch.setattr(activation_plan, "host_room", lambda: 100 * inp)
    monkeypatch.setattr(activation_plan, "HOST_COPY_BYTES_PER_FLOP", 1.0)  # a tiny layer: copies take time

    def reserved(share):  # what the budget holds for layers keeping `share` inputs' worth of outputs
        return activation_plan.PREFETCH * (share + 1) * inp

    def plan(budget, lora=True):
        model = fuselm.hf.patch(_model(lora), checkpointing="auto", memory_budget=_gib(budget))
        _step(model, _batch(16))
        return activation_plan.current(model), activation_plan.checkpoints._KEPT.room

    try:
        got, room = plan(f.base + transient + reserved(8))  # the copies of every output fit the forward
        assert got.modes == ("offload",) * 4 and got.kept_per_input == (8.0,) * 4
        assert got.kept_output_bytes == reserved(8) and room == 96 * inp
        assert got.estimated_peak <= f.base + transient + reserved(8) + 64
        assert "keep their projections' outputs: 4 at 8 inputs" in str(got)
        got, room = plan(f.base + transient + reserved(2))  # room for q, k and v only
        assert got.modes == ("offload",) * 4 and got.kept_per_input == (2.0,) * 4 and room == 96 * inp
        assert got.kept_output_bytes == reserved(2)
        got, _ = plan(f.base + transient + reserved(share))  # q and k: the smallest share
        assert got.kept_per_input == (share,) * 4 and got.kept_output_bytes == reserved(share)
        monkeypatch.setattr(activation_plan, "HOST_COPY_BYTES_PER_FLOP", 0.0)  # no time for more copies:
        got, _ = plan(f.base + transient + reserved(8))  # the room holds every input on the device instead
        assert "offload" not in got.modes and got.kept_output_bytes == 0
        monkeypatch.setattr(activation_plan, "HOST_COPY_BYTES_PER_FLOP", 1.0)
        got, room = plan(f.base + transient)
        assert got.modes == ("offload",) * 4 and got.kept_output_bytes == 0 and room == 0
        got, room = plan(f.base + 2 * kept + transient)  # kept outputs would cost a kept layer: no
        assert got.modes == ("offload", "offload", "keep", "keep") and got.kept_output_bytes == 0
        full = _figures()  # no PEFT: plain projections keep nothing, so nothing is reserved
        got, _ = plan(full.base + full.keep_bytes_per_token * full.tokens, lora=False)  # all checkpointed
        assert "offload" in got.modes and got.kept_output_bytes == 0
    finally:
        activation_plan.checkpoints.set_kept_output_room(None)


def test_kept_shares_take_the_largest_share_the_host_link_copies_in_time():
    """Each offloaded layer keeps the largest share whose copies fit: back while the next layer's backward
    runs (shorter when that layer recomputes less), out while the forward runs, within the host's room;
    else the smallest."""
    off, keep = ("offload",) * 4, ("keep",)
    two = {1.5: (15, 0.1), 9.5: (95, 0.7)}  # share: (bytes kept of a layer, the share of its recompute saved)
    three = {**two, 4.0: (40, 0.3)}

    def shares(modes, levels, unit, host=10**6):
        return activation_plan.kept_shares(modes, 10, levels, unit, host)

    assert shares(off + keep, two, 10**6) == (9.5,) * 4 + (0.0,)  # time for every copy
    assert shares(off + keep, two, 100) == (9.5, 9.5, 9.5, 1.5, 0.0)  # a kept layer's backward: too short
    assert shares(off + keep, two, 70) == (9.5, 1.5, 9.5, 1.5, 0.0)  # after a layer that keeps 9.5: too
    assert shares(off + keep, three, 70) == (9.5, 4.0, 9.5, 4.0, 0.0)
    assert shares(off + keep, three, 40) == (4.0, 4.0, 4.0, 1.5, 0.0)
    assert shares(off + keep, three, 100, host=4 * 15 + 25) == (1.5, 1.5, 1.5, 4.0, 0.0)  # the host's room
    assert shares(off, {1.5: (15, 0.1)}, 10**6) == (1.5,) * 4
    assert shares(keep, two, 10**6) == (0.0,)


def _qlora_maker(tmp_path):
    """(config, a function making the same tiny QLoRA model on every call: an NF4 base through bitsandbytes'
    CPU backend, LoRA r=4 without dropout); skips where bitsandbytes has no CPU 4-bit backend."""
    pytest.importorskip("bitsandbytes")
    from kit.hf_models import model_class, nf4_config, tiny_config

    torch.manual_seed(0)
    src = model_class("llama")(tiny_config("llama", layers=LAYERS))
    src.save_pretrained(tmp_path)

    def qlora():
        try:
            base = type(src).from_pretrained(  # on the CPU, as this file's other models: exact budgets
                tmp_path, quantization_config=nf4_config(), dtype=torch.float32, device_map={"": "cpu"}
            )
        except Exception as e:  # bitsandbytes without a CPU 4-bit backend
            pytest.skip(f"bitsandbytes 4-bit on CPU: {e}")
        torch.manual_seed(0)
        return _peft(base, dropout=0.0)

    return src.config, qlora


def _probed_qlora(monkeypatch, tmp_path):
    """(config, the QLoRA maker, a batch, a model planned on it with no limit, its plan); no host room
    (no kept outputs)."""
    monkeypatch.setattr(activation_plan, "host_room", lambda: None)
    config, qlora = _qlora_maker(tmp_path)
    ids = _batch(256)
    probe = fuselm.hf.patch(qlora(), checkpointing="auto", memory_budget=1e6)
    _step(probe, ids)
    return config, qlora, ids, probe, activation_plan.current(probe)


def _counting_dequantizations(monkeypatch) -> list[int]:
    """The identities of the 4-bit weights dequantized from now on, one entry per dequantization."""
    from fuselm.lora import frozen

    calls: list[int] = []
    real = frozen.Bnb4bitWeight.dense

    def counting(self, dtype=None):
        calls.append(self.identity())
        return real(self, dtype)

    monkeypatch.setattr(frozen.Bnb4bitWeight, "dense", counting)
    return calls


def test_recomputes_hold_their_dense_base_weights_where_the_budget_has_room(monkeypatch, tmp_path):
    """A QLoRA model (NF4 base, bitsandbytes' CPU backend): where the budget holds a layer's dense base
    weights besides the plan's layers, each checkpointed layer's backward reuses the dense weights its
    recompute made (every weight dequantized twice a step: forward, recompute), the plan says so and counts
    them in its peak; 64 bytes less and the backward dequantizes again. The same loss and gradients either
    way."""
    config, qlora, ids, probe, f = _probed_qlora(monkeypatch, tmp_path)
    kept, inp = f.keep_bytes_per_token * f.tokens, f.input_bytes_per_token * f.tokens
    transient = kept + f.remade_bytes_per_token * f.tokens
    layer = probe.base_model.model.model.layers[0]
    held = activation_plan._dense_bytes(layer, torch.float32)
    h, i, kv = config.hidden_size, config.intermediate_size, config.num_key_value_heads * config.head_dim
    assert held == 4 * (2 * h * h + 2 * h * kv + 3 * h * i)  # q, o; k, v; gate, up, down in fp32
    assert kept > 4 * inp + held  # the budgets below keep no layer
    calls = _counting_dequantizations(monkeypatch)
    results = {}
    for budget, hold in ((f.base + transient + 4 * inp + held, True), (f.base + transient + 4 * inp, False)):
        model = fuselm.hf.patch(qlora(), checkpointing="auto", memory_budget=_gib(budget - 64 * (not hold)))
        _step(model, ids)  # planned
        plan = activation_plan.current(model)
        assert plan.modes == ("recompute",) * LAYERS and plan.estimated_peak <= budget
        assert plan.held_dense_bytes == (held if hold else 0)
        assert ("dense base weights" in str(plan)) == hold
        calls.clear()
        loss = _step(model, ids)
        counts = sorted(collections.Counter(calls).values())
        assert len(counts) == 7 * LAYERS
        # without: a third time in the backward, but the down projections (the MLP's recompute runs
        # nothing; its backward makes gate and up and reads down once) and the first layer's q, k and v
        # (the embeddings need no gradient: no backward GEMM of theirs)
        assert lora_functions.RECOMPUTE_MLP_CHUNKS == 1
        assert counts == ([2] * 7 * LAYERS if hold else [2] * (LAYERS + 3) + [3] * (6 * LAYERS - 3))
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        results[hold] = (loss.detach(), grads)
    assert torch.equal(results[True][0], results[False][0])
    assert all(torch.equal(a, b) for a, b in zip(results[True][1], results[False][1], strict=True))


def test_a_budget_with_room_to_spare_keeps_4bit_base_weights_dense_across_steps(monkeypatch, tmp_path):
    """What the budget holds beyond the plan (and the recomputes' held weights) keeps whole layers' 4-bit
    base weights dense across steps, checkpointed layers first: those are not dequantized again in later
    steps, the plan counts them in its peak and says so, the loss and gradients are those of a budget
    without the room, and taking the plan out (unpatch) gives the memory back."""
    from fuselm.lora import frozen

    _, qlora, ids, probe, f = _probed_qlora(monkeypatch, tmp_path)
    each = activation_plan._dense_bytes(probe.base_model.model.model.layers[0], torch.float32)
    assert f.resident_layers == tuple(range(LAYERS)) and f.resident_bytes == LAYERS * each  # room for all
    assert f"{LAYERS} layers keep their 4-bit base weights dense across steps" in str(f)
    all_recomputed = f.base + (f.keep_bytes_per_token + f.remade_bytes_per_token) * f.tokens
    all_recomputed += LAYERS * f.input_bytes_per_token * f.tokens + each  # + the recomputes' held weights
    calls = _counting_dequantizations(monkeypatch)
    results = {}
    for resident in (2, 0):
        budget = (all_recomputed + resident * each) / (1 - activation_plan.RESIDENT_SPARE)  # the spare left
        model = fuselm.hf.patch(qlora(), checkpointing="auto", memory_budget=_gib(int(budget)))
        _step(model, ids)  # planned; the resident weights made as the layers first ask for them
        plan = activation_plan.current(model)
        assert plan.modes == ("recompute",) * LAYERS and plan.held_dense_bytes == each
        assert plan.resident_layers == tuple(range(resident)) and plan.estimated_peak <= plan.budget
        calls.clear()
        losses = [_step(model, ids).detach() for _ in range(2)]
        counts = collections.Counter(calls)
        assert len(counts) == 7 * (LAYERS - resident) and set(counts.values()) == {4}  # 2 a step, held
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        results[resident] = (losses, grads)
        if resident:
            fuselm.hf.unpatch(model)
            assert not any(frozen._RESIDENT in p.__dict__ for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(results[2][0], results[0][0], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(results[2][1], results[0][1], strict=True))
