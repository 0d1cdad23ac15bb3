"""``fuselm bench finetune``: LoRA / QLoRA fine-tuning steps, HF + PEFT vs + Liger vs + fuselm vs Unsloth."""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import math
import os
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import torch

from . import e2e, fresh_process, training
from .arguments import UsageError, parse_list, parse_shapes
from .cases import GIB
from .fresh_process import SEED, CaseReport, median_of
from .harness import SkipProvider, error_text
from .report import DTYPE_NAMES, OFFLINE_ENV, dtype_name, md_table, pyplot, ratio

NAME = "finetune"
DESCRIPTION = "LoRA / QLoRA fine-tuning steps (PEFT): HF vs + Liger vs + fuselm vs Unsloth"
PROVIDERS: tuple[str, ...] = ("hf", "liger", "fuselm", "unsloth")
PROVIDER_TITLES = {"hf": "HF + PEFT", "liger": "+ Liger", "fuselm": "+ fuselm.hf.patch", "unsloth": "Unsloth"}
PROVIDER_DESCRIPTIONS = {
    "hf": "transformers + PEFT LoRA, HF gradient checkpointing (use_reentrant=False)",
    "liger": "the same + Liger-Kernel apply_liger_kernel_to_<family> (rope, rms_norm, swiglu, FLCE) before "
    "loading",
    "fuselm": "the same as hf, then fuselm.hf.patch(peft_model) (with --offload: checkpointing='offload')",
    "unsloth": "Unsloth FastLanguageModel.from_pretrained + get_peft_model(use_gradient_checkpointing="
    "'unsloth'), imported first in its worker",
}
SCENARIOS: tuple[str, ...] = ("qlora", "lora")
SCENARIO_TITLES = {"qlora": "QLoRA (NF4 base)", "lora": "bf16 LoRA"}
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LR = 1e-4
RANK = 16
FIRST_LOSSES = 5
WORKER_TIMEOUT_S = 900.0  # also a build's
MARKER = "fuselm_bench_model.json"
GRAPH = "graph"  # fuselm@graph: checkpointing "offload" (--no-offload: "recompute") in CUDA graphs


def split_provider(provider: str) -> tuple[str, float | str | None]:
    """``(provider, its variant: GiB budget, GRAPH or None)``; UsageError for a bad or misplaced variant."""
    base, at, setting = provider.partition("@")
    if not at:
        return provider, None
    if base != "fuselm":
        raise UsageError(f"--providers: {provider!r}: only fuselm has variants (fuselm@<GiB>, fuselm@graph)")
    return base, GRAPH if setting == GRAPH else parse_budget(setting)


def describe_variant(setting: str) -> str:
    """What a fuselm@<setting> provider does instead of fuselm's default."""
    if setting == GRAPH:
        return "@graph: patch(checkpointing='offload'; --no-offload: 'recompute') replayed from CUDA graphs"
    return f"@{setting}: patch(checkpointing='auto', memory_budget={setting}) instead"


def provider_title(provider: str) -> str:
    """The column title of a provider (a variant: the base title and its budget, or CUDA graphs)."""
    base, variant = split_provider(provider)
    suffix = "" if variant is None else " (CUDA graphs)" if variant == GRAPH else f" @ {variant:g} GiB"
    return PROVIDER_TITLES[base] + suffix


DEFAULT_MODELS = ("llama3-8b",)
# shapes: (batch, sequence length), of each --models and --scenarios
GPU_PLAN = fresh_process.Plan("gpu", ((4, 2048),), 3, 10, 2, 4, profile_steps=2)
CPU_PLAN = fresh_process.Plan("cpu", ((2, 32),), 2, 2, 1, 1, profile_steps=1)


# ---- the saved model and its tokenizer ----


def model_settings(model: str, tiny: bool) -> dict[str, Any]:
    """``model``'s config keyword arguments, with a pad token id (default: the last id)."""
    settings = e2e.MODELS[model].settings(tiny)
    settings.setdefault("pad_token_id", settings["vocab_size"] - 1)
    return settings


def saved_dtype(model: str, dtype: torch.dtype) -> str:
    """What ``model``'s checkpoint holds: ``dtype``'s name, or ``nf4`` for a 4-bit-only shape."""
    return "nf4" if e2e.MODELS[model].nf4_only else dtype_name(dtype)


def model_folder(model_dir: str | Path, model: str, tiny: bool, dtype: torch.dtype) -> Path:
    """Where ``model`` is saved under ``model_dir``: ``<model>[-tiny]-<dtype or nf4>``."""
    return Path(model_dir) / f"{model}{'-tiny' if tiny else ''}-{saved_dtype(model, dtype)}"


def make_tokenizer(vocab_size: int, bos_id: int | None, eos_id: int, pad_id: int):
    """A word-level ``PreTrainedTokenizerFast`` of exactly ``vocab_size`` tokens (``t<i>``, the specials at
    their ids): what ``from_pretrained`` of a local folder (Unsloth's too) needs, built without a download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = {eos_id: "</s>", pad_id: "<pad>"} | ({bos_id: "<s>"} if bos_id is not None else {})
    specials[next(i for i in range(vocab_size) if i not in specials)] = "<unk>"
    if len(specials) != (4 if bos_id is not None else 3):
        raise ValueError(f"bos {bos_id}, eos {eos_id} and pad {pad_id} must be distinct ids")
    tokenizer = Tokenizer(models.WordLevel({specials.get(i, f"t{i}"): i for i in range(vocab_size)}, "<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    names = {"eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
    names.update({"bos_token": "<s>"} if bos_id is not None else {})
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **names)


def save_model(
    model: str, tiny: bool, folder: Path, device: torch.device, dtype: torch.dtype, seed: int
) -> dict:
    """Save ``model`` (seeded init; 4-bit-only shapes quantized per tensor), its tokenizer and marker."""
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
    ids = [settings.get("bos_token_id"), settings["eos_token_id"], settings["pad_token_id"]]
    make_tokenizer(settings["vocab_size"], *ids).save_pretrained(folder)
    marker = dict(model=model, tiny=tiny, dtype=saved_dtype(model, dtype), seed=seed, settings=settings)
    marker.update(bytes=sum(p.stat().st_size for p in folder.iterdir() if p.is_file()))
    marker.update(build_s=time.perf_counter() - t0)
    (folder / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return marker


def saved_model_ok(folder: Path, model: str, tiny: bool, dtype: torch.dtype, seed: int) -> dict | None:
    """The marker of ``folder`` if it holds this model (same shape, dtype and seed), else None."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    want = {"model": model, "tiny": tiny, "dtype": saved_dtype(model, dtype), "seed": seed}
    want["settings"] = json.loads(json.dumps(model_settings(model, tiny)))  # tuples -> lists, as saved
    return marker if all(marker.get(k) == v for k, v in want.items()) else None


def models_folder(model_dir: str | None, prefix: str) -> contextlib.AbstractContextManager[str]:
    """``--model-dir`` (kept), else a temporary folder removed at the end: where the models are saved."""
    if model_dir is not None:
        return contextlib.nullcontext(model_dir)
    return tempfile.TemporaryDirectory(prefix=prefix, ignore_cleanup_errors=True)


def ensure_saved_model(
    model_dir: str | Path, model: str, tiny: bool, dtype: torch.dtype, device: torch.device, seed: int = SEED
) -> tuple[Path, dict[str, Any]]:
    """The folder of ``model`` under ``model_dir``, saved now unless it holds it already: on CUDA in a worker
    process (``--build``: this process holds no GPU memory), on a CPU here."""
    folder = model_folder(model_dir, model, tiny, dtype)
    if marker := saved_model_ok(folder, model, tiny, dtype, seed):
        return folder, {"reused": True, "bytes": marker.get("bytes"), "build_s": None}
    if folder.exists():
        shutil.rmtree(folder)
    if device.type != "cuda":
        saved = save_model(model, tiny, folder, device, dtype, seed)
    else:
        spec = dict(model=model, tiny=tiny, folder=str(folder), dtype=DTYPE_NAMES[dtype], seed=seed)
        saved = fresh_process.run_worker(
            lambda result: [sys.executable, "-m", __name__, "--build", json.dumps(spec), str(result)],
            timeout=WORKER_TIMEOUT_S,
            prefix="fuselm-finetune-build-",
            env=base_env(),
        )
        if saved.get("status") != "ok":
            raise RuntimeError(f"saving {model} to {folder} failed: {saved.get('error')}")
    return folder, {"reused": False, "bytes": saved.get("bytes"), "build_s": saved.get("build_s")}


def build_main(argv: list[str]) -> int:
    """``--build <JSON: model, tiny, folder, dtype, seed> <result file>``: :func:`save_model` on CUDA."""
    _, spec, result_file = argv
    s = json.loads(spec)
    try:
        dtype, folder = fresh_process.DTYPES[s["dtype"]], Path(s["folder"])
        marker = save_model(s["model"], s["tiny"], folder, torch.device("cuda"), dtype, s["seed"])
        result = {"status": "ok", "bytes": marker["bytes"], "build_s": marker["build_s"]}
    except Exception as e:  # noqa: BLE001 - reported to the parent
        result = {"status": "error", "error": error_text(e, 300)}
    Path(result_file).write_text(json.dumps(result) + "\n")
    return 0 if result["status"] == "ok" else 1


# ---- the environment of the workers ----


def base_env(unsloth_compile: bool = False) -> dict[str, str]:
    """Every worker's: offline, no Unsloth statistics, Unsloth's allocator setting for every provider (unless
    the parent sets one), Unsloth's compile off unless asked."""
    env = {**OFFLINE_ENV, "UNSLOTH_DISABLE_STATISTICS": "1"}
    if not (os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF")):
        env["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"
    if not unsloth_compile:
        env["UNSLOTH_COMPILE_DISABLE"] = "1"
    return env


def worker_env(provider: str, extra: dict[str, Any] | None = None) -> dict[str, str]:
    """:func:`base_env`, on the GPU ``extra["gpu"]`` alone when given."""
    extra = extra or {}
    env = base_env(bool(extra.get("unsloth_compile")))
    if extra.get("gpu") is not None:
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
    """The command that starts a worker (Unsloth's imports ``unsloth`` first)."""
    return [sys.executable, "-c", UNSLOTH_BOOT] if provider == "unsloth" else [sys.executable, "-m", __name__]


# ---- one run (what a worker does) ----


def load_peft_model(case: fresh_process.WorkerCase, folder: Path) -> tuple[Any, str]:
    """The provider's LoRA model of the saved ``folder`` in training mode, and how it checkpoints;
    ``case.extra``: ``rank``, ``alpha``, ``dropout``, ``offload``, ``mlp_chunk_tokens`` (:func:`run_cli`),
    ``keep_outputs`` (False: offloaded recomputes keep no outputs, the least device memory)."""
    (provider, memory_budget), (_, scenario, _, seq) = split_provider(case.provider), case.shape
    device, seed, extra = case.device, case.seed, case.extra
    rank, offload, chunk = extra.get("rank", RANK), extra.get("offload", True), extra.get("mlp_chunk_tokens")
    alpha = float(rank if extra.get("alpha") is None else extra["alpha"])
    marker = json.loads((folder / MARKER).read_text())
    prequantized = marker["dtype"] == "nf4"  # the checkpoint's own 4-bit layers and quantization_config
    if prequantized and scenario != "qlora":
        raise SkipProvider(f"{marker['model']} is saved 4-bit only (QLoRA)")
    alpha = int(alpha) if alpha.is_integer() else alpha  # LoraConfig's type: an int, as users pass it
    lora = {"r": rank, "lora_alpha": alpha, "lora_dropout": extra.get("dropout", 0.0)}
    lora["target_modules"] = list(TARGET_MODULES)
    if provider == "unsloth":
        from unsloth import FastLanguageModel

        model, _ = FastLanguageModel.from_pretrained(
            model_name=str(folder), max_seq_length=seq, load_in_4bit=scenario == "qlora", dtype=torch.bfloat16
        )
        model = FastLanguageModel.get_peft_model(
            model, **lora, bias="none", use_gradient_checkpointing="unsloth", random_state=seed
        )
        # model.train(), as a trainer does right after get_peft_model (for_training would re-resolve the
        # checkpointing mode get_peft_model just set)
        return model.train(), "Unsloth's ('unsloth': activations offloaded to host)"
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if provider == "liger":
        e2e.apply_provider_before_build("liger", device, e2e.MODELS[marker["model"]].family)
    kwargs: dict[str, Any] = {"dtype": case.dtype, "attn_implementation": "sdpa"}
    kwargs["device_map"] = {"": device.index or 0} if device.type == "cuda" else {"": "cpu"}
    if scenario == "qlora" and not prequantized:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_quant_storage=torch.bfloat16,
        )
    model = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
    model.config.use_cache = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # renamed activation_checkpointing_enable in 5.24
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.manual_seed(seed)  # the LoRA A matrices: the same init for every PEFT-based provider
    model = get_peft_model(model, LoraConfig(**lora, bias="none", task_type="CAUSAL_LM"))
    how, options = "HF gradient checkpointing (use_reentrant=False)", {}
    if provider == "fuselm":  # fuselm.hf.patch(model); memory_budget: its variant, GiB or GRAPH
        import fuselm.hf
        import fuselm.offload

        if chunk is not None:  # the MLP over chunks of tokens (long sequences)
            options["mlp_chunk_tokens"] = chunk
            how += f", MLP in chunks of {chunk} tokens"
        if memory_budget == GRAPH or (memory_budget is None and offload):
            options["checkpointing"] = "offload" if offload else "recompute"
            how += f" + fuselm.hf.patch(checkpointing='{options['checkpointing']}')"
            if not extra.get("keep_outputs", True):  # the least device memory (max-context)
                fuselm.offload.set_kept_output_room(0)
                how += " + fuselm.offload.set_kept_output_room(0)"
        elif memory_budget is not None:
            options.update(checkpointing="auto", memory_budget=memory_budget)
            how += f" + fuselm.hf.patch(checkpointing='auto', memory_budget={memory_budget:g})"
        else:
            how += "; --no-offload"
        fuselm.hf.patch(model, **options)
    return model.train(), how


def fused_forwards(model: torch.nn.Module, called: set[int] | None = None) -> dict[str, Any]:
    """The modules whose ``forward`` is fuselm's (qualified name ``fuselm*``, or defined in fuselm):
    counts, distinct names with their counts, and the LoRA layers (modules with ``lora_A``)."""
    counts: collections.Counter[str] = collections.Counter()
    modules = lora = ran = 0
    lora_ran = {"peft": 0, "fused": 0, "inside": 0}
    for module in model.modules():
        modules += 1
        fn = vars(module).get("forward") or type(module).forward
        while isinstance(fn, functools.partial):  # bound methods and partials looked through
            fn = fn.func
        fn = getattr(fn, "__func__", fn)
        mod, qual = getattr(fn, "__module__", "") or "", getattr(fn, "__qualname__", "") or type(fn).__name__
        fused = qual.startswith("fuselm") or mod == "fuselm" or mod.startswith("fuselm.")
        if fused:
            counts[qual if qual.startswith("fuselm") else f"{mod}.{qual}"] += 1
            ran += called is not None and id(module) in called
        if hasattr(module, "lora_A"):
            lora += 1
            if called is not None:
                lora_ran["inside" if id(module) not in called else "fused" if fused else "peft"] += 1
    out: dict[str, Any] = {"fused_modules": sum(counts.values()), "modules": modules}
    out.update(fused_forwards=dict(sorted(counts.items())), lora_layers=lora)
    if called is not None:
        out["fused_modules_ran"] = ran
        out.update({f"lora_layers_{k}": v for k, v in lora_ran.items()})
    return out


def host_memory(device: torch.device, rss_before: int | None) -> dict[str, Any]:
    """Host memory of the run."""
    rss = _rss()
    out: dict[str, Any] = {"host_pinned_bytes": None, "host_pinned_source": None}
    out["rss_delta_bytes"] = None if rss is None or rss_before is None else rss - rss_before
    try:
        import resource

        out["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    except (ImportError, OSError):
        out["max_rss_bytes"] = None
    if device.type != "cuda":
        return out
    try:
        stats = torch.cuda.host_memory_stats()
    except Exception:  # noqa: BLE001 - an older torch without the binding: RSS below
        stats = {}
    keys = sorted(k for k in stats if k.startswith("allocated_bytes") and k.endswith("peak"))
    if keys:
        out["host_pinned_bytes"] = int(stats[keys[0]])
        out["host_pinned_source"] = f"torch.cuda.host_memory_stats()['{keys[0]}'] (pinned allocator peak)"
        offload = sys.modules.get("fuselm.offload")  # page-locks its large buffers outside that allocator
        if offload is not None:
            out["host_pinned_bytes"] += offload.host_memory_stats()["peak_pinned_bytes"]
            out["host_pinned_source"] += " + fuselm.offload.host_memory_stats()['peak_pinned_bytes']"
    elif out["rss_delta_bytes"] is not None:
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
    """Make the CUDA ``device`` act as a GPU of ``gib`` GiB for this process (allocations past it OOM)."""
    index = torch.cuda.current_device() if device.index is None else device.index
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * GIB / total), index)


def train(case: fresh_process.WorkerCase, unsloth_failed: str | None = None) -> dict[str, Any]:
    """A worker's run: load the saved model as the provider does, train LoRA (``extra["trainer"]``: through
    ``Trainer.train()``, fuselm@graph under ``capture_training_steps``); the measurements. ``case.extra``:
    ``model_dir``, ``memory_cap_gib`` and :func:`run_cli`'s settings."""
    provider, memory_budget = split_provider(case.provider)
    if provider not in PROVIDERS:
        raise ValueError(f"unknown provider {provider!r}; known: {', '.join(PROVIDERS)}")
    if provider == "unsloth" and unsloth_failed:
        raise SkipProvider(f"unsloth not importable ({unsloth_failed})")
    device, extra, trainer = case.device, case.extra, bool(case.extra.get("trainer"))
    cuda = device.type == "cuda"
    if (provider in ("liger", "unsloth") or memory_budget == GRAPH) and not cuda:
        raise SkipProvider("needs CUDA")
    folder = model_folder(
        extra["model_dir"], case.shape[0], case.plan.tiny, torch.bfloat16 if cuda else torch.float32
    )
    if not (folder / MARKER).is_file():
        raise FileNotFoundError(f"no saved model in {folder} (the parent saves it before the workers run)")
    memory_cap_gib = extra.get("memory_cap_gib")
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        if memory_cap_gib is not None:
            cap_memory(device, memory_cap_gib)
    rss_before = _rss()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        peft_model, checkpointing = load_peft_model(case, folder)
        load_s = time.perf_counter() - t0
        weights = torch.cuda.memory_allocated(device) if cuda else None
        params = [p for p in peft_model.parameters() if p.requires_grad]

        def forward(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            loss = peft_model(input_ids=x, labels=x).loss
            return loss, loss.detach()

        called: set[int] = set()  # the modules the first (warmup, untimed) step calls
        graphs, watched = memory_budget == GRAPH, None if trainer else called
        figures = e2e.run_training(
            case, peft_model, forward, params, lr=LR, trainer=trainer, graphs=graphs, called=watched
        )
    messages = (str(w.message)[:300] for w in caught if "fuselm" in str(w.message) or "fuselm" in w.filename)
    from fuselm.hf import activation_plan

    plan_of = activation_plan.current(peft_model)
    return {
        **figures,
        **host_memory(device, rss_before),
        "weights_bytes": weights,
        "params": sum(p.numel() for p in peft_model.parameters()),
        "trainable_params": sum(p.numel() for p in params),
        "trainable_dtype": str(params[0].dtype).removeprefix("torch.") if params else None,
        "load_s": load_s,
        "checkpointing": checkpointing,
        "memory_cap_gib": memory_cap_gib,
        "fuselm_warnings": list(dict.fromkeys(messages))[:20],
        "activation_plan": None if plan_of is None else str(plan_of),
        **fused_forwards(peft_model, None if trainer else called),
    }


def worker(argv: list[str], unsloth_failed: str | None = None) -> int:
    """A worker; ``unsloth_failed``: why Unsloth's boot script could not import it (a skip's reason)."""
    run = functools.partial(train, unsloth_failed=unsloth_failed)
    return fresh_process.worker_main(replace(BENCH, train=run), argv)


# ---- rows ----


@dataclass
class FinetuneRow(fresh_process.WorkerRow):
    """One (provider, model, scenario, B, T, repeat) result; ``status`` ok, oom, error or skipped."""

    SHAPE_FIELDS: ClassVar[tuple[str, ...]] = ("model", "scenario", "batch", "seq")
    SHAPE_DIMS: ClassVar[tuple[str, ...]] = ("model", "scenario", "B", "T")
    SHAPE_TITLE: ClassVar[str] = "model scenario B x T"
    SHAPE_FORMAT: ClassVar[str] = "{} {} {}x{}"

    provider: str
    model: str
    scenario: str
    batch: int
    seq: int
    status: str
    host_pinned_bytes: int | None = None
    host_pinned_source: str | None = None
    rss_delta_bytes: int | None = None
    max_rss_bytes: int | None = None
    trainable_params: int | None = None
    trainable_dtype: str | None = None
    load_s: float | None = None
    checkpointing: str | None = None
    fused_modules: int | None = None
    fused_modules_ran: int | None = None
    modules: int | None = None
    fused_forwards: dict[str, int] = field(default_factory=dict)
    lora_layers: int | None = None
    lora_layers_peft: int | None = None
    lora_layers_fused: int | None = None
    lora_layers_inside: int | None = None
    fuselm_warnings: list[str] = field(default_factory=list)
    memory_cap_gib: float | None = None  # set_per_process_memory_fraction's cap (max-context)
    activation_plan: str | None = None  # fuselm@<GiB>: what each decoder layer kept, recomputed, offloaded


def bnb_cpu_4bit_works() -> str | None:
    """None when a bitsandbytes NF4 layer runs forward and backward on this CPU, else why not."""
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


# ---- reports ----


def _ok(rows: list[Any]) -> list[Any]:
    return [r for r in rows if r.status == "ok"]


def loss_gap(report: CaseReport, provider: str, shape: tuple[Any, ...]) -> float | None:
    """max |loss_p - loss_hf| over the first :data:`FIRST_LOSSES` steps, the first ok repeat of each."""
    mine, hf = _ok(report.rows_of(provider, shape)), _ok(report.rows_of("hf", shape))
    if not mine or not hf or not mine[0].losses or not hf[0].losses:
        return None
    n = min(FIRST_LOSSES, len(mine[0].losses), len(hf[0].losses))
    return max(abs(a - b) for a, b in zip(mine[0].losses[:n], hf[0].losses[:n], strict=True))


def headline_table(report: CaseReport, model: str, batch: int, seq: int) -> str:
    """Scenarios x providers of one (model, B x T): ``ms, GiB`` (medians); under it, per peer that ran, the
    time and peak of each fuselm column over the peer's."""
    providers = [p for p in report.providers if p not in report.skipped]
    lines = []
    for scenario in SCENARIOS:
        shape = (model, scenario, batch, seq)
        if shape not in report.shapes:
            continue
        cells = [SCENARIO_TITLES[scenario]]
        for p in providers:
            rows = report.rows_of(p, shape)
            ms, peak = median_of(rows, "step_ms"), median_of(rows, "peak_gib")
            cell = "—" if ms is None else f"{ms:.0f} ms, " + ("n/a" if peak is None else f"{peak:.2f} GiB")
            cells.append(cell if _ok(rows) else fresh_process.failed_cell(rows))
        lines.append(cells)
        for peer in ("unsloth", "hf"):
            other = _ok(report.rows_of(peer, shape))
            if peer not in providers or not other:
                continue
            ratios = [SCENARIO_TITLES[scenario] + " / " + PROVIDER_TITLES[peer] + " (time, peak)"]
            for p in providers:
                mine = _ok(report.rows_of(p, shape)) if split_provider(p)[0] == "fuselm" else []
                t, m = (ratio(median_of(mine, a), median_of(other, a)) for a in ("step_ms", "peak_bytes"))
                ratios.append("" if t is None else f"{t:.2f}x, " + ("—" if m is None else f"{m:.2f}x"))
            lines.append(ratios)
    return md_table(["scenario", *(provider_title(p) for p in providers)], lines)


def detail_table(report: CaseReport) -> str:
    head = ["model", "scenario", "B x T", "provider", "ms/step", "tokens/s"]
    head += ["CPU ms/step", "GPU ms/step", "launches/step", "bound by", "peak alloc GiB", "peak reserved GiB"]
    head += ["host pinned GiB", f"first {FIRST_LOSSES} losses", "max abs diff vs HF"]
    head += ["fuselm modules ran (PEFT LoRA)", "note"]
    cuda = report.device_type == "cuda"
    cell, in_gib = fresh_process.summary_cell, lambda x: f"{x / GIB:.2f}"
    lines = []
    for shape, p, rows in report.groups():
        model, scenario, b, t = shape
        first = next(iter(_ok(rows)), None)
        gap = loss_gap(report, p, shape)
        fused = "—"
        if first is not None and first.fused_modules is not None and p == "fuselm":
            fused = f"{first.fused_modules_ran} (PEFT LoRA {first.lora_layers_peft}/{first.lora_layers})"
        cells = [model, scenario, f"{b}x{t}", p, fresh_process.first_cell(rows, "step_ms", "{:.0f}".format)]
        cells.append(cell(rows, "tokens_per_s", fresh_process.fmt_tokens))
        cells += [cell(rows, a, "{:.0f}".format) for a in ("cpu_ms", "gpu_ms", "launches")]
        cells.append(e2e.bound_cell(rows, cuda))
        gib = [cell(rows, a, in_gib) for a in ("peak_bytes", "reserved_bytes", "host_pinned_bytes")]
        losses = "—" if first is None else ", ".join(f"{x:.4f}" for x in first.losses[:FIRST_LOSSES])
        cells += [*gib, losses, "—" if gap is None else f"{gap:.1e}", fused, fresh_process.note_cell(rows)]
        lines.append(cells)
    return md_table(head, lines)


def fused_paths_section(report: CaseReport) -> str:
    """Per configuration: which modules ran fuselm's forward, and fuselm's warnings."""
    lines = ["## What fuselm ran", ""]
    for shape in report.shapes:
        ok = _ok(report.rows_of("fuselm", shape))
        if not ok:
            continue
        r = ok[0]
        names = ", ".join(f"{n} x{c}" for n, c in r.fused_forwards.items()) or "none"
        ran = (
            f"{r.fused_modules} of {r.modules} modules have fuselm's forward (the Trainer's steps are not "
            "watched)"
            if r.fused_modules_ran is None
            else f"{r.fused_modules_ran} modules ran fuselm's forward in the first step ({r.fused_modules} "
            f"of {r.modules} have it); of {r.lora_layers} LoRA layers, {r.lora_layers_inside} ran inside a "
            f"fused parent (never called), {r.lora_layers_fused} ran fuselm's own forward, "
            f"{r.lora_layers_peft} ran PEFT's"
        )
        lines.append(f"- {r.label(shape)}: {ran}; checkpointing: {r.checkpointing}; forwards: {names}")
        lines += [f"  - warning: {w}" for w in r.fuselm_warnings]
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def tables(report: CaseReport) -> str:
    """A headline table per (model, B x T), the details, what fuselm ran."""
    sections = [
        f"## {model}, B{b} x {t}: ms per step, peak allocated GiB\n\n" + headline_table(report, model, b, t)
        for model, b, t in dict.fromkeys((s[0], s[2], s[3]) for s in report.shapes)
    ]
    sections += ["## Details\n\n" + detail_table(report), fused_paths_section(report)]
    return "\n\n".join(s for s in sections if s)


def notes(report: CaseReport) -> list[str]:
    extra = report.metadata.get("finetune", {})
    fused = "fused" if report.device_type == "cuda" else "not fused"
    out = [
        f"LoRA r={extra.get('rank')}, alpha={extra.get('alpha')}, dropout={extra.get('dropout')} on "
        f"{', '.join(TARGET_MODULES)}; AdamW ({fused}) on the trainable parameters, lr {LR}; labels = "
        f"input_ids (random ids, the same batch every step and provider, seed {SEED}).",
        "qlora: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4', bnb_4bit_use_double_quant="
        "True, bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16), the LM head "
        "not quantized; lora: the base in the run's dtype.",
        *e2e.step_notes(report),
        "peak reserved GiB = torch.cuda.max_memory_reserved(); host pinned GiB: "
        + (pinned_source(report) or "see host_pinned_source in the JSON")
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
    return out + ([extra["scenario_note"]] if extra.get("scenario_note") else [])


def facts(report: CaseReport) -> list[str]:
    extra = report.metadata.get("finetune", {})
    compile_ = "on" if extra.get("unsloth_compile") else "off (UNSLOTH_COMPILE_DISABLE=1)"
    offload = "on" if extra.get("offload") else "off"
    out = [*e2e.model_facts(report), f"fuselm: offload {offload}; Unsloth: per-block compile {compile_}"]
    if extra.get("trainer"):
        out.append(
            "steps: transformers.Trainer.train() (its data loader, clipping at 1.0, a log line a step), "
            "fuselm@graph under fuselm.integrations.trainer.capture_training_steps"
        )
    return out


def pinned_source(report: CaseReport) -> str | None:
    """How the rows measured host pinned memory."""
    return "; ".join(sorted({r.host_pinned_source for r in report.rows if r.host_pinned_source})) or None


def plan_json(report: CaseReport) -> dict[str, Any]:
    fields = FinetuneRow.SHAPE_FIELDS
    gaps = [
        {**dict(zip(fields, s, strict=True)), "provider": p, "max_abs_diff_vs_hf": loss_gap(report, p, s)}
        for s, p, _ in report.groups()
    ]
    extra = {**report.metadata.get("finetune", {}), "host_pinned_source": pinned_source(report)}
    return {"plan": report.plan.name, "finetune": extra, "loss_gaps": gaps}


def plot(report: CaseReport, path: Path) -> None:
    """Bars of step time and peak GiB; with memory budgets, step time against peak GiB per configuration."""
    if not any(isinstance(split_provider(p)[1], float) for p in report.providers):
        fresh_process.write_bars(BENCH, report, path)
        return
    plt = pyplot()
    fig, axes = plt.subplots(1, len(report.shapes), figsize=(5.0 * len(report.shapes), 4.2), squeeze=False)
    for ax, shape in zip(axes[0], report.shapes, strict=True):
        budgets = []
        for provider in report.providers:
            rows = report.rows_of(provider, shape)
            ms, gib = median_of(rows, "step_ms"), median_of(rows, "peak_gib")
            base, budget = split_provider(provider)
            if ms is None or gib is None:
                continue
            if isinstance(budget, float):
                budgets.append((gib, ms, budget))
            else:
                marker = {"unsloth": "*", "hf": "x", "liger": "^"}.get(base, "o")
                size = 120 if marker == "*" else 50
                ax.scatter([gib], [ms], marker=marker, s=size, label=provider_title(provider))
        if budgets:
            budgets.sort()
            ax.plot([b[0] for b in budgets], [b[1] for b in budgets], "o-", label="fuselm, memory_budget=")
            for gib, ms, budget in budgets:
                ax.annotate(
                    f"{budget:g} GiB", (gib, ms), textcoords="offset points", xytext=(4, 4), fontsize=8
                )
        ax.set_title(BENCH.row_type.label(shape), fontsize=9)
        ax.set(xlabel="peak allocated GiB", ylabel="ms per step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"fuselm bench {NAME}: step time against memory ({report.plan.name} plan)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


VERSIONS = ("peft", "bitsandbytes", "unsloth", "unsloth_zoo")
BENCH = fresh_process.Bench(
    name=NAME,
    description=DESCRIPTION,
    providers=PROVIDERS,
    provider_descriptions=PROVIDER_DESCRIPTIONS,
    row_type=FinetuneRow,
    plans=(GPU_PLAN, CPU_PLAN),
    train=train,
    timeout_s=WORKER_TIMEOUT_S,
    versions=("torch", "triton", "transformers", "liger-kernel", *VERSIONS),
    peers={"unsloth": "Unsloth", "hf": "HF"},
    precheck=e2e.precheck,
    worker_prefix=worker_prefix,
    worker_env=worker_env,
    variant_description=describe_variant,
    facts=facts,
    tables=tables,
    notes=notes,
    plan_json=plan_json,
    panels=(("step_ms", "ms/step", 1.0), ("peak_gib", "peak allocated GiB", 1.0)),
    plot=plot,
)


# ---- command line ----


def grid(args: argparse.Namespace, plan: fresh_process.Plan) -> list[tuple[str, str, int, int]]:
    """``--models`` x ``--scenarios`` x ``--shapes`` (defaults: the plan's). Raises ``UsageError``."""
    models = parse_list(args.models, list(e2e.MODELS), "model", default=DEFAULT_MODELS)
    scenarios = parse_list(args.scenarios, SCENARIOS, "scenario", default=SCENARIOS)
    shapes = parse_shapes(args.shapes, 2) if args.shapes else plan.shapes
    for m in models:
        if e2e.MODELS[m].nf4_only and "qlora" not in scenarios:
            raise UsageError(f"{m} is saved 4-bit only: it runs --scenarios qlora")
    full = [m for m in models if not e2e.MODELS[m].nf4_only]  # the others are saved 4-bit: qlora only
    return [(m, s, b, t) for m in models for s in scenarios if s == "qlora" or m in full for b, t in shapes]


def parse_budget(text: str) -> float:
    """One ``--memory-budgets`` value: GiB > 0; UsageError otherwise."""
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"--memory-budgets: {text!r} is not a number of GiB") from None
    if not (math.isfinite(value) and value > 0):
        raise UsageError(f"--memory-budgets: {text!r} must be a number of GiB > 0")
    return value


def run_cli(args: argparse.Namespace, argv: list[str]) -> int:
    """``fuselm bench finetune``; the exit code. Raises ``UsageError``."""
    c = fresh_process.start_cli(BENCH, args, argv, grid=grid, packages=VERSIONS)
    device = torch.device(c.device_type)
    cuda = device.type == "cuda"
    rank = args.rank or RANK
    options = {"rank": rank, "alpha": float(args.lora_alpha or rank), "dropout": args.lora_dropout or 0.0}
    if not 0.0 <= options["dropout"] < 1.0:
        raise UsageError(f"--lora-dropout must be in [0, 1), got {options['dropout']}")
    options.update(
        offload=args.offload is not False, unsloth_compile=args.unsloth_compile, trainer=args.trainer
    )
    if args.memory_budgets:  # fuselm once per budget: fuselm@<GiB> providers (checkpointing="auto")
        named = [f"fuselm@{parse_budget(b):g}" for b in args.memory_budgets.split(",")]
        c.providers = [*c.providers, *(p for p in named if p not in c.providers)]
    for provider in c.providers:  # fuselm@<GiB> and fuselm@graph named in --providers: checked
        split_provider(provider)
    scenario_note = None
    if not cuda and any(s[1] == "qlora" for s in c.shapes):
        reason = bnb_cpu_4bit_works()
        if reason is not None:
            c.shapes = [s for s in c.shapes if s[1] != "qlora"]
            scenario_note = f"qlora not run on this CPU: {reason}; the CPU smoke runs lora only."
            print(scenario_note)
            if not c.shapes:
                raise UsageError(scenario_note)
    save_dtype = torch.bfloat16 if cuda else torch.float32
    env = base_env(args.unsloth_compile)
    with models_folder(args.model_dir, "fuselm-finetune-models-") as model_dir:
        folders = {}
        for model in dict.fromkeys(s[0] for s in c.shapes):
            tiny = "tiny, " if c.plan.tiny else ""
            print(f"saving {model} ({tiny}{DTYPE_NAMES[save_dtype]}) to {model_dir} ...", flush=True)
            folder, info = ensure_saved_model(model_dir, model, c.plan.tiny, save_dtype, device)
            folders[model] = {"folder": str(folder), **info}
            print(f"  {'reused' if info['reused'] else 'saved'} {folder}", flush=True)
        c.extra.update(model_dir=str(model_dir), **options)
        c.metadata["finetune"] = {
            **options,
            "profile_steps": c.plan.profile_steps,
            "env": " ".join(f"{k}={v}" for k, v in env.items()),
            "model_folders": folders,
            "model_dir_kept": args.model_dir is not None,
            "scenario_note": scenario_note,
        }
        return fresh_process.run_cli(BENCH, c, progress=not args.no_progress)


if __name__ == "__main__":  # a worker: python -m fuselm_bench.finetune --worker ... (or --build ...)
    sys.exit(build_main(sys.argv[1:]) if sys.argv[1:2] == ["--build"] else worker(sys.argv[1:]))
