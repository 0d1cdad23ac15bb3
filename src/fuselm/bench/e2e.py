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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from . import fresh_process, training
from .fresh_process import SkipRun
from .report import DTYPE_NAMES, md_table
from .runner import print_written

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
DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


# ---- the model and one training run (what a worker process does) ----


def llama_config(model: dict[str, Any]):
    """A ``transformers.LlamaConfig`` from the preset's keyword arguments (no cache, SDPA attention;
    :func:`fuselm.bench.training.llama_config`)."""
    return training.llama_config(model, "sdpa")


def apply_provider_before_build(provider: str, device: torch.device) -> None:
    """Class-level patches that must be in place before the model is built (Liger's)."""
    if provider != "liger":
        return
    if device.type != "cuda":
        raise SkipRun("needs CUDA (Liger-Kernel's Triton kernels run on the GPU only)")
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
    except Exception as e:  # noqa: BLE001 - any import failure means: not available here
        raise SkipRun(f"liger_kernel not importable ({type(e).__name__}: {e})") from None
    apply_liger_kernel_to_llama(
        rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True
    )


def build_model(preset: Preset, provider: str, dtype: torch.dtype, device: torch.device, seed: int = SEED):
    """Seeded random init of the preset's ``LlamaForCausalLM`` on ``device`` in ``dtype``, with the
    provider's patches (``hf`` and ``fuselm`` get identical weights for the same seed)."""
    if provider not in PROVIDERS:
        raise ValueError(f"unknown provider {provider!r}; known: {', '.join(PROVIDERS)}")
    apply_provider_before_build(provider, device)
    config = llama_config(preset.model)
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
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    model = build_model(preset, provider, dtype, device, seed)
    params = sum(p.numel() for p in model.parameters())
    weights_bytes = torch.cuda.memory_allocated(device) if cuda else None
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen).to(device)
    run = training.train(
        training.causal_lm_loss(model),
        list(model.parameters()),
        [ids] * (warmup + steps),
        lr=LR,
        fused_adamw=preset.fused_adamw and cuda,
        warmup=warmup,
    )
    return {
        "status": "ok",
        "tokens_per_s": run.tokens_per_s(batch * seq),
        "step_ms": run.timed_s / steps * 1e3,
        "warmup_s": run.warmup_s,
        **fresh_process.memory_figures(device),
        "weights_bytes": weights_bytes,
        "params": params,
        "losses": run.logged,
        "first_loss": run.logged[0],
        "final_loss": run.logged[-1],
    }


def worker_main(argv: Sequence[str]) -> int:
    """The worker process: one (provider, batch) run, its result as JSON in ``--result``.

    Status ``ok`` (exit 0), ``oom`` or ``skipped`` (exit 0: a result, not a failure), ``error`` (exit 1,
    with the exception and the tail of its traceback).
    """
    case = [("--batch", {"type": int}), ("--seq", {"type": int}), ("--preset", {"choices": sorted(PRESETS)})]
    parser = fresh_process.worker_parser(
        "python -m fuselm.bench.e2e --worker", "one e2e run", case, dtypes=list(DTYPES), seed=SEED
    )
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"provider": args.provider, "batch": args.batch, "seq": args.seq}
    device = torch.device(args.device)

    def run_one() -> dict[str, Any]:
        if args.provider not in PROVIDERS:
            raise ValueError(f"unknown provider {args.provider!r}; known: {', '.join(PROVIDERS)}")
        return train(
            PRESETS[args.preset],
            args.provider,
            args.batch,
            args.seq,
            dtype=DTYPES[args.dtype],
            device=device,
            warmup=args.warmup,
            steps=args.steps,
            seed=args.seed,
        )

    return fresh_process.worker_main(result, device, args.result, run_one)


# ---- the parent: one fresh process per (provider, batch) ----


@dataclass
class E2ERow(fresh_process.WorkerRow):
    """One (provider, B, T) result. ``status``: ok, oom, error or skipped; ``error`` says why."""

    SHAPE_FIELDS: ClassVar[tuple[str, ...]] = ("batch", "seq")

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


@dataclass
class E2EReport(fresh_process.CaseRows):
    """Everything one ``fuselm bench e2e`` run produced; ``row(provider, (B, T))`` finds a row."""

    preset: Preset
    dtype: torch.dtype
    device_type: str
    shapes: tuple[tuple[int, int], ...]
    providers: tuple[str, ...]
    warmup: int
    steps: int
    metadata: dict[str, Any]
    rows: list[E2ERow] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def worker_command(
    provider: str,
    batch: int,
    seq: int,
    *,
    preset: str,
    dtype: torch.dtype,
    device: str,
    warmup: int,
    steps: int,
    result: Path,
) -> list[str]:
    """The command line of one worker process."""
    case = {"batch": batch, "seq": seq, "preset": preset}
    options = {
        "dtype": DTYPE_NAMES[dtype],
        "device": device,
        "warmup": warmup,
        "steps": steps,
        "result": result,
    }
    return fresh_process.worker_command("fuselm.bench.e2e", provider, case, **options)


def run_case(
    provider: str,
    batch: int,
    seq: int,
    *,
    preset: Preset,
    dtype: torch.dtype,
    device: torch.device,
    warmup: int,
    steps: int,
    timeout: float = WORKER_TIMEOUT_S,
) -> E2ERow:
    """Run one (provider, batch, seq) in a fresh worker process and return its row (never raises for a
    failure of the worker: the row's status is ``error`` and ``error`` says what happened)."""
    options = {"dtype": dtype, "device": device.type, "warmup": warmup, "steps": steps}
    data = fresh_process.run_worker(
        lambda result: worker_command(provider, batch, seq, preset=preset.name, result=result, **options),
        timeout=timeout,
        prefix="fuselm-e2e-",
    )
    return fresh_process.row_from_result(E2ERow, {"provider": provider, "batch": batch, "seq": seq}, data)


def _precheck(provider: str, device: torch.device) -> str | None:
    """A reason to skip ``provider`` without starting a process (None: try it)."""
    if provider == "liger":
        if device.type != "cuda":
            return "needs CUDA (Liger-Kernel's Triton kernels run on the GPU only)"
        import importlib.util

        if importlib.util.find_spec("liger_kernel") is None:
            return "liger_kernel not importable (pip install liger-kernel, or put it on PYTHONPATH)"
    return None


def fmt_tokens(x: float | None) -> str:
    """Tokens/s as docs/peers.md writes them: 49123.4 -> '49.1k', 812.0 -> '812'."""
    from .report import fmt_num

    if x is None:
        return "—"
    return f"{fmt_num(x / 1e3)}k" if x >= 1e3 else fmt_num(x)


def _summary(row: E2ERow) -> str:
    label = f"{row.provider} {row.batch}x{row.seq}"
    if row.status == "ok":
        peak = f", peak {row.peak_gib:.1f} GiB" if row.peak_gib is not None else ""
        return f"{label}: {fmt_tokens(row.tokens_per_s)} tok/s{peak}, final loss {row.final_loss:.4f}"
    return f"{label}: {row.status}: {row.error}"


def run(
    *,
    preset: Preset,
    shapes: Sequence[tuple[int, int]],
    providers: Sequence[str],
    dtype: torch.dtype,
    device: torch.device,
    warmup: int,
    steps: int,
    metadata: dict[str, Any] | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
    timeout: float = WORKER_TIMEOUT_S,
) -> E2EReport:
    """Run every (shape, provider) in its own worker process; return the report (nothing written)."""
    for p in providers:
        if p not in PROVIDERS:
            raise ValueError(f"unknown provider {p!r}; known: {', '.join(PROVIDERS)}")
    report = E2EReport(
        preset=preset,
        dtype=dtype,
        device_type=device.type,
        shapes=tuple((int(b), int(t)) for b, t in shapes),
        providers=tuple(providers),
        warmup=warmup,
        steps=steps,
        metadata=dict(metadata or {}),
    )
    for p in providers:
        reason = _precheck(p, device)
        if reason:
            report.skipped[p] = reason
            log(f"skipping provider {p}: {reason}")
    options = {"preset": preset, "dtype": dtype, "device": device, "warmup": warmup, "steps": steps}
    fresh_process.run_cases(
        report,
        lambda provider, shape: run_case(provider, *shape, timeout=timeout, **options),
        E2ERow,
        name=NAME,
        log=log,
        summary=_summary,
        progress=progress,
    )
    return report


# ---- ratios and report files ----


def ratios(report: E2EReport) -> list[dict[str, Any]]:
    """Per shape: fuselm's tokens/s and peak memory over Liger's and over HF's (None where missing)."""
    return fresh_process.ratios(
        report, E2ERow, ("liger", "hf"), {"tokens": "tokens_per_s", "peak": "peak_bytes"}
    )


def _model_line(preset: Preset) -> str:
    m = preset.model
    return (
        f"hidden {m['hidden_size']}, intermediate {m['intermediate_size']}, {m['num_hidden_layers']} layers, "
        f"{m['num_attention_heads']} heads, {m['num_key_value_heads']} kv heads, head_dim {m['head_dim']}, "
        f"vocab {m['vocab_size']}, tied embeddings, rope theta {m['rope_theta']:g} with llama3 scaling"
    )


def notes(report: E2EReport) -> list[str]:
    """Footnotes of the report: method, what is counted, the anchors."""
    cuda = report.device_type == "cuda"
    out = [
        "Each (provider, batch) ran in a fresh process (`python -m fuselm.bench.e2e --worker`): peak memory "
        "and Liger's class patches do not leak between runs.",
        "One step: forward with labels = input_ids (random ids, the same batch every step), backward, "
        f"AdamW.step() ({'fused' if cuda and report.preset.fused_adamw else 'not fused'}), "
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


def _cell_tokens(r: E2ERow) -> str:
    return {"ok": fmt_tokens(r.tokens_per_s), "oom": "OOM"}.get(r.status, "error")


def _cell_num(x: float | None, r: E2ERow, fmt: str) -> str:
    if r.status != "ok":
        return "—"
    return "n/a" if x is None else format(x, fmt)


def markdown_table(report: E2EReport) -> str:
    """One line per (B x T, provider): tokens/s, ms per step, peak GiB, first and final loss, note."""
    head = ["B x T", "provider", "tokens/s", "ms/step", "peak GiB", "first loss", "final loss", "note"]
    rows = [
        [
            f"{r.batch}x{r.seq}",
            r.provider,
            _cell_tokens(r),
            _cell_num(r.step_ms, r, ".1f"),
            _cell_num(r.peak_gib, r, ".1f"),
            _cell_num(r.first_loss, r, ".4f"),
            _cell_num(r.final_loss, r, ".4f"),
            (r.error or "").replace("|", "/").replace("\n", " "),
        ]
        for r in report.rows
    ]
    return md_table(head, rows)


def ratio_table(report: E2EReport) -> str:
    """fuselm / Liger and fuselm / HF, tokens/s and peak memory, per shape."""
    head = [
        "B x T",
        "tokens/s fuselm / Liger",
        "peak fuselm / Liger",
        "tokens/s fuselm / HF",
        "peak fuselm / HF",
    ]
    return fresh_process.ratio_table(head, ratios(report), lambda r: f"{r['batch']}x{r['seq']}")


def markdown(report: E2EReport) -> str:
    """The whole report: header (device, versions, commit, model, method), results, ratios, notes."""
    return fresh_process.markdown(
        report,
        name=NAME,
        description=DESCRIPTION,
        cpu_figures="**CPU figures** (no CUDA device): a tiny config, fp32, a few steps; a smoke test of the "
        "path, not comparable to GPU results.",
        versions=("torch", "triton", "transformers", "liger-kernel"),
        facts=[
            f"model ({report.preset.name} preset, random init, SDPA attention, no activation checkpointing): "
            f"{_model_line(report.preset)}",
            f"steps: {report.warmup} warmup + {report.steps} timed per run",
        ],
        sections=[markdown_table(report), ratio_table(report)],
        notes=[*notes(report), *(f"{p}: {PROVIDER_DESCRIPTIONS[p]}" for p in report.providers)],
    )


def to_json(report: E2EReport) -> dict[str, Any]:
    """All raw numbers and the metadata, JSON-ready."""
    return {
        "suite": NAME,
        "description": DESCRIPTION,
        "preset": report.preset.name,
        "model": report.preset.model,
        "dtype": DTYPE_NAMES.get(report.dtype, str(report.dtype)),
        "device_type": report.device_type,
        "shape_dims": ["B", "T"],
        "shapes": [list(s) for s in report.shapes],
        "providers": list(report.providers),
        "warmup": report.warmup,
        "steps": report.steps,
        "metadata": report.metadata,
        "rows": fresh_process.rows_json(report.rows),
        "ratios": ratios(report),
        "skipped": report.skipped,
        "notes": notes(report),
    }


def write_png(report: E2EReport, path: Path) -> None:
    """Two panels of grouped bars per (B x T) and provider: tokens/s and peak GiB (OOM marked)."""
    dtype = DTYPE_NAMES.get(report.dtype, str(report.dtype))
    fresh_process.write_bars(
        report,
        path,
        panels=(("tokens_per_s", "tokens/s (k)", 1e-3), ("peak_gib", "peak GiB", 1.0)),
        labels=[f"{b}x{t}" for b, t in report.shapes],
        title=f"fuselm bench {NAME} ({report.preset.name} preset), {dtype}, {report.metadata.get('device')}",
        width_per_shape=3.2,
        mark_failures=True,
        xlabel="B x T",
    )


def write_report(report: E2EReport, out_dir: str | Path) -> dict[str, Path]:
    """Write ``e2e.md``, ``e2e.json`` and ``e2e.png`` into ``out_dir``; return their paths."""
    return fresh_process.write_report_files(
        NAME, out_dir, markdown(report), to_json(report), lambda path: write_png(report, path)
    )


# ---- command line ----


def run_cli(args: argparse.Namespace, argv: list[str]) -> int:
    """``fuselm bench e2e`` with the parsed ``fuselm bench`` arguments; returns the exit code.

    Uses ``--shapes`` (BxT pairs), ``--providers``, ``--steps``, ``--warmup``, ``--quick``, ``--dtype``
    (CUDA only: the CPU preset always runs fp32), ``--device``, ``--out``, ``--no-progress``; ``--modes``
    does not apply. Raises ``fuselm.bench.arguments.UsageError`` for bad values.
    """
    c = fresh_process.start_cli(
        args, argv, name=NAME, providers=PROVIDERS, plans=(GPU_PRESET, CPU_PRESET), ndim=2
    )
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
    print(
        f"{NAME}: {len(c.shapes)} shapes x {len(c.providers)} providers, {c.warmup} warmup + {c.steps} timed "
        "steps, one fresh process each",
        flush=True,
    )
    report = run(
        preset=c.plan,
        shapes=c.shapes,
        providers=c.providers,
        dtype=c.dtype,
        device=c.device,
        warmup=c.warmup,
        steps=c.steps,
        metadata=meta,
        progress=not args.no_progress,
    )
    print_written(markdown(report), write_report(report, c.out_dir))
    return 0 if any(r.status == "ok" for r in report.rows) else 1


if __name__ == "__main__":  # a worker: python -m fuselm.bench.e2e --worker ... (the benchmark: fuselm bench)
    sys.exit(worker_main(sys.argv[1:]))
