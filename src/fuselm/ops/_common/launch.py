"""How fuselm launches its Triton kernels: the cached launch binding every launcher goes through
(:func:`launcher`), and the launch heuristics of the row-wise kernels (the block of a one-row program,
persistent grids).

The cached launch binding
-------------------------
``kernel[grid](**kwargs)`` costs ~15 us of host time per call in Triton 3.x: it binds the arguments,
computes their specialization (dtypes, alignment and divisibility of every argument), hashes the options,
looks the compiled kernel up, builds its launch metadata and finally calls the compiled kernel's launcher
(~5 us). ``launcher(kernel)`` returns a function with the calling convention of ``kernel[grid](**kwargs)``
(``launch(grid, **kwargs)``) that does the first launch of each specialization through Triton and keeps
the compiled kernel; later launches of that specialization are one dictionary lookup, keyed by a superset
of what Triton specializes on, and a direct call of the compiled kernel's launcher. The key holds, per
argument in the kernel's order:

- a tensor: its dtype, whether its data pointer is 16-byte aligned and whether it is a CUDA tensor;
- an int: whether it is 1 and whether it is divisible by 16 (Triton specializes both), and its integer
  type by range (i32 / i64 / u64);
- a float: only that it is a float (Triton passes floats as fp32 without specializing them); a bool or
  None: its value;
- a constexpr: its value;

then the options (``num_warps``, ``num_stages``, ``enable_fp_fusion``, ...) and the current CUDA device.
The direct call passes each tensor as its data pointer (an int, read once for the key and the call):
Triton's launcher then skips what it does per tensor argument (a Python method call and a driver query,
cuPointerGetAttribute, which refuses host memory); a tensor that is not on a CUDA device has another key
and takes Triton's path, which raises as before.
The fast form of the key assumes that each parameter keeps the kind (tensor, int, float) it had at the
first launch: a scalar of another kind is keyed by its kind and value as above (a slower form, the same
information); a non-tensor where a tensor was, or an argument of any other type, makes the call take
Triton's own path (uncached, still correct).

The direct call runs where it was checked against Triton's source (3.4 to 3.9, CUDA): under
``TRITON_INTERPRET=1`` (the interpreter has no compiled kernels), on ROCm, on another Triton version
(with a one-time warning), while Triton launch hooks or pre-run hooks are installed (a profiler such as
proton), while torch.compile traces (dynamo understands ``kernel[grid](...)``), and with
``FUSELM_DIRECT_LAUNCH=0`` in the environment, every launch is ``kernel[grid](**kwargs)``.
Not covered by the key: Triton's debug and instrumentation knobs and the kernel's global variables,
which Triton checks per launch: change them before the first launch of a process, not between launches.
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings

import torch

from .dispatch import interpret_mode


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1); triton.next_power_of_2 on the host without its
    per-call cost (a few microseconds in Triton 3.9, where it is a constexpr function)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints; triton.cdiv on the host without its per-call cost (a jit-wrapped function in
    Triton 3.9: ~10 us a call)."""
    return -(-a // b)


@functools.lru_cache(maxsize=256)  # host time: called per launch
def row_launch(n_cols: int, max_block: int = 32768) -> tuple[int, int]:
    """Block size and warp count for a kernel that walks one row of `n_cols` elements.

    BLOCK is the next power of two of n_cols, capped at `max_block` (then the kernel loops);
    warps grow with the block so that each thread holds a few dozen values at most.
    Under the interpreter the block stays small: it is numpy, and huge blocks only cost time.
    """
    block = next_pow2(n_cols)
    if interpret_mode():
        max_block = min(max_block, 256)
    block = min(block, max_block)
    num_warps = min(32, max(4, block // 1024))
    return block, num_warps


@functools.lru_cache(maxsize=8)
def _sm_limits(index: int) -> tuple[int, int, int, int]:
    """(multiprocessors, registers, threads, shared memory bytes) per multiprocessor."""
    p = torch.cuda.get_device_properties(index)
    return (
        p.multi_processor_count,
        getattr(p, "regs_per_multiprocessor", 65536),
        getattr(p, "max_threads_per_multi_processor", 2048),
        getattr(p, "shared_memory_per_multiprocessor", 228 * 1024),
    )


def persistent_grid(n_items: int, device, programs_per_sm: int) -> int:
    """Programs of a persistent kernel over `n_items` rows: a few per multiprocessor, at most one a row."""
    if device.type != "cuda":
        return max(n_items, 1)
    return max(1, min(n_items, _sm_limits(device.index or 0)[0] * programs_per_sm))


_OCCUPANCY: dict[tuple, int] = {}


def _occupancy_key(kwargs: dict) -> tuple:
    """What decides a compiled variant's registers: tensor dtypes, the constexprs (UPPER_CASE names)
    and num_warps. The launch builds kwargs in a fixed order, so no sorting. Integer and alignment
    specializations are left out: they change the registers little, and a wrong guess costs time only."""
    return tuple(
        v.dtype if isinstance(v, torch.Tensor) else v
        for k, v in kwargs.items()
        if k[0].isupper() or k == "num_warps" or isinstance(v, torch.Tensor)
    )


def resident_programs(
    kernel,
    kwargs: dict,
    n_items: int,
    device: torch.device,
    per_sm: int,
    max_per_sm: int = 8,
    fallback_per_sm: int = 2,
    variant: tuple | None = None,
) -> int:
    """Programs of a persistent `kernel` (launched with `kwargs`) over n_items row blocks: per_sm per
    multiprocessor if per_sm > 0, else as many as are resident at once (one wave), from the compiled
    kernel's register and shared memory use, at most max_per_sm per multiprocessor (fallback_per_sm
    when this Triton cannot say). The occupancy is computed once per kernel variant and device;
    `variant` (what decides the variant's registers: dtypes, constexprs, num_warps), when the caller
    gives it, saves reading it from kwargs (host time)."""
    if device.type != "cuda":
        return max(n_items, 1)
    if per_sm <= 0:
        key = (kernel, device.index, max_per_sm, _occupancy_key(kwargs) if variant is None else variant)
        per_sm = _OCCUPANCY.get(key, 0)
        if not per_sm:
            try:
                compiled = kernel.warmup(grid=(1,), **kwargs)
                compiled._init_handles()
                _, regs, threads, smem = _sm_limits(device.index or 0)
                threads_per_program = 32 * kwargs["num_warps"]
                regs_per_thread = -(-max(1, compiled.n_regs) // 8) * 8  # allocated 256 per warp
                per_sm = min(
                    regs // (regs_per_thread * threads_per_program),
                    threads // threads_per_program,
                    smem // max(1, compiled.metadata.shared),
                )
                per_sm = max(1, min(per_sm, max_per_sm))
            except Exception:  # noqa: BLE001 - an older or newer Triton: use the fixed count
                per_sm = fallback_per_sm
            _OCCUPANCY[key] = per_sm
    return persistent_grid(n_items, device, per_sm)


# ---- the cached launch binding ----

# Triton versions (major, minor) whose launch path was read from source: JITFunction.run calls
# kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata,
# launch_enter_hook, launch_exit_hook, *every argument in the kernel's order) on the compiled kernel.
DIRECT_TRITON_VERSIONS = ((3, 4), (3, 9))

_COUNTS = [0, 0]  # launches through the cached binding, launches through kernel[grid](...)
_LAUNCHERS: list = []  # every launcher made, for set_direct_launch
_MODE: list = []  # [_resolve_mode()'s answer] once resolved
_FORCED: list = []  # set_direct_launch's override


def launch_counts() -> tuple[int, int]:
    """(launches through the cached binding, launches through ``kernel[grid](...)``) so far, over every
    launcher of the process: tests and benchmarks read the difference across a call."""
    return _COUNTS[0], _COUNTS[1]


def set_direct_launch(enabled: bool | None) -> None:
    """Turn the direct call of cached compiled kernels off (False: every launch through Triton's
    ``kernel[grid](...)``), back on where it is supported (True), or back to the default (None: on unless
    ``FUSELM_DIRECT_LAUNCH=0``). For benchmarks that compare the two paths, and for tests."""
    _FORCED[:] = [] if enabled is None else [bool(enabled)]
    _MODE[:] = []
    for ns in _LAUNCHERS:
        ns["_DIRECT"] = False
        ns["_RESOLVED"] = False


def _warn_once(reason: str) -> None:
    if not _WARNED:
        _WARNED.append(reason)
        warnings.warn(
            f"fuselm.ops._common.launch: every Triton launch goes through kernel[grid](...) (about 10 us "
            f"more host time per launch than the cached binding): {reason}",
            RuntimeWarning,
            stacklevel=4,
        )


_WARNED: list = []


def _triton_version() -> tuple[int, int] | None:
    import triton

    try:
        major, minor = (int(p) for p in triton.__version__.split(".")[:2])
    except ValueError:
        return None
    return major, minor


def _resolve_mode():
    """(may launches call the compiled kernel directly?, a function that says whether Triton launch hooks
    are installed, the current CUDA device's index, the raw current stream of a device), decided once per
    process."""
    if _MODE:
        return _MODE[0]
    direct, hooks, device, stream = False, _always, None, None
    if _FORCED and not _FORCED[0]:
        pass
    elif not _FORCED and os.environ.get("FUSELM_DIRECT_LAUNCH", "1") == "0":
        pass
    elif interpret_mode() or not torch.cuda.is_available():
        pass  # the interpreter (expected: no compiled kernels), or nothing to launch on
    elif torch.version.hip is not None:
        _warn_once("the direct call is not checked on ROCm")
    elif not (hasattr(torch._C, "_cuda_getDevice") and hasattr(torch._C, "_cuda_getCurrentRawStream")):
        _warn_once("this torch has no torch._C._cuda_getDevice / _cuda_getCurrentRawStream")
    else:
        import triton

        version = _triton_version()
        lo, hi = DIRECT_TRITON_VERSIONS
        if version is None or not lo <= version <= hi:
            _warn_once(
                f"Triton {triton.__version__} is not among the versions whose launch path was checked "
                f"({lo[0]}.{lo[1]} to {hi[0]}.{hi[1]})"
            )
        else:
            direct = True
            hooks = _hooks_test(version)
            device, stream = torch._C._cuda_getDevice, torch._C._cuda_getCurrentRawStream
    _MODE[:] = [(direct, hooks, device, stream)]
    return _MODE[0]


def _always() -> bool:
    return True


def _hooks_test(version: tuple[int, int]):
    """A function that says whether Triton launch hooks (a profiler's) are installed: 3.4 keeps None or a
    function in knobs.runtime.launch_enter_hook / launch_exit_hook, 3.5+ HookChain objects with a list of
    calls."""
    from triton import knobs

    rt = knobs.runtime
    if version < (3, 5):
        return lambda: rt.launch_enter_hook is not None or rt.launch_exit_hook is not None
    return lambda: bool(rt.launch_enter_hook.calls or rt.launch_exit_hook.calls)


def constexpr_names(kernel) -> tuple[str, ...]:
    """The parameters of a @triton.jit kernel (or the interpreter's stand-in) annotated tl.constexpr."""
    params = getattr(kernel, "params", None)
    if params is not None and all(hasattr(p, "is_constexpr") for p in params):
        return tuple(p.name for p in params if p.is_constexpr)
    sig = inspect.signature(kernel.fn)
    return tuple(n for n, p in sig.parameters.items() if "constexpr" in str(p.annotation))


def _parameters(kernel) -> list[inspect.Parameter]:
    return list(inspect.signature(kernel.fn).parameters.values())


class _Unkeyed(Exception):
    """An argument of a kind the key does not describe: the launch goes through Triton."""


def _scalar_key(value):
    """Key of an argument whose kind differs from the one its parameter had at the first launch (or of any
    argument before it): ints by Triton's int specialization, floats by kind, bools and None by value,
    tensors by dtype and alignment; anything else is not described."""
    cls = value.__class__
    if cls is int:
        return ("i", value == 1, value & 15 == 0, -(2**31) <= value < 2**31, value < 2**63)
    if cls is float:
        return ("f",)
    if value is None or cls is bool:
        return cls, value
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() & 15 == 0
    raise _Unkeyed(type(value).__name__)


def _kind(value) -> str:
    """The kind of an argument at the first launch: "t" tensor, "i" int, "f" float, "o" anything else."""
    cls = value.__class__
    if isinstance(value, torch.Tensor):
        return "t"
    return "i" if cls is int else "f" if cls is float else "o"


def _key_elements(p: str, kind: str) -> str:
    """Python expression of the key of runtime argument `p` whose parameter had `kind` at the first launch:
    the fast forms below for that kind, _scalar_key for another kind (or AttributeError for a parameter
    that had a tensor: such a launch then goes through Triton). A tensor's key is its dtype, whether its
    data pointer is 16-byte aligned and whether it is a CUDA tensor (the pointer, kept in ``_fl_ptr_<p>``,
    is what the direct call passes); an int32 int's is -1 for 1, else whether it is divisible by 16
    (other ints: _scalar_key); a float's is True."""
    if kind == "t":
        return f"{p}.dtype, (_fl_ptr_{p} := {p}.data_ptr()) & 15 == 0, {p}.is_cuda"
    if kind == "i":
        return (
            f"(-1 if {p} == 1 else {p} & 15 == 0) "
            f"if {p}.__class__ is int and -2147483648 <= {p} <= 2147483647 else _scalar_key({p})"
        )
    if kind == "f":
        return f"True if {p}.__class__ is float else _scalar_key({p})"
    return f"_scalar_key({p})"


_TEMPLATE = """
def key({params}, **_fl_options):
    return ({key_elements}, *_fl_options.items())

def launch(_fl_grid, {params}, **_fl_options):
    _fl_key = None
    if _DIRECT:
        try:
            if not (_compiling() or _jit.pre_run_hooks or _hooks()):
                _fl_dev = _device()
                _fl_key = (_fl_dev, {key_elements}, *_fl_options.items())
        except Exception:
            _fl_key = None
        if _fl_key is not None:
            _fl_entry = _cache.get(_fl_key)
            if _fl_entry is not None:
                _fl_n = len(_fl_grid)
                _fl_entry[0](
                    _fl_grid[0],
                    _fl_grid[1] if _fl_n > 1 else 1,
                    _fl_grid[2] if _fl_n > 2 else 1,
                    _stream(_fl_dev),
                    _fl_entry[1],
                    _fl_entry[2],
                    None,
                    None,
                    None,
                    {args},
                )
                _counts[0] += 1
                return _fl_entry[3]
    return _first(_fl_key, _fl_grid, {{{kwargs}}}, _fl_options)
"""


def _first_launch(ns: dict, kernel):
    """The slow path of a launcher: Triton's own launch; the compiled kernel is kept for its key when the
    direct call is on (the first launch of each specialization, or a call the key could not describe)."""

    def first(key, grid, kwargs, options):
        if torch.compiler.is_compiling():
            return kernel[grid](**kwargs, **options)
        if not ns["_RESOLVED"]:
            direct, hooks, device, stream = _resolve_mode()
            if direct:
                ns["_device"], ns["_stream"], ns["_hooks"] = device, stream, hooks
            ns["_DIRECT"], ns["_RESOLVED"] = direct, True
        compiled = kernel[grid](**kwargs, **options)
        _COUNTS[1] += 1
        if ns["_DIRECT"]:
            if key is None:
                try:
                    key = (ns["_device"](), *ns["_public_key"](**kwargs, **options))
                except Exception:  # an argument the key cannot describe: no caching
                    key = None
            entry = _entry_of(compiled)
            if key is not None and entry is not None:
                ns["_cache"][key] = entry
        return compiled

    return first


def _entry_of(compiled):
    """(launcher, function handle, packed metadata, compiled kernel) of what kernel[grid](...) returned,
    or None (with a one-time warning and the direct call off) when it is not the compiled kernel this
    module knows."""
    try:
        return compiled.run, compiled.function, compiled.packed_metadata, compiled
    except AttributeError as exc:
        _MODE[:] = [(False, _always, None, None)]
        for ns in _LAUNCHERS:
            ns["_DIRECT"] = False
        _warn_once(
            "kernel[grid](...) did not return a compiled kernel with run, function and packed_metadata "
            f"({exc})"
        )
        return None


def _generate(ns: dict, kinds: dict | None) -> None:
    """(Re)generate the launcher's key and launch functions for parameters of these kinds (None: before the
    first launch, every argument through _scalar_key). The launch function object handed out stays the
    same: its code is replaced."""
    kernel = ns["_jit"]
    params = _parameters(kernel)
    names = [p.name for p in params]
    assert not any(n.startswith("_fl_") for n in names), "kernel parameters must not start with _fl_"
    constexprs = set(constexpr_names(kernel))
    signature = ", ".join(
        n if p.default is inspect.Parameter.empty else f"{n}=_default_{n}"
        for n, p in zip(names, params, strict=True)
    )
    for n, p in zip(names, params, strict=True):
        if p.default is not inspect.Parameter.empty:
            ns[f"_default_{n}"] = p.default
    elements = ", ".join(
        n if n in constexprs else _key_elements(n, kinds[n] if kinds else "o") for n in names
    )
    tensors = {n for n in names if n not in constexprs and kinds and kinds[n] == "t"}
    source = _TEMPLATE.format(
        params=signature,
        key_elements=elements,
        args=", ".join(f"_fl_ptr_{n}" if n in tensors else n for n in names),
        kwargs=", ".join(f"{n!r}: {n}" for n in names),
    )
    name = getattr(getattr(kernel, "fn", None), "__name__", "kernel")
    code = compile(source, f"<fuselm launcher of {name}>", "exec")
    exec(code, ns)  # noqa: S102 - generated from the kernel's signature
    ns["_kinds"] = kinds
    if "_launch_fn" in ns:  # callers hold the first function object
        ns["_launch_fn"].__code__ = ns["launch"].__code__


def _public_key(ns: dict):
    """launch.key(**kwargs): the key of a launch without the device; the first call (or launch) fixes the
    kinds of the parameters (tensor, int, float, other) that the fast forms of the key assume."""

    def key(**kwargs):
        if ns["_kinds"] is None:
            params = _parameters(ns["_jit"])
            values = {p.name: kwargs.get(p.name, p.default) for p in params}
            _generate(ns, {n: _kind(v) for n, v in values.items()})
        return ns["key"](**kwargs)

    return key


def launcher(kernel):
    """``launch(grid, **kwargs)``: launches `kernel` (a ``@triton.jit`` function) as
    ``kernel[grid](**kwargs)`` does and returns the compiled kernel, through a cached binding of the
    compiled kernel after the first launch of each specialization (the module docstring says what the
    key holds and where Triton's own path runs instead). ``launch.key(**kwargs)`` is the key without the
    device; ``launch.kernel`` the kernel.

    Example:
        >>> import triton, triton.language as tl
        >>> @triton.jit
        ... def fill_kernel(out_ptr, value, n, BLOCK: tl.constexpr):
        ...     offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ...     tl.store(out_ptr + offs, value, mask=offs < n)
        >>> fill = launcher(fill_kernel)
        >>> out = torch.empty(100, device="cuda")  # doctest: +SKIP
        >>> fill((triton.cdiv(100, 64),), out_ptr=out, value=1.5, n=100, BLOCK=64)  # doctest: +SKIP
    """
    ns: dict = {
        "_jit": kernel,
        "_cache": {},
        "_counts": _COUNTS,
        "_compiling": torch.compiler.is_compiling,
        "_scalar_key": _scalar_key,
        "_DIRECT": False,
        "_RESOLVED": False,
        "_device": None,
        "_stream": None,
        "_hooks": _always,
    }
    ns["_first"] = _first_launch(ns, kernel)
    ns["_public_key"] = _public_key(ns)
    _generate(ns, None)
    fn = ns["launch"]
    ns["_launch_fn"] = fn
    fn.key = ns["_public_key"]
    fn.kernel = kernel
    fn.cache = ns["_cache"]
    fn.__name__ = fn.__qualname__ = f"launch_{getattr(getattr(kernel, 'fn', None), '__name__', 'kernel')}"
    _LAUNCHERS.append(ns)
    return fn
