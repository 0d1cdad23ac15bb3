"""fuselm.distributed.linear_log_probs: the vocabulary split over W processes vs the whole vocabulary.

Every case runs on W ranks (gloo on CPU at world sizes 2 and 3 with V = 37, so the slices are uneven; one
case with an empty slice; nccl on 2 GPUs when there are 2); random per-token upstream gradients on
log_probs, entropy and lse. The parent checks every output and every gradient (the weight and bias
shards put back together, every rank's input gradient) against PyTorch on the whole vocabulary in the
same dtype and in float64, under the numerics rule (docs/design.md section 5).
"""

from __future__ import annotations

import zlib

import pytest
import torch
from kit.oracles import naive_log_probs, split_sizes
from kit.workers import case_results, nccl_world_sizes, run_workers

import fuselm.distributed
from fuselm.ops._common.testing import assert_numerics

N_SHAPE = (3, 8)
H = 16
V = 37
FLOAT_OUTS = ("log_probs", "entropy", "lse", "log_sum_sq_probs", "mean_logits")
DIFFERENTIABLE = ("log_probs", "entropy", "lse")

# name -> (keyword arguments, how the vocabulary is split; "bias" is a case option)
CASES = {
    "plain": ({"outputs": ("log_probs",)}, "uneven"),
    "every_output_bias": ({"outputs": FLOAT_OUTS, "bias": True}, "uneven"),
    "temperature_softcap_scale": (
        {"outputs": ("log_probs", "entropy"), "temperature": 0.7, "softcap": 3.0, "logit_scale": 1.3},
        "uneven",
    ),
    "memory_min": ({"outputs": ("log_probs", "entropy", "lse"), "memory": "min"}, "uneven"),
    "ignore_index_5": ({"outputs": ("log_probs", "entropy"), "ignore_index": 5}, "uneven"),
    "empty_slice": ({"outputs": FLOAT_OUTS, "bias": True}, "empty"),
    "gathered_sizes": ({"outputs": ("log_probs", "entropy")}, "gathered"),
    "dtensor": ({"outputs": ("log_probs", "entropy", "lse"), "bias": True}, "dtensor"),
}


def case_inputs(name: str, dtype: torch.dtype, device: str) -> dict:
    """Whole-vocabulary inputs of a case and its upstream gradients, the same on every rank."""
    kw, _ = CASES[name]
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    n = N_SHAPE[0] * N_SHAPE[1]
    target = torch.randint(0, V, (n,), generator=g)
    target[torch.randperm(n, generator=g)[: n // 4]] = kw.get("ignore_index", -100)
    x = torch.randn(*N_SHAPE, H, generator=g)
    w = torch.randn(V, H, generator=g) * (2.0 / H**0.5)
    b = torch.randn(V, generator=g) * 0.5 if kw.get("bias") else None
    ups = {k: torch.randn(N_SHAPE, generator=g) for k in DIFFERENTIABLE if k in kw["outputs"]}

    def put(t):
        return t.to(device=device, dtype=dtype) if t is not None else None

    return {"x": put(x), "w": put(w), "b": put(b), "target": target.reshape(N_SHAPE).to(device), "ups": ups}


def _options(kw: dict) -> dict:
    return {k: v for k, v in kw.items() if k not in ("bias", "outputs", "memory")}


def _objective(out, ups):
    return sum((getattr(out, k) * u.to(getattr(out, k))).sum() for k, u in ups.items())


def _distributed_case(name: str, rank: int, world: int, dtype: torch.dtype, device: str) -> dict:
    kw, how = CASES[name]
    inputs = case_inputs(name, dtype, device)
    sizes = split_sizes(world, how, V)
    lo = sum(sizes[:rank])
    sl = slice(lo, lo + sizes[rank])
    x = inputs["x"].detach().clone().requires_grad_()
    w = inputs["w"][sl].detach().clone().requires_grad_()
    b = inputs["b"][sl].detach().clone().requires_grad_() if inputs["b"] is not None else None
    leaves = [x, w] + ([b] if b is not None else [])
    args = {k: v for k, v in kw.items() if k != "bias"}
    if how not in ("gathered", "dtensor"):
        args["vocab_sizes"] = sizes
    w_arg, b_arg = w, b
    if how == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = init_device_mesh(torch.device(device).type, (world,))
        w_arg = DTensor.from_local(w, mesh, [Shard(0)], run_check=False, shape=(V, H), stride=(H, 1))
        if b is not None:
            b_arg = DTensor.from_local(b, mesh, [Shard(0)], run_check=False, shape=(V,), stride=(1,))
    out = fuselm.distributed.linear_log_probs(x, w_arg, inputs["target"], linear_bias=b_arg, **args)
    grads = torch.autograd.grad(_objective(out, inputs["ups"]), leaves)
    return {
        "outs": {k: getattr(out, k).detach().cpu() for k in FLOAT_OUTS if getattr(out, k) is not None},
        "grads": [g.detach().cpu() for g in grads],
    }


def _worker(rank: int, world: int, names: list[str], dtype: torch.dtype, device_kind: str) -> dict:
    device = f"cuda:{rank}" if device_kind == "cuda" else "cpu"
    return {name: _distributed_case(name, rank, world, dtype, device) for name in names}


def whole_vocabulary(name: str, dtype: torch.dtype, compute: torch.dtype):
    """Outputs and gradients of the full-logits formula on the whole vocabulary, computed in `compute`."""
    kw, _ = CASES[name]
    inputs = case_inputs(name, dtype, "cpu")
    leaves = [
        inputs[k].detach().to(compute).requires_grad_() for k in ("x", "w", "b") if inputs[k] is not None
    ]
    b = leaves[2] if len(leaves) == 3 else None
    out = naive_log_probs(leaves[0], leaves[1], inputs["target"], linear_bias=b, **_options(kw))
    grads = torch.autograd.grad(_objective(out, inputs["ups"]), leaves)
    return {k: getattr(out, k).detach() for k in kw["outputs"]}, [g.detach() for g in grads]


def check_case(name: str, per_rank: list[dict], dtype: torch.dtype, world: int) -> None:
    kw, how = CASES[name]
    sizes = split_sizes(world, how, V)
    eager_outs, eager_grads = whole_vocabulary(name, dtype, dtype)
    ref_outs, ref_grads = whole_vocabulary(name, dtype, torch.float64)
    first = per_rank[0]
    assert set(first["outs"]) == set(kw["outputs"])
    for r, res in enumerate(per_rank):
        for k, o in res["outs"].items():
            assert torch.equal(o, first["outs"][k]), f"{name}: rank {r}'s {k} differs from rank 0's"
            assert o.dtype == torch.float32 and o.shape == N_SHAPE
    for k, o in first["outs"].items():
        assert_numerics(f"{name} {k}", o, eager_outs[k], ref_outs[k], dtype)
    for r, res in enumerate(per_rank):  # the whole input gradient on every rank
        assert_numerics(f"{name} input grad (rank {r})", res["grads"][0], eager_grads[0], ref_grads[0], dtype)
    for i, what in enumerate(("weight", "bias")[: len(first["grads"]) - 1], start=1):
        shards = [res["grads"][i] for res in per_rank]
        assert [s.shape[0] for s in shards] == sizes
        assert_numerics(f"{name} {what} grad", torch.cat(shards), eager_grads[i], ref_grads[i], dtype)


def distributed_results(world: int, backend: str, dtype: torch.dtype) -> list[dict]:
    return case_results(_worker, CASES, world, backend, dtype)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("world", [2, 3])
def test_gloo_matches_whole_vocabulary(name, world):
    per_rank = distributed_results(world, "gloo", torch.float32)
    check_case(name, [res[name] for res in per_rank], torch.float32, world)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(
    "world", nccl_world_sizes() or [pytest.param(2, marks=pytest.mark.skip("needs 2 GPUs"))]
)
def test_nccl_matches_whole_vocabulary(name, dtype, world):
    per_rank = distributed_results(world, "nccl", dtype)
    check_case(name, [res[name] for res in per_rank], dtype, world)


def _errors_worker(rank: int, world: int) -> list[tuple[str, str]]:
    x = torch.randn(4, H)
    w = torch.randn(3, H)
    target = torch.tensor([0, 1, 2, -100])
    calls = {
        "is_top1": lambda: fuselm.distributed.linear_log_probs(
            x, w, target, outputs=("log_probs", "is_top1")
        ),
        "unknown output": lambda: fuselm.distributed.linear_log_probs(x, w, target, outputs=("logits",)),
        "bad target": lambda: fuselm.distributed.linear_log_probs(x, w, torch.tensor([0, 1, 3 * world, 0])),
        "target shape": lambda: fuselm.distributed.linear_log_probs(x, w, target[:3]),
        "temperature": lambda: fuselm.distributed.linear_log_probs(x, w, target, temperature=0.0),
    }
    out = []
    for what, call in calls.items():
        try:
            call()
            out.append((what, "no error"))
        except ValueError as e:
            out.append((what, str(e)))
    return out


def test_bad_arguments_raise_errors_that_name_them():
    words = {
        "is_top1": "is_top1",
        "unknown output": "outputs",
        "bad target": "target",
        "target shape": "target",
        "temperature": "temperature",
    }
    for rank_result in run_workers(_errors_worker, 2):
        for what, message in rank_result:
            assert words[what] in message, f"{what}: {message}"
