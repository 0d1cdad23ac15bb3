"""DTensor inputs to the row-wise block ops (ops/_common/dtensor.py): rms_norm, layer_norm, swiglu /
geglu (+ packed), apply_rotary.

On a one-rank gloo mesh (this process): every supported placement gives the op's plain-tensor
results bit for bit, outputs keep the inputs' placements, gradients reach the DTensor inputs with the
right placements; every unsupported one raises ValueError saying what to pass. On two ranks (spawned,
gloo): uneven shards, and the weight gradient summed over ranks (Partial) is the whole one.
Both the reference path and, under TRITON_INTERPRET=1, the kernels.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fuselm
from fuselm.ops._common.testing import assert_numerics
from fuselm.ops.rope import apply_rotary
from fuselm.ops.swiglu import swiglu_linear

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

if dist.is_available():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """A one-rank gloo process group in this process (torn down after the module if created here)."""
    created = not dist.is_initialized()
    if created:
        init = tmp_path_factory.mktemp("gloo") / "init"
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    if created:
        dist.destroy_process_group()


def rope_tables(gen, batch, seq, rot):
    angle = torch.rand(batch, seq, rot // 2, generator=gen) * 6.0
    emb = torch.cat([angle, angle], -1)
    return emb.cos(), emb.sin()


# name: (op taking tensors, {input: (shape, placement or None for a plain tensor)}, shape of the grads)
def _cases():
    rms = lambda x, w, residual=None: fuselm.rms_norm(x, w, residual=residual, offset=1.0, casting="gemma")  # noqa: E731
    ln = lambda x, w, b, residual=None: fuselm.layer_norm(x, w, b, residual=residual)  # noqa: E731
    rope_bhtd = lambda q, k, cos, sin: apply_rotary(q, k, cos, sin)  # noqa: E731
    rope_bthd = lambda q, k, cos, sin: apply_rotary(q, k, cos, sin, layout="bthd")  # noqa: E731

    def rope_pos(q, k, cos, sin, position_ids):
        return apply_rotary(q, k, cos, sin, position_ids=position_ids)

    x, h = (2, 3, 16), (16,)
    S0, S1, S2, R = Shard(0), Shard(1), Shard(2), Replicate()
    return {
        "rms_norm Shard(0), weight Replicate": (rms, dict(x=(x, S0), w=(h, R))),
        "rms_norm Shard(1), plain weight": (rms, dict(x=(x, S1), w=(h, None))),
        "rms_norm Replicate": (rms, dict(x=(x, R), w=(h, R))),
        "rms_norm residual Shard(1)": (rms, dict(x=(x, S1), w=(h, R), residual=(x, S1))),
        "rms_norm Shard(-2)": (rms, dict(x=(x, Shard(-2)), w=(h, R))),
        "layer_norm Shard(1)": (ln, dict(x=(x, S1), w=(h, R), b=(h, R))),
        "layer_norm residual Shard(0)": (ln, dict(x=(x, S0), w=(h, None), b=(h, R), residual=(x, S0))),
        "swiglu Shard(-1)": (fuselm.swiglu, dict(gate=(x, Shard(-1)), up=(x, Shard(-1)))),
        "swiglu Shard(0)": (fuselm.swiglu, dict(gate=(x, S0), up=(x, S0))),
        "geglu Shard(2)": (fuselm.geglu, dict(gate=(x, S2), up=(x, S2))),
        "swiglu_packed Shard(1)": (fuselm.swiglu_packed, dict(gate_up=(x, S1))),
        "geglu_packed Replicate": (fuselm.geglu_packed, dict(gate_up=(x, R))),
        "rope bhtd heads Shard(1)": (
            rope_bhtd,
            dict(q=((2, 4, 3, 8), S1), k=((2, 2, 3, 8), S1), cos=((2, 3, 8), R), sin=((2, 3, 8), None)),
        ),
        "rope bthd heads Shard(2), partial rotary": (
            rope_bthd,
            dict(q=((2, 3, 4, 8), S2), k=((2, 3, 2, 8), S2), cos=((2, 3, 4), None), sin=((2, 3, 4), None)),
        ),
        "rope position_ids": (
            rope_pos,
            dict(
                q=((2, 4, 3, 8), S1),
                k=((2, 2, 3, 8), S1),
                cos=((10, 8), R),
                sin=((10, 8), R),
                position_ids=((2, 3), R),
            ),
        ),
    }


def _plain_inputs(spec, gen):
    out = {}
    for name, (shape, _) in spec.items():
        if name == "position_ids":
            out[name] = torch.randint(0, 10, shape, generator=gen)
        elif name in ("cos", "sin"):
            out[name] = (torch.rand(shape, generator=gen) * 6).cos()
        else:
            out[name] = torch.randn(shape, generator=gen)
    return out


@pytest.mark.parametrize("case", list(_cases()))
def test_supported_placements_match_plain_tensors(case, mesh, gen):
    fn, spec = _cases()[case]
    plain = _plain_inputs(spec, gen)
    grad_names = [n for n in plain if plain[n].is_floating_point() and n not in ("cos", "sin")]
    leaves = {n: t.clone().requires_grad_(n in grad_names) for n, t in plain.items()}
    want = fn(**leaves)
    want = want if isinstance(want, tuple) else (want,)
    gos = [torch.randn(o.shape, generator=gen) for o in want]
    want_grads = torch.autograd.grad(want, [leaves[n] for n in grad_names], gos)

    dist_in = {}
    for n, t in plain.items():
        placement = spec[n][1]
        t = t.clone() if placement is None else distribute_tensor(t, mesh, [placement])
        dist_in[n] = t.requires_grad_(n in grad_names)
    got = fn(**dist_in)
    got = got if isinstance(got, tuple) else (got,)
    lead = next(n for n, (_, p) in spec.items() if p is not None and n in grad_names)
    row_placements = dist_in[lead].placements[0]
    for g, w in zip(got, want, strict=True):
        assert isinstance(g, DTensor) and tuple(g.placements) == (row_placements,)
        assert g.shape == w.shape and g.stride() == w.stride()
        assert torch.equal(g.full_tensor(), w)
    dgos = [distribute_tensor(go, mesh, [row_placements]) for go in gos]
    got_grads = torch.autograd.grad(got, [dist_in[n] for n in grad_names], dgos)
    for n, g, w in zip(grad_names, got_grads, want_grads, strict=True):
        placement = spec[n][1]
        if placement is None:  # a plain operand: this rank's share (all of it on one rank)
            assert not isinstance(g, DTensor)
        else:
            whole = len(spec[n][0]) == 1  # a norm's weight / bias: summed over the sharded rows
            sharded = isinstance(row_placements, Shard)
            expect = (Partial() if sharded else Replicate()) if whole else dist_in[n].placements[0]
            assert isinstance(g, DTensor) and tuple(g.placements) == (expect,), (n, g.placements)
            g = g.full_tensor()
        assert torch.equal(g, w), n


def _bad_calls(mesh):
    def dt(shape, placement):
        return distribute_tensor(torch.randn(shape), mesh, [placement])

    x, w = (2, 3, 16), (16,)
    R = Replicate()
    cs = torch.randn(2, 3, 8)
    return {
        "norm sharded on H": ("x is sharded on dimension 2", lambda: fuselm.rms_norm(dt(x, Shard(2)), None)),
        "norm sharded on -1": ("Replicate", lambda: fuselm.layer_norm(dt(x, Shard(-1)), None, None)),
        "weight sharded": ("weight must be whole", lambda: fuselm.rms_norm(dt(x, Shard(0)), dt(w, Shard(0)))),
        "bias sharded": ("bias must be whole", lambda: fuselm.layer_norm(dt(x, R), None, dt(w, Shard(0)))),
        "partial x": (
            "redistribute",
            lambda: fuselm.rms_norm(DTensor.from_local(torch.randn(x), mesh, [Partial()]), None),
        ),
        "residual plain": (
            "residual must be a DTensor",
            lambda: fuselm.rms_norm(dt(x, Shard(0)), None, residual=torch.randn(x)),
        ),
        "residual other placement": (
            "residual must be a DTensor",
            lambda: fuselm.rms_norm(dt(x, Shard(0)), None, residual=dt(x, Shard(1))),
        ),
        "weight DTensor, x plain": ("full_tensor", lambda: fuselm.rms_norm(torch.randn(x), dt(w, R))),
        "swiglu placements differ": (
            "up must be a DTensor",
            lambda: fuselm.swiglu(dt(x, Shard(2)), dt(x, R)),
        ),
        "packed sharded on 2I": ("gate | up", lambda: fuselm.swiglu_packed(dt(x, Shard(2)))),
        "swiglu_linear": ("swiglu_linear", lambda: swiglu_linear(dt(x, R), dt(x, R), torch.randn(4, 16))),
        "rope sharded on T": (
            "per head",
            lambda: apply_rotary(dt((2, 4, 3, 8), Shard(2)), dt((2, 2, 3, 8), Shard(2)), cs, cs),
        ),
        "rope sharded on batch": (
            "local",
            lambda: apply_rotary(
                dt((2, 3, 4, 8), Shard(0)), dt((2, 3, 2, 8), Shard(0)), cs, cs, layout="bthd"
            ),
        ),
        "rope cos sharded": (
            "cos must be whole",
            lambda: apply_rotary(
                dt((2, 4, 3, 8), Shard(1)), dt((2, 2, 3, 8), Shard(1)), dt((2, 3, 8), Shard(1)), cs
            ),
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "norm sharded on H",
        "norm sharded on -1",
        "weight sharded",
        "bias sharded",
        "partial x",
        "residual plain",
        "residual other placement",
        "weight DTensor, x plain",
        "swiglu placements differ",
        "packed sharded on 2I",
        "swiglu_linear",
        "rope sharded on T",
        "rope sharded on batch",
        "rope cos sharded",
    ],
)
def test_unsupported_placements_raise_value_error_saying_what_to_pass(case, mesh):
    match, call = _bad_calls(mesh)[case]
    with pytest.raises(ValueError, match=match):
        call()


# ---- two ranks (spawned gloo processes): uneven shards, gradients summed over ranks ----


def _two_rank_worker(rank, world_size):
    """Runs on every rank: rms_norm + residual on Shard(1) of [2, 5, 16] (uneven: 3 + 2 rows), swiglu
    on Shard(-1), apply_rotary on heads; returns max |DTensor result - whole-tensor result| per item, and
    dweight (DTensor's, whole-tensor fuselm's, float64)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(0)  # the same inputs on every rank
    x, r, go = (torch.randn(2, 5, 16, generator=g) for _ in range(3))
    w = torch.rand(16, generator=g)
    gate, up = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    q, k = torch.randn(2, 4, 3, 8, generator=g), torch.randn(2, 2, 3, 8, generator=g)
    cos, sin = torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 8, generator=g)
    errs = {}

    leaves = [t.clone().requires_grad_() for t in (x, r, w)]
    y, s = fuselm.rms_norm(leaves[0], leaves[2], residual=leaves[1])
    want = (y, s, *torch.autograd.grad((y, s), leaves, (go, go)))
    dleaves = [
        distribute_tensor(t, mesh, [p]).requires_grad_()
        for t, p in zip((x, r, w), (Shard(1),) * 2 + (Replicate(),), strict=True)
    ]
    y, s = fuselm.rms_norm(dleaves[0], dleaves[2], residual=dleaves[1])
    dgo = distribute_tensor(go, mesh, [Shard(1)])
    got = (y, s, *torch.autograd.grad((y, s), dleaves, (dgo, dgo)))
    for name, a, b in zip(("y", "sum", "dx", "dresidual"), got, want, strict=False):
        errs[f"rms_norm {name}"] = (a.full_tensor() - b).abs().max().item()
    # dweight: the ranks' partial sums added in another order (the numerics rule, in the caller)
    leaves = [t.double().requires_grad_() for t in (x, r, w)]
    y, s = fuselm.rms_norm(leaves[0], leaves[2], residual=leaves[1])
    ref = torch.autograd.grad((y, s), leaves[2], (go.double(), go.double()))[0]
    dweight = (got[4].full_tensor(), want[4], ref)

    out = fuselm.swiglu(*(distribute_tensor(t, mesh, [Shard(-1)]) for t in (gate, up)))
    errs["swiglu"] = (out.full_tensor() - fuselm.swiglu(gate, up)).abs().max().item()

    qe, ke = apply_rotary(*(distribute_tensor(t, mesh, [Shard(1)]) for t in (q, k)), cos, sin)
    qw, kw = apply_rotary(q, k, cos, sin)
    errs["rope q"] = (qe.full_tensor() - qw).abs().max().item()
    errs["rope k"] = (ke.full_tensor() - kw).abs().max().item()
    return errs, dweight


def test_two_ranks_match_whole_tensors():
    from kit.workers import run_workers

    for errs, dweight in run_workers(_two_rank_worker, 2, backend="gloo", timeout=300):
        assert max(errs.values()) == 0.0, errs
        assert_numerics("dweight (Partial, summed over 2 ranks)", *dweight, torch.float32)
