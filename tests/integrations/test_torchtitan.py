"""fuselm's torchtitan loss (fuselm.integrations.torchtitan): the fused LM head + cross-entropy against
plain PyTorch (always), and against torchtitan's own ChunkedLossWrapper on the same hidden states and head,
in one process and under FSDP2 on 2 processes (gloo; NCCL on 2 GPUs), where torchtitan imports (skipped in
CI, where it is not installed: its dependencies are not in the CI budget)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kit.workers import nccl_world_sizes, run_workers

from fuselm.integrations.torchtitan import fused_head_loss
from fuselm.ops._common.testing import assert_numerics

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


@pytest.mark.parametrize(
    "backend",
    [
        "gloo",
        pytest.param(
            "nccl", marks=pytest.mark.skipif(2 not in nccl_world_sizes(), reason="needs 2 CUDA devices")
        ),
    ],
)
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
