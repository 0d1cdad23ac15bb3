"""Where a LoRA fine-tuning step spends its GPU time (lab script, not the library).

1. One LoRA projection, fwd+bwd, at Llama-3-8B shapes (8192 tokens): PEFT's composition (fp32 adapters,
   x cast to fp32, ``result + lora_B(lora_A(x)) * s``) against a fused one (the update added into the base
   GEMM's output by ``addmm_``, adapters in the compute dtype, dX accumulated with addmm).
2. A whole step (HF + PEFT + gradient checkpointing, optionally fuselm.hf.patch) of a random-init model,
   then one profiled step: the kernels' device time grouped by kind.

    PYTHONPATH=src:/tmp/site python benchmarks/scripts/lora_step_profile.py --shape llama3-8b --batch 4x2048
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "llama3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0,
                        tie_word_embeddings=True),
}


class FusedLora(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, a, b, s):
        a16, b16 = a.to(x.dtype), b.to(x.dtype)
        low = x @ a16.t()
        y = x @ w.t()
        y.addmm_(low, b16.t(), alpha=s)
        ctx.save_for_backward(x, w, a16, b16, low)
        ctx.s = s
        ctx.dtypes = (a.dtype, b.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, a16, b16, low = ctx.saved_tensors
        s = ctx.s
        g = dy @ b16  # [N, r]
        dx = dy @ w
        dx.addmm_(g, a16, alpha=s)
        da = (g.t() @ x).mul_(s)
        db = (dy.t() @ low).mul_(s)
        return dx, None, da.to(ctx.dtypes[0]), db.to(ctx.dtypes[1]), None


def peft_style(x, w, a, b, s):
    y = F.linear(x, w)
    xa = x.to(a.dtype)
    return (y + F.linear(F.linear(xa, a), b) * s).to(x.dtype)


def micro(rank: int, out: dict) -> None:
    from triton.testing import do_bench

    n = 8192
    rows = []
    for k, m in ((4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)):
        x = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        a = (torch.randn(rank, k, device="cuda") / k**0.5).requires_grad_()
        b = (torch.randn(m, rank, device="cuda") / rank**0.5).requires_grad_()
        dy = torch.randn(n, m, device="cuda", dtype=torch.bfloat16)
        row = {"k": k, "m": m}
        for name, fn in (("base_only", lambda: F.linear(x, w)), ("peft", lambda: peft_style(x, w, a, b, 2.0)),
                         ("fused", lambda: FusedLora.apply(x, w, a, b, 2.0))):
            def step(fn=fn):
                y = fn()
                y.backward(dy)
            row[name] = do_bench(step, warmup=10, rep=50)
            x.grad = a.grad = b.grad = None
        gemm_flops = 2 * n * k * m * 2  # fwd + dX
        row["floor_ms_at_700T"] = gemm_flops / 700e12 * 1e3
        rows.append(row)
        print(json.dumps(row), flush=True)
    out["micro"] = rows


def kind(name: str) -> str:
    n = name.lower()
    if "flash" in n or "fmha" in n or "attention" in n:
        return "attention"
    if "gemm" in n or "sm90_xmma" in n or "cutlass" in n or "nvjet" in n or "gemv" in n:
        return "gemm"
    if "triton" in n:
        return "triton"
    if "dequant" in n or "kdequantize" in n:
        return "dequant"
    if "elementwise" in n or "vectorized" in n or "unrolled" in n:
        return "elementwise"
    if "reduce" in n:
        return "reduce"
    if "memcpy" in n or "memset" in n:
        return "copy"
    return "other"


def lora_model(shape: str, rank: int, patch: dict | None = None):
    """A random-init Llama of ``shape`` on CUDA in bf16, HF gradient checkpointing, PEFT LoRA of ``rank`` on
    all seven projections (dropout 0), then ``fuselm.hf.patch(model, **patch)`` unless ``patch`` is None;
    (model, its config, a fused AdamW on the adapters)."""
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**SHAPES[shape], attn_implementation="sdpa", max_position_embeddings=8192)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    lcfg = peft.LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj"])
    model = peft.get_peft_model(model, lcfg)
    if patch is not None:
        import fuselm.hf

        fuselm.hf.patch(model, **patch)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    return model, cfg, opt


def step_profile(args, out: dict) -> None:
    model, cfg, opt = lora_model(args.shape, args.rank, {} if args.fuselm else None)
    b, t = map(int, args.batch.split("x"))
    ids = torch.randint(0, cfg.vocab_size, (b, t), device="cuda")

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    out["step_ms"] = times
    out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    groups: dict[str, float] = defaultdict(float)
    top = []
    for ev in prof.key_averages():
        dt = ev.device_time_total / 1e3
        if dt <= 0:
            continue
        groups[kind(ev.key)] += dt
        top.append((dt, ev.count, ev.key[:110]))
    top.sort(reverse=True)
    out["groups_ms"] = dict(sorted(groups.items(), key=lambda kv: -kv[1]))
    out["top"] = top[:30]
    print(json.dumps({k: out[k] for k in ("step_ms", "peak_gib", "groups_ms")}, indent=1), flush=True)
    for dt, cnt, name in top[:30]:
        print(f"{dt:9.2f} ms {cnt:6d}  {name}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--batch", default="4x2048")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--fuselm", action="store_true")
    p.add_argument("--micro", action="store_true")
    p.add_argument("--json")
    args = p.parse_args()
    out: dict = {"args": vars(args), "gpu": torch.cuda.get_device_name()}
    if args.micro:
        micro(args.rank, out)
    else:
        step_profile(args, out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
