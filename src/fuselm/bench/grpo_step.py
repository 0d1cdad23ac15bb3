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
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import e2e, fresh_process

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
    """Build the model, run ``warmup`` + ``steps`` GRPO-shaped steps, return the measurements."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    model = e2e.build_model(plan.preset, "hf", dtype, device, seed)
    head = make_head(provider, model)
    params = sum(p.numel() for p in model.parameters())
    weights_bytes = torch.cuda.memory_allocated(device) if cuda else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=e2e.LR, fused=plan.preset.fused_adamw and cuda)
    b = make_batch(model.config.vocab_size, batch, prompt, completion, device, seed)
    n_tokens = b["mask"].sum()

    def step() -> torch.Tensor:
        hidden = model.model(input_ids=b["ids"]).last_hidden_state
        h = hidden[:, prompt - 1 : prompt + completion - 1]  # position i predicts token i + 1
        log_probs, entropy = head(h, b["targets"])
        loss = policy_loss(log_probs, b["mask"], b["adv"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            m = b["mask"].to(torch.float32)
            return torch.stack(
                [
                    loss.detach().float(),
                    (log_probs.detach() * m).sum() / n_tokens,
                    (entropy.detach() * m).sum() / n_tokens,
                ]
            )

    logs = []
    t_build = time.perf_counter()
    for _ in range(warmup):
        logs.append(step())
    e2e._sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        logs.append(step())
    e2e._sync(device)
    elapsed = time.perf_counter() - t0
    values = torch.stack(logs).cpu().tolist()
    return {
        "status": "ok",
        "step_ms": elapsed / steps * 1e3,
        "tokens_per_s": batch * (prompt + completion) * steps / elapsed,
        "completion_tokens": int(n_tokens),
        "warmup_s": t0 - t_build,
        "peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "reserved_bytes": torch.cuda.max_memory_reserved(device) if cuda else None,
        "weights_bytes": weights_bytes,
        "params": params,
        "losses": [v[0] for v in values],
        "mean_log_probs": [v[1] for v in values],
        "mean_entropy": [v[2] for v in values],
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
class StepRow:
    """One (provider, B, P, C) result; ``status`` ok, oom, error or skipped."""

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

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.batch, self.prompt, self.completion)

    @property
    def peak_gib(self) -> float | None:
        return None if self.peak_bytes is None else self.peak_bytes / e2e.GIB


@dataclass
class StepReport:
    """Everything one ``fuselm bench grpo_step`` run produced."""

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

    def row(self, provider: str, shape: tuple[int, int, int]) -> StepRow | None:
        for r in self.rows:
            if r.provider == provider and r.shape == tuple(shape):
                return r
        return None


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
    b, p, c = shape
    return [
        sys.executable,
        "-m",
        "fuselm.bench.grpo_step",
        "--worker",
        f"--provider={provider}",
        f"--batch={b}",
        f"--prompt={p}",
        f"--completion={c}",
        f"--plan={plan}",
        f"--dtype={e2e.DTYPE_NAMES[dtype]}",
        f"--device={device}",
        f"--warmup={warmup}",
        f"--steps={steps}",
        f"--result={result}",
    ]


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
    data = fresh_process.run_worker(
        lambda result_path: worker_command(
            provider,
            shape,
            plan=plan.preset.name,
            dtype=dtype,
            device=device.type,
            warmup=warmup,
            steps=steps,
            result=result_path,
        ),
        timeout=timeout,
        prefix="fuselm-grpo-",
    )
    b, p, c = shape
    return fresh_process.row_from_result(
        StepRow, {"provider": provider, "batch": b, "prompt": p, "completion": c}, data
    )


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
    oom_at: dict[tuple[str, int, int], int] = {}
    for shape in report.shapes:
        for provider in providers:
            if provider in report.skipped:
                continue
            smallest = oom_at.get((provider, shape[1], shape[2]))
            if smallest is not None and shape[0] >= smallest:
                row = StepRow(
                    provider, *shape, "oom", error=f"not run: out of memory at batch {smallest} already"
                )
            else:
                row = run_case(
                    provider,
                    shape,
                    plan=plan,
                    dtype=dtype,
                    device=device,
                    warmup=warmup,
                    steps=steps,
                    timeout=timeout,
                )
            if row.status == "oom":
                key = (provider, shape[1], shape[2])
                oom_at[key] = min(shape[0], oom_at.get(key, shape[0]))
            if not fresh_process.add_row(report, provider, row, log, _summary):
                continue
            if on_row is not None:
                on_row(report)
    return report


# ---- report ----


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or not b > 0 else a / b


def ratios(report: StepReport) -> list[dict[str, Any]]:
    """Per shape: fuselm's ms/step and peak memory over TRL's and over HF's."""
    out = []
    for shape in report.shapes:
        f = report.row("fuselm", shape)
        entry: dict[str, Any] = {"batch": shape[0], "prompt": shape[1], "completion": shape[2]}
        for key in ("trl", "hf"):
            o = report.row(key, shape)
            ok = f is not None and f.status == "ok" and o is not None and o.status == "ok"
            entry[f"time_vs_{key}"] = _ratio(f.step_ms, o.step_ms) if ok else None
            entry[f"peak_vs_{key}"] = _ratio(f.peak_bytes, o.peak_bytes) if ok else None
        out.append(entry)
    return out


def _label(shape: tuple[int, int, int]) -> str:
    return f"{shape[0]}x({shape[1]}+{shape[2]})"


def markdown_table(report: StepReport) -> str:
    """One line per (shape, provider): ms/step, tokens/s, peak GiB, mean log-prob / entropy of step 1 and of
    the last step, note."""
    head = ["B x (P + C)", "provider", "ms/step", "tokens/s", "peak GiB", "logp step 1", "entropy step 1"]
    head += ["entropy last", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report.rows:
        ok = r.status == "ok"
        note = (r.error or "").replace("|", "/").replace("\n", " ")
        cells = [
            _label(r.shape),
            r.provider,
            f"{r.step_ms:.1f}" if ok else {"oom": "OOM"}.get(r.status, "error"),
            e2e.fmt_tokens(r.tokens_per_s) if ok else "—",
            ("n/a" if r.peak_gib is None else f"{r.peak_gib:.1f}") if ok else "—",
            f"{r.mean_log_probs[0]:.4f}" if ok and r.mean_log_probs else "—",
            f"{r.mean_entropy[0]:.4f}" if ok and r.mean_entropy else "—",
            f"{r.mean_entropy[-1]:.4f}" if ok and r.mean_entropy else "—",
            note,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratio_table(report: StepReport) -> str:
    """fuselm / TRL and fuselm / HF: time per step and peak memory, per shape."""
    head = ["B x (P + C)", "time fuselm / TRL", "peak fuselm / TRL", "time fuselm / HF", "peak fuselm / HF"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in ratios(report):
        keys = ("time_vs_trl", "peak_vs_trl", "time_vs_hf", "peak_vs_hf")
        cells = [_label((r["batch"], r["prompt"], r["completion"]))]
        cells += ["—" if r[k] is None else f"{r[k]:.2f}x" for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


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
    m = report.metadata
    dtype = e2e.DTYPE_NAMES.get(report.dtype, str(report.dtype))
    lines = [f"# fuselm bench {NAME}", "", f"{DESCRIPTION}, {dtype} weights.", ""]
    if report.device_type != "cuda":
        lines += ["**CPU figures** (no CUDA device): a tiny config, fp32, a smoke test of the path.", ""]
    versions = ", ".join(
        f"{k} {m[k]}" for k in ("torch", "triton", "transformers", "trl") if m.get(k) is not None
    )
    lines += [
        f"- device: {m.get('device')}",
        f"- versions: {versions}; fuselm {m.get('fuselm')} @ {m.get('commit')}",
        f"- date: {m.get('date')}",
        "- model (random init, SDPA attention, no activation checkpointing): "
        + _model_line(report.plan.preset),
        f"- command: `{m.get('command')}`",
        "",
        markdown_table(report),
        "",
        ratio_table(report),
        "",
    ]
    lines += [f"- {n}" for n in notes(report)]
    lines += [f"- {p}: {PROVIDER_DESCRIPTIONS[p]}" for p in report.providers]
    lines += [f"- skipped {name}: {reason}" for name, reason in report.skipped.items()]
    return "\n".join(lines) + "\n"


def to_json(report: StepReport) -> dict[str, Any]:
    return {
        "suite": NAME,
        "description": DESCRIPTION,
        "model": report.plan.preset.model,
        "dtype": e2e.DTYPE_NAMES.get(report.dtype, str(report.dtype)),
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    providers = [p for p in report.providers if p not in report.skipped]
    labels = [_label(s) for s in report.shapes]
    width = 0.8 / max(1, len(providers))
    fig, axes = plt.subplots(1, 2, figsize=(max(8.0, 3.0 + 2.4 * len(labels)), 4))
    for ax, (attr, title) in zip(axes, (("step_ms", "ms / step"), ("peak_gib", "peak GiB")), strict=True):
        for i, prov in enumerate(providers):
            xs = [j + (i - (len(providers) - 1) / 2) * width for j in range(len(labels))]
            vals = []
            for shape in report.shapes:
                r = report.row(prov, shape)
                v = getattr(r, attr) if r is not None and r.status == "ok" else None
                vals.append(float("nan") if v is None else v)
            bars = ax.bar(xs, vals, width=width, label=prov)
            ax.bar_label(bars, labels=["" if math.isnan(v) else f"{v:.1f}" for v in vals], fontsize=7)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_title(title)
        if providers:
            ax.legend(fontsize=8)
    dtype = e2e.DTYPE_NAMES.get(report.dtype, str(report.dtype))
    fig.suptitle(f"fuselm bench {NAME}, {dtype}, {report.metadata.get('device')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(report: StepReport, out_dir: str | Path) -> dict[str, Path]:
    """Write ``grpo_step.md``, ``.json`` and ``.png`` into ``out_dir``; return their paths."""
    return fresh_process.write_report_files(
        NAME, out_dir, markdown(report), to_json(report), lambda path: write_png(report, path)
    )


# ---- command line ----


def run_cli(args: argparse.Namespace, argv: list[str]) -> int:
    """``fuselm bench grpo_step``: ``--shapes BxPxC``, ``--providers``, ``--steps``, ``--warmup``,
    ``--quick``, ``--dtype`` (CUDA only; CPU runs fp32), ``--device``, ``--out``. Raises
    ``fuselm.cli.UsageError``."""
    from ..cli import UsageError, parse_list, parse_shapes
    from .report import collect_metadata, gpu_slug

    providers = parse_list(args.providers, PROVIDERS, "provider") if args.providers else list(PROVIDERS)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device available")
    cuda = torch.cuda.is_available() and args.device != "cpu"
    plan = GPU_PLAN if cuda else CPU_PLAN
    shapes = parse_shapes(args.shapes, 3) if args.shapes else list(plan.shapes)
    for b, p, c in shapes:
        if p < 1:
            raise UsageError(f"bad shape {b}x{p}x{c}: the prompt needs at least 1 token")
    warmup, steps, dtype = fresh_process.cli_steps_dtype(args, plan, cuda)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    meta = collect_metadata(device, argv)
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except ImportError:
        raise UsageError('fuselm bench grpo_step needs transformers: pip install "fuselm[hf]"') from None
    from .linear_log_probs import _peer_versions

    meta.update({k: v for k, v in _peer_versions().items() if k == "trl"})
    if not cuda:
        print("No CUDA device in use: a tiny config in fp32 (a smoke test), not comparable to GPU results.")
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
        plan=plan,
        shapes=shapes,
        providers=providers,
        dtype=dtype,
        device=device,
        warmup=warmup,
        steps=steps,
        metadata=meta,
        on_row=lambda r: write_report(r, out_dir),
    )
    paths = write_report(report, out_dir)
    print()
    print(markdown(report))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    print()
    print(markdown_table(report))
    return 0 if any(r.status == "ok" for r in report.rows) else 1


def _main(argv: Sequence[str] | None = None) -> int:
    """``python -m fuselm.bench.grpo_step --worker ...`` runs one worker; anything else is ``fuselm bench
    grpo_step``."""
    return fresh_process.main(argv, NAME, worker_main)


if __name__ == "__main__":
    sys.exit(_main())
