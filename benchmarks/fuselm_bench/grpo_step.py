"""``fuselm bench grpo_step``: GRPO-shaped training steps of a Llama-3.2-1B-shaped model, the LM head's
per-token log-probs by provider (:data:`PROVIDER_DESCRIPTIONS`; the backbone is the same plain transformers
model for all)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from . import e2e, fresh_process, step_timing
from .linear_log_probs import peer_versions, setup_trl
from .report import md_table

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
WORKER_TIMEOUT_S = 300.0  # a GPU worker takes about a minute; a hung one must not eat the whole run


# shapes: (batch, prompt, completion); the model: e2e's default (Llama-3.2-1B, tiny on a CPU)
GPU_PLAN = fresh_process.Plan("gpu", ((8, 512, 1536), (16, 512, 1536)), 3, 8, 2, 3)
CPU_PLAN = fresh_process.Plan("cpu", ((2, 16, 48),), 1, 2, 1, 1)


# ---- the batch and the heads (what a worker runs) ----


def make_batch(
    vocab: int, batch: int, prompt: int, completion: int, device: torch.device, seed: int = e2e.SEED
) -> dict[str, torch.Tensor]:
    """Random ``ids [B, P + C]``, completion ``mask [B, C]``, ``targets [B, C]`` (-100 on padding) and ``adv
    [B]`` (normalised as GRPO's groups leave them)."""
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
        trl = setup_trl(weight.device)
        return lambda h, t: trl(h, weight, t, ("log_probs", "entropy"))
    if provider == "fuselm":
        import fuselm

        def fuselm_head(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            r = fuselm.linear_log_probs(h, weight, t, outputs=("log_probs", "entropy"), memory="auto")
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


def train(case: fresh_process.WorkerCase) -> dict[str, Any]:
    """A worker's run: build the model, ``warmup`` + ``steps`` GRPO-shaped steps, the measurements."""
    (batch, prompt, completion), device = case.shape, case.device
    model, figures = fresh_process.build_measured(
        lambda: e2e.build_model(case.plan, "hf", case.dtype, device, case.seed), device
    )
    head = make_head(case.provider, model)
    b = make_batch(model.config.vocab_size, batch, prompt, completion, device, case.seed)
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

    fused = device.type == "cuda"  # fused AdamW: CUDA only
    step = step_timing.optimizer_step(forward, list(model.parameters()), [b], lr=e2e.LR, fused=fused)
    run = step_timing.run_steps(step, warmup=case.warmup, steps=case.steps, profiled=0, device=device)
    return {
        "status": "ok",
        **e2e.step_figures(run, batch * (prompt + completion), device),
        "completion_tokens": int(n_tokens),
        **fresh_process.memory_figures(device),
        **figures,
        "losses": [v[0] for v in run.logged],
        "mean_log_probs": [v[1] for v in run.logged],
        "mean_entropy": [v[2] for v in run.logged],
    }


# ---- the parent ----


@dataclass
class StepRow(fresh_process.WorkerRow):
    """One (provider, B, P, C) result; ``status`` ok, oom, error or skipped."""

    SHAPE_FIELDS: ClassVar[tuple[str, ...]] = ("batch", "prompt", "completion")
    SHAPE_DIMS: ClassVar[tuple[str, ...]] = ("B", "P", "C")
    SHAPE_TITLE: ClassVar[str] = "B x (P + C)"
    SHAPE_FORMAT: ClassVar[str] = "{}x({}+{})"

    provider: str
    batch: int
    prompt: int
    completion: int
    status: str
    completion_tokens: int | None = None
    mean_log_probs: list[float] = field(default_factory=list)
    mean_entropy: list[float] = field(default_factory=list)

    def figures(self) -> tuple[str, str]:
        return f"{self.step_ms:.1f} ms/step", f"mean entropy {self.mean_entropy[0]:.4f}"


# ---- report ----


def markdown_table(report: fresh_process.CaseReport) -> str:
    head = ["B x (P + C)", "provider", "ms/step", "tokens/s", "peak GiB", "logp step 1", "entropy step 1"]
    head += ["entropy last", "note"]
    lines = []
    for r in report.rows:
        cells = [fresh_process.failed_cell([r]), *["—"] * 5]
        if r.status == "ok":
            cells = [f"{r.step_ms:.1f}", fresh_process.fmt_tokens(r.tokens_per_s)]
            cells.append("n/a" if r.peak_gib is None else f"{r.peak_gib:.1f}")
            firsts_last = ((r.mean_log_probs, 0), (r.mean_entropy, 0), (r.mean_entropy, -1))
            cells += [f"{values[i]:.4f}" if values else "—" for values, i in firsts_last]
        lines.append([StepRow.label(r.shape), r.provider, *cells, fresh_process.note_cell([r])])
    return md_table(head, lines)


def notes(report: fresh_process.CaseReport) -> list[str]:
    fused = "fused" if report.device_type == "cuda" else "not fused"
    return [
        "One step: backbone forward (plain transformers, SDPA), the provider's head on the completion "
        f"positions, PPO-clip loss (clip {CLIP_EPS}, old log-probs = detached current ones, random "
        f"per-sequence advantages, mean over completion tokens), backward, AdamW.step() ({fused}), "
        "zero_grad(set_to_none=True); the same batch every step.",
        "Batch: random ids; completion lengths uniform in [C/2, C] (the rest is padding, target -100); "
        "entropy computed for every completion token and logged (no gradient through it).",
        "ms/step: the median of the timed steps, each between two device synchronizations; tokens/s = "
        "B * (P + C) / that median.",
        "logp / entropy: mean over the completion tokens of the first and the last step (same seed, weights "
        "and batch for every provider: step 1 must agree across providers).",
    ]


BENCH = fresh_process.Bench(
    name=NAME,
    description=DESCRIPTION,
    providers=PROVIDERS,
    provider_descriptions=PROVIDER_DESCRIPTIONS,
    row_type=StepRow,
    plans=(GPU_PLAN, CPU_PLAN),
    train=train,
    timeout_s=WORKER_TIMEOUT_S,
    versions=("torch", "triton", "transformers", "trl"),
    peers={"trl": "TRL", "hf": "HF"},
    facts=lambda report: [f"model {e2e.MODELS[e2e.DEFAULT_MODEL].describe(report.plan.tiny)}", e2e.BUILT],
    tables=markdown_table,
    notes=notes,
    plan_json=lambda report: {"model": e2e.MODELS[e2e.DEFAULT_MODEL].settings(report.plan.tiny)},
)


# ---- command line ----


def run_cli(args: argparse.Namespace, argv: list[str]) -> int:
    """``fuselm bench grpo_step`` (``--shapes BxPxC``); the exit code. Raises ``UsageError``."""
    c = fresh_process.start_cli(BENCH, args, argv)  # parse_shapes: every size >= 1, the prompt's too
    c.metadata.update({k: v for k, v in peer_versions().items() if k == "trl"})
    return fresh_process.run_cli(BENCH, c, progress=False, summary=markdown_table)


if __name__ == "__main__":  # a worker: python -m fuselm_bench.grpo_step --worker ...
    sys.exit(fresh_process.worker_main(BENCH, sys.argv[1:]))
