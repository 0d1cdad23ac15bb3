"""Train a Llama-shaped model twice from the same init and batches: Hugging Face eager, then
``fuselm.hf.patch``-ed (fuselm's RMSNorm, RoPE, SwiGLU and the loss from the hidden states, no logits).

Per run: the loss of every step, tokens/s after the warmup, peak CUDA memory, and the activations autograd
saves for backward in the first step (parameters excluded). CUDA: the Llama-3.2-1B shape in bf16 (ids are
still bytes); CPU: a tiny fp32 model with the 256 byte values as vocabulary (fuselm's PyTorch paths).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import platform
import time
import weakref
from dataclasses import dataclass, field
from importlib import metadata, resources, util
from pathlib import Path

import torch

PNG_NAME, JSON_NAME = "fuselm_demo.png", "fuselm_demo.json"
INSTALL_HINT = 'fuselm demo needs transformers: pip install "fuselm[demo]"'


# The Llama shapes (``LlamaConfig`` keyword arguments): Llama-3.2-1B's on CUDA, a tiny one on CPU.
GPU_SIZE = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, vocab_size=128256,
)  # fmt: skip
CPU_SIZE = dict(
    hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, vocab_size=256,
)  # fmt: skip


@dataclass(frozen=True)
class DemoSettings:
    """``steps`` AdamW steps of ``batch`` x ``seq`` bytes; tokens/s after ``warmup``; ``seed``: init, data."""

    device: str
    size: dict  # LlamaConfig keyword arguments: GPU_SIZE, CPU_SIZE
    dtype: torch.dtype
    steps: int
    batch: int
    seq: int
    lr: float
    warmup: int = 2
    seed: int = 0


def default_settings(device: str, *, steps=None, batch=None, seq=None) -> DemoSettings:
    """CUDA: Llama-3.2-1B shape, bf16, 30 steps of 2 x 2048; CPU: the tiny model, fp32, 100 steps of
    4 x 128; ``steps``/``batch``/``seq`` override.

    Example:
        >>> s = default_settings("cpu", steps=5)
        >>> s.steps, s.batch, s.seq, s.size["vocab_size"], s.dtype
        (5, 4, 128, 256, torch.float32)
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    overrides = {k: v for k, v in (("steps", steps), ("batch", batch), ("seq", seq)) if v is not None}
    for name, value in overrides.items():
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if device == "cuda":
        base = DemoSettings("cuda", GPU_SIZE, torch.bfloat16, steps=30, batch=2, seq=2048, lr=3e-4)
    else:
        base = DemoSettings("cpu", CPU_SIZE, torch.float32, steps=100, batch=4, seq=128, lr=1e-3)
    return dataclasses.replace(base, **overrides)


def load_corpus() -> bytes:
    """The text shipped with the package (``fuselm/demo/corpus.txt``), as bytes."""
    return resources.files(__package__).joinpath("corpus.txt").read_bytes()


def sample_batches(data: bytes, *, steps: int, batch: int, seq: int, seed: int) -> list[torch.Tensor]:
    """``steps`` int64 ``[batch, seq]`` batches (token id = byte value), windows at seeded offsets.

    Example:
        >>> b = sample_batches(b"abcdefgh" * 4, steps=2, batch=3, seq=5, seed=0)
        >>> len(b), b[0].shape, b[0].dtype
        (2, torch.Size([3, 5]), torch.int64)
    """
    if len(data) < seq:
        raise ValueError(f"seq must be at most the corpus length ({len(data)} bytes), got {seq}")
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - seq + 1, (steps, batch), generator=gen)
    return [tokens[s[:, None] + torch.arange(seq)] for s in starts]


def build_model(settings: DemoSettings, dtype: torch.dtype | None = None, state=None):
    """The ``LlamaForCausalLM`` of ``settings`` (from code: nothing downloaded; sdpa, no cache), built on
    its device in ``dtype`` (default: the settings') as the default dtype, so the rotary buffers stay fp32
    as with ``from_pretrained``; loaded from ``state`` if given; in training mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **settings.size, max_position_embeddings=max(settings.seq, 2048), rms_norm_eps=1e-5, use_cache=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=True,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype or settings.dtype)
    try:
        with torch.device(settings.device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    if state is not None:
        model.load_state_dict(state)
    return model.train()


def initial_state(settings: DemoSettings) -> dict[str, torch.Tensor]:
    """The weights both runs start from: a model built under ``torch.manual_seed(seed)``, copied to CPU."""
    torch.manual_seed(settings.seed)
    return {k: v.detach().to("cpu", copy=True) for k, v in build_model(settings).state_dict().items()}


class _Box(list):  # [tensor]: what autograd keeps for a saved tensor, it dies with the saved slot
    pass


class SavedTensorMeter(torch.autograd.graph.saved_tensors_hooks):
    """Bytes of the tensors autograd keeps for backward (unique storages, ``exclude``'s not counted) that
    are still saved when :meth:`live_bytes` is called.

    Example:
        >>> w = torch.randn(8, 8, requires_grad=True)
        >>> with SavedTensorMeter(exclude=[w]) as meter:
        ...     y = (torch.randn(4, 8) @ w).sin().sum()
        ...     meter.live_bytes()  # the [4, 8] fp32 inputs of the matmul and of sin
        256
    """

    def __init__(self, exclude=()) -> None:
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._boxes: list[weakref.ref] = []
        super().__init__(self._pack, lambda box: box[0])

    def _pack(self, tensor: torch.Tensor) -> _Box:
        self._boxes.append(weakref.ref(box := _Box([tensor])))
        return box

    def live_bytes(self) -> int:
        gc.collect()
        storages = (box[0].untyped_storage() for ref in self._boxes if (box := ref()) is not None)
        sizes = {s.data_ptr(): s.nbytes() for s in storages if s.data_ptr() not in self._exclude | {0}}
        return sum(sizes.values())

    def __enter__(self) -> SavedTensorMeter:
        super().__enter__()
        return self


@dataclass
class RunResult:
    """One run: per-step losses, tokens/s after warmup, peak CUDA memory, first step's saved activations."""

    name: str
    losses: list[float] = field(default_factory=list)
    tokens_per_s: float | None = None
    peak_bytes: int | None = None
    saved_bytes: int = 0
    seconds: float = 0.0


def train(model, batches: list[torch.Tensor], *, lr: float, name: str, warmup=2, progress=True) -> RunResult:
    """One AdamW step per batch (labels = input_ids); the first forward metered, parameters excluded."""
    from tqdm.auto import tqdm

    params, run = list(model.parameters()), RunResult(name)
    cuda = (device := params[0].device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else lambda: None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    optimizer = torch.optim.AdamW(params, lr=lr, fused=cuda)
    bar = tqdm(batches, desc=name, disable=not progress, unit="step")
    sync()
    start = timed = time.perf_counter()
    for step, ids in enumerate(bar):
        if step == warmup:
            sync()
            timed = time.perf_counter()
        ids = ids.to(device)
        with SavedTensorMeter(exclude=params) if step == 0 else contextlib.nullcontext() as meter:
            loss = model(input_ids=ids, labels=ids).loss
            run.saved_bytes = meter.live_bytes() if meter else run.saved_bytes
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        run.losses.append(loss.item())
        bar.set_postfix(loss=f"{run.losses[-1]:.4f}")
    sync()
    end = time.perf_counter()
    if len(batches) > warmup:
        run.tokens_per_s = (len(batches) - warmup) * batches[0].numel() / (end - timed)
    run.peak_bytes = torch.cuda.max_memory_allocated() if cuda else None
    run.seconds = end - start
    return run


@dataclass
class DemoResult:
    settings: DemoSettings
    hf: RunResult
    fuselm: RunResult
    comparison: dict[str, float]
    meta: dict[str, str]
    paths: dict[str, str] = field(default_factory=dict)


def compare(reference: list[float], other: list[float]) -> dict[str, float]:
    """``max_abs`` and ``max_rel`` step differences of two loss curves, ``curve_rel`` the relative norm.

    Example:
        >>> c = compare([2.0, 1.0], [2.0, 1.001])
        >>> round(c["max_abs"], 6), round(c["max_rel"], 6)
        (0.001, 0.001)
    """
    if len(reference) != len(other) or not reference:
        raise ValueError(f"loss curves must have the same nonzero length, got {len(reference)}, {len(other)}")
    ref = torch.tensor(reference, dtype=torch.float64)
    diff = torch.tensor(other, dtype=torch.float64) - ref
    rel = {"max_rel": (diff.abs() / ref.abs()).max().item(), "curve_rel": (diff.norm() / ref.norm()).item()}
    return {"max_abs": diff.abs().max().item(), **rel}


def run_demo(settings: DemoSettings, out=".", *, progress: bool = True, log=print) -> DemoResult:
    """Both runs; ``fuselm_demo.png`` and ``.json`` written into ``out`` unless None. CPU runs use one
    thread (tiny ops gain nothing from more; on a busy machine, spinning workers make tokens/s noise).

    Example:
        >>> result = run_demo(default_settings("cpu", steps=3), out=None, progress=False, log=lambda *a: None)
        >>> len(result.fuselm.losses), result.comparison["max_rel"] < 1e-4
        (3, True)
        >>> result.fuselm.saved_bytes < result.hf.saved_bytes
        True
    """
    import fuselm.hf

    threads, cuda = torch.get_num_threads(), settings.device == "cuda"
    torch.set_num_threads(threads if cuda else 1)
    meta = {"device": torch.cuda.get_device_name() if cuda else f"CPU ({platform.machine()}, 1 thread)"}
    for n in ("torch", "transformers", "triton"):
        meta[n] = metadata.version(n) if util.find_spec(n) else "not installed"
    log("; ".join(f"{k} {v}" for k, v in meta.items()))
    s, runs = settings, []
    log(f"model: Llama {s.size}, {s.dtype}; {s.steps} steps of {s.batch} x {s.seq} bytes, AdamW lr {s.lr:g}")
    batches = sample_batches(load_corpus(), steps=s.steps, batch=s.batch, seq=s.seq, seed=s.seed)
    try:
        state = initial_state(s)
        for name, patch in (("HF eager", False), ("fuselm", True)):
            model = build_model(s, state=state)
            if fuselm.hf.is_patched(model):
                raise RuntimeError("the HF baseline is already patched: fuselm.hf.unpatch('llama') first")
            try:
                model = fuselm.hf.patch(model) if patch else model
                runs.append(train(model, batches, lr=s.lr, name=name, warmup=s.warmup, progress=progress))
            finally:
                fuselm.hf.unpatch(model)  # also restores HF's rotary function; a no-op on the baseline
                del model
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
    finally:
        torch.set_num_threads(threads)
    result = DemoResult(s, *runs, compare(runs[0].losses, runs[1].losses), meta)
    if out is not None:
        result.paths = write_outputs(result, Path(out), log)
    return result


def format_table(result: DemoResult) -> str:
    """The markdown table of both runs, then the loss agreement."""
    hf, ours, c = result.hf, result.fuselm, result.comparison
    lines = [
        "| run | final loss | max abs loss diff vs HF (rel) | tokens/s | peak memory | saved activations |"
    ]
    lines.append("|---|---|---|---|---|---|")
    diff = f"{c['max_abs']:.2e} ({c['max_rel']:.2e})"
    for label, run, gap in (("HF transformers, eager", hf, "(reference)"), ("fuselm.hf.patch", ours, diff)):
        x = (lambda a, b: f" ({a / b:.2f}x)" if a and b else "") if run is ours else (lambda a, b: "")
        rate = "n/a" if run.tokens_per_s is None else f"{run.tokens_per_s:,.0f}"
        peak = "n/a (CPU)" if run.peak_bytes is None else f"{run.peak_bytes / 2**30:.2f} GiB"
        rate, peak = rate + x(run.tokens_per_s, hf.tokens_per_s), peak + x(run.peak_bytes, hf.peak_bytes)
        saved = f"{run.saved_bytes / 2**20:.1f} MiB{x(run.saved_bytes, hf.saved_bytes)}"
        lines.append(f"| {label} | {run.losses[-1]:.4f} | {gap} | {rate} | {peak} | {saved} |")
    lines += [
        "",
        f"loss agreement: the fuselm loss curve is {c['curve_rel']:.2e} away from the HF curve (relative "
        f"norm over {len(hf.losses)} steps); largest step difference {c['max_abs']:.2e} (relative "
        f"{c['max_rel']:.2e}).",
        "saved activations: tensors autograd keeps for backward during one step, parameters excluded.",
    ]
    if result.settings.device == "cpu":
        lines.append(
            "CPU run: fuselm runs its PyTorch reference paths here; tokens/s are CPU figures and peak "
            "memory needs CUDA. The Triton kernels and the 128256-entry vocabulary run with --device cuda."
        )
    return "\n".join(lines)


def write_outputs(result: DemoResult, out: Path, log=print) -> dict[str, str]:
    """``fuselm_demo.json`` (settings, versions, both runs, comparison) and, with matplotlib, the plot."""
    out.mkdir(parents=True, exist_ok=True)
    record, dtype = dataclasses.asdict(result), str(result.settings.dtype).removeprefix("torch.")
    record["settings"]["dtype"], record["runs"] = dtype, {r: record.pop(r) for r in ("hf", "fuselm")}
    del record["paths"]
    (out / JSON_NAME).write_text(json.dumps(record, indent=2) + "\n")
    paths = {"json": str(out / JSON_NAME)}
    try:
        import matplotlib
    except ImportError:
        log(f'matplotlib is not installed: no {PNG_NAME} (pip install "fuselm[demo]")')
        return paths
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hf, ours, s, c = result.hf, result.fuselm, result.settings, result.comparison
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [2.2, 1]})
    steps = range(1, len(hf.losses) + 1)
    ax.plot(steps, hf.losses, color="tab:gray", linewidth=3.5, alpha=0.6, label="HF transformers, eager")
    ax.plot(steps, ours.losses, color="tab:blue", linewidth=1.4, linestyle="--", label="fuselm.hf.patch")
    ax.set(xlabel="step", ylabel="training loss", title=f"loss (curves differ by {c['curve_rel']:.1e})")
    ax.grid(alpha=0.3)
    ax.legend()
    cuda = hf.peak_bytes is not None
    what, unit = ("peak memory", "GiB") if cuda else ("saved activations", "MiB")
    values = [(r.peak_bytes if cuda else r.saved_bytes) / 2 ** (30 if cuda else 20) for r in (hf, ours)]
    bx.bar_label(bx.bar(["HF eager", "fuselm"], values, color=["tab:gray", "tab:blue"]), fmt=f"%.2f {unit}")
    bx.set(ylabel=f"{what} ({unit})", title=what, ylim=(0, max(values) * 1.18 or 1))
    z = s.size
    title = f"Llama, hidden {z['hidden_size']}, {z['num_hidden_layers']} layers, vocab {z['vocab_size']}; "
    fig.suptitle(title + f"{s.batch} x {s.seq} tokens/step, {dtype}, {result.meta['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / PNG_NAME, dpi=120)
    plt.close(fig)
    return {**paths, "png": str(out / PNG_NAME)}
