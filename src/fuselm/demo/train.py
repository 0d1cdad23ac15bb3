"""Train a Llama-shaped model twice from the same init: Hugging Face eager, then patched with fuselm.

The job of ``fuselm demo``. Both runs see the same initial weights (one ``state_dict``, built once under
``torch.manual_seed``) and the same batches in the same order (windows of the shipped corpus, tokenized
as bytes, sampled with a seeded generator), with the same optimizer. What differs is only
``fuselm.hf.patch(model)``: RMSNorm, RoPE and the SwiGLU MLP run fuselm's ops, and the loss comes from
the hidden states through the fused linear cross-entropy (no ``[B, T, V]`` logits).

Per run it records the loss of every step, tokens/s (after ``warmup`` steps), the peak allocated CUDA
memory, and on every device the bytes of the activations autograd keeps for backward (measured with
``torch.autograd.graph.saved_tensors_hooks`` during the first step, parameters excluded).

Sizes: on CUDA the shape of Llama-3.2-1B (vocabulary 128256, bf16; the ids are still bytes, the large
vocabulary is what makes the loss layer matter); on CPU a tiny model in fp32 with a 256-entry vocabulary
that trains in seconds, where fuselm dispatches to its PyTorch reference paths.
"""

from __future__ import annotations

import dataclasses
import json
import platform
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

from . import training
from .training import SavedTensorMeter as SavedTensorMeter  # the demo's meter, named here too
from .training import free_memory

CORPUS = "corpus.txt"
PNG_NAME = "fuselm_demo.png"
JSON_NAME = "fuselm_demo.json"
INSTALL_HINT = 'fuselm demo needs transformers: pip install "fuselm[demo]"'


@dataclass(frozen=True)
class ModelSize:
    """The shape of the Llama model the demo trains (``LlamaConfig`` fields)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True


# Llama-3.2-1B (its rope scaling aside: the demo's sequences are short).
GPU_SIZE = ModelSize(
    hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, head_dim=64, vocab=128256
)
# Tiny, for a CPU: both runs in seconds. The vocabulary is just the 256 byte values.
CPU_SIZE = ModelSize(hidden=128, intermediate=384, layers=2, heads=4, kv_heads=2, head_dim=32, vocab=256)


@dataclass(frozen=True)
class DemoSettings:
    """Everything that defines a demo run. :func:`default_settings` gives the per-device defaults.

    Attributes:
        device: ``"cuda"`` or ``"cpu"``.
        size: the model shape.
        dtype: of the weights (and the optimizer state): bf16 on CUDA, fp32 on CPU.
        steps: optimizer steps per run.
        batch, seq: ``B`` sequences of ``T`` byte tokens per step.
        lr: AdamW learning rate (constant).
        warmup: the first steps left out of tokens/s (kernel compilation, allocator warm-up).
        seed: of the initial weights and of the batch sampling.
        attn_implementation: the Hugging Face attention of both runs.
        threads: ``torch.set_num_threads`` during the runs (restored after), None to leave it. CPU: 1, as
            the tiny model's ops are too small to gain from more, and on a busy machine more threads
            make them many times slower (spinning OpenMP workers), which would make tokens/s noise.
    """

    device: str
    size: ModelSize
    dtype: torch.dtype
    steps: int
    batch: int
    seq: int
    lr: float
    warmup: int = 2
    seed: int = 0
    attn_implementation: str = "sdpa"
    threads: int | None = None


def default_settings(
    device: str, *, steps: int | None = None, batch: int | None = None, seq: int | None = None
) -> DemoSettings:
    """The demo's defaults for ``device`` (``"cuda"``: Llama-3.2-1B shape, bf16, 2 x 2048, 30 steps;
    ``"cpu"``: the tiny model, fp32, 4 x 128, 100 steps, one thread), with ``steps``/``batch``/``seq``
    overridden when given.

    Example:
        >>> s = default_settings("cpu", steps=5)
        >>> s.steps, s.batch, s.seq, s.size.vocab, s.dtype
        (5, 4, 128, 256, torch.float32)
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    for name, value in (("steps", steps), ("batch", batch), ("seq", seq)):
        if value is not None and (not isinstance(value, int) or value <= 0):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if device == "cuda":
        base = DemoSettings("cuda", GPU_SIZE, torch.bfloat16, steps=30, batch=2, seq=2048, lr=3e-4)
    else:
        base = DemoSettings("cpu", CPU_SIZE, torch.float32, steps=100, batch=4, seq=128, lr=1e-3, threads=1)
    overrides = {k: v for k, v in (("steps", steps), ("batch", batch), ("seq", seq)) if v is not None}
    return dataclasses.replace(base, **overrides)


# ---- data ----


def load_corpus() -> bytes:
    """The text shipped with the package (``fuselm/demo/corpus.txt``), as bytes.

    Example:
        >>> len(load_corpus()) > 10_000
        True
    """
    return resources.files(__package__).joinpath(CORPUS).read_bytes()


def sample_batches(data: bytes, *, steps: int, batch: int, seq: int, seed: int) -> list[torch.Tensor]:
    """``steps`` batches of token ids ``[batch, seq]`` (int64, token id = byte value): windows of ``data``
    at offsets drawn by a ``torch.Generator`` seeded with ``seed`` (the same list for the same arguments).

    Example:
        >>> b = sample_batches(b"abcdefgh" * 4, steps=2, batch=3, seq=5, seed=0)
        >>> len(b), b[0].shape, b[0].dtype
        (2, torch.Size([3, 5]), torch.int64)
    """
    if len(data) < seq:
        raise ValueError(f"seq must be at most the corpus length ({len(data)} bytes), got {seq}")
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)  # [n]
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - seq + 1, (steps, batch), generator=gen)  # [steps, B]
    window = torch.arange(seq)
    return [tokens[s[:, None] + window] for s in starts]


# ---- model ----


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    return transformers


def llama_config(settings: DemoSettings):
    """The ``transformers.LlamaConfig`` of ``settings`` (built from code, nothing downloaded)."""
    _transformers()
    s = settings.size
    model = {
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "vocab_size": s.vocab,
        "max_position_embeddings": max(settings.seq, 2048),
        "rope_theta": s.rope_theta,
        "rope_scaling": {"rope_type": "default"},
        "rms_norm_eps": s.rms_norm_eps,
        "tie_word_embeddings": s.tie_word_embeddings,
    }
    return training.llama_config(model, settings.attn_implementation)


def build_model(config, device: str, dtype: torch.dtype, state: dict[str, torch.Tensor] | None = None):
    """A ``LlamaForCausalLM`` of ``config`` on ``device`` in ``dtype``, loaded from ``state`` if given
    (:func:`fuselm.demo.training.build_llama`)."""
    _transformers()
    return training.build_llama(config, device, dtype, state)


def initial_state(settings: DemoSettings, config=None) -> dict[str, torch.Tensor]:
    """The initial weights both runs start from: a model built under ``torch.manual_seed(settings.seed)``,
    its ``state_dict`` copied to the CPU (so it takes no device memory during the runs)."""
    config = config if config is not None else llama_config(settings)
    torch.manual_seed(settings.seed)
    model = build_model(config, settings.device, settings.dtype)
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    del model
    free_memory(torch.device(settings.device))
    return state


# ---- measurement ----


@dataclass
class RunResult:
    """What one training run measured.

    Attributes:
        name: the row label.
        losses: the loss of every step (float).
        tokens_per_s: tokens of the steps after the warmup divided by their wall time (None if there are
            no such steps).
        peak_bytes: ``torch.cuda.max_memory_allocated()`` over the run (weights, gradients, AdamW state,
            activations); None on CPU.
        saved_bytes: activations saved for backward during the first step (parameters excluded).
        seconds: wall time of the whole run.
    """

    name: str
    losses: list[float] = field(default_factory=list)
    tokens_per_s: float | None = None
    peak_bytes: int | None = None
    saved_bytes: int = 0
    seconds: float = 0.0


def train(
    model,
    batches: list[torch.Tensor],
    *,
    lr: float,
    name: str,
    warmup: int = 2,
    progress: bool = True,
) -> RunResult:
    """Train ``model`` on ``batches`` (labels = input_ids; Hugging Face shifts them) with AdamW at a fixed
    ``lr``, one optimizer step per batch; returns the per-step losses and the measurements.

    The loop is :func:`fuselm.demo.training.train`: the first step runs inside a :class:`SavedTensorMeter`
    (the saved-activation figure); tokens/s counts the steps after ``warmup``; each step's loss is read as
    it ends (the progress bar shows it). On CUDA the peak memory statistics are reset at the start.

    Shapes: every batch is ``[B, T]`` int64 token ids below the model's vocabulary size.

    Example:
        >>> import torch
        >>> from fuselm.demo.train import build_model, default_settings, llama_config, load_corpus
        >>> from fuselm.demo.train import sample_batches, train
        >>> s = default_settings("cpu", steps=3, batch=1, seq=16)
        >>> batches = sample_batches(load_corpus(), steps=3, batch=1, seq=16, seed=0)
        >>> model = build_model(llama_config(s), "cpu", torch.float32)
        >>> run = train(model, batches, lr=1e-3, name="HF", warmup=1, progress=False)
        >>> len(run.losses), run.saved_bytes > 0, run.tokens_per_s > 0, run.peak_bytes
        (3, True, True, None)
    """
    from tqdm.auto import tqdm

    params = list(model.parameters())
    device = params[0].device
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    bar = tqdm(total=len(batches), desc=name, disable=not progress, leave=True, unit="step")

    def show_loss(step: int, loss: torch.Tensor) -> None:
        bar.set_postfix(loss=f"{loss.item():.4f}")  # syncs: the step is done
        bar.update()

    run = training.train(
        training.causal_lm_loss(model),
        params,
        batches,
        lr=lr,
        fused_adamw=cuda,
        warmup=warmup,
        measure_saved=True,
        on_step=show_loss,
    )
    bar.close()
    return RunResult(
        name=name,
        losses=run.logged,
        tokens_per_s=run.tokens_per_s(batches[0].numel()),
        peak_bytes=torch.cuda.max_memory_allocated(device) if cuda else None,
        saved_bytes=run.saved_bytes or 0,
        seconds=run.seconds,
    )


# ---- the demo ----


@dataclass
class DemoResult:
    """Both runs and their comparison (see :func:`compare`)."""

    settings: DemoSettings
    hf: RunResult
    fuselm: RunResult
    comparison: dict[str, float]
    meta: dict[str, str]
    paths: dict[str, str] = field(default_factory=dict)


def compare(reference: list[float], other: list[float]) -> dict[str, float]:
    """How far the ``other`` loss curve is from ``reference``: ``max_abs`` (max over steps of
    ``|other - reference|``), ``max_rel`` (of that divided by ``|reference|``) and ``curve_rel``
    (``||other - reference|| / ||reference||`` over all steps, the measure of the numerics rule).

    Example:
        >>> c = compare([2.0, 1.0], [2.0, 1.001])
        >>> round(c["max_abs"], 6), round(c["max_rel"], 6)
        (0.001, 0.001)
    """
    if len(reference) != len(other) or not reference:
        raise ValueError(
            f"loss curves must have the same nonzero length, got {len(reference)} and {len(other)}"
        )
    ref = torch.tensor(reference, dtype=torch.float64)
    oth = torch.tensor(other, dtype=torch.float64)
    diff = (oth - ref).abs()
    return {
        "max_abs": diff.max().item(),
        "max_rel": (diff / ref.abs()).max().item(),
        "curve_rel": (torch.linalg.vector_norm(oth - ref) / torch.linalg.vector_norm(ref)).item(),
    }


def _meta(settings: DemoSettings) -> dict[str, str]:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    transformers = _transformers()
    if settings.device == "cuda":
        device_name = torch.cuda.get_device_name()
    else:
        threads = torch.get_num_threads()
        device_name = f"CPU ({platform.machine()}, {threads} thread{'s' if threads > 1 else ''})"
    return {
        "device": device_name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "triton": triton_version,
    }


def run_demo(
    settings: DemoSettings, out: str | Path | None = ".", *, progress: bool = True, log=print
) -> DemoResult:
    """Train the model of ``settings`` twice from the same init (Hugging Face eager, then
    ``fuselm.hf.patch``-ed) and, when ``out`` is not None, write ``fuselm_demo.png`` and
    ``fuselm_demo.json`` there.

    Args:
        settings: sizes, steps and device (:func:`default_settings`).
        out: output folder (created if missing), or None to write nothing.
        progress: show a tqdm bar per run.
        log: where the status lines go (``print``; a no-op to silence them).

    Returns:
        a :class:`DemoResult`; ``result.paths`` holds the files written.

    Raises:
        ImportError: transformers is missing (``pip install "fuselm[demo]"``).
        RuntimeError: the baseline model is already patched (``fuselm.hf.patch("llama")`` in force).

    Example:
        >>> from fuselm.demo import default_settings, run_demo
        >>> result = run_demo(default_settings("cpu", steps=3), out=None, progress=False,
        ...                   log=lambda *a: None)
        >>> len(result.hf.losses), len(result.fuselm.losses), result.comparison["max_rel"] < 1e-4
        (3, 3, True)
        >>> result.fuselm.saved_bytes < result.hf.saved_bytes
        True
    """
    _transformers()
    previous_threads = torch.get_num_threads()
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    try:
        result = _run_both(settings, progress=progress, log=log)
    finally:
        torch.set_num_threads(previous_threads)
    if out is not None:
        result.paths = write_outputs(result, out, log=log)
    return result


def _run_both(settings: DemoSettings, *, progress: bool, log) -> DemoResult:
    import fuselm.hf

    config = llama_config(settings)
    meta = _meta(settings)
    s = settings.size
    log(
        f"device: {meta['device']}; torch {meta['torch']}, transformers {meta['transformers']}, "
        f"triton {meta['triton']}"
    )
    log(
        f"model: Llama, hidden {s.hidden}, intermediate {s.intermediate}, {s.layers} layers, "
        f"{s.heads}/{s.kv_heads} heads, vocab {s.vocab}, {str(settings.dtype).removeprefix('torch.')}; "
        f"{settings.steps} steps of {settings.batch} x {settings.seq} byte tokens, AdamW lr {settings.lr:g}"
    )
    corpus = load_corpus()
    batches = sample_batches(
        corpus, steps=settings.steps, batch=settings.batch, seq=settings.seq, seed=settings.seed
    )
    state = initial_state(settings, config)

    model = build_model(config, settings.device, settings.dtype, state)
    if fuselm.hf.is_patched(model):
        raise RuntimeError(
            "the Hugging Face baseline is already patched (fuselm.hf.patch('llama') is in force in this "
            "process); fuselm.hf.unpatch('llama') before running the demo"
        )
    hf = train(model, batches, lr=settings.lr, name="HF eager", warmup=settings.warmup, progress=progress)
    del model
    free_memory(torch.device(settings.device))

    model = fuselm.hf.patch(build_model(config, settings.device, settings.dtype, state))
    try:
        ours = train(model, batches, lr=settings.lr, name="fuselm", warmup=settings.warmup, progress=progress)
    finally:
        fuselm.hf.unpatch(model)
        del model
        free_memory(torch.device(settings.device))

    return DemoResult(settings, hf, ours, compare(hf.losses, ours.losses), meta)


# ---- report ----


def _gib(n: int | None) -> str:
    return "n/a (CPU)" if n is None else f"{n / 2**30:.2f} GiB"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _rate(x: float | None) -> str:
    return "n/a" if x is None else f"{x:,.0f}"


def format_table(result: DemoResult) -> str:
    """The markdown table of both runs and the line on loss agreement.

    Example:
        >>> print(format_table(result))                                              # doctest: +SKIP
        | run | final loss | max abs loss diff vs HF (rel) | tokens/s | peak memory | saved activations |
        ...
    """
    hf, ours, c = result.hf, result.fuselm, result.comparison
    saved_ratio = f" ({ours.saved_bytes / hf.saved_bytes:.2f}x)" if hf.saved_bytes else ""
    peak_ratio = f" ({ours.peak_bytes / hf.peak_bytes:.2f}x)" if hf.peak_bytes and ours.peak_bytes else ""
    speed = f" ({ours.tokens_per_s / hf.tokens_per_s:.2f}x)" if hf.tokens_per_s and ours.tokens_per_s else ""
    rows = [
        "| run | final loss | max abs loss diff vs HF (rel) | tokens/s | peak memory | saved activations |",
        "|---|---|---|---|---|---|",
        f"| HF transformers, eager | {hf.losses[-1]:.4f} | (reference) | {_rate(hf.tokens_per_s)} | "
        f"{_gib(hf.peak_bytes)} | {_mib(hf.saved_bytes)} |",
        f"| fuselm.hf.patch | {ours.losses[-1]:.4f} | {c['max_abs']:.2e} ({c['max_rel']:.2e}) | "
        f"{_rate(ours.tokens_per_s)}{speed} | {_gib(ours.peak_bytes)}{peak_ratio} | "
        f"{_mib(ours.saved_bytes)}{saved_ratio} |",
    ]
    n = len(hf.losses)
    lines = [
        "\n".join(rows),
        "",
        f"loss agreement: the fuselm loss curve is {c['curve_rel']:.2e} away from the HF curve "
        f"(relative norm over {n} steps); largest step difference {c['max_abs']:.2e} "
        f"(relative {c['max_rel']:.2e}).",
        "saved activations: tensors autograd keeps for backward during one step, parameters excluded.",
    ]
    if result.settings.device == "cpu":
        lines.append(
            "CPU run: fuselm runs its PyTorch reference paths here; tokens/s are CPU figures and peak "
            "memory needs CUDA. The Triton kernels and the 128256-entry vocabulary run with --device cuda."
        )
    return "\n".join(lines)


def to_json(result: DemoResult) -> dict:
    """The numbers of ``result`` as a JSON-serializable dict."""
    settings = dataclasses.asdict(result.settings)
    settings["dtype"] = str(result.settings.dtype).removeprefix("torch.")
    return {
        "settings": settings,
        "meta": result.meta,
        "runs": {"hf": dataclasses.asdict(result.hf), "fuselm": dataclasses.asdict(result.fuselm)},
        "comparison": result.comparison,
    }


def write_outputs(result: DemoResult, out: str | Path, *, log=print) -> dict[str, str]:
    """Write ``fuselm_demo.json`` and (with matplotlib) ``fuselm_demo.png`` into ``out``; returns the
    paths written by kind (``"json"``, ``"png"``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    json_path = out / JSON_NAME
    json_path.write_text(json.dumps(to_json(result), indent=2) + "\n")
    paths["json"] = str(json_path)
    try:
        import matplotlib
    except ImportError:
        log(f'matplotlib is not installed: no {PNG_NAME} (pip install "fuselm[demo]")')
        return paths
    matplotlib.use("Agg")
    png_path = out / PNG_NAME
    plot(result, png_path)
    paths["png"] = str(png_path)
    return paths


def plot(result: DemoResult, path: str | Path) -> None:
    """Loss curves of both runs on one axis, and bars of peak memory (CUDA) or saved activations (CPU)."""
    import matplotlib.pyplot as plt

    hf, ours = result.hf, result.fuselm
    fig, (ax_loss, ax_mem) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [2.2, 1]})
    steps = range(1, len(hf.losses) + 1)
    ax_loss.plot(steps, hf.losses, color="tab:gray", linewidth=3.5, alpha=0.6, label="HF transformers, eager")
    ax_loss.plot(steps, ours.losses, color="tab:blue", linewidth=1.4, linestyle="--", label="fuselm.hf.patch")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss")
    c = result.comparison
    ax_loss.set_title(f"loss (curves differ by {c['curve_rel']:.1e}, relative)")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()

    if hf.peak_bytes is not None and ours.peak_bytes is not None:
        values, unit, what = [hf.peak_bytes / 2**30, ours.peak_bytes / 2**30], "GiB", "peak memory"
    else:
        values, unit, what = [hf.saved_bytes / 2**20, ours.saved_bytes / 2**20], "MiB", "saved activations"
    bars = ax_mem.bar(["HF eager", "fuselm"], values, color=["tab:gray", "tab:blue"])
    ax_mem.bar_label(bars, labels=[f"{v:.2f} {unit}" if unit == "GiB" else f"{v:.1f} {unit}" for v in values])
    ax_mem.set_ylabel(f"{what} ({unit})")
    ax_mem.set_title(what)
    ax_mem.set_ylim(0, max(values) * 1.18 if max(values) > 0 else 1)
    s = result.settings
    fig.suptitle(
        f"Llama, hidden {s.size.hidden}, {s.size.layers} layers, vocab {s.size.vocab}; "
        f"{s.batch} x {s.seq} tokens/step, {str(s.dtype).removeprefix('torch.')}, {result.meta['device']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
