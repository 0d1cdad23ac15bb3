"""QLoRA through the trainers on CUDA: a 4-bit (NF4, double quantization) tiny Llama with PEFT LoRA
(all linear layers, dropout 0.1), trained by Hugging Face's Trainer and by TRL's SFTTrainer, with
``fuselm.hf.patch(model, checkpointing="offload")`` (and ``fuselm.trl.patch()`` for SFT): the logged losses
under the numerics rule against the same run without fuselm (bf16 compute) and a float32-compute reference
on the same quantized weights, and every LoRA layer ran fuselm's forward. bitsandbytes' CPU backend runs
the CPU variants of these paths (tests/hf/test_lora_patch.py); this is the CUDA one."""

from __future__ import annotations

import pytest
import torch
from kit import trl_models as tm
from kit.hf_models import nf4_config

from fuselm.ops._common.testing import assert_numerics

trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")
import fuselm.hf  # noqa: E402
import fuselm.trl  # noqa: E402

STEPS = 4


def quantized_lora(path, compute_dtype):
    from transformers import LlamaForCausalLM

    q = nf4_config(compute_dtype)
    model = LlamaForCausalLM.from_pretrained(
        path, quantization_config=q, dtype=compute_dtype, device_map={"": 0}
    )
    torch.manual_seed(1)
    cfg = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules="all-linear")
    return peft.get_peft_model(model, cfg)


def fuselm_lora_layers(model) -> tuple[int, int]:
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    return sum("lora_linear_forward" in getattr(m.forward, "__qualname__", "") for m in layers), len(layers)


def train(kind, path, tmp_path, compute_dtype, patched):
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments
    from trl import SFTConfig, SFTTrainer

    torch.manual_seed(0)
    model = quantized_lora(path, compute_dtype)
    if patched:
        fuselm.hf.patch(model, checkpointing="offload")
        assert fuselm_lora_layers(model)[0] == fuselm_lora_layers(model)[1] > 0
    common = dict(
        output_dir=str(tmp_path / f"{kind}-{patched}-{compute_dtype}"),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
        bf16=compute_dtype == torch.bfloat16,
        gradient_checkpointing=True,
        disable_tqdm=True,
    )
    tok = tm.tokenizer()
    if kind == "trainer":
        data = tm.language_modeling(32).map(lambda r: tok(r["text"]), remove_columns=["text"])
        trainer = Trainer(
            model=model,
            args=TrainingArguments(**common),
            train_dataset=data,
            data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
        )
    else:
        if patched:
            fuselm.trl.patch()
        trainer = SFTTrainer(
            model=model,
            args=SFTConfig(**common),
            train_dataset=tm.prompt_completion(32),
            processing_class=tok,
        )
    try:
        trainer.train()
    finally:
        fuselm.trl.unpatch()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == STEPS
    return torch.tensor(losses, dtype=torch.float64)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["trainer", "sft"])
def test_qlora_training_on_cuda(kind, tmp_path):
    path = tmp_path / "tiny"
    tm.model(hidden_size=64, intermediate_size=128).save_pretrained(path)
    reference = train(kind, path, tmp_path, torch.float32, patched=False)
    eager = train(kind, path, tmp_path, torch.bfloat16, patched=False)
    ours = train(kind, path, tmp_path, torch.bfloat16, patched=True)
    assert_numerics(f"{kind} losses", ours, eager, reference, torch.bfloat16)
