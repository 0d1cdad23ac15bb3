"""``fuselm bench e2e``: whole training steps (forward with labels, backward, ``AdamW.step``) of randomly
initialised Llama-3.2-1B / Qwen3-0.6B / Llama-3-8B-shaped causal LMs (:data:`MODELS`), host vs GPU time."""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from . import fresh_process, step_timing, training
from .arguments import UsageError, parse_list, parse_shapes
from .harness import import_peer
from .report import md_table

NAME = "e2e"
DESCRIPTION = "end-to-end training steps of Llama-3.2-1B / Qwen3-0.6B shapes (HF transformers), host vs GPU"
PROVIDERS: tuple[str, ...] = ("hf", "liger", "fuselm", "fuselm-graph", "hf-trainer", "fuselm-trainer")
DEFAULT_PROVIDERS: tuple[str, ...] = ("hf", "liger", "fuselm")
PROVIDER_DESCRIPTIONS = {
    "hf": "transformers, eager modules, SDPA attention",
    "liger": "transformers + Liger-Kernel apply_liger_kernel_to_<family> (rope, rms_norm, swiglu, FLCE)",
    "fuselm": "transformers + fuselm.hf.patch(model) (rms_norm, rope, swiglu, linear cross-entropy)",
    "fuselm-graph": (
        "fuselm's model with forward + backward captured in one CUDA graph and replayed each step "
        "(fuselm.CapturedStep), AdamW outside it (opt-in: --providers ...,fuselm-graph)"
    ),
    "hf-trainer": "transformers.Trainer.train() of the hf model (opt-in)",
    "fuselm-trainer": "Trainer.train() of fuselm's model under capture_training_steps (opt-in; CUDA)",
}
TRAINER_PROVIDERS = ("hf-trainer", "fuselm-trainer")
SEED = fresh_process.SEED
LR = 1e-5
WORKER_TIMEOUT_S = 1800.0
BUILT = "random init, SDPA attention, no activation checkpointing"  # the models of e2e
HOST_BOUND = 0.9  # bound by the GPU when its kernels run >= HOST_BOUND of the step, else by the host

LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}  # fmt: skip

# the tiny sizes every family takes on a CPU
TINY = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": 3,
}  # fmt: skip


@dataclass(frozen=True)
class ModelShape:
    """A named model shape: its transformers family and full-size config (:data:`TINY` on a CPU)."""

    name: str
    family: str
    config: dict[str, Any]
    nf4_only: bool = False  # saved as a 4-bit checkpoint (its bf16 weights fit no one machine): QLoRA only

    def settings(self, tiny: bool = False) -> dict[str, Any]:
        return {**self.config, **TINY} if tiny else dict(self.config)

    def describe(self, tiny: bool = False) -> str:
        m = self.settings(tiny)
        rope = "llama3 scaling" if m.get("rope_scaling") else "default"
        return (
            f"{self.name} ({self.family}{', tiny' if tiny else ''}): hidden {m['hidden_size']}, intermediate "
            f"{m['intermediate_size']}, {m['num_hidden_layers']} layers, {m['num_attention_heads']} heads, "
            f"{m['num_key_value_heads']} kv heads, head_dim {m['head_dim']}, vocab {m['vocab_size']}, "
            f"{'tied' if m.get('tie_word_embeddings') else 'untied'} embeddings, rope theta "
            f"{m['rope_theta']:g} ({rope})"
        )


# Llama-3-8B's config; the other Llama shapes change a few of its sizes
LLAMA3_8B: dict[str, Any] = {
    "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "rope_theta": 500000.0, "bos_token_id": 128000, "eos_token_id": 128001,
}  # fmt: skip
QWEN3_06B: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "rope_theta": 1000000.0, "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645,
}  # fmt: skip
LLAMA32_1B = {
    **LLAMA3_8B, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "head_dim": 64,
    "max_position_embeddings": 131072, "tie_word_embeddings": True, "rope_scaling": LLAMA3_ROPE_SCALING,
}  # fmt: skip
# Llama-3.3-70B's shape: QLoRA only (141 GB of bf16 weights; fuselm_bench.nf4_checkpoint saves it 4-bit)
LLAMA3_70B = {
    **LLAMA3_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
    "num_attention_heads": 64, "max_position_embeddings": 131072,
    "rope_scaling": {**LLAMA3_ROPE_SCALING, "factor": 8.0},
}  # fmt: skip

MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("llama3.2-1b", "llama", LLAMA32_1B),
        ModelShape("qwen3-0.6b", "qwen3", QWEN3_06B),
        ModelShape("llama3-8b", "llama", LLAMA3_8B),
        ModelShape("llama3-70b", "llama", LLAMA3_70B, nf4_only=True),
    )
}
DEFAULT_MODEL = "llama3.2-1b"

GPU_GRID = (("llama3.2-1b", 1, 512), ("llama3.2-1b", 1, 2048), ("llama3.2-1b", 4, 2048))
GPU_GRID += (("llama3.2-1b", 4, 4096), ("llama3.2-1b", 8, 4096), ("qwen3-0.6b", 1, 2048))
GPU_PRESET = fresh_process.Plan("gpu", GPU_GRID, 3, 10, 2, 4, profile_steps=3)
CPU_GRID = (("llama3.2-1b", 2, 64), ("qwen3-0.6b", 2, 64))
CPU_PRESET = fresh_process.Plan("cpu", CPU_GRID, 2, 3, 1, 2, profile_steps=1)


# ---- the model and one training run (what a worker process does) ----


def apply_provider_before_build(provider: str, device: torch.device, family: str = "llama") -> None:
    """Liger's class-level patches, before the model is built."""
    if provider != "liger":
        return
    apply = import_peer(device, "liger_kernel.transformers", f"apply_liger_kernel_to_{family}")
    apply(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True)


def build_model(
    preset: fresh_process.Plan,
    provider: str,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = SEED,
    model: str = DEFAULT_MODEL,
):
    """Seeded random init of ``model`` (tiny on a CPU), the provider's patches (same seed: same weights)."""
    if provider not in PROVIDERS:
        raise ValueError(f"unknown provider {provider!r}; known: {', '.join(PROVIDERS)}")
    shape = MODELS[model]
    apply_provider_before_build(provider, device, shape.family)
    config = training.causal_lm_config(shape.family, shape.settings(preset.tiny), "sdpa")
    torch.manual_seed(seed)
    built = training.build_causal_lm(config, device, dtype)
    if provider in ("fuselm", "fuselm-graph", "fuselm-trainer"):
        import fuselm.hf

        fuselm.hf.patch(built)
    return built


def train(case: fresh_process.WorkerCase) -> dict[str, Any]:
    """A worker's run: build the case's model, train it; the measurements (exceptions, OOM too, propagate)."""
    provider, model = case.provider, case.shape[0]
    built, figures = fresh_process.build_measured(
        lambda: build_model(case.plan, provider, case.dtype, case.device, case.seed, model), case.device
    )
    trainer, graphs = provider in TRAINER_PROVIDERS, provider in ("fuselm-graph", "fuselm-trainer")
    forward = training.causal_lm_loss(built)
    out = run_training(case, built, forward, list(built.parameters()), lr=LR, trainer=trainer, graphs=graphs)
    return {**out, **figures, "final_loss": out["losses"][-1]}


def run_training(
    case: fresh_process.WorkerCase,
    model: Any,
    forward: training.Forward,
    params: list[torch.nn.Parameter],
    *,
    lr: float,
    trainer: bool = False,
    graphs: bool = False,
    called: set[int] | None = None,
) -> dict[str, Any]:
    """The steps of a worker on one random batch (the case's shape ends with B, T), through
    ``Trainer.train()`` or an AdamW loop on ``forward`` (``called``: :func:`step_timing.watch_first_step`):
    their figures, peak memory and losses. ``case.extra["profile_steps"]`` overrides the plan's."""
    (batch, seq), device = case.shape[-2:], case.device
    gen = torch.Generator().manual_seed(case.seed + 1)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen).to(device)
    fused = device.type == "cuda"  # fused AdamW: CUDA only
    profiled = case.extra.get("profile_steps", case.plan.profile_steps)
    timing = {"warmup": case.warmup, "steps": case.steps, "profiled": profiled, "device": device}
    if trainer:
        run = step_timing.run_trainer(model, ids, graphs=graphs, lr=lr, fused=fused, seed=case.seed, **timing)
    else:
        step = step_timing.optimizer_step(forward, params, [ids], lr=lr, fused=fused, graphed=graphs)
        if called is not None:
            step = step_timing.watch_first_step(step, called)
        run = step_timing.run_steps(step, **timing)
    return {
        "status": "ok",
        **step_figures(run, batch * seq, device),
        **fresh_process.memory_figures(device),
        "losses": run.logged,
        "first_loss": run.logged[0] if run.logged else None,
    }


def step_figures(run: step_timing.StepRun, tokens_per_step: int, device: torch.device) -> dict[str, Any]:
    """A worker's per-step figures of ``run`` (GPU figures None off CUDA)."""
    median = statistics.median(run.step_s) if run.step_s else None
    # no CUDA, or a profile without device events (CUPTI unavailable): no GPU figures rather than zeros
    prof = run.profile if device.type == "cuda" and run.profile is not None and run.profile.kernels else None

    def per_step(name: str, scale: float) -> float | None:
        value = prof.per_step(name) if prof is not None else None
        return None if value is None else value * scale

    return {
        "step_ms": None if median is None else median * 1e3,
        "step_ms_all": [s * 1e3 for s in run.step_s],
        "tokens_per_s": None if not median else tokens_per_step / median,
        "cpu_ms": run.cpu_s / len(run.step_s) * 1e3 if run.step_s else None,
        "gpu_ms": per_step("kernel_s", 1e3),
        "launches": per_step("kernels", 1.0),
        "memcpy_ms": per_step("memcpy_s", 1e3),
        "memcpys": per_step("memcpys", 1.0),
        "profile_steps": 0 if run.profile is None else run.profile.steps,
        "top_kernels": None if prof is None else prof.top(),
        "idle_ms": per_step("idle_s", 1e3),
        "top_idle": None if prof is None else prof.top(10, "idle_before"),
        "warmup_s": run.warmup_s,
    }


def bound_by(gpu_ms: float | None, step_ms: float | None, cuda: bool = True) -> str | None:
    """``GPU`` when its kernels keep the GPU busy ``>= HOST_BOUND`` of the step, else ``host`` (the GPU waits
    for Python, the launches or a synchronization); None without both figures, or off CUDA."""
    if gpu_ms is None or not step_ms or not cuda:
        return None
    return "GPU" if gpu_ms >= HOST_BOUND * step_ms else "host"


def rows_bound_by(rows: list[Any], cuda: bool) -> str | None:
    """:func:`bound_by` of the medians over ``rows``' ok repeats."""
    return bound_by(*(fresh_process.median_of(rows, a) for a in ("gpu_ms", "step_ms")), cuda)


def bound_cell(rows: list[Any], cuda: bool) -> str:
    return (rows_bound_by(rows, cuda) or "n/a") if any(r.status == "ok" for r in rows) else "—"


# ---- the parent: one fresh process per (configuration, repeat, provider) ----


@dataclass
class E2ERow(fresh_process.WorkerRow):
    """One (provider, model, B, T, repeat) result."""

    SHAPE_FIELDS: ClassVar[tuple[str, ...]] = ("model", "batch", "seq")
    SHAPE_DIMS: ClassVar[tuple[str, ...]] = ("model", "B", "T")
    SHAPE_TITLE: ClassVar[str] = "model B x T"
    SHAPE_FORMAT: ClassVar[str] = "{} {}x{}"

    provider: str
    model: str
    batch: int
    seq: int
    status: str
    final_loss: float | None = None


def precheck(provider: str, device: torch.device) -> str | None:
    """Why a provider cannot run here, else None: fuselm-graph and fuselm-trainer (CUDA graphs) and the peers
    (liger, unsloth) need CUDA, and a peer must be importable. Finetune's precheck too."""
    if provider in ("fuselm-graph", "fuselm-trainer") and device.type != "cuda":
        return "needs CUDA (CUDA graphs)"
    package = {"liger": "liger_kernel", "unsloth": "unsloth"}.get(provider)
    if package is None:
        return None
    if device.type != "cuda":
        return "needs CUDA"
    if importlib.util.find_spec(package) is None:
        return f"{package} not importable (pip install {package.replace('_', '-')}, or put it on PYTHONPATH)"
    return None


# ---- report files ----


def markdown_table(report: fresh_process.CaseReport) -> str:
    """One line per (configuration, provider); medians over the repeats with their range."""
    head = ["model", "B x T", "provider", "tokens/s", "ms/step", "CPU ms/step", "GPU ms/step"]
    head += ["launches/step", "bound by", "peak GiB", "first loss", "note"]
    cuda = report.device_type == "cuda"
    cell = fresh_process.summary_cell
    lines = []
    for (model, b, t), provider, rows in report.groups():
        tokens = fresh_process.first_cell(rows, "tokens_per_s", fresh_process.fmt_tokens)
        cells = [model, f"{b}x{t}", provider, tokens, *(cell(rows, a) for a in ("step_ms", "cpu_ms"))]
        cells += [cell(rows, "gpu_ms"), cell(rows, "launches", "{:.0f}".format), bound_cell(rows, cuda)]
        cells += [cell(rows, "peak_gib"), cell(rows, "first_loss", "{:.4f}".format)]
        lines.append([*cells, fresh_process.note_cell(rows)])
    return md_table(head, lines)


def step_notes(report: fresh_process.CaseReport) -> list[str]:
    """How the step figures of a row are measured (``e2e``, ``finetune``)."""
    waits = {r.gpu_wait for r in report.rows if r.status == "ok"} - {None}
    if waits == {"blocking"}:
        wait = "; a wait for the GPU inside a step sleeps (CUDA blocking sync): this is host work alone."
    elif waits or report.device_type == "cuda":  # none: rows of an older version, whose waits spun
        wait = (
            f"; waits for the GPU: {', '.join(sorted(waits)) or 'spin'} (a spinning wait counts as CPU time)."
        )
    else:
        wait = "."
    return [
        "ms/step: the median of the timed steps, each between two device synchronizations; tokens/s = "
        "B * T / that median.",
        "CPU ms/step: time.process_time() (all threads) of the timed steps, read before each step's closing "
        "synchronization, / steps" + wait,
        "GPU ms/step and launches/step: the CUDA kernels' summed device time and number in a torch.profiler "
        "window of the profiled steps (after the timed ones), / steps; memory copies and memsets are not in "
        "them (memcpy_ms, memcpys in the JSON).",
        f"bound by: GPU when GPU ms/step >= {HOST_BOUND} x ms/step, else host (the GPU waits for Python, the "
        "launches or a synchronization).",
    ]


def notes(report: fresh_process.CaseReport) -> list[str]:
    fused = "fused" if report.device_type == "cuda" else "not fused"
    out = [
        "One step: forward with labels = input_ids (random ids, the same batch every step), backward, "
        f"AdamW.step() ({fused}), zero_grad(set_to_none=True).",
        *step_notes(report),
        "first loss: the loss of the first step (same seed, weights and batch for every provider).",
    ]
    if any(p in TRAINER_PROVIDERS for p in report.providers):
        out.append(
            "hf-trainer, fuselm-trainer: steps of transformers.Trainer.train() (the same batch through its "
            "data loader, gradient clipping at 1.0, the loss logged every step), timed from the end of one "
            "optimizer step to the end of the next; fuselm-trainer under capture_training_steps."
            + "".join(f" {line}" for line in trainer_ratios(report))
        )
    return out


def trainer_ratios(report: fresh_process.CaseReport) -> list[str]:
    """fuselm-trainer's tokens/s over hf-trainer's per configuration, with the per-repeat range."""
    out = []
    for shape in report.shapes:
        value, each = fresh_process.pair_ratio(report, shape, "fuselm-trainer", "hf-trainer", "tokens_per_s")
        if value is not None:
            text = fresh_process.ratio_text(value, each)
            out.append(f"{E2ERow.label(shape)}: fuselm-trainer / hf-trainer tokens/s {text}.")
    return out


def model_facts(report: fresh_process.CaseReport) -> list[str]:
    """The sizes of the report's models."""
    models = dict.fromkeys(s[0] for s in report.shapes)
    return [f"model {MODELS[m].describe(report.plan.tiny)}" for m in models if m in MODELS]


def plan_json(report: fresh_process.CaseReport) -> dict[str, Any]:
    cuda = report.device_type == "cuda"
    models = dict.fromkeys(s[0] for s in report.shapes)
    return {
        "preset": report.plan.name,
        "models": {m: MODELS[m].settings(report.plan.tiny) for m in models if m in MODELS},
        "profile_steps": report.plan.profile_steps,
        "host_bound_threshold": HOST_BOUND,
        "bound_by": [
            {"model": m, "batch": b, "seq": t, "provider": p, "bound_by": rows_bound_by(rows, cuda)}
            for (m, b, t), p, rows in report.groups()
        ],
    }


BENCH = fresh_process.Bench(
    name=NAME,
    description=DESCRIPTION,
    providers=PROVIDERS,
    default_providers=DEFAULT_PROVIDERS,
    provider_descriptions=PROVIDER_DESCRIPTIONS,
    row_type=E2ERow,
    plans=(GPU_PRESET, CPU_PRESET),
    train=train,
    timeout_s=WORKER_TIMEOUT_S,
    versions=("torch", "triton", "transformers", "liger-kernel"),
    peers={"liger": "Liger", "hf": "HF"},
    metrics={"tokens": ("tokens_per_s", "tokens/s"), "peak": ("peak_bytes", "peak")},
    precheck=precheck,
    facts=lambda report: [*model_facts(report), BUILT],
    tables=markdown_table,
    notes=notes,
    plan_json=plan_json,
    panels=(
        ("tokens_per_s", "tokens/s (k)", 1e-3),
        ("step_ms", "ms/step", 1.0),
        ("cpu_ms", "CPU ms/step", 1.0),
        ("gpu_ms", "GPU kernel ms/step", 1.0),
        ("peak_gib", "peak GiB", 1.0),
    ),
)


# ---- command line ----


def grid(args: argparse.Namespace, preset: fresh_process.Plan) -> list[tuple[str, int, int]]:
    """``--models`` at ``--shapes`` BxT, else the preset's grid limited to ``--models``."""
    in_grid = list(dict.fromkeys(m for m, _, _ in preset.shapes))
    trained_in_full = [m for m in MODELS if not MODELS[m].nf4_only]
    models = parse_list(args.models, trained_in_full, "model", default=in_grid)
    if args.shapes:
        return [(m, b, t) for m in models for b, t in parse_shapes(args.shapes, 2)]
    missing = [m for m in models if m not in in_grid]
    if missing:
        raise UsageError(f"--models {','.join(missing)}: not in the default grid; give --shapes BxT too")
    return [c for c in preset.shapes if c[0] in models]


def run_cli(args: argparse.Namespace, argv: list[str]) -> int:
    """``fuselm bench e2e``; the exit code. Raises ``UsageError``."""
    if args.repeats is None:
        args.repeats = 3
    c = fresh_process.start_cli(BENCH, args, argv, grid=grid)
    alloc = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    c.metadata.update({k: os.environ[k] for k in alloc if os.environ.get(k)})
    return fresh_process.run_cli(BENCH, c, progress=not args.no_progress)


if __name__ == "__main__":  # a worker: python -m fuselm_bench.e2e --worker ... (the benchmark: fuselm bench)
    sys.exit(fresh_process.worker_main(BENCH, sys.argv[1:]))
