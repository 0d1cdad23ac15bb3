"""End-to-end training benchmark: a Llama-3.2-1B-shaped model trained with Hugging Face transformers.

``fuselm bench e2e`` times whole training steps (forward with labels, backward, ``AdamW.step``) of a
randomly initialised Llama-3.2-1B-shaped ``LlamaForCausalLM`` for three providers:

- ``hf``: plain transformers (eager modules, SDPA attention, the loss on materialized logits).
- ``liger``: transformers with Liger-Kernel's ``apply_liger_kernel_to_llama`` (RoPE, RMSNorm, SwiGLU,
  fused linear cross-entropy), applied to the classes before the model is built. Needs CUDA and an
  importable ``liger_kernel``; skipped with the reason otherwise.
- ``fuselm``: transformers with ``fuselm.hf.patch(model)`` on the built model (RMSNorm, RoPE, SwiGLU MLP,
  the CausalLM loss through fused linear cross-entropy).

The setup is docs/peers.md's "End to end" table: hidden 2048, intermediate 8192, 16 layers, 32 heads,
8 kv heads, head_dim 64, vocab 128256 (tied embeddings), llama3 rope scaling, bf16 weights,
``torch.optim.AdamW(fused=True)``, no activation checkpointing, sequence 4096, batches 4, 8 and 16,
``labels = input_ids`` (random token ids, the same batch every step).

Method: every (provider, batch) runs in a fresh ``python -m fuselm.bench.e2e --worker ...`` process
(peak memory is per process, and Liger patches classes), which writes its result as JSON to a file the
parent names. In the worker: seed, build the model on the device, ``warmup`` steps, then ``steps`` timed
steps between two ``torch.cuda.synchronize()``; tokens/s = ``B * T * steps / elapsed``. Peak memory is
``torch.cuda.max_memory_allocated()`` over the whole process: weights, gradients, AdamW state and
activations (GiB = 2^30 bytes). ``torch.cuda.OutOfMemoryError`` is reported as OOM; a provider that ran
out of memory at batch B is not run again at a larger batch of the same sequence length.

Without CUDA (``--device cpu`` or no GPU) a tiny config runs in fp32 with unfused AdamW in seconds:
a smoke test of the whole path whose figures say nothing about GPU speed (peak memory: n/a).

Shapes are given as ``--shapes BxT`` pairs (``--shapes 8x4096`` or ``4x4096,8x4096``); ``--steps`` and
``--warmup`` set the step counts, ``--quick`` uses fewer steps. ``fuselm bench all`` does not include
this benchmark (minutes long on a GPU): run it by name.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from . import fresh_process, training
from .harness import SkipProvider, import_peer
from .report import fmt_num, md_table

NAME = "e2e"
DESCRIPTION = "end-to-end training steps of a Llama-3.2-1B-shaped model (HF transformers)"
PROVIDERS: tuple[str, ...] = ("hf", "liger", "fuselm")
PROVIDER_DESCRIPTIONS = {
    "hf": "transformers, eager modules, SDPA attention",
    "liger": "transformers + Liger-Kernel apply_liger_kernel_to_llama (rope, rms_norm, swiglu, FLCE)",
    "fuselm": "transformers + fuselm.hf.patch(model) (rms_norm, rope, swiglu, linear cross-entropy)",
}
SEED = 0
LR = 1e-5
WORKER_TIMEOUT_S = 1800.0

LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass(frozen=True)
class Preset:
    """A model and a run plan: the Llama-3.2-1B shape on a GPU, or a tiny one for a CPU smoke run."""

    name: str
    model: dict[str, Any]
    shapes: tuple[tuple[int, int], ...]  # (batch, sequence length)
    warmup: int
    steps: int
    quick_warmup: int
    quick_steps: int
    fused_adamw: bool


GPU_PRESET = Preset(
    name="gpu",
    model={
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "rope_theta": 500000.0,
        "rope_scaling": LLAMA3_ROPE_SCALING,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    shapes=((4, 4096), (8, 4096), (16, 4096)),
    warmup=3,
    steps=10,
    quick_warmup=2,
    quick_steps=4,
    fused_adamw=True,
)

CPU_PRESET = Preset(
    name="cpu",
    model={
        **GPU_PRESET.model,
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    shapes=((2, 64), (4, 64)),
    warmup=2,
    steps=3,
    quick_warmup=1,
    quick_steps=2,
    fused_adamw=False,
)
PRESETS = {p.name: p for p in (GPU_PRESET, CPU_PRESET)}


# ---- the model and one training run (what a worker process does) ----


def apply_provider_before_build(provider: str, device: torch.device) -> None:
    """Class-level patches that must be in place before the model is built (Liger's)."""
    if provider != "liger":
        return
    if device.type != "cuda":
        raise SkipProvider("needs CUDA (Liger-Kernel's Triton kernels run on the GPU only)")
    apply = import_peer(device, "liger_kernel.transformers", "apply_liger_kernel_to_llama")
    apply(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True)


def build_model(preset: Preset, provider: str, dtype: torch.dtype, device: torch.device, seed: int = SEED):
    """Seeded random init of the preset's ``LlamaForCausalLM`` (no cache, SDPA attention) on ``device`` in
    ``dtype``, with the provider's patches (``hf`` and ``fuselm`` get identical weights for the same seed)."""
    if provider not in PROVIDERS:
        raise ValueError(f"unknown provider {provider!r}; known: {', '.join(PROVIDERS)}")
    apply_provider_before_build(provider, device)
    config = training.llama_config(preset.model, "sdpa")
    torch.manual_seed(seed)
    model = training.build_llama(config, device, dtype)
    if provider == "fuselm":
        import fuselm.hf

        fuselm.hf.patch(model)
    return model


def train(
    preset: Preset,
    provider: str,
    batch: int,
    seq: int,
    *,
    dtype: torch.dtype,
    device: torch.device,
    warmup: int,
    steps: int,
    seed: int = SEED,
) -> dict[str, Any]:
    """Build the model, run ``warmup`` + ``steps`` training steps, return the measurements.

    One step (:func:`fuselm.bench.training.train`): ``model(input_ids=ids, labels=ids).loss.backward()``,
    ``optimizer.step()``, ``optimizer.zero_grad(set_to_none=True)``. The losses stay on the device until the
    end (no host sync inside the timed region). Raises ``torch.cuda.OutOfMemoryError`` and anything else
    unchanged.
    """
    model, figures = fresh_process.build_measured(
        lambda: build_model(preset, provider, dtype, device, seed), device
    )
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen).to(device)
    run = training.train(
        training.causal_lm_loss(model),
        list(model.parameters()),
        [ids] * (warmup + steps),
        lr=LR,
        fused_adamw=preset.fused_adamw and device.type == "cuda",
        warmup=warmup,
    )
    return {
        "status": "ok",
        "tokens_per_s": run.tokens_per_s(batch * seq),
        "step_ms": run.timed_s / steps * 1e3,
        "warmup_s": run.warmup_s,
        **fresh_process.memory_figures(device),
        **figures,
        "losses": run.logged,
        "first_loss": run.logged[0],
        "final_loss": run.logged[-1],
    }


# ---- the parent: one fresh process per (provider, batch) ----


@dataclass
class E2ERow(fresh_process.WorkerRow):
    """One (provider, B, T) result. ``status``: ok, oom, error or skipped; ``error`` says why."""

    SHAPE_FIELDS: ClassVar[tuple[str, ...]] = ("batch", "seq")
    SHAPE_DIMS: ClassVar[tuple[str, ...]] = ("B", "T")
    SHAPE_TITLE: ClassVar[str] = "B x T"
    SHAPE_FORMAT: ClassVar[str] = "{}x{}"

    provider: str
    batch: int
    seq: int
    status: str
    tokens_per_s: float | None = None
    step_ms: float | None = None
    peak_bytes: int | None = None
    reserved_bytes: int | None = None
    weights_bytes: int | None = None
    params: int | None = None
    first_loss: float | None = None
    final_loss: float | None = None
    losses: list[float] = field(default_factory=list)
    warmup_s: float | None = None
    wall_s: float | None = None
    error: str | None = None
    traceback: str | None = None

    def figures(self) -> tuple[str, str]:
        return f"{fmt_tokens(self.tokens_per_s)} tok/s", f"final loss {self.final_loss:.4f}"


def _precheck(provider: str, device: torch.device) -> str | None:
    """A reason to skip ``provider`` without starting a process (None: try it)."""
    if provider == "liger":
        if device.type != "cuda":
            return "needs CUDA (Liger-Kernel's Triton kernels run on the GPU only)"
        import importlib.util

        if importlib.util.find_spec("liger_kernel") is None:
            return "liger_kernel not importable (pip install liger-kernel, or put it on PYTHONPATH)"
    return None


BENCH = fresh_process.Bench(
    name=NAME,
    description=DESCRIPTION,
    providers=PROVIDERS,
    provider_descriptions=PROVIDER_DESCRIPTIONS,
    row_type=E2ERow,
    plan_flag="preset",
    plans=PRESETS,
    train=train,
    timeout_s=WORKER_TIMEOUT_S,
    seed=SEED,
    versions=("torch", "triton", "transformers", "liger-kernel"),
    peers={"liger": "Liger", "hf": "HF"},
    metrics={"tokens": ("tokens_per_s", "tokens/s"), "peak": ("peak_bytes", "peak")},
    precheck=_precheck,
)


def fmt_tokens(x: float | None) -> str:
    """Tokens/s as docs/peers.md writes them: 49123.4 -> '49.1k', 812.0 -> '812'."""
    if x is None:
        return "—"
    return f"{fmt_num(x / 1e3)}k" if x >= 1e3 else fmt_num(x)


# ---- report files ----


def _model_line(preset: Preset) -> str:
    m = preset.model
    return (
        f"hidden {m['hidden_size']}, intermediate {m['intermediate_size']}, {m['num_hidden_layers']} layers, "
        f"{m['num_attention_heads']} heads, {m['num_key_value_heads']} kv heads, head_dim {m['head_dim']}, "
        f"vocab {m['vocab_size']}, tied embeddings, rope theta {m['rope_theta']:g} with llama3 scaling"
    )


def notes(report: fresh_process.CaseReport) -> list[str]:
    """Footnotes of the report: method, what is counted, the anchors."""
    cuda = report.device_type == "cuda"
    out = [
        "Each (provider, batch) ran in a fresh process (`python -m fuselm.bench.e2e --worker`): peak memory "
        "and Liger's class patches do not leak between runs.",
        "One step: forward with labels = input_ids (random ids, the same batch every step), backward, "
        f"AdamW.step() ({'fused' if cuda and report.plan.fused_adamw else 'not fused'}), "
        f"zero_grad(set_to_none=True). {report.warmup} warmup steps, then {report.steps} timed steps.",
        "tokens/s = B * T * timed steps / their wall time"
        + (" (torch.cuda.synchronize() before and after)." if cuda else "."),
    ]
    if cuda:
        out.append(
            "peak GiB = torch.cuda.max_memory_allocated() over the whole process: weights, gradients, AdamW "
            "state and activations (GiB = 2^30 bytes); the JSON also has max_memory_reserved."
        )
        out.append(
            "OOM = torch.cuda.OutOfMemoryError; a provider that ran out of memory at batch B is not run at a "
            "larger batch of the same sequence length."
        )
        out.append(
            "docs/peers.md (H200, transformers 5.17): HF eager 49.1k / 49.6k tok/s, 61.2 / 115.3 GiB at "
            "batch 4 / 8 (OOM at 16) and HF + Liger 63.5k / 64.4k / 65.8k tok/s, 26.3 / 45.2 / 82.9 GiB."
        )
    else:
        out.append("No CUDA: peak memory is not measured (n/a); each worker runs one CPU thread.")
    out.append(
        "first loss: the loss of the first step (same seed, weights and batch for every provider); final "
        "loss: of the last timed step."
    )
    return out


def _cell(x: float | None, r: E2ERow, fmt: str) -> str:
    if r.status != "ok":
        return "—"
    return "n/a" if x is None else format(x, fmt)


def markdown_table(report: fresh_process.CaseReport) -> str:
    """One line per (B x T, provider): tokens/s, ms per step, peak GiB, first and final loss, note."""
    head = ["B x T", "provider", "tokens/s", "ms/step", "peak GiB", "first loss", "final loss", "note"]
    rows = [
        [
            E2ERow.label(r.shape),
            r.provider,
            fresh_process.status_cell(r, fmt_tokens(r.tokens_per_s)),
            _cell(r.step_ms, r, ".1f"),
            _cell(r.peak_gib, r, ".1f"),
            _cell(r.first_loss, r, ".4f"),
            _cell(r.final_loss, r, ".4f"),
            fresh_process.note_cell(r),
        ]
        for r in report.rows
    ]
    return md_table(head, rows)


def markdown(report: fresh_process.CaseReport) -> str:
    """The whole report: header (device, versions, commit, model, method), results, ratios, notes."""
    return fresh_process.markdown(
        BENCH,
        report,
        cpu_figures="**CPU figures** (no CUDA device): a tiny config, fp32, a few steps; a smoke test of the "
        "path, not comparable to GPU results.",
        facts=[
            f"model ({report.plan.name} preset, random init, SDPA attention, no activation checkpointing): "
            f"{_model_line(report.plan)}",
            f"steps: {report.warmup} warmup + {report.steps} timed per run",
        ],
        table=markdown_table(report),
        notes=notes(report),
    )


def to_json(report: fresh_process.CaseReport) -> dict[str, Any]:
    """All raw numbers and the metadata, JSON-ready."""
    plan = {"preset": report.plan.name, "model": report.plan.model}
    return fresh_process.report_json(BENCH, report, plan, notes(report))


def write_png(report: fresh_process.CaseReport, path: Path) -> None:
    """Two panels of grouped bars per (B x T) and provider: tokens/s and peak GiB (OOM marked)."""
    fresh_process.write_bars(
        BENCH,
        report,
        path,
        panels=(("tokens_per_s", "tokens/s (k)", 1e-3), ("peak_gib", "peak GiB", 1.0)),
        title=f" ({report.plan.name} preset)",
        width_per_shape=3.2,
        mark_failures=True,
    )


def write_report(report: fresh_process.CaseReport, out_dir: str | Path) -> dict[str, Path]:
    """Write ``e2e.md``, ``e2e.json`` and ``e2e.png`` into ``out_dir``; return their paths."""
    return fresh_process.write_report(
        NAME, out_dir, markdown(report), to_json(report), lambda path: write_png(report, path)
    )


# ---- command line ----


def run_cli(args: argparse.Namespace, argv: list[str]) -> int:
    """``fuselm bench e2e`` with the parsed ``fuselm bench`` arguments; returns the exit code.

    Uses ``--shapes`` (BxT pairs), ``--providers``, ``--steps``, ``--warmup``, ``--quick``, ``--dtype``
    (CUDA only: the CPU preset always runs fp32), ``--device``, ``--out``, ``--no-progress``; ``--modes``
    does not apply. Raises ``fuselm.bench.arguments.UsageError`` for bad values.
    """
    c = fresh_process.start_cli(BENCH, args, argv, plans=(GPU_PRESET, CPU_PRESET))
    meta = c.metadata
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        meta["PYTORCH_CUDA_ALLOC_CONF"] = os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    if c.device.type != "cuda":
        print(
            "No CUDA device in use: these are CPU figures (tiny model, fp32, a few steps, no memory "
            "figures), not comparable to GPU results."
        )
    print(
        f"device: {meta['device']}; torch {meta['torch']}, triton {meta['triton']}, transformers "
        f"{meta['transformers']}, liger-kernel {meta.get('liger-kernel', 'n/a')}, fuselm @ {meta['commit']}"
    )
    report = fresh_process.run_cli(
        BENCH, c, markdown=markdown, write=write_report, progress=not args.no_progress
    )
    return fresh_process.exit_code(report)


if __name__ == "__main__":  # a worker: python -m fuselm.bench.e2e --worker ... (the benchmark: fuselm bench)
    sys.exit(fresh_process.worker_main(BENCH, sys.argv[1:]))
