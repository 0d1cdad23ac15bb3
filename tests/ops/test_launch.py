"""ops/_common/launch.py: the host-side helpers every launcher calls."""

from __future__ import annotations

import warnings

import pytest
import torch
import triton
import triton.language as tl

from fuselm.ops._common import launch
from fuselm.ops._common.dispatch import interpret_mode
from fuselm.ops._common.launch import launch_counts, launcher, next_pow2, row_launch


def test_next_pow2_matches_triton():
    for n in [*range(0, 70), 127, 128, 129, 4095, 4096, 4097, 32000, 128256, 2**31 - 1, 2**31, 2**31 + 1]:
        assert next_pow2(n) == triton.next_power_of_2(max(n, 1)), n
    assert next_pow2(-5) == 1


def test_row_launch_blocks_and_warps():
    """The next power of two of the row, capped (256 under the interpreter), and warps that grow with it."""
    cap = 256 if interpret_mode() else 4096
    block, warps = row_launch(3000, max_block=4096)
    assert block == min(4096, cap) and 4 <= warps <= 32
    assert row_launch(3000, max_block=4096) == (block, warps)  # cached: the same answer again
    assert row_launch(1) == (1, 4)


# ---- the cached launch binding ----


@triton.jit
def _toy_kernel(x_ptr, out_ptr, n, scale, flag, BLOCK: tl.constexpr, MODE: tl.constexpr = 0):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    if MODE == 1:
        x = x * scale
    tl.store(out_ptr + offs, x, mask=mask)


def _toy_args(**over):
    x = over.pop("x", torch.zeros(64))
    args = dict(x_ptr=x, out_ptr=torch.zeros(64), n=64, scale=0.5, flag=None, BLOCK=16, MODE=0)
    args.update(over)
    return args


_TOY = launcher(_toy_kernel)
_TOY.key(**_toy_args())  # the first call fixes the kinds of the parameters (tensor, int, float, other)


def _key(**over):
    return _TOY.key(**_toy_args(**over))


def test_key_is_the_same_for_the_same_specialization():
    """Other tensors of the same dtype and alignment, ints of the same kind, other float values and the
    same options: one key (one cached binding)."""
    base = _key(num_warps=4)
    same = _key(x=torch.ones(128), n=48, scale=3.0, num_warps=4)  # 48 and 64: both multiples of 16
    assert same == base
    assert hash(same) == hash(base)


@pytest.mark.parametrize(
    "change",
    [
        dict(x=torch.zeros(64, dtype=torch.float16)),  # dtype
        dict(x=torch.zeros(65)[1:]),  # data pointer not 16-byte aligned
        dict(n=1),  # Triton specializes 1 as a constant
        dict(n=17),  # not divisible by 16
        dict(n=2**31),  # int64 instead of int32
        dict(n=2**64 - 16),  # uint64
        dict(n=64.0),  # a float where an int was
        dict(scale=1),  # an int where a float was
        dict(scale=True),  # a bool where a float was
        dict(flag=False),  # None -> bool
        dict(BLOCK=32),  # a constexpr
        dict(MODE=1),  # a constexpr with a default
        dict(num_warps=8),  # an option
        dict(num_warps=4, num_stages=2),  # another option
    ],
    ids=lambda d: "-".join(d),
)
def test_key_changes_with_every_specialization(change):
    """Everything Triton specializes on (dtypes, 16-byte alignment of pointers, ints equal to 1, divisible by
    16, their integer type, constexprs, options) changes the key."""
    assert _key(**{"num_warps": 4, **change}) != _key(num_warps=4)


def test_key_of_ints_follows_triton():
    """An int's key holds exactly what Triton 3.x looks at: == 1, % 16 == 0, and its type by range."""
    assert _key(n=16) == _key(n=2**20)
    assert _key(n=3) == _key(n=5)
    assert _key(n=-16) == _key(n=32)
    assert _key(n=2**31 - 16) == _key(n=16)
    assert _key(n=2**31) != _key(n=2**31 - 16)
    assert _key(n=2**40) == _key(n=2**36)
    assert _key(n=True) != _key(n=1)  # a bool is u1, an int 1 a constant


def test_key_refuses_arguments_it_cannot_describe():
    with pytest.raises(launch._Unkeyed):
        _key(flag=(1, 2))


class _Compiled:
    """What kernel[grid](...) returns in Triton 3.x, as far as the launcher reads it."""

    def __init__(self, calls):
        self.function, self.packed_metadata, self.calls = "function-handle", "packed-metadata", calls

    def run(self, *args):
        self.calls.append(("direct", args))


class _FakeKernel:
    """A JITFunction stand-in: the toy kernel's signature, launches recorded instead of run."""

    def __init__(self):
        self.fn, self.params, self.pre_run_hooks, self.calls = _toy_kernel.fn, None, [], []

    def __getitem__(self, grid):
        def run(**kwargs):
            self.calls.append(("triton", grid, kwargs))
            return _Compiled(self.calls)

        return run


@pytest.fixture
def direct_mode(monkeypatch):
    """The direct call on, as on a GPU with a checked Triton version (device 3, stream 77)."""
    monkeypatch.setattr(launch, "_MODE", [(True, lambda: False, lambda: 3, lambda device: 77 + device)])
    yield
    launch.set_direct_launch(None)


def test_second_launch_calls_the_compiled_kernel_directly(direct_mode):
    """The first launch of a specialization goes through Triton and keeps what it returns; the next one
    calls the compiled kernel's launcher with Triton's arguments: the grid padded to 3 dims, the stream,
    the function handle, the packed metadata, no launch metadata nor hooks, then every argument in the
    kernel's order (constexprs and defaults included, options left out), tensors as their data pointers."""
    fake = _FakeKernel()
    launch_fn = launcher(fake)
    before = launch_counts()
    args = _toy_args()
    args.pop("MODE")  # the default
    first = launch_fn((4,), num_warps=2, **args)
    assert [c[0] for c in fake.calls] == ["triton"]
    assert fake.calls[0][2]["num_warps"] == 2
    x2, out2 = torch.ones(64), torch.ones(64)
    again = launch_fn((5, 2), **dict(args, x_ptr=x2, out_ptr=out2, n=32, scale=2.0), num_warps=2)
    assert again is first
    kind, direct_args = fake.calls[1]
    assert kind == "direct"
    assert direct_args[:9] == (5, 2, 1, 80, "function-handle", "packed-metadata", None, None, None)
    assert direct_args[9:] == (x2.data_ptr(), out2.data_ptr(), 32, 2.0, None, 16, 0)
    assert launch_counts() == (before[0] + 1, before[1] + 1)
    # another specialization (fp16 input): Triton again, then direct
    half = dict(args, x_ptr=torch.zeros(64, dtype=torch.float16))
    launch_fn((4,), num_warps=2, **half)
    launch_fn((4,), num_warps=2, **half)
    assert [c[0] for c in fake.calls] == ["triton", "direct", "triton", "direct"]
    assert len(launch_fn.cache) == 2


def test_a_host_tensor_never_takes_a_binding_made_for_cuda_tensors(direct_mode):
    """The direct call passes data pointers without Triton's check that they are device memory: a CPU
    tensor where CUDA tensors were launched has another key, so it takes Triton's path (which refuses it)."""
    fake = _FakeKernel()
    launch_fn = launcher(fake)
    on_cpu = _toy_args()
    launch_fn.key(**on_cpu)
    key = launch_fn.key(**on_cpu)
    assert (torch.float32, True, False) == key[:3]  # x_ptr: dtype, 16-byte aligned, not CUDA
    if torch.cuda.is_available():
        on_gpu = dict(on_cpu, x_ptr=on_cpu["x_ptr"].cuda(), out_ptr=on_cpu["out_ptr"].cuda())
        assert launch_fn.key(**on_gpu) != key


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_host_tensor_after_cached_cuda_launches_raises_instead_of_faulting():
    launch.set_direct_launch(None)
    launch_fn = launcher(_toy_kernel)
    x, out = torch.randn(64, device="cuda"), torch.empty(64, device="cuda")
    for _ in range(2):
        launch_fn((4,), x_ptr=x, out_ptr=out, n=64, scale=2.0, flag=None, BLOCK=16, MODE=1)
    assert torch.equal(out, x * 2.0)
    with pytest.raises(ValueError, match="cpu tensor"):
        launch_fn((4,), x_ptr=x.cpu(), out_ptr=out, n=64, scale=2.0, flag=None, BLOCK=16, MODE=1)
    launch_fn((4,), x_ptr=x * 3, out_ptr=out, n=64, scale=1.0, flag=None, BLOCK=16, MODE=1)
    assert torch.equal(out, x * 3)  # the context is intact


def test_what_the_key_cannot_describe_goes_through_triton(direct_mode):
    fake = _FakeKernel()
    launch_fn = launcher(fake)
    for _ in range(2):
        launch_fn((1,), **_toy_args(flag=(1, 2)))
    assert [c[0] for c in fake.calls] == ["triton", "triton"]
    assert launch_fn.cache == {}


def test_hooks_and_tracing_take_tritons_path(direct_mode):
    """Triton launch hooks (a profiler), a kernel's pre-run hooks, and torch.compile tracing: every launch
    through kernel[grid](...), the cache kept for later."""
    fake = _FakeKernel()
    launch_fn = launcher(fake)
    launch_fn((1,), **_toy_args())  # resolves the mode and caches
    ns = launch_fn.__globals__
    ns["_hooks"] = lambda: True
    launch_fn((1,), **_toy_args())
    ns["_hooks"] = lambda: False
    fake.pre_run_hooks.append(lambda *a, **k: None)
    launch_fn((1,), **_toy_args())
    fake.pre_run_hooks.clear()
    ns["_compiling"] = lambda: True
    launch_fn((1,), **_toy_args())
    ns["_compiling"] = torch.compiler.is_compiling
    launch_fn((1,), **_toy_args())
    assert [c[0] for c in fake.calls] == ["triton"] * 4 + ["direct"]


def test_direct_launch_can_be_turned_off(direct_mode):
    fake = _FakeKernel()
    launch_fn = launcher(fake)
    launch_fn((1,), **_toy_args())
    launch.set_direct_launch(False)
    launch_fn((1,), **_toy_args())
    launch_fn((1,), **_toy_args())
    assert [c[0] for c in fake.calls] == ["triton"] * 3


def test_an_unexpected_compiled_kernel_turns_the_direct_call_off(direct_mode):
    """If kernel[grid](...) returns something without run / function / packed_metadata (another Triton),
    the launchers warn once and stay on Triton's path."""

    class Odd(_FakeKernel):
        def __getitem__(self, grid):
            def run(**kwargs):
                self.calls.append(("triton", grid, kwargs))
                return object()

            return run

    fake = Odd()
    launch_fn = launcher(fake)
    monkey_warned = launch._WARNED[:]
    launch._WARNED.clear()
    try:
        with pytest.warns(RuntimeWarning, match="fuselm.ops._common.launch"):
            launch_fn((1,), **_toy_args())
        launch_fn((1,), **_toy_args())
    finally:
        launch._WARNED[:] = monkey_warned
    assert [c[0] for c in fake.calls] == ["triton", "triton"]


@pytest.mark.skipif(not interpret_mode(), reason="the interpreter's path (TRITON_INTERPRET=1)")
def test_interpreter_launches_through_triton_without_a_warning():
    """Under TRITON_INTERPRET=1 every launch is kernel[grid](...) (no compiled kernel to call), silently."""
    launch.set_direct_launch(None)
    launch_fn = launcher(_toy_kernel)
    x, out = torch.randn(64), torch.empty(64)
    before = launch_counts()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            launch_fn((4,), x_ptr=x, out_ptr=out, n=64, scale=2.0, flag=None, BLOCK=16, MODE=1)
    assert torch.equal(out, x * 2.0)
    assert launch_counts() == (before[0], before[1] + 2)
