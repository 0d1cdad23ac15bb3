"""How close do Triton `tl.dot` GEMM loops get to cuBLAS on Hopper for an LM-head shape?

Question: can the fused memory="min" linear-cross-entropy kernels (which compute logits tiles x @ W^T in
Triton and reduce them on chip, never storing the logits) reach ~90% of cuBLAS? This script times the
GEMM part alone, with the reduction replaced by the cheapest stand-in: every [BLOCK_M, BLOCK_N] logits
tile is reduced to its per-row maximum, stored into an fp32 [n_vocab_tiles, N] buffer (compute-bound,
tiny output, like the stats kernel).

Shapes: X [N, H] bf16 and W [V, H] bf16, both row-major, logits = X @ W^T [N, V], FLOPs = 2 N H V:
(N, H, V) = (8192, 4096, 128256) (Llama-3-8B head) and (8192, 2304, 256000) (Gemma-2-2B head).

Providers (triton.testing.do_bench, median of rep=100 ms after warmup=25 ms):
- cublas: torch.matmul(x, w.t(), out=...) writing the bf16 [N, V] logits; also a bf16 8192^3 matmul
  as the card's GEMM ceiling.
- ptr: pointer-based tl.load of x tiles [BLOCK_M, BLOCK_K] and w^T tiles [BLOCK_K, BLOCK_N], fp32
  accumulator, K loop pipelined through the num_stages launch option, one program a tile, GROUP_M
  grouped tile order (L2 reuse of the W tiles).
- ptr-persistent: the same with one program per SM looping over the tiles (tl.range flatten=True).
- tma: host-side TensorDescriptor (triton.tools.tensor_descriptor) for x [BLOCK_M, BLOCK_K] and
  w [BLOCK_N, BLOCK_K] blocks, desc.load in the kernel and tl.dot(a, b.T).
- tma-persistent, tma-persistent-flatten: TMA with one program per SM (tile loop plain / flattened).
- tma-persistent-ws-k: warp_specialize=True on the K loop's tl.range.
- tma-persistent-ws-tiles: warp_specialize=True on the tile loop (as Triton's persistent-matmul
  tutorial does, there with flatten=True too; with flatten, Triton 3.6 does not warp-specialize on Hopper).
  Triton 3.6 warp-specializes on Hopper only kernels launched with num_warps=4 (they then run 12 warps:
  one producer and two consumer warp groups), so these two variants also run WS_EXTRA_CONFIGS; the
  printed line says "warps 12 (warp-specialized)" where it happened, else the loop ran as a plain one.
Each Triton variant is run over the tile configs (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of
CONFIGS; a config or variant that fails to compile or run (out of shared memory, feature unsupported on
this Triton / GPU) prints one line with the exception and the sweep goes on. Every run is checked
once against torch: the per-tile row maxima of a subset of rows against fp32 torch logits (max abs
difference printed; fp32 accumulation order only, so expect ~1e-5 .. 1e-4).

Numbers: ms and TFLOP/s (2 N H V / time) per provider, and "vs cublas" = cuBLAS time / this time,
i.e. the fraction of the cuBLAS GEMM throughput this loop reaches on the same shape (cuBLAS also
writes the 2-4 GB of logits, which the Triton loops do not; that costs cuBLAS a few percent at most).
A ratio near 0.9 for the best config says the fused kernels' GEMM core can get there; the gap of the
stats kernel to its best variant here is then the cost of its own epilogue.

Run on the GPU machine (runs each variant on both shapes before the next variant, so a crash in a late
variant keeps the earlier results; ~2-4 minutes on an H100):
    PYTHONPATH=src python benchmarks/experiments/triton_gemm_ceiling.py
    PYTHONPATH=src python benchmarks/experiments/triton_gemm_ceiling.py --variants ptr,tma
CPU check of the kernels in Triton's interpreter (tiny fp16 shapes; bf16 tl.dot is wrong there):
    TRITON_INTERPRET=1 python benchmarks/experiments/triton_gemm_ceiling.py --cpu-check
The script does not import fuselm.
"""

import argparse
import os
import sys
from dataclasses import dataclass

if "--cpu-check" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

SHAPES = [(8192, 4096, 128256), (8192, 2304, 256000)]  # (N, H, V)
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
CONFIGS = [
    (128, 256, 64, 8, 3),
    (128, 256, 64, 8, 4),
    (128, 128, 64, 4, 4),
    (128, 128, 64, 8, 4),
    (256, 128, 64, 8, 3),
]
# Triton 3.6's Hopper warp specialization only applies to num_warps=4 kernels (it then runs 12 warps: a
# producer and two consumer warp groups) and not to flattened loops; the WS variants also run these
WS_EXTRA_CONFIGS = [(128, 256, 64, 4, 3), (128, 256, 64, 4, 4), (256, 128, 64, 4, 3)]
CPU_SHAPE = (48, 64, 200)  # partial row and vocab tiles on purpose
CPU_CONFIG = (32, 32, 32, 4, 1)
CHECK_ROW_STEP = 16  # the GPU check compares every 16th row
WARMUP_MS, REP_MS = 25, 100


# ----------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _tile_coords(tile_id, num_m, num_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of a tile in grouped order: GROUP_M row tiles sweep the vocab tiles together."""
    tiles_per_group = GROUP_M * num_n
    first_m = (tile_id // tiles_per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    local = tile_id % tiles_per_group
    return first_m + local % group_rows, local // group_rows


@triton.jit
def _store_row_max(acc, out_ptr, pid_m, pid_n, M, V, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Stand-in epilogue: out[pid_n, rows] = max over the tile's valid columns of acc."""
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.where(cols[None, :] < V, acc, float("-inf"))
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tl.store(out_ptr + pid_n * M + rows, tl.max(acc, axis=1), mask=rows < M)


@triton.jit
def _ptr_tile(
    x_ptr, w_ptr, stride_x, stride_w, M, V, K, pid_m, pid_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """fp32 [BLOCK_M, BLOCK_N] tile of x @ w^T from pointer loads (K % BLOCK_K == 0). Rows and columns
    past the end wrap around to valid ones (no masks in the loop); the epilogue masks them."""
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % V
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_x + ks[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + cols[None, :] * stride_w + ks[:, None]  # [BLOCK_K, BLOCK_N] tile of w^T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        acc = tl.dot(tl.load(x_ptrs), tl.load(w_ptrs), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit
def _tma_tile(
    x_desc, w_desc, off_m, off_n, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WS_K: tl.constexpr,
):  # fmt: skip
    """fp32 [BLOCK_M, BLOCK_N] tile of x @ w^T from TMA loads (out-of-bounds rows / columns read 0)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, warp_specialize=WS_K):
        a = x_desc.load([off_m, k])  # [BLOCK_M, BLOCK_K]
        b = w_desc.load([off_n, k])  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(a, b.T, acc)
    return acc


@triton.jit
def ptr_rowmax_kernel(
    x_ptr, w_ptr, out_ptr, M, V, K, stride_x, stride_w,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = _tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(V, BLOCK_N), GROUP_M)
    acc = _ptr_tile(x_ptr, w_ptr, stride_x, stride_w, M, V, K, pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K)
    _store_row_max(acc, out_ptr, pid_m, pid_n, M, V, BLOCK_M, BLOCK_N)


@triton.jit
def ptr_rowmax_persistent_kernel(
    x_ptr, w_ptr, out_ptr, M, V, K, stride_x, stride_w,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr,
):  # fmt: skip
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(V, BLOCK_N)
    for tile_id in tl.range(tl.program_id(0), num_m * num_n, NUM_PROGRAMS, flatten=FLATTEN):
        pid_m, pid_n = _tile_coords(tile_id, num_m, num_n, GROUP_M)
        acc = _ptr_tile(x_ptr, w_ptr, stride_x, stride_w, M, V, K, pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K)
        _store_row_max(acc, out_ptr, pid_m, pid_n, M, V, BLOCK_M, BLOCK_N)


@triton.jit
def tma_rowmax_kernel(
    x_desc, w_desc, out_ptr, M, V, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = _tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(V, BLOCK_N), GROUP_M)
    acc = _tma_tile(x_desc, w_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, K, BLOCK_M, BLOCK_N, BLOCK_K, False)
    _store_row_max(acc, out_ptr, pid_m, pid_n, M, V, BLOCK_M, BLOCK_N)


@triton.jit
def tma_rowmax_persistent_kernel(
    x_desc, w_desc, out_ptr, M, V, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr, WS_TILES: tl.constexpr, WS_K: tl.constexpr,
):  # fmt: skip
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(V, BLOCK_N)
    for tile_id in tl.range(
        tl.program_id(0), num_m * num_n, NUM_PROGRAMS, flatten=FLATTEN, warp_specialize=WS_TILES
    ):
        pid_m, pid_n = _tile_coords(tile_id, num_m, num_n, GROUP_M)
        acc = _tma_tile(x_desc, w_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, K, BLOCK_M, BLOCK_N, BLOCK_K, WS_K)
        _store_row_max(acc, out_ptr, pid_m, pid_n, M, V, BLOCK_M, BLOCK_N)


# ----------------------------------------------------------------------------------------------------
# Variants and launches
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    name: str
    tma: bool
    persistent: bool = False
    flatten: bool = False
    ws_tiles: bool = False
    ws_k: bool = False

    @property
    def configs(self):
        return CONFIGS + WS_EXTRA_CONFIGS if self.ws_tiles or self.ws_k else CONFIGS


VARIANTS = [
    Variant("ptr", tma=False),
    Variant("ptr-persistent", tma=False, persistent=True, flatten=True),
    Variant("tma", tma=True),
    Variant("tma-persistent", tma=True, persistent=True),
    Variant("tma-persistent-flatten", tma=True, persistent=True, flatten=True),
    Variant("tma-persistent-ws-k", tma=True, persistent=True, ws_k=True),
    Variant("tma-persistent-ws-tiles", tma=True, persistent=True, ws_tiles=True),
]


def make_launch(variant, x, w, out, config, num_sms, group_m):
    """A no-argument callable that runs `variant` with `config`, writing the per-tile row maxima to out."""
    m, k = x.shape
    v = w.shape[0]
    block_m, block_n, block_k, num_warps, num_stages = config
    assert k % block_k == 0, "the pointer loop has no K mask"
    assert v * k < 2**31 and m * k < 2**31, "int32 offsets"
    num_tiles = triton.cdiv(m, block_m) * triton.cdiv(v, block_n)
    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m)
    meta.update(num_warps=num_warps, num_stages=num_stages)
    if variant.tma:
        x_desc = TensorDescriptor.from_tensor(x, [block_m, block_k])
        w_desc = TensorDescriptor.from_tensor(w, [block_n, block_k])
        args = (x_desc, w_desc, out, m, v, k)
    else:
        args = (x, w, out, m, v, k, x.stride(0), w.stride(0))
    if not variant.persistent:
        kernel = tma_rowmax_kernel if variant.tma else ptr_rowmax_kernel
        grid = (num_tiles,)
    else:
        grid = (min(num_sms, num_tiles),)
        meta.update(NUM_PROGRAMS=grid[0], FLATTEN=variant.flatten)
        if variant.tma:
            kernel = tma_rowmax_persistent_kernel
            meta.update(WS_TILES=variant.ws_tiles, WS_K=variant.ws_k)
        else:
            kernel = ptr_rowmax_persistent_kernel
    return lambda: kernel[grid](*args, **meta)


def out_buffer(x, w, block_n):
    return torch.full((triton.cdiv(w.shape[0], block_n), x.shape[0]), float("nan"), device=x.device)


def tile_max_reference(logits, block_n):
    """Per-tile row maxima [n_vocab_tiles, rows] of fp32 logits [rows, V]."""
    rows, v = logits.shape
    n_tiles = triton.cdiv(v, block_n)
    padded = torch.full((rows, n_tiles * block_n), float("-inf"), device=logits.device)
    padded[:, :v] = logits
    return padded.view(rows, n_tiles, block_n).amax(dim=2).t()


def max_abs_diff(out, ref_logits, rows, block_n):
    got = out[:, rows] if rows is not None else out
    return (got - tile_max_reference(ref_logits, block_n)).abs().max().item()


def config_name(config):
    return "{}x{}x{} w{} s{}".format(*config)


# ----------------------------------------------------------------------------------------------------
# GPU benchmark
# ----------------------------------------------------------------------------------------------------


def bench_ms(fn):
    return triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")


def tflops(flops, ms):
    return flops / (ms * 1e-3) / 1e12


def shape_name(shape):
    return "N{} H{} V{}".format(*shape)


def report(shape, provider, config, ms, flops, cublas_ms, extra=""):
    ratio = f"{cublas_ms / ms:6.3f}" if cublas_ms else "   -  "
    print(
        f"{shape_name(shape):<22} {provider:<24} {config:<20} {ms:8.3f} ms {tflops(flops, ms):7.1f} TFLOP/s"
        f"  vs cublas {ratio}  {extra}",
        flush=True,
    )


def make_problem(shape, device):
    n, h, v = shape
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn((n, h), device=device, generator=gen).to(torch.bfloat16)
    w = (0.02 * torch.randn((v, h), device=device, generator=gen)).to(torch.bfloat16)
    rows = torch.arange(0, n, CHECK_ROW_STEP, device=device)
    ref = torch.cat([x[rows].float() @ wc.float().t() for wc in w.split(32768)], dim=1)  # fp32 [rows, V]
    return dict(x=x, w=w, rows=rows, ref=ref, flops=2 * n * h * v)


def bench_cublas(shapes, problems):
    square = torch.randn((8192, 8192), device="cuda", dtype=torch.bfloat16)
    ms = bench_ms(lambda a=square: torch.matmul(a, a))
    report((8192, 8192, 8192), "cublas 8192^3", "-", ms, 2 * 8192**3, None, "(card GEMM ceiling)")
    cublas_ms = {}
    for shape, p in zip(shapes, problems, strict=True):
        logits = torch.empty((p["x"].shape[0], p["w"].shape[0]), device="cuda", dtype=torch.bfloat16)
        cublas_ms[shape] = bench_ms(lambda p=p, logits=logits: torch.matmul(p["x"], p["w"].t(), out=logits))
        report(shape, "cublas", "bf16 logits", cublas_ms[shape], p["flops"], cublas_ms[shape])
        del logits
    return cublas_ms


def run_one(variant, config, shape, p, cublas_ms, num_sms, group_m):
    """Check then time one (variant, config, shape); None where it fails."""
    name = f"{shape_name(shape):<22} {variant.name:<24} {config_name(config):<20}"
    try:
        out = out_buffer(p["x"], p["w"], config[1])
        launch = make_launch(variant, p["x"], p["w"], out, config, num_sms, group_m)
        compiled = launch()
        torch.cuda.synchronize()
        diff = max_abs_diff(out, p["ref"], p["rows"], config[1])
        ms = bench_ms(launch)
    except Exception as e:  # compile errors, out of resources, unsupported features
        print(name, "FAILED", f"{type(e).__name__}: {e}".replace("\n", " ")[:200], flush=True)
        return None
    extra = f"maxdiff {diff:.1e}{'' if diff < 1e-2 else ' WRONG'}  {kernel_note(compiled, config)}"
    report(shape, variant.name, config_name(config), ms, p["flops"], cublas_ms[shape], extra)
    return ms


def kernel_note(compiled, config):
    """Registers a thread and spills of the compiled kernel, and its warp count where the compiler changed
    it (warp specialization adds warp groups)."""
    note = f"regs {getattr(compiled, 'n_regs', '?')} spills {getattr(compiled, 'n_spills', '?')}"
    warps = getattr(getattr(compiled, "metadata", None), "num_warps", config[3])
    return note + (f" warps {warps} (warp-specialized)" if warps != config[3] else "")


def print_summary(best, shapes, problems, cublas_ms):
    print("\nbest config per variant:")
    for shape, p in zip(shapes, problems, strict=True):
        for name, (ms, config) in best.get(shape, {}).items():
            report(shape, name, config_name(config), ms, p["flops"], cublas_ms[shape])


def gpu_main(args):
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference logits
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs", flush=True)
    print(f"torch {torch.__version__}, triton {triton.__version__}", flush=True)
    print(f"do_bench median, warmup={WARMUP_MS} ms rep={REP_MS} ms, GROUP_M={args.group_m}\n", flush=True)
    shapes = SHAPES
    problems = [make_problem(shape, "cuda") for shape in shapes]
    cublas_ms = bench_cublas(shapes, problems)
    best = {}
    for variant in selected_variants(args.variants):
        print(flush=True)
        for shape, p in zip(shapes, problems, strict=True):
            for config in variant.configs:
                ms = run_one(variant, config, shape, p, cublas_ms, props.multi_processor_count, args.group_m)
                if ms is not None and ms < best.setdefault(shape, {}).get(variant.name, (float("inf"),))[0]:
                    best[shape][variant.name] = (ms, config)
    print_summary(best, shapes, problems, cublas_ms)


def selected_variants(names):
    if not names:
        return VARIANTS
    wanted = names.split(",")
    unknown = set(wanted) - {v.name for v in VARIANTS}
    assert not unknown, f"unknown variants {sorted(unknown)}; known: {[v.name for v in VARIANTS]}"
    return [v for v in VARIANTS if v.name in wanted]


# ----------------------------------------------------------------------------------------------------
# CPU check (Triton interpreter)
# ----------------------------------------------------------------------------------------------------


def cpu_check(args):
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    n, h, v = CPU_SHAPE
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((n, h), generator=gen).to(torch.float16)  # bf16 tl.dot is wrong in the interpreter
    w = (0.1 * torch.randn((v, h), generator=gen)).to(torch.float16)
    ref = x.float() @ w.float().t()
    failed = []
    for variant in selected_variants(args.variants):
        out = out_buffer(x, w, CPU_CONFIG[1])
        try:
            make_launch(variant, x, w, out, CPU_CONFIG, num_sms=3, group_m=2)()
            diff = max_abs_diff(out, ref, None, CPU_CONFIG[1])
            row_diff = (out.amax(dim=0) - ref.amax(dim=1)).abs().max().item()
            ok = diff < 1e-3 and row_diff < 1e-3
            result = f"tile maxdiff {diff:.1e}, row maxdiff {row_diff:.1e}: {'ok' if ok else 'WRONG'}"
        except Exception as e:
            ok = False
            result = f"FAILED {type(e).__name__}: {str(e)}".replace("\n", " ")[:200]
        print(f"{variant.name:<24} {result}", flush=True)
        if not ok:
            failed.append(variant.name)
    print("all variants ok" if not failed else f"failed: {failed}")
    return 1 if failed else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-check", action="store_true", help="check the kernels in the interpreter")
    parser.add_argument("--variants", default="", help="comma-separated subset of the Triton variants")
    parser.add_argument("--group-m", type=int, default=8, help="row tiles per group of the tile order")
    args = parser.parse_args()
    if args.cpu_check:
        sys.exit(cpu_check(args))
    assert torch.cuda.is_available(), "the benchmark needs a CUDA GPU (use --cpu-check on the CPU)"
    gpu_main(args)


if __name__ == "__main__":
    main()
