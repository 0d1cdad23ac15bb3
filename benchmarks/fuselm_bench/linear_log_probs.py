"""Op suite: per-token log-probs (and entropy) of the LM head, ``fuselm bench linear_log_probs``."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable
from typing import Any

import torch

import fuselm

from .harness import Inputs, Provider, Report, Shape, SkipProvider, Suite, compiled_setup, import_peer
from .linear_cross_entropy import DEFAULT_IGNORE_K, IGNORE_INDEX, RANDOM, cost
from .linear_cross_entropy import make_inputs as lce_make_inputs
from .report import cell, md_table, package_versions, shape_label

NAME = "linear_log_probs"
LOG_PROBS, WITH_ENTROPY = 1, 2
OUTPUTS = {LOG_PROBS: ("log_probs",), WITH_ENTROPY: ("log_probs", "entropy")}
TRL_CHUNK_SIZE = 32768  # the vocabulary chunk TRL's fused LM head passes (trl.trainer.utils, TRL 1.16)
ACCURACY_TOKENS = 256
_REF_SLAB = 16384  # vocabulary rows per fp64 GEMM of the reference


def split_shape(shape: Shape) -> tuple[int, int, int, int, int]:
    """``(N, H, V[, k, outputs])`` -> ``(N, H, V, k, outputs)`` (defaults: 1/7 ignored, + entropy)."""
    if len(shape) not in (3, 5):
        raise ValueError(f"expected (N, H, V, k, outputs), got {tuple(shape)}")
    n, h, v, k, outputs = (*shape, DEFAULT_IGNORE_K, WITH_ENTROPY) if len(shape) == 3 else shape
    if k < 1:
        raise ValueError(f"k (1/k of the targets ignored) must be >= 1, got {k}")
    if outputs not in OUTPUTS:
        raise ValueError(
            f"outputs must be {LOG_PROBS} (log_probs) or {WITH_ENTROPY} (+ entropy), got {outputs}"
        )
    return int(n), int(h), int(v), int(k), int(outputs)


def make_inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> Inputs:
    """The linear_cross_entropy suite's random inputs, plus ``outputs`` (the output names) and ``case`` (the
    shape, which keys the accuracy records)."""
    n, h, v, k, outputs = split_shape(shape)
    x = lce_make_inputs((n, h, v, RANDOM, k), dtype, device)
    return {**x, "outputs": OUTPUTS[outputs], "case": (n, h, v, k, outputs)}  # type: ignore[dict-item]


# ---- accuracy (recorded on each provider's first call per shape) ----

# (case, provider) -> {"log_probs": max abs error, "entropy": max abs error or None, "tokens": count}
ACCURACY: dict[tuple[tuple[int, ...], str], dict[str, Any]] = {}
_REFERENCE: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def reference(
    x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, tokens: int = ACCURACY_TOKENS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, log_probs, entropy) on the CPU of the first ``tokens`` non-ignored rows, from fp64 logits."""
    with torch.no_grad():
        rows = (target != IGNORE_INDEX).nonzero().squeeze(1)[:tokens]
        xs = x.detach()[rows].double()
        w = weight.detach()
        z = torch.cat([xs @ w[s : s + _REF_SLAB].double().T for s in range(0, w.shape[0], _REF_SLAB)], dim=1)
        logp = torch.log_softmax(z, dim=1)
        lp = logp.gather(1, target[rows][:, None]).squeeze(1)
        ent = -(logp.exp() * logp).sum(dim=1)
        return rows.cpu(), lp.cpu(), ent.cpu()


def record_accuracy(provider: str, inputs: Inputs, out: Any) -> None:
    """Compare a provider's outputs with :func:`reference`, once per (case, provider)."""
    key = (inputs["case"], provider)
    if key in ACCURACY:
        return
    x, w, t = inputs["input"], inputs["linear_weight"], inputs["target"]
    ref_key = (key[0][:4], x.dtype, str(x.device))  # the inputs do not depend on the outputs code
    if ref_key not in _REFERENCE:
        _REFERENCE.clear()  # one shape at a time: keep no stale references
        _REFERENCE[ref_key] = reference(x, w, t)
    rows, lp_ref, ent_ref = _REFERENCE[ref_key]

    def error(out: torch.Tensor, ref: torch.Tensor) -> float:
        return float((out.detach()[rows.to(out.device)].double().cpu() - ref).abs().max())

    with torch.no_grad():
        entry: dict[str, Any] = {"tokens": int(rows.numel()), "entropy": None}
        entry["log_probs"] = error(out[0], lp_ref) if rows.numel() else None
        if len(out) > 1 and out[1] is not None and rows.numel():
            entry["entropy"] = error(out[1], ent_ref)
    ACCURACY[key] = entry


def _provider(name: str, setup: Callable[[torch.device], Callable[..., Any]], description: str) -> Provider:
    """A provider of ``fn(x, w, target, outputs) -> tuple`` that records its accuracy per shape."""

    def accurate_setup(device: torch.device) -> Callable[[Inputs], Any]:
        fn = setup(device)

        def run(x: Inputs) -> Any:
            out = fn(x["input"], x["linear_weight"], x["target"], x["outputs"])
            record_accuracy(name, x, out)
            return out

        return run

    return Provider(name, accurate_setup, description)


# ---- providers: fn(x, w, target, outputs) -> (log_probs,) or (log_probs, entropy), [N] fp32 ----


def _torch(x: torch.Tensor, w: torch.Tensor, target: torch.Tensor, outputs: tuple[str, ...]) -> tuple:
    """Eager reference: fp32 logits, log_softmax, gather, entropy; 0 at ignored targets."""
    logp = torch.log_softmax((x @ w.T).float(), dim=-1)
    keep = target != IGNORE_INDEX
    lp = torch.where(keep, logp.gather(-1, target.clamp(min=0)[:, None]).squeeze(-1), 0.0)
    if "entropy" not in outputs:
        return (lp,)
    return lp, torch.where(keep, -(logp.exp() * logp).sum(dim=-1), 0.0)


def setup_trl(device: torch.device) -> Callable[..., Any]:
    """TRL's ``ChunkedLogProbFunction`` as TRL's fused LM head calls it: on the non-ignored rows only, the
    results scattered back (0 at ignored targets)."""
    trl = "trl.kernels.chunked_logprob"
    chunked = import_peer(device, trl, "ChunkedLogProbFunction", trl, cuda=False)

    def run(x: torch.Tensor, w: torch.Tensor, target: torch.Tensor, outputs: tuple[str, ...]) -> tuple:
        keep = target != IGNORE_INDEX
        res = chunked.apply(x[keep], w, None, target[keep], 1.0, TRL_CHUNK_SIZE, None, 1.0, outputs)
        return tuple(r.new_zeros(target.shape).masked_scatter(keep, r) for r in res[: len(outputs)])

    return run


def setup_liger_cute(device: torch.device) -> Callable[..., Any]:
    """Liger-Kernel's CuTe DSL SM90 fused scaled cross-entropy (per-token NLL and entropy)."""
    if device.type != "cuda":
        raise SkipProvider("needs CUDA")
    if torch.cuda.get_device_capability(device) != (9, 0):
        raise SkipProvider(f"needs an SM90 GPU (H100/H200), not {torch.cuda.get_device_name(device)}")
    try:
        from liger_kernel.ops.fused_linear_scaled_cross_entropy import _load_sm90_function

        function = _load_sm90_function()
    except Exception as e:  # noqa: BLE001
        raise SkipProvider(f"Liger's CuTe DSL path not importable ({type(e).__name__}: {e})") from None
    # positional: input, weight, target, temperature, ignore_index, m_tiles_per_cluster, return_entropy
    return _liger(lambda x, w, t, entropy: function.apply(x, w, t, 1.0, IGNORE_INDEX, 1, entropy))


def setup_liger_fallback(device: torch.device) -> Callable[..., Any]:
    """Liger-Kernel's portable fallback of the fused scaled cross-entropy (what it runs off SM90)."""
    module = "liger_kernel.ops.fused_linear_scaled_cross_entropy"
    function = import_peer(device, module, "_FusedLinearPPOFallbackFunction", cuda=False)
    # positional: input, weight, target, temperature, ignore_index, return_entropy
    return _liger(lambda x, w, t, entropy: function.apply(x, w, t, 1.0, IGNORE_INDEX, entropy))


def _liger(apply: Callable[..., Any]) -> Callable[..., Any]:
    """Liger's per-token NLL (and entropy) as log_probs = -NLL (and entropy)."""

    def run(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, outputs: tuple[str, ...]) -> tuple:
        out = apply(x, w, t, "entropy" in outputs)
        return (-out[0], out[1]) if "entropy" in outputs else (-out,)

    return run


def _setup_fuselm(memory: str) -> Callable[[torch.device], Callable[..., Any]]:
    def run(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, outputs: tuple[str, ...]) -> tuple:
        r = fuselm.linear_log_probs(x, w, t, outputs=outputs, memory=memory)
        return (r.log_probs, r.entropy) if "entropy" in outputs else (r.log_probs,)

    return lambda device: run


_LLAMA3_8B, _QWEN2_7B_2X, _GEMMA2_2B = (8192, 4096, 128256), (16384, 4096, 151936), (8192, 2304, 256000)
_K = DEFAULT_IGNORE_K

SUITE = Suite(
    name=NAME,
    description=(
        "per-token log-probs (and entropy) of x [N, H] @ W [V, H]^T at N targets, random per-token upstream "
        "gradients; x and W require grad"
    ),
    shape_dims=("N", "H", "V", "1/k ignored", "outputs (1 log_probs, 2 + entropy)"),
    gpu_shapes=(
        *((*nhv, _K, outputs) for nhv in (_LLAMA3_8B, _QWEN2_7B_2X, _GEMMA2_2B) for outputs in (1, 2)),
        (*_LLAMA3_8B, 2, LOG_PROBS),
        (*_LLAMA3_8B, 2, WITH_ENTROPY),
    ),
    cpu_shapes=(
        (256, 64, 1000, _K, LOG_PROBS),
        (256, 64, 1000, _K, WITH_ENTROPY),
        (256, 64, 1000, 2, WITH_ENTROPY),
    ),
    providers=(
        _provider("torch", lambda device: _torch, "logits.float(), log_softmax, gather, entropy; eager"),
        _provider("torch_compile", compiled_setup(_torch), "torch.compile of the eager function"),
        _provider("trl", setup_trl, "TRL ChunkedLogProbFunction on the non-ignored rows (as TRL's head)"),
        _provider("liger_cute", setup_liger_cute, "Liger fused scaled CE, CuTe DSL SM90 kernel"),
        _provider("liger_fallback", setup_liger_fallback, "Liger fused scaled CE, portable fallback"),
        _provider("fuselm", _setup_fuselm("auto"), 'fuselm.linear_log_probs(memory="auto")'),
        _provider("fuselm_min", _setup_fuselm("min"), 'fuselm.linear_log_probs(memory="min")'),
    ),
    make_inputs=make_inputs,
    cost=cost,
    columns=("ms", "x_floor", "extra_mib"),
    forward_grad=True,
    notes=(
        "Shapes: N x H x V x k x outputs: round(N/k) targets ignored (-100) at random positions; "
        "outputs 1 = log_probs, 2 = log_probs + entropy. Random inputs (logits about N(0, 1)); "
        "temperature 1, no bias.",
        "Backward: random per-token upstream gradients (randn) on log_probs and, when asked for, on the "
        "entropy.",
        "x floor: time / (6NHV (full), 2NHV (fwd), 4NHV (bwd) FLOPs at the measured GEMM rate); a design "
        "that recomputes the logits in the backward (per-token gradients: no gradient in the forward) is "
        "bounded by 8NHV = 1.33x floor.",
        "trl processes the non-ignored rows only (hidden[mask], as TRL's fused LM head does, then "
        "masked_scatter); the other providers take all N rows.",
        "liger_cute validates its targets with a host sync (its default, "
        "LIGER_SCALED_CE_SM90_VALIDATE_TARGETS=1) and returns the entropy in bf16; liger_fallback "
        "materializes fp32 logits in 512-token chunks.",
    ),
)


# ---- the accuracy and summary tables ----


def summary_table(report: Report) -> str:
    head = ["N x H x V x k x outputs", "provider", "fwd ms", "bwd ms", "fwd+bwd ms", "x floor", "extra MiB"]
    head += ["max err log_probs", "max err entropy"]
    lines = []
    for shape in report.shapes:
        for p in (p for p in report.providers if p not in report.skipped):
            fwd, bwd, full = (report.row(shape, p, m) for m in ("fwd", "bwd", "full"))
            cells = [shape_label(shape), p, *("—" if r is None else cell(r, "ms") for r in (fwd, bwd, full))]
            cells += ["—" if full is None else cell(full, col) for col in ("x_floor", "extra_mib")]
            acc = ACCURACY.get((split_shape(shape), p)) or {}
            cells += ["—" if acc.get(k) is None else f"{acc[k]:.1e}" for k in ("log_probs", "entropy")]
            lines.append(cells)
    return md_table(head, lines)


def extra_markdown(report: Report) -> str:
    m = report.metadata
    peers = ", ".join(f"{k} {m[k]}" for k in ("trl", "liger-kernel", "nvidia-cutlass-dsl") if m.get(k))
    lines = [
        "## Summary (fwd+bwd columns from the full mode; accuracy vs fp64)",
        "",
        summary_table(report),
        "",
        f"Accuracy: max abs error over the first {ACCURACY_TOKENS} non-ignored tokens of each shape, against "
        "log_softmax of fp64 logits of the same (rounded) x and W; measured on each provider's first call.",
        *([f"Peers in this run: {peers}."] if peers else []),
    ]
    return "\n".join(lines) + "\n"


def peer_versions() -> dict[str, str]:
    """TRL's and nvidia-cutlass-dsl's versions (TRL's kernels may be on the path without its metadata)."""
    out = package_versions(("trl", "nvidia-cutlass-dsl"))
    if "trl" not in out:
        with contextlib.suppress(Exception):
            import trl.kernels.chunked_logprob  # noqa: F401

            out["trl"] = "kernels only (trl/kernels on the path, no package metadata)"
    return out


# ---- command line ----


def run_cli(args: argparse.Namespace, argv: list[str]) -> int:
    """``fuselm bench linear_log_probs``: :func:`runner.run_op_suites` with the accuracy, its summary last."""
    from .runner import run_op_suites

    def extras(report: Report) -> dict[str, Any]:
        cases = [(s, p, (split_shape(s), p)) for s in report.shapes for p in report.providers]
        accuracy = [
            {"shape": list(s), "provider": p, **ACCURACY[key]} for s, p, key in cases if key in ACCURACY
        ]
        return {"extra_markdown": extra_markdown(report), "extra_json": {"accuracy": accuracy}}

    ACCURACY.clear()
    try:
        return run_op_suites([SUITE], args, argv, peer_versions(), split_shape, extras, summary_table)
    finally:
        _REFERENCE.clear()
