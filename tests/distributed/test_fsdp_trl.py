"""TRL's SFT and GRPO trainers under FSDP2 with ``fuselm.trl.patch()``: one training step
on 2 ranks gives, on each rank, the loss of the same step on TRL's own LM head kernel, and the same
gradients, both under the numerics rule against a float64 single-process reference (docs/design.md
section 5). Peak memory per rank is reported (``pytest -s``): ``torch.cuda.max_memory_allocated`` of the
step on CUDA, none on CPU.

How the step is driven: by the real trainers, ``SFTTrainer.train()`` / ``GRPOTrainer.train()`` for one
optimizer step (``max_steps=1``), in each of 2 spawned ranks (gloo on CPU; nccl on 2 GPUs), on a model
sharded by hand the standard way (``fully_shard`` on each decoder layer, then on the root, as in
test_fsdp.py) before it is handed to the trainer. Two things make that work without accelerate's own FSDP
launcher or plugin:

- Each rank sets the variables a launcher would (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...), so that
  accelerate sees the process group already there: 2 processes, the rank's device (cuda:LOCAL_RANK on GPU;
  without them accelerate says one process, and transformers puts every rank on cuda:0), the data sharded
  over the ranks, TRL's cross-rank token counts and metrics gathered.
- The model carries transformers' mark of a model sharded at load time
  (``_is_distributed_loading_by_transformers``, what ``from_pretrained(distributed_config=...)`` sets):
  the Trainer then neither moves it nor wraps it. Without the mark, accelerate wraps the FSDP2 model in
  DDP, which fails at once: "aten.cat.default got mixed torch.Tensor and DTensor" (DDP's broadcast of the
  module states).

GRPO does not generate: the trainer's ``_generate_and_score_completions`` is replaced by a fixed rollout
per rank (prompt and completion ids with left and right padding, advantages, old log-probs of an earlier
policy, so that the ratio differs from 1 and the clipping acts) and, as TRL computes them, the reference
model's log-probs (beta > 0; the reference model's head runs under the patch too; the KL term is 0 at
this first step, where the reference model is the policy's checkpoint, as in TRL) and the token count
gathered over the ranks. Everything after (``_prepare_inputs``' shuffle, ``training_step``,
``compute_loss`` with TRL's default ``dapo`` loss and an entropy bonus, so that the head's entropy output
counts too, the backward, the optimizer step) is the trainer's.

The per-rank loss is what the trainer's ``compute_loss`` returned; the gradients are read (full tensors)
by a callback just before the optimizer step (``max_grad_norm=0``: no clipping).

What is compared, per case (SFT on every parameter; SFT with PEFT LoRA adapters on every linear; GRPO on
every parameter), per rank for the loss and for every trained parameter's gradient:
- ours: the FSDP step under ``fuselm.trl.patch()``, fp32;
- trl: the same FSDP step on TRL's own kernel (``ChunkedLogProbFunction``), fp32;
- eager: one process, TRL's own kernel, fp32; reference: the same in float64, with TRL's head replaced by
  its definition (full logits, ``log_softmax``: float64 throughout). Both run the trainer's
  ``compute_loss`` on the batch the rank trained on (SFT: recorded in the rank; GRPO: the same fixed
  rollout), on every rank's batch, the gradients averaged over the ranks (FSDP averages them). TRL
  normalizes each rank's loss by the tokens of all ranks divided by accelerate's number of processes
  (SFT: ``average_tokens_across_devices``; GRPO's ``dapo``): that number is 2 in the ranks and 1 here, so
  the single process is given the ranks' token count divided by 2.
Rules: ours against trl (fuselm changes nothing under FSDP), ours and trl each against eager (FSDP itself
is right), all against the float64 reference. Spies: TRL's kernel never runs under the patch, fuselm's op
never runs without it, each runs in its own step.

Private names this relies on (checked against trl 1.16 and transformers 5.24): TRL's
``_generate_and_score_completions``, ``_get_per_token_logps_and_entropies`` and
``current_gradient_accumulation_steps`` (set by ``train()``; the single process calls ``compute_loss``
itself), transformers' ``_is_distributed_loading_by_transformers`` and ``TrainingArguments._n_gpu``.
The nccl variant is the same code on 2 GPUs (written for it; run it where there are 2).

All cases of one backend run in one spawn of 2 processes (a spawn costs seconds of imports).
"""

from __future__ import annotations

import math
import os
import pickle
import traceback
from pathlib import Path

import pytest
import torch
from filelock import FileLock  # a dependency of torch
from kit.hf_models import build
from kit.spies import counting
from kit.workers import backend_params, run_workers

import fuselm.trl
from fuselm.ops._common.testing import assert_numerics

pytest.importorskip("trl")
pytest.importorskip("peft")
from kit import trl_models as tm  # noqa: E402

WORLD_SIZE = 2
SEED = 0
BATCH = 4  # per rank: SFT rows, GRPO completions
PROMPT, COMPLETION = 6, 8  # GRPO's fixed rollout: prompt and completion lengths (padded)
CASES = ("sft", "sft_lora", "grpo")
HEADS = ("fuselm", "trl")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

BACKENDS = backend_params(WORLD_SIZE)


# ---- the model, the trainer, the rollout (in the ranks and in the test process) ----


def _model(case: str, checkpoint: str, dtype: torch.dtype, device) -> torch.nn.Module:
    """The checkpoint's tiny Llama (kit.hf_models), loaded the same on every rank and in the test process;
    for "sft_lora" with LoRA adapters on every linear (A and B random, so every adapter gets a gradient),
    made in fp32 and then cast (the float64 reference has the same adapters)."""
    from transformers import AutoModelForCausalLM

    # sdpa, not eager: HF's eager attention takes the softmax in fp32, where float64's finfo.min (the mask
    # value) is -inf, so a fully masked row (a left-padded prompt position) is NaN in float64 and spreads
    # to its whole sequence through the next layer's values: the reference would be NaN
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="sdpa")
    if case == "sft_lora":
        import peft

        config = peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS, init_lora_weights=False
        )
        torch.manual_seed(SEED + 1)
        model = peft.get_peft_model(model, config)
    return model.to(device=device, dtype=dtype)


def _trainer(case: str, model, device_type: str, output_dir: str):
    """The TRL trainer of the case around `model` (one optimizer step of plain SGD, no gradient clipping;
    the rest TRL's defaults: gradient checkpointing, GRPO's dapo loss)."""
    from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

    common = dict(
        output_dir=output_dir,
        max_steps=1,
        per_device_train_batch_size=BATCH,
        learning_rate=0.1,
        optim="sgd",
        max_grad_norm=0.0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=device_type == "cpu",
        bf16=False,
        seed=SEED,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    if case == "grpo":
        # an entropy bonus: the head's entropy output enters the loss and the gradients
        config = dict(num_generations=2, max_completion_length=COMPLETION, beta=0.04, entropy_coef=0.01)
        if device_type == "cuda":  # the reference model: TRL's default device_map="auto" in one process
            # spreads it over every visible GPU (ranks load it with None, then on their own GPU)
            config["model_init_kwargs"] = {"device_map": {"": torch.cuda.current_device()}}
        args = _one_gpu(GRPOConfig(**common, **config))
        return GRPOTrainer(
            model=model,
            args=args,
            reward_funcs=tm.reward_nouns,
            train_dataset=tm.prompts(WORLD_SIZE * BATCH),
            processing_class=tm.tokenizer(),
        )
    args = _one_gpu(SFTConfig(**common))
    dataset = tm.prompt_completion(WORLD_SIZE * BATCH)  # the same on every rank: accelerate shards it
    return SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tm.tokenizer())


def _no_ddp_on_sharded(trainer, sharded) -> None:
    """transformers >= 5.2x reads the mark set above (the model already reduces its own gradients) and asks
    accelerate to prepare it without DDP; older ones (5.17 on the GPU machine) wrap the FSDP2 model in DDP,
    which refuses DTensor parameters. There, the same request by hand: prepare_model without device
    placement and in evaluation mode (accelerate's way of saying "do not wrap")."""
    if hasattr(trainer, "is_distributed_loading_by_transformers"):
        return
    accelerator = trainer.accelerator
    prepare_model = accelerator.prepare_model

    def prepare_without_ddp(model, device_placement=None, evaluation_mode=False):
        if model is not sharded:
            return prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        return prepare_model(model, device_placement=False, evaluation_mode=True)

    accelerator.prepare_model = prepare_without_ddp


def _one_gpu(args):
    """One GPU per process: where accelerate sees a single process (the test process), transformers counts
    every visible GPU and GRPOTrainer refuses the nn.DataParallel that would follow."""
    if args.device.type == "cuda":  # sets up the devices (once), then overrides their count
        args._n_gpu = 1
    return args


def _fixed_rollout(rank: int, vocab: int) -> dict:
    """Rank `rank`'s completions, fixed (CPU, float64): prompts left-padded, completions ending with eos
    and right-padded, advantages, and the log-probs of an earlier policy (the model's are about
    -log(vocab); the ratio to them is about exp(N(0, 0.3)), so some tokens are clipped)."""
    g = torch.Generator().manual_seed(2000 + rank)
    pad, eos = 0, 2
    prompt_ids = torch.randint(3, tm.VOCAB, (BATCH, PROMPT), generator=g)
    prompt_mask = torch.ones(BATCH, PROMPT, dtype=torch.long)
    prompt_mask[0, : 2 + rank] = 0
    prompt_mask[2, :1] = 0
    completion_ids = torch.randint(3, tm.VOCAB, (BATCH, COMPLETION), generator=g)
    lengths = torch.tensor([COMPLETION, 5 + rank, 3, COMPLETION - 1])  # eos included (row 0: truncated)
    completion_mask = (torch.arange(COMPLETION) < lengths[:, None]).long()
    completion_ids[torch.arange(1, BATCH), lengths[1:] - 1] = eos
    old = -math.log(vocab) + 0.3 * torch.randn(BATCH, COMPLETION, generator=g, dtype=torch.float64)
    return {
        "prompt_ids": prompt_ids.masked_fill(prompt_mask == 0, pad),
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids.masked_fill(completion_mask == 0, pad),
        "completion_mask": completion_mask,
        "advantages": torch.randn(BATCH, generator=g, dtype=torch.float64),
        "old_per_token_logps": old * completion_mask,
    }


def _rollout(trainer, rank: int, num_items_in_batch=None) -> dict:
    """What GRPOTrainer's ``_generate_and_score_completions`` returns, for the fixed completions of rank
    `rank`: the reference model's log-probs and the token count (gathered over the ranks, unless given)
    computed as TRL does."""
    device = trainer.accelerator.device
    dtype = next(trainer.model.parameters()).dtype
    batch = {
        k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype)
        for k, v in _fixed_rollout(rank, trainer.model.config.vocab_size).items()
    }
    if num_items_in_batch is None:  # TRL's count: the completion tokens of every rank
        num_items_in_batch = trainer.accelerator.gather(batch["completion_mask"].sum()).sum()
    batch["num_items_in_batch"] = torch.as_tensor(num_items_in_batch, device=device)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        batch["ref_per_token_logps"], _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.ref_model, ids, mask, COMPLETION
        )
    return batch


def _trained(model):
    """(name, parameter) of what trains: every parameter, or the adapters of a PEFT model."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


# ---- in the ranks ----


def _spies() -> dict:
    """Counts calls of TRL's kernel (its forward) and of fuselm's op (through fuselm.trl's adapter)."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    from fuselm.trl import patching

    counts = {"trl": 0, "fuselm": 0}
    # a fresh process: nothing to restore
    ChunkedLogProbFunction.forward = staticmethod(counting(counts, "trl", ChunkedLogProbFunction.forward))
    patching.linear_log_probs = counting(counts, "fuselm", patching.linear_log_probs)
    return counts


def _cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    return value


def _fsdp_step(case: str, head: str, mesh, device, rank: int, checkpoint: str, counts: dict) -> dict:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import TrainerCallback

    model = _model(case, checkpoint, torch.float32, device)  # the same weights on every rank
    causal_lm = model.get_base_model() if case == "sft_lora" else model
    for layer in causal_lm.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(causal_lm, mesh=mesh)
    # transformers' mark of a model sharded at load time: the Trainer neither moves it nor wraps it in DDP
    causal_lm._is_distributed_loading_by_transformers = True
    sharded = all(isinstance(p, DTensor) for p in model.parameters())

    record: dict = {"losses": []}
    before = dict(counts)
    with tm.lm_head(head):
        output_dir = os.path.join(os.path.dirname(checkpoint), f"out-{case}-{head}-{rank}")
        trainer = _trainer(case, model, device.type, output_dir)
        _no_ddp_on_sharded(trainer, model)
        if case == "grpo":
            trainer._generate_and_score_completions = lambda generation_batch: _rollout(trainer, rank)
        compute_loss = trainer.compute_loss

        def recording_compute_loss(model, inputs, *args, **kwargs):
            if case != "grpo":  # the batch the rank trains on (the reference reruns it)
                record["inputs"] = {k: _cpu(v) for k, v in inputs.items()}
                record["num_items_in_batch"] = _cpu(kwargs.get("num_items_in_batch"))
            loss = compute_loss(model, inputs, *args, **kwargs)
            record["losses"].append(_cpu(loss))
            return loss

        trainer.compute_loss = recording_compute_loss

        class Gradients(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                grads = {}
                for name, p in _trained(model):  # the same order on every rank: full_tensor() gathers
                    grads[name] = _cpu(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
                record["grads"] = grads

        trainer.add_callback(Gradients())
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
        peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
        patched = fuselm.trl.is_patched()
    return {
        "loss": record["losses"][0],
        "steps": len(record["losses"]),
        "grads": record["grads"],
        "inputs": record.get("inputs"),
        "num_items_in_batch": record.get("num_items_in_batch"),
        "peak_bytes": peak,
        "patched": patched,
        "sharded": sharded,
        "processes": trainer.accelerator.num_processes,
        "calls": {k: counts[k] - before[k] for k in counts},
    }


def _trl_worker(rank: int, world_size: int, device_type: str, checkpoint: str, cases) -> dict:
    """Every (case, head) on this rank: -> ("ok", results) or ("error", traceback)."""
    from torch.distributed.device_mesh import init_device_mesh

    # what a launcher (torchrun, accelerate launch) sets: accelerate then joins the existing process group
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",  # not used: the process group exists
    )
    mesh = init_device_mesh(device_type, (world_size,))
    device = torch.device("cpu")
    if device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())  # the rank's GPU (set by run_workers)
    import datasets
    import transformers

    datasets.disable_progress_bars()  # a fresh process: the bars would bury the printed peaks under -s
    transformers.utils.logging.disable_progress_bar()
    counts = _spies()
    results = {}
    for case in cases:
        for head in HEADS:
            try:
                results[(case, head)] = ("ok", _fsdp_step(case, head, mesh, device, rank, checkpoint, counts))
            except Exception:
                results[(case, head)] = ("error", traceback.format_exc())
    return results


# ---- in the test process ----


def _save_checkpoint(path: Path) -> str:
    if not (path / "config.json").is_file():
        build("llama", torch.float32, "cpu", seed=SEED).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", params=BACKENDS)
def trl_runs(request, tmp_path_factory):
    """(device type, checkpoint, [per-rank results of every case]) of one spawn on the backend. Under
    pytest-xdist the first worker to get here spawns and leaves the results in the session's shared
    temporary folder for the others (pytest-xdist's recipe for a fixture that runs once)."""
    device_type = "cuda" if request.param == "nccl" else "cpu"

    def spawn(checkpoint: str):
        args = (device_type, checkpoint, CASES)
        return run_workers(_trl_worker, WORLD_SIZE, backend=request.param, args=args, timeout=300)

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        checkpoint = _save_checkpoint(tmp_path_factory.mktemp("fsdp_trl") / "tiny-llama")
        return device_type, checkpoint, spawn(checkpoint)
    shared = tmp_path_factory.getbasetemp().parent
    path = shared / f"fsdp_trl_runs_{request.param}.pkl"
    with FileLock(f"{path}.lock"):
        checkpoint = _save_checkpoint(shared / "fsdp_trl_tiny_llama")
        if not path.is_file():
            path.write_bytes(pickle.dumps(spawn(checkpoint)))
        return device_type, checkpoint, pickle.loads(path.read_bytes())


def _per_rank(trl_runs, case: str, head: str) -> list[dict]:
    _, _, results = trl_runs
    out = []
    for rank, result in enumerate(results):
        status, value = result[(case, head)]
        if status != "ok":
            raise AssertionError(f"{case} ({head}) failed on rank {rank}:\n{value}")
        out.append(value)
    return out


def _fsdp_case(trl_runs, case: str, head: str) -> dict:
    """One (case, head)'s FSDP results: per-rank losses stacked, rank 0's gradients (full tensors, the same
    on every rank), per-rank peaks and batches; the flags checked on every rank."""
    per_rank = _per_rank(trl_runs, case, head)
    for rank, r in enumerate(per_rank):
        assert r["sharded"], f"{case} ({head}) rank {rank}: fully_shard left a parameter unsharded"
        assert r["processes"] == WORLD_SIZE, f"accelerate saw {r['processes']} processes, not {WORLD_SIZE}"
        assert r["steps"] == 1, f"{case} ({head}) rank {rank}: compute_loss ran {r['steps']} times"
        assert r["patched"] == (head == "fuselm")
        calls = r["calls"]
        if head == "fuselm":  # fuselm's op instead of TRL's kernel, never TRL's
            assert calls["fuselm"] > 0 and calls["trl"] == 0, f"{case} rank {rank}: {calls}"
        else:
            assert calls["trl"] > 0 and calls["fuselm"] == 0, f"{case} rank {rank}: {calls}"
    for other in per_rank[1:]:
        assert other["grads"].keys() == per_rank[0]["grads"].keys()
        for name, grad in per_rank[0]["grads"].items():
            assert torch.equal(grad, other["grads"][name]), f"{name}: full gradients differ across ranks"
    return {
        "loss": torch.stack([r["loss"] for r in per_rank]),
        "grads": per_rank[0]["grads"],
        "peaks": [r["peak_bytes"] for r in per_rank],
        "batches": [(r["inputs"], r["num_items_in_batch"]) for r in per_rank],
    }


def _single_process(case: str, device_type: str, checkpoint: str, batches) -> dict:
    """The step in this process on every rank's batch, unsharded: kind -> (per-rank losses, mean of the
    per-rank gradients) for "reference" (float64, exact head) and "eager" (fp32, TRL's kernel), by the
    trainer's compute_loss."""
    device = torch.device(device_type)
    runs = {}
    for kind, dtype, head in (("reference", torch.float64, "exact"), ("eager", torch.float32, "trl")):
        model = _model(case, checkpoint, dtype, device)
        losses, grads = [], {}
        with tm.lm_head(head):
            output_dir = os.path.join(os.path.dirname(checkpoint), f"single-{case}-{kind}")
            trainer = _trainer(case, model, device_type, output_dir)
            model.train()
            trainer.current_gradient_accumulation_steps = 1  # what train() sets for one micro-batch
            for rank in range(WORLD_SIZE):
                model.zero_grad(set_to_none=True)
                if case == "grpo":
                    # TRL divides the token count of all ranks by accelerate's number of processes
                    vocab = model.config.vocab_size
                    tokens = sum(_fixed_rollout(r, vocab)["completion_mask"].sum() for r in range(WORLD_SIZE))
                    inputs = _rollout(trainer, rank, tokens / WORLD_SIZE)
                    loss = trainer.compute_loss(model, inputs)
                else:
                    recorded, num_items = batches[rank]
                    inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in recorded.items()}
                    num_items = None if num_items is None else num_items.to(device) / WORLD_SIZE
                    loss = trainer.compute_loss(model, inputs, num_items_in_batch=num_items)
                loss.backward()
                losses.append(loss.detach().cpu())
                for name, p in _trained(model):
                    grads[name] = grads.get(name, 0) + p.grad.cpu() / WORLD_SIZE
        runs[kind] = (torch.stack(losses), grads)
    return runs


def _megabytes(peaks) -> str:
    return ", ".join("none (CPU)" if p is None else f"{p / 2**20:.1f} MiB" for p in peaks)


@pytest.mark.parametrize("case", CASES)
def test_fsdp_trl_step_matches_trl_and_reference(trl_runs, case, record_property):
    """One SFT / SFT-LoRA / GRPO step of the TRL trainer on a model fully_shard-ed over 2 ranks: the loss
    of each rank and the gradients under fuselm.trl.patch() follow the numerics rule against the same
    step on TRL's own kernel and against float64; TRL's FSDP step follows it against one process. The
    peak memory of each rank's step is printed (CUDA; none on CPU)."""
    device_type, checkpoint, _ = trl_runs
    ours, theirs = _fsdp_case(trl_runs, case, "fuselm"), _fsdp_case(trl_runs, case, "trl")
    print(
        f"\n{case} ({device_type}, {WORLD_SIZE} ranks) peak memory per rank: "
        f"fuselm {_megabytes(ours['peaks'])}; TRL {_megabytes(theirs['peaks'])}"
    )
    record_property("peak_bytes_per_rank", {"fuselm": ours["peaks"], "trl": theirs["peaks"]})
    batches = tuple(ours["batches"])
    if case != "grpo":  # both steps trained on the same batch on each rank, the ranks on their own
        assert not torch.equal(batches[0][0]["input_ids"], batches[1][0]["input_ids"])
        for (a, n_a), (b, n_b) in zip(batches, theirs["batches"], strict=True):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if torch.is_tensor(a[k]))
            assert (n_a is None and n_b is None) or torch.equal(n_a, n_b)
    single = _single_process(case, device_type, checkpoint, batches)
    (ref_loss, ref_grads), (eager_loss, eager_grads) = single["reference"], single["eager"]
    assert ours["grads"].keys() == theirs["grads"].keys() == ref_grads.keys() and ref_grads
    if case == "sft_lora":
        assert all("lora_" in n for n in ref_grads)
    for name, value in (("loss", ref_loss), *((f"grad {n}", g) for n, g in ref_grads.items())):
        assert torch.isfinite(value).all(), f"{case} reference {name} is not finite"  # rel_err skips NaNs
    outputs = [("loss", ours["loss"], theirs["loss"], eager_loss, ref_loss)]
    for n in ref_grads:
        outputs.append((f"grad {n}", ours["grads"][n], theirs["grads"][n], eager_grads[n], ref_grads[n]))
    for name, o, t, e, r in outputs:
        assert_numerics(f"{case} {name}: FSDP fuselm vs FSDP TRL", o, t, r)
        assert_numerics(f"{case} {name}: FSDP fuselm vs one-process TRL", o, e, r)
        assert_numerics(f"{case} {name}: FSDP TRL vs one-process TRL", t, e, r)
