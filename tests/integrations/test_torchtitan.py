"""fuselm's torchtitan loss (fuselm.integrations.torchtitan): the fused LM head + cross-entropy against
plain PyTorch (always), and against torchtitan's own ChunkedLossWrapper on the same hidden states and head,
in one process and under FSDP2 on 2 processes (gloo; NCCL on 2 GPUs); then through torchtitan's own trainer
on a tiny Llama over 2 ranks, loss curve against its default loss's. Where torchtitan imports (skipped in
CI, where it is not installed: its dependencies are not in the CI budget)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from kit.workers import backend_params, run_workers

from fuselm.integrations.torchtitan import fused_head_loss
from fuselm.ops._common.testing import ATOL, assert_numerics

B, L, D, V = 2, 8, 16, 37


def _inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, L, D, generator=g, dtype=dtype)
    head = torch.nn.Linear(D, V, bias=False, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, D, generator=g, dtype=dtype) / 4)
    labels = torch.randint(0, V, (B, L), generator=g)
    labels[0, :3] = -100
    return hidden, head, labels


def _grads(loss_fn, hidden, head, labels, tokens):
    h = hidden.detach().clone().requires_grad_()
    head.zero_grad(set_to_none=True)
    loss = loss_fn(h, head, labels, tokens)
    loss.backward()
    return [loss.detach(), h.grad, head.weight.grad]


def _torch_loss(h, head, labels, tokens):
    return F.cross_entropy(head(h).flatten(0, 1), labels.flatten(), reduction="sum") / tokens


def test_fused_head_loss_matches_cross_entropy_on_the_logits():
    tokens = torch.tensor(13.0)
    ours = _grads(fused_head_loss, *_inputs(), tokens)
    eager = _grads(_torch_loss, *_inputs(), tokens)
    ref = _grads(_torch_loss, *_inputs(torch.float64), tokens.double())
    for name, o, e, r in zip(("loss", "d hidden", "d weight"), ours, eager, ref, strict=True):
        assert_numerics(name, o, e, r, torch.float32)


def test_dtensor_hidden_states_are_refused():
    from torch.distributed.tensor import DTensor

    class Fake(DTensor):  # an instance check is all the loss does before refusing
        def __new__(cls):
            return torch.Tensor._make_subclass(cls, torch.zeros(1))

    with pytest.raises(ValueError, match="hidden states"):
        fused_head_loss(Fake(), torch.nn.Linear(1, 2), torch.zeros(1, 1, dtype=torch.long))


def _titan(num_chunks=4):
    loss_module = pytest.importorskip("torchtitan.components.loss", reason="torchtitan is not installed here")
    from fuselm.integrations.torchtitan import FuselmLinearCrossEntropy

    theirs = loss_module.ChunkedLossWrapper.Config(num_chunks=num_chunks).build()
    ours = FuselmLinearCrossEntropy.Config(num_chunks=num_chunks).build()
    return loss_module, theirs, ours


def _step(loss, hidden, head, labels, tokens):
    h = hidden.detach().clone().requires_grad_()
    loss.set_lm_head(head)
    value, metrics = loss(h, labels, tokens)
    value.backward()
    return value.detach(), h.grad


def test_torchtitan_loss_class_matches_its_chunked_wrapper():
    loss_module, theirs, ours = _titan()
    assert isinstance(ours, loss_module.ChunkedLossWrapper)
    tokens = torch.tensor(13.0)
    hidden, head, labels = _inputs()
    got = _step(ours, hidden, head, labels, tokens) + (head.weight.grad.clone(),)
    head.zero_grad(set_to_none=True)
    want = _step(theirs, hidden, head, labels, tokens) + (head.weight.grad.clone(),)
    ref = _grads(_torch_loss, *_inputs(torch.float64), tokens.double())
    for name, o, e, r in zip(("loss", "d hidden", "d weight"), got, want, ref, strict=True):
        assert_numerics(f"{name} vs torchtitan's ChunkedLossWrapper", o, e, r, torch.float32)


def test_torchtitan_loss_takes_what_its_trainer_passes():
    """torchtitan's trainer passes the batch's ``positions`` to the loss (its text dataloader always yields
    them; ignored, as by its CrossEntropyLoss) and its command line gives ``--loss.memory`` as a string."""
    _, _, ours = _titan()
    hidden, head, labels = _inputs()
    ours.set_lm_head(head)
    tokens = torch.tensor(13.0)
    plain = ours(hidden, labels, tokens)[0]
    with_positions = ours(hidden, labels, tokens, positions=torch.arange(L).expand(B, L))[0]
    torch.testing.assert_close(with_positions, plain, rtol=0, atol=0)
    with pytest.raises(ValueError, match="advantages"):
        ours(hidden, labels, tokens, advantages=torch.ones(B, L))
    from fuselm.integrations.torchtitan import FuselmLinearCrossEntropy

    assert FuselmLinearCrossEntropy.Config(memory="1048576").build().memory == 1048576
    assert FuselmLinearCrossEntropy.Config(memory="min").build().memory == "min"
    with pytest.raises(ValueError, match="memory"):
        FuselmLinearCrossEntropy.Config(memory="lots").build()


def _fsdp_worker(rank, world_size, device_type):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _, theirs, ours = _titan()
    mesh = init_device_mesh(device_type, (world_size,))
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    out = {}
    for name, loss in (("theirs", theirs), ("ours", ours)):
        hidden, head, labels = (t.to(device) for t in _inputs(seed=rank))  # each rank its batch
        torch.manual_seed(0)
        head = _inputs()[1].to(device)  # the same head on every rank
        decoder = torch.nn.Linear(D, D, bias=False, device=device)
        with torch.no_grad():
            decoder.weight.copy_(torch.eye(D) + 0.01)
        fully_shard(decoder, mesh=mesh)
        fully_shard(head, mesh=mesh)
        tokens = torch.tensor(26.0, device=device)  # the valid tokens of both ranks' batches together
        loss.set_lm_head(head)
        value, _ = loss(decoder(hidden), labels, tokens)
        value.backward()
        grads = (decoder.weight.grad.full_tensor(), head.weight.grad.full_tensor())
        out[name] = tuple(t.detach().cpu() for t in (value, *grads))
    return out


def _fsdp_reference(world_size=2):
    """Per rank: (loss, the decoder's and the head's gradients averaged over the ranks, as FSDP2's default
    reduce-scatter does), in float64 in one process."""
    decoder = torch.nn.Linear(D, D, bias=False, dtype=torch.float64)
    with torch.no_grad():
        decoder.weight.copy_(torch.eye(D, dtype=torch.float64) + 0.01)
    head = _inputs(torch.float64)[1]
    losses, grads = [], [0, 0]
    for rank in range(world_size):
        hidden, _, labels = _inputs(torch.float64, seed=rank)
        decoder.zero_grad(set_to_none=True)
        head.zero_grad(set_to_none=True)
        loss = _torch_loss(decoder(hidden), head, labels, torch.tensor(26.0, dtype=torch.float64))
        loss.backward()
        losses.append(loss.detach())
        grads = [g + p.grad / world_size for g, p in zip(grads, (decoder.weight, head.weight), strict=True)]
    return [(loss, *grads) for loss in losses]


@pytest.mark.parametrize("backend", backend_params(2))
def test_torchtitan_loss_under_fsdp2_matches_its_chunked_wrapper(backend):
    """Two ranks (gloo on the CPU; NCCL on 2 GPUs, fuselm's kernels on CUDA), the decoder and the head each
    fully_shard-ed: the loss on each rank's batch and the reduced gradients of the decoder and of the head
    keep the numerics rule against float64, with torchtitan's ChunkedLossWrapper (on the same modules) as
    the baseline."""
    _titan()
    device_type = "cuda" if backend == "nccl" else "cpu"
    results = run_workers(_fsdp_worker, 2, backend=backend, args=(device_type,), timeout=240)
    for rank, (out, ref) in enumerate(zip(results, _fsdp_reference(), strict=True)):
        names = ("loss", "d decoder", "d head")
        for name, o, e, r in zip(names, out["ours"], out["theirs"], ref, strict=True):
            assert_numerics(f"rank {rank} {name}", o, e, r, torch.float32)


# --- torchtitan's own trainer: a tiny Llama, its default loss against fuselm's, loss curves equal ---------

STEPS = 5


def _tiny_assets(root):
    """A word-level tokenizer (tokenizer.json + tokenizer_config.json, what torchtitan's HuggingFaceTokenizer
    loads from ``hf_assets_path``) and a JSON-lines text corpus in the layout of its ``c4_test`` dataset
    (a folder that ``datasets.load_dataset(path, split="train")`` reads): the wheel ships neither."""
    import json
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<bos>", "<eos>"] + [f"w{i}" for i in range(200)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer_dir, data_dir = root / "tokenizer", root / "c4_tiny"
    tokenizer_dir.mkdir()
    data_dir.mkdir()
    tokenizer.save(str(tokenizer_dir / "tokenizer.json"))
    (tokenizer_dir / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"})
    )
    rng = random.Random(0)
    with open(data_dir / "train.jsonl", "w") as f:
        for _ in range(64):
            text = " ".join(f"w{rng.randrange(200)}" for _ in range(rng.randrange(20, 80)))
            f.write(json.dumps({"text": text}) + "\n")
    return tokenizer_dir, data_dir


def llama3_tiny():
    """torchtitan's llama3 debug model (dim 256, 6 layers, vocabulary 2048) with its default loss
    (ChunkedLossWrapper over CrossEntropyLoss), as a torchtitan config-registry function
    (``--module <this module> --config llama3_tiny``); paths and steps come from the command line."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.validate import Validator
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    # Its attention is FlexAttention, which has no backward on the CPU (torch), and torchtitan's registry
    # refuses SDPA for language models; torchtitan's own graph_trainer tests swap it in like this.
    for layer in config.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.training.seq_len = 64
    config.training.local_batch_size = 2
    config.training.mixed_precision_param = "float32"  # FSDP2 computes in bf16 by default
    # The default "spmd_types" backend has fully_shard turn SPMD-annotated plain parameters into DTensors,
    # which torch 2.13's FSDP2 refuses ("all parameters must be DTensors on the full SPMD mesh"): DTensors.
    config.parallelism.spmd_backend = "partial_dtensor"
    config.debug.seed = 0  # the same initial weights in both runs
    config.checkpoint = CheckpointManager.Config(enable=False)
    config.validator = Validator.Config(enable=False)
    return config


def llama3_tiny_fuselm():
    """The same with fuselm's loss: what a user's config registry does (``--loss.memory`` on the command
    line sets its memory plan)."""
    from fuselm.integrations.torchtitan import FuselmLinearCrossEntropy

    config = llama3_tiny()
    config.loss = FuselmLinearCrossEntropy.Config()
    return config


def _fit_torchtitan_to(device_type, backend):
    """What torchtitan 0.3.0 needs to run here, each naming what it works around; applied in a fresh
    process before torchtitan's trainer is imported (modules bind its device type at import)."""
    import sys
    import types

    import torch.distributed as dist

    if device_type == "cpu":
        # torchtitan/tools/utils.py get_device_info(): `_get_available_device_type() or "cuda"`, so on a
        # machine without an accelerator the trainer calls torch.cuda.set_device (trainer.py, Trainer
        # __init__) and its memory monitor torch.cuda's statistics (components/metrics.py). The CPU as its
        # device: torch.cpu plus the few calls torch.cpu lacks (no allocator statistics: peaks read -1).
        bound = [
            m for m in ("torchtitan.distributed.utils", "torchtitan.components.metrics") if m in sys.modules
        ]
        if bound:
            raise RuntimeError(f"{bound} imported before the CPU device was set: run in a fresh process")
        import torchtitan.tools.utils as titan_utils

        cpu = types.ModuleType("torchtitan_cpu_device")
        cpu.__dict__.update({k: v for k, v in vars(torch.cpu).items() if not k.startswith("__")})
        cpu.device_count = lambda: 1
        cpu.current_device = lambda: 0  # an index, as torch.distributed.barrier(device_ids=...) wants
        cpu.get_device_name = lambda device=None: "cpu"
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        cpu.get_device_properties = lambda device=None: types.SimpleNamespace(total_memory=total)
        cpu.reset_peak_memory_stats = lambda device=None: None
        cpu.empty_cache = lambda: None
        cpu.memory_stats = lambda device=None: {}
        titan_utils.device_type, titan_utils.device_module = "cpu", cpu
    if backend == "gloo":
        # torchtitan sets FSDP's gradient divide factor to 1 (distributed/fsdp.py, disable_fsdp_gradient_
        # division: it divides by the global token count itself), which FSDP2 reduce-scatters as
        # ReduceOp.PREMUL_SUM(1.0): "Cannot use ReduceOp.PREMUL_SUM with Gloo". The same sum, forced plain.
        import torchtitan.distributed.fsdp as titan_fsdp
        from torch.distributed.fsdp import FSDPModule

        divide_by_one = titan_fsdp.disable_fsdp_gradient_division

        def divide_by_one_with_sum(model):
            divide_by_one(model)
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_force_sum_reduction_for_comms(True)

        titan_fsdp.disable_fsdp_gradient_division = divide_by_one_with_sum
    if not hasattr(dist, "set_timeout"):
        # torchtitan 0.3.0 calls torch.distributed.set_timeout after the first step (distributed/utils.py,
        # set_pg_timeouts), the public name of torch's _set_pg_timeout in releases after 2.13.
        dist.set_timeout = dist.distributed_c10d._set_pg_timeout


def _trainer_worker(rank, world_size, device_type, backend, config_name, cli_args, cache_root):
    """One rank of ``torchtitan.train``'s flow (ConfigManager().parse_args, config.build(), train(),
    close()); returns the per-step loss and gradient norm that the trainer logs, and the peak of
    torch.cuda.max_memory_allocated over the steps (None on the CPU)."""
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["HF_DATASETS_CACHE"] = os.path.join(cache_root, f"rank{rank}")
    _fit_torchtitan_to(device_type, backend)
    from torchtitan.config import ConfigManager

    config = ConfigManager().parse_args(["--module", __name__, "--config", config_name, *cli_args])
    trainer = config.build()
    cuda = device_type == "cuda"
    curve = {"loss": [], "grad_norm": [], "peak_bytes": None}
    log = trainer.metrics_processor.log

    def logged(step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs):
        curve["loss"].append(global_avg_loss)
        curve["grad_norm"].append(grad_norm)
        if cuda:  # read before the log, which resets the peak statistics at every step
            curve["peak_bytes"] = max(curve["peak_bytes"] or 0, torch.cuda.max_memory_allocated())
        return log(step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs)

    trainer.metrics_processor.log = logged
    try:
        trainer.train()
    finally:
        trainer.close()
    return curve


@pytest.mark.parametrize("backend", backend_params(2))
def test_torchtitan_trainer_loss_curve_with_fuselm_equals_its_default(
    backend, tmp_path, monkeypatch, record_property
):
    """torchtitan's own trainer (Trainer.Config from a config-registry function, parsed by its
    ConfigManager as ``torchtitan.train`` does, FSDP2 over 2 ranks, its dataloader and tokenizer, AdamW,
    warmup, gradient clipping) trains a tiny Llama for STEPS steps twice: with its default loss and with
    ``loss=FuselmLinearCrossEntropy.Config()``. The per-step loss and gradient norm it logs must agree.

    The numerics rule needs a float64 reference, and torchtitan's trainer has no float64 run
    (training.dtype is bfloat16 or float32, TORCH_DTYPE_MAP in torchtitan/config/__init__.py has no
    float64, and its cross-entropy casts the logits to float32), so the two fp32 curves are compared
    directly, to ATOL[float32] = 1e-5 relative per step. At step 1 (same weights, same batch) the losses
    differ only by fp32 rounding: each token's logits (a sum over D = 256) and its log-sum-exp over the
    V = 2048 classes are summed in another order (fuselm's blocks against torch's reductions); such a sum
    of n terms is off by at most about log2(n) * 2^-24 ~ 7e-7 of itself, so the mean loss (~8) by about
    1e-7 relative, the gradients likewise. Later steps carry these gradients through AdamW, which moves an
    element whose gradient is rounding noise by up to the learning rate, but such elements barely change
    the loss. 1e-5 is about ten times what rounding explains (seen: at most 2e-7, 1 to 2 ulp), and a 1%
    error (a wrong normalization, a lost token, a wrong head gradient through FSDP) is a thousand times it.

    On the CPU, what torchtitan 0.3.0 lacks is worked around in _fit_torchtitan_to (its CUDA fallback
    device, gloo's missing PREMUL_SUM) and the attention is SDPA (FlexAttention has no CPU backward);
    fuselm runs its PyTorch reference there, its Triton kernels on 2 GPUs (NCCL). Peak memory per rank
    (torch.cuda.max_memory_allocated; none on the CPU) is printed (-s) and recorded as a property."""
    try:
        import torchtitan.trainer  # noqa: F401
    except ImportError as e:  # torchtitan itself, or one of its dependencies (torchdata, tensorboard, ...)
        pytest.skip(f"torchtitan's trainer does not import here: {e}")
    tokenizer_dir, data_dir = _tiny_assets(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    device_type = "cuda" if backend == "nccl" else "cpu"
    runs = {}
    for name in ("llama3_tiny", "llama3_tiny_fuselm"):
        cli = [
            "--hf_assets_path", str(tokenizer_dir),
            "--dataloader.dataset_path", str(data_dir),
            "--dump_folder", str(tmp_path / name),
            "--training.steps", str(STEPS),
        ]  # fmt: skip
        args = (device_type, backend, name, cli, str(tmp_path / "hf_cache"))
        runs[name] = run_workers(_trainer_worker, 2, backend=backend, args=args, timeout=240)
    theirs, ours = runs["llama3_tiny"], runs["llama3_tiny_fuselm"]
    for rank in (0, 1):
        print(f"\nrank {rank}: step, loss torchtitan / fuselm, grad norm torchtitan / fuselm")
        for step in range(STEPS):
            t, o = theirs[rank], ours[rank]
            print(f"  {step + 1}  {t['loss'][step]:.7f} / {o['loss'][step]:.7f}  ", end="")
            print(f"{t['grad_norm'][step]:.7f} / {o['grad_norm'][step]:.7f}")
        peaks = {k: runs[k][rank]["peak_bytes"] for k in runs}
        shown = (
            "none on the CPU"
            if device_type == "cpu"
            else {k: f"{v / 2**20:.1f} MiB" for k, v in peaks.items()}
        )
        print(f"  peak memory (torch.cuda.max_memory_allocated): {shown}")
        record_property(f"rank{rank}_peak_bytes", peaks)
    for rank, (t, o) in enumerate(zip(theirs, ours, strict=True)):
        for key in ("loss", "grad_norm"):
            assert len(o[key]) == len(t[key]) == STEPS, (key, o[key], t[key])
            for step, (a, b) in enumerate(zip(o[key], t[key], strict=True)):
                assert abs(a - b) <= ATOL[torch.float32] * abs(b), (
                    f"rank {rank} step {step + 1} {key}: fuselm {a!r} vs torchtitan {b!r}"
                )
