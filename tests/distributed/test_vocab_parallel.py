"""fuselm.distributed: the vocabulary split over W processes vs the single-process losses.

Every case runs on W ranks (gloo on CPU, world sizes 2 and 3, vocabulary not divisible by either; nccl
on 2 GPUs when there are 2), each rank on its slice of the classes; the parent checks the loss and every
gradient (the shards put back together, and the input gradient of every rank) against eager PyTorch on
the whole vocabulary and the float64 reference, under the numerics rule (docs/design.md section 5).
One spawn per world size runs every case (workers are slow to start).
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F
from kit.oracles import eager_cross_entropy, reference64, split_sizes
from kit.workers import case_results, nccl_world_sizes, run_workers

import fuselm.distributed
from fuselm.ops._common.testing import assert_numerics

N_SHAPE = (3, 8)  # tokens: [B, T]
H = 16
V = 37  # prime: uneven slices for world sizes 2 and 3
SCALAR_GRAD = 0.75  # upstream gradient of a scalar loss (exercises the rescaling of the in-forward gradient)

# name -> (op, keyword arguments, how the vocabulary is split, what the case exercises)
CASES = {
    "ce_mean": ("ce", {}, "uneven"),
    "ce_sum": ("ce", {"reduction": "sum"}, "uneven"),
    "ce_none": ("ce", {"reduction": "none"}, "uneven"),
    "ce_weight_smoothing": ("ce", {"weight": True, "label_smoothing": 0.1}, "uneven"),
    "ce_smoothing_zloss_softcap_lse": (
        "ce",
        {"label_smoothing": 0.2, "z_loss": 1e-2, "softcap": 3.0, "return_lse": True, "reduction": "none"},
        "uneven",
    ),
    "ce_weight_zloss_sum": ("ce", {"weight": True, "z_loss": 1e-2, "reduction": "sum"}, "uneven"),
    "ce_inplace_backward": ("ce", {"inplace_backward": True, "label_smoothing": 0.1}, "uneven"),
    "ce_ignore_index_5": ("ce", {"ignore_index": 5}, "uneven"),
    "ce_empty_slice": ("ce", {"label_smoothing": 0.1}, "empty"),
    "ce_gathered_sizes": ("ce", {}, "gathered"),
    "ce_bad_target": ("ce", {"reduction": "none", "bad_target": True}, "uneven"),
    "ce_dtensor": ("ce", {"label_smoothing": 0.1}, "dtensor"),
    "lce_mean_bias": ("lce", {"bias": True}, "uneven"),
    "lce_sum": ("lce", {"reduction": "sum"}, "uneven"),
    "lce_none_lse": ("lce", {"reduction": "none", "return_lse": True, "bias": True}, "uneven"),
    "lce_all_options": (
        "lce",
        {"weight": True, "label_smoothing": 0.1, "z_loss": 1e-2, "softcap": 3.0, "bias": True},
        "uneven",
    ),
    "lce_chunks": ("lce", {"memory": 1, "label_smoothing": 0.1}, "uneven"),  # 16-row chunks: 2 of them
    "lce_memory_min": ("lce", {"memory": "min"}, "uneven"),
    "lce_empty_slice": ("lce", {"bias": True}, "empty"),
    "lce_gathered_sizes": ("lce", {}, "gathered"),
    "lce_dtensor": ("lce", {"bias": True}, "dtensor"),
    "ce_token_weights_zloss": ("ce", {"token_weights": True, "z_loss": 1e-2}, "uneven"),
    "lce_token_weights_none": ("lce", {"token_weights": True, "reduction": "none", "bias": True}, "uneven"),
}
OPTION_KEYS = ("bias", "bad_target", "token_weights")  # case options that are not function arguments


def case_inputs(name: str, dtype: torch.dtype, device: str):
    """Whole-vocabulary inputs of a case, the same on every rank (seeded by the case name)."""
    op, kw, _ = CASES[name]
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    n = N_SHAPE[0] * N_SHAPE[1]
    target = torch.randint(0, V, (n,), generator=g)
    target[torch.randperm(n, generator=g)[: n // 4]] = kw.get("ignore_index", -100)
    if kw.get("bad_target"):
        target[1] = V + 3
    out = {"target": target.reshape(N_SHAPE).to(device)}
    if op == "ce":
        out["logits"] = (2 * torch.randn(n, V, generator=g)).reshape(*N_SHAPE, V)
    else:
        out["x"] = torch.randn(*N_SHAPE, H, generator=g)
        out["w"] = torch.randn(V, H, generator=g) * (2.0 / H**0.5)
        out["b"] = torch.randn(V, generator=g) * 0.5 if kw.get("bias") else None
    out["class_weight"] = torch.rand(V, generator=g) + 0.5 if kw.get("weight") else None
    n_out = 2 if kw.get("return_lse") else 1
    shape = N_SHAPE if kw.get("reduction") == "none" else ()
    ups = [torch.randn(shape, generator=g) if shape else torch.tensor(SCALAR_GRAD) for _ in range(n_out)]
    if n_out == 2:
        ups[1] = torch.randn(N_SHAPE, generator=g)
    out["upstream"] = ups
    for k in ("logits", "x", "w", "b", "class_weight"):
        if out.get(k) is not None:
            out[k] = out[k].to(device=device, dtype=dtype)
    out["upstream"] = [u.to(dtype).to(device) for u in ups]
    out["token_weights"] = (
        (torch.rand(N_SHAPE, generator=g) * 2).to(device) if kw.get("token_weights") else None
    )
    return out


def function_kwargs(kw: dict, inputs: dict) -> dict:
    args = {k: v for k, v in kw.items() if k not in OPTION_KEYS and k != "weight"}
    args["weight"] = inputs["class_weight"]
    if kw.get("token_weights"):
        args["token_weights"] = inputs["token_weights"]
    return args


def _outputs_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _distributed_case(name: str, rank: int, world: int, dtype: torch.dtype, device: str) -> dict:
    op, kw, how = CASES[name]
    inputs = case_inputs(name, dtype, device)
    sizes = split_sizes(world, how, V)
    lo = sum(sizes[:rank])
    sl = slice(lo, lo + sizes[rank])
    args = function_kwargs(kw, inputs)
    if how != "gathered" and how != "dtensor":
        args["vocab_sizes"] = sizes
    if op == "ce":
        logits = inputs["logits"][..., sl].detach().clone().requires_grad_()
        leaves = [logits]
        arg = logits
        if how == "dtensor":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import DTensor, Shard

            mesh = init_device_mesh(torch.device(device).type, (world,))
            shape, stride = (*N_SHAPE, V), (N_SHAPE[1] * V, V, 1)
            arg = DTensor.from_local(logits, mesh, [Shard(2)], run_check=False, shape=shape, stride=stride)
        outs = fuselm.distributed.cross_entropy(arg, inputs["target"], **args)
    else:
        x = inputs["x"].detach().clone().requires_grad_()
        w = inputs["w"][sl].detach().clone().requires_grad_()
        b = inputs["b"][sl].detach().clone().requires_grad_() if inputs["b"] is not None else None
        leaves = [x, w] + ([b] if b is not None else [])
        w_arg, b_arg = w, b
        if how == "dtensor":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import DTensor, Shard

            mesh = init_device_mesh(torch.device(device).type, (world,))
            w_arg = DTensor.from_local(w, mesh, [Shard(0)], run_check=False, shape=(V, H), stride=(H, 1))
            if b is not None:
                b_arg = DTensor.from_local(b, mesh, [Shard(0)], run_check=False, shape=(V,), stride=(1,))
        outs = fuselm.distributed.linear_cross_entropy(x, w_arg, inputs["target"], linear_bias=b_arg, **args)
    outs = _outputs_tuple(outs)
    ups = [u.to(o.dtype) for u, o in zip(inputs["upstream"], outs, strict=True)]
    grads = torch.autograd.grad(outs, leaves, ups)
    return {
        "outs": [o.detach().cpu() for o in outs],
        "grads": [g.detach().cpu() for g in grads],
        "out_dtypes": [o.dtype for o in outs],
    }


def _worker(rank: int, world: int, names: list[str], dtype: torch.dtype, device_kind: str) -> dict:
    device = f"cuda:{rank}" if device_kind == "cuda" else "cpu"
    return {name: _distributed_case(name, rank, world, dtype, device) for name in names}


def single_process(name: str, dtype: torch.dtype, fn):
    """Outputs and gradients on the whole vocabulary: "eager" (PyTorch in dtype) or "reference" (fp64)."""
    op, kw, _ = CASES[name]
    inputs = case_inputs(name, dtype, "cpu")
    if kw.get("bad_target"):  # the oracle has no NaN rows: it sees that row ignored (compared as 0)
        inputs["target"].view(-1)[1] = kw.get("ignore_index", -100)
    compute = torch.float64 if fn == "reference" else dtype
    args = function_kwargs(kw, inputs)
    args.pop("memory", None)
    args.pop("inplace_backward", None)
    if args["weight"] is not None:
        args["weight"] = args["weight"].to(compute)
    ce = reference64 if fn == "reference" else eager_cross_entropy
    if op == "ce":
        leaves = [inputs["logits"].detach().to(compute).requires_grad_()]
        outs = ce(leaves[0], inputs["target"], **args)
    else:
        leaves = [
            inputs[k].detach().to(compute).requires_grad_() for k in ("x", "w", "b") if inputs[k] is not None
        ]
        logits = F.linear(leaves[0], leaves[1], leaves[2] if len(leaves) == 3 else None)
        outs = ce(logits, inputs["target"], **args)
    outs = _outputs_tuple(outs)
    ups = [u.to(o.dtype) for u, o in zip(inputs["upstream"], outs, strict=True)]
    grads = torch.autograd.grad(outs, leaves, ups)
    return [o.detach() for o in outs], [g.detach() for g in grads]


def check_case(name: str, per_rank: list[dict], dtype: torch.dtype, world: int) -> None:
    op, _, how = CASES[name]
    sizes = split_sizes(world, how, V)
    eager_outs, eager_grads = single_process(name, dtype, "eager")
    ref_outs, ref_grads = single_process(name, dtype, "reference")
    first = per_rank[0]
    if CASES[name][1].get("bad_target"):  # an out-of-range target: NaN loss, zero gradient on its row only
        for res in per_rank:
            loss, grad = res["outs"][0].view(-1), res["grads"][0].view(-1, res["grads"][0].shape[-1])
            assert torch.isnan(loss[1]), f"{name}: the bad row's loss is not NaN"
            assert torch.equal(grad[1], torch.zeros_like(grad[1])), f"{name}: the bad row has a gradient"
            loss[1] = 0.0
    for r, res in enumerate(per_rank):
        for o, o0 in zip(res["outs"], first["outs"], strict=True):
            assert torch.equal(o.nan_to_num(), o0.nan_to_num()), (
                f"{name}: rank {r}'s output differs from rank 0's"
            )
    assert first["out_dtypes"][0] == dtype
    for what, o, e, ref in zip(("loss", "lse"), first["outs"], eager_outs, ref_outs, strict=False):
        assert o.shape == ref.shape, f"{name} {what}: shape {tuple(o.shape)} != {tuple(ref.shape)}"
        assert_numerics(f"{name} {what}", o, e, ref, dtype)
    if op == "ce":
        shard_grad_names, full_grads = ["logits"], []
    else:
        # the input gradient is the whole one on every rank (summed over the ranks)
        for r, res in enumerate(per_rank):
            assert_numerics(
                f"{name} input grad (rank {r})", res["grads"][0], eager_grads[0], ref_grads[0], dtype
            )
        shard_grad_names = ["weight", "bias"][: len(first["grads"]) - 1]
        full_grads = [None]
    for i, what in enumerate(shard_grad_names, start=len(full_grads)):
        shards = [res["grads"][i] for res in per_rank]
        assert [s.shape[-1 if op == "ce" else 0] for s in shards] == sizes
        whole = torch.cat(shards, dim=-1 if op == "ce" else 0)
        assert_numerics(f"{name} {what} grad", whole, eager_grads[i], ref_grads[i], dtype)


def distributed_results(world: int, backend: str, dtype: torch.dtype) -> list[dict]:
    return case_results(_worker, CASES, world, backend, dtype)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("world", [2, 3])
def test_gloo_matches_single_process(name, world):
    per_rank = distributed_results(world, "gloo", torch.float32)
    check_case(name, [res[name] for res in per_rank], torch.float32, world)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(
    "world", nccl_world_sizes() or [pytest.param(2, marks=pytest.mark.skip("needs 2 GPUs"))]
)
def test_nccl_matches_single_process(name, dtype, world):
    per_rank = distributed_results(world, "nccl", dtype)
    check_case(name, [res[name] for res in per_rank], dtype, world)


# ---- bad arguments: each error names what is wrong ----


def _errors_worker(rank: int, world: int) -> list[tuple[str, str, str]]:
    """(what, exception type, message) of every bad call, on rank `rank` of `world`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    x, w, t = torch.randn(4, H), torch.randn(5, H), torch.randint(0, 5 * world, (4,))
    mesh = init_device_mesh("cpu", (world,))
    calls = {
        "vocab_sizes of the wrong length": lambda: fuselm.distributed.linear_cross_entropy(
            x, w, t, vocab_sizes=[5] * (world + 1)
        ),
        "vocab_sizes without this rank's size": lambda: fuselm.distributed.linear_cross_entropy(
            x, w, t, vocab_sizes=[6] * world
        ),
        "DTensor and process_group": lambda: fuselm.distributed.linear_cross_entropy(
            x, DTensor.from_local(w, mesh, [Shard(0)]), t, process_group=mesh.get_group()
        ),
        "DTensor weight replicated": lambda: fuselm.distributed.linear_cross_entropy(
            x, DTensor.from_local(w, mesh, [Replicate()]), t
        ),
        "DTensor input sharded": lambda: fuselm.distributed.linear_cross_entropy(
            DTensor.from_local(x, mesh, [Shard(0)]), w, t
        ),
        "class weight of the local size": lambda: fuselm.distributed.linear_cross_entropy(
            x, w, t, weight=torch.ones(5)
        ),
        "float64": lambda: fuselm.distributed.cross_entropy(torch.randn(4, 5, dtype=torch.float64), t),
        "every slice empty": lambda: fuselm.distributed.cross_entropy(torch.randn(4, 0), t),
    }
    out = []
    for what, call in calls.items():
        try:
            call()
            out.append((what, "no error", ""))
        except Exception as e:  # reported to the parent
            out.append((what, type(e).__name__, str(e)))
    return out


ERRORS = {  # what -> (exception type, words the message must contain)
    "vocab_sizes of the wrong length": ("ValueError", "vocab_sizes"),
    "vocab_sizes without this rank's size": ("ValueError", "vocab_sizes"),
    "DTensor and process_group": ("ValueError", "process_group"),
    "DTensor weight replicated": ("ValueError", "Shard(0)"),
    "DTensor input sharded": ("ValueError", "input"),
    "class weight of the local size": ("ValueError", "weight"),
    "float64": ("ValueError", "input"),
    "every slice empty": ("ValueError", "no class"),
}


def test_bad_arguments_raise_errors_that_name_them():
    per_rank = run_workers(_errors_worker, 2)
    for rank, results in enumerate(per_rank):
        assert [r[0] for r in results] == list(ERRORS)
        for what, kind, message in results:
            want_kind, words = ERRORS[what]
            assert kind == want_kind and words in message, f"rank {rank}, {what}: {kind}: {message}"


def test_needs_an_initialized_process_group():
    with pytest.raises(RuntimeError, match="process group"):
        fuselm.distributed.cross_entropy(torch.randn(4, 5), torch.randint(0, 5, (4,)))


# ---- memory: no rank holds more than its slice of any [N, V] tensor ----


def _memory_worker(rank: int, world: int, n: int, h: int, v: int, budget: int) -> dict:
    device = torch.device("cuda", rank)
    even = [v // world + (r < v % world) for r in range(world)]
    sizes = split_sizes(world, "uneven", V) if v == V else even
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, h, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
    w = (torch.randn(sizes[rank], h, device=device, generator=g) / h**0.5).bfloat16().requires_grad_()
    t = torch.randint(0, v, (n,), device=device, generator=g)
    x.grad, w.grad = torch.zeros_like(x), torch.zeros_like(w)  # gradients allocated once, as in training
    loss = fuselm.distributed.linear_cross_entropy(x, w, t, vocab_sizes=sizes, memory=budget)  # warm up
    loss.backward()
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    loss = fuselm.distributed.linear_cross_entropy(x, w, t, vocab_sizes=sizes, memory=budget)
    loss.backward()
    torch.cuda.synchronize(device)
    return {"extra": torch.cuda.max_memory_allocated(device) - before, "rows": sizes[rank]}


@pytest.mark.gpu
@pytest.mark.parametrize(
    "world", nccl_world_sizes() or [pytest.param(2, marks=pytest.mark.skip("needs 2 GPUs"))]
)
def test_nccl_rank_memory_is_one_chunk_plus_gradients(world):
    """Extra peak memory per rank of fwd + bwd: the chunk buffer, dX and dW of its slice (the gradients of
    the step, before they are added into .grad) and O(N) statistics; far below its [N, V_r] slice of
    logits (1 GiB here)."""
    n, h, v, budget = 8192, 1024, 128256, 64 * 2**20
    for res in run_workers(_memory_worker, world, backend="nccl", args=(n, h, v, budget)):
        grads = 2 * (n * h + res["rows"] * h)  # bf16 dX and dW
        allowed = budget + grads + n * 64 + 2**20  # + per-token fp32 statistics and allocator rounding
        logits_slice = 2 * n * res["rows"]
        assert res["extra"] <= allowed, f"extra {res['extra'] / 2**20:.1f} MiB > {allowed / 2**20:.1f} MiB"
        assert res["extra"] < logits_slice / 4
