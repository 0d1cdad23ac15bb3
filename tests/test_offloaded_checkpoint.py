"""Activation offloading for gradient checkpointing (fuselm.offload): offloaded_checkpoint's semantics on
CPU tensors against no checkpointing and torch's checkpoint (recompute, gradients, dropout masks, RNG,
autocast, outputs and arguments of any structure, options), the host buffer pool and its counts; on a GPU,
that the device RNG state is replayed. The Hugging Face wiring is tested in tests/hf/test_offload.py (not
tests/test_offload.py: two test modules cannot share a basename, tests/ has no __init__.py)."""

from __future__ import annotations

import ast
import contextlib
import copy
import doctest
import functools
import gc
import inspect
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

from fuselm import offload
from fuselm.ops._common.testing import assert_numerics


@pytest.fixture(autouse=True)
def _fresh():
    offload._warned.clear()
    offload.set_kept_output_room(None)  # process-wide: a plan made by another test may have set it
    yield
    gc.collect()  # graphs of a failed test: their host buffers back to the pool


def _in_use() -> int:
    return offload.host_memory_stats()["in_use_bytes"]


# ---- offloaded_checkpoint on plain functions ----


class Block(torch.nn.Module):
    """A residual block with dropout: y = x + dropout(W2 gelu(W1 x)) * scale."""

    def __init__(self, h: int, p: float = 0.1) -> None:
        super().__init__()
        self.up, self.down, self.drop = (
            torch.nn.Linear(h, 2 * h),
            torch.nn.Linear(2 * h, h),
            torch.nn.Dropout(p),
        )

    def forward(self, x, scale=1.0):
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(x)))) * scale


def _blocks(n=3, h=16, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.ModuleList(Block(h) for _ in range(n)).to(dtype)


def _run(blocks, x, how, seed=5):
    """Loss of the chain of blocks on x under `how` (None, "torch", "offload"), grads left in place."""
    torch.manual_seed(seed)
    for block in blocks:
        if how == "offload":
            x = offload.offloaded_checkpoint(block, x, 0.5, use_reentrant=False)
        elif how == "torch":
            x = torch_checkpoint.checkpoint(block, x, 0.5, use_reentrant=False)
        else:
            x = block(x, 0.5)
    loss = (x * x).mean()
    loss.backward()
    return loss


def _param_grads(module):
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("input_grad", [True, False], ids=["input_grad", "frozen_input"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_chain_matches_no_checkpointing(dtype, input_grad):
    """Three blocks with dropout 0.1: loss, input gradient and every parameter gradient as without
    checkpointing (the same dropout masks: same seed), also when the input does not require grad (the
    parameters still get theirs); host buffers hold the inputs between forward and backward only."""
    ref_blocks = _blocks(dtype=torch.float64)
    x0 = torch.randn(2, 7, 16, dtype=torch.float64)
    losses, grads, xgrads = [], [], []
    for how, d in ((None, torch.float64), (None, dtype), ("offload", dtype)):
        blocks = clone_blocks(ref_blocks, d)
        x = x0.to(d).clone().requires_grad_(input_grad)
        before = offload.host_memory_stats()
        losses.append(_run(blocks, x, how))
        after = offload.host_memory_stats()
        if how == "offload":
            assert after["offloads"] - before["offloads"] == 3
            assert after["fetches"] - before["fetches"] == 3
            assert after["prefetched"] - before["prefetched"] == 2  # block 2's and 1's, from 3's and 2's
            assert after["in_use_bytes"] == before["in_use_bytes"]
        grads.append(_param_grads(blocks))
        xgrads.append(x.grad)
    assert_numerics("loss", losses[2], losses[1], losses[0], dtype)
    assert grads[2].keys() == grads[1].keys() and len(grads[1]) == 12
    for name in grads[1]:
        assert_numerics(f"grad {name}", grads[2][name], grads[1][name], grads[0][name], dtype)
    if input_grad:
        assert_numerics("grad x", xgrads[2], xgrads[1], xgrads[0], dtype)
    else:
        assert xgrads[2] is None


def clone_blocks(blocks, dtype):
    return copy.deepcopy(blocks).to(dtype)


def test_inputs_are_on_the_host_between_forward_and_backward():
    """in_use_bytes grows by exactly the bytes of each call's positional tensors, and drops back when the
    backward consumed them, or when the graph is freed without a backward."""
    blocks = _blocks(2, h=8)
    x = torch.randn(3, 5, 8, requires_grad=True)
    base = _in_use()
    y = offload.offloaded_checkpoint(blocks[0], x, use_reentrant=False)
    assert _in_use() - base == x.numel() * 4
    z = offload.offloaded_checkpoint(blocks[1], y, use_reentrant=False)
    assert _in_use() - base == 2 * x.numel() * 4
    z.sum().backward()
    assert _in_use() == base
    w = offload.offloaded_checkpoint(blocks[0], x, use_reentrant=False)
    assert _in_use() - base == x.numel() * 4
    del w
    gc.collect()
    assert _in_use() == base


def test_buffers_are_reused_across_steps_and_shapes():
    """A second step, and a shorter sequence, take the buffers of the first: nothing new is allocated."""
    offload.empty_host_cache()
    blocks = _blocks(2, h=8)
    _run(blocks, torch.randn(2, 16, 8), "offload")  # 1 KiB per input
    held = offload.host_memory_stats()["pageable_bytes"]
    _run(blocks, torch.randn(2, 16, 8), "offload")
    _run(blocks, torch.randn(2, 13, 8), "offload")  # 832 bytes: in the 1 KiB buffers
    assert offload.host_memory_stats()["pageable_bytes"] == held == 2 * 1024


def test_longer_sequences_drop_the_smaller_buffers():
    """When the sequences grow, the free buffers too small for them are dropped rather than kept beside
    the new ones: the pool holds the buffers of the longest sequence only."""
    offload.empty_host_cache()
    blocks = _blocks(2, h=8)
    for seq in (16, 64, 256):  # 1, 4, 16 KiB per input
        _run(blocks, torch.randn(2, seq, 8), "offload")
        assert offload.host_memory_stats()["pageable_bytes"] == 2 * seq * 64
    _run(blocks, torch.randn(2, 160, 8), "offload")  # shorter (10 KiB): the 16 KiB buffers serve it
    assert offload.host_memory_stats()["pageable_bytes"] == 2 * 256 * 64
    _run(blocks, torch.randn(2, 16, 8), "offload")  # far shorter: buffers of its own beside them
    assert offload.host_memory_stats()["pageable_bytes"] == 2 * 256 * 64 + 2 * 16 * 64


def test_a_small_input_leaves_a_large_free_buffer_alone():
    """A request takes a free buffer of at most twice its size: a small input gets a buffer of its own
    while a large one is free (the large one stays for the next large input)."""
    offload.empty_host_cache()
    pool, cpu = offload._POOL, torch.device("cpu")
    held = [pool.acquire(1 << 16, cpu)]
    pool.release(held)
    held = [pool.acquire(100, cpu), pool.acquire(40_000, cpu)]
    assert [entry[0] for _, (_, entry), _ in held] == [128, 1 << 16]  # 40 KB took the 64 KiB buffer
    pool.release(held)
    assert offload.host_memory_stats()["pageable_bytes"] == 128 + (1 << 16)


@pytest.mark.parametrize("nbytes", [1, 1000, 1 << 20, (1 << 20) + 1, 3 << 20, 2_808_217_600, (1 << 33) - 1])
def test_buffer_sizes(nbytes):
    """Powers of two up to SMALL_BUFFER; above, less than 1/8 more than asked, on a coarse grid (1/16 of
    the power of two above), so that nearby lengths share a size."""
    size = offload.buffer_bytes(nbytes)
    assert size >= nbytes
    if nbytes <= offload.SMALL_BUFFER:
        assert size & (size - 1) == 0 and size < 2 * max(nbytes, 1)
    else:
        power = 1 << (nbytes - 1).bit_length()
        assert size % (power // offload.STEPS_PER_OCTAVE) == 0 and size < nbytes * 1.125


def test_outputs_args_and_keywords_of_any_structure():
    """A tuple output with a nested tuple, None, a string and an integer tensor; non-tensor positional
    arguments; a keyword tensor and a partial's bound tensor that require grad and are not leaves (made
    from parameters, shared by two calls, as rotary tables would be) get their gradients through the
    outer graph, once per call."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 6).double()
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    bias_p = torch.randn(6, dtype=torch.float64, requires_grad=True)
    gain_p = torch.randn(6, dtype=torch.float64, requires_grad=True)
    leaves = (x, bias_p, gain_p, lin.weight, lin.bias)

    def fn(gain, x, mode, *, bias, power):
        h = lin(x) * gain + bias
        return h**power, (h.sum(-1), None), mode, h.argmax(-1)

    def run(checkpointed):
        for t in leaves:
            t.grad = None
        bias, gain = bias_p * 2, gain_p.exp()
        h, outs = x, []
        for _ in range(2):
            if checkpointed:
                out = offload.offloaded_checkpoint(
                    functools.partial(fn, gain), h, "m", use_reentrant=False, bias=bias, power=2
                )
            else:
                out = fn(gain, h, "m", bias=bias, power=2)
            outs.append(out)
            h = out[0] / 10
        sum(o[0].sum() + o[1][0].square().sum() for o in outs).backward()
        return outs, [t.grad.clone() for t in leaves]

    eager, want = run(False)
    ours, got = run(True)
    for out, ref in zip(ours, eager, strict=True):
        assert out[2] == "m" and out[1][1] is None
        assert torch.equal(out[3], ref[3]) and not out[3].requires_grad
        assert torch.equal(out[0], ref[0]) and out[0].requires_grad
    for name, g, w in zip(("x", "bias", "gain", "weight", "lin.bias"), got, want, strict=True):
        assert_numerics(f"grad {name}", g, w, w, torch.float64)


def test_autocast_state_is_restored_for_the_recompute():
    """Called under CPU bf16 autocast, the recompute (which runs outside it) autocasts the same way: the
    gradients are those of the autocast run without checkpointing, bit for bit."""
    blocks = _blocks(2, h=8)
    x = torch.randn(2, 5, 8)
    grads = []
    for how in (None, "offload"):
        blocks.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = x
            for block in blocks:
                y = block(y) if how is None else offload.offloaded_checkpoint(block, y, use_reentrant=False)
        y.float().square().sum().backward()
        grads.append(_param_grads(blocks))
    for name in grads[0]:
        assert torch.equal(grads[1][name], grads[0][name]), name


def test_rng_state_after_backward_is_the_callers():
    """The recompute replays the forward's RNG state inside a fork: the caller's RNG stream goes on as
    if there had been no recompute."""
    blocks = _blocks(1, h=8)
    torch.manual_seed(3)
    y = offload.offloaded_checkpoint(blocks[0], torch.randn(2, 8), use_reentrant=False)
    expected = torch.get_rng_state()
    y.sum().backward()
    assert torch.equal(torch.get_rng_state(), expected)


def test_no_grad_runs_the_function_as_is():
    blocks = _blocks(1, h=8)
    before = offload.host_memory_stats()["offloads"]
    with torch.no_grad():
        y = offload.offloaded_checkpoint(blocks[0], torch.randn(2, 8), use_reentrant=False)
    assert not y.requires_grad
    assert offload.host_memory_stats()["offloads"] == before


def test_second_backward_raises():
    lin = torch.nn.Linear(4, 4)
    y = offload.offloaded_checkpoint(lin, torch.randn(2, 4), use_reentrant=False)
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="already backpropagated"):
        y.sum().backward()


def test_autograd_grad_raises():
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    y = offload.offloaded_checkpoint(lin, x, use_reentrant=False)
    with pytest.raises(RuntimeError, match="torch.autograd.grad"):
        torch.autograd.grad(y.sum(), x)


@pytest.mark.parametrize(
    "option, match",
    [
        ({"use_reentrant": "yes"}, "use_reentrant"),
        ({"preserve_rng_state": None}, "preserve_rng_state"),
        ({"context_fn": lambda: (None, None)}, "context_fn"),
        ({"determinism_check": "strict"}, "determinism_check"),
    ],
)
def test_bad_options_raise(option, match):
    with pytest.raises(ValueError, match=match):
        offload.offloaded_checkpoint(torch.nn.Linear(2, 2), torch.randn(1, 2), **option)


def test_no_positional_tensor_warns():
    lin = torch.nn.Linear(2, 2)
    with pytest.warns(UserWarning, match="no positional tensor"):
        y = offload.offloaded_checkpoint(functools.partial(lin, torch.randn(1, 2)), use_reentrant=False)
    y.sum().backward()
    assert lin.weight.grad is not None


@pytest.mark.parametrize("name", ["offloaded_checkpoint", "recompute_checkpoint"])
def test_signature_is_torch_checkpoints(name):
    ours = inspect.signature(getattr(offload, name)).parameters
    theirs = inspect.signature(torch_checkpoint.checkpoint).parameters
    extra = ("preserve_rng_state", "kept_per_input", "prefetch", "backward_context")
    assert list(theirs) == [p for p in ours if p not in extra]
    both = ("preserve_rng_state", "backward_context")
    for option in extra if name == "offloaded_checkpoint" else both:
        assert ours[option].kind is inspect.Parameter.KEYWORD_ONLY


@pytest.mark.parametrize("checkpoint", [offload.offloaded_checkpoint, offload.recompute_checkpoint])
def test_backward_context_wraps_the_recompute_and_the_backward(checkpoint):
    """backward_context: entered once per call's backward, around its recompute (the function runs again
    inside) and the gradients of its inside (a hook on an inner tensor fires inside); the same gradients
    as without; anything but None or a callable raises ValueError naming it."""
    events = []

    @contextlib.contextmanager
    def scope():
        events.append("enter")
        yield
        events.append("exit")

    layer = torch.nn.Linear(8, 8)

    def f(h):
        events.append("run")
        y = layer(h).tanh()
        if y.requires_grad:
            y.register_hook(lambda g: events.append("grad"))
        return y

    x = torch.randn(4, 8, requires_grad=True)
    checkpoint(f, x, backward_context=scope).sum().backward()
    assert events == ["run", "enter", "run", "grad", "exit"]
    got = (x.grad.clone(), layer.weight.grad.clone())
    x.grad = layer.weight.grad = layer.bias.grad = None
    layer(x).tanh().sum().backward()
    assert torch.equal(got[0], x.grad) and torch.equal(got[1], layer.weight.grad)
    with pytest.raises(ValueError, match="backward_context must be None or callable, got 3"):
        checkpoint(f, x, backward_context=3)


def test_checkpoint_fn_binds_checked_options():
    """checkpoint_fn: a partial of offloaded_checkpoint with exactly the options given (kept_per_input
    included; recompute_checkpoint has none); an unknown or unsupported option raises ValueError naming
    it, when bound (not at the first backward)."""
    f = offload.checkpoint_fn(use_reentrant=True, preserve_rng_state=False)
    assert isinstance(f, functools.partial) and f.func is offload.offloaded_checkpoint
    assert f.keywords == {"use_reentrant": True, "preserve_rng_state": False} and f.args == ()
    with pytest.raises(ValueError, match="'offload_to'"):
        offload.checkpoint_fn(use_reentrant=False, offload_to="disk")
    with pytest.raises(ValueError, match="context_fn"):
        offload.checkpoint_fn(context_fn=lambda: (None, None))
    assert offload.checkpoint_fn(False, use_reentrant=False).func is offload.recompute_checkpoint
    with pytest.raises(ValueError, match="^checkpoint_fn: offload must be a bool, got 'no'"):
        offload.checkpoint_fn("no")
    assert offload.checkpoint_fn(kept_per_input=4).keywords == {"kept_per_input": 4}
    assert offload.checkpoint_fn(prefetch=2).keywords == {"prefetch": 2}
    with pytest.raises(ValueError, match="kept_per_input must be None or a finite number >= 0, got -1"):
        offload.checkpoint_fn(kept_per_input=-1)
    with pytest.raises(ValueError, match="'kept_per_input'"):  # recompute_checkpoint keeps nothing
        offload.checkpoint_fn(False, kept_per_input=4)


# ---- recompute_checkpoint, and outputs a recompute leaves unread ----


def test_recompute_checkpoint_keeps_inputs_on_their_device_and_matches():
    blocks, x = _blocks(), torch.randn(4, 16, requires_grad=True)
    want = _run(blocks, x, None)
    want_grads, want_x = _param_grads(blocks), x.grad.clone()
    blocks.zero_grad(set_to_none=True)
    x.grad = None
    before = offload.host_memory_stats()["offloads"]
    torch.manual_seed(5)
    y = x
    for block in blocks:
        y = offload.recompute_checkpoint(block, y, 0.5, use_reentrant=False)
    assert offload.host_memory_stats()["offloads"] == before  # nothing went to host buffers
    loss = (y * y).mean()
    loss.backward()
    assert torch.equal(loss, want) and torch.equal(x.grad, want_x)
    for name, grad in _param_grads(blocks).items():
        assert torch.equal(grad, want_grads[name]), name


class Tail(torch.nn.Module):
    """y = x + last(tanh(first(x))) [* w]: ``last``'s output may go unread in a recompute when nothing
    after it saves (``scaled``: the product with w saves it); counts the calls of ``last``'s GEMM."""

    def __init__(self, h: int, scaled: bool = False) -> None:
        super().__init__()
        self.first, self.last = torch.nn.Linear(h, h), torch.nn.Linear(h, h)
        self.w = torch.nn.Parameter(torch.randn(h)) if scaled else None
        self.computed = 0
        self.output_bytes: list[int] = []  # the output's memory when its gradient arrives (recomputes)

    def forward(self, x):
        h = torch.tanh(self.first(x))
        if offload.output_may_go_unread():
            # what backward needs of `last`: its input (saved by a Function that skips the GEMM)
            y = _SkippedLinear.apply(h, self.last.weight, self.last.bias)
            offload.note_unread_output()
        else:
            self.computed += 1
            y = self.last(h)
        if self.w is not None:
            y = y * self.w
        out = x + y
        if out.requires_grad:
            out.register_hook(lambda g: self.output_bytes.append(out.untyped_storage().nbytes()))
        return out


class _SkippedLinear(torch.autograd.Function):
    """A linear layer's graph without its output's values (NaN, so that any read shows)."""

    @staticmethod
    def forward(ctx, h, w, b):
        ctx.save_for_backward(h, w)
        return h.new_full((*h.shape[:-1], w.shape[0]), float("nan"))

    @staticmethod
    def backward(ctx, dy):
        h, w = ctx.saved_tensors
        return dy @ w, dy.flatten(0, -2).t() @ h.flatten(0, -2), dy.flatten(0, -2).sum(0)


@pytest.mark.parametrize("how", ["recompute", "offload"])
def test_a_recompute_may_leave_the_last_output_unread(how):
    """The recompute of a checkpointed call skips an output nothing after it saves: the same gradients,
    the skipped work done once (the forward), not twice; the call's own output (made from the skipped
    one, read by nothing) gives its memory back before the backward."""
    check = offload.recompute_checkpoint if how == "recompute" else offload.offloaded_checkpoint
    torch.manual_seed(0)
    tail, x = Tail(8), torch.randn(3, 8, requires_grad=True)
    want = torch.autograd.grad((tail(x) ** 2).sum(), [x, *tail.parameters()])
    tail.computed = 0
    tail.output_bytes.clear()
    (check(tail, x, use_reentrant=False) ** 2).sum().backward()
    assert tail.computed == 1  # the forward only
    assert tail.output_bytes == [0]  # the recomputed output held no memory through the backward
    for got, exp in zip([x.grad, *(p.grad for p in tail.parameters())], want, strict=True):
        assert_numerics("grad", got, exp, exp, torch.float32)


def test_a_save_after_an_unread_output_recomputes_in_full_once_and_for_ever():
    """Something after the skipped output saves a tensor (here y * w saves y): the recompute runs again
    with every output computed (the gradients stay right), said once; later recomputes of that kind of
    call never skip."""
    torch.manual_seed(0)
    tail, x = Tail(8, scaled=True), torch.randn(3, 8, requires_grad=True)
    want = torch.autograd.grad((tail(x) ** 2).sum(), [x, *tail.parameters()])
    for step in range(2):
        tail.computed = 0
        x.grad = None
        tail.zero_grad(set_to_none=True)
        if step == 0:
            with pytest.warns(UserWarning, match="saves a tensor after an output it skipped"):
                (offload.recompute_checkpoint(tail, x) ** 2).sum().backward()
        else:
            (offload.recompute_checkpoint(tail, x) ** 2).sum().backward()
        assert tail.computed == 2  # the forward and one full recompute (the skipping one ran first)
        for got, exp in zip([x.grad, *(p.grad for p in tail.parameters())], want, strict=True):
            assert torch.isfinite(got).all()
            assert_numerics("grad", got, exp, exp, torch.float32)
    offload._OUTPUTS_READ.discard(Tail)


def test_outputs_are_read_outside_a_recompute():
    """Not in a recompute, under no_grad in one, nor in the forward of a checkpointed call nested in one
    (its output feeds the outer call's), nor under other saved-tensor hooks: every output is read."""
    assert not offload.output_may_go_unread()
    with pytest.raises(RuntimeError, match="outside a recompute"):
        offload.note_unread_output()
    seen = []

    def inner(x):
        seen.append(("inner", offload.output_may_go_unread()))
        return x * 2

    def outer(x):
        seen.append(("outer", offload.output_may_go_unread()))
        with torch.no_grad():
            seen.append(("no_grad", offload.output_may_go_unread()))
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            seen.append(("hooks", offload.output_may_go_unread()))
        return offload.recompute_checkpoint(inner, x.sin())

    x = torch.randn(4, requires_grad=True)
    offload.recompute_checkpoint(outer, x).sum().backward()
    assert ("outer", True) in seen and ("no_grad", True) not in seen and ("hooks", True) not in seen
    assert ("inner", True) in seen  # its own recompute (in the outer backward)
    forwards = [s for s in seen if s[0] == "inner"][:2]  # the first forward, then the outer recompute's
    assert forwards == [("inner", False), ("inner", False)]


def test_imports_torch_and_the_standard_library_only():
    """fuselm.offload is framework-agnostic: each of its imports is torch or the standard library (no
    relative import, no transformers; tests/test_api.py's "offload" rule names the forbidden ones)."""
    roots = set()
    for node in ast.walk(ast.parse(Path(offload.__file__).read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            roots.add("." if node.level else node.module.partition(".")[0])
    assert "torch" in roots and roots <= {"torch", *sys.stdlib_module_names}, roots


def test_importing_fuselm_does_not_import_offload():
    code = "import sys, fuselm; print('fuselm.offload' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_docstring_examples_run():
    result = doctest.testmod(offload, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 10 and result.failed == 0


# ---- GPU ----


@pytest.mark.gpu
def test_gpu_inputs_go_to_page_locked_buffers_of_their_size():
    """A CUDA input of 3 MiB + 4 bytes goes to a page-locked host buffer of buffer_bytes (3.25 MiB, where
    PyTorch's pinned allocator would take 4 MiB), comes back exact, and empty_host_cache frees it."""
    offload.empty_host_cache()
    before = offload.host_memory_stats()["pinned_bytes"]
    x = torch.randn((3 << 18) + 1, device="cuda", requires_grad=True)  # fp32: 3 MiB + 4 bytes
    seen = []

    def fn(t):
        seen.append(t.detach().clone())
        return t * 2.0

    y = offload.offloaded_checkpoint(fn, x, use_reentrant=False)
    ((buf, _, nbytes),) = offload._Stash._last().held
    assert buf.is_pinned() and buf.numel() == offload.buffer_bytes(nbytes) == (13 << 18)
    assert offload.host_memory_stats()["pinned_bytes"] - before == 13 << 18
    y.sum().backward()
    assert torch.equal(seen[0], seen[1]) and torch.equal(x.grad, torch.full_like(x, 2.0))
    offload.empty_host_cache()
    assert offload.host_memory_stats()["pinned_bytes"] == 0


@pytest.mark.gpu
def test_gpu_recompute_draws_the_forwards_dropout_masks():
    """On CUDA the device RNG state is replayed: the recompute's dropout masks are the forward's, and
    the gradient is the one of the forward's masks."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 256).cuda()
    masks = []

    def fn(x):
        y = torch.nn.functional.dropout(lin(x), 0.5)
        masks.append(y == 0)
        return y

    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    y = offload.offloaded_checkpoint(fn, x, use_reentrant=False)
    torch.randn(10, device="cuda")  # the RNG moves on between forward and backward
    y.sum().backward()
    assert len(masks) == 2 and torch.equal(masks[0], masks[1]) and masks[0].any()
    keep = (~masks[0]).float() * 2.0  # d(sum(dropout(W x + b)))/dx = (mask * 2) @ W
    reference = keep.double() @ lin.weight.double()
    assert_numerics("grad x", x.grad, keep @ lin.weight, reference, torch.float32)


# ---- selective_checkpoint: only the outputs marked remakeable are made again ----


def _selective_block(made: list):
    """tanh(x) marked remakeable and read by three products (each saves it), a weight per product."""
    ws = [torch.randn(6, 5, dtype=torch.float64, requires_grad=True) for _ in range(3)]

    def block(x):
        def remake():
            made.append(torch.is_grad_enabled())
            return torch.tanh(x)

        n = offload.remakeable(torch.tanh(x), remake)
        rows = n.view(-1, 6)  # a view of it is saved as well
        return sum((rows @ w).sin().sum() for w in ws)

    return block, ws


def test_selective_checkpoint_makes_marked_outputs_again_once_with_the_same_gradients():
    made: list = []
    block, ws = _selective_block(made)
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    want = torch.autograd.grad(block(x), (x, *ws))
    assert made == []  # outside selective_checkpoint: marked for nothing
    out = offload.selective_checkpoint(block, x)
    assert made == []
    got = torch.autograd.grad(out, (x, *ws))
    assert made == [False]  # once, under no_grad, for three saves of it and tanh's own
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_selective_checkpoint_frees_the_marked_output_after_forward():
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 6, dtype=torch.float64, requires_grad=True)
    refs = []

    def block(x):
        n = offload.remakeable(x * 2, lambda: x * 2)
        refs.append(weakref.ref(n))
        return (n @ w).sum()

    kept = block(x)
    assert refs[-1]() is not None  # saved by the matmul: held until backward
    out = offload.selective_checkpoint(block, x)
    gc.collect()
    assert refs[-1]() is None  # only its recipe is held
    out.backward()
    kept.backward()
    assert torch.equal(w.grad, 2 * (2 * x).T @ torch.ones(4, 6, dtype=torch.float64))


def test_selective_checkpoint_raises_for_a_saved_tensor_changed_in_place():
    w = torch.randn(6, 6, requires_grad=True)
    x = torch.randn(4, 6, requires_grad=True)
    out = offload.selective_checkpoint(lambda x: (x.exp() @ w).sum(), x)
    with torch.no_grad():
        w.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an in-place operation"):
        out.backward()


def test_selective_checkpoint_is_the_plain_call_inside_other_hooks_and_without_grad():
    made: list = []
    block, ws = _selective_block(made)
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    out = torch_checkpoint.checkpoint(
        lambda x: offload.selective_checkpoint(block, x), x, use_reentrant=False
    )  # the checkpoint's hooks are on: nothing marked (its recompute must see every save)
    torch.autograd.grad(out, (x, *ws))
    assert made == []
    with torch.no_grad():
        offload.selective_checkpoint(block, x)
    assert made == []
    with pytest.raises(ValueError, match="use_reentrant"):
        offload.selective_checkpoint(block, x, use_reentrant="yes")


def test_selective_checkpoint_saves_a_marked_output_changed_in_place_as_it_is():
    made: list = []
    w = torch.randn(6, 6, dtype=torch.float64, requires_grad=True)

    def block(x):
        n = offload.remakeable(torch.tanh(x), lambda: made.append(1) or torch.tanh(x))
        with torch.no_grad():
            n.mul_(3.0)  # no longer what the recipe makes
        return (n @ w).sum()

    x = torch.randn(4, 6, dtype=torch.float64)
    offload.selective_checkpoint(block, x).backward()
    assert made == [] and torch.allclose(w.grad, 3 * torch.tanh(x).T @ torch.ones(4, 6, dtype=torch.float64))


class _Token:
    """A value a call keeps in its memo (weakly referenceable: the test sees when the memo lets it go)."""


@pytest.mark.parametrize("checkpoint", [offload.offloaded_checkpoint, offload.recompute_checkpoint])
def test_a_call_memo_is_shared_by_its_forward_and_recompute_then_freed(checkpoint):
    memos, made = [], []

    def f(x):
        memo = offload.call_memo()
        memos.append(memo)
        if "token" not in memo:
            memo["token"] = _Token()
            made.append(weakref.ref(memo["token"]))
        return x * 2

    assert offload.call_memo() is None
    x = torch.randn(3, requires_grad=True)
    y = checkpoint(f, x)
    assert offload.call_memo() is None  # only inside the call
    y.sum().backward()
    assert len(memos) == 2 and memos[0] is memos[1] and len(made) == 1  # the recompute found it
    memos.clear()
    del y
    gc.collect()
    assert made[0]() is None  # freed with the backward
    assert torch.equal(x.grad, torch.full((3,), 2.0))
    checkpoint(f, torch.randn(3, requires_grad=True))  # another call: a memo of its own
    assert len(made) == 2


# ---- outputs kept for the recompute ----


def _kept_or_made(made: list, key: str, make):
    """``make()`` unless the recompute finds it kept; made counts the calls of make; keeps what it made."""
    y = offload.kept_output(key)
    if y is None:
        made.append(key)
        y = make()
        offload.keep_output(key, y)
    return y


class _Product(torch.autograd.Function):
    """x @ w whose backward needs x and w only: its output may be kept for the recompute."""

    @staticmethod
    def forward(ctx, x, w, made):
        ctx.save_for_backward(x, w)
        return _kept_or_made(made, "xw", lambda: x @ w)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        return dy @ w.t(), x.t() @ dy, None


def test_an_output_kept_in_the_forward_is_the_recomputes_and_is_made_once():
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    made = []

    def f(x):
        return torch.tanh(_Product.apply(x, w, made)) * x  # x @ w is as large as x: within the share

    x = torch.randn(4, 8, requires_grad=True)
    torch.tanh(x @ w).mul(x).sum().backward()
    want = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    before = _in_use()
    y = offload.offloaded_checkpoint(f, x)
    assert _in_use() - before == 2 * x.numel() * x.element_size()  # the input and the kept output
    y.sum().backward()
    assert made == ["xw"]  # the recompute took the forward's
    assert torch.equal(x.grad, want[0]) and torch.equal(w.grad, want[1])
    del y
    gc.collect()
    assert _in_use() == before and offload._KEPT.in_use == 0


def test_outputs_beyond_the_calls_share_or_the_room_are_made_again():
    """An output larger than the call's share (kept_per_input, default KEPT_PER_INPUT) or than the room is
    made again in the recompute; within a larger share it is kept; with a share of 0 nothing is."""
    made = []
    x = torch.randn(4, 8, requires_grad=True)
    big = int(offload.KEPT_PER_INPUT) + 1

    def f(x):
        return _kept_or_made(made, "wide", lambda: x.repeat(1, big)).sum(1)  # more than the share

    offload.offloaded_checkpoint(f, x).sum().backward()
    assert made == ["wide", "wide"]
    made.clear()
    offload.offloaded_checkpoint(f, x, kept_per_input=big).sum().backward()
    assert made == ["wide"]  # kept: the recompute took the forward's
    made.clear()
    offload.offloaded_checkpoint(
        lambda x: _kept_or_made(made, "h", lambda: x * 2), x, kept_per_input=0
    ).sum().backward()
    assert made == ["h", "h"]
    made.clear()
    try:
        offload.set_kept_output_room(0)

        def g(x):
            return _kept_or_made(made, "h", lambda: x * 2)

        offload.offloaded_checkpoint(g, x).sum().backward()
        assert made == ["h", "h"]
    finally:
        offload.set_kept_output_room(None)


def test_outputs_are_kept_in_offloaded_forwards_only():
    made = []
    x = torch.randn(4, 8, requires_grad=True)

    def f(x):
        return _kept_or_made(made, "h", lambda: x * 2)

    offload.recompute_checkpoint(f, x).sum().backward()  # its inputs stay on the device: so do its outputs
    assert made == ["h", "h"]
    offload.keep_output("h", x)  # outside a checkpointed call
    assert offload.kept_output("h") is None and offload._KEPT.in_use == 0


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_kept_output_room_must_be_none_or_a_count_of_bytes(bad):
    with pytest.raises(ValueError, match="nbytes"):
        offload.set_kept_output_room(bad)


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), True, "1"])
def test_kept_per_input_must_be_a_finite_number_at_least_zero(bad):
    with pytest.raises(
        ValueError, match="^offloaded_checkpoint: kept_per_input must be None or a finite number >= 0"
    ):
        offload.offloaded_checkpoint(torch.tanh, torch.ones(2, requires_grad=True), kept_per_input=bad)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", None])
def test_prefetch_must_be_an_int_at_least_one(bad):
    with pytest.raises(ValueError, match="^offloaded_checkpoint: prefetch must be an int >= 1"):
        offload.offloaded_checkpoint(torch.tanh, torch.ones(2, requires_grad=True), prefetch=bad)
    with pytest.raises(ValueError, match="prefetch must be an int >= 1"):
        offload.checkpoint_fn(prefetch=bad)


@pytest.mark.parametrize("prefetch", [1, 2, 5])
def test_prefetch_brings_back_that_many_earlier_calls(prefetch):
    """The backward of an offloaded call brings back the inputs of the `prefetch` offloaded calls made
    before it (their host buffers go back to the pool then): when the last of four calls recomputes, its
    own input and min(prefetch, 3) others are off the host; the gradients are those of plain autograd."""
    in_use = []

    def block(x):
        in_use.append(offload.host_memory_stats()["in_use_bytes"])
        return torch.tanh(x) * 2

    x0 = torch.randn(2, 7, 16, dtype=torch.float64, requires_grad=True)
    base = offload.host_memory_stats()["in_use_bytes"]
    x = x0
    for _ in range(4):
        x = offload.offloaded_checkpoint(block, x, prefetch=prefetch)
    each = (offload.host_memory_stats()["in_use_bytes"] - base) // 4
    x.sum().backward()
    assert each > 0 and in_use[4] == base + (4 - 1 - min(prefetch, 3)) * each  # the 4th call's recompute
    ref = x0.detach().clone().requires_grad_()
    y = ref
    for _ in range(4):
        y = torch.tanh(y) * 2
    y.sum().backward()
    assert torch.equal(x0.grad, ref.grad)
    assert offload.host_memory_stats()["in_use_bytes"] == base


def test_the_newest_calls_backward_takes_its_tensors_from_the_device():
    """The newest offloaded call's tensors stay on their device too until the next call starts: the last
    call's recompute (the backward's first) runs on its very input, an earlier call's on the copy that came
    back; the gradients are plain autograd's."""
    seen = []

    def block(x):
        seen.append(x)
        return torch.tanh(x) * 2

    x0 = torch.randn(2, 7, 16, dtype=torch.float64, requires_grad=True)
    y1 = offload.offloaded_checkpoint(block, x0)
    y2 = offload.offloaded_checkpoint(block, y1)
    newest = offload._Stash._last()
    assert newest.on_device is not None and newest.previous().on_device is None
    y2.sum().backward()
    assert seen[2].data_ptr() == y1.data_ptr()  # the 2nd call's recompute: its input itself
    assert seen[3].data_ptr() != x0.data_ptr() and torch.equal(seen[3], x0)  # the 1st's: a copy
    ref = x0.detach().clone().requires_grad_()
    (torch.tanh(torch.tanh(ref) * 2) * 2).sum().backward()
    assert torch.equal(x0.grad, ref.grad)


def test_an_input_written_after_the_forward_comes_back_from_its_host_copy():
    """An input of the newest call written in place after the forward is not read on the device: the
    recompute gets the forward's values (its host copy), and so do the gradients."""
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, 16, dtype=torch.float64)
    want = torch.autograd.grad(torch.tanh(x * w).sum(), w)[0]
    y = offload.offloaded_checkpoint(lambda t: torch.tanh(t * w), x)
    x.add_(1.0)
    y.sum().backward()
    assert torch.equal(w.grad, want)


def test_a_capture_scope_leaves_no_copy_waiting_and_gives_its_buffers_back():
    """captured_host_buffers: the buffers taken for captured copies inside the scope are its list's (not the
    pool's free ones) until give_back_host_buffers returns them; copies a failed capture left waiting to
    be joined are dropped when the scope ends (a later capture must not wait on them)."""
    offload.empty_host_cache()
    cpu = torch.device("cpu")
    with pytest.raises(RuntimeError, match="capture failed"):
        with offload.captured_host_buffers() as owned:
            buf, _, _ = offload._POOL.acquire(1024, cpu, captured=True)
            offload._UNJOINED.append([(None, torch.ones(1))])  # a copy out that nothing joined
            raise RuntimeError("capture failed")
    assert offload._UNJOINED == []
    free = {id(entry[2]) for bucket in offload._POOL.free.values() for entry in bucket}
    assert [id(entry[2]) for _, entry in owned] == [id(buf)] and id(buf) not in free
    offload.give_back_host_buffers(owned)
    assert owned == [] and id(buf) in {id(e[2]) for bucket in offload._POOL.free.values() for e in bucket}
