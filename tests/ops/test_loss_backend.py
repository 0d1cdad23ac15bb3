"""The loss family's row backend as code: LocalRows and the vocabulary shard implement the RowBackend
protocol (ops/_common/loss/backend.py) with its exact signatures, so a change of the contract shows here
rather than as a TypeError in one of the two."""

from __future__ import annotations

import inspect

import pytest

from fuselm.ops._common.loss.backend import RowBackend
from fuselm.ops._common.loss.rows import LocalRows

METHODS = ("scales_for_forward", "forward", "backward", "reduce_input_grad_")


def _backends():
    shard = pytest.importorskip("fuselm.distributed.shard")
    return {"LocalRows": LocalRows, "VocabShard": shard.VocabShard}


@pytest.mark.parametrize("name", ["LocalRows", "VocabShard"])
def test_backend_has_the_protocols_signatures(name):
    cls = _backends()[name]
    for method in METHODS:
        want = inspect.signature(getattr(RowBackend, method))
        got = inspect.signature(getattr(cls, method))
        assert list(got.parameters) == list(want.parameters), (name, method)
        for p_got, p_want in zip(got.parameters.values(), want.parameters.values(), strict=True):
            assert p_got.kind == p_want.kind and p_got.default == p_want.default, (name, method, p_got)


def test_local_rows_is_a_row_backend():
    rows = LocalRows(7)
    assert isinstance(rows, RowBackend) and rows.n_classes == 7


def test_an_incomplete_backend_is_not_one():
    class NoBackward:
        n_classes = 3

        def forward(self, logits, target, opts, scales, grad, predicted=None): ...

        def reduce_input_grad_(self, dx): ...

    assert not isinstance(NoBackward(), RowBackend)


FAMILY_OPS = (
    "loss_rows_fwd",
    "loss_rows_fwd_inplace",
    "loss_rows_bwd",
    "loss_rows_bwd_inplace",
    "linear_cross_entropy_fwd",
    "linear_cross_entropy_bwd",
    "linear_log_probs_fwd",
    "linear_log_probs_bwd",
)


@pytest.mark.parametrize("op", FAMILY_OPS)
def test_family_op_schemas_carry_every_scalar_option(op):
    """The custom ops' schemas are derived from LossOptions (family_custom_op): every scalar field, by its
    name and type, is an argument of every op of the family, so a new scalar option is one LossOptions
    field (plus its kernel code) and reaches torch.compile's graphs with no schema or fake edited."""
    import torch

    import fuselm  # noqa: F401 - registers the ops
    from fuselm.ops._common.loss.options import SCALAR_FIELDS, LossOptions

    schema = getattr(torch.ops.fuselm, op).default._schema
    arguments = {a.name: str(a.type) for a in schema.arguments}
    types = {int: "int", str: "str", float: "float"}
    for name in SCALAR_FIELDS:
        assert arguments.get(name) == types[type(getattr(LossOptions(), name))], (op, name, arguments)
    assert not any(a.kwarg_only for a in schema.arguments), "inductor calls fallback ops positionally"


def test_family_op_called_positionally_or_by_name():
    """Inductor's generated code passes every argument positionally; eager code by name: the function sees
    the same tensors and named scalars either way."""
    import torch

    from fuselm.ops._common.loss.options import LossOptions, family_custom_op, options_of

    seen = []

    @family_custom_op("fuselm_test::rows", tensors="Tensor logits", flags="bool flag", returns="Tensor")
    def rows(logits, weight, token_weights, weight_sum, grad_scale, **named):
        seen.append((options_of(named, weight, token_weights), named["flag"]))
        return logits.clone()

    opts = LossOptions.of(label_smoothing=0.25, softcap=3.0)
    x, one = torch.ones(2), torch.ones(1)
    rows(x, None, None, None, one, **opts.op_kwargs(tensors=False), flag=True)
    rows(x, None, None, None, one, *opts.op_kwargs(tensors=False).values(), True)
    assert seen[0] == seen[1] == (opts, True)


def _family_op_cases():
    """(op, args, kwargs) of every family custom op on small inputs (the Triton path's device)."""
    import torch
    from conftest import kernel_device

    from fuselm.ops._common.loss.options import LossOptions

    device = kernel_device()
    g = torch.Generator().manual_seed(0)
    opts = LossOptions.of(label_smoothing=0.1, z_loss=1e-3).op_kwargs(tensors=False)
    logits = torch.randn(6, 37, generator=g).to(device)
    x, w = torch.randn(6, 16, generator=g).to(device), torch.randn(37, 16, generator=g).to(device)
    t = torch.randint(0, 37, (6,), generator=g).to(device)
    t[0] = -100
    gs, dloss = torch.full((1,), 0.2, device=device), torch.full((1,), 0.5, device=device)
    scales = (None, None, None, gs)
    ops = torch.ops.fuselm
    lse = ops.loss_rows_fwd(logits, t, *scales, **opts, compute_grad=False, compute_predicted=False)[1]
    plan = {"kind": "chunked", "chunk_rows": 4, "fp32_weight_grad": False}
    needs = {"need_dx": True, "need_dw": True, "need_db": False}
    slabs = {"budget": 1 << 20, "slab_floor": 8, "fixed_in_budget": True}
    llp_lse = ops.linear_log_probs_fwd(x, w, None, t, **opts, **slabs, stats=0)[2]
    return [
        (ops.loss_rows_fwd, (logits, t, *scales), {**opts, "compute_grad": True, "compute_predicted": True}),
        (ops.loss_rows_fwd_inplace, (logits.clone(), t, *scales), {**opts, "compute_predicted": False}),
        (ops.loss_rows_bwd, (logits, t, *scales, dloss, None, lse), opts),
        (ops.loss_rows_bwd_inplace, (logits.clone(), t, *scales, dloss, None, lse), opts),
        (
            ops.linear_cross_entropy_fwd,
            (x, w, None, t, *scales),
            {**opts, **plan, **needs, "compute_grad": True, "compute_predicted": False},
        ),
        (ops.linear_cross_entropy_bwd, (x, w, None, t, *scales, dloss, None, lse), {**opts, **plan, **needs}),
        (ops.linear_log_probs_fwd, (x, w, None, t), {**opts, **slabs, "stats": 0}),
        (
            ops.linear_log_probs_bwd,
            (x, w, None, t, llp_lse, None, torch.ones(6, device=device), None, None),
            {**opts, **slabs, **needs},
        ),
    ]


def test_family_ops_pass_torch_library_opcheck():
    """torch.library.opcheck on every family custom op: the schema (mutations declared), the fake against
    the real implementation, autograd registration and AOT dispatch. Needs the Triton path (the ops launch
    kernels): CUDA, or the CPU under TRITON_INTERPRET=1."""
    import torch
    from conftest import TRITON_PATH

    if not TRITON_PATH:
        pytest.skip("the family's custom ops launch Triton kernels: CUDA or TRITON_INTERPRET=1")
    cases = _family_op_cases()
    assert len(cases) == len(FAMILY_OPS)
    for op, args, kwargs in cases:
        result = torch.library.opcheck(op.default, args, kwargs)
        assert set(result.values()) == {"SUCCESS"}, (op, result)
