"""fuselm.trl: TRL's trainers on fuselm's fused LM head.

Patching: patch / unpatch / is_patched round trips (the very object back), idempotence, the version
and contract checks, the adapter against TRL's kernel call by call.

Trainers (SFT, DPO, GRPO, KTO, RLOO): a few steps of each, three times from the same checkpoint with
the same seed (same data order, same sampled completions):
- reference: the model in float64, TRL's head replaced by its definition in float64 (full logits,
  log_softmax; :class:`ExactTrlHead`), so the whole step is float64;
- eager: fp32, TRL unpatched (TRL's own ChunkedLogProbFunction);
- ours: fp32 under fuselm.trl.patch().
Every logged value but clock readings (loss, grad norm, entropy, rewards, KL, log-probs, ...) and every
trained parameter follow the numerics rule: err(ours) <= 2 * err(eager) + atol[dtype] against the
reference (the optimizer is SGD: see COMMON). TRL's own kernel is spied on: called in the eager run,
never under the patch, where fuselm's op is called as many times instead.
"""

from __future__ import annotations

import doctest
import functools

import pytest
import torch

from fuselm.ops._common.testing import assert_numerics

trl = pytest.importorskip("trl")
from kit import trl_models as tm  # noqa: E402
from kit.oracles import ExactTrlHead  # noqa: E402
from trl.kernels.chunked_logprob import ChunkedLogProbFunction  # noqa: E402
from trl.trainer import utils as trl_utils  # noqa: E402

import fuselm.trl  # noqa: E402
from fuselm.trl import patching  # noqa: E402

# CPU in CI; on a GPU machine the same tests run TRL's and fuselm's Triton kernels
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]

# ---- heads and spies ----


@pytest.fixture(autouse=True)
def restore_trl():
    """Every test leaves TRL as it found it."""
    original = trl_utils._ChunkedLogProbFunction
    yield
    fuselm.trl.unpatch()
    trl_utils._ChunkedLogProbFunction = original


@pytest.fixture
def calls(monkeypatch):
    """Counts calls of TRL's kernel (its forward) and of fuselm's op (through the adapter), and records
    the dtypes of the hidden states fuselm's op gets."""
    counts = {"trl": 0, "fuselm": 0, "fuselm_dtypes": set()}
    trl_forward = ChunkedLogProbFunction.forward
    fuselm_op = patching.linear_log_probs

    @functools.wraps(trl_forward)
    def spy_trl(*args, **kwargs):
        counts["trl"] += 1
        return trl_forward(*args, **kwargs)

    def spy_fuselm(*args, **kwargs):
        counts["fuselm"] += 1
        counts["fuselm_dtypes"].add(args[0].dtype)
        return fuselm_op(*args, **kwargs)

    monkeypatch.setattr(ChunkedLogProbFunction, "forward", staticmethod(spy_trl))
    monkeypatch.setattr(patching, "linear_log_probs", spy_fuselm)
    return counts


# ---- patching ----


def test_import_does_not_import_trl():
    import subprocess
    import sys

    code = "import sys, fuselm.trl; assert 'trl' not in sys.modules and not fuselm.trl.is_patched()"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_patch_unpatch_round_trip():
    original = trl_utils._ChunkedLogProbFunction
    assert original is ChunkedLogProbFunction and not fuselm.trl.is_patched()
    fuselm.trl.patch()
    assert trl_utils._ChunkedLogProbFunction is fuselm.trl.FusedLogProbs and fuselm.trl.is_patched()
    fuselm.trl.patch()  # twice: a no-op
    fuselm.trl.patch(memory="min")  # only the plan changes
    assert trl_utils._ChunkedLogProbFunction is fuselm.trl.FusedLogProbs
    fuselm.trl.unpatch()
    assert trl_utils._ChunkedLogProbFunction is original and not fuselm.trl.is_patched()
    fuselm.trl.unpatch()  # twice: a no-op
    assert trl_utils._ChunkedLogProbFunction is original


@pytest.mark.parametrize("version", ["1.15.2", "0.29.0", "2.0.0", "2.0.0.dev0", "not-a-version"])
def test_unsupported_trl_version(monkeypatch, version):
    monkeypatch.setattr(trl, "__version__", version)
    with pytest.raises(RuntimeError, match=rf"supports trl >=1\.16,<2.*trl {version} is installed"):
        fuselm.trl.patch()
    assert not fuselm.trl.is_patched()


@pytest.mark.parametrize("version", ["1.16.0", "1.16.1", "1.17.0.dev0", "1.99"])
def test_supported_trl_version(monkeypatch, version):
    monkeypatch.setattr(trl, "__version__", version)
    fuselm.trl.patch()
    assert fuselm.trl.is_patched()


def test_changed_kernel_contract(monkeypatch):
    class Other(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight, targets):
            return hidden

    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", Other)
    with pytest.raises(RuntimeError, match="expects"):
        fuselm.trl.patch()
    assert trl_utils._ChunkedLogProbFunction is Other


def test_bad_arguments():
    for bad in ("fast", 0, True, 1.5e9):
        with pytest.raises(ValueError, match="^memory must be 'auto', 'min' or a positive int"):
            fuselm.trl.patch(memory=bad)
    hidden, weight, targets = torch.randn(3, 8), torch.randn(10, 8), torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="unknown"):
        outputs = ("log_probs", "lse")
        fuselm.trl.FusedLogProbs.apply(hidden, weight, None, targets, 1.0, 32768, None, 1.0, outputs)
    with pytest.raises(ValueError, match="outside"):  # TRL's kernel would return a wrong number
        fuselm.trl.FusedLogProbs.apply(hidden, weight, None, torch.tensor([1, 2, 10]), 1.0, 32768)


def test_docstring_example():
    finder, runner = doctest.DocTestFinder(recurse=False), doctest.DocTestRunner()
    for test in finder.find(fuselm.trl.FusedLogProbs, globs={"FusedLogProbs": fuselm.trl.FusedLogProbs}):
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0


# ---- the adapter against TRL's kernel, one call ----

# (temperature, softcap, logit_scale, bias)
SETTINGS = [(1.0, None, 1.0, False), (0.7, 30.0, 0.5, True), (1.3, 5.0, 2.0, False)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature, softcap, logit_scale, bias", SETTINGS)
def test_adapter_matches_trl_kernel(temperature, softcap, logit_scale, bias, device):
    """The 5 outputs and the gradients (upstream gradients on log-probs and entropy) of one call: fuselm
    through the adapter vs TRL's kernel (fp32) vs the definition in float64."""
    g = torch.Generator().manual_seed(0)
    n, h, v = 37, 24, 301
    x = torch.randn(n, h, generator=g, dtype=torch.float64)
    w = torch.randn(v, h, generator=g, dtype=torch.float64) / h**0.5 * 4
    b = torch.randn(v, generator=g, dtype=torch.float64) if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    t[::5] = (x @ w.T).argmax(-1)[::5]  # some targets are the argmax (is_top1 true)
    g_lp, g_ent = torch.randn(2, n, generator=g, dtype=torch.float64)
    x, w, b, t, g_lp, g_ent = (None if a is None else a.to(device) for a in (x, w, b, t, g_lp, g_ent))
    results = []
    runs = ((ExactTrlHead, torch.float64), (ChunkedLogProbFunction, torch.float32), (None, torch.float32))
    for fn, dtype in runs:
        leaves = [p.detach().to(dtype).requires_grad_() if p is not None else None for p in (x, w, b)]
        args = (*leaves, t, temperature, 64, softcap, logit_scale, patching.TRL_OUTPUTS)
        if fn is None:
            fuselm.trl.patch()
            fn = trl_utils._ChunkedLogProbFunction
        out = fn.apply(*args)
        fuselm.trl.unpatch()
        assert (
            out[0].dtype
            == out[1].dtype
            == out[2].dtype
            == out[3].dtype
            == (torch.float64 if dtype == torch.float64 else torch.float32)
        )
        assert out[4].dtype == torch.bool
        ((out[0] * g_lp.to(out[0].dtype)).sum() + (out[1] * g_ent.to(out[1].dtype)).sum()).backward()
        grads = [p.grad for p in leaves if p is not None]
        results.append((*out[:4], out[4].double(), *grads))
    ref, eager, ours = results
    names = [*patching.TRL_OUTPUTS, "d_hidden", "d_weight", "d_bias"]
    for name, o, e, r in zip(names, ours, eager, ref, strict=False):
        assert_numerics(name, o, e, r, torch.float32)
    assert ref[4].sum() > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("leaf_dtype", [torch.float32, torch.bfloat16])
def test_adapter_under_autocast(leaf_dtype, device):
    """Under bf16 autocast (mixed-precision training, fp32 or bf16 weights) the head computes in bf16, as
    TRL's does, and the gradients come back in the leaves' dtypes; numerics rule at bf16 against float64."""
    g = torch.Generator().manual_seed(1)
    n, h, v = 29, 32, 257
    x = torch.randn(n, h, generator=g, dtype=torch.float64)
    w = torch.randn(v, h, generator=g, dtype=torch.float64) / h**0.5 * 3
    t = torch.randint(0, v, (n,), generator=g)
    g_lp, g_ent = torch.randn(2, n, generator=g, dtype=torch.float64)
    x, w, t, g_lp, g_ent = (a.to(device) for a in (x, w, t, g_lp, g_ent))
    results = []
    for fn in (ExactTrlHead, ChunkedLogProbFunction, None):
        dtype = torch.float64 if fn is ExactTrlHead else leaf_dtype
        xx, ww = (p.detach().to(dtype).requires_grad_() for p in (x, w))
        if fn is None:
            fuselm.trl.patch()
            fn = trl_utils._ChunkedLogProbFunction
        autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=fn is not ExactTrlHead)
        with autocast:
            lp, ent, *_ = fn.apply(xx, ww, None, t, 0.9, 128, None, 1.0, ("log_probs", "entropy"))
        fuselm.trl.unpatch()
        assert fn is ExactTrlHead or lp.dtype == ent.dtype == torch.float32
        ((lp * g_lp.to(lp.dtype)).sum() + (ent * g_ent.to(ent.dtype)).sum()).backward()
        assert xx.grad.dtype == ww.grad.dtype == dtype
        results.append((lp, ent, xx.grad, ww.grad))
    ref, eager, ours = results
    for name, o, e, r in zip(["log_probs", "entropy", "d_hidden", "d_weight"], ours, eager, ref, strict=True):
        assert_numerics(name, o, e, r, torch.bfloat16)


def test_adapter_outputs_not_asked_are_none():
    x, w, t = torch.randn(4, 8), torch.randn(16, 8), torch.tensor([0, 3, 5, 15])
    fuselm.trl.patch()
    out = trl_utils._ChunkedLogProbFunction.apply(x, w, None, t, 1.0, 32768, None, 1.0, ("log_probs",))
    assert out[0].shape == (4,) and out[1:] == (None, None, None, None)


def test_adapter_empty_batch():
    """A micro-batch without a valid label (add_fused_lm_head's CUDA path hands the head 0 rows): empty
    outputs, and a backward through add_fused_lm_head's masked_scatter gives zero gradients, as TRL's."""
    fuselm.trl.patch()
    hidden, weight = torch.randn(0, 8, requires_grad=True), torch.randn(16, 8, requires_grad=True)
    out = trl_utils._ChunkedLogProbFunction.apply(
        hidden, weight, None, torch.zeros(0, dtype=torch.long), 1.0, 32768, None, 1.0, patching.TRL_OUTPUTS
    )
    assert [o.shape for o in out] == [(0,)] * 5
    mask = torch.zeros(2, 3, dtype=torch.bool)
    out[0].new_zeros(mask.shape).masked_scatter(mask, out[0]).sum().backward()
    assert hidden.grad.shape == (0, 8) and weight.grad is not None and not weight.grad.any()


def test_adapter_refuses_zero3_weights():
    weight = torch.randn(16, 8)
    weight.ds_status = "NOT_AVAILABLE"  # what DeepSpeed ZeRO-3 puts on its parameters
    with pytest.raises(NotImplementedError, match="ZeRO-3"):
        fuselm.trl.FusedLogProbs.apply(torch.randn(3, 8), weight, None, torch.tensor([1, 2, 3]), 1.0, 64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("when", ["before", "after"])
def test_add_fused_lm_head(calls, when, device):
    """A model given TRL's fused head by add_fused_lm_head (temperature 0.7; the config's
    final_logit_softcapping and logit_scale, which add_fused_lm_head reads from any config), patched before
    or after: the output fields, the loss and every parameter's gradient against TRL's and float64."""
    model = tm.model(seed=3, final_logit_softcapping=20.0, logit_scale=0.5)
    ids = torch.randint(3, tm.VOCAB, (3, 11), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[:, :4] = -100
    labels[1, 7:] = -100
    ids, labels = ids.to(device), labels.to(device)
    outputs = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    results = []
    for kind, dtype in (("exact", torch.float64), ("trl", torch.float32), ("fuselm", torch.float32)):
        m = tm.clone(model, dtype).to(device)
        if when == "before":
            with tm.lm_head(kind):
                trl_utils.add_fused_lm_head(m, temperature=0.7, outputs=outputs)
                out = m(input_ids=ids, labels=labels, fused_lm_head=True)
        else:
            trl_utils.add_fused_lm_head(m, temperature=0.7, outputs=outputs)
            with tm.lm_head(kind):
                out = m(input_ids=ids, labels=labels, fused_lm_head=True)
        (out.loss + out.entropy.sum() / 10).backward()
        fields = [out.loss, *(getattr(out, name).double() for name in outputs)]
        results.append((fields, {n: p.grad for n, p in m.named_parameters()}))
    assert calls["trl"] == 1 and calls["fuselm"] == 1
    (ref, ref_grads), (eager, eager_grads), (ours, ours_grads) = results
    for name, o, e, r in zip(("loss", *outputs), ours, eager, ref, strict=True):
        assert_numerics(name, o, e, r, torch.float32)
    for name in ref_grads:
        assert_numerics(f"d {name}", ours_grads[name], eager_grads[name], ref_grads[name], torch.float32)
    assert (ours[1] == 0).sum() == (labels[:, 1:] == -100).sum()  # zero on ignored positions


# ---- trainers: reference (float64) vs TRL (fp32) vs fuselm (fp32) ----


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny Llama saved once (fp32); every run loads it, so TRL builds its reference models too."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tm.model(seed=0).save_pretrained(path)
    return str(path)


# Plain SGD: the update is linear in the gradient, so the runs differ as much as their gradients do.
# (AdamW's first step divides each gradient coordinate by its own magnitude: a coordinate whose gradient
# is about AdamW's eps carries its rounding noise, whatever its relative size, into the parameter, and
# which of two equally rounded fp32 runs draws the larger noise is luck: measured up to 4x apart here.)
COMMON = dict(
    optim="sgd",
    logging_steps=1,
    report_to="none",
    save_strategy="no",
    use_cpu=True,
    bf16=False,
    seed=0,
    disable_tqdm=True,
    dataloader_num_workers=0,
)


def _train(config_cls, trainer_cls, kind, dtype, checkpoint, tmp_path, config, **trainer_kwargs):
    """One run; returns (per-step logs {key: [values]}, final trainable parameters {name: tensor})."""
    args = config_cls(
        output_dir=str(tmp_path / kind),
        model_init_kwargs={"dtype": dtype, "attn_implementation": "eager"},
        **{**COMMON, **config},
    )
    with tm.lm_head(kind):
        trainer = trainer_cls(model=checkpoint, args=args, processing_class=tm.tokenizer(), **trainer_kwargs)
        trainer.train()
    logs: dict[str, list[float]] = {}
    for entry in trainer.state.log_history:
        if "train_runtime" not in entry:
            for key, value in entry.items():
                logs.setdefault(key, []).append(value)
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return logs, params


TIMINGS = ("time", "runtime", "per_second")  # logged keys that are clock readings


def _check_runs(calls, run, skip=(), dtype=torch.float32):
    """Reference, TRL and fuselm runs of `run(kind, dtype)`: the spies, then the numerics rule on every
    logged value but clock readings (losses, gradient norms, entropies, rewards, ...) and on every trained
    parameter. Returns the reference run's logs."""
    ref_logs, ref_params = run("exact", torch.float64)
    assert calls["trl"] == 0 and calls["fuselm"] == 0
    eager_logs, eager_params = run("trl", torch.float32)
    assert calls["trl"] > 0 and calls["fuselm"] == 0  # TRL's kernel ran the unpatched run
    trl_calls = calls["trl"]
    ours_logs, ours_params = run("fuselm", torch.float32)
    assert calls["trl"] == trl_calls  # not once under the patch
    assert calls["fuselm"] == trl_calls  # fuselm's op instead, call for call
    assert ref_logs.keys() == eager_logs.keys() == ours_logs.keys()
    for key in ref_logs:
        if key not in skip and not any(word in key for word in TIMINGS):
            values = [
                torch.tensor(logs[key], dtype=torch.float64) for logs in (ours_logs, eager_logs, ref_logs)
            ]
            assert_numerics(f"logged {key}", *values, dtype)
    assert ref_params.keys() == eager_params.keys() == ours_params.keys() and ref_params
    for name in ref_params:
        ours, eager, ref = ours_params[name], eager_params[name], ref_params[name]
        assert_numerics(f"trained {name}", ours, eager, ref, dtype)
    return ref_logs


GPU = pytest.mark.gpu
SFT_MODES = ["completion_only", "padding_free", "peft", "autocast"]
SFT_MODES += [pytest.param("cuda", marks=GPU), pytest.param("cuda_autocast", marks=GPU)]


@pytest.mark.parametrize("mode", SFT_MODES)
def test_sft(calls, checkpoint, tmp_path, mode):
    """SFTTrainer on prompt/completion pairs (loss on the completions only); padding-free (one packed
    row, -100 at the document starts); LoRA adapters (the head's weight is frozen: no weight gradient);
    bf16 autocast on fp32 weights; on CUDA (Triton kernels on both sides, only valid rows scored)."""
    from trl import SFTConfig, SFTTrainer

    config = dict(max_steps=4, per_device_train_batch_size=4, learning_rate=0.3)
    kwargs = dict(train_dataset=tm.prompt_completion(16))
    if mode == "padding_free":
        config.update(padding_free=True, max_length=None)
    autocast = mode.endswith("autocast")
    if autocast:
        config["bf16"] = True  # fp32 weights, bf16 autocast (the reference run stays float64 throughout)
    if mode.startswith("cuda"):
        config["use_cpu"] = False
    if mode == "peft":
        from peft import LoraConfig

        kwargs["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        config["learning_rate"] = 1.0

    def run(kind, dtype):
        run_config = {**config, "bf16": False} if kind == "exact" else config
        return _train(SFTConfig, SFTTrainer, kind, dtype, checkpoint, tmp_path, run_config, **kwargs)

    logs = _check_runs(calls, run, dtype=torch.bfloat16 if autocast else torch.float32)
    assert calls["fuselm_dtypes"] == {torch.bfloat16 if autocast else torch.float32}
    assert logs["loss"][-1] < logs["loss"][0]


@pytest.mark.parametrize("rows", ["all", "valid"])
def test_dpo(calls, checkpoint, tmp_path, monkeypatch, rows):
    """DPOTrainer (sigmoid loss, WPO weights: every output of the head is used), reference model loaded from
    the checkpoint (its head runs under no_grad). rows="valid": add_fused_lm_head's CUDA path, where the
    head gets only the rows whose label is not -100 (on CPU it gets every row, ignored labels as 0)."""
    from trl import DPOConfig, DPOTrainer

    if rows == "valid":
        monkeypatch.setattr(trl_utils, "_use_triton", lambda device: True)  # only picks the rows

    config = dict(max_steps=3, per_device_train_batch_size=4, learning_rate=1.0, use_weighting=True)

    def run(kind, dtype):
        return _train(
            DPOConfig, DPOTrainer, kind, dtype, checkpoint, tmp_path, config, train_dataset=tm.preference(12)
        )

    logs = _check_runs(calls, run)
    assert logs["rewards/margins"][-1] > 0


def test_grpo(calls, checkpoint, tmp_path):
    """GRPOTrainer: completions sampled by HF generate at temperature 0.8, a Python reward, KL to a
    reference model loaded from the checkpoint (beta > 0). The same seed samples the same completions in
    the three runs (checked: lengths and rewards are logged and compared)."""
    from trl import GRPOConfig, GRPOTrainer

    config = dict(
        max_steps=3,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        temperature=0.8,
        beta=0.1,
        learning_rate=1.0,
    )

    def run(kind, dtype):
        return _train(
            GRPOConfig,
            GRPOTrainer,
            kind,
            dtype,
            checkpoint,
            tmp_path,
            config,
            reward_funcs=tm.reward_nouns,
            train_dataset=tm.prompts(12),
        )

    logs = _check_runs(calls, run)
    assert logs["kl"][-1] > 0  # the policy moved away from the reference model


def test_kto(calls, checkpoint, tmp_path):
    """KTOTrainer on unpaired desirable / undesirable completions, KL term from mismatched pairs,
    reference model loaded from the checkpoint."""
    from trl import KTOConfig, KTOTrainer

    config = dict(max_steps=3, per_device_train_batch_size=4, learning_rate=1.0)

    def run(kind, dtype):
        dataset = tm.unpaired_preference(12)
        return _train(KTOConfig, KTOTrainer, kind, dtype, checkpoint, tmp_path, config, train_dataset=dataset)

    _check_runs(calls, run)


def test_rloo(calls, checkpoint, tmp_path):
    """RLOOTrainer: sampled completions, a Python reward, leave-one-out baseline, KL to a reference model."""
    from trl import RLOOConfig, RLOOTrainer

    config = dict(
        max_steps=3,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        temperature=0.8,
        beta=0.1,
        learning_rate=1.0,
    )

    def run(kind, dtype):
        return _train(
            RLOOConfig,
            RLOOTrainer,
            kind,
            dtype,
            checkpoint,
            tmp_path,
            config,
            reward_funcs=tm.reward_nouns,
            train_dataset=tm.prompts(12),
        )

    # RLOO's logged loss is 0 up to rounding at every step (advantages summing to 0 times a ratio of 1): it
    # has no digits to compare; its gradient does (grad_norm and the parameters are compared).
    logs = _check_runs(calls, run, skip=("loss",))
    assert max(abs(x) for x in logs["loss"]) < 1e-6 and logs["kl"][-1] != 0


def test_sft_with_hf_patch(calls, checkpoint, tmp_path, monkeypatch):
    """fuselm.hf.patch("llama") (block kernels) and fuselm.trl.patch() (head) together on SFTTrainer: the
    model's norms, RoPE and MLP run fuselm's, the head fuselm.linear_log_probs, and fuselm.hf's CausalLM
    loss (linear_cross_entropy) never runs (TRL calls the backbone directly)."""
    from trl import SFTConfig, SFTTrainer

    import fuselm.hf
    from fuselm.hf import blocks, loss

    names = ("rms_norm", "apply_rotary", "gated_mlp")
    hf_calls = dict.fromkeys((*names, "linear_cross_entropy"), 0)
    for name in hf_calls:
        module = loss if name == "linear_cross_entropy" else blocks
        original = getattr(module, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            hf_calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    config = dict(max_steps=4, per_device_train_batch_size=4, learning_rate=0.3)

    def run(kind, dtype):
        if kind == "fuselm":
            fuselm.hf.patch("llama")
        try:
            kwargs = dict(train_dataset=tm.prompt_completion(16))
            return _train(SFTConfig, SFTTrainer, kind, dtype, checkpoint, tmp_path, config, **kwargs)
        finally:
            fuselm.hf.unpatch("llama")

    _check_runs(calls, run)
    assert {name for name in names if hf_calls[name] > 0} == set(names)
    assert hf_calls["linear_cross_entropy"] == 0
