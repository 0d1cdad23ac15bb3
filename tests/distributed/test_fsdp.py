"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on models patched by ``fuselm.hf.patch``: one training
step on 2 ranks (each its own batch) gives each rank's loss and the gradients of the single-process run,
under the numerics rule against float64 (docs/design.md section 5).

The standard recipe: ``fuselm.hf.patch(model)`` (instance patching), ``fully_shard`` on each decoder layer,
then on the root. FSDP2 unshards the root's own parameters (embeddings, final norm, lm_head) in the root's
pre-forward hook, so the patched CausalLM forward, which reads ``lm_head.weight`` itself and never calls
``lm_head``, sees a plain tensor there; the fused loss runs (``logits is None``). FSDP2 averages the
gradients over the data-parallel ranks (its default reduce-scatter for fp32), so the single-process
gradients are the mean of the per-rank ones (each rank's loss is the mean over its own tokens).

What is compared, per rank for the loss and for every parameter's full (``full_tensor()``) gradient:
- FSDP: the patched model, sharded, fp32 (gloo on CPU; nccl on 2 GPUs);
- the same patched model unsharded in one process, fp32 (the statement of the item: FSDP gives it);
- eager: the unpatched Hugging Face model, fp32; reference: the same in float64.
FSDP and the single-process patched model each follow the rule against eager, and FSDP follows it
against the single-process patched model as well.

Also: ``fully_shard(model.lm_head)`` on its own (its weight stays a sharded DTensor outside lm_head's
own forward): the patched forward sees an lm_head it cannot fuse (FSDP's class and hooks) and runs HF's
forward, which returns logits; the loss and gradients are still right. And ``patch`` after
``fully_shard``: the root's class is then FSDP's subclass ``FSDP<Name>ForCausalLM(FSDPModule,
<Name>ForCausalLM)``, which instance patching looks through, so the fused loss is put in too.

And PEFT LoRA: adapters on every linear of llama and qwen3, patched (fuselm's fused
LoRA path, no fallback to PEFT's forward), the layers and the root sharded: the adapters' gradients and the
losses are the single-process ones. A MoE family (qwen3_moe) runs the standard recipe too. And TRL's fused
LM head (add_fused_lm_head, what TRL's trainers call) computed by fuselm (fuselm.trl.patch) under FSDP2:
losses and gradients of one process running TRL's own head.

All cases of one backend run in one spawn of 2 processes (a spawn costs seconds of imports).
"""

from __future__ import annotations

import functools
import gc
import os
import pickle
import traceback
import warnings

import pytest
import torch
from filelock import FileLock  # a dependency of torch
from kit import skip_unless_fuselm_trl
from kit.hf_models import MODEL_TYPES, build
from kit.workers import backend_params, run_workers

import fuselm.hf
import fuselm.trl
from fuselm.ops._common.testing import assert_numerics

WORLD_SIZE = 2
SEED = 0
VOCAB, BATCH, SEQ = 300, 2, 16  # hf_models' tiny configs: hidden 64, 2 layers, vocab 300

# (model_type, how): "standard" = patch, shard the layers, shard the root; "lm_head_alone" = the same
# with lm_head sharded on its own too; "patch_after_shard" = shard first, then patch.
# "lora": PEFT LoRA on every linear of the decoder (random A and B), patched (fuselm's fused LoRA path),
# then sharded as "standard"; only the adapters train. "qlora": the same over bitsandbytes 4-bit (NF4)
# bases: fully_shard shards the packed bytes, fuselm.hf.patch kept each layer's quantization state. The
# bytes are stored as float32 (bitsandbytes' quant_storage, the documented FSDP + QLoRA recipe): torch
# 2.11's fully_shard cannot shard an integer parameter (it makes every shard require grad), 2.13's can.
QUANT_STORAGE = torch.float32
LORA_TYPES = ("llama", "qwen3")
CASES = (
    *((model_type, "standard") for model_type in (*MODEL_TYPES, "qwen3_moe")),
    ("llama", "lm_head_alone"),
    ("llama", "patch_after_shard"),
    *((model_type, "lora") for model_type in LORA_TYPES),
    ("llama", "qlora"),
    ("llama", "trl"),
)
TRL_OUTPUTS = ("log_probs", "entropy")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _model(model_type: str, how: str, dtype: torch.dtype, device) -> torch.nn.Module:
    """The tiny model of the case, the same on every rank and in the single process (with LoRA adapters
    for "lora": A and B random, so that every adapter gets a gradient)."""
    model = build(model_type, dtype, device, seed=SEED)
    if how == "trl":  # TRL's fused LM head (what its trainers add): model(..., fused_lm_head=True)
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model, outputs=TRL_OUTPUTS)
        return model
    if how not in ("lora", "qlora"):
        return model
    import peft

    if how == "qlora":
        model = _quantized(model, dtype, device)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS, init_lora_weights=False
    )
    torch.manual_seed(SEED + 1)
    model = peft.get_peft_model(model, config)
    return model.to(device=device, dtype=dtype) if how == "lora" else model.to(device)


def _quantized(model: torch.nn.Module, dtype: torch.dtype, device) -> torch.nn.Module:
    """The decoder's linears as bitsandbytes 4-bit (NF4) layers computing in fp32 (quantized on `device`),
    or, for float64 (the reference), as dense float64 linears holding those layers' dequantized weights."""
    import bitsandbytes as bnb

    model = model.to(torch.float32)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in LORA_TARGETS:
                dense = getattr(parent, name, None)
                if dense is None:
                    continue
                q = bnb.nn.Linear4bit(
                    dense.in_features,
                    dense.out_features,
                    bias=False,
                    compute_dtype=torch.float32,
                    quant_type="nf4",
                    quant_storage=QUANT_STORAGE,
                )
                weight = dense.weight.data.clone()
                q.weight = bnb.nn.Params4bit(
                    weight, requires_grad=False, quant_type="nf4", quant_storage=QUANT_STORAGE
                )
                q = q.to(device)  # quantizes
                if dtype == torch.float64:
                    w = bnb.functional.dequantize_4bit(q.weight.data, q.weight.quant_state)
                    q = torch.nn.Linear(dense.in_features, dense.out_features, bias=False, device=device)
                    q.weight = torch.nn.Parameter(w.to(torch.float64))
                setattr(parent, name, q)
    return model.to(torch.float64) if dtype == torch.float64 else model


def _trained(model: torch.nn.Module):
    """(name, parameter) of what trains: every parameter, or the adapters of a PEFT model."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


BACKENDS = backend_params(WORLD_SIZE)


def _batch(rank: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch: random token ids; labels the ids with a prompt and a few tokens at -100."""
    g = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[0, : 3 + rank] = -100  # a prompt (of another length on each rank)
    labels[1, torch.randperm(SEQ, generator=g)[:3]] = -100
    return ids.to(device), labels.to(device)


# ---- in the workers ----


def _fsdp_step(model_type: str, how: str, mesh, device: torch.device, rank: int) -> dict:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = _model(model_type, how, torch.float32, device)  # the same init on every rank
    causal_lm = model.get_base_model() if how in ("lora", "qlora") else model
    if how == "trl":
        fuselm.trl.patch()
    elif how != "patch_after_shard":
        fuselm.hf.patch(model)
    if how == "lm_head_alone":
        fully_shard(model.lm_head, mesh=mesh)
    for layer in causal_lm.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(causal_lm, mesh=mesh)
    if how == "patch_after_shard":
        fuselm.hf.patch(model)
    sharded = all(isinstance(p, DTensor) for p in model.parameters())

    ids, labels = _batch(rank, device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _forward(model, how, ids, labels)
        out.loss.backward()
    grads = {}
    for name, p in _trained(model):  # the same order on every rank: full_tensor() gathers
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grads[name] = grad.cpu()
    if how == "trl":
        fused = fuselm.trl.is_patched()
        fuselm.trl.unpatch()
    else:
        fused = out.logits is None  # fuselm's linear_cross_entropy path returns no logits
        fuselm.hf.unpatch(model)
    return {
        "loss": out.loss.detach().cpu(),
        "grads": grads,
        "fused_loss": fused,
        "sharded": sharded,
        # fuselm says once when a LoRA layer runs PEFT's forward instead of its fused path
        "fallbacks": sorted({str(w.message) for w in caught if "fuselm" in str(w.message)}),
    }


def _forward(model, how: str, ids, labels):
    """The step's forward: TRL's fused head for "trl" (its loss: the mean negative log-prob), else HF's."""
    if how == "trl":
        return model(input_ids=ids, labels=labels, fused_lm_head=True)
    return model(input_ids=ids, labels=labels)


def _fsdp_worker(rank: int, world_size: int, device_type: str, cases) -> dict:
    """Every case on this rank: (model_type, how) -> ("ok", results) or ("error", traceback)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (world_size,))
    device = torch.device("cpu")
    if device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())  # the rank's GPU (set by run_workers)
    results = {}
    for model_type, how in cases:
        try:
            results[(model_type, how)] = ("ok", _fsdp_step(model_type, how, mesh, device, rank))
        except Exception:
            results[(model_type, how)] = ("error", traceback.format_exc())
    return results


# ---- in the test process ----


@pytest.fixture(scope="module", params=BACKENDS)
def fsdp_runs(request, tmp_path_factory):
    """(device type, [per-rank results of every case]) of one spawn on the backend. Under pytest-xdist the
    first worker to get here spawns and leaves the results in the session's shared temporary folder for
    the others (pytest-xdist's recipe for a fixture that runs once)."""
    device_type = "cuda" if request.param == "nccl" else "cpu"

    def spawn():
        args = (device_type, CASES)
        return device_type, run_workers(
            _fsdp_worker, WORLD_SIZE, backend=request.param, args=args, timeout=300
        )

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return spawn()
    path = tmp_path_factory.getbasetemp().parent / f"fsdp_runs_{request.param}.pkl"
    with FileLock(f"{path}.lock"):
        if not path.is_file():
            path.write_bytes(pickle.dumps(spawn()))
        return pickle.loads(path.read_bytes())


def _fsdp_case(fsdp_runs, model_type: str, how: str) -> dict:
    """One case's FSDP results: per-rank losses stacked, rank 0's gradients (full tensors, the same on
    every rank), and the flags, which must agree across ranks."""
    _, results = fsdp_runs
    per_rank = []
    for rank, result in enumerate(results):
        status, value = result[(model_type, how)]
        if status != "ok":
            raise AssertionError(f"{model_type} ({how}) failed on rank {rank}:\n{value}")
        per_rank.append(value)
    for other in per_rank[1:]:
        for name, grad in per_rank[0]["grads"].items():
            assert torch.equal(grad, other["grads"][name]), f"{name}: full gradients differ across ranks"
    assert len({(r["fused_loss"], r["sharded"], tuple(r["fallbacks"])) for r in per_rank}) == 1
    return {**per_rank[0], "loss": torch.stack([r["loss"] for r in per_rank])}


@functools.cache
def _single_process(model_type: str, device_type: str, how: str = "standard") -> dict:
    """The same step in this process on every rank's batch, unsharded: kind -> (per-rank losses, mean of
    the per-rank gradients) for "reference" (HF float64), "eager" (HF fp32), "patched" (fuselm fp32)."""
    device = torch.device(device_type)
    gc.collect()  # models other tests patched and dropped: their finalizers give HF's rotary function back
    runs = {}
    for kind, dtype in (("reference", torch.float64), ("eager", torch.float32), ("patched", torch.float32)):
        assert not fuselm.hf.is_patched(model_type)  # HF's own code for the reference and eager
        model = _model(model_type, how, dtype, device)
        if kind == "patched" and how == "trl":
            fuselm.trl.patch()
        elif kind == "patched":
            fuselm.hf.patch(model)
        losses, grads = [], {}
        for rank in range(WORLD_SIZE):
            model.zero_grad(set_to_none=True)
            ids, labels = _batch(rank, device)
            loss = _forward(model, how, ids, labels).loss
            loss.backward()
            losses.append(loss.detach().cpu())
            for name, p in _trained(model):
                grads[name] = grads.get(name, 0) + p.grad.cpu() / WORLD_SIZE
        fuselm.hf.unpatch(model)
        if how == "trl":
            fuselm.trl.unpatch()
        runs[kind] = (torch.stack(losses), grads)
    return runs


def _check(label: str, fsdp: dict, model_type: str, device_type: str, how: str = "standard") -> None:
    single = _single_process(model_type, device_type, how)
    (ref_loss, ref_grads), (eager_loss, eager_grads) = single["reference"], single["eager"]
    patched_loss, patched_grads = single["patched"]
    assert fsdp["grads"].keys() == ref_grads.keys()
    outputs = [("loss", fsdp["loss"], patched_loss, eager_loss, ref_loss)]
    for n in ref_grads:
        outputs.append((f"grad {n}", fsdp["grads"][n], patched_grads[n], eager_grads[n], ref_grads[n]))
    for name, ours, patched, eager, reference in outputs:
        assert_numerics(f"{label} {name}: FSDP vs eager", ours, eager, reference)
        assert_numerics(f"{label} {name}: single-process patched vs eager", patched, eager, reference)
        assert_numerics(f"{label} {name}: FSDP vs single-process patched", ours, patched, reference)


@pytest.mark.parametrize("model_type", LORA_TYPES)
def test_fsdp_peft_lora_step_matches_single_process(fsdp_runs, model_type):
    """PEFT LoRA on every linear, fuselm.hf.patch (the fused LoRA path), fully_shard the layers and the
    root: per-rank losses and the adapters' averaged gradients are the single-process ones, with the fused
    loss and no LoRA layer falling back to PEFT's forward."""
    pytest.importorskip("peft")
    fsdp = _fsdp_case(fsdp_runs, model_type, "lora")
    assert fsdp["sharded"], "fully_shard left a parameter unsharded"
    assert fsdp["fused_loss"], "the patched CausalLM forward did not run fuselm's linear_cross_entropy"
    assert not fsdp["fallbacks"], fsdp["fallbacks"]
    assert fsdp["grads"] and all("lora_" in n for n in fsdp["grads"])
    _check(f"{model_type} FSDP + LoRA", fsdp, model_type, fsdp_runs[0], "lora")


def test_fsdp_qlora_step_matches_single_process(fsdp_runs):
    """PEFT LoRA over bitsandbytes 4-bit (NF4) bases, patched, then fully_shard-ed (the packed 4-bit bytes
    sharded, each layer's quantization state kept on the layer by fuselm.hf.patch): per-rank losses and the
    adapters' averaged gradients are the single-process ones (the float64 reference runs dense layers of
    the dequantized weights), with every LoRA layer on fuselm's fused path."""
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    fsdp = _fsdp_case(fsdp_runs, "llama", "qlora")
    assert fsdp["sharded"], "fully_shard left a parameter unsharded"
    assert fsdp["fused_loss"] and not fsdp["fallbacks"], fsdp["fallbacks"]
    assert fsdp["grads"] and all("lora_" in n for n in fsdp["grads"])
    _check("llama FSDP + QLoRA", fsdp, "llama", fsdp_runs[0], "qlora")


def test_fsdp_trl_fused_head_matches_single_process(fsdp_runs):
    """TRL's fused LM head (add_fused_lm_head, what its trainers use) on fuselm (fuselm.trl.patch) under
    FSDP2: the per-rank losses (the mean negative log-prob) and every gradient equal one process running
    TRL's own head, under the numerics rule."""
    skip_unless_fuselm_trl()
    fsdp = _fsdp_case(fsdp_runs, "llama", "trl")
    assert fsdp["sharded"] and fsdp["fused_loss"], "fuselm.trl was not patched during the step"
    _check("llama FSDP + TRL fused head", fsdp, "llama", fsdp_runs[0], "trl")


@pytest.mark.parametrize("model_type", (*MODEL_TYPES, "qwen3_moe"))
def test_fsdp_step_matches_single_process(fsdp_runs, model_type):
    """patch, fully_shard the layers and the root: the fused loss runs on the unsharded lm_head weight;
    per-rank losses and the averaged gradients are the single-process ones."""
    fsdp = _fsdp_case(fsdp_runs, model_type, "standard")
    assert fsdp["sharded"], "fully_shard left a parameter unsharded"
    assert fsdp["fused_loss"], "the patched CausalLM forward did not run fuselm's linear_cross_entropy"
    _check(f"{model_type} FSDP", fsdp, model_type, fsdp_runs[0])


def test_fsdp_lm_head_sharded_alone_runs_hf_forward(fsdp_runs):
    """fully_shard(model.lm_head) on its own: its weight is a sharded DTensor outside its own forward, so
    the patched forward must not read it; it runs HF's forward (logits returned), with the right numbers."""
    fsdp = _fsdp_case(fsdp_runs, "llama", "lm_head_alone")
    assert fsdp["sharded"]
    assert not fsdp["fused_loss"], "the fused loss ran on an lm_head that FSDP shards on its own"
    _check("llama FSDP (lm_head sharded alone)", fsdp, "llama", fsdp_runs[0])


def test_fsdp_patch_after_fully_shard_is_correct(fsdp_runs):
    """patch() after fully_shard(): the loss and gradients are right (whatever got patched)."""
    fsdp = _fsdp_case(fsdp_runs, "llama", "patch_after_shard")
    assert fsdp["sharded"]
    _check("llama FSDP (patched after sharding)", fsdp, "llama", fsdp_runs[0])


def test_fsdp_patch_after_fully_shard_fuses_loss(fsdp_runs):
    """patch() after fully_shard() should put the fused loss in too."""
    assert _fsdp_case(fsdp_runs, "llama", "patch_after_shard")["fused_loss"]
