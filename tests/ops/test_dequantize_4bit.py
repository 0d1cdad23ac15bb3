"""fuselm.ops.dequantize_4bit: bit-equal to its reference and to bitsandbytes' dequantize_4bit (NF4 and FP4,
single and double quantization, any blocksize, odd sizes), one launch per weight, argument errors.

Exactness: the kernel rounds each fp32 value once to the output dtype, as bitsandbytes does, so every
comparison is torch.equal. Under the Triton interpreter a 16-bit store truncates instead of rounding
(an interpreter trap), so there the 16-bit outputs are checked on the GPU only.
"""

from __future__ import annotations

import doctest

import pytest
import torch
from conftest import TRITON_PATH, kernel_device
from kit.spies import LaunchSpy

from fuselm.ops.dequantize_4bit import dequantize_4bit, dequantize_4bit_reference
from fuselm.ops.dequantize_4bit import op as dq_op

DEVICE = kernel_device()
ON_GPU = DEVICE == "cuda"
DTYPES = (torch.float32, torch.bfloat16, torch.float16) if ON_GPU else (torch.float32,)
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _quantized(n: int, blocksize: int, nested: bool, seed: int = 0):
    """Random codes and scales in bitsandbytes' layout: (packed uint8, absmax, table, nested operands)."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, ((n + 1) // 2,), generator=g, dtype=torch.uint8)
    blocks = -(-n // blocksize)
    table = torch.sort(torch.randn(16, generator=g)).values
    if not nested:
        return packed.to(DEVICE), (torch.rand(blocks, generator=g) * 3).to(DEVICE), table.to(DEVICE), {}
    absmax = torch.randint(0, 256, (blocks,), generator=g, dtype=torch.uint8)
    code = torch.sort(torch.randn(256, generator=g)).values
    scale = torch.rand(-(-blocks // 256), generator=g) * 0.1
    extra = {
        "absmax_code": code.to(DEVICE),
        "absmax_scale": scale.to(DEVICE),
        "absmax_blocksize": 256,
        "absmax_offset": torch.tensor([0.37]).to(DEVICE),
    }
    return packed.to(DEVICE), absmax.to(DEVICE), table.to(DEVICE), extra


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("nested", [False, True], ids=["single", "double"])
@pytest.mark.parametrize(
    "shape,blocksize",
    [((64, 128), 64), ((33, 7), 32), ((1, 5), 2), ((3, 1000), 256), ((2, 4096), 4096)],
    ids=["64x128-b64", "odd-33x7-b32", "n5-b2", "3x1000-b256", "b4096"],
)
def test_matches_the_reference_bit_for_bit(shape, blocksize, nested, dtype):
    n = shape[0] * shape[1]
    packed, absmax, table, extra = _quantized(n, blocksize, nested)
    expected = dequantize_4bit_reference(packed, absmax, table, blocksize, shape, dtype, **extra)
    got = dequantize_4bit(packed, absmax, table, blocksize, shape, dtype, **extra)
    assert got.shape == shape and got.dtype == dtype
    assert torch.equal(got, expected)
    # the scales in the reference follow the documented formula
    blocks = torch.arange(n, device=DEVICE) // blocksize
    if nested:
        s = (
            extra["absmax_code"][absmax.long()]
            * extra["absmax_scale"][torch.arange(absmax.numel(), device=DEVICE) // 256]
        )
        s = s + extra["absmax_offset"]
    else:
        s = absmax
    data = packed.long()
    codes = torch.stack((data >> 4, data & 15), 1).reshape(-1)[:n]
    assert torch.equal(expected.reshape(-1), (table[codes] * s[blocks]).to(dtype))


def test_writes_into_out_and_launches_once(monkeypatch):
    packed, absmax, table, extra = _quantized(64 * 256, 64, True)
    spy = LaunchSpy(dq_op.dequantize_4bit_launch)
    monkeypatch.setattr(dq_op, "dequantize_4bit_launch", spy)
    out = torch.empty(64, 256, device=DEVICE)
    got = dequantize_4bit(packed, absmax, table, 64, (64, 256), torch.float32, out=out, **extra)
    assert got is out
    assert len(spy.calls) == (1 if TRITON_PATH else 0)
    assert torch.equal(
        out, dequantize_4bit_reference(packed, absmax, table, 64, (64, 256), torch.float32, **extra)
    )


def test_packed_of_another_dtype_is_read_as_bytes():
    """bitsandbytes stores the codes in its quant_storage dtype (bf16 in QLoRA recipes): read as bytes."""
    packed, absmax, table, _ = _quantized(256, 64, False)
    as_bf16 = packed.view(torch.bfloat16).reshape(-1, 1)
    assert torch.equal(
        dequantize_4bit(as_bf16, absmax, table, 64, (4, 64), torch.float32),
        dequantize_4bit(packed, absmax, table, 64, (4, 64), torch.float32),
    )


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [False, True], ids=["single", "double"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: DTYPE_IDS[d])
def test_bit_equal_to_bitsandbytes(quant_type, nested, dtype):
    """bitsandbytes quantizes a weight; its dequantize_4bit and fuselm's give the same bits (the weight's
    rows a multiple of the blocksize: bitsandbytes' CPU kernel assumes it)."""
    bnbf = pytest.importorskip("bitsandbytes.functional")
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype) * 0.05
    q, qs = bnbf.quantize_4bit(w, blocksize=64, quant_type=quant_type, compress_statistics=nested)
    expected = bnbf.dequantize_4bit(q, qs)
    table = bnbf.get_4bit_type(quant_type, device=q.device)
    extra = {}
    if nested:
        extra = {
            "absmax_code": qs.state2.code,
            "absmax_scale": qs.state2.absmax,
            "absmax_blocksize": qs.state2.blocksize,
            "absmax_offset": qs.offset.float().reshape(1),
        }
    got = dequantize_4bit(q, qs.absmax, table, qs.blocksize, qs.shape, qs.dtype, **extra)
    assert got.dtype == expected.dtype == dtype
    assert torch.equal(got, expected)


def test_an_empty_weight():
    packed, absmax, table, _ = _quantized(2, 2, False)
    got = dequantize_4bit(packed[:0], absmax[:0], table, 2, (0, 3), torch.float32)
    assert got.shape == (0, 3)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"packed": [1, 2]}, "packed must be a torch.Tensor"),
        ({"blocksize": 48}, "blocksize must be a power of two"),
        ({"blocksize": True}, "blocksize must be a power of two"),
        ({"shape": (8, 64)}, "packed must be contiguous with at least 256 bytes"),
        ({"dtype": torch.int32}, "dtype must be one of"),
        ({"absmax": "absmax[:3]"}, "absmax must have 4 elements"),
        ({"absmax": "absmax.double()"}, r"absmax must have dtype in \(float32\)"),
        ({"table": "table[:8]"}, "table must have 16 elements"),
        ({"absmax_code": "table"}, "come together"),
        ({"out": "torch.empty(4, 64, device=DEVICE, dtype=torch.float16)"}, "out must be a torch.float32"),
        ({"out": "torch.empty(64, 4, device=DEVICE).t()"}, "out must be contiguous"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_arguments_name_the_argument(change, match):
    packed, absmax, table, _ = _quantized(256, 64, False)
    args = {
        "packed": packed,
        "absmax": absmax,
        "table": table,
        "blocksize": 64,
        "shape": (4, 64),
        "dtype": torch.float32,
    }
    env = {"torch": torch, "DEVICE": DEVICE, **args}
    for k, v in change.items():
        args[k] = eval(v, env) if isinstance(v, str) else v
    with pytest.raises(ValueError, match=match):
        dequantize_4bit(**args)


def test_double_quantization_operands_are_checked():
    packed, absmax, table, extra = _quantized(256, 64, True)
    with pytest.raises(ValueError, match=r"absmax must have dtype in \(uint8\)"):
        dequantize_4bit(packed, absmax.float(), table, 64, (4, 64), torch.float32, **extra)
    with pytest.raises(ValueError, match="absmax_offset must have 1 elements"):
        dequantize_4bit(
            packed, absmax, table, 64, (4, 64), torch.float32, **{**extra, "absmax_offset": table[:2]}
        )


def test_docstring_example():
    assert doctest.testmod(dq_op, raise_on_error=False).failed == 0
