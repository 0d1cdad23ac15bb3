"""fuselm.integrations.trainer.capture_training_steps: transformers' Trainer (and TRL's SFTTrainer) with each
step's forward and backward replayed from CUDA graphs.

CPU: the arguments and the setups that cannot be captured are refused naming the cause (a CPU trainer among
them). Training runs, each twice: on CUDA graphs (GPU) and on graphs emulated on the CPU (kit.fake_graphs).
Three runs of the same steps from the same weights and data: a float64 reference (eager), the eager Trainer
and the Trainer with the switch, in fp32; every logged loss and gradient norm and every trained parameter
follow the numerics rule (docs/design.md section 5; the optimizer is SGD, as tests/trl/test_trl.py says
why): plain and fuselm-patched Llama, gradient accumulation 2 (with num_items_in_batch), PEFT LoRA, batches
of three shapes with max_graphs=2 (the third runs eagerly, said once), TRL's SFTTrainer. On the GPU only:
QLoRA (NF4) under bf16 autocast, its losses against the eager run's and an fp32-compute reference's."""

from __future__ import annotations

import copy
import doctest
import warnings

import pytest
import torch
from kit import skip_unless_fuselm_trl
from kit.fake_graphs import emulate
from kit.hf_models import build

import fuselm.hf
from fuselm.integrations import trainer as module
from fuselm.integrations.trainer import CapturedTrainingSteps, capture_training_steps
from fuselm.ops._common.testing import assert_numerics

transformers = pytest.importorskip("transformers")

VOCAB = 300


# ---- data ----


class Rows(torch.utils.data.Dataset):
    """Token rows of the given lengths (cycled): input_ids, labels (-100 on the first 3 tokens)."""

    def __init__(self, n: int, lengths=(12,), seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        self.rows = [torch.randint(3, VOCAB, (lengths[i % len(lengths)],), generator=g) for i in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        labels = self.rows[i].clone()
        labels[:3] = -100
        return {"input_ids": self.rows[i], "labels": labels}


def pad(rows):
    """Right-pads a batch to its longest row (labels -100, attention_mask 0 on the padding)."""
    length = max(len(r["input_ids"]) for r in rows)

    def padded(key, value):
        return torch.stack(
            [torch.nn.functional.pad(r[key], (0, length - len(r[key])), value=value) for r in rows]
        )

    mask = torch.stack([(torch.arange(length) < len(r["input_ids"])).long() for r in rows])
    return {"input_ids": padded("input_ids", 0), "labels": padded("labels", -100), "attention_mask": mask}


# ---- arguments and refused setups (CPU) ----


def _args(tmp_path, **kw):
    return transformers.TrainingArguments(
        str(tmp_path), report_to="none", save_strategy="no", disable_tqdm=True, **{"use_cpu": True, **kw}
    )


def _model(device="cpu", dtype=torch.float32):
    model = build("llama", dtype, device)
    model.config._attn_implementation = "sdpa"  # eager attention makes its mask from a host value
    return model


def _trainer(tmp_path, model=None, **kw):
    return transformers.Trainer(model=model or _model(), args=_args(tmp_path, **kw), train_dataset=Rows(8))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_graphs=0), "max_graphs must be an int >= 1, got 0"),
        (dict(max_graphs=2.0), "max_graphs must be an int >= 1, got 2.0"),
        (dict(warmup=0), "warmup must be an int >= 1, got 0"),
        (dict(warmup=True), "warmup must be an int >= 1, got True"),
    ],
)
def test_bad_arguments_are_named(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        capture_training_steps(_trainer(tmp_path), **kwargs)
    with pytest.raises(ValueError, match="trainer must be a transformers.Trainer"):
        capture_training_steps(_model())


def test_a_cpu_trainer_is_refused(tmp_path):
    """Without CUDA the switch says why and leaves the trainer as it was (it trains eagerly)."""
    trainer = _trainer(tmp_path)
    with pytest.raises(ValueError, match="the trainer runs on cpu; CUDA graphs hold GPU work only"):
        capture_training_steps(trainer)
    assert "training_step" not in vars(trainer)


@pytest.mark.parametrize(
    "setup, message",
    [
        (
            "gradient_checkpointing",
            "gradient checkpointing is on: only fuselm's .* checkpointing='recompute'",
        ),
        ("eager", "the model's attention is 'eager': Hugging Face's eager attention makes its mask"),
        ("flash_attention_2", "the model's attention is 'flash_attention_2': flash attention unpads"),
        ("torch_compile", "torch_compile=True"),
        ("checkpointed_model", "gradient checkpointing is on"),
        ("planned_model", "gradient checkpointing is on"),
    ],
)
def test_setups_that_cannot_be_captured_are_refused(tmp_path, monkeypatch, setup, message):
    emulate(monkeypatch)  # the CPU counts as a capture device: the other causes are seen
    model, kwargs = _model(), {}
    if setup in ("eager", "flash_attention_2"):
        model.config._attn_implementation = setup
    elif setup == "checkpointed_model":
        model.gradient_checkpointing_enable()
    elif setup == "planned_model":  # checkpointing="auto": a plan's kept layers are not checked in a graph
        fuselm.hf.patch(model, checkpointing="auto", memory_budget=1.0)
        model.gradient_checkpointing_enable()
    else:
        kwargs[setup] = True
    trainer = _trainer(tmp_path, model, **kwargs)
    with pytest.raises(ValueError, match=f"capture_training_steps: {message}"):
        capture_training_steps(trainer)


def test_a_patched_model_that_trained_is_accepted(tmp_path, monkeypatch):
    """A patched model's training forward switches its attention to fuselm's SDPA (fuselm.hf.attention):
    still SDPA's kernels, so capturing its steps is allowed."""
    emulate(monkeypatch)
    model = fuselm.hf.patch(_model()).train()
    ids = torch.randint(3, 50, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    assert model.config._attn_implementation == "fuselm_sdpa"
    capture_training_steps(_trainer(tmp_path, model))


def test_the_model_is_checked_again_at_its_first_step(tmp_path, monkeypatch):
    emulate(monkeypatch)
    trainer = capture_training_steps(_trainer(tmp_path, max_steps=1))
    trainer.model.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="the model's attention is 'eager'"):
        trainer.train()


def test_docstring_example_runs():
    finder, runner = doctest.DocTestFinder(recurse=False), doctest.DocTestRunner()
    for test in finder.find(capture_training_steps, "capture_training_steps", globs={}):
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0


# ---- training: CUDA graphs on a GPU, emulated graphs on the CPU ----


COMMON = dict(optim="sgd", learning_rate=0.5, logging_steps=1, seed=0, dataloader_num_workers=0)


def _train(model, tmp_path, device, graphs, dataset, collator=None, max_graphs=4, **config):
    """One run of the Trainer (with the switch when ``graphs``): (per-step logs, trained parameters,
    the installed step or None)."""
    args = _args(tmp_path / f"run{graphs}", use_cpu=device == "cpu", **{**COMMON, **config})
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
    forward = vars(model).get("forward")  # fuselm's patch of the CausalLM is an instance forward
    if graphs:
        capture_training_steps(trainer, max_graphs=max_graphs, warmup=2)
    trainer.train()
    logs: dict[str, list[float]] = {}
    for entry in trainer.state.log_history:
        if "train_runtime" not in entry:
            for key in ("loss", "grad_norm"):
                logs.setdefault(key, []).append(entry[key])
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert vars(model).get("forward") is forward  # the routing is taken out after each step
    return logs, params, (trainer.training_step if graphs else None)


def _check(runs):
    """The numerics rule on every logged value and trained parameter: ``runs`` = (reference, eager, ours)."""
    (ref_logs, ref_params, _), (eager_logs, eager_params, _), (logs, params, _) = runs
    for key in ref_logs:
        values = [torch.tensor(r[key], dtype=torch.float64) for r in (logs, eager_logs, ref_logs)]
        assert_numerics(f"logged {key}", *values, torch.float32)
    assert ref_params.keys() == eager_params.keys() == params.keys() and params
    for name in ref_params:
        assert_numerics(f"trained {name}", params[name], eager_params[name], ref_params[name], torch.float32)


def _three_runs(make, tmp_path, device, **train):
    """Reference (float64, eager), eager (fp32) and captured (fp32) runs of the models ``make(dtype)``
    gives (the same weights)."""
    return [
        _train(make(torch.float64), tmp_path / "ref", device, False, **train),
        _train(make(torch.float32), tmp_path / "eager", device, False, **train),
        _train(make(torch.float32), tmp_path / "ours", device, True, **train),
    ]


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("patched", [False, True], ids=["hf", "fuselm"])
def test_trainer_steps_from_graphs_match_eager(tmp_path, graph_device, accumulation, patched):
    """Losses, gradient norms and trained parameters of the captured Trainer against the eager one; with
    gradient accumulation 2 the second micro-batch's gradients add to the first's (num_items_in_batch
    scales both: a tensor input of the graph)."""
    base = _model(graph_device)

    def make(dtype):
        model = copy.deepcopy(base).to(dtype)
        return fuselm.hf.patch(model) if patched and dtype != torch.float64 else model

    runs = _three_runs(
        make,
        tmp_path,
        graph_device,
        dataset=Rows(16),
        max_steps=4,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulation,
    )
    _check(runs)
    steps = runs[2][2]
    assert isinstance(steps, CapturedTrainingSteps)
    assert steps.graphs.replays == 4 * accumulation and steps.graphs.eager == 0
    (signature,) = steps.graphs.signatures
    items = [e for e in signature if e[:3] == ("tensor", "num_items_in_batch", ())]  # int64 in 5.17
    assert len(items) == 1 and items[0][4].type == torch.device(graph_device).type, signature


@pytest.mark.parametrize("checkpointing", [None, "recompute", "offload"])
def test_peft_lora(tmp_path, graph_device, checkpointing):
    """A PEFT LoRA model (patched: fuselm.lora's nodes inside the graphs), gradient accumulation 2: only the
    adapters train, as in the eager run; with Trainer's gradient checkpointing on, fuselm's recompute is
    captured too, its layer inputs on the device (checkpointing="recompute") or copied to host memory and
    back inside the graphs (checkpointing="offload")."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"],
        init_lora_weights=False,
    )  # fmt: skip
    torch.manual_seed(1)
    base = peft.get_peft_model(_model(graph_device), config)

    def make(dtype):
        model = copy.deepcopy(base).to(dtype)
        return fuselm.hf.patch(model, checkpointing=checkpointing) if dtype != torch.float64 else model

    runs = _three_runs(
        make,
        tmp_path,
        graph_device,
        dataset=Rows(16),
        max_steps=3,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        gradient_checkpointing=checkpointing is not None,
    )
    _check(runs)
    assert all("lora_" in name for name in runs[2][1])
    assert runs[2][2].graphs.replays == 6 and runs[2][2].graphs.eager == 0


@pytest.mark.gpu
def test_qlora(tmp_path):
    """A QLoRA model (NF4 with double quantization, PEFT LoRA on every linear, patched: fuselm.lora's
    dequantizing nodes inside the graphs) under Trainer's bf16 autocast, gradient accumulation 2: the
    captured run's losses against the eager run's and an fp32-compute reference's, on the same weights."""
    peft = pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    from kit import trl_models as tm
    from kit.hf_models import nf4_config

    path = tmp_path / "tiny"
    tm.model(hidden_size=64, intermediate_size=128, vocab_size=VOCAB).save_pretrained(path)

    def run(compute_dtype, graphs):
        model = transformers.LlamaForCausalLM.from_pretrained(
            path, quantization_config=nf4_config(compute_dtype), dtype=compute_dtype, device_map={"": 0},
            attn_implementation="sdpa",
        )  # fmt: skip
        torch.manual_seed(1)
        config = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear")
        model = fuselm.hf.patch(peft.get_peft_model(model, config))
        args = _args(
            tmp_path / f"{compute_dtype}{graphs}", use_cpu=False, **{**COMMON, "learning_rate": 0.1},
            max_steps=4, per_device_train_batch_size=2, gradient_accumulation_steps=2,
            bf16=compute_dtype == torch.bfloat16,
        )  # fmt: skip
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Rows(16, seed=2))
        if graphs:
            capture_training_steps(trainer, max_graphs=1, warmup=2)
        trainer.train()
        if graphs:
            assert trainer.training_step.graphs.replays == 8 and trainer.training_step.graphs.eager == 0
        return torch.tensor(
            [e["loss"] for e in trainer.state.log_history if "loss" in e], dtype=torch.float64
        )

    reference, eager, ours = run(torch.float32, False), run(torch.bfloat16, False), run(torch.bfloat16, True)
    assert len(ours) == 4
    assert_numerics("losses", ours, eager, reference, torch.bfloat16)


def test_new_shapes_are_captured_up_to_max_graphs_then_run_eagerly(tmp_path, graph_device):
    """Batches of 8, 12 and 16 tokens (in turn) with max_graphs=2: the first two shapes are captured, the
    third runs eagerly, said once; the run still matches the eager one (eager and replayed micro-batches
    accumulate together)."""
    base = _model(graph_device)
    train = dict(
        dataset=Rows(24, lengths=(8, 8, 12, 10, 16, 16)),  # batches of 8, 12 (one row padded), 16 tokens
        collator=pad,
        max_graphs=2,
        max_steps=6,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        train_sampling_strategy="sequential",
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runs = _three_runs(lambda dtype: copy.deepcopy(base).to(dtype), tmp_path, graph_device, **train)
    _check(runs)
    ours = [str(w.message) for w in caught if "capture_training_steps" in str(w.message)]
    assert len(ours) == 1 and "beyond max_graphs=2 captured ones: it runs eagerly" in ours[0], ours
    graphs = runs[2][2].graphs
    assert len(graphs.signatures) == 2 and graphs.eager > 0 and graphs.replays > 0
    assert graphs.replays == 8 and graphs.eager == 4


def test_sft_trainer(tmp_path, graph_device):
    """TRL's SFTTrainer on prompt/completion pairs (loss on the completions), fuselm.trl's head and
    fuselm.hf's block kernels: the captured run against the eager one; TRL's head scores every position
    inside the graphs (no boolean-mask compaction)."""
    skip_unless_fuselm_trl()
    from kit import trl_models as tm
    from trl import SFTConfig, SFTTrainer

    path = tmp_path / "tiny-llama"
    tm.model(seed=0).save_pretrained(path)
    runs = []
    for kind, dtype, graphs in (("exact", torch.float64, False), ("fuselm", torch.float32, False),
                                ("fuselm", torch.float32, True)):  # fmt: skip
        args = SFTConfig(
            output_dir=str(tmp_path / f"{kind}{graphs}"),
            model_init_kwargs={"dtype": dtype, "attn_implementation": "sdpa"},
            pad_to_multiple_of=8,
            gradient_checkpointing=False,  # SFTConfig's default is True
            max_steps=4,
            per_device_train_batch_size=4,
            learning_rate=0.3,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            bf16=False,
            use_cpu=graph_device == "cpu",
            **{k: v for k, v in COMMON.items() if k != "learning_rate"},
        )
        fuselm.hf.patch("llama") if kind == "fuselm" else None
        try:
            with tm.lm_head(kind):
                trainer = SFTTrainer(
                    model=str(path),
                    args=args,
                    train_dataset=tm.prompt_completion(16),
                    processing_class=tm.tokenizer(),
                )
                if graphs:
                    capture_training_steps(trainer, max_graphs=4, warmup=2)
                trainer.train()
        finally:
            fuselm.hf.unpatch("llama")
        logs = {}
        for entry in trainer.state.log_history:
            if "train_runtime" not in entry:
                for key in ("loss", "grad_norm", "entropy", "mean_token_accuracy"):
                    logs.setdefault(key, []).append(entry[key])
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        runs.append((logs, params, trainer.training_step if graphs else None))
    _check(runs)
    graphs = runs[2][2].graphs
    assert graphs.replays == 4 and graphs.eager == 0 and graphs.signatures


def test_module_imports_neither_transformers_nor_trl():
    import subprocess
    import sys

    code = (
        "import sys, fuselm.integrations.trainer; "
        "assert 'transformers' not in sys.modules and 'trl' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert module.__all__ == ["capture_training_steps", "CapturedTrainingSteps"]
