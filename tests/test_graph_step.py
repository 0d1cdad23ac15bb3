"""fuselm.CapturedStep: a fixed-shape step's forward + backward captured in a CUDA graph and replayed.

CPU: the arguments are checked before anything touches a GPU. GPU: replays give the eager step's loss and
gradients on new data (with fuselm ops inside), parameters the loss does not reach get no gradient, new
inputs must match the captured ones, dropout draws new masks each replay. A patched HF model's step:
tests/hf/test_compile_host.py."""

from __future__ import annotations

import pytest
import torch

import fuselm
from fuselm import CapturedStep
from fuselm.ops._common.testing import assert_numerics

CUDA = torch.cuda.is_available()


def _linear_step():
    w = torch.nn.Parameter(torch.ones(3))
    return (lambda x: (w * x).sum()), [w]


# ---- arguments (CPU) ----


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(example_inputs=[torch.ones(3)]),
            r"example_inputs\[0\] must be a CUDA tensor, got a tensor on cpu",
        ),
        (dict(example_inputs=torch.ones(3)), "example_inputs must be a sequence of tensors"),
        (dict(example_inputs=[3.0]), r"example_inputs\[0\] must be a CUDA tensor, got float"),
        (dict(params=[]), "params is empty"),
        (dict(example_inputs=[]), "example_inputs is empty"),
        (dict(params=[torch.ones(3)]), r"params\[0\] must be a tensor that requires grad"),
        (dict(loss_fn=3), "loss_fn must be callable"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    loss_fn, params = _linear_step()
    args = dict(loss_fn=loss_fn, params=params, example_inputs=[torch.ones(3)])
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=message):
        CapturedStep(args["loss_fn"], args["params"], args["example_inputs"])


@pytest.mark.gpu
@pytest.mark.parametrize("warmup", [0, -1, 1.5, True])
def test_bad_warmup_is_named(warmup):
    loss_fn, params = _linear_step()
    with pytest.raises(ValueError, match="warmup must be an int >= 1"):
        CapturedStep(loss_fn, params, [torch.ones(3, device="cuda")], warmup=warmup)


# ---- replays (GPU) ----


def _model(seed=0):
    torch.manual_seed(seed)
    layers = dict(up=torch.nn.Linear(16, 64), down=torch.nn.Linear(32, 16), unused=torch.nn.Linear(2, 2))
    return torch.nn.ModuleDict(layers).cuda()


def _loss(model):
    def loss_fn(x, target):  # fuselm's RMSNorm, SwiGLU and cross-entropy inside
        h = fuselm.rms_norm(x, torch.ones(16, device=x.device, dtype=x.dtype))
        gate, up = model["up"](h).chunk(2, dim=-1)
        return fuselm.cross_entropy(model["down"](fuselm.swiglu(gate, up)), target).mean()

    return loss_fn


@pytest.mark.gpu
def test_replays_give_the_eager_steps_loss_and_gradients():
    graphed, eager, ref = _model(), _model(), _model().double()
    step = CapturedStep(_loss(graphed), list(graphed.parameters()), _batch(0))
    for seed in (1, 2, 3):
        x, t = _batch(seed)
        loss = step(x, t)
        eager.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        loss_eager = _loss(eager)(x, t)
        loss_eager.backward()
        loss_ref = _loss(ref)(x.double(), t)
        loss_ref.backward()
        assert_numerics("loss", loss, loss_eager.detach(), loss_ref.detach(), torch.float32)
        for name in ("up", "down"):
            for p, pe, pr in zip(graphed[name].parameters(), eager[name].parameters(), ref[name].parameters(),
                                 strict=True):  # fmt: skip
                assert_numerics(name, p.grad, pe.grad, pr.grad, torch.float32)
        assert graphed["unused"].weight.grad is None
        with torch.no_grad():  # the same SGD step on both: the graph reads the parameters in place
            for m in (graphed, eager, ref):
                for p in m.parameters():
                    if p.grad is not None:
                        p -= 0.1 * p.grad


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 16, generator=g).cuda()
    t = torch.randint(0, 16, (4,), generator=g).cuda()
    return [x, t]


@pytest.mark.gpu
def test_inputs_must_match_the_captured_ones():
    model = _model()
    step = CapturedStep(
        _loss(model), [p for n, p in model.named_parameters() if "unused" not in n], _batch(0)
    )
    x, t = _batch(1)
    with pytest.raises(ValueError, match=r"expected 2 inputs"):
        step(x)
    with pytest.raises(
        ValueError, match=r"inputs\[0\] must be a float32 tensor of shape \[4, 16\] on cuda:0"
    ):
        step(x[:2], t)
    with pytest.raises(ValueError, match=r"inputs\[1\] must be a int64 tensor"):
        step(x, t.int())
    with pytest.raises(ValueError, match="loss_fn must return a scalar tensor"):
        CapturedStep(lambda x, t: model["up"](x), list(model["up"].parameters()), _batch(0))


@pytest.mark.gpu
def test_dropout_draws_new_masks_each_replay():
    w = torch.nn.Parameter(torch.ones(1024, device="cuda"))
    step = CapturedStep(
        lambda x: torch.nn.functional.dropout(w * x, 0.5).sum(), [w], [torch.ones(1024, device="cuda")]
    )
    x = torch.ones(1024, device="cuda")
    step(x)
    first = w.grad.clone()
    step(x)
    assert not torch.equal(first, w.grad)
    assert set(first.unique().tolist()) <= {0.0, 2.0}
