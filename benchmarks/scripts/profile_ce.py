"""One cross-entropy fwd+bwd for ncu: python benchmarks/scripts/profile_ce.py N V BLOCK WARPS PER_SM."""

import sys

import torch

import fuselm
from fuselm.ops._common.loss import rows as ce_op  # the row kernels' launchers

n, v, block, warps, per_sm = (int(a) for a in sys.argv[1:6])
ce_op._fwd_config = lambda n_cols: (block >= n_cols, block, warps, per_sm)
x = torch.randn(n, v, device="cuda", dtype=torch.bfloat16).requires_grad_()
t = torch.randint(0, v, (n,), device="cuda")
for _ in range(3):
    torch.autograd.grad(fuselm.cross_entropy(x, t, inplace_backward=True), x)
    fuselm.cross_entropy(x.detach(), t)
torch.cuda.synchronize()
