"""fuselm.apply_rotary: numerics (docs/design.md section 5), layouts, strides, cos/sin forms, position_ids,
partial rotary, GQA in one launch, Hugging Face parity, torch.compile, failure modes.

Every numeric check goes through assert_numerics: err(fuselm) <= 2 * err(eager) + atol[dtype], errors
measured against apply_rotary_reference run on float64 copies. "eager" is Hugging Face's
apply_rotary_pos_emb written out (rotate_half, partial rotary by slicing), every op in the input dtype.

Sizes: on CUDA larger ones; on the CPU the Triton interpreter runs one numpy program per (b, t)
position, so B * T stays small.
"""

from __future__ import annotations

import doctest
import warnings

import pytest
import torch
from conftest import TRITON_PATH, kernel_device
from kit.spies import LaunchSpy

import fuselm
from fuselm.ops._common.testing import assert_numerics
from fuselm.ops.rope import apply_rotary, apply_rotary_reference
from fuselm.ops.rope import op as rope_op

DEVICE = kernel_device()
ON_GPU = DEVICE == "cuda"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}
LAYOUTS = ("bhtd", "bthd")

# (B, T, Hq, Hk, D, R): R = rotary width (R < D: partial rotary)
SHAPES = {
    "llama": (2, 300, 32, 8, 128, 128) if ON_GPU else (1, 20, 4, 2, 128, 128),
    "T1": (3, 1, 3, 1, 64, 64),
    "T7-partial-32of80": (2, 7, 3, 1, 80, 32),
    "T63-heads1": (1, 63, 1, 1, 64, 64),
    "partial-24of64": (2, 7, 1, 3, 64, 24),  # R/2 = 12: not a power of two
}
if ON_GPU:
    SHAPES["gemma-256"] = (2, 129, 8, 4, 256, 256)

triton_path_only = pytest.mark.skipif(
    not TRITON_PATH, reason="Triton kernels not exercised (no CUDA, TRITON_INTERPRET unset)"
)


# ---- inputs ----


def qk_shape(b, t, h, d, layout):
    return (b, h, t, d) if layout == "bhtd" else (b, t, h, d)


def make_qk(gen, shape, dtype, layout, device=DEVICE):
    b, t, hq, hk, d, _ = shape
    q = torch.randn(qk_shape(b, t, hq, d, layout), generator=gen).to(dtype)
    k = torch.randn(qk_shape(b, t, hk, d, layout), generator=gen).to(dtype)
    return q.to(device), k.to(device)


def hf_tables(positions, rot, dtype, base=10000.0, device=DEVICE):
    """cos, sin [..., R] as Hugging Face's rotary embedding makes them (cat(freqs, freqs)), in dtype."""
    inv_freq = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)
    freqs = positions.cpu().float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)


def make_tables(gen, shape, dtype, batch_dim=True):
    """cos/sin [B, T, R] (or [1, T, R]) at random, distinct per batch row, positions in [0, 4096)."""
    b, t, _, _, _, rot = shape
    start = torch.randint(0, 4096 - t, (b if batch_dim else 1, 1), generator=gen)
    return hf_tables(start + torch.arange(t), rot, dtype)


def grad_outputs(gen, outs):
    return [torch.randn(o.shape, generator=gen).to(o.dtype).to(o.device) for o in outs]


# ---- the three implementations ----


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_eager(q, k, cos, sin, position_ids=None, layout="bhtd"):
    """Hugging Face's apply_rotary_pos_emb (with its partial-rotary slicing), every op in q's dtype."""
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    if cos.dim() == 3:
        unsqueeze_dim = 1 if layout == "bhtd" else 2
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    rot = cos.shape[-1]
    q_rot, q_pass = q[..., :rot], q[..., rot:]
    k_rot, k_pass = k[..., :rot], k[..., rot:]
    q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)
    k_embed = (k_rot * cos) + (rotate_half(k_rot) * sin)
    return torch.cat((q_embed, q_pass), dim=-1), torch.cat((k_embed, k_pass), dim=-1)


def reference64(q, k, cos, sin, position_ids=None, layout="bhtd"):
    """The oracle: apply_rotary_reference on float64 copies."""
    return apply_rotary_reference(
        q.double(), k.double(), cos.double(), sin.double(), position_ids=position_ids, layout=layout
    )


def ours(q, k, cos, sin, position_ids=None, layout="bhtd"):
    return apply_rotary(q, k, cos, sin, position_ids=position_ids, layout=layout)


def fwd_bwd(fn, q, k, cos, sin, kw, gos):
    """Outputs and (dq, dk) of sum <out_i, go_i>, on leaves that share q's and k's memory and strides."""
    qr = q.detach().requires_grad_()
    kr = k.detach().requires_grad_()
    outs = fn(qr, kr, cos, sin, **kw)
    dq, dk = torch.autograd.grad(outs, (qr, kr), [g.to(o.dtype) for g, o in zip(gos, outs, strict=True)])
    return tuple(o.detach() for o in outs), (dq, dk)


def check_case(name, q, k, cos, sin, gen, *, fn=ours, **kw):
    """The numerics rule for q_embed, k_embed, dq, dk; output dtypes and shapes."""
    dtype = q.dtype
    gos = grad_outputs(gen, (q, k))
    out, grads = fwd_bwd(fn, q, k, cos, sin, kw, gos)
    out_e, grads_e = fwd_bwd(hf_eager, q, k, cos, sin, kw, gos)
    out_r, grads_r = fwd_bwd(reference64, q, k, cos, sin, kw, gos)
    for what, o, e, r, x in zip(
        ("q_embed", "k_embed", "dq", "dk"),
        (*out, *grads),
        (*out_e, *grads_e),
        (*out_r, *grads_r),
        (q, k, q, k),
        strict=True,
    ):
        assert o.shape == x.shape and o.dtype == dtype and o.device == x.device, what
        assert_numerics(f"{name} {what}", o, e, r, dtype)
    return out, grads


# ---- numerics over shapes, dtypes, layouts ----


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_numerics(dtype, layout, shape, gen):
    q, k = make_qk(gen, SHAPES[shape], dtype, layout)
    cos, sin = make_tables(gen, SHAPES[shape], dtype)
    check_case(f"{shape} {layout}", q, k, cos, sin, gen, layout=layout)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", ["llama", "T7-partial-32of80", "partial-24of64"])
def test_fp32_bit_for_bit_with_hf_eager(shape, layout, gen):
    """fp32: the same roundings as Hugging Face's code (no FMA contraction): outputs and gradients equal."""
    q, k = make_qk(gen, SHAPES[shape], torch.float32, layout)
    cos, sin = make_tables(gen, SHAPES[shape], torch.float32)
    gos = grad_outputs(gen, (q, k))
    out, grads = fwd_bwd(ours, q, k, cos, sin, dict(layout=layout), gos)
    out_e, grads_e = fwd_bwd(hf_eager, q, k, cos, sin, dict(layout=layout), gos)
    for what, a, b in zip(
        ("q_embed", "k_embed", "dq", "dk"), (*out, *grads), (*out_e, *grads_e), strict=True
    ):
        assert torch.equal(a, b), f"{what}: max diff {(a - b).abs().max().item():.3e}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_transformers_bit_for_bit(layout, gen):
    """fp32 against transformers' own Llama apply_rotary_pos_emb (skipped where it is not installed)."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    shape = SHAPES["llama"]
    q, k = make_qk(gen, shape, torch.float32, layout)
    cos, sin = make_tables(gen, shape, torch.float32)
    hq, hk = llama.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1 if layout == "bhtd" else 2)
    oq, ok = apply_rotary(q, k, cos, sin, layout=layout)
    assert torch.equal(oq, hq) and torch.equal(ok, hk)


def test_arbitrary_tables_follow_the_formula(gen):
    """cos/sin whose two halves differ (not cat(freqs, freqs)): both halves are used, forward and
    backward (the backward swaps the halves of sin)."""
    shape = (2, 7, 3, 2, 64, 48)
    for layout in LAYOUTS:
        q, k = make_qk(gen, shape, torch.float32, layout)
        cos = torch.randn(2, 7, 48, generator=gen).to(DEVICE)
        sin = torch.randn(2, 7, 48, generator=gen).to(DEVICE)
        check_case(f"random tables {layout}", q, k, cos, sin, gen, layout=layout)


def test_reference_matches_hf_eager_float64(gen):
    """The oracle itself is Hugging Face's formula (checked in float64, with partial rotary and GQA)."""
    shape = SHAPES["T7-partial-32of80"]
    for layout in LAYOUTS:
        q, k = make_qk(gen, shape, torch.float64, layout, device="cpu")
        cos, sin = make_tables(gen, shape, torch.float64)
        ref = apply_rotary_reference(q, k, cos.cpu(), sin.cpu(), layout=layout)
        hf = hf_eager(q, k, cos.cpu(), sin.cpu(), layout=layout)
        for a, b in zip(ref, hf, strict=True):
            assert torch.equal(a, b)


# ---- cos / sin forms and position_ids ----


@pytest.mark.parametrize("form", ["[B,T,R]", "[1,T,R]", "[T,R]", "4-D", "expanded"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cos_sin_forms(layout, form, gen):
    shape = (2, 7, 3, 1, 64, 64)
    q, k = make_qk(gen, shape, torch.bfloat16, layout)
    cos, sin = make_tables(gen, shape, torch.bfloat16, batch_dim=False)  # [1, T, R]
    expected = apply_rotary(
        q, k, cos.expand(2, -1, -1).contiguous(), sin.expand(2, -1, -1).contiguous(), layout=layout
    )
    if form == "[B,T,R]":
        cos, sin = cos.expand(2, -1, -1).contiguous(), sin.expand(2, -1, -1).contiguous()
    elif form == "[T,R]":
        cos, sin = cos[0], sin[0]
    elif form == "4-D":
        axis = 1 if layout == "bhtd" else 2
        cos, sin = cos.unsqueeze(axis), sin.unsqueeze(axis)
    elif form == "expanded":
        cos, sin = cos.expand(2, -1, -1), sin.expand(2, -1, -1)
    got = apply_rotary(q, k, cos, sin, layout=layout)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    if form in ("[1,T,R]", "[T,R]"):
        check_case(form, q, k, cos, sin, gen, layout=layout)


POS_CASES = [  # (dtype, layout, form of position_ids)
    *((d, lay, "[B,T]") for d in (torch.float32, torch.bfloat16) for lay in LAYOUTS),
    *((torch.float32, "bhtd", form) for form in ("[1,T]", "[T]", "int32")),
]


@pytest.mark.parametrize(
    "dtype, layout, pos_form",
    POS_CASES,
    ids=lambda v: DTYPE_IDS.get(v, v) if isinstance(v, torch.dtype) else v,
)
def test_position_ids(dtype, layout, pos_form, gen):
    """cos/sin tables [max_pos, R] indexed by position_ids: the same as passing cos[position_ids]."""
    shape = (2, 7, 3, 2, 80, 32)
    max_pos = 50
    q, k = make_qk(gen, shape, dtype, layout)
    cos, sin = hf_tables(torch.arange(max_pos), 32, dtype)
    pos = torch.randint(0, max_pos, (2, 7), generator=gen)
    pos[0, :3] = pos[0, 3]  # repeated positions
    pos[1, -1] = max_pos - 1
    if pos_form in ("[1,T]", "[T]"):
        pos = pos[:1]
    pos = pos.to(DEVICE)
    pos_arg = pos[0] if pos_form == "[T]" else pos.int() if pos_form == "int32" else pos
    gathered = (cos[pos.expand(2, 7)], sin[pos.expand(2, 7)])
    got = apply_rotary(q, k, cos, sin, position_ids=pos_arg, layout=layout)
    expected = apply_rotary(q, k, *gathered, layout=layout)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    check_case(f"position_ids {pos_form}", q, k, cos, sin, gen, position_ids=pos.expand(2, 7), layout=layout)
    # a [1, max_pos, R] table is accepted too
    got3 = apply_rotary(q, k, cos[None], sin[None], position_ids=pos_arg, layout=layout)
    for a, b in zip(got3, expected, strict=True):
        assert torch.equal(a, b)


def test_out_of_range_position_gives_nan(gen, monkeypatch):
    """A position outside [0, max_pos): that token's rotary columns are NaN, never an out-of-bounds read;
    its pass-through columns and the other tokens are right. With FUSELM_VALIDATE=1: ValueError."""
    shape = (1, 5, 2, 1, 64, 32)
    q, k = make_qk(gen, shape, torch.float32, "bhtd")
    cos, sin = hf_tables(torch.arange(10), 32, torch.float32)
    pos = torch.tensor([[0, 3, 10, -1, 9]], device=DEVICE)
    expected = apply_rotary_reference(q, k, cos, sin, position_ids=pos.clamp(0, 9))
    good = [0, 1, 4]
    for fn in (apply_rotary, apply_rotary_reference):
        for o, x, e in zip(fn(q, k, cos, sin, position_ids=pos), (q, k), expected, strict=True):
            assert torch.isnan(o[:, :, 2:4, :32]).all()
            assert torch.equal(o[:, :, :, 32:], x[:, :, :, 32:])  # pass-through untouched
            assert torch.equal(o[:, :, good], e[:, :, good])
    monkeypatch.setenv("FUSELM_VALIDATE", "1")
    with pytest.raises(ValueError, match="position_ids"):
        apply_rotary(q, k, cos, sin, position_ids=pos)
    apply_rotary(q, k, cos, sin, position_ids=pos.clamp(0, 9))


# ---- strides: views of fused projections, no copies ----


def _strided_inputs(gen, kind, dtype):
    """q, k views as attention code makes them, plus the layout to call with."""
    b, t, hq, hk, d = 2, 7, 3, 1, 64
    if kind == "hf-transposed-view":  # q_proj(x).view(B, T, H, D).transpose(1, 2)
        q = torch.randn(b, t, hq, d, generator=gen).to(dtype).to(DEVICE).transpose(1, 2)
        k = torch.randn(b, t, hk, d, generator=gen).to(dtype).to(DEVICE).transpose(1, 2)
        return q, k, "bhtd"
    if kind == "fused-qkv-slice":  # qkv_proj(x).view(B, T, Hq + 2 Hk, D), split, transposed
        qkv = torch.randn(b, t, hq + 2 * hk, d, generator=gen).to(dtype).to(DEVICE)
        return qkv[:, :, :hq].transpose(1, 2), qkv[:, :, hq : hq + hk].transpose(1, 2), "bhtd"
    if kind == "bthd-of-contiguous-bhtd":
        q = torch.randn(b, hq, t, d, generator=gen).to(dtype).to(DEVICE).transpose(1, 2)
        k = torch.randn(b, hk, t, d, generator=gen).to(dtype).to(DEVICE).transpose(1, 2)
        return q, k, "bthd"
    if kind == "last-dim-strided":  # stride(-1) == 2: copied first (documented)
        q = torch.randn(b, hq, t, 2 * d, generator=gen).to(dtype).to(DEVICE)[..., ::2]
        k = torch.randn(b, hk, t, 2 * d, generator=gen).to(dtype).to(DEVICE)[..., ::2]
        return q, k, "bhtd"
    raise AssertionError(kind)


STRIDED = ["hf-transposed-view", "fused-qkv-slice", "bthd-of-contiguous-bhtd", "last-dim-strided"]


@pytest.mark.parametrize("kind", STRIDED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_strided_inputs(dtype, kind, gen):
    q, k, layout = _strided_inputs(gen, kind, dtype)
    assert not q.is_contiguous()
    cos, sin = make_tables(gen, (2, 7, 3, 1, 64, 64), dtype)
    (oq, ok), _ = check_case(kind, q, k, cos, sin, gen, layout=layout)
    if TRITON_PATH and kind in ("hf-transposed-view", "bthd-of-contiguous-bhtd"):
        # dense inputs: outputs in the same memory order (written as they are read)
        assert same_strides(oq, q) and same_strides(ok, k)


def same_strides(a, b):
    """Equal strides on every dimension of size > 1 (a size-1 dimension's stride means nothing)."""
    return a.shape == b.shape and all(
        sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride(), strict=True) if n > 1
    )


def spy_kernels(monkeypatch) -> tuple[LaunchSpy, LaunchSpy]:
    """(dense-rows kernel spy, per-position kernel spy), installed in rope's op module."""
    dense, per_position = LaunchSpy(rope_op.rope_fwd_dense_launch), LaunchSpy(rope_op.rope_fwd_launch)
    monkeypatch.setattr(rope_op, "rope_fwd_dense_launch", dense)
    monkeypatch.setattr(rope_op, "rope_fwd_launch", per_position)
    return dense, per_position


def not_dense(x: torch.Tensor) -> torch.Tensor:
    """x's values in a view that is dense in no memory order (rows twice as long as D): the launcher then
    takes the per-position kernel."""
    wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype, device=x.device)
    wide[..., : x.shape[-1]] = x
    return wide[..., : x.shape[-1]]


@triton_path_only
@pytest.mark.parametrize(
    "kind, kernel", [("hf-transposed-view", "dense"), ("fused-qkv-slice", "per-position")]
)
def test_strided_views_are_read_in_place(kind, kernel, gen, monkeypatch):
    """No copy of a view with a unit last stride: the kernel gets q's and k's own memory; dense views go
    to the dense-rows kernel, the others to the per-position kernel."""
    dense, per_position = spy_kernels(monkeypatch)
    q, k, layout = _strided_inputs(gen, kind, torch.bfloat16)
    cos, sin = make_tables(gen, (2, 7, 3, 1, 64, 64), torch.bfloat16)
    apply_rotary(q, k, cos, sin, layout=layout)
    used, unused = (dense, per_position) if kernel == "dense" else (per_position, dense)
    assert unused.calls == []
    (call,) = used.calls
    assert call["q_ptr"].data_ptr() == q.data_ptr() and call["k_ptr"].data_ptr() == k.data_ptr()
    assert call["cos_ptr"].data_ptr() == cos.data_ptr()


@triton_path_only
@pytest.mark.parametrize("kernel", ["dense", "per-position"])
def test_gqa_one_launch_each_way(kernel, gen, monkeypatch):
    """q and k (different head counts) in one launch forward and one backward, the bwd with IS_BWD. A
    not-dense input takes the per-position kernel forward; its gradients (dense) take the dense one."""
    dense, per_position = spy_kernels(monkeypatch)
    shape = (2, 7, 4, 2, 64, 64)
    q, k = make_qk(gen, shape, torch.bfloat16, "bhtd")
    if kernel == "per-position":
        q, k = not_dense(q), not_dense(k)
    cos, sin = make_tables(gen, shape, torch.bfloat16)
    qr, kr = q.detach().requires_grad_(), k.detach().requires_grad_()
    oq, ok = apply_rotary(qr, kr, cos, sin)
    (fwd,) = (dense if kernel == "dense" else per_position).calls
    assert fwd["IS_BWD"] is False
    assert fwd["N_QH"] == 4 and fwd["N_KH"] == 2
    (oq.float().square().sum() + ok.float().sum()).backward()
    assert len(dense.calls) + len(per_position.calls) == 2
    assert dense.calls[-1]["IS_BWD"] is True


@triton_path_only
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", ["plain", "partial-24of64", "position_ids", "k-other-order"])
def test_dense_and_per_position_kernels_agree_bit_for_bit(case, dtype, layout, gen, monkeypatch):
    """The two kernels compute the same fp32 formula: the same outputs and gradients, bit for bit, on the
    same values (dense inputs -> dense-rows kernel; a not-dense view of them -> per-position kernel)."""
    dense_spy, per_position = spy_kernels(monkeypatch)
    shape = (2, 9, 5, 3, 64, 24 if case == "partial-24of64" else 64)
    q, k = make_qk(gen, shape, dtype, layout)
    if case == "k-other-order":  # k dense in the other memory order than q
        k = k.transpose(1, 2).contiguous().transpose(1, 2)
    cos, sin = make_tables(gen, shape, dtype)
    kw = {"layout": layout}
    if case == "position_ids":
        cos, sin = hf_tables(torch.arange(40), shape[-1], dtype)
        kw["position_ids"] = torch.randint(0, 40, (2, 9), generator=gen).to(DEVICE)
    gos = grad_outputs(gen, (q, k))
    from_dense = fwd_bwd(ours, q, k, cos, sin, kw, gos)
    assert len(dense_spy.calls) == 2 and per_position.calls == []
    from_strided = fwd_bwd(ours, not_dense(q), not_dense(k), cos, sin, kw, [not_dense(g) for g in gos])
    assert len(per_position.calls) == 2 and len(dense_spy.calls) == 2
    for a, b in zip((*from_dense[0], *from_dense[1]), (*from_strided[0], *from_strided[1]), strict=True):
        assert torch.equal(a, b)


@triton_path_only
def test_dense_kernel_int64_index_math_gives_the_same_result(gen, monkeypatch):
    """The dense-rows kernel's int64 index path (taken past 2^31 elements; here forced by a zero limit)
    computes what the int32 path does, forward and backward, position_ids included."""
    shape = (2, 9, 5, 3, 64, 48)
    q, k = make_qk(gen, shape, torch.float32, "bhtd")
    cos, sin = hf_tables(torch.arange(40), 48, torch.float32)
    kw = {"position_ids": torch.randint(0, 40, (2, 9), generator=gen).to(DEVICE)}
    gos = grad_outputs(gen, (q, k))
    int32 = fwd_bwd(ours, q, k, cos, sin, kw, gos)
    dense, _ = spy_kernels(monkeypatch)
    monkeypatch.setattr(rope_op, "INT32_INDEX_LIMIT", 0)
    int64 = fwd_bwd(ours, q, k, cos, sin, kw, gos)
    assert [c["INDEX_64"] for c in dense.calls] == [True, True]
    for a, b in zip((*int32[0], *int32[1]), (*int64[0], *int64[1]), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_many_heads_walk_several_tiles(layout, gen, monkeypatch):
    """Head counts above one tile of the per-position kernel (MAX_TILE made tiny; not-dense inputs, which
    that kernel takes): it walks the heads tile after tile, the last tile masked; partial rotary and
    position_ids on that path too."""
    monkeypatch.setattr(rope_op, "MAX_TILE", 32)  # BLOCK_R = 16 -> 2 heads per tile
    rope_op._launch_config.cache_clear()
    try:
        assert rope_op.launch_config(5, 3, 32, 48)["BLOCK_HQ"] == 2
        shape = (2, 5, 5, 3, 48, 32)
        q, k = make_qk(gen, shape, torch.bfloat16, layout)
        q, k = not_dense(q), not_dense(k)
        cos, sin = make_tables(gen, shape, torch.bfloat16)
        check_case("several tiles", q, k, cos, sin, gen, layout=layout)
        cos_t, sin_t = hf_tables(torch.arange(9), 32, torch.bfloat16)
        pos = torch.randint(0, 9, (2, 5), generator=gen).to(DEVICE)
        check_case("several tiles, position_ids", q, k, cos_t, sin_t, gen, position_ids=pos, layout=layout)
    finally:
        rope_op._launch_config.cache_clear()


# ---- gradients ----


def test_only_q_used(gen):
    """k_embed unused: dk is zero (or None), dq right."""
    shape = (2, 7, 3, 1, 64, 64)
    q, k = make_qk(gen, shape, torch.float32, "bhtd")
    cos, sin = make_tables(gen, shape, torch.float32)
    qr, kr = q.clone().requires_grad_(), k.clone().requires_grad_()
    oq, _ = apply_rotary(qr, kr, cos, sin)
    g = torch.randn(oq.shape, generator=gen).to(DEVICE)
    oq.backward(g)
    qe, ke = q.clone().requires_grad_(), k.clone().requires_grad_()
    hf_eager(qe, ke, cos, sin)[0].backward(g)
    assert torch.equal(qr.grad, qe.grad)
    assert kr.grad is None or torch.equal(kr.grad, torch.zeros_like(k))  # reference: None, kernel: zeros


def test_stride_zero_grad_outputs(gen):
    """out.sum().backward() hands the backward expanded (stride 0) output gradients."""
    shape = (2, 7, 3, 1, 64, 32)
    q, k = make_qk(gen, shape, torch.bfloat16, "bthd")
    cos, sin = make_tables(gen, shape, torch.bfloat16)
    gos = [torch.ones((), dtype=x.dtype, device=DEVICE).expand(x.shape) for x in (q, k)]
    _, grads = fwd_bwd(ours, q, k, cos, sin, dict(layout="bthd"), gos)
    _, grads_e = fwd_bwd(hf_eager, q, k, cos, sin, dict(layout="bthd"), gos)
    _, grads_r = fwd_bwd(reference64, q, k, cos, sin, dict(layout="bthd"), gos)
    for what, o, e, r in zip(("dq", "dk"), grads, grads_e, grads_r, strict=True):
        assert_numerics(f"ones {what}", o, e, r, q.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_tables_requiring_grad_use_the_reference(dtype, gen, monkeypatch):
    """cos/sin that require grad: no gradient is dropped, the differentiable reference runs, and on the
    Triton path it says so once (one RuntimeWarning per process)."""
    from fuselm.ops._common import dispatch

    monkeypatch.setattr(dispatch, "_SAID", set())
    shape = (2, 5, 2, 1, 32, 32)
    q, k = make_qk(gen, shape, dtype, "bhtd")
    cos, sin = make_tables(gen, shape, dtype)
    gos = grad_outputs(gen, (q, k))

    def grads(fn, tensors):
        leaves = [t.detach().requires_grad_() for t in tensors]
        outs = fn(*leaves)
        return torch.autograd.grad(outs, leaves, [g.to(o.dtype) for g, o in zip(gos, outs, strict=True)])

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours_ = grads(apply_rotary, (q, k, cos, sin))
        grads(apply_rotary, (q, k, cos, sin))
    said = [str(w.message) for w in caught if "cos / sin require grad" in str(w.message)]
    assert len(said) == (1 if TRITON_PATH else 0), said
    eager = grads(hf_eager, (q, k, cos, sin))
    ref = grads(apply_rotary_reference, [t.double() for t in (q, k, cos, sin)])
    for what, o, e, r in zip(("dq", "dk", "dcos", "dsin"), ours_, eager, ref, strict=True):
        assert_numerics(f"tables with grad {what}", o, e, r, dtype)


def test_float64_runs_the_reference(gen):
    shape = SHAPES["T7-partial-32of80"]
    q, k = make_qk(gen, shape, torch.float64, "bthd")
    cos, sin = make_tables(gen, shape, torch.float64)
    check_case("fp64", q, k, cos, sin, gen, layout="bthd")


def test_empty_sequence():
    q = torch.randn(2, 3, 0, 64, device=DEVICE, requires_grad=True)
    k = torch.randn(2, 1, 0, 64, device=DEVICE, requires_grad=True)
    cos = torch.randn(2, 0, 64, device=DEVICE)
    oq, ok = apply_rotary(q, k, cos, cos)
    assert oq.shape == q.shape and ok.shape == k.shape
    (oq.sum() + ok.sum()).backward()
    assert q.grad.shape == q.shape


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=DTYPE_IDS.get)
def test_fp32_tables_with_low_precision_inputs(dtype, gen):
    """cos/sin in fp32 with fp16/bf16 q/k: outputs in q's dtype, computed from the fp32 tables (Hugging
    Face would cast the tables to q's dtype first: that is the eager side here)."""
    shape = (2, 7, 3, 1, 64, 64)
    q, k = make_qk(gen, shape, dtype, "bhtd")
    cos, sin = make_tables(gen, shape, torch.float32)
    check_case("fp32 tables", q, k, cos, sin, gen)


# ---- argument checking ----


def _bad_calls():
    q = torch.randn(2, 4, 5, 16, device=DEVICE)
    k = torch.randn(2, 2, 5, 16, device=DEVICE)
    cos = torch.randn(2, 5, 16, device=DEVICE)
    pos = torch.arange(5, device=DEVICE)[None].expand(2, 5)
    table = torch.randn(20, 16, device=DEVICE)
    ar = apply_rotary
    cases = {
        "q not a tensor": ("q", lambda: ar(q.tolist(), k, cos, cos)),
        "q int": ("q", lambda: ar(q.long(), k, cos, cos)),
        "q 3-D": ("q", lambda: ar(q[0], k, cos, cos)),
        "k not a tensor": ("k", lambda: ar(q, None, cos, cos)),
        "k dtype": ("k", lambda: ar(q, k.half(), cos, cos)),
        "k head dim": ("k", lambda: ar(q, k[..., :8], cos, cos)),
        "k seq len": ("k", lambda: ar(q, k[:, :, :4], cos, cos)),
        "k batch": ("k", lambda: ar(q, k[:1], cos, cos)),
        "layout": ("layout", lambda: ar(q, k, cos, cos, layout="bsnd")),
        "cos not a tensor": ("cos", lambda: ar(q, k, 1.0, cos)),
        "cos int": ("cos", lambda: ar(q, k, cos.long(), cos.long())),
        "cos seq len": ("cos", lambda: ar(q, k, cos[:, :4], cos[:, :4])),
        "cos batch": ("cos", lambda: ar(q, k, cos.repeat(2, 1, 1), cos.repeat(2, 1, 1))),
        "cos odd width": ("cos", lambda: ar(q, k, cos[..., :15], cos[..., :15])),
        "cos wider than head": ("cos", lambda: ar(q, k, cos.repeat(1, 1, 2), cos.repeat(1, 1, 2))),
        "cos 4-D not on head axis": ("cos", lambda: ar(q, k, cos[:, :, None], cos[:, :, None])),
        "cos 1-D": ("cos", lambda: ar(q, k, cos[0, 0], cos[0, 0])),
        "sin shape": ("sin", lambda: ar(q, k, cos, cos[:1])),
        "sin not a tensor": ("sin", lambda: ar(q, k, cos, None)),
        "position_ids float": ("position_ids", lambda: ar(q, k, table, table, position_ids=pos.float())),
        "position_ids shape": ("position_ids", lambda: ar(q, k, table, table, position_ids=pos[:, :4])),
        "position_ids batch": (
            "position_ids",
            lambda: ar(q, k, table, table, position_ids=pos.repeat(2, 1)),
        ),
        "cos not a table with position_ids": ("cos", lambda: ar(q, k, cos, cos, position_ids=pos)),
    }
    if ON_GPU:
        cases["k on another device"] = ("k", lambda: ar(q, k.cpu(), cos, cos))
        cases["cos on another device"] = ("cos", lambda: ar(q, k, cos.cpu(), cos.cpu()))
        cases["position_ids on another device"] = (
            "position_ids",
            lambda: ar(q, k, table, table, position_ids=pos.cpu()),
        )
    return cases


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_arguments_raise_value_error_naming_them(case):
    name, call = _bad_calls()[case]
    with pytest.raises(ValueError, match=name):
        call()


# ---- dispatch, export, docstring, compile, CUDA graphs ----


def test_dispatch_runs_the_expected_path(monkeypatch, gen):
    spy, _ = spy_kernels(monkeypatch)  # dense q and k: the dense-rows kernel
    ref_calls = []

    def reference_spy(*args, **kwargs):
        ref_calls.append(1)
        return apply_rotary_reference(*args, **kwargs)

    monkeypatch.setattr(rope_op, "apply_rotary_reference", reference_spy)
    shape = (1, 3, 2, 1, 16, 16)
    q, k = make_qk(gen, shape, torch.float32, "bhtd")
    cos, sin = make_tables(gen, shape, torch.float32)
    apply_rotary(q, k, cos, sin)
    assert (len(spy.calls), len(ref_calls)) == ((1, 0) if TRITON_PATH else (0, 1))
    apply_rotary(q.double(), k.double(), cos, sin)
    assert len(ref_calls) == (1 if TRITON_PATH else 2)


def test_exported_from_fuselm():
    assert fuselm.apply_rotary is apply_rotary
    assert "apply_rotary" in fuselm.__all__


def test_docstring_example_runs():
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    (test,) = finder.find(rope_op.apply_rotary, "apply_rotary", globs={})
    result = runner.run(test)
    assert result.failed == 0 and result.attempted > 0


COMPILE_CASES = {
    "bhtd": (SHAPES["T7-partial-32of80"], "bhtd", False),
    "bthd+position_ids": ((2, 7, 3, 1, 64, 64), "bthd", True),
}


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("case", list(COMPILE_CASES))
def test_torch_compile_fullgraph(case, backend, gen):
    torch._dynamo.reset()
    shape, layout, with_pos = COMPILE_CASES[case]
    dtype = torch.bfloat16 if ON_GPU else torch.float32

    def inputs():
        q, k = make_qk(gen, shape, dtype, layout)
        if with_pos:
            cos, sin = hf_tables(torch.arange(40), shape[-1], dtype)
            pos = torch.randint(0, 40, shape[:2], generator=gen).to(DEVICE)
            return q, k, cos, sin, dict(position_ids=pos, layout=layout)
        return q, k, *make_tables(gen, shape, dtype), dict(layout=layout)

    def fn(q, k, cos, sin, position_ids=None, layout="bhtd"):
        # q, k as activations of the graph, as in a model
        return apply_rotary(q * 1.0, k * 1.0, cos, sin, position_ids=position_ids, layout=layout)

    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    for call in ("1st call", "2nd call"):
        q, k, cos, sin, kw = inputs()
        check_case(f"compiled {case} {call}", q, k, cos, sin, gen, fn=compiled, **kw)
    torch._dynamo.reset()


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay(gen):
    """Forward + backward captured once and replayed on new data: no host syncs on the hot path."""
    shape = (2, 128, 8, 2, 128, 128)
    q, k = make_qk(gen, shape, torch.bfloat16, "bhtd")
    cos, sin = make_tables(gen, shape, torch.bfloat16)
    qs, ks = q.clone().requires_grad_(), k.clone().requires_grad_()
    gq, gk = grad_outputs(gen, (q, k))

    def step():
        oq, ok = apply_rotary(qs, ks, cos, sin)
        return (oq, ok, *torch.autograd.grad((oq, ok), (qs, ks), (gq, gk)))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    q2, k2 = make_qk(gen, shape, torch.bfloat16, "bhtd")
    with torch.no_grad():
        qs.copy_(q2)
        ks.copy_(k2)
    graph.replay()
    torch.cuda.synchronize()
    out, grads = fwd_bwd(ours, q2, k2, cos, sin, {}, [gq, gk])
    for a, b in zip(static, (*out, *grads), strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.slow
def test_int64_addressing_past_2_31_elements():
    """q [1, 64, T, 128] bf16 contiguous with 64 * T * 128 > 2^31 elements (4.3 GB): head 63 starts past
    element 2^31. Forward, then backward with grad_output = the outputs (dq = R(-theta) R(theta) q ~ q);
    about 15 GB in all. Checked on the last positions of the last heads against the float64 reference."""
    b, hq, hk, d = 1, 64, 8, 128
    t = (1 << 31) // (hq * d) + 63
    assert b * hq * t * d > 2**31
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, hq, t, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    k = torch.randn(b, hk, t, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    cos, sin = hf_tables(torch.arange(t, device="cuda")[None], d, torch.bfloat16)
    oq, ok = apply_rotary(q, k, cos, sin)
    dq, dk = torch.autograd.grad((oq, ok), (q, k), (oq, ok))
    for heads, times in ((slice(-3, None), slice(-5, None)), (slice(0, 2), slice(0, 5))):
        sl = (slice(None), heads, times)
        qs, ks = q.detach()[sl], k.detach()[sl]
        cs, ss = cos[:, times], sin[:, times]
        gos = [oq.detach()[sl], ok.detach()[sl]]
        ref, gref = fwd_bwd(reference64, qs, ks, cs, ss, {}, gos)
        eag, geag = fwd_bwd(hf_eager, qs, ks, cs, ss, {}, gos)
        for what, o, e, r in zip(
            ("q_embed", "k_embed", "dq", "dk"),
            (oq.detach()[sl], ok.detach()[sl], dq[sl], dk[sl]),
            (*eag, *geag),
            (*ref, *gref),
            strict=True,
        ):
            assert_numerics(f"int64 {heads} {times} {what}", o, e, r, torch.bfloat16)
