"""Convergence: N AdamW steps of a model patched by fuselm.hf against the same model unpatched, from the
same init on the same batches. Per-step losses, final parameters and the top-k log-probs of the trained
models on held-out tokens follow the numerics rule against an unpatched float64 run:
err(patched) <= 2 * err(unpatched, same dtype) + atol[dtype].

CPU (CI): fp32, tiny configs: dense families (Llama, Phi-3's packed MLP and partial RoPE, Gemma 2's
softcaps), a MoE (Qwen3-MoE: router auxiliary loss, a dense layer) and a multimodal wrapper (Gemma 3's
ConditionalGeneration). GPU: bf16, hidden 1024, 4 layers, vocab 32000, those and more (the Triton
kernels in the loop: RMSNorm, RoPE, SwiGLU / GeGLU, fused linear cross-entropy). Every model type of
the registry is checked step by step in test_families.py.
"""

from __future__ import annotations

import pytest
import torch
from conftest import HAS_CUDA
from kit.hf_models import CLASSIC_TYPES, build, clone

import fuselm.hf
from fuselm.ops._common.testing import assert_numerics

STEPS = 20
CPU_TYPES = ("llama", "phi3", "gemma2", "qwen3_moe", "gemma3")
GPU_TYPES = (*CLASSIC_TYPES, "qwen3_moe", "mixtral", "deepseek_v3", "gemma3", "qwen2_vl", "llava")
TOP_K = 5


def _batches(vocab: int, batch: int, seq: int, steps: int, device: str, seed: int = 7):
    """steps + 1 batches (the last one held out) of a learnable stream: from a random first token, each
    token is a fixed function of the previous one (a bigram table the model can pick up within a few
    steps, so the loss falls and the runs are compared while learning). A third of each row's first
    tokens is masked out of the labels (a prompt)."""
    g = torch.Generator().manual_seed(seed)
    successor = torch.randint(3, vocab - 5, (vocab,), generator=g)  # clear of image tokens
    out = []
    for _ in range(steps + 1):
        ids = torch.empty(batch, seq, dtype=torch.long)
        ids[:, 0] = torch.randint(3, vocab - 5, (batch,), generator=g)
        for t in range(1, seq):
            ids[:, t] = successor[ids[:, t - 1]]
        labels = ids.clone()
        labels[:, : seq // 3] = -100
        out.append((ids.to(device), labels.to(device)))
    return out


def _train(model, batches, lr: float):
    """AdamW steps on every batch but the last; returns (per-step losses, top-k log-probs of the held-out
    batch at the positions/indices ``topk_at`` picks later, full held-out log-probs)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses = []
    model.train()
    for ids, labels in batches[:-1]:
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.detach().double().cpu())
    model.eval()
    with torch.no_grad():
        logprobs = model(input_ids=batches[-1][0]).logits.double().log_softmax(-1).cpu()
    return torch.stack(losses), logprobs, out.logits


def _check_convergence(
    model_type: str, dtype: torch.dtype, device: str, sizes: dict, batch: int, seq: int, lr
):
    eager = build(model_type, dtype, device, **sizes)
    ref = clone(eager, torch.float64)
    ours = fuselm.hf.patch(clone(eager))
    batches = _batches(eager.config.get_text_config().vocab_size, batch, seq, STEPS, device)
    try:
        (l_ref, p_ref, _), (l_eager, p_eager, _), (l_ours, p_ours, last_logits) = (
            _train(m, batches, lr) for m in (ref, eager, ours)
        )
    finally:
        fuselm.hf.unpatch(ours)
    assert last_logits is None  # the patched training forward made no logits
    assert_numerics("per-step losses", l_ours, l_eager, l_ref, dtype)
    top = p_ref.topk(TOP_K, dim=-1).indices  # the reference model's top-k tokens at every position
    assert_numerics(
        f"top-{TOP_K} log-probs",
        p_ours.gather(-1, top),
        p_eager.gather(-1, top),
        p_ref.gather(-1, top),
        dtype,
    )
    params = [dict(m.named_parameters()) for m in (ref, eager, ours)]
    for name in params[1]:
        assert_numerics(f"trained {name}", params[2][name], params[1][name], params[0][name], dtype)
    assert l_ref[-1] < l_ref[0]  # it did learn something: the comparison is not between untrained models


@pytest.mark.parametrize("model_type", CPU_TYPES)
def test_convergence_cpu_fp32(model_type):
    """lr 5e-4: at 3e-3 these 20 fp32 steps are chaotic too (torch 2.13 CPU): each step's gradients are
    within the rule, but Llama's trained layer-0 gate_proj ends at 1.8x the bound, at 0.93x with lr 1e-3,
    0.54x with 5e-4 (the unpatched run's own error grows the same way); the loss still falls from 5.8
    to 4.3."""
    _check_convergence(model_type, torch.float32, "cpu", dict(hidden=64, layers=2, vocab=300), 2, 32, 5e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("model_type", GPU_TYPES)
def test_convergence_gpu_bf16(model_type):
    """bf16 weights and AdamW states, lr 3e-4. At lr 1e-3 these 20 steps are chaotic in bf16: the
    unpatched run alone ends 10-60% away from the float64 run in top-5 log-probs, and which of two
    equally rounded runs drifts further is luck (benchmarks/scripts/convergence_sensitivity.py; NOTES.md).
    At 3e-4 the loss still falls and both runs stay within ~1% of float64 (top-5), so the rule compares
    the kernels, not the chaos."""
    sizes = dict(hidden=1024, layers=4, vocab=32000, heads=8)
    _check_convergence(model_type, torch.bfloat16, "cuda", sizes, 4, 256, 3e-4)
