"""RoPE fwd+bwd kernels of fuselm and of torch.compile (Hugging Face's function) at Llama-3-8B shapes,
one call each inside a cudaProfilerStart/Stop region, for Nsight Compute:

    ncu --profile-from-start off --metrics <list> python benchmarks/scripts/rope_ncu.py

Then it prints each provider's graph-replay time, and the launcher's with a new output and in
place. TORCH_LOGS=output_code shows compile's kernels.
"""

import torch
import triton

import fuselm
from fuselm_bench.harness import capture_graph
from fuselm_bench.rope import hf_apply_rotary_pos_emb, make_inputs

B, T, HQ, HK, D = 4, 4096, 32, 8, 128


def main():
    torch.manual_seed(0)
    dev = "cuda"
    inputs = make_inputs((B, T, HQ, HK, D), torch.bfloat16, torch.device(dev))  # the bench suite's inputs
    q, k, cos, sin = inputs["q"], inputs["k"], inputs["cos"], inputs["sin"]
    gq, gk = torch.randn_like(q), torch.randn_like(k)

    def full(fn):
        oq, ok = fn(q, k, cos, sin)
        return torch.autograd.grad((oq, ok), (q, k), (gq, gk))

    compiled_fn = torch.compile(hf_apply_rotary_pos_emb)
    calls = {"fuselm": lambda: full(fuselm.apply_rotary), "torch_compile": lambda: full(compiled_fn)}
    for fn in calls.values():
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for fn in calls.values():
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    # the launcher alone, forward direction: a new output vs the output written over the input (the
    # buffer reuse inductor's backward may do), [B, T, H, D] views of the [B, H, T, D] tensors
    from fuselm.ops.rope.op import _launch

    qv, kv = q.detach().transpose(1, 2), k.detach().transpose(1, 2)
    qn, kn = torch.empty_like(q).transpose(1, 2), torch.empty_like(k).transpose(1, 2)
    calls["launcher, new output"] = lambda: _launch(qv, kv, qn, kn, cos, sin, None, False)
    calls["launcher, in place"] = lambda: _launch(qv, kv, qv, kv, cos, sin, None, False)
    for name, fn in calls.items():
        g = capture_graph(fn, torch.device(dev))
        ms = sorted(triton.testing.do_bench(g.replay, warmup=25, rep=200) for _ in range(5))
        print(f"{name:14s} fwd+bwd graph replay median of 5: {ms[2] * 1e3:.1f} us (min {ms[0] * 1e3:.1f})")


if __name__ == "__main__":
    main()
