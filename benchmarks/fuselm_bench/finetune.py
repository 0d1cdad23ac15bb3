"""LoRA / QLoRA fine-tuning benchmark: ``fuselm bench finetune``.

Provider against provider, reproducible: a random-init model of a named shape (``--models``: ``llama3-8b``
(default), ``llama3.2-1b``, ``qwen3-0.6b``, ``llama3-70b``: QLoRA only, saved 4-bit by
:mod:`fuselm_bench.nf4_checkpoint`; the shapes of :data:`fuselm_bench.e2e.MODELS`) is saved once
per run with a tokenizer to a local folder (``--model-dir``, else a temporary folder removed at the end;
nothing comes from the hub), then every (scenario, B x T, provider) loads it and trains LoRA adapters in
a fresh process:

- scenarios (``--scenarios``): ``qlora`` = bitsandbytes NF4 with double quantization, bf16 compute, the LM
  head not quantized (``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
  bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16,
  bnb_4bit_quant_storage=torch.bfloat16)``: the packed bytes stored as bf16, which FSDP2 shards on every
  torch); ``lora`` = a bf16 base;
- LoRA (PEFT's ``LoraConfig``): r = ``--rank`` (16), alpha = ``--lora-alpha`` (= r), dropout
  ``--lora-dropout`` (0), on q, k, v, o, gate, up, down projections, no bias; AdamW (fused on CUDA) on the
  trainable (LoRA) parameters, lr 1e-4; batch ``--shapes BxT`` (4 x 2048), ``labels = input_ids`` (random
  ids, the same batch every step and for every provider);
- providers: ``hf`` (transformers + PEFT, HF gradient checkpointing with ``use_reentrant=False``),
  ``liger`` (the same, Liger-Kernel's ``apply_liger_kernel_to_<family>`` applied before the model is
  loaded; CUDA only), ``fuselm`` (the same, then ``fuselm.hf.patch(peft_model)``, with
  ``checkpointing="offload"`` when fuselm's ``patch`` takes that option, else its documented equivalent
  ``fuselm.hf.offload.enable(model)``, when ``--offload`` is on, the default), ``unsloth`` (imported
  first in its worker; ``FastLanguageModel.from_pretrained(folder, max_seq_length=T,
  load_in_4bit=scenario == "qlora", dtype=torch.bfloat16)`` and
  ``FastLanguageModel.get_peft_model(..., use_gradient_checkpointing="unsloth")``; CUDA only). A provider
  that cannot be imported, or needs CUDA where there is none, is skipped with the reason.

Every worker runs with ``HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 USE_HUB_KERNELS=0
UNSLOTH_DISABLE_STATISTICS=1`` and, as
Unsloth sets it for itself, ``PYTORCH_ALLOC_CONF=expandable_segments:True`` (unless the parent's
environment sets an allocator configuration); Unsloth's worker also ``UNSLOTH_COMPILE_DISABLE=1`` unless
``--unsloth-compile`` (its per-block compile takes minutes: the eager figure is what fits in a call).

Per step, as ``fuselm bench e2e`` measures them (:func:`fuselm_bench.step_timing.run_steps`): wall (median of
``--steps`` (10) after ``--warmup`` (3)), the process's CPU time, the GPU kernel time and launches (a
``torch.profiler`` window of ``--profile-steps`` (2) after the timed ones), tokens/s; peak allocated and
reserved over the whole process (weights included); host pinned memory (``torch.cuda.host_memory_stats()``
peak of the pinned allocator when torch has it, else the growth of the process's resident set: the report
says which); the first losses; for fuselm which fused paths ran (the modules whose forward is fuselm's, by
qualified name, the LoRA layers among them, and fuselm's warnings).

Without CUDA a tiny config of the model (fp32) runs the path in seconds: ``lora``, and ``qlora`` when
bitsandbytes' 4-bit layers work on this CPU (probed in the parent; the report says when they do not).

``--world-size W`` (W > 1; ``hf`` and ``fuselm`` only, Liger and Unsloth refused): every case also runs on
a fresh group of W spawned ranks (:mod:`fuselm_bench.rank_group`: NCCL with one GPU per rank and NVLink
multicast off, gloo processes on a CPU). Each rank loads the same saved model, applies the provider and
PEFT as the one-process worker does, then FSDP2 (:func:`shard_fsdp2`: ``fully_shard`` per decoder layer,
then the root; fuselm patches before sharding, which keeps QLoRA's quantization state) and times the same
step on its own batch of B x T (rank 0's is the one-process batch; the global batch is W x B x T). A case
ends with an all-reduce of its status on every rank (a rank's error or OOM becomes the row's; a group stuck
in a collective after a rank said it failed is killed). The report ``finetune_ws<W>.{md,json,png}``
(:mod:`fuselm_bench.finetune_sharded`) gives each case's one-GPU row (the one-process path, same run) beside
its W-GPU row: step time (the slowest rank's median), tokens/s in all and per GPU, peak memory per rank,
tokens/s per GPU on W GPUs / on one, and the first losses of both.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib.util
import inspect
import json
import math
import os
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from fuselm.demo import training

from . import e2e, fresh_process, step_timing
from .arguments import UsageError, parse_list, parse_shapes
from .cases import GIB, Row
from .harness import SkipProvider, error_text, import_peer
from .report import DTYPE_NAMES, OFFLINE_ENV, md_table, ratio

NAME = "finetune"
DESCRIPTION = "LoRA / QLoRA fine-tuning steps (PEFT): HF vs + Liger vs + fuselm vs Unsloth"
PROVIDERS: tuple[str, ...] = ("hf", "liger", "fuselm", "unsloth")
DATA_PARALLEL_PROVIDERS: tuple[str, ...] = ("hf", "fuselm")  # --world-size: PEFT models sharded by hand
PROVIDER_TITLES = {"hf": "HF + PEFT", "liger": "+ Liger", "fuselm": "+ fuselm.hf.patch", "unsloth": "Unsloth"}
PROVIDER_DESCRIPTIONS = {
    "hf": "transformers + PEFT LoRA, HF gradient checkpointing (use_reentrant=False)",
    "liger": "the same + Liger-Kernel apply_liger_kernel_to_<family> (rope, rms_norm, swiglu, FLCE) before "
    "loading",
    "fuselm": "the same as hf, then fuselm.hf.patch(peft_model) (with --offload: checkpointing='offload', or "
    "fuselm.hf.offload.enable where patch has no such option)",
    "unsloth": "Unsloth FastLanguageModel.from_pretrained + get_peft_model(use_gradient_checkpointing="
    "'unsloth'), imported first in its worker",
}
SCENARIOS: tuple[str, ...] = ("qlora", "lora")


def split_provider(provider: str) -> tuple[str, float | None]:
    """``(provider, memory budget in GiB or None)`` of a provider name: ``fuselm@24`` is fuselm patched with
    ``checkpointing="auto", memory_budget=24`` (``--memory-budgets``); ValueError for another variant.

    Example:
        >>> split_provider("fuselm@24"), split_provider("hf")
        (('fuselm', 24.0), ('hf', None))
    """
    base, at, budget = provider.partition("@")
    if not at:
        return provider, None
    if base != "fuselm":
        raise ValueError(f"{provider!r}: only fuselm takes a memory budget (fuselm@<GiB>)")
    return base, float(budget)


def provider_title(provider: str) -> str:
    """The column title of a provider (a budget variant: the base title and its budget)."""
    base, budget = split_provider(provider)
    return PROVIDER_TITLES[base] + ("" if budget is None else f" @ {budget:g} GiB")


SCENARIO_TITLES = {"qlora": "QLoRA (NF4 base)", "lora": "bf16 LoRA"}
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SEED = 0
LR = 1e-4
RANK = 16
FIRST_LOSSES = 5
WORKER_TIMEOUT_S = 900.0
BUILD_TIMEOUT_S = 900.0
MARKER = "fuselm_bench_model.json"
FUSELM_PREFIX = "fuselm"


# ---- plans ----


@dataclass(frozen=True)
class FinetuneDefaults:
    """The suite's defaults on a device: full-size models in bf16 on a GPU, or tiny ones in fp32 on a CPU."""

    name: str
    tiny: bool
    models: tuple[str, ...]
    scenarios: tuple[str, ...]
    shapes: tuple[tuple[int, int], ...]
    warmup: int
    steps: int
    quick_warmup: int
    quick_steps: int
    profile_steps: int
    fused_adamw: bool

    @property
    def grid(self) -> tuple[tuple[str, str, int, int], ...]:
        return tuple((m, s, b, t) for m in self.models for s in self.scenarios for b, t in self.shapes)


GPU_PLAN = FinetuneDefaults(
    name="gpu",
    tiny=False,
    models=("llama3-8b",),
    scenarios=SCENARIOS,
    shapes=((4, 2048),),
    warmup=3,
    steps=10,
    quick_warmup=2,
    quick_steps=4,
    profile_steps=2,
    fused_adamw=True,
)
CPU_PLAN = FinetuneDefaults(
    name="cpu",
    tiny=True,
    models=("llama3-8b",),
    scenarios=SCENARIOS,
    shapes=((2, 32),),
    warmup=2,
    steps=2,
    quick_warmup=1,
    quick_steps=1,
    profile_steps=1,
    fused_adamw=False,
)
PLANS = {p.name: p for p in (GPU_PLAN, CPU_PLAN)}


# ---- the saved model and its tokenizer ----


def model_settings(model: str, tiny: bool) -> dict[str, Any]:
    """The config keyword arguments of ``model`` (:data:`fuselm_bench.e2e.MODELS`), with a pad token id
    (the last id of the vocabulary unless the shape has one)."""
    settings = e2e.MODELS[model].settings(tiny)
    settings.setdefault("pad_token_id", settings["vocab_size"] - 1)
    return settings


def saved_dtype(model: str, dtype: torch.dtype) -> str:
    """The name of what ``model``'s checkpoint holds: ``dtype``'s, or ``nf4`` for a 4-bit-only shape."""
    return "nf4" if e2e.MODELS[model].nf4_only else DTYPE_NAMES.get(dtype, str(dtype))


def model_folder(model_dir: str | Path, model: str, tiny: bool, dtype: torch.dtype) -> Path:
    """Where ``model`` is saved under ``model_dir``: ``<model>[-tiny]-<dtype or nf4>``."""
    return Path(model_dir) / f"{model}{'-tiny' if tiny else ''}-{saved_dtype(model, dtype)}"


def make_tokenizer(vocab_size: int, bos_id: int | None, eos_id: int, pad_id: int):
    """A word-level tokenizer with exactly ``vocab_size`` tokens (``t<i>`` for id i; ``<s>``, ``</s>``,
    ``<pad>`` and ``<unk>`` at their ids), as a ``PreTrainedTokenizerFast``: what ``from_pretrained`` of a
    local folder (Unsloth's included) needs beside the weights, built without a download.

    Example:
        >>> tok = make_tokenizer(16, 1, 2, 15)
        >>> len(tok), tok.eos_token_id, tok.pad_token_id, tok("t5 t9")["input_ids"]
        (16, 2, 15, [5, 9])
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = {eos_id: "</s>", pad_id: "<pad>"}
    if bos_id is not None:
        specials[bos_id] = "<s>"
    unk_id = next(i for i in range(vocab_size) if i not in specials)
    specials[unk_id] = "<unk>"
    if len(specials) != (4 if bos_id is not None else 3):
        raise ValueError(f"bos {bos_id}, eos {eos_id} and pad {pad_id} must be distinct ids")
    vocab = {specials.get(i, f"t{i}"): i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    names = {"eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
    if bos_id is not None:
        names["bos_token"] = "<s>"
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **names)


def save_model(
    model: str, tiny: bool, folder: Path, device: torch.device, dtype: torch.dtype, seed: int
) -> dict:
    """Build ``model`` (seeded random init, on ``device`` in ``dtype``), save it as safetensors with its
    tokenizer into ``folder`` and write the marker that :func:`saved_model_ok` checks; returns what was
    written (the marker's content). A 4-bit-only shape is drawn and quantized tensor by tensor
    (:mod:`fuselm_bench.nf4_checkpoint`): its bf16 weights are never held."""
    t0 = time.perf_counter()
    settings = model_settings(model, tiny)
    shape = e2e.MODELS[model]
    config = training.causal_lm_config(shape.family, settings, "sdpa")
    config.use_cache = True  # what a saved checkpoint says; the workers turn it off
    if shape.nf4_only:
        from .nf4_checkpoint import save_nf4_checkpoint

        save_nf4_checkpoint(config, folder, device, seed=seed)
    else:
        torch.manual_seed(seed)
        built = training.build_causal_lm(config, device, dtype)
        folder.mkdir(parents=True, exist_ok=True)
        built.save_pretrained(folder, safe_serialization=True)
        del built
    tokenizer = make_tokenizer(
        settings["vocab_size"],
        settings.get("bos_token_id"),
        settings["eos_token_id"],
        settings["pad_token_id"],
    )
    tokenizer.save_pretrained(folder)
    marker = {
        "model": model,
        "tiny": tiny,
        "dtype": saved_dtype(model, dtype),
        "seed": seed,
        "settings": settings,
        "bytes": sum(p.stat().st_size for p in folder.iterdir() if p.is_file()),
        "build_s": time.perf_counter() - t0,
    }
    (folder / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return marker


def saved_model_ok(folder: Path, model: str, tiny: bool, dtype: torch.dtype, seed: int) -> bool:
    """Does ``folder`` hold the saved model this run asks for (same shape, dtype and seed)?"""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    want = {"model": model, "tiny": tiny, "dtype": saved_dtype(model, dtype), "seed": seed}
    settings = json.loads(json.dumps(model_settings(model, tiny)))  # tuples -> lists, as in the marker
    return all(marker.get(k) == v for k, v in want.items()) and marker.get("settings") == settings


def ensure_saved_model(
    model_dir: Path, model: str, tiny: bool, dtype: torch.dtype, device: torch.device, seed: int = SEED
) -> tuple[Path, dict[str, Any]]:
    """The folder of ``model`` under ``model_dir``, saved now unless it already holds it. On CUDA the build
    runs in a worker process (``python -m fuselm_bench.finetune --build``), so this process holds no GPU
    memory; on a CPU (a tiny model) here. Returns the folder and what happened (``reused``, ``build_s``,
    ``bytes``). Raises ``RuntimeError`` if the build failed."""
    folder = model_folder(model_dir, model, tiny, dtype)
    if saved_model_ok(folder, model, tiny, dtype, seed):
        marker = json.loads((folder / MARKER).read_text())
        return folder, {"reused": True, "bytes": marker.get("bytes"), "build_s": None}
    if folder.exists():
        shutil.rmtree(folder)
    if device.type != "cuda":
        marker = save_model(model, tiny, folder, device, dtype, seed)
        return folder, {"reused": False, "bytes": marker["bytes"], "build_s": marker["build_s"]}
    args = [f"--model={model}", f"--folder={folder}", f"--dtype={DTYPE_NAMES[dtype]}", f"--seed={seed}"]
    args += ["--device=cuda"] + (["--tiny"] if tiny else [])
    data = fresh_process.run_worker(
        lambda result: [sys.executable, "-m", __name__, "--build", *args, f"--result={result}"],
        timeout=BUILD_TIMEOUT_S,
        prefix="fuselm-finetune-build-",
        env=base_env(),
    )
    if data.get("status") != "ok":
        raise RuntimeError(f"saving {model} to {folder} failed: {data.get('error')}")
    return folder, {"reused": False, "bytes": data.get("bytes"), "build_s": data.get("build_s")}


def build_main(argv: list[str]) -> int:
    """``python -m fuselm_bench.finetune --build ...``: :func:`save_model` in this fresh process; the
    result (or the error) as JSON to ``--result``."""
    p = argparse.ArgumentParser(prog="python -m fuselm_bench.finetune --build")
    p.add_argument("--build", action="store_true", required=True)
    p.add_argument("--model", choices=sorted(e2e.MODELS), required=True)
    p.add_argument("--folder", required=True)
    p.add_argument("--dtype", choices=sorted(fresh_process.DTYPES), required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), required=True)
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--result", required=True)
    args = p.parse_args(argv)
    try:
        device = torch.device(args.device)
        marker = save_model(
            args.model, args.tiny, Path(args.folder), device, fresh_process.DTYPES[args.dtype], args.seed
        )
        result = {"status": "ok", "bytes": marker["bytes"], "build_s": marker["build_s"]}
        code = 0
    except Exception as e:  # noqa: BLE001 - reported to the parent
        result, code = {"status": "error", "error": error_text(e, 300)}, 1
    Path(args.result).write_text(json.dumps(result) + "\n")
    return code


# ---- the environment of the workers ----


def base_env(unsloth_compile: bool = False) -> dict[str, str]:
    """What every worker runs with: no hub (:data:`fuselm_bench.report.OFFLINE_ENV`), no Unsloth statistics,
    Unsloth's allocator setting for every provider (unless the parent sets an allocator configuration),
    Unsloth's compile off unless asked."""
    env = {**OFFLINE_ENV, "UNSLOTH_DISABLE_STATISTICS": "1"}
    if not (os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF")):
        env["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"
    if not unsloth_compile:
        env["UNSLOTH_COMPILE_DISABLE"] = "1"
    return env


def worker_env(provider: str, extra: dict[str, Any] | None = None) -> dict[str, str]:
    """:func:`base_env` with ``--unsloth-compile`` (``extra["unsloth_compile"]``), on the GPU
    ``extra["gpu"]`` alone (``CUDA_VISIBLE_DEVICES``) when given."""
    env = base_env(bool((extra or {}).get("unsloth_compile")))
    if (extra or {}).get("gpu") is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(extra["gpu"])
    return env


UNSLOTH_BOOT = (
    "import sys\n"
    "try:\n"
    "    import unsloth  # first: it patches transformers, PEFT and TRL when imported\n"
    "    failed = None\n"
    "except Exception as e:\n"
    "    failed = f'{type(e).__name__}: {e}'\n"
    "from fuselm_bench.finetune import worker\n"
    "sys.exit(worker(sys.argv[1:], unsloth_failed=failed))\n"
)


def worker_prefix(provider: str) -> list[str]:
    """The command that starts a worker: Unsloth's imports ``unsloth`` before anything else."""
    if provider == "unsloth":
        return [sys.executable, "-c", UNSLOTH_BOOT]
    return [sys.executable, "-m", __name__]


# ---- one run (what a worker does) ----


def _enable_checkpointing(model) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # renamed activation_checkpointing_enable in 5.24
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _quantization(scenario: str):
    if scenario != "qlora":
        return None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_quant_storage=torch.bfloat16,  # shardable by FSDP2 (--world-size) on every torch
    )


def apply_fuselm(
    model, offload: bool, mlp_chunk_tokens: int | None = None, memory_budget: float | None = None
) -> str:
    """``fuselm.hf.patch(model)`` for the fuselm provider, with activation offloading when ``offload``:
    ``patch(model, checkpointing="offload")`` when ``patch`` has that parameter, else the documented
    equivalent ``fuselm.hf.offload.enable(model)`` when this fuselm has it (on top of HF's non-reentrant
    checkpointing, already on); with ``memory_budget`` (GiB), ``patch(model, checkpointing="auto",
    memory_budget=...)`` instead. Returns how the model checkpoints."""
    import fuselm.hf

    hf = "HF gradient checkpointing (use_reentrant=False)"
    chunks = {}
    if mlp_chunk_tokens is not None:  # the MLP over chunks of tokens (long sequences)
        if "mlp_chunk_tokens" not in inspect.signature(fuselm.hf.patch).parameters:
            raise SkipProvider("this fuselm has no patch(mlp_chunk_tokens=)")
        chunks = {"mlp_chunk_tokens": mlp_chunk_tokens}
        hf = f"{hf}, MLP in chunks of {mlp_chunk_tokens} tokens"
    if memory_budget is not None:
        if "memory_budget" not in inspect.signature(fuselm.hf.patch).parameters:
            raise SkipProvider("this fuselm has no patch(memory_budget=)")
        fuselm.hf.patch(model, checkpointing="auto", memory_budget=memory_budget, **chunks)
        return f"{hf} + fuselm.hf.patch(checkpointing='auto', memory_budget={memory_budget:g})"
    if not offload:
        fuselm.hf.patch(model, **chunks)
        return f"{hf}; --no-offload"
    if "checkpointing" in inspect.signature(fuselm.hf.patch).parameters:
        fuselm.hf.patch(model, checkpointing="offload", **chunks)
        return f"{hf} + fuselm.hf.patch(checkpointing='offload')"
    fuselm.hf.patch(model)
    try:
        from fuselm.hf import offload as hf_offload
    except ImportError:
        return (
            f"{hf}; this fuselm has no activation offloading (no patch(checkpointing=), no fuselm.hf.offload)"
        )
    hf_offload.enable(model)
    return f"{hf} + fuselm.hf.offload.enable(model) (layer inputs in pinned host memory)"


def load_peft_model(
    provider: str,
    folder: Path,
    scenario: str,
    seq: int,
    *,
    dtype: torch.dtype,
    device: torch.device,
    rank: int,
    alpha: float,
    dropout: float,
    seed: int,
    offload: bool,
    mlp_chunk_tokens: int | None = None,
    memory_budget: float | None = None,
) -> tuple[Any, str]:
    """The provider's LoRA model of the saved ``folder`` in training mode, and how it checkpoints
    (``mlp_chunk_tokens``: fuselm's MLP over chunks of tokens; ``memory_budget``: fuselm's activation plan
    under that many GiB; the other providers have no such options)."""
    cuda = device.type == "cuda"
    if provider in ("liger", "unsloth") and not cuda:
        raise SkipProvider("needs CUDA")
    marker = json.loads((folder / MARKER).read_text())
    prequantized = marker["dtype"] == "nf4"  # the checkpoint's own 4-bit layers and quantization_config
    if prequantized and scenario != "qlora":
        raise SkipProvider(f"{marker['model']} is saved 4-bit only (QLoRA)")
    alpha = int(alpha) if float(alpha).is_integer() else alpha  # LoraConfig's type: an int, as users pass it
    if provider == "unsloth":
        from unsloth import FastLanguageModel

        model, _ = FastLanguageModel.from_pretrained(
            model_name=str(folder), max_seq_length=seq, load_in_4bit=scenario == "qlora", dtype=torch.bfloat16
        )
        model = FastLanguageModel.get_peft_model(
            model,
            r=rank,
            target_modules=list(TARGET_MODULES),
            lora_alpha=alpha,
            lora_dropout=dropout,
            bias="none",
            use_gradient_checkpointing="unsloth",
            random_state=seed,
        )
        # model.train(), as a trainer does right after get_peft_model (for_training would re-resolve the
        # checkpointing mode get_peft_model just set)
        return model.train(), "Unsloth's ('unsloth': activations offloaded to host)"
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    family = e2e.MODELS[marker["model"]].family
    if provider == "liger":
        apply = import_peer(device, "liger_kernel.transformers", f"apply_liger_kernel_to_{family}")
        apply(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True)
    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": "sdpa"}
    kwargs["device_map"] = {"": device.index or 0} if cuda else {"": "cpu"}
    quantization = None if prequantized else _quantization(scenario)
    if quantization is not None:
        kwargs["quantization_config"] = quantization
    model = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
    model.config.use_cache = False
    _enable_checkpointing(model)
    torch.manual_seed(seed)  # the LoRA A matrices: the same init for every PEFT-based provider
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(TARGET_MODULES),
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, config)
    checkpointing = "HF gradient checkpointing (use_reentrant=False)"
    if provider == "fuselm":
        checkpointing = apply_fuselm(model, offload, mlp_chunk_tokens, memory_budget)
    return model.train(), checkpointing


def shard_fsdp2(peft_model, device: torch.device) -> str:
    """FSDP2 over the whole ``torch.distributed`` group, the standard recipe (tests/distributed/test_fsdp.py):
    ``fully_shard`` on each decoder layer, then on the root CausalLM under PEFT's wrappers (patched
    before: ``fuselm.hf.patch`` keeps each bitsandbytes 4-bit layer's quantization state on the layer, so
    QLoRA's packed weights shard like any parameter). Returns what was done, for the report."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world_size = torch.distributed.get_world_size()
    mesh = init_device_mesh(device.type, (world_size,))
    causal_lm = peft_model.get_base_model()
    layers = list(causal_lm.model.layers)
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(causal_lm, mesh=mesh)
    return (
        f"FSDP2 over {world_size} ranks: fully_shard on each of {len(layers)} decoder layers, then on "
        f"{type(causal_lm).__name__.removeprefix('FSDP')}"
    )


def _forward_name(fn: Any) -> tuple[str, str]:
    """(module, qualified name) of a forward (bound methods and partials looked through)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    return getattr(fn, "__module__", "") or "", getattr(fn, "__qualname__", "") or type(fn).__name__


def is_fuselm_forward(fn: Any) -> bool:
    """Is ``fn`` (a module's forward) fuselm's: its qualified name starts with ``fuselm``
    (``fuselm_LlamaMLP.forward``) or it is defined in a ``fuselm`` module?"""
    mod, qual = _forward_name(fn)
    return qual.startswith(FUSELM_PREFIX) or mod == FUSELM_PREFIX or mod.startswith(FUSELM_PREFIX + ".")


class CalledModules:
    """The modules whose ``__call__`` ran while the context was open (a global forward pre-hook: no module's
    own hook dictionaries change). A LoRA layer that a fused parent computes from its weights is never
    called; one that runs its own forward (PEFT's, or a fuselm instance forward) is.

    Example:
        >>> inner = torch.nn.Linear(2, 2)
        >>> with CalledModules() as called:
        ...     _ = inner(torch.ones(2))
        >>> id(inner) in called.ids
        True
    """

    def __init__(self) -> None:
        self.ids: set[int] = set()
        self._handle = None

    def __enter__(self) -> CalledModules:
        from torch.nn.modules.module import register_module_forward_pre_hook

        self._handle = register_module_forward_pre_hook(lambda module, args: self.ids.add(id(module)))
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()


def fused_forwards(model: torch.nn.Module, called: set[int] | None = None) -> dict[str, Any]:
    """Which of ``model``'s modules run a forward of fuselm's (:func:`is_fuselm_forward` of the instance
    ``forward`` or of its class's): their count, the distinct names with their counts, and the LoRA layers
    (modules with ``lora_A``). With ``called`` (ids of the modules called during a step,
    :class:`CalledModules`), also how the LoRA layers ran in that step: ``lora_layers_peft`` called with a
    forward that is not fuselm's (PEFT's, or a peer's), ``lora_layers_fused`` called with fuselm's,
    ``lora_layers_inside`` not called at all (computed inside a fused parent, e.g. fuselm's LoRA MLP), and
    ``fused_modules_ran`` (modules with fuselm's forward that were called).

    Example:
        >>> class fuselm_Lin(torch.nn.Linear):
        ...     def forward(self, x):
        ...         return super().forward(x)
        >>> out = fused_forwards(torch.nn.Sequential(torch.nn.Linear(2, 2), fuselm_Lin(2, 2)))
        >>> out["fused_modules"], out["modules"], out["fused_forwards"]
        (1, 3, {'fuselm_Lin.forward': 1})
    """
    counts: collections.Counter[str] = collections.Counter()
    modules = lora = ran = 0
    lora_ran = {"peft": 0, "fused": 0, "inside": 0}
    for module in model.modules():
        modules += 1
        fn = vars(module).get("forward") or type(module).forward
        fused = is_fuselm_forward(fn)
        if fused:
            mod, qual = _forward_name(fn)
            counts[qual if qual.startswith(FUSELM_PREFIX) else f"{mod}.{qual}"] += 1
            ran += called is not None and id(module) in called
        if hasattr(module, "lora_A"):
            lora += 1
            if called is not None:
                lora_ran["inside" if id(module) not in called else "fused" if fused else "peft"] += 1
    out: dict[str, Any] = {
        "fused_modules": sum(counts.values()),
        "modules": modules,
        "fused_forwards": dict(sorted(counts.items())),
        "lora_layers": lora,
    }
    if called is not None:
        out["fused_modules_ran"] = ran
        out.update({f"lora_layers_{k}": v for k, v in lora_ran.items()})
    return out


def host_memory(device: torch.device, rss_before: int | None) -> dict[str, Any]:
    """Host memory used by the run. On CUDA ``host_pinned_bytes``: the peak of torch's pinned (host)
    allocator when ``torch.cuda.host_memory_stats`` exists (``host_pinned_source`` names the key), plus the
    peak of fuselm's offload pool when the run imported it (it registers its large buffers), else the
    resident set's growth since ``rss_before`` (psutil), and the source says so; None off CUDA (no pinned
    memory there). The RSS figures (growth, peak) are kept in any case."""
    out: dict[str, Any] = {"host_pinned_bytes": None, "host_pinned_source": None}
    rss = _rss()
    out["rss_delta_bytes"] = None if rss is None or rss_before is None else rss - rss_before
    try:
        import resource

        out["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    except (ImportError, OSError):
        out["max_rss_bytes"] = None
    stats = None
    if device.type == "cuda" and hasattr(torch.cuda, "host_memory_stats"):
        try:
            stats = torch.cuda.host_memory_stats()
        except Exception:  # noqa: BLE001 - an older torch without the binding: RSS below
            stats = None
    keys = sorted(k for k in stats or {} if k.startswith("allocated_bytes") and k.endswith("peak"))
    if keys:
        out["host_pinned_bytes"] = int(stats[keys[0]])
        out["host_pinned_source"] = f"torch.cuda.host_memory_stats()['{keys[0]}'] (pinned allocator peak)"
        offload = sys.modules.get("fuselm.offload")  # page-locks its large buffers outside that allocator
        if device.type == "cuda" and offload is not None:
            out["host_pinned_bytes"] += offload.host_memory_stats()["peak_pinned_bytes"]
            out["host_pinned_source"] += " + fuselm.offload.host_memory_stats()['peak_pinned_bytes']"
    elif device.type == "cuda" and out["rss_delta_bytes"] is not None:
        out["host_pinned_bytes"] = out["rss_delta_bytes"]
        out["host_pinned_source"] = "psutil RSS after the steps - before loading (no pinned-allocator stats)"
    return out


def _rss() -> int | None:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # noqa: BLE001 - psutil missing: no RSS figures
        return None


def cap_memory(device: torch.device, gib: float) -> None:
    """Make the CUDA ``device`` act as a GPU of ``gib`` GiB for this process: allocations past it raise
    torch.cuda.OutOfMemoryError (``torch.cuda.set_per_process_memory_fraction``, which wants the device's
    index: ``"cuda"`` means the current device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total), index)


def train(
    plan: FinetuneDefaults,
    provider: str,
    model: str,
    scenario: str,
    batch: int,
    seq: int,
    *,
    dtype: torch.dtype,
    device: torch.device,
    warmup: int,
    steps: int,
    seed: int = SEED,
    model_dir: str,
    rank: int = RANK,
    alpha: float | None = None,
    dropout: float = 0.0,
    offload: bool = True,
    profile_steps: int | None = None,
    unsloth_compile: bool = False,
    unsloth_failed: str | None = None,
    memory_cap_gib: float | None = None,
    mlp_chunk_tokens: int | None = None,
    data_parallel: bool = False,
    gpu: int | None = None,
) -> dict[str, Any]:
    """Load the saved ``model`` as ``provider`` does for ``scenario``, train LoRA for ``warmup`` +
    ``steps`` + ``profile_steps`` steps, return the measurements (raises ``SkipProvider`` when the provider
    cannot run here).

    ``data_parallel``: this process is one rank of an initialized ``torch.distributed`` group (``fuselm
    bench finetune --world-size``): the loaded (and patched) model is sharded with FSDP2
    (:func:`shard_fsdp2`) before the optimizer is built, and the rank trains on its own batch (rank 0's is
    the single-process batch), so the group's global batch is world size x ``batch`` x ``seq``.
    ``gpu``: the GPU the parent gave this worker alone (:func:`worker_env`: it is this process's cuda:0)."""
    provider, memory_budget = split_provider(provider)
    if provider not in PROVIDERS:
        raise ValueError(f"unknown provider {provider!r}; known: {', '.join(PROVIDERS)}")
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; known: {', '.join(SCENARIOS)}")
    if provider == "unsloth" and unsloth_failed:
        raise SkipProvider(f"unsloth not importable ({unsloth_failed})")
    if provider in ("liger", "unsloth") and device.type != "cuda":
        raise SkipProvider("needs CUDA")
    if data_parallel and provider not in DATA_PARALLEL_PROVIDERS:
        raise ValueError(
            f"{provider} does not run under FSDP2 here; only {', '.join(DATA_PARALLEL_PROVIDERS)}"
        )
    process_rank = torch.distributed.get_rank() if data_parallel else 0
    folder = model_folder(
        model_dir, model, plan.tiny, torch.bfloat16 if device.type == "cuda" else torch.float32
    )
    if not (folder / MARKER).is_file():
        raise FileNotFoundError(f"no saved model in {folder} (the parent saves it before the workers run)")
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        if memory_cap_gib is not None:
            cap_memory(device, memory_cap_gib)
    rss_before = _rss()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        peft_model, checkpointing = load_peft_model(
            provider,
            folder,
            scenario,
            seq,
            dtype=dtype,
            device=device,
            rank=rank,
            alpha=float(rank if alpha is None else alpha),
            dropout=dropout,
            seed=seed,
            offload=offload,
            mlp_chunk_tokens=mlp_chunk_tokens,
            memory_budget=memory_budget,
        )
        sharding = shard_fsdp2(peft_model, device) if data_parallel else None
        load_s = time.perf_counter() - t0
        weights = torch.cuda.memory_allocated(device) if cuda else None
        params = [p for p in peft_model.parameters() if p.requires_grad]  # after sharding: FSDP's DTensors
        gen = torch.Generator().manual_seed(seed + 1 + process_rank)
        vocab = peft_model.config.vocab_size
        ids = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)

        def forward(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            loss = peft_model(input_ids=x, labels=x).loss
            return loss, loss.detach()

        step = step_timing.optimizer_step(forward, params, [ids], lr=LR, fused=plan.fused_adamw and cuda)
        called = CalledModules()

        def first_step_watched(i: int) -> torch.Tensor:
            if i != 0:
                return step(i)
            with called:  # which modules the first (warmup, untimed) step calls
                return step(0)

        profiled = plan.profile_steps if profile_steps is None else profile_steps
        if data_parallel:  # the ranks loaded at their own pace: start the steps together
            torch.distributed.barrier()
        run = step_timing.run_steps(
            first_step_watched, warmup=warmup, steps=steps, profiled=profiled, device=device
        )
    fuselm_warnings = list(
        dict.fromkeys(
            str(w.message)[:300] for w in caught if "fuselm" in str(w.message) or "fuselm" in w.filename
        )
    )
    out: dict[str, Any] = {
        "status": "ok",
        **e2e.step_figures(run, batch * seq, device),
        **fresh_process.memory_figures(device),
        **host_memory(device, rss_before),
        "weights_bytes": weights,
        "params": sum(p.numel() for p in peft_model.parameters()),
        "trainable_params": sum(p.numel() for p in params),
        "trainable_dtype": str(params[0].dtype).removeprefix("torch.") if params else None,
        "load_s": load_s,
        "checkpointing": checkpointing,
        "sharding": sharding,
        "memory_cap_gib": memory_cap_gib,
        "losses": run.logged,
        "first_loss": run.logged[0] if run.logged else None,
        "fuselm_warnings": fuselm_warnings[:20],
        "activation_plan": _activation_plan(peft_model),
        **fused_forwards(peft_model, called.ids),
    }
    return out


def _activation_plan(model) -> str | None:
    """fuselm's activation plan of ``model`` (``checkpointing="auto"``), as it reports it, or None."""
    try:
        from fuselm.hf import activation_plan
    except ImportError:
        return None
    plan = activation_plan.current(model)
    return None if plan is None else str(plan)


def worker(argv: list[str], unsloth_failed: str | None = None) -> int:
    """A worker process (``python -m fuselm_bench.finetune --worker ...``, or Unsloth's boot script):
    :func:`fresh_process.worker_main` of :data:`BENCH`; ``unsloth_failed``: why ``import unsloth`` failed
    (the provider is then skipped with that reason)."""
    bench = BENCH
    if unsloth_failed is not None:
        bench = _with_train(functools.partial(train, unsloth_failed=unsloth_failed))
    return fresh_process.worker_main(bench, argv)


def _with_train(fn) -> fresh_process.Bench:
    import dataclasses

    return dataclasses.replace(BENCH, train=fn)


# ---- the parent ----


@dataclass
class FinetuneRow(Row):
    """One (provider, model, scenario, B, T, repeat) result; ``status`` ok, oom, error or skipped."""

    SHAPE_FIELDS: ClassVar[tuple[str, ...]] = ("model", "scenario", "batch", "seq")
    SHAPE_DIMS: ClassVar[tuple[str, ...]] = ("model", "scenario", "B", "T")
    SHAPE_TITLE: ClassVar[str] = "model scenario B x T"
    SHAPE_FORMAT: ClassVar[str] = "{} {} {}x{}"
    TEXT_FIELDS: ClassVar[tuple[str, ...]] = ("model", "scenario")

    provider: str
    model: str
    scenario: str
    batch: int
    seq: int
    status: str
    repeat: int = 0
    tokens_per_s: float | None = None
    step_ms: float | None = None
    step_ms_all: list[float] = field(default_factory=list)
    cpu_ms: float | None = None
    gpu_ms: float | None = None
    launches: float | None = None
    memcpy_ms: float | None = None
    memcpys: float | None = None
    profile_steps: int | None = None
    top_kernels: list | None = None  # (name, ms/step, launches/step) of the profiled steps, most time first
    idle_ms: float | None = None  # the GPU idle between its kernels and copies, per profiled step
    top_idle: list | None = None  # (next event's name, idle ms/step, gaps/step), most idle first
    peak_bytes: int | None = None
    reserved_bytes: int | None = None
    weights_bytes: int | None = None
    host_pinned_bytes: int | None = None
    host_pinned_source: str | None = None
    rss_delta_bytes: int | None = None
    max_rss_bytes: int | None = None
    params: int | None = None
    trainable_params: int | None = None
    trainable_dtype: str | None = None
    load_s: float | None = None
    checkpointing: str | None = None
    first_loss: float | None = None
    losses: list[float] = field(default_factory=list)
    fused_modules: int | None = None
    fused_modules_ran: int | None = None
    modules: int | None = None
    fused_forwards: dict[str, int] = field(default_factory=dict)
    lora_layers: int | None = None
    lora_layers_peft: int | None = None
    lora_layers_fused: int | None = None
    lora_layers_inside: int | None = None
    fuselm_warnings: list[str] = field(default_factory=list)
    warmup_s: float | None = None
    wall_s: float | None = None
    memory_cap_gib: float | None = None  # set_per_process_memory_fraction's cap (max-context)
    activation_plan: str | None = None  # fuselm@<GiB>: what each decoder layer kept, recomputed, offloaded
    # "blocking" (a wait for the GPU sleeps) or "spin (why)": harness.blocking_sync
    gpu_wait: str | None = None
    error: str | None = None
    traceback: str | None = None
    # --world-size: the GPUs (ranks) of the step, each with its own batch of batch x seq. step_ms is the
    # slowest rank's median, tokens_per_s the group's (world_size x batch x seq / step), peak_bytes and
    # reserved_bytes the largest rank's; the other figures are rank 0's. One process: 1, the lists empty.
    world_size: int = 1
    sharding: str | None = None
    rank_step_ms: list[float | None] = field(default_factory=list)
    rank_peak_bytes: list[int | None] = field(default_factory=list)
    rank_first_losses: list[float | None] = field(default_factory=list)

    @property
    def tokens_per_s_per_gpu(self) -> float | None:
        return None if self.tokens_per_s is None else self.tokens_per_s / self.world_size

    @property
    def reserved_gib(self) -> float | None:
        return None if self.reserved_bytes is None else self.reserved_bytes / GIB

    @property
    def pinned_gib(self) -> float | None:
        return None if self.host_pinned_bytes is None else self.host_pinned_bytes / GIB

    def figures(self) -> tuple[str, str]:
        step = "—" if self.step_ms is None else f"{self.step_ms:.0f} ms"
        cpu = "" if self.cpu_ms is None else f" (CPU {self.cpu_ms:.0f} ms)"
        losses = ", ".join(f"{x:.4f}" for x in self.losses[:3])
        return f"{step}{cpu}, {e2e.fmt_tokens(self.tokens_per_s)} tok/s", f"losses {losses}"


def _precheck(provider: str, device: torch.device) -> str | None:
    """A reason to skip ``provider`` without starting a process (None: try it)."""
    if provider in ("liger", "unsloth"):
        if device.type != "cuda":
            return "needs CUDA"
        package = {"liger": "liger_kernel", "unsloth": "unsloth"}[provider]
        if importlib.util.find_spec(package) is None:
            return f"{package} not importable (pip install it, or put it on PYTHONPATH)"
    return None


BENCH = fresh_process.Bench(
    name=NAME,
    description=DESCRIPTION,
    providers=PROVIDERS,
    provider_descriptions=PROVIDER_DESCRIPTIONS,
    row_type=FinetuneRow,
    plan_flag="plan",
    plans=PLANS,
    train=train,
    timeout_s=WORKER_TIMEOUT_S,
    seed=SEED,
    versions=(
        "torch",
        "triton",
        "transformers",
        "peft",
        "bitsandbytes",
        "liger-kernel",
        "unsloth",
        "unsloth_zoo",
    ),
    peers={"unsloth": "Unsloth", "hf": "HF"},
    metrics={"time": ("step_ms", "time"), "peak": ("peak_bytes", "peak")},
    precheck=_precheck,
    worker_prefix=worker_prefix,
    worker_env=worker_env,
    variant_description="@{setting}: patch(checkpointing='auto', memory_budget={setting}) instead",
)


def bnb_cpu_4bit_works() -> str | None:
    """None when a bitsandbytes NF4 (double-quantized) layer runs forward and backward on this CPU, else
    why not."""
    try:
        import bitsandbytes as bnb

        layer = bnb.nn.Linear4bit(
            64, 64, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4", compress_statistics=True
        )
        layer.weight = bnb.nn.Params4bit(torch.randn(64, 64), requires_grad=False, quant_type="nf4")
        layer = layer.to("cpu")
        x = torch.randn(4, 64, requires_grad=True)
        layer(x).float().sum().backward()
        if x.grad is None or not torch.isfinite(x.grad).all():
            return "bitsandbytes 4-bit backward gave no finite gradient on the CPU"
    except Exception as e:  # noqa: BLE001 - whatever fails, qlora does not run here
        return f"bitsandbytes 4-bit does not run on this CPU ({error_text(e, 160)})"
    return None


# ---- report ----


def _ok(rows: list[Any]) -> list[Any]:
    return [r for r in rows if r.status == "ok"]


def loss_gap(report: fresh_process.CaseReport, provider: str, shape: tuple[Any, ...]) -> float | None:
    """max |loss_p - loss_hf| over the first :data:`FIRST_LOSSES` steps, the first ok repeat of each."""
    mine, hf = _ok(report.rows_of(provider, shape)), _ok(report.rows_of("hf", shape))
    if not mine or not hf or not mine[0].losses or not hf[0].losses:
        return None
    n = min(FIRST_LOSSES, len(mine[0].losses), len(hf[0].losses))
    return max(abs(a - b) for a, b in zip(mine[0].losses[:n], hf[0].losses[:n], strict=True))


def _gib(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f} GiB"


def headline_table(report: fresh_process.CaseReport, model: str, batch: int, seq: int) -> str:
    """The headline table of one (model, B x T): scenario rows x provider columns, ``ms, GiB`` (medians
    over the repeats; GiB = peak allocated), then fuselm / Unsloth and fuselm / HF (time, memory)."""
    providers = [p for p in report.providers if p not in report.skipped]
    head = ["scenario", *(provider_title(p) for p in providers)]
    head += ["fuselm / Unsloth (time, memory)", "fuselm / HF (time, memory)"]
    lines = []
    for scenario in SCENARIOS:
        shape = (model, scenario, batch, seq)
        if shape not in report.shapes:
            continue
        cells = [SCENARIO_TITLES[scenario]]
        for p in providers:
            rows = report.rows_of(p, shape)
            ok = _ok(rows)
            if not ok:
                cells.append({"oom": "OOM"}.get(rows[0].status, "error") if rows else "—")
                continue
            ms = fresh_process.median_of(ok, "step_ms")
            peak = fresh_process.median_of(ok, "peak_gib")
            cells.append(f"{ms:.0f} ms, {_gib(peak)}" if ms is not None else "—")
        for peer in ("unsloth", "hf"):
            mine, other = report.rows_of("fuselm", shape), report.rows_of(peer, shape)
            t = ratio(fresh_process.median_of(mine, "step_ms"), fresh_process.median_of(other, "step_ms"))
            m = ratio(
                fresh_process.median_of(mine, "peak_bytes"), fresh_process.median_of(other, "peak_bytes")
            )
            cells.append("—" if t is None else f"{t:.2f}x, " + ("—" if m is None else f"{m:.2f}x"))
        lines.append(cells)
    return md_table(head, lines)


def detail_table(report: fresh_process.CaseReport) -> str:
    """One line per (configuration, provider): ms/step (range), tokens/s, CPU / GPU ms/step, launches,
    bound by, peak allocated / reserved, host pinned, first losses, max |loss - HF's|, fused modules, note."""
    gpus = any(len(s) > len(FinetuneRow.SHAPE_FIELDS) for s in report.shapes)  # a --world-size report
    head = ["model", "scenario", "B x T", *(["GPUs"] if gpus else []), "provider", "ms/step", "tokens/s"]
    head += ["CPU ms/step", "GPU ms/step", "launches/step", "bound by", "peak alloc GiB", "peak reserved GiB"]
    head += ["host pinned GiB"]
    head += [f"first {FIRST_LOSSES} losses", "max abs diff vs HF", "fuselm modules ran (PEFT LoRA)", "note"]
    cuda = report.device_type == "cuda"
    lines = []
    for shape in report.shapes:
        model, scenario, b, t = shape[:4]
        for p in report.providers:
            rows = report.rows_of(p, shape)
            if not rows:
                continue
            ok = _ok(rows)
            gpu, wall = (fresh_process.median_of(rows, a) for a in ("gpu_ms", "step_ms"))
            gap = loss_gap(report, p, shape)
            first = ok[0] if ok else None
            fused = (
                "—"
                if first is None or first.fused_modules is None or p != "fuselm"
                else f"{first.fused_modules_ran} (PEFT LoRA {first.lora_layers_peft}/{first.lora_layers})"
            )
            status = "" if ok else {"oom": "OOM"}.get(rows[0].status, "error")
            lines.append(
                [
                    model,
                    scenario,
                    f"{b}x{t}",
                    *([str(shape[4])] if gpus else []),
                    p,
                    status or e2e.summary_cell(rows, "step_ms", lambda v: f"{v:.0f}"),
                    e2e.summary_cell(rows, "tokens_per_s", e2e.fmt_tokens),
                    e2e.summary_cell(rows, "cpu_ms", lambda v: f"{v:.0f}"),
                    e2e.summary_cell(rows, "gpu_ms", lambda v: f"{v:.0f}"),
                    e2e.summary_cell(rows, "launches", lambda v: f"{v:.0f}"),
                    (e2e.bound_by(gpu, wall, cuda) or "n/a") if ok else "—",
                    e2e.summary_cell(rows, "peak_gib", lambda v: f"{v:.2f}"),
                    e2e.summary_cell(rows, "reserved_gib", lambda v: f"{v:.2f}"),
                    e2e.summary_cell(rows, "pinned_gib", lambda v: f"{v:.2f}"),
                    "—" if first is None else ", ".join(f"{x:.4f}" for x in first.losses[:FIRST_LOSSES]),
                    "—" if gap is None else f"{gap:.1e}",
                    fused,
                    "; ".join(dict.fromkeys(fresh_process.note_cell(r) for r in rows if r.error)),
                ]
            )
    return md_table(head, lines)


def fused_paths_section(report: fresh_process.CaseReport) -> str:
    """For each configuration fuselm ran: which modules ran fuselm's forward (by name, with counts), and
    fuselm's warnings (what fell back, and why)."""
    lines = ["## What fuselm ran", ""]
    for shape in report.shapes:
        ok = _ok(report.rows_of("fuselm", shape))
        if not ok:
            continue
        r = ok[0]
        names = ", ".join(f"{n} x{c}" for n, c in r.fused_forwards.items()) or "none"
        lines.append(
            f"- {r.label(shape)}: {r.fused_modules_ran} modules ran fuselm's forward in the first "
            f"step ({r.fused_modules} of {r.modules} have it); of {r.lora_layers} LoRA layers, "
            f"{r.lora_layers_inside} ran inside a fused parent (never called), {r.lora_layers_fused} ran "
            f"fuselm's own forward, {r.lora_layers_peft} ran PEFT's; checkpointing: {r.checkpointing}; "
            f"forwards: {names}"
        )
        lines += [f"  - warning: {w}" for w in r.fuselm_warnings]
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def notes(report: fresh_process.CaseReport) -> list[str]:
    cuda = report.device_type == "cuda"
    extra = report.metadata.get("finetune", {})
    out = [
        f"LoRA r={extra.get('rank')}, alpha={extra.get('alpha')}, dropout={extra.get('dropout')} on "
        f"{', '.join(TARGET_MODULES)}; AdamW ({'fused' if cuda else 'not fused'}) on the trainable "
        f"parameters, lr {LR}; labels = input_ids (random ids, the same batch every step and provider, "
        f"seed {SEED}).",
        "qlora: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4', bnb_4bit_use_double_quant="
        "True, bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16), the LM head "
        "not quantized; lora: the base in the run's dtype.",
        "Each (configuration, provider) ran in a fresh process (Unsloth's imports unsloth first); "
        f"{report.repeats} repeat(s); cells are medians over the repeats (range in the details).",
        "ms/step: median of the timed steps, each between two device synchronizations; CPU ms/step: "
        "time.process_time() of the timed steps before each closing synchronization; GPU ms/step and "
        "launches/step: CUDA kernels in a torch.profiler window after the timed steps; bound by: GPU when "
        f"GPU >= {e2e.HOST_BOUND} x wall, else host.",
        "GiB: peak allocated = torch.cuda.max_memory_allocated() over the whole process (weights "
        "included); peak reserved = max_memory_reserved(); host pinned: "
        + (extra.get("host_pinned_source") or "see host_pinned_source in the JSON")
        + "; the JSON also has the resident set's growth (rss_delta_bytes).",
        f"first {FIRST_LOSSES} losses: the first ok repeat; max abs diff vs HF: over those steps (the LoRA "
        "B matrices start at zero: step 1 is the base model's loss).",
        "fuselm modules ran (PEFT LoRA): the modules whose forward is fuselm's (qualified name starting with "
        "fuselm, or defined in fuselm) that the first step called, and (x/y) the LoRA layers that ran "
        "PEFT's own forward in that step, of all; a LoRA layer a fused parent computes is never called.",
        f"Environment of every worker: {extra.get('env')}.",
    ]
    for model, info in (extra.get("model_folders") or {}).items():
        how = "reused" if info.get("reused") else f"saved in {info.get('build_s') or 0:.0f} s"
        size = (info.get("bytes") or 0) / GIB
        out.append(f"Saved model {model}: {info.get('folder')} ({how}, {size:.2f} GiB, safetensors).")
    if extra.get("scenario_note"):
        out.append(extra["scenario_note"])
    if not cuda:
        out.append("No CUDA: tiny models in fp32, no GPU or memory figures; Liger and Unsloth need CUDA.")
    return out


def markdown(report: fresh_process.CaseReport) -> str:
    """The whole report: header, the headline table per (model, B x T), details, fused paths, ratios,
    notes."""
    extra = report.metadata.get("finetune", {})
    models = list(dict.fromkeys(s[0] for s in report.shapes))
    facts = [f"model {e2e.MODELS[m].describe(report.plan.tiny)}" for m in models if m in e2e.MODELS]
    facts.append(
        f"steps per run: {report.warmup} warmup, {report.steps} timed, {extra.get('profile_steps')} profiled"
    )
    facts.append(
        f"fuselm: offload {'on' if extra.get('offload') else 'off'}; Unsloth: per-block compile "
        f"{'on' if extra.get('unsloth_compile') else 'off (UNSLOTH_COMPILE_DISABLE=1)'}"
    )
    facts += [
        f"merged rows of: `{m.get('command')}` ({m.get('date')}, {m.get('commit')})" for m in report.merged
    ]
    sections = []
    configs = list(dict.fromkeys((s[0], s[2], s[3]) for s in report.shapes))
    for model, b, t in configs:
        sections.append(
            f"## {model}, B{b} x {t}: ms per step, peak allocated GiB\n\n"
            + headline_table(report, model, b, t)
        )
    sections.append("## Details\n\n" + detail_table(report))
    fused = fused_paths_section(report)
    table = "\n\n".join(sections) + ("\n\n" + fused if fused else "")
    return fresh_process.markdown(
        BENCH,
        report,
        cpu_figures="**CPU figures** (no CUDA device): a tiny config, fp32; a smoke test of the path.",
        facts=facts,
        table=table,
        notes=notes(report),
    )


def to_json(report: fresh_process.CaseReport) -> dict[str, Any]:
    """All raw numbers and the metadata, JSON-ready (``loss_gaps``: max |loss - HF's| per configuration)."""
    gaps = [
        {
            **dict(zip(FinetuneRow.SHAPE_FIELDS, s, strict=True)),
            "provider": p,
            "max_abs_diff_vs_hf": loss_gap(report, p, s),
        }
        for s in report.shapes
        for p in report.providers
        if report.rows_of(p, s)
    ]
    plan = {"plan": report.plan.name, "finetune": report.metadata.get("finetune", {}), "loss_gaps": gaps}
    return fresh_process.report_json(BENCH, report, plan, notes(report))


def write_png(report: fresh_process.CaseReport, path: Path) -> None:
    """Bars of step time and peak memory per provider, one group per (model, scenario, B x T); with
    memory budgets (``fuselm@<GiB>`` providers), step time against peak memory instead."""
    if any(split_provider(p)[1] is not None for p in report.providers):
        write_budget_png(report, path)
        return
    fresh_process.write_bars(
        BENCH,
        report,
        path,
        panels=(("step_ms", "ms/step", 1.0), ("peak_gib", "peak allocated GiB", 1.0)),
        title=f" ({report.plan.name} plan)",
        width_per_shape=3.0,
        mark_failures=True,
    )


def write_budget_png(report: fresh_process.CaseReport, path: Path) -> None:
    """One panel per (model, scenario, B x T): each provider's step time (median ms) against its peak
    allocated GiB, fuselm's budgets joined by a line and labelled, the peers as marked points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(report.shapes)
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.0 * len(shapes), 4.2), squeeze=False)
    for ax, shape in zip(axes[0], shapes, strict=True):
        budgets = []
        for provider in report.providers:
            rows = _ok(report.rows_of(provider, shape))
            ms, gib = fresh_process.median_of(rows, "step_ms"), fresh_process.median_of(rows, "peak_gib")
            if ms is None or gib is None:
                continue
            base, budget = split_provider(provider)
            if budget is not None:
                budgets.append((gib, ms, budget))
                continue
            marker = {"unsloth": "*", "hf": "x", "liger": "^"}.get(base, "o")
            ax.scatter(
                [gib], [ms], marker=marker, s=120 if marker == "*" else 50, label=PROVIDER_TITLES[base]
            )
        if budgets:
            budgets.sort()
            ax.plot([b[0] for b in budgets], [b[1] for b in budgets], "o-", label="fuselm, memory_budget=")
            for gib, ms, budget in budgets:
                ax.annotate(
                    f"{budget:g} GiB", (gib, ms), textcoords="offset points", xytext=(4, 4), fontsize=8
                )
        ax.set_title(BENCH.row_type.label(shape), fontsize=9)
        ax.set_xlabel("peak allocated GiB")
        ax.set_ylabel("ms per step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"fuselm bench {NAME}: step time against memory ({report.plan.name} plan)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(report: fresh_process.CaseReport, out_dir: str | Path) -> dict[str, Path]:
    """Write ``finetune.md``, ``finetune.json`` and ``finetune.png`` into ``out_dir``; return their paths."""
    return fresh_process.write_report(
        NAME, out_dir, markdown(report), to_json(report), lambda path: write_png(report, path)
    )


# ---- command line ----


def grid(args: argparse.Namespace, plan: FinetuneDefaults) -> list[tuple[str, str, int, int]]:
    """``--models`` x ``--scenarios`` x ``--shapes`` (each default: the plan's). Raises ``UsageError``.

    Example:
        >>> grid(argparse.Namespace(models=None, scenarios="lora", shapes="1x2048,4x2048"), GPU_PLAN)
        [('llama3-8b', 'lora', 1, 2048), ('llama3-8b', 'lora', 4, 2048)]
    """
    models = (
        parse_list(args.models, list(e2e.MODELS), "model") if getattr(args, "models", None) else plan.models
    )
    scenarios = (
        parse_list(args.scenarios, SCENARIOS, "scenario")
        if getattr(args, "scenarios", None)
        else plan.scenarios
    )
    shapes = parse_shapes(args.shapes, 2) if args.shapes else plan.shapes
    for m in models:
        if e2e.MODELS[m].nf4_only and "qlora" not in scenarios:
            raise UsageError(f"{m} is saved 4-bit only: it runs --scenarios qlora")
    return [
        (m, s, b, t)
        for m in models
        for s in scenarios
        if s == "qlora" or not e2e.MODELS[m].nf4_only
        for b, t in shapes
    ]


def run_cli(args: argparse.Namespace, argv: list[str], group: Any = None) -> int:
    """``fuselm bench finetune``: ``--models``, ``--scenarios``, ``--shapes`` (BxT), ``--providers``,
    ``--rank``, ``--lora-alpha``, ``--lora-dropout``, ``--offload/--no-offload``, ``--unsloth-compile``,
    ``--model-dir``, ``--repeats`` (default 1), ``--steps``, ``--warmup``, ``--profile-steps``, ``--quick``,
    ``--dtype`` (CUDA; the CPU plan runs fp32), ``--device``, ``--out``, ``--merge``. Raises
    ``UsageError``. ``group``: the data-parallel run of ``--world-size`` (``finetune_sharded.GROUP``, which
    the registry's entry point passes: this module does not import that one)."""
    c = fresh_process.start_cli(BENCH, args, argv, plans=(GPU_PLAN, CPU_PLAN), grid=grid)
    cuda = c.device.type == "cuda"
    world_size = getattr(args, "world_size", None) or 1
    if world_size > 1:
        if group is None:
            raise UsageError("--world-size runs through fuselm_bench.finetune_sharded.run_cli")
        group.check(c, args, world_size)
    rank = getattr(args, "rank", None) or RANK
    alpha = float(getattr(args, "lora_alpha", None) or rank)
    dropout = getattr(args, "lora_dropout", None) or 0.0
    if not 0.0 <= dropout < 1.0:
        raise UsageError(f"--lora-dropout must be in [0, 1), got {dropout}")
    offload = True if getattr(args, "offload", None) is None else bool(args.offload)
    profile = getattr(args, "profile_steps", None)
    if profile is not None and profile < 0:
        raise UsageError(f"--profile-steps must be >= 0, got {profile}")
    profile = c.plan.profile_steps if profile is None else profile
    unsloth_compile = bool(getattr(args, "unsloth_compile", False))
    budgets = getattr(args, "memory_budgets", None)
    if budgets:  # fuselm once per budget: fuselm@<GiB> providers (checkpointing="auto")
        values = [parse_budget(b) for b in budgets.split(",")]
        c.providers = [*c.providers, *(f"fuselm@{b:g}" for b in values if f"fuselm@{b:g}" not in c.providers)]
    for provider in c.providers:  # fuselm@<GiB> named in --providers
        base, _, budget = provider.partition("@")
        if budget and (base != "fuselm" or parse_budget(budget) is None):
            raise UsageError(f"--providers: {provider!r}: only fuselm takes a memory budget (fuselm@<GiB>)")
    scenario_note = None
    if not cuda and any(s[1] == "qlora" for s in c.shapes):
        reason = bnb_cpu_4bit_works()
        if reason is not None:
            c.shapes = [s for s in c.shapes if s[1] != "qlora"]
            scenario_note = f"qlora not run on this CPU: {reason}; the CPU smoke runs lora only."
            print(scenario_note)
            if not c.shapes:
                raise UsageError(scenario_note)
    for version in ("peft", "bitsandbytes", "unsloth", "unsloth_zoo"):
        v = _version(version)
        if v:
            c.metadata[version] = v
    keep = args.model_dir is not None
    model_dir = Path(args.model_dir) if keep else Path(tempfile.mkdtemp(prefix="fuselm-finetune-models-"))
    save_dtype = torch.bfloat16 if cuda else torch.float32
    env = base_env(unsloth_compile)
    try:
        folders = {}
        for model in dict.fromkeys(s[0] for s in c.shapes):
            print(
                f"saving {model} ({'tiny, ' if c.plan.tiny else ''}{DTYPE_NAMES[save_dtype]}) to "
                f"{model_dir} ...",
                flush=True,
            )
            folder, info = ensure_saved_model(model_dir, model, c.plan.tiny, save_dtype, c.device)
            folders[model] = {"folder": str(folder), **info}
            print(f"  {'reused' if info['reused'] else 'saved'} {folder}", flush=True)
        c.extra.update(
            model_dir=str(model_dir),
            rank=rank,
            alpha=alpha,
            dropout=dropout,
            offload=offload,
            profile_steps=profile,
            unsloth_compile=unsloth_compile,
        )
        c.metadata["finetune"] = {
            "rank": rank,
            "alpha": alpha,
            "dropout": dropout,
            "offload": offload,
            "unsloth_compile": unsloth_compile,
            "profile_steps": profile,
            "env": " ".join(f"{k}={v}" for k, v in env.items()),
            "model_folders": folders,
            "model_dir_kept": keep,
            "scenario_note": scenario_note,
            "host_pinned_source": None,
        }
        if world_size > 1:
            env_ranks = group.env(c.device.type)
            c.metadata["finetune"]["group_env"] = " ".join(f"{k}={v}" for k, v in env_ranks.items())
        if not cuda:
            print(
                "No CUDA device in use: a tiny config in fp32 (a smoke test), not comparable to GPU results."
            )

        def write(report: fresh_process.CaseReport, out: Path) -> dict[str, Path]:
            sources = {r.host_pinned_source for r in report.rows if r.host_pinned_source}
            report.metadata["finetune"]["host_pinned_source"] = "; ".join(sorted(sources)) or None
            return write_report(report, out)

        if world_size > 1:
            report = group.run(c, world_size, progress=not args.no_progress)
        else:
            report = fresh_process.run_cli(
                BENCH, c, markdown=markdown, write=write, progress=not args.no_progress, write_each_row=True
            )
    finally:
        if not keep:
            shutil.rmtree(model_dir, ignore_errors=True)
    return fresh_process.exit_code(report)


def parse_budget(text: str) -> float:
    """One ``--memory-budgets`` value: GiB, a number > 0; UsageError otherwise.

    Example:
        >>> parse_budget("24"), parse_budget("7.5")
        (24.0, 7.5)
    """
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"--memory-budgets: {text!r} is not a number of GiB") from None
    if not (math.isfinite(value) and value > 0):
        raise UsageError(f"--memory-budgets: {text!r} must be a number of GiB > 0")
    return value


def _version(package: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:  # noqa: BLE001
        return None


if __name__ == "__main__":  # a worker: python -m fuselm_bench.finetune --worker ... (or --build ...)
    if "--build" in sys.argv[1:]:
        sys.exit(build_main(sys.argv[1:]))
    sys.exit(worker(sys.argv[1:]))
