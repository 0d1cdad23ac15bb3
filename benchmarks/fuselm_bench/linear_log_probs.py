"""Benchmark suite: per-token log-probs (and entropy) of the LM head, ``fuselm bench linear_log_probs``.

What RL and preference losses (GRPO, PPO, DPO) need from the head: ``log_probs[i] = log softmax(x @ W.T)[i,
target_i]`` and often the entropy of row i, with a *different* upstream gradient per token (advantages),
so that the gradient cannot be formed in the forward as a mean loss's can. Every provider gets random
per-token upstream gradients on log_probs (and on entropy when it is asked for).

A shape is ``(N, H, V, k, outputs)``: x ``[N, H]``, W ``[V, H]`` (both require grad), target ``[N]`` with
``round(N / k)`` entries (random positions) set to -100 (``k = 7``: 1/7 ignored, ``k = 2``: half), and
``outputs`` 1 for ``("log_probs",)``, 2 for ``("log_probs", "entropy")``. Inputs are those of the
linear_cross_entropy suite's random case (x ~ N(0, 1), W ~ N(0, 1/H): logits about N(0, 1)).

Providers (temperature 1, no bias, no softcap; per-token outputs in fp32, 0 at ignored targets):

- ``torch``: logits ``(x @ W.T).float()``, ``log_softmax``, ``gather`` at the targets, entropy
  ``-(p * log p).sum(-1)``; eager, every row (ignored ones too).
- ``torch_compile``: ``torch.compile`` of the same function (static shapes; compiled once per
  (N, H, V, outputs)); skipped on CPU.
- ``trl``: TRL's ``trl.kernels.chunked_logprob.ChunkedLogProbFunction.apply(hidden, weight, None, targets,
  1.0, 32768, None, 1.0, outputs)`` called as TRL's fused LM head calls it: on the non-ignored rows only
  (``hidden[mask]``), the results scattered back with ``masked_scatter`` (so TRL pays no FLOPs for ignored
  tokens). Its gradients are accumulated in fp32 [N, H] and [V, H] buffers.
- ``liger_cute``: Liger-Kernel's CuTe DSL SM90 fused scaled cross-entropy,
  ``liger_kernel.ops.fused_linear_scaled_cross_entropy._load_sm90_function().apply(x, W, target, 1.0, -100,
  1, return_entropy)`` (needs an SM90 GPU, bf16, and nvidia-cutlass-dsl); it returns the per-token NLL
  (fp32) and the entropy (bf16), log_probs = -NLL.
- ``liger_fallback``: Liger's portable fallback of the same op, ``_FusedLinearPPOFallbackFunction.apply(x,
  W, target, 1.0, -100, return_entropy)`` (512-token chunks of fp32 logits), what Liger runs off SM90.
- ``fuselm`` / ``fuselm_min``: ``fuselm.linear_log_probs(x, W, target, outputs=..., memory="auto" / "min")``.

Cost: the GEMMs over all N rows, 2NHV FLOPs forward, 4NHV backward, 6NHV forward + backward; ``x_floor`` is
the time over those FLOPs at the GEMM rate measured in the run. Per-token upstream gradients force the
logits to be recomputed in the backward by any design that does not keep them, so 8NHV (1.33x) is the
bound of an O(N)-memory design. The forward is timed as in a training step (``forward_grad=True``).

Accuracy: for every (shape, provider) the outputs of its first call are compared with an fp64 reference
(``log_softmax`` of fp64 logits of the same bf16 x and W) on the first 256 non-ignored tokens: max abs
error of log_probs and of the entropy. The first call is a warmup call of the harness (or the call that
shapes the upstream gradients), outside the timed and the memory-measured calls.

This suite has its own runner (``run_cli``, for the accuracy table); ``fuselm bench linear_log_probs``
takes ``--shapes NxHxVxkxE``, ``--providers``, ``--modes``, ``--dtype``, ``--quick``, ``--device``, ``--out``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .harness import Inputs, Provider, Report, Shape, SkipProvider, Suite, import_peer
from .linear_cross_entropy import DEFAULT_IGNORE_K, IGNORE_INDEX, RANDOM, cost, ignored_share
from .linear_cross_entropy import make_inputs as lce_make_inputs

NAME = "linear_log_probs"
LOG_PROBS, WITH_ENTROPY = 1, 2
OUTPUTS = {LOG_PROBS: ("log_probs",), WITH_ENTROPY: ("log_probs", "entropy")}
OUTPUT_LABELS = {LOG_PROBS: "log_probs", WITH_ENTROPY: "log_probs + entropy"}
TRL_CHUNK_SIZE = 32768  # the vocabulary chunk TRL's fused LM head passes (trl.trainer.utils, TRL 1.16)
ACCURACY_TOKENS = 256
_REF_SLAB = 16384  # vocabulary rows per fp64 GEMM of the reference


def split_shape(shape: Shape) -> tuple[int, int, int, int, int]:
    """``(N, H, V)`` or ``(N, H, V, k, outputs)`` -> ``(N, H, V, k, outputs)`` (defaults: 1/7 ignored,
    log_probs + entropy).

    Example:
        >>> split_shape((256, 64, 1000))
        (256, 64, 1000, 7, 2)
    """
    if len(shape) == 3:
        n, h, v = shape
        k, outputs = DEFAULT_IGNORE_K, WITH_ENTROPY
    elif len(shape) == 5:
        n, h, v, k, outputs = shape
    else:
        raise ValueError(f"expected (N, H, V, k, outputs), got {tuple(shape)}")
    if k < 1:
        raise ValueError(f"k (1/k of the targets ignored) must be >= 1, got {k}")
    if outputs not in OUTPUTS:
        raise ValueError(
            f"outputs must be {LOG_PROBS} (log_probs) or {WITH_ENTROPY} (+ entropy), got {outputs}"
        )
    return int(n), int(h), int(v), int(k), int(outputs)


def describe(shape: Shape) -> str:
    """(8192, 4096, 128256, 2, 2) -> 'N=8192 H=4096 V=128256, half ignored, log_probs + entropy'."""
    n, h, v, k, outputs = split_shape(shape)
    return f"N={n} H={h} V={v}, {ignored_share(k)} ignored, {OUTPUT_LABELS[outputs]}"


def make_inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> Inputs:
    """x ``[N, H]`` and W ``[V, H]`` (both require grad), target ``[N]`` with ``round(N / k)`` entries -100
    (the linear_cross_entropy suite's random inputs), plus two plain entries the providers read:
    ``outputs`` (the tuple of output names) and ``case`` (the shape, which keys the accuracy records)."""
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
    """(rows, log_probs, entropy): the first ``tokens`` non-ignored rows and their log-probs and entropy from
    fp64 logits of the given x and W (on their device, ``_REF_SLAB`` vocabulary rows per GEMM), on the CPU."""
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
    """Compare a provider's outputs with :func:`reference` (once per (case, provider))."""
    case = inputs["case"]
    key = (case, provider)
    if key in ACCURACY:
        return
    x, w, t = inputs["input"], inputs["linear_weight"], inputs["target"]
    ref_key = (case[:4], x.dtype, str(x.device))  # the inputs do not depend on the outputs code
    if ref_key not in _REFERENCE:
        _REFERENCE.clear()  # one shape at a time: keep no stale references
        _REFERENCE[ref_key] = reference(x, w, t)
    rows, lp_ref, ent_ref = _REFERENCE[ref_key]
    outs = out if isinstance(out, (tuple, list)) else (out,)
    with torch.no_grad():
        lp = outs[0].detach()[rows.to(outs[0].device)].double().cpu()
        entry: dict[str, Any] = {"tokens": int(rows.numel()), "entropy": None}
        entry["log_probs"] = float((lp - lp_ref).abs().max()) if rows.numel() else None
        if len(outs) > 1 and outs[1] is not None and rows.numel():
            ent = outs[1].detach()[rows.to(outs[1].device)].double().cpu()
            entry["entropy"] = float((ent - ent_ref).abs().max())
    ACCURACY[key] = entry


def _with_accuracy(name: str, fn: Callable[[Inputs], Any]) -> Callable[[Inputs], Any]:
    def run(inputs: Inputs) -> Any:
        out = fn(inputs)
        if (inputs.get("case"), name) not in ACCURACY and "case" in inputs:
            record_accuracy(name, inputs, out)
        return out

    return run


# ---- providers ----


def _args(x: Inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[str, ...]]:
    return x["input"], x["linear_weight"], x["target"], x["outputs"]  # type: ignore[return-value]


def torch_log_probs(
    x: torch.Tensor, w: torch.Tensor, target: torch.Tensor, entropy: bool
) -> tuple[torch.Tensor, ...]:
    """Eager reference: fp32 logits, log_softmax, gather, entropy; 0 at ignored targets."""
    logits = (x @ w.T).float()
    logp = torch.log_softmax(logits, dim=-1)
    keep = target != IGNORE_INDEX
    lp = logp.gather(-1, target.clamp(min=0)[:, None]).squeeze(-1)
    lp = torch.where(keep, lp, 0.0)
    if not entropy:
        return (lp,)
    ent = -(logp.exp() * logp).sum(dim=-1)
    return lp, torch.where(keep, ent, 0.0)


def setup_torch(device: torch.device) -> Callable[[Inputs], Any]:
    """Eager PyTorch on [N, V] logits."""

    def run(x: Inputs) -> Any:
        a, w, t, outputs = _args(x)
        return torch_log_probs(a, w, t, "entropy" in outputs)

    return _with_accuracy("torch", run)


_COMPILED: dict[str, Any] = {}


def setup_torch_compile(device: torch.device) -> Callable[[Inputs], Any]:
    """torch.compile of the eager function, static shapes; compiled once per (N, H, V, outputs) (the cache of
    Dynamo is reset when that changes). Skipped on CPU to keep the CPU run short."""
    if device.type != "cuda":
        raise SkipProvider("skipped on CPU (compile time would dominate a CPU smoke run)")

    def run(x: Inputs) -> Any:
        a, w, t, outputs = _args(x)
        key = (tuple(a.shape), tuple(w.shape), outputs, a.dtype)
        if _COMPILED.get("key") != key:
            torch._dynamo.reset()
            _COMPILED["key"] = key
            _COMPILED["fn"] = torch.compile(torch_log_probs, dynamic=False)
        return _COMPILED["fn"](a, w, t, "entropy" in outputs)

    return _with_accuracy("torch_compile", run)


def setup_trl(device: torch.device) -> Callable[[Inputs], Any]:
    """TRL's ChunkedLogProbFunction on the non-ignored rows, as TRL's fused LM head calls it."""
    trl = "trl.kernels.chunked_logprob"
    chunked_log_probs = import_peer(device, trl, "ChunkedLogProbFunction", trl, cuda=False)

    def run(x: Inputs) -> Any:
        a, w, t, outputs = _args(x)
        mask = t != IGNORE_INDEX
        res = chunked_log_probs.apply(a[mask], w, None, t[mask], 1.0, TRL_CHUNK_SIZE, None, 1.0, outputs)
        lp = res[0].new_zeros(t.shape).masked_scatter(mask, res[0])
        if "entropy" not in outputs:
            return (lp,)
        return lp, res[1].new_zeros(t.shape).masked_scatter(mask, res[1])

    return _with_accuracy("trl", run)


def setup_liger_cute(device: torch.device) -> Callable[[Inputs], Any]:
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

    def run(x: Inputs) -> Any:
        a, w, t, outputs = _args(x)
        entropy = "entropy" in outputs
        # positional: input, weight, target, temperature, ignore_index, m_tiles_per_cluster, return_entropy
        out = function.apply(a, w, t, 1.0, IGNORE_INDEX, 1, entropy)
        return (-out[0], out[1]) if entropy else (-out,)

    return _with_accuracy("liger_cute", run)


def setup_liger_fallback(device: torch.device) -> Callable[[Inputs], Any]:
    """Liger-Kernel's portable fallback of the fused scaled cross-entropy (what it runs off SM90)."""
    module = "liger_kernel.ops.fused_linear_scaled_cross_entropy"
    function = import_peer(device, module, "_FusedLinearPPOFallbackFunction", cuda=False)

    def run(x: Inputs) -> Any:
        a, w, t, outputs = _args(x)
        entropy = "entropy" in outputs
        # positional: input, weight, target, temperature, ignore_index, return_entropy
        out = function.apply(a, w, t, 1.0, IGNORE_INDEX, entropy)
        return (-out[0], out[1]) if entropy else (-out,)

    return _with_accuracy("liger_fallback", run)


def _fuselm_op() -> Callable[..., Any]:
    import fuselm

    op = getattr(fuselm, "linear_log_probs", None)
    if op is None:
        raise SkipProvider("fuselm.linear_log_probs is not in this checkout")
    return op


def _setup_fuselm(name: str, memory: str) -> Callable[[torch.device], Callable[[Inputs], Any]]:
    def setup(device: torch.device) -> Callable[[Inputs], Any]:
        op = _fuselm_op()

        def run(x: Inputs) -> Any:
            a, w, t, outputs = _args(x)
            r = op(a, w, t, outputs=outputs, memory=memory)
            return (r.log_probs, r.entropy) if "entropy" in outputs else (r.log_probs,)

        return _with_accuracy(name, run)

    setup.__doc__ = f'fuselm.linear_log_probs, memory="{memory}".'
    return setup


setup_fuselm = _setup_fuselm("fuselm", "auto")
setup_fuselm_min = _setup_fuselm("fuselm_min", "min")

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
        (*_LLAMA3_8B, _K, LOG_PROBS),
        (*_LLAMA3_8B, _K, WITH_ENTROPY),
        (*_QWEN2_7B_2X, _K, LOG_PROBS),
        (*_QWEN2_7B_2X, _K, WITH_ENTROPY),
        (*_GEMMA2_2B, _K, LOG_PROBS),
        (*_GEMMA2_2B, _K, WITH_ENTROPY),
        (*_LLAMA3_8B, 2, LOG_PROBS),
        (*_LLAMA3_8B, 2, WITH_ENTROPY),
    ),
    cpu_shapes=(
        (256, 64, 1000, _K, LOG_PROBS),
        (256, 64, 1000, _K, WITH_ENTROPY),
        (256, 64, 1000, 2, WITH_ENTROPY),
    ),
    providers=(
        Provider("torch", setup_torch, "logits.float(), log_softmax, gather, entropy; eager"),
        Provider("torch_compile", setup_torch_compile, "torch.compile of the eager function"),
        Provider("trl", setup_trl, "TRL ChunkedLogProbFunction on the non-ignored rows (as TRL's head)"),
        Provider("liger_cute", setup_liger_cute, "Liger fused scaled CE, CuTe DSL SM90 kernel"),
        Provider("liger_fallback", setup_liger_fallback, "Liger fused scaled CE, portable fallback"),
        Provider("fuselm", setup_fuselm, 'fuselm.linear_log_probs(memory="auto")'),
        Provider("fuselm_min", setup_fuselm_min, 'fuselm.linear_log_probs(memory="min")'),
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


def _sci(x: float | None) -> str:
    return "—" if x is None else f"{x:.1e}"


def accuracy_rows(report) -> list[dict[str, Any]]:
    """One entry per (shape, provider) that recorded its accuracy in this process, in the report's order."""
    out = []
    for shape in report.shapes:
        case = split_shape(shape)
        for p in report.providers:
            a = ACCURACY.get((case, p))
            if a is not None:
                out.append({"shape": list(shape), "provider": p, **a})
    return out


def summary_table(report) -> str:
    """One line per (shape, provider): fwd / bwd / fwd+bwd ms, x floor (fwd+bwd), extra MiB (fwd+bwd),
    max abs error of log_probs and entropy vs fp64."""
    from .report import cell, md_table, shape_label

    head = ["N x H x V x k x outputs", "provider", "fwd ms", "bwd ms", "fwd+bwd ms", "x floor", "extra MiB"]
    head += ["max err log_probs", "max err entropy"]
    lines = []
    for shape in report.shapes:
        for p in report.providers:
            if p in report.skipped:
                continue
            fwd, bwd, full = (report.row(shape, p, m) for m in ("fwd", "bwd", "full"))
            cells = [shape_label(shape), p, *("—" if r is None else cell(r, "ms") for r in (fwd, bwd, full))]
            cells += ["—" if full is None else cell(full, col) for col in ("x_floor", "extra_mib")]
            acc = ACCURACY.get((split_shape(shape), p)) or {}
            lines.append([*cells, _sci(acc.get("log_probs")), _sci(acc.get("entropy"))])
    return md_table(head, lines)


def extra_markdown(report) -> str:
    """The section after the harness's table: the summary with accuracy, and what the peers were."""
    m = report.metadata
    peers = ", ".join(f"{k} {m[k]}" for k in ("trl", "liger-kernel", "nvidia-cutlass-dsl") if m.get(k))
    lines = [
        "## Summary (fwd+bwd columns from the full mode; accuracy vs fp64)",
        "",
        summary_table(report),
        "",
        f"Accuracy: max abs error over the first {ACCURACY_TOKENS} non-ignored tokens of each shape, against "
        "log_softmax of fp64 logits of the same (rounded) x and W; measured on each provider's first call.",
    ]
    if peers:
        lines.append(f"Peers in this run: {peers}.")
    return "\n".join(lines) + "\n"


def peer_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    try:
        out["trl"] = version("trl")
    except PackageNotFoundError:
        try:
            import trl.kernels.chunked_logprob  # noqa: F401

            out["trl"] = "kernels only (trl/kernels on the path, no package metadata)"
        except Exception:  # noqa: BLE001
            pass
    try:
        out["nvidia-cutlass-dsl"] = version("nvidia-cutlass-dsl")
    except PackageNotFoundError:
        pass
    return out


# ---- command line ----


def run_cli(args: argparse.Namespace, argv: list[str]) -> int:
    """``fuselm bench linear_log_probs`` with the parsed ``fuselm bench`` arguments; returns the exit code
    (0: something measured, 1: nothing). Raises ``fuselm_bench.arguments.UsageError`` for bad values."""
    from .report import write_report
    from .runner import finish, start

    session, [(_, shapes, providers)] = start([SUITE], args, argv, peer_versions(), check_shape=split_shape)
    out_dir = session.out_dir
    ACCURACY.clear()

    def write_partial(report: Report, done: int) -> None:
        accuracy = {"accuracy": accuracy_rows(report)}
        write_report(report, out_dir, extra_markdown=extra_markdown(report), extra_json=accuracy)
        print(f"{done}/{len(shapes)} shapes done; results so far written to {out_dir}", flush=True)

    report = run_by_shape(session, shapes, providers, on_shape=write_partial)
    _REFERENCE.clear()
    accuracy = {"accuracy": accuracy_rows(report)}
    code = finish(report, out_dir, extra_markdown=extra_markdown(report), extra_json=accuracy)
    print()
    print(summary_table(report))
    return code


def run_by_shape(
    session: Any,
    shapes: Sequence[Shape],
    providers: Sequence[str],
    on_shape: Callable[[Report, int], None] | None = None,
) -> Report:
    """The suite run in ``session`` (a :class:`fuselm_bench.runner.Session`) one shape at a time, merged into
    one report; after each shape ``on_shape(report so far, shapes done)`` (the CLI writes the files then: a
    run stopped part-way keeps the shapes it finished). Each skip reason is printed once."""
    seen: set[str] = set()

    def log_once(msg: str) -> None:
        if msg not in seen:
            seen.add(msg)
            print(msg)

    report: Report | None = None
    for i, shape in enumerate(shapes):
        part = session.run(SUITE, [shape], providers, log=log_once)
        if report is None:
            report = part
        else:
            report.shapes = (*report.shapes, *part.shapes)
            report.rows.extend(part.rows)
            report.skipped.update(part.skipped)
        if on_shape is not None:
            on_shape(report, i + 1)
    assert report is not None, "no shapes"
    return report
