"""GRPO-shaped training step benchmark: ``fuselm bench grpo_step``.

A randomly initialised Llama-3.2-1B-shaped ``LlamaForCausalLM`` (the ``e2e`` benchmark's GPU preset: hidden
2048, 16 layers, 32 heads, 8 kv heads, intermediate 8192, vocab 128256, tied embeddings; bf16 weights, SDPA
attention, fused AdamW, no activation checkpointing) takes GRPO-shaped steps: a batch of B sequences of P
prompt + C completion token ids (random ids; completion lengths uniform in [C/2, C], the rest of each
completion is padding), per-token log-probs of the completion tokens from the last hidden states, and a
PPO-clip policy loss (clip 0.2) with random per-sequence advantages and old log-probs = the detached
current ones (the first step of a GRPO iteration), averaged over the completion tokens; the entropy of
every completion token is computed and logged (no gradient). One step: backbone forward, head, loss,
backward, ``AdamW.step()``, ``zero_grad(set_to_none=True)``.

The backbone is the same plain transformers model for every provider; only the head differs:

- ``hf``: ``model.lm_head`` on the completion positions ([B, C, V] bf16 logits), ``log_softmax`` in fp32,
  ``gather``; entropy from the log-softmax under ``torch.no_grad()``.
- ``trl``: TRL's ``trl.kernels.chunked_logprob.ChunkedLogProbFunction`` as TRL's fused LM head
  (``trl.trainer.utils.add_fused_lm_head``) calls it: on the non-padding positions only, vocabulary chunk
  32768, outputs ("log_probs", "entropy"), results scattered back with ``masked_scatter``.
- ``fuselm``: ``fuselm.linear_log_probs(hidden, lm_head.weight, targets, outputs=("log_probs", "entropy"))``
  (memory "auto") on the [B, C, H] completion hidden states, padding targets -100.

Every (provider, shape) runs in a fresh ``python -m fuselm.bench.grpo_step --worker ...`` process (peak memory
is per process); ``warmup`` steps, then ``steps`` timed steps between two ``torch.cuda.synchronize()``.
Peak memory is ``torch.cuda.max_memory_allocated()`` of the whole process (weights, gradients, AdamW state,
activations). A provider that runs out of memory at batch B is not run at a larger batch of the same (P, C).

Shapes are ``--shapes BxPxC`` triples; on a GPU the default is 8 x (512 + 1536) and 16 x (512 + 1536) (16384
and 32768 tokens a step). Without CUDA a tiny config runs in fp32 in seconds: a smoke test of the path.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from . import e2e, fresh_process, training
from .report import DTYPE_NAMES, md_table
from .runner import print_written

NAME = "grpo_step"
DESCRIPTION = "GRPO-shaped training steps of a Llama-3.2-1B-shaped model: the LM head's per-token log-probs"
PROVIDERS: tuple[str, ...] = ("hf", "trl", "fuselm")
PROVIDER_DESCRIPTIONS = {
    "hf": "lm_head logits [B, C, V] in the model dtype, log_softmax in fp32, gather; entropy under no_grad",
    "trl": "TRL 1.16 ChunkedLogProbFunction on the non-padding positions, as TRL's fused LM head calls it",
    "fuselm": 'fuselm.linear_log_probs(outputs=("log_probs", "entropy"), memory="auto")',
}
IGNORE_INDEX = -100
CLIP_EPS = 0.2
TRL_CHUNK_SIZE = 32768
WORKER_TIMEOUT_S = 300.0  # a GPU worker takes about a minute; a hung one must not eat the whole run


@dataclass(frozen=True)
class Plan:
    """Shapes and step counts of a run; ``preset`` is the e2e benchmark's model preset."""

    preset: e2e.Preset
    shapes: tuple[tuple[int, int, int], ...]  # (batch, prompt, completion)
    warmup: int
    steps: int
    quick_warmup: int
    quick_steps: int


GPU_PLAN = Plan(
    e2e.GPU_PRESET, ((8, 512, 1536), (16, 512, 1536)), warmup=3, steps=8, quick_warmup=2, quick_steps=3
)
CPU_PLAN = Plan(e2e.CPU_PRESET, ((2, 16, 48),), warmup=1, steps=2, quick_warmup=1, quick_steps=1)
PLANS = {p.preset.name: p for p in (GPU_PLAN, CPU_PLAN)}


# ---- the batch and the heads (what a worker runs) ----


def make_batch(
    vocab: int, batch: int, prompt: int, completion: int, device: torch.device, seed: int = e2e.SEED
) -> dict[str, torch.Tensor]:
    """Random ``input_ids [B, P + C]``, the completion ``mask [B, C]`` (lengths uniform in [C/2, C]),
    ``targets [B, C]`` (the completion ids, -100 on padding) and ``advantages [B]`` (standard normal,
    centred and scaled as GRPO's group normalisation leaves them)."""
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, vocab, (batch, prompt + completion), generator=gen)
    lengths = torch.randint(max(1, completion // 2), completion + 1, (batch,), generator=gen)
    mask = torch.arange(completion)[None, :] < lengths[:, None]
    targets = ids[:, prompt:].masked_fill(~mask, IGNORE_INDEX)
    adv = torch.randn(batch, generator=gen)
    if batch > 1:
        adv = (adv - adv.mean()) / (adv.std() + 1e-4)
    return {k: v.to(device) for k, v in {"ids": ids, "mask": mask, "targets": targets, "adv": adv}.items()}


Head = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def make_head(provider: str, model: Any) -> Head:
    """``head(hidden [B, C, H], targets [B, C]) -> (log_probs, entropy)``, both [B, C] fp32, 0 at -100."""
    weight = model.lm_head.weight
    if provider == "hf":

        def hf_head(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logp = torch.log_softmax(model.lm_head(h).float(), dim=-1)
            keep = t != IGNORE_INDEX
            lp = torch.where(keep, logp.gather(-1, t.clamp(min=0)[..., None]).squeeze(-1), 0.0)
            with torch.no_grad():
                ent = torch.where(keep, -(logp.exp() * logp).sum(-1), 0.0)
            return lp, ent

        return hf_head
    if provider == "trl":
        try:
            from trl.kernels.chunked_logprob import ChunkedLogProbFunction
        except Exception as e:  # noqa: BLE001 - any import failure means: not available here
            raise e2e.SkipRun(
                f"trl.kernels.chunked_logprob not importable ({type(e).__name__}: {e})"
            ) from None

        def trl_head(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            keep = t != IGNORE_INDEX
            res = ChunkedLogProbFunction.apply(
                h[keep], weight, None, t[keep], 1.0, TRL_CHUNK_SIZE, None, 1.0, ("log_probs", "entropy")
            )
            return tuple(x.new_zeros(t.shape).masked_scatter(keep, x) for x in res[:2])  # type: ignore[return-value]

        return trl_head
    if provider == "fuselm":
        import fuselm

        op = getattr(fuselm, "linear_log_probs", None)
        if op is None:
            raise e2e.SkipRun("fuselm.linear_log_probs is not in this checkout")

        def fuselm_head(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            r = op(h, weight, t, outputs=("log_probs", "entropy"), memory="auto")
            return r.log_probs, r.entropy

        return fuselm_head
    raise ValueError(f"unknown provider {provider!r}; known: {', '.join(PROVIDERS)}")


def policy_loss(log_probs: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """PPO-clip loss with old log-probs = ``log_probs.detach()``, averaged over the completion tokens."""
    ratio = torch.exp(log_probs - log_probs.detach())
    a = adv[:, None]
    per_token = -torch.minimum(ratio * a, ratio.clamp(1 - CLIP_EPS, 1 + CLIP_EPS) * a)
    m = mask.to(per_token.dtype)
    return (per_token * m).sum() / m.sum().clamp(min=1)


def train(
    plan: Plan,
    provider: str,
    batch: int,
    prompt: int,
    completion: int,
    *,
    dtype: torch.dtype,
    device: torch.device,
    warmup: int,
    steps: int,
    seed: int = e2e.SEED,
) -> dict[str, Any]:
    """Build the model, run ``warmup`` + ``steps`` GRPO-shaped steps (:func:`fuselm.bench.training.train`),
    return the measurements."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    model = e2e.build_model(plan.preset, "hf", dtype, device, seed)
    head = make_head(provider, model)
    params = sum(p.numel() for p in model.parameters())
    weights_bytes = torch.cuda.memory_allocated(device) if cuda else None
    b = make_batch(model.config.vocab_size, batch, prompt, completion, device, seed)
    n_tokens = b["mask"].sum()
    m = b["mask"].to(torch.float32)

    def forward(b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = model.model(input_ids=b["ids"]).last_hidden_state
        h = hidden[:, prompt - 1 : prompt + completion - 1]  # position i predicts token i + 1
        log_probs, entropy = head(h, b["targets"])
        loss = policy_loss(log_probs, b["mask"], b["adv"])
        with torch.no_grad():  # logged: the loss, mean log-prob and mean entropy of the completion tokens
            mean_lp, mean_ent = ((x.detach() * m).sum() / n_tokens for x in (log_probs, entropy))
            return loss, torch.stack([loss.detach().float(), mean_lp, mean_ent])

    run = training.train(
        forward,
        list(model.parameters()),
        [b] * (warmup + steps),
        lr=e2e.LR,
        fused_adamw=plan.preset.fused_adamw and cuda,
        warmup=warmup,
    )
    return {
        "status": "ok",
        "step_ms": run.timed_s / steps * 1e3,
        "tokens_per_s": run.tokens_per_s(batch * (prompt + completion)),
        "completion_tokens": int(n_tokens),
        "warmup_s": run.warmup_s,
        **fresh_process.memory_figures(device),
        "weights_bytes": weights_bytes,
        "params": params,
        "losses": [v[0] for v in run.logged],
        "mean_log_probs": [v[1] for v in run.logged],
        "mean_entropy": [v[2] for v in run.logged],
    }


def worker_main(argv: Sequence[str]) -> int:
    """One (provider, shape) run; its result as JSON in ``--result`` (status ok, oom, skipped or error)."""
    case = [(f"--{k}", {"type": int}) for k in ("batch", "prompt", "completion")]
    case.append(("--plan", {"choices": sorted(PLANS)}))
    parser = fresh_process.worker_parser(
        "python -m fuselm.bench.grpo_step --worker", "one run", case, dtypes=list(e2e.DTYPES), seed=e2e.SEED
    )
    args = parser.parse_args(argv)
    result: dict[str, Any] = {
        "provider": args.provider,
        "batch": args.batch,
        "prompt": args.prompt,
        "completion": args.completion,
    }
    device = torch.device(args.device)

    def run_one() -> dict[str, Any]:
        return train(
            PLANS[args.plan],
            args.provider,
            args.batch,
            args.prompt,
            args.completion,
            dtype=e2e.DTYPES[args.dtype],
            device=device,
            warmup=args.warmup,
            steps=args.steps,
            seed=args.seed,
        )

    return fresh_process.worker_main(result, device, args.result, run_one)


# ---- the parent ----


@dataclass
class StepRow(fresh_process.WorkerRow):
    """One (provider, B, P, C) result; ``status`` ok, oom, error or skipped."""

    SHAPE_FIELDS: ClassVar[tuple[str, ...]] = ("batch", "prompt", "completion")

    provider: str
    batch: int
    prompt: int
    completion: int
    status: str
    step_ms: float | None = None
    tokens_per_s: float | None = None
    completion_tokens: int | None = None
    peak_bytes: int | None = None
    reserved_bytes: int | None = None
    weights_bytes: int | None = None
    params: int | None = None
    losses: list[float] = field(default_factory=list)
    mean_log_probs: list[float] = field(default_factory=list)
    mean_entropy: list[float] = field(default_factory=list)
    warmup_s: float | None = None
    wall_s: float | None = None
    error: str | None = None
    traceback: str | None = None


@dataclass
class StepReport(fresh_process.CaseRows):
    """Everything one ``fuselm bench grpo_step`` run produced; ``row(provider, (B, P, C))`` finds a row."""

    plan: Plan
    dtype: torch.dtype
    device_type: str
    shapes: tuple[tuple[int, int, int], ...]
    providers: tuple[str, ...]
    warmup: int
    steps: int
    metadata: dict[str, Any]
    rows: list[StepRow] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def worker_command(
    provider: str,
    shape: tuple[int, int, int],
    *,
    plan: str,
    dtype: torch.dtype,
    device: str,
    warmup: int,
    steps: int,
    result: Path,
) -> list[str]:
    """The command line of one worker process."""
    case = {**dict(zip(StepRow.SHAPE_FIELDS, shape, strict=True)), "plan": plan}
    options = {"dtype": DTYPE_NAMES[dtype], "device": device, "warmup": warmup, "steps": steps}
    return fresh_process.worker_command("fuselm.bench.grpo_step", provider, case, **options, result=result)


def run_case(
    provider: str,
    shape: tuple[int, int, int],
    *,
    plan: Plan,
    dtype: torch.dtype,
    device: torch.device,
    warmup: int,
    steps: int,
    timeout: float = WORKER_TIMEOUT_S,
) -> StepRow:
    """One (provider, shape) in a fresh worker process (a failure of the worker becomes the row's error)."""
    options = {"dtype": dtype, "device": device.type, "warmup": warmup, "steps": steps}
    data = fresh_process.run_worker(
        lambda result: worker_command(provider, shape, plan=plan.preset.name, result=result, **options),
        timeout=timeout,
        prefix="fuselm-grpo-",
    )
    key = {"provider": provider, **dict(zip(StepRow.SHAPE_FIELDS, shape, strict=True))}
    return fresh_process.row_from_result(StepRow, key, data)


def _summary(r: StepRow) -> str:
    label = f"{r.provider} {r.batch}x({r.prompt}+{r.completion})"
    if r.status == "ok":
        peak = f", peak {r.peak_gib:.1f} GiB" if r.peak_gib is not None else ""
        return f"{label}: {r.step_ms:.1f} ms/step{peak}, mean entropy {r.mean_entropy[0]:.4f}"
    return f"{label}: {r.status}: {r.error}"


def run(
    *,
    plan: Plan,
    shapes: Sequence[tuple[int, int, int]],
    providers: Sequence[str],
    dtype: torch.dtype,
    device: torch.device,
    warmup: int,
    steps: int,
    metadata: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
    timeout: float = WORKER_TIMEOUT_S,
    on_row: Callable[[StepReport], None] | None = None,
) -> StepReport:
    """Run every (shape, provider) in its own worker process; return the report. ``on_row(report so far)``
    after each result (the CLI writes the files then: a run stopped part-way keeps what it measured)."""
    for p in providers:
        if p not in PROVIDERS:
            raise ValueError(f"unknown provider {p!r}; known: {', '.join(PROVIDERS)}")
    report = StepReport(
        plan=plan,
        dtype=dtype,
        device_type=device.type,
        shapes=tuple((int(b), int(p), int(c)) for b, p, c in shapes),
        providers=tuple(providers),
        warmup=warmup,
        steps=steps,
        metadata=dict(metadata or {}),
    )
    options = {"plan": plan, "dtype": dtype, "device": device, "warmup": warmup, "steps": steps}
    fresh_process.run_cases(
        report,
        lambda provider, shape: run_case(provider, shape, timeout=timeout, **options),
        StepRow,
        name=NAME,
        log=log,
        summary=_summary,
        progress=False,
        on_row=on_row,
    )
    return report


# ---- report ----


def ratios(report: StepReport) -> list[dict[str, Any]]:
    """Per shape: fuselm's ms/step and peak memory over TRL's and over HF's."""
    return fresh_process.ratios(report, StepRow, ("trl", "hf"), {"time": "step_ms", "peak": "peak_bytes"})


def _label(shape: tuple[int, int, int]) -> str:
    return f"{shape[0]}x({shape[1]}+{shape[2]})"


def markdown_table(report: StepReport) -> str:
    """One line per (shape, provider): ms/step, tokens/s, peak GiB, mean log-prob / entropy of step 1 and of
    the last step, note."""
    head = ["B x (P + C)", "provider", "ms/step", "tokens/s", "peak GiB", "logp step 1", "entropy step 1"]
    head += ["entropy last", "note"]
    rows = []
    for r in report.rows:
        ok = r.status == "ok"
        rows.append(
            [
                _label(r.shape),
                r.provider,
                f"{r.step_ms:.1f}" if ok else {"oom": "OOM"}.get(r.status, "error"),
                e2e.fmt_tokens(r.tokens_per_s) if ok else "—",
                ("n/a" if r.peak_gib is None else f"{r.peak_gib:.1f}") if ok else "—",
                f"{r.mean_log_probs[0]:.4f}" if ok and r.mean_log_probs else "—",
                f"{r.mean_entropy[0]:.4f}" if ok and r.mean_entropy else "—",
                f"{r.mean_entropy[-1]:.4f}" if ok and r.mean_entropy else "—",
                (r.error or "").replace("|", "/").replace("\n", " "),
            ]
        )
    return md_table(head, rows)


def ratio_table(report: StepReport) -> str:
    """fuselm / TRL and fuselm / HF: time per step and peak memory, per shape."""
    head = ["B x (P + C)", "time fuselm / TRL", "peak fuselm / TRL", "time fuselm / HF", "peak fuselm / HF"]
    label = lambda r: _label((r["batch"], r["prompt"], r["completion"]))  # noqa: E731
    return fresh_process.ratio_table(head, ratios(report), label)


def notes(report: StepReport) -> list[str]:
    cuda = report.device_type == "cuda"
    fused = "fused" if cuda and report.plan.preset.fused_adamw else "not fused"
    out = [
        "One step: backbone forward (plain transformers, SDPA), the provider's head on the completion "
        f"positions, PPO-clip loss (clip {CLIP_EPS}, old log-probs = detached current ones, random "
        f"per-sequence advantages, mean over completion tokens), backward, AdamW.step() ({fused}), "
        f"zero_grad(set_to_none=True). {report.warmup} warmup steps, then {report.steps} timed steps; the "
        "same batch every step.",
        "Batch: random ids; completion lengths uniform in [C/2, C] (the rest is padding, target -100); "
        "entropy computed for every completion token and logged (no gradient through it).",
        "ms/step: wall time of the timed steps / steps"
        + (" (torch.cuda.synchronize() before and after)" if cuda else "")
        + "; tokens/s = B * (P + C) * steps / that time.",
        "logp / entropy: mean over the completion tokens of the first and the last step (same seed, weights "
        "and batch for every provider: step 1 must agree across providers).",
        "Each (provider, shape) ran in a fresh process (`python -m fuselm.bench.grpo_step --worker`).",
    ]
    if cuda:
        out.append(
            "peak GiB = torch.cuda.max_memory_allocated() of the whole process: weights, gradients, AdamW "
            "state and activations (GiB = 2^30 bytes). OOM = torch.cuda.OutOfMemoryError; a provider out "
            "of memory at batch B is not run at a larger batch of the same (P, C)."
        )
    else:
        out.append(
            "No CUDA: a tiny config in fp32, peak memory not measured (n/a); one CPU thread per worker."
        )
    return out


def _model_line(preset: e2e.Preset) -> str:
    m = preset.model
    return (
        f"hidden {m['hidden_size']}, intermediate {m['intermediate_size']}, {m['num_hidden_layers']} layers, "
        f"{m['num_attention_heads']} heads, {m['num_key_value_heads']} kv heads, vocab {m['vocab_size']}, "
        "tied embeddings"
    )


def markdown(report: StepReport) -> str:
    """The whole report: header (device, versions, commit, model), results, ratios, notes."""
    return fresh_process.markdown(
        report,
        name=NAME,
        description=DESCRIPTION,
        cpu_figures="**CPU figures** (no CUDA device): a tiny config, fp32, a smoke test of the path.",
        versions=("torch", "triton", "transformers", "trl"),
        facts=[
            "model (random init, SDPA attention, no activation checkpointing): "
            + _model_line(report.plan.preset)
        ],
        sections=[markdown_table(report), ratio_table(report)],
        notes=[*notes(report), *(f"{p}: {PROVIDER_DESCRIPTIONS[p]}" for p in report.providers)],
    )


def to_json(report: StepReport) -> dict[str, Any]:
    """All raw numbers and the metadata, JSON-ready."""
    return {
        "suite": NAME,
        "description": DESCRIPTION,
        "model": report.plan.preset.model,
        "dtype": DTYPE_NAMES.get(report.dtype, str(report.dtype)),
        "device_type": report.device_type,
        "shape_dims": ["B", "P", "C"],
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


def write_png(report: StepReport, path: Path) -> None:
    """Two panels of grouped bars per shape and provider: ms/step and peak GiB."""
    dtype = DTYPE_NAMES.get(report.dtype, str(report.dtype))
    fresh_process.write_bars(
        report,
        path,
        panels=(("step_ms", "ms / step", 1.0), ("peak_gib", "peak GiB", 1.0)),
        labels=[_label(s) for s in report.shapes],
        title=f"fuselm bench {NAME}, {dtype}, {report.metadata.get('device')}",
        width_per_shape=2.4,
    )


def write_report(report: StepReport, out_dir: str | Path) -> dict[str, Path]:
    """Write ``grpo_step.md``, ``.json`` and ``.png`` into ``out_dir``; return their paths."""
    return fresh_process.write_report_files(
        NAME, out_dir, markdown(report), to_json(report), lambda path: write_png(report, path)
    )


# ---- command line ----


def run_cli(args: argparse.Namespace, argv: list[str]) -> int:
    """``fuselm bench grpo_step``: ``--shapes BxPxC``, ``--providers``, ``--steps``, ``--warmup``,
    ``--quick``, ``--dtype`` (CUDA only; CPU runs fp32), ``--device``, ``--out``. Raises
    ``fuselm.bench.arguments.UsageError``."""
    from .arguments import UsageError
    from .linear_log_probs import _peer_versions

    c = fresh_process.start_cli(
        args, argv, name=NAME, providers=PROVIDERS, plans=(GPU_PLAN, CPU_PLAN), ndim=3
    )
    for b, p, c_ in c.shapes:
        if p < 1:
            raise UsageError(f"bad shape {b}x{p}x{c_}: the prompt needs at least 1 token")
    c.metadata.update({k: v for k, v in _peer_versions().items() if k == "trl"})
    if c.device.type != "cuda":
        print("No CUDA device in use: a tiny config in fp32 (a smoke test), not comparable to GPU results.")
    print(
        f"{NAME}: {len(c.shapes)} shapes x {len(c.providers)} providers, {c.warmup} warmup + {c.steps} timed "
        "steps, one fresh process each",
        flush=True,
    )
    report = run(
        plan=c.plan,
        shapes=c.shapes,
        providers=c.providers,
        dtype=c.dtype,
        device=c.device,
        warmup=c.warmup,
        steps=c.steps,
        metadata=c.metadata,
        on_row=lambda r: write_report(r, c.out_dir),
    )
    print_written(markdown(report), write_report(report, c.out_dir))
    print()
    print(markdown_table(report))
    return 0 if any(r.status == "ok" for r in report.rows) else 1


if __name__ == "__main__":  # a worker: python -m fuselm.bench.grpo_step --worker ...
    sys.exit(worker_main(sys.argv[1:]))
