"""fuselm.graph_step: a step's forward and backward captured in CUDA graphs per input shape and replayed
(GraphCache, and CapturedStep on it).

CPU: the arguments are checked before anything touches a GPU. Replays, each test twice: on CUDA graphs (GPU)
and on graphs emulated on the CPU (kit.fake_graphs: recorded operations replayed on the same tensors), which
check the bookkeeping around the graphs in CI: the eager step's loss and gradients on new data (with fuselm
ops inside), gradients added into .grad as backward() adds them, new shapes captured up to max_graphs and
eager beyond with one warning, a call before the previous backward eager, dropout's new masks. A patched HF
model's step: tests/hf/test_compile_host.py; Trainer's: tests/integrations/test_trainer.py."""

from __future__ import annotations

import warnings

import pytest
import torch

import fuselm
from fuselm import CapturedStep
from fuselm.graph_step import GraphCache
from fuselm.offload import offloaded_checkpoint, recompute_checkpoint
from fuselm.ops._common.testing import assert_numerics


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
        (dict(warmup=0), "warmup must be an int >= 1, got 0"),
        (dict(warmup=1.5), "warmup must be an int >= 1"),
        (dict(warmup=True), "warmup must be an int >= 1"),
        (dict(max_graphs=0), "max_graphs must be an int >= 1, got 0"),
        (dict(max_graphs="2"), "max_graphs must be an int >= 1"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    loss_fn, params = _linear_step()
    args = dict(loss_fn=loss_fn, params=params, example_inputs=[torch.ones(3)])
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=message):
        CapturedStep(**args)


# ---- replays: CUDA graphs on a GPU, emulated graphs on the CPU ----


def _model(device, seed=0):
    torch.manual_seed(seed)
    layers = dict(up=torch.nn.Linear(16, 64), down=torch.nn.Linear(32, 16), unused=torch.nn.Linear(2, 2))
    return torch.nn.ModuleDict(layers).to(device)


def _loss(model):
    def loss_fn(x, target):  # fuselm's RMSNorm, SwiGLU and cross-entropy inside
        h = fuselm.rms_norm(x, torch.ones(16, device=x.device, dtype=x.dtype))
        gate, up = model["up"](h).chunk(2, dim=-1)
        return fuselm.cross_entropy(model["down"](fuselm.swiglu(gate, up)), target).mean()

    return loss_fn


def _batch(seed, device, rows=4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 16, generator=g).to(device)
    t = torch.randint(0, 16, (rows,), generator=g).to(device)
    return [x, t]


def _trained(model):
    return [p for n, p in model.named_parameters() if "unused" not in n]


def _eager_grads(model, batches):
    """The gradients eager backward() accumulates over ``batches`` (from no gradient)."""
    model.zero_grad(set_to_none=True)
    for x, t in batches:
        _loss(model)(x, t).backward()
    return [p.grad.clone() for p in _trained(model)]


def test_replays_give_the_eager_steps_loss_and_gradients(graph_device):
    graphed, eager, ref = _model(graph_device), _model(graph_device), _model(graph_device).double()
    step = CapturedStep(_loss(graphed), list(graphed.parameters()), _batch(0, graph_device))
    for seed in (1, 2, 3):
        x, t = _batch(seed, graph_device)
        for m in (graphed, eager, ref):
            m.zero_grad(set_to_none=True)
        loss = step(x, t)
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
    assert step.graphs.replays == 3 and step.graphs.eager == 0


def test_gradients_add_into_grad_as_backward_adds_them(graph_device):
    """Micro-batches accumulate; a .grad set to None (zero_grad) starts again from zero; a .grad an eager
    backward made is added to; the gradient buffers become .grad."""
    graphed, eager = _model(graph_device), _model(graph_device)
    step = CapturedStep(_loss(graphed), _trained(graphed), _batch(0, graph_device))
    batches = [_batch(seed, graph_device) for seed in (1, 2, 3)]
    for x, t in batches[:2]:
        step(x, t)
    want = _eager_grads(eager, batches[:2])
    for p, g in zip(_trained(graphed), want, strict=True):
        torch.testing.assert_close(p.grad, g)
    buffers = [p.grad for p in _trained(graphed)]
    graphed.zero_grad(set_to_none=True)
    step(*batches[2])
    for p, g, buffer in zip(_trained(graphed), _eager_grads(eager, batches[2:]), buffers, strict=True):
        assert p.grad is buffer
        torch.testing.assert_close(p.grad, g)
    graphed.zero_grad(set_to_none=True)
    _loss(graphed)(*batches[0]).backward()  # an eager micro-batch, then a replayed one
    step(*batches[1])
    for p, g in zip(_trained(graphed), _eager_grads(eager, batches[:2]), strict=True):
        torch.testing.assert_close(p.grad, g)


def test_a_grad_made_between_forward_and_backward_is_added(graph_device):
    """An eager backward between a replayed forward and its backward (another loss term): its .grad is
    added to the replay's, after the pass that writes the buffers (no .grad at the forward: after
    zero_grad() to None) and the pass that adds into them (zeroed buffers: zero_grad(set_to_none=False))."""
    graphed, eager = _model(graph_device), _model(graph_device)
    params = _trained(graphed)
    cache = GraphCache(max_graphs=1, warmup=1, owner="test")
    a, b = _batch(1, graph_device), _batch(2, graph_device)
    want = _eager_grads(eager, [a, b])
    for set_to_none in (True, False, True):
        graphed.zero_grad(set_to_none=set_to_none)
        out = cache(_loss(graphed), lambda: params, tuple(a), {})
        _loss(graphed)(*b).backward()
        out.backward()
        for p, g in zip(params, want, strict=True):
            torch.testing.assert_close(p.grad, g)
    assert cache.replays == 3 and cache.eager == 0


def test_new_shapes_are_captured_up_to_max_graphs_then_run_eagerly(graph_device):
    graphed, eager = _model(graph_device), _model(graph_device)
    step = CapturedStep(_loss(graphed), _trained(graphed), _batch(0, graph_device, rows=4), max_graphs=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rows in (4, 6, 4, 3, 6, 3):
            graphed.zero_grad(set_to_none=True)
            batch = _batch(rows, graph_device, rows=rows)
            loss = step(*batch)
            torch.testing.assert_close(loss, _loss(eager)(*batch).detach())
            for p, g in zip(_trained(graphed), _eager_grads(eager, [batch]), strict=True):
                torch.testing.assert_close(p.grad, g)
    assert [str(w.message) for w in caught] == [
        "CapturedStep: a batch of a new shape (args[0] [3, 16], args[1] [3]) beyond max_graphs=2 captured "
        "ones: it runs eagerly, as every further new shape does (pad batches to fewer shapes, or raise "
        "max_graphs)"
    ]
    assert len(step.graphs.signatures) == 2 and step.graphs.replays == 4 and step.graphs.eager == 2


def test_a_call_before_the_previous_backward_runs_eagerly(graph_device):
    """Two forwards, then their backwards: the second runs eagerly (a replay would overwrite the first's
    activations); a backward after a later replay raises instead of reading overwritten activations."""
    graphed, eager = _model(graph_device), _model(graph_device)
    params = _trained(graphed)
    cache = GraphCache(max_graphs=1, warmup=1, owner="test")
    fn = _loss(graphed)
    a, b = _batch(1, graph_device), _batch(2, graph_device)
    with pytest.warns(UserWarning, match="test: a call before the backward of the previous call"):
        la, lb = cache(fn, lambda: params, tuple(a), {}), cache(fn, lambda: params, tuple(b), {})
    (la + 2 * lb).backward(retain_graph=True)
    eager.zero_grad(set_to_none=True)
    (_loss(eager)(*a) + 2 * _loss(eager)(*b)).backward()
    for p, pe in zip(params, _trained(eager), strict=True):
        torch.testing.assert_close(p.grad, pe.grad)
    assert cache.replays == 1 and cache.eager == 1
    cache(fn, lambda: params, tuple(b), {}).backward()  # the first call's backward ran: replayed again
    with pytest.raises(RuntimeError, match="after a later captured call overwrote its activations"):
        la.backward()


def test_arguments_a_graph_cannot_hold_run_eagerly(graph_device):
    graphed = _model(graph_device)
    cache = GraphCache(max_graphs=2, warmup=1, owner="test")
    x, t = _batch(1, graph_device)

    def fn(x, t, scale):
        return _loss(graphed)(x, t) * scale[0]

    with pytest.warns(UserWarning, match=r"test: argument 'scale' is a list \(a graph takes tensors"):
        loss = cache(fn, lambda: _trained(graphed), (x, t), {"scale": [2.0]})
    loss.backward()
    assert cache.eager == 1 and not cache.signatures
    with pytest.warns(UserWarning, match="argument 0 requires grad"):
        cache(fn, lambda: _trained(graphed), (x.clone().requires_grad_(), t), {"scale": (1.0,)})
    with torch.no_grad():  # nothing to capture without grad mode: eager, silently
        cache(fn, lambda: _trained(graphed), (x, t), {"scale": [1.0]})
    assert cache.eager == 2 and not cache.signatures


def test_loss_fn_must_return_a_scalar(graph_device):
    model = _model(graph_device)
    with pytest.raises(ValueError, match="loss_fn must return a scalar tensor"):
        CapturedStep(lambda x, t: model["up"](x), list(model["up"].parameters()), _batch(0, graph_device))
    with pytest.raises(ValueError, match=r"inputs\[1\] must be a CUDA tensor, got int"):
        CapturedStep(_loss(model), _trained(model), _batch(0, graph_device))(_batch(1, graph_device)[0], 3)


# ---- gradient checkpointing inside the graphs ----


def _checkpointed_loss(model, checkpoint):
    """_loss's MLP, checkpointed by ``checkpoint``."""

    def loss_fn(x, target):
        def mlp(h):
            gate, up = model["up"](h).chunk(2, dim=-1)
            return model["down"](fuselm.swiglu(gate, up))

        h = fuselm.rms_norm(x, torch.ones(16, device=x.device, dtype=x.dtype))
        return fuselm.cross_entropy(checkpoint(mlp, h), target).mean()

    return loss_fn


def _replays_match_eager(step, graphed, eager, device):
    """Two replays of ``step`` (on ``graphed``) on new batches: the eager non-checkpointed step's loss and
    gradients (on ``eager``) bit for bit."""
    for seed in (1, 2):
        x, t = _batch(seed, device)
        for m in (graphed, eager):
            m.zero_grad(set_to_none=True)
        loss = step(x, t)
        loss_eager = _loss(eager)(x, t)
        loss_eager.backward()
        assert torch.equal(loss, loss_eager.detach())
        for p, pe in zip(_trained(graphed), _trained(eager), strict=True):
            assert torch.equal(p.grad, pe.grad)
    assert step.graphs.replays == 2 and step.graphs.eager == 0


def test_fuselms_recompute_checkpoint_is_captured(graph_device):
    """A step checkpointed by recompute_checkpoint replays the eager non-checkpointed step's loss and
    gradients bit for bit (the recompute runs the same operations on the same inputs)."""
    graphed, eager = _model(graph_device), _model(graph_device)
    step = CapturedStep(
        _checkpointed_loss(graphed, recompute_checkpoint), _trained(graphed), _batch(0, graph_device)
    )
    _replays_match_eager(step, graphed, eager, graph_device)


def test_an_offloaded_checkpoint_is_captured_with_its_host_copies(graph_device):
    """A step whose checkpointed call keeps its input in host memory (offloaded_checkpoint) is captured with
    the copies: every replay sends the new input out and back, and gives the eager step's loss and gradients
    bit for bit. The host buffers are the graphs' while they live (an eager offload gets others; the passes
    of one signature share them), the pool's again once they are gone."""
    import gc

    from fuselm import offload

    def free():
        return {id(entry[2]) for bucket in offload._POOL.free.values() for entry in bucket}

    graphed, eager = _model(graph_device), _model(graph_device)
    step = CapturedStep(
        _checkpointed_loss(graphed, offloaded_checkpoint), _trained(graphed), _batch(0, graph_device)
    )
    owned = {id(entry[2]) for graphs in step.graphs._graphs.values() for _, entry in graphs.host_buffers}
    assert len(owned) == 1, "one input offloaded: the two passes captured (write, add) share its buffer"
    assert not owned & free(), "the graphs own their host buffers"
    _replays_match_eager(step, graphed, eager, graph_device)
    stash = offload._Stash([torch.ones(64, 16, device=graph_device)])
    assert stash.held and all(id(held[0]) not in owned for held in stash.held)
    del stash, step
    gc.collect()
    assert owned <= free()


def test_a_checkpoint_that_draws_random_numbers_raises_at_the_capture(graph_device):
    """Dropout inside a checkpointed call: a capture cannot restore its masks for the recompute."""
    w = torch.nn.Parameter(torch.ones(64, device=graph_device))

    def loss_fn(x):
        return recompute_checkpoint(lambda h: torch.nn.functional.dropout(w * h, 0.5), x).sum()

    with pytest.raises(RuntimeError, match=r"draws random numbers \(dropout\) and is checkpointed"):
        CapturedStep(loss_fn, [w], [torch.ones(64, device=graph_device)])


def test_a_checkpoint_is_captured_when_its_last_eager_run_drew_no_random_numbers(graph_device):
    """What counts is the warm-up before the capture: a function that drew (dropout 0.5) in an earlier
    eager step and draws none now (dropout 0) is captured."""
    w = torch.nn.Parameter(torch.ones(64, device=graph_device))
    p = [0.5]

    def loss_fn(x):
        return recompute_checkpoint(lambda h: torch.nn.functional.dropout(w * h, p[0]), x).sum()

    x = torch.ones(64, device=graph_device)
    loss_fn(x).backward()
    p[0], w.grad = 0.0, None
    step = CapturedStep(loss_fn, [w], [x])
    assert step(x).item() == 64 and torch.equal(w.grad, x)
    assert step.graphs.replays == 1 and step.graphs.eager == 0


def test_a_tensor_outside_params_that_would_get_a_gradient_is_named(graph_device):
    w, v = (torch.nn.Parameter(torch.ones(3, device=graph_device)) for _ in "wv")
    with pytest.raises(ValueError, match=r"not one of its parameters \(torch.float32 \[3\]"):
        CapturedStep(lambda x: (w * v * x).sum(), [w], [torch.ones(3, device=graph_device)])


def test_dropout_draws_new_masks_each_replay(graph_device):
    w = torch.nn.Parameter(torch.ones(1024, device=graph_device))
    step = CapturedStep(
        lambda x: torch.nn.functional.dropout(w * x, 0.5).sum(), [w], [torch.ones(1024, device=graph_device)]
    )
    x = torch.ones(1024, device=graph_device)
    step(x)
    first, w.grad = w.grad.clone(), None
    step(x)
    assert not torch.equal(first, w.grad)
    assert set(first.unique().tolist()) <= {0.0, 2.0}
