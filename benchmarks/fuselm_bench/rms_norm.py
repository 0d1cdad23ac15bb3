"""Op suite: RMSNorm (Llama casting) over the last dimension of ``[N, H]``, with and without the residual
add before it.

A shape is ``(N, H, S)``: x ``[N, H]`` and weight ``[H]`` (requiring grad); ``S = 2`` adds a residual
``[N, H]`` (requiring grad) first, ``s = x + residual``, and both ``rms_norm(s)`` and s are outputs (s is
the next block's residual). Bytes per element (``itemsize`` b): ``S = 1`` fwd 2b, bwd 3b, full 5b;
``S = 2`` fwd 4b, bwd 4b, full 8b (the suite's notes say which reads and writes).

``python -m fuselm_bench.rms_norm --tune`` sweeps the launch constants of ``ops/rms_norm/op.py`` on the
suite's GPU shapes (:func:`tune`).
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fuselm.ops.rms_norm import rms_norm

from .arguments import parse_shapes
from .harness import Cost, Inputs, Provider, Shape, SkipProvider, Suite, compiled_setup, import_peer

EPS = 1e-6


def split_shape(shape: Shape) -> tuple[int, int, int]:
    """(N, H, S) from a suite shape; ``(N, H)`` means S = 1 (no residual)."""
    if len(shape) == 2:
        return int(shape[0]), int(shape[1]), 1
    if len(shape) != 3 or shape[2] not in (1, 2):
        raise ValueError(
            f"an rms_norm shape is N x H x S with S 1 (x) or 2 (x + residual), got {tuple(shape)}"
        )
    return int(shape[0]), int(shape[1]), int(shape[2])


def make_inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> Inputs:
    """x ~ N(0, 1) ``[N, H]`` and weight ~ U[0.5, 1.5) ``[H]``, both requiring grad; with S = 2 also a
    residual ~ N(0, 1) ``[N, H]`` requiring grad."""
    n, h, summed = split_shape(shape)
    inputs = {
        "x": torch.randn(n, h, device=device, dtype=dtype).requires_grad_(True),
        "weight": (torch.rand(h, device=device) + 0.5).to(dtype).requires_grad_(True),
    }
    if summed == 2:
        inputs["residual"] = torch.randn(n, h, device=device, dtype=dtype).requires_grad_(True)
    return inputs


def cost(shape: Shape, mode: str, dtype: torch.dtype) -> Cost:
    """Bytes per call: see the module docstring (5 * itemsize per element for fwd + bwd, 8 with S = 2)."""
    n, h, summed = split_shape(shape)
    per_element = ({"fwd": 4, "bwd": 4, "full": 8} if summed == 2 else {"fwd": 2, "bwd": 3, "full": 5})[mode]
    return Cost(bytes=float(n * h * per_element * dtype.itemsize))


def hf_llama_rms_norm(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """LlamaRMSNorm.forward as Hugging Face writes it."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    return weight * hidden_states.to(input_dtype)


def _torch_fn(x: Inputs) -> Any:
    r = x.get("residual")
    if r is None:
        return hf_llama_rms_norm(x["x"], x["weight"])
    s = x["x"] + r
    return hf_llama_rms_norm(s, x["weight"]), s


def setup_liger(device: torch.device) -> Callable[[Inputs], Any]:
    """Liger-Kernel's RMSNorm (CUDA, importable liger_kernel); with S = 2 an eager add first."""
    function = import_peer(device, "liger_kernel.ops.rms_norm", "LigerRMSNormFunction")

    def run(x: Inputs) -> Any:
        r = x.get("residual")
        s = x["x"] if r is None else x["x"] + r
        y = function.apply(s, x["weight"], EPS, 0.0, "llama", False)
        return y if r is None else (y, s)

    return run


def _only(name: str, residual: bool, fn: Callable[[Inputs], Any]) -> Callable[[torch.device], Any]:
    """The setup of a provider of the S = 2 (``residual``) or the S = 1 shapes (skipped at the others)."""

    def run(x: Inputs) -> Any:
        if ("residual" in x) != residual:
            raise SkipProvider(f"{name} runs the S = {1 + int(residual)} shapes")
        return fn(x)

    return lambda device: run


def _add_then_fuselm(x: Inputs) -> Any:
    s = x["x"] + x["residual"]
    return rms_norm(s, x["weight"], EPS), s


setup_fuselm = _only("fuselm", False, lambda x: rms_norm(x["x"], x["weight"], EPS))
setup_fuselm_residual = _only(
    "fuselm_residual", True, lambda x: rms_norm(x["x"], x["weight"], EPS, residual=x["residual"])
)

SUITE = Suite(
    name="rms_norm",
    description="RMSNorm (Llama casting) over the last dim of [N, H]; S = 2 adds a residual first",
    shape_dims=("N", "H", "S"),
    gpu_shapes=((16384, 4096, 1), (32768, 8192, 1), (16384, 4096, 2), (32768, 8192, 2)),
    cpu_shapes=((256, 256, 1), (256, 256, 2)),
    providers=(
        Provider("torch", lambda device: _torch_fn, "Hugging Face LlamaRMSNorm code, eager"),
        Provider("torch_compile", compiled_setup(_torch_fn), "torch.compile of the eager function"),
        Provider("liger", setup_liger, "liger_kernel LigerRMSNormFunction (in_place=False)"),
        Provider("fuselm", setup_fuselm, "fuselm.rms_norm (S = 1)"),
        Provider("fuselm_residual", setup_fuselm_residual, "fuselm.rms_norm(..., residual=) (S = 2)"),
        Provider(
            "torch_add_then_fuselm",
            _only("torch_add_then_fuselm", True, _add_then_fuselm),
            "x + residual, then fuselm.rms_norm",
        ),
    ),
    make_inputs=make_inputs,
    cost=cost,
    columns=("ms", "ms_eager", "tbps", "x_copy", "extra_mib"),
    cuda_graph=True,
    notes=(
        "S = 1: bytes counted are 2 per element per itemsize forward (read x, write y) and 3 backward "
        "(read x, dy, write dx): 10 bytes per element fwd + bwd in bf16.",
        "S = 2: a residual is added first and the sum is a second output; 4 per element per itemsize "
        "forward (read x, residual, write y, sum), 4 backward (read sum, dy, d sum, write dx = d residual).",
        "fuselm runs the S = 1 shapes, fuselm_residual and torch_add_then_fuselm the S = 2 shapes; "
        "the other providers run both.",
    ),
)


# ---- tuning the launch constants (GPU) ----

FWD_SPACE: dict[str, Sequence[int]] = {
    "FWD_ELEMS_PER_WARP": (256, 512, 1024),
    "FWD_TILE": (4096, 8192),
    "FWD_PROGRAMS_PER_SM": (0, 4, 8),
}
BWD_SPACE: dict[str, Sequence[int]] = {
    "BWD_ELEMS_PER_WARP": (256, 512, 1024),
    "BWD_TILE": (4096, 8192),
    "BWD_PROGRAMS_PER_SM": (0, 1, 2, 4),
    "BWD_PREFETCH": (0, 1),
}


def tune(
    shapes: Sequence[Shape] | None = None,
    *,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.bfloat16,
    fwd_space: dict[str, Sequence[int]] | None = None,
    bwd_space: dict[str, Sequence[int]] | None = None,
    quick: bool = False,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Sweep the launch constants of ``fuselm.ops.rms_norm.op`` (module attributes, restored afterwards):
    every combination of ``fwd_space`` timed on the forward, then every combination of ``bwd_space``
    timed on forward + backward (the forward at its defaults). Returns one dict per (shape, pass,
    combination) with the time and its bandwidth ratio (cost of that mode / time / copy bandwidth)."""
    from fuselm.ops.rms_norm import op as rms_op

    from .harness import Ceilings, compute_ratios, measure_ceilings, time_ms

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = list(shapes or (SUITE.gpu_shapes if device.type == "cuda" else SUITE.cpu_shapes))
    spaces = {"fwd": dict(FWD_SPACE if fwd_space is None else fwd_space)}
    spaces["full"] = dict(BWD_SPACE if bwd_space is None else bwd_space)
    ceilings = measure_ceilings(device, quick=True) if device.type == "cuda" else Ceilings()
    saved = {k: getattr(rms_op, k) for space in spaces.values() for k in space}
    results: list[dict[str, Any]] = []
    try:
        for shape in shapes:
            torch.manual_seed(0)
            inputs = make_inputs(shape, dtype, device)
            fn = (setup_fuselm_residual if "residual" in inputs else setup_fuselm)(device)
            wrt = [t for t in inputs.values() if t.requires_grad]
            outs = fn(inputs)
            gos = [torch.randn_like(o) for o in (outs if isinstance(outs, tuple) else (outs,))]

            def fwd(fn=fn, inputs=inputs):
                with torch.no_grad():
                    return fn(inputs)

            def full(fn=fn, inputs=inputs, wrt=wrt, gos=gos):
                o = fn(inputs)
                return torch.autograd.grad(o if isinstance(o, tuple) else (o,), wrt, gos)

            for mode, space in spaces.items():
                call = fwd if mode == "fwd" else full
                for values in itertools.product(*space.values()):
                    config = dict(zip(space, values, strict=True))
                    for k, v in saved.items():
                        setattr(rms_op, k, config.get(k, v))
                    call()  # compile
                    ms = time_ms(call, device, quick=quick)
                    x_copy = compute_ratios(ms, cost(shape, mode, dtype), ceilings)["x_copy"]
                    results.append(dict(shape=tuple(shape), mode=mode, **config, ms=ms, x_copy=x_copy))
                    ratio = f"{x_copy:.3f}" if x_copy else "n/a"
                    log(f"{shape} {mode} {config}: {ms:.4f} ms, x_copy {ratio}")
    finally:
        for k, v in saved.items():
            setattr(rms_op, k, v)
    for shape in shapes:
        for mode in spaces:
            rows = [r for r in results if r["shape"] == tuple(shape) and r["mode"] == mode]
            if rows:
                log(f"best {mode} {tuple(shape)}: {min(rows, key=lambda r: r['ms'])}")
    return results


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fuselm_bench.rms_norm", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--tune", action="store_true", help="sweep the launch constants (see tune())")
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--shapes", default=None, help="NxHxR,... (default: the suite's shapes)")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args(argv)
    if not args.tune:
        parser.print_help()
        return 0
    device = torch.device(args.device) if args.device else None
    tune(parse_shapes(args.shapes) if args.shapes else None, device=device, quick=args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
