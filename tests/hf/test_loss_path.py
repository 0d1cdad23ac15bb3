"""The loss path of patched Hugging Face models, as a training run meets it: Trainer evaluation, batches
without targets, bad labels, PEFT heads, bf16 autocast on the CPU, label smoothing, and the generic head
(MoE router loss, multimodal wrappers, logit transforms). Patched vs unpatched under the numerics rule
(CPU fp32, float64 reference) wherever both give a number."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.nn.functional as F
from kit.hf_models import build, clone

import fuselm.hf
import fuselm.ops.linear_cross_entropy.op as lce_op
from fuselm.hf import _common, causal_lm, loss
from fuselm.hf.registry import FAMILIES
from fuselm.ops._common.testing import assert_numerics

transformers = pytest.importorskip("transformers")
VOCAB = 300


@pytest.fixture(autouse=True)
def _clean():
    """No class patch left over, and every one-time warning fresh."""
    _common._warned.clear()
    yield
    gc.collect()
    for model_type in FAMILIES:
        fuselm.hf.unpatch(model_type)
    _common._warned.clear()


def _batch(b=2, t=12, seed=1, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab - 5, (b, t), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt
    return ids, labels


def _small(model_type="llama", **kw):
    return build(model_type, hidden=32, layers=1, **kw)


def _three(model, **patch_kw):
    """(float64 reference, eager HF, patched) copies of ``model``."""
    return clone(model, torch.float64), model, fuselm.hf.patch(clone(model), **patch_kw)


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _step(model, **inputs):
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out


def _check_step(models, names=("loss",), **inputs):
    """One training step of (reference, eager, ours): the outputs in `names` and every gradient."""
    outs = [_step(m, **inputs) for m in models]
    for name in names:
        assert_numerics(name, getattr(outs[2], name), getattr(outs[1], name), getattr(outs[0], name))
    grads = [_grads(m) for m in models]
    assert grads[2].keys() == grads[1].keys()
    for name in grads[1]:
        assert_numerics(f"grad {name}", grads[2][name], grads[1][name], grads[0][name], torch.float32)
    return outs


def _trainer_args(tmp_path, **kw):
    return transformers.TrainingArguments(
        **{
            "output_dir": str(tmp_path),
            "per_device_train_batch_size": 2,
            "per_device_eval_batch_size": 2,
            "max_steps": 2,
            "learning_rate": 1e-3,
            "logging_steps": 1,
            "report_to": [],
            "use_cpu": True,
            "save_strategy": "no",
            "seed": 0,
            "data_seed": 0,
            **kw,
        }
    )


def _rows(n=4, t=12, seed=3):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(3, VOCAB, (t,), generator=g)
        labels = ids.clone()
        labels[: 1 + i] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _logged(trainer, key="loss"):
    return torch.tensor([h[key] for h in trainer.state.log_history if key in h])


def test_positional_arguments_are_read_by_name():
    """model(input_ids, attention_mask, ...) positionally, labels and num_items_in_batch by keyword."""
    ref, eager, ours = _three(_small())
    ids, labels = _batch()
    mask = torch.ones_like(ids)
    outs = []
    for m in (ref, eager, ours):
        m.train()
        outs.append(m(ids, mask, labels=labels, num_items_in_batch=torch.tensor(13)))
    assert outs[2].logits is None
    assert_numerics("loss", outs[2].loss, outs[1].loss, outs[0].loss)


# ---- 1. evaluation: logits and HF's loss ----


def test_trainer_evaluate_with_metrics_gets_logits(tmp_path):
    """run_clm.py's evaluation (compute_metrics + preprocess_logits_for_metrics) on a patched model: the
    eval forward returns HF's logits and loss (it once returned logits=None and predict() crashed)."""
    pytest.importorskip("accelerate")

    def preprocess(logits, labels):
        return logits.argmax(dim=-1)

    def accuracy(pred):
        preds, labels = pred.predictions[:, :-1], pred.label_ids[:, 1:]
        mask = labels != -100
        return {"accuracy": float((preds[mask] == labels[mask]).mean())}

    def evaluate(model):
        trainer = transformers.Trainer(
            model=model,
            args=_trainer_args(tmp_path / str(id(model))),
            eval_dataset=_rows(),
            compute_metrics=accuracy,
            preprocess_logits_for_metrics=preprocess,
        )
        return trainer.evaluate()

    ref, eager, ours = _three(_small())
    results = [evaluate(m) for m in (ref, eager, ours)]
    assert results[2]["eval_accuracy"] == results[1]["eval_accuracy"]
    losses = [torch.tensor(r["eval_loss"]) for r in results]
    assert_numerics("eval loss", losses[2], losses[1], losses[0], torch.float32)
    ids, labels = _batch()
    ours.train()
    assert ours(input_ids=ids, labels=labels).logits is None  # training stays fused


@pytest.mark.parametrize("mode", ["eval", "no_grad"])
def test_eval_and_no_grad_run_hf_forward(mode):
    ref, eager, ours = _three(_small())
    ids, labels = _batch()
    for m in (ref, eager, ours):
        m.train(mode != "eval")
    with torch.no_grad():
        outs = [m(input_ids=ids, labels=labels) for m in (ref, eager, ours)]
    for name in ("loss", "logits"):
        assert_numerics(name, getattr(outs[2], name), getattr(outs[1], name), getattr(outs[0], name))


# ---- 2. a batch without targets ----


@pytest.mark.parametrize("num_items", [None, 0])
def test_all_ignored_batch_gives_zero_gradients(num_items):
    """Every label -100 (completion-only data after truncation): the loss is HF's, NaN (0 / 0 with
    num_items_in_batch = 0, an empty mean without), and every gradient is zero, as HF's."""
    models = [_small(), *_three(_small())[2:]]  # eager, ours
    ids, _ = _batch()
    labels = torch.full_like(ids, -100)
    kw = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    for m in models:
        out = _step(m, input_ids=ids, labels=labels, **kw)
        assert torch.isnan(out.loss)
        grads = _grads(m)
        assert grads and all(torch.all(g == 0) for g in grads.values())


def test_trainer_step_on_an_all_ignored_batch_keeps_weights_finite(tmp_path):
    """Trainer passes num_items_in_batch = 0 for a batch without targets; after the step every weight is
    finite and as HF's (the fused loss once turned them all into NaN)."""
    pytest.importorskip("accelerate")
    rows = _rows(n=2)
    for row in rows:
        row["labels"] = torch.full_like(row["labels"], -100)
    ref, eager, ours = _three(_small())
    for model in (ref, eager, ours):
        args = _trainer_args(tmp_path / str(id(model)), max_steps=1, weight_decay=0.1)
        transformers.Trainer(model=model, args=args, train_dataset=rows).train()
    params = [dict(m.named_parameters()) for m in (ref, eager, ours)]
    for name, p in params[2].items():
        assert torch.isfinite(p).all(), name
        assert_numerics(name, p, params[1][name], params[0][name], torch.float32)


# ---- 3. labels outside the vocabulary ----


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 7, -1])
def test_out_of_range_label_raises_in_eager(bad):
    """HF raises IndexError; the fused loss a ValueError naming the labels and the value (found by the
    host sync that skips ignored tokens; no other sync)."""
    model = fuselm.hf.patch(_small())
    ids, labels = _batch()
    labels[1, 5] = bad
    with pytest.raises(ValueError, match=rf"labels hold {bad}, outside \[0, {VOCAB}\)"):
        model(input_ids=ids, labels=labels)


def test_out_of_range_label_without_sync_leaves_weights_finite(monkeypatch):
    """Under torch.compile / CUDA graph capture (no host sync; simulated): the loss is NaN (visible) and the
    gradients are finite, those of the batch with that label ignored."""
    monkeypatch.setattr(lce_op, "compaction_allowed", lambda device: False)
    model = fuselm.hf.patch(_small())
    ids, labels = _batch()
    n_items = torch.tensor(20)
    bad = labels.clone()
    bad[1, 5] = VOCAB + 7
    ignored = labels.clone()
    ignored[1, 5] = -100
    out = _step(model, input_ids=ids, labels=bad, num_items_in_batch=n_items)
    assert torch.isnan(out.loss)
    got = _grads(model)
    _step(model, input_ids=ids, labels=ignored, num_items_in_batch=n_items)
    want = _grads(model)
    for name in want:
        assert torch.isfinite(got[name]).all(), name
        torch.testing.assert_close(got[name], want[name])


# ---- 4. PEFT heads ----


def _peft(model, **config):
    peft = pytest.importorskip("peft")
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, **config))
    for name, p in wrapped.named_parameters():  # LoRA B starts at zero: make the adapters matter
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    return wrapped


def _three_peft(wrapped):
    ref = copy.deepcopy(wrapped).double()
    ours = fuselm.hf.patch(copy.deepcopy(wrapped))
    return ref, wrapped, ours


def test_modules_to_save_lm_head_is_fused():
    """modules_to_save=["lm_head"]: the loss is fused on the active (trained) copy of the head."""
    wrapped = _peft(_small(), target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    models = _three_peft(wrapped)
    ids, labels = _batch()
    outs = _check_step(models, input_ids=ids, labels=labels)
    assert outs[2].logits is None
    grads = _grads(models[2])
    assert any("modules_to_save" in n and "lm_head" in n for n in grads)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_lora_on_lm_head_is_fused(dropout):
    """LoRA on lm_head: the base weight and the adapter's B side by side, the input and the scaled A(x)
    side by side: HF's logits exactly, dropout included (the same random mask: same seed, same call)."""
    wrapped = _peft(_small(), target_modules=["lm_head", "q_proj"], lora_dropout=dropout)
    models = _three_peft(wrapped)
    ids, labels = _batch()
    outs = []
    for m in models:
        torch.manual_seed(7)
        outs.append(_step(m, input_ids=ids, labels=labels))
    assert outs[2].logits is None
    assert_numerics("loss", outs[2].loss, outs[1].loss, outs[0].loss)
    grads = [_grads(m) for m in models]
    assert any("lm_head.lora_B" in n for n in grads[2])
    for name in grads[1]:
        assert_numerics(f"grad {name}", grads[2][name], grads[1][name], grads[0][name], torch.float32)


def test_disabled_lora_on_lm_head_reads_the_base_weight():
    wrapped = _peft(_small(), target_modules=["lm_head"])
    models = _three_peft(wrapped)
    ids, labels = _batch()
    outs = []
    for m in models:  # only the LoRA weights are trainable, and they are off: a forward, no backward
        m.train()
        with m.disable_adapter():
            outs.append(m(input_ids=ids, labels=labels))
    assert outs[2].logits is None
    assert_numerics("loss", outs[2].loss, outs[1].loss, outs[0].loss)


def test_an_unsupported_head_falls_back_with_one_warning():
    """A head fuselm cannot read (here DoRA on lm_head): HF's forward runs, and a warning says so once."""
    wrapped = _peft(_small(), target_modules=["lm_head"], use_dora=True)
    ref, eager, ours = _three_peft(wrapped)
    ids, labels = _batch()
    with pytest.warns(UserWarning, match="loss is HF's"):
        out = _step(ours, input_ids=ids, labels=labels)
    assert out.logits is not None
    want = _step(eager, input_ids=ids, labels=labels)
    torch.testing.assert_close(out.loss, want.loss)


# ---- 8. bf16 autocast on the CPU ----


def test_cpu_bf16_autocast_loss_is_fp32_accurate():
    """Trainer(bf16=True, use_cpu=True) runs the model under CPU bf16 autocast: the fused loss is as accurate
    as HF's (fp32 math on bf16 operands; the CPU reference once rounded each token's loss to bf16). Only
    the loss is patched, so both see the same hidden states; the oracle is float64 on them."""
    eager = build("llama", layers=1)
    ours = fuselm.hf.patch(clone(eager), rms_norm=False, rope=False, swiglu=False)
    ids, labels = _batch(t=64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hf = eager(input_ids=ids, labels=labels, output_hidden_states=True)
        fused = ours(input_ids=ids, labels=labels)
    hidden = hf.hidden_states[-1].to(torch.bfloat16).double()
    logits = hidden @ eager.lm_head.weight.to(torch.bfloat16).double().T
    target = F.pad(labels, (0, 1), value=-100)[:, 1:]
    oracle = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
    assert fused.loss.dtype == torch.float32
    assert_numerics("loss", fused.loss, hf.loss, oracle, torch.float32)


# ---- 9. label smoothing, memory ----


def test_label_smoothing_through_patch_matches_trainer_label_smoother(tmp_path):
    """Trainer(label_smoothing_factor=0.1) on HF's model vs fuselm.hf.patch(model, label_smoothing=0.1)
    under Trainer(label_smoothing_factor=0): the same logged losses and trained weights."""
    pytest.importorskip("accelerate")
    ref, eager, ours = _three(_small(), label_smoothing=0.1)
    trained = []
    for model in (ref, eager, ours):
        smoothing = 0.0 if model is ours else 0.1
        args = _trainer_args(tmp_path / str(id(model)), label_smoothing_factor=smoothing)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=_rows())
        trainer.train()
        trained.append(_logged(trainer))
    assert trained[1].shape == (2,)
    assert_numerics("logged losses", trained[2], trained[1], trained[0], torch.float32)
    params = [dict(m.named_parameters()) for m in (ref, eager, ours)]
    for name in params[1]:
        assert_numerics(name, params[2][name], params[1][name], params[0][name], torch.float32)


def test_label_smoother_bypassing_the_fused_loss_warns_once(tmp_path):
    """Trainer's label smoother pops the labels: the patched model trains without them, the full logits
    are made; one warning says what to do."""
    pytest.importorskip("accelerate")
    model = fuselm.hf.patch(_small())
    args = _trainer_args(tmp_path, label_smoothing_factor=0.1)
    with pytest.warns(UserWarning, match="training without labels") as record:
        transformers.Trainer(model=model, args=args, train_dataset=_rows()).train()
    assert sum("training without labels" in str(w.message) for w in record) == 1


def test_patch_options_reach_the_fused_loss(monkeypatch):
    seen = []
    fused = loss.linear_cross_entropy

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return fused(*args, **kwargs)

    monkeypatch.setattr(loss, "linear_cross_entropy", spy)
    model = fuselm.hf.patch(_small(), label_smoothing=0.2, memory=2**20, accum_dtype=torch.float32)
    ids, labels = _batch()
    model(input_ids=ids, labels=labels)
    assert seen and seen[0]["label_smoothing"] == 0.2 and seen[0]["memory"] == 2**20
    assert seen[0]["accum_dtype"] == torch.float32


def test_label_smoothing_on_logits():
    """cross_entropy=True (loss on HF's logits) takes label_smoothing too: PyTorch's formula."""
    model = fuselm.hf.patch(_small(), linear_cross_entropy=False, cross_entropy=True, label_smoothing=0.1)
    ids, labels = _batch()
    model.train()
    out = model(input_ids=ids, labels=labels)
    target = F.pad(labels, (0, 1), value=-100)[:, 1:].reshape(-1)
    want = F.cross_entropy(out.logits.reshape(-1, VOCAB).double(), target, label_smoothing=0.1)
    eager = F.cross_entropy(out.logits.reshape(-1, VOCAB), target, label_smoothing=0.1)
    assert_numerics("loss", out.loss, eager, want)


# ---- the generic head ----


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_moe_router_loss_and_output_class_as_hf(model_type):
    """HF's own forward adds router_aux_loss_coef * aux_loss to the fused loss: the output class, the
    aux loss and router logits are HF's; return_dict=False gives HF's tuple without logits."""
    models = _three(build(model_type, hidden=32))  # 2 layers: Qwen 3 MoE's first one is dense
    ids, labels = _batch()
    outs = _check_step(models, names=("loss", "aux_loss"), input_ids=ids, labels=labels)
    assert type(outs[2]) is type(outs[1]) and outs[2].logits is None
    assert outs[2].aux_loss is not None and outs[2].router_logits is not None
    as_tuple = models[2](input_ids=ids, labels=labels, return_dict=False)
    torch.testing.assert_close(as_tuple[0], outs[2].loss)
    torch.testing.assert_close(as_tuple[1], outs[2].aux_loss)


def test_multimodal_wrapper_with_an_image():
    """Gemma3ForConditionalGeneration on text with an image (pixel_values, image tokens): HF's output class
    with the image hidden states, the loss and every gradient (vision tower included) as HF's."""
    eager = build("gemma3", hidden=32, layers=1)
    config = eager.config
    ids, labels = _batch(t=16)
    ids[:, 2:6] = config.image_token_index  # one image: mm_tokens_per_image = 4 tokens
    labels = torch.where(ids == config.image_token_index, -100, labels)
    pixels = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(0))
    token_types = (ids == config.image_token_index).long()
    inputs = dict(input_ids=ids, pixel_values=pixels, token_type_ids=token_types, labels=labels)
    models = _three(eager)
    outs = _check_step(models, **inputs)
    assert type(outs[2]).__name__ == "Gemma3CausalLMOutputWithPast" and outs[2].logits is None
    assert outs[2].image_hidden_states is not None
    assert any("vision" in n for n in _grads(models[2]))


def test_head_facts_read_what_each_forward_applies():
    """The logit transforms are those HF's forward applies (its source), read from the config; Gemma 3's
    multimodal wrapper does not softcap although its text config carries the attribute."""
    facts = {
        name: causal_lm.head_facts(getattr(transformers, name).forward).transforms
        for name in (
            "LlamaForCausalLM",
            "GraniteForCausalLM",
            "CohereForCausalLM",
            "FalconH1ForCausalLM",
            "Gemma2ForCausalLM",
            "Gemma3ForConditionalGeneration",
        )
    }
    assert facts == {
        "LlamaForCausalLM": set(),
        "GraniteForCausalLM": {"logits_scaling"},
        "CohereForCausalLM": {"logit_scale"},
        "FalconH1ForCausalLM": {"lm_head_multiplier"},
        "Gemma2ForCausalLM": {"final_logit_softcapping"},
        "Gemma3ForConditionalGeneration": set(),
    }


@pytest.mark.parametrize("model_type", ["granite", "cohere", "falcon_h1"])
def test_scaled_logits_families(model_type):
    """Logits scaled by the config (divided by logits_scaling, times logit_scale / lm_head_multiplier):
    the scale folded into the hidden states gives HF's loss and gradients."""
    ids, labels = _batch()
    _check_step(_three(_small(model_type)), input_ids=ids, labels=labels)


# ---- GPU: the Triton path of the same loss ----


@pytest.mark.gpu
def test_gpu_fused_path_numerics_empty_batch_and_bad_labels():
    """On CUDA the patched loss runs the Triton kernels: loss and gradients as HF's; an all-ignored batch
    with num_items_in_batch = 0 leaves every gradient zero; a bad label raises ValueError in eager."""
    ref, eager, ours = (m.cuda() for m in _three(_small()))
    ids, labels = (a.cuda() for a in _batch())
    _check_step((ref, eager, ours), input_ids=ids, labels=labels)
    empty = torch.full_like(labels, -100)
    out = _step(ours, input_ids=ids, labels=empty, num_items_in_batch=torch.tensor(0, device="cuda"))
    assert torch.isnan(out.loss)
    assert all(torch.all(g == 0) for g in _grads(ours).values())
    labels[1, 3] = VOCAB
    with pytest.raises(ValueError, match=f"labels hold {VOCAB}"):
        ours(input_ids=ids, labels=labels)
