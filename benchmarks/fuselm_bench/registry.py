"""The suites the lab knows: name -> (module, one-line description), imported lazily."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable

from .harness import Suite

SUITES: dict[str, tuple[str, str]] = {
    "cross_entropy": ("fuselm_bench.cross_entropy", "cross-entropy on given [N, V] logits"),
    "linear_cross_entropy": ("fuselm_bench.linear_cross_entropy", "linear layer + cross-entropy, fused"),
    "rms_norm": ("fuselm_bench.rms_norm", "RMSNorm over [N, H] (S = 2: residual add fused), fwd + bwd"),
    "layer_norm": ("fuselm_bench.layer_norm", "LayerNorm with weight and bias over [N, H], fwd + bwd"),
    "rope": ("fuselm_bench.rope", "rotary position embedding of q and k (Hugging Face layout)"),
    "swiglu": ("fuselm_bench.swiglu", "SwiGLU silu(gate) * up on [N, I], forward + backward"),
}

TRAINING_SUITES: dict[str, tuple[str, str]] = {
    "e2e": (
        "fuselm_bench.e2e",
        "Llama-3.2-1B / Qwen3-0.6B training steps: HF vs HF+Liger vs HF+fuselm, host vs GPU time (minutes)",
    ),
    "finetune": (
        "fuselm_bench.finetune",
        "LoRA / QLoRA steps of a saved random-init model: HF+PEFT vs +Liger vs +fuselm vs Unsloth (minutes)",
    ),
    "linear_log_probs": (
        "fuselm_bench.linear_log_probs",
        "per-token log-probs (+ entropy) of the LM head vs torch, TRL, Liger; accuracy vs fp64 (minutes)",
    ),
    "max-context": (
        "fuselm_bench.max_context",
        "the longest sequence one LoRA / QLoRA step fits under a memory cap, by bisection (minutes to hours)",
    ),
}


def suite_names() -> list[str]:
    """The op suites, in order (what ``all`` runs)."""
    return list(SUITES)


def get_suite(name: str) -> Suite:
    return importlib.import_module(SUITES[name][0]).SUITE


def get_training_runner(name: str) -> Callable[[argparse.Namespace, list[str]], int]:
    if name not in TRAINING_SUITES:
        raise KeyError(f"unknown training benchmark {name!r}; known: {', '.join(TRAINING_SUITES)}")
    return importlib.import_module(TRAINING_SUITES[name][0]).run_cli
