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
import inspect
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import fresh_process
from .fresh_process import SkipRun

NAME = "e2e"
DESCRIPTION = "end-to-end training steps of a Llama-3.2-1B-shaped model (HF transformers)"
PROVIDERS: tuple[str, ...] = ("hf", "liger", "fuselm")
PROVIDER_DESCRIPTIONS = {
    "hf": "transformers, eager modules, SDPA attention",
    "liger": "transformers + Liger-Kernel apply_liger_kernel_to_llama (rope, rms_norm, swiglu, FLCE)",
    "fuselm": "transformers + fuselm.hf.patch(model) (rms_norm, rope, swiglu, linear cross-entropy)",
}
GIB = 1 << 30
SEED = 0
LR = 1e-5
WORKER_TIMEOUT_S = 1800.0
ACCEPTANCE_BATCH = 8
ACCEPTANCE_TOKENS = 1.05  # fuselm tokens/s >= 1.05x Liger's
ACCEPTANCE_PEAK = 0.90  # fuselm peak memory <= 0.9x Liger's

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
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


# ---- the model and one training run (what a worker process does) ----


def llama_config(model: dict[str, Any]):
    """A ``transformers.LlamaConfig`` from the preset's keyword arguments (no cache, SDPA attention).

    transformers 5 takes the rope settings as ``rope_parameters`` (theta inside); older versions as
    ``rope_theta`` and ``rope_scaling``: whichever the installed ``LlamaConfig`` accepts is used.
    """
    from transformers import LlamaConfig

    kwargs = dict(model)
    theta, scaling = kwargs.pop("rope_theta"), kwargs.pop("rope_scaling")
    if "rope_parameters" in inspect.signature(LlamaConfig.__init__).parameters:
        kwargs["rope_parameters"] = {**scaling, "rope_theta": theta}
    else:
        kwargs.update(rope_theta=theta, rope_scaling=scaling)
    return LlamaConfig(use_cache=False, **kwargs)


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
    from transformers import LlamaForCausalLM

    config = llama_config(preset.model)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.train()
    if provider == "fuselm":
        import fuselm.hf

        fuselm.hf.patch(model)
    return model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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

    One step: ``model(input_ids=ids, labels=ids).loss.backward()``, ``optimizer.step()``,
    ``optimizer.zero_grad(set_to_none=True)``. The losses stay on the device until the end (no host
    sync inside the timed region). Raises ``torch.cuda.OutOfMemoryError`` and anything else unchanged.
    """
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    model = build_model(preset, provider, dtype, device, seed)
    params = sum(p.numel() for p in model.parameters())
    weights_bytes = torch.cuda.memory_allocated(device) if cuda else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=preset.fused_adamw and cuda)
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen).to(device)

    def step() -> torch.Tensor:
        out = model(input_ids=ids, labels=ids)
        loss = out.loss
        del out  # HF eager returns the logits too: do not keep them alive into the next step
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    losses = []
    t_build = time.perf_counter()
    for _ in range(warmup):
        losses.append(step())
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        losses.append(step())
    _sync(device)
    elapsed = time.perf_counter() - t0
    loss_values = [float(x) for x in torch.stack(losses).float().cpu()]
    return {
        "status": "ok",
        "tokens_per_s": batch * seq * steps / elapsed,
        "step_ms": elapsed / steps * 1e3,
        "warmup_s": t0 - t_build,
        "peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "reserved_bytes": torch.cuda.max_memory_reserved(device) if cuda else None,
        "weights_bytes": weights_bytes,
        "params": params,
        "losses": loss_values,
        "first_loss": loss_values[0],
        "final_loss": loss_values[-1],
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
class E2ERow:
    """One (provider, B, T) result. ``status``: ok, oom, error or skipped; ``error`` says why."""

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

    @property
    def peak_gib(self) -> float | None:
        return None if self.peak_bytes is None else self.peak_bytes / GIB

    @property
    def shape(self) -> tuple[int, int]:
        return (self.batch, self.seq)


@dataclass
class E2EReport:
    """Everything one ``fuselm bench e2e`` run produced."""

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

    def row(self, provider: str, shape: tuple[int, int]) -> E2ERow | None:
        """The row of (provider, (B, T)), or None."""
        for r in self.rows:
            if r.provider == provider and r.shape == tuple(shape):
                return r
        return None


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
    return [
        sys.executable,
        "-m",
        "fuselm.bench.e2e",
        "--worker",
        f"--provider={provider}",
        f"--batch={batch}",
        f"--seq={seq}",
        f"--preset={preset}",
        f"--dtype={DTYPE_NAMES[dtype]}",
        f"--device={device}",
        f"--warmup={warmup}",
        f"--steps={steps}",
        f"--result={result}",
    ]


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
    data = fresh_process.run_worker(
        lambda result_path: worker_command(
            provider,
            batch,
            seq,
            preset=preset.name,
            dtype=dtype,
            device=device.type,
            warmup=warmup,
            steps=steps,
            result=result_path,
        ),
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
    from tqdm.auto import tqdm

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
    oom_at: dict[tuple[str, int], int] = {}  # (provider, seq) -> smallest batch that ran out of memory
    cases = [(s, p) for s in report.shapes for p in providers]
    bar = tqdm(cases, desc=NAME, disable=not progress, leave=False)
    for (batch, seq), provider in bar:
        if provider in report.skipped:
            continue
        bar.set_postfix_str(f"{provider} {batch}x{seq}")
        smallest = oom_at.get((provider, seq))
        if smallest is not None and batch >= smallest:
            row = E2ERow(
                provider, batch, seq, "oom", error=f"not run: out of memory at batch {smallest} already"
            )
        else:
            row = run_case(
                provider,
                batch,
                seq,
                preset=preset,
                dtype=dtype,
                device=device,
                warmup=warmup,
                steps=steps,
                timeout=timeout,
            )
        if row.status == "oom":
            oom_at[(provider, seq)] = min(batch, oom_at.get((provider, seq), batch))
        fresh_process.add_row(report, provider, row, log, _summary)
    bar.close()
    return report


# ---- ratios and report files ----


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b > 0:
        return None
    return a / b


def ratios(report: E2EReport) -> list[dict[str, Any]]:
    """Per shape: fuselm's tokens/s and peak memory over Liger's and over HF's (None where missing)."""
    out = []
    for shape in report.shapes:
        f, lg, hf = (report.row(p, shape) for p in ("fuselm", "liger", "hf"))
        entry: dict[str, Any] = {"batch": shape[0], "seq": shape[1]}
        for key, other in (("liger", lg), ("hf", hf)):
            ok = f is not None and f.status == "ok" and other is not None and other.status == "ok"
            entry[f"tokens_vs_{key}"] = _ratio(f.tokens_per_s, other.tokens_per_s) if ok else None
            entry[f"peak_vs_{key}"] = _ratio(f.peak_bytes, other.peak_bytes) if ok else None
        out.append(entry)
    return out


def acceptance(report: E2EReport) -> dict[str, Any] | None:
    """The targets at batch 8 (tokens/s >= 1.05x Liger's, peak <= 0.9x Liger's); None without both rows."""
    for r in ratios(report):
        if r["batch"] == ACCEPTANCE_BATCH and r["tokens_vs_liger"] is not None:
            peak = r["peak_vs_liger"]
            return {
                "batch": r["batch"],
                "seq": r["seq"],
                "tokens_vs_liger": r["tokens_vs_liger"],
                "tokens_target": ACCEPTANCE_TOKENS,
                "tokens_met": r["tokens_vs_liger"] >= ACCEPTANCE_TOKENS,
                "peak_vs_liger": peak,
                "peak_target": ACCEPTANCE_PEAK,
                "peak_met": None if peak is None else peak <= ACCEPTANCE_PEAK,
            }
    return None


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
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report.rows:
        note = (r.error or "").replace("|", "/").replace("\n", " ")
        cells = [
            f"{r.batch}x{r.seq}",
            r.provider,
            _cell_tokens(r),
            _cell_num(r.step_ms, r, ".1f"),
            _cell_num(r.peak_gib, r, ".1f"),
            _cell_num(r.first_loss, r, ".4f"),
            _cell_num(r.final_loss, r, ".4f"),
            note,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _x(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}x"


def ratio_table(report: E2EReport) -> str:
    """fuselm / Liger and fuselm / HF, tokens/s and peak memory, per shape."""
    head = [
        "B x T",
        "tokens/s fuselm / Liger",
        "peak fuselm / Liger",
        "tokens/s fuselm / HF",
        "peak fuselm / HF",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in ratios(report):
        cells = [f"{r['batch']}x{r['seq']}"] + [
            _x(r[k]) for k in ("tokens_vs_liger", "peak_vs_liger", "tokens_vs_hf", "peak_vs_hf")
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _acceptance_line(report: E2EReport) -> str:
    a = acceptance(report)
    if a is None:
        return f"Targets at batch {ACCEPTANCE_BATCH} (fuselm vs Liger): not measured in this run."

    def verdict(met: bool | None) -> str:
        return "n/a" if met is None else ("met" if met else "NOT met")

    peak = "n/a" if a["peak_vs_liger"] is None else f"{a['peak_vs_liger']:.3f}x"
    return (
        f"Targets at batch {a['batch']} (fuselm vs Liger): tokens/s {a['tokens_vs_liger']:.3f}x "
        f"(>= {ACCEPTANCE_TOKENS}x: {verdict(a['tokens_met'])}); peak memory {peak} "
        f"(<= {ACCEPTANCE_PEAK}x: {verdict(a['peak_met'])})."
    )


def markdown(report: E2EReport) -> str:
    """The whole report: header (device, versions, commit, model, method), results, ratios, notes."""
    m = report.metadata
    dtype = DTYPE_NAMES.get(report.dtype, str(report.dtype))
    lines = [f"# fuselm bench {NAME}", "", f"{DESCRIPTION}, {dtype} weights.", ""]
    if report.device_type != "cuda":
        lines += [
            "**CPU figures** (no CUDA device): a tiny config, fp32, a few steps; a smoke test of the path, "
            "not comparable to GPU results.",
            "",
        ]
    versions = ", ".join(
        f"{k} {m[k]}" for k in ("torch", "triton", "transformers", "liger-kernel") if m.get(k) is not None
    )
    lines += [
        f"- device: {m.get('device')}",
        f"- versions: {versions}; fuselm {m.get('fuselm')} @ {m.get('commit')}",
        f"- date: {m.get('date')}",
        f"- model ({report.preset.name} preset, random init, SDPA attention, no activation checkpointing): "
        f"{_model_line(report.preset)}",
        f"- steps: {report.warmup} warmup + {report.steps} timed per run",
        f"- command: `{m.get('command')}`",
        "",
        markdown_table(report),
        "",
        ratio_table(report),
        "",
        _acceptance_line(report),
        "",
    ]
    lines += [f"- {n}" for n in notes(report)]
    lines += [f"- {p}: {PROVIDER_DESCRIPTIONS[p]}" for p in report.providers]
    for name, reason in report.skipped.items():
        lines.append(f"- skipped {name}: {reason}")
    return "\n".join(lines) + "\n"


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
        "acceptance": acceptance(report),
        "skipped": report.skipped,
        "notes": notes(report),
    }


def write_png(report: E2EReport, path: Path) -> None:
    """Two panels of grouped bars per (B x T) and provider: tokens/s and peak GiB (OOM marked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    providers = [p for p in report.providers if p not in report.skipped]
    labels = [f"{b}x{t}" for b, t in report.shapes]
    width = 0.8 / max(1, len(providers))
    fig, axes = plt.subplots(1, 2, figsize=(max(8.0, 3.0 + 1.6 * len(labels) * 2), 4))
    panels = (("tokens_per_s", "tokens/s (k)", 1e-3), ("peak_gib", "peak GiB", 1.0))
    for ax, (attr, title, scale) in zip(axes, panels, strict=True):
        any_value = False
        for i, prov in enumerate(providers):
            xs = [j + (i - (len(providers) - 1) / 2) * width for j in range(len(labels))]
            vals = []
            for x, shape in zip(xs, report.shapes, strict=True):
                r = report.row(prov, shape)
                v = getattr(r, attr) if r is not None and r.status == "ok" else None
                vals.append(float("nan") if v is None else v * scale)
                any_value |= v is not None
                if r is not None and r.status != "ok":
                    ax.text(
                        x,
                        0,
                        "OOM" if r.status == "oom" else "error",
                        ha="center",
                        va="bottom",
                        rotation=90,
                        fontsize=8,
                    )
            bars = ax.bar(xs, vals, width=width, label=prov)
            texts = ["" if math.isnan(v) else f"{v:.1f}" for v in vals]
            ax.bar_label(bars, labels=texts, fontsize=7)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_xlim(-0.5, len(labels) - 0.5)
        ax.set_xlabel("B x T")
        ax.set_title(title)
        if any_value:
            ax.legend(fontsize=8)
        else:
            ax.set_yticks([])
            text = "n/a (no CUDA)" if attr == "peak_gib" else "no results"
            ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)
    dtype = DTYPE_NAMES.get(report.dtype, str(report.dtype))
    title = f"fuselm bench {NAME} ({report.preset.name} preset), {dtype}, {report.metadata.get('device')}"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
    does not apply. Raises ``fuselm.cli.UsageError`` for bad values.
    """
    from ..cli import UsageError, parse_list, parse_shapes
    from .report import collect_metadata, gpu_slug

    providers = parse_list(args.providers, PROVIDERS, "provider") if args.providers else list(PROVIDERS)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device available")
    cuda = torch.cuda.is_available() and args.device != "cpu"
    preset = GPU_PRESET if cuda else CPU_PRESET
    shapes = parse_shapes(args.shapes, 2) if args.shapes else list(preset.shapes)
    warmup, steps, dtype = fresh_process.cli_steps_dtype(args, preset, cuda)

    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    meta = collect_metadata(device, argv)
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except ImportError:
        raise UsageError('fuselm bench e2e needs transformers: pip install "fuselm[hf]"') from None
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        meta["PYTORCH_CUDA_ALLOC_CONF"] = os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    if not cuda:
        print(
            "No CUDA device in use: these are CPU figures (tiny model, fp32, a few steps, no memory "
            "figures), not comparable to GPU results."
        )
    print(
        f"device: {meta['device']}; torch {meta['torch']}, triton {meta['triton']}, transformers "
        f"{meta['transformers']}, liger-kernel {meta.get('liger-kernel', 'n/a')}, fuselm @ {meta['commit']}"
    )
    print(
        f"{NAME}: {len(shapes)} shapes x {len(providers)} providers, {warmup} warmup + {steps} timed steps, "
        "one fresh process each",
        flush=True,
    )
    out_dir = (
        Path(args.out)
        if args.out
        else Path("benchmarks") / "results" / gpu_slug(meta["device"] if cuda else None)
    )
    report = run(
        preset=preset,
        shapes=shapes,
        providers=providers,
        dtype=dtype,
        device=device,
        warmup=warmup,
        steps=steps,
        metadata=meta,
        progress=not args.no_progress,
    )
    paths = write_report(report, out_dir)
    print()
    print(markdown(report))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0 if any(r.status == "ok" for r in report.rows) else 1


def _main(argv: Sequence[str] | None = None) -> int:
    """``python -m fuselm.bench.e2e --worker ...`` runs one worker; anything else is ``fuselm bench e2e``."""
    return fresh_process.main(argv, NAME, worker_main)


if __name__ == "__main__":
    sys.exit(_main())
