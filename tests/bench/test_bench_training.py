"""The shared pieces of the lab: its training loop, the argument parsers, the report helpers (their
docstring examples)."""

from __future__ import annotations

import doctest

import pytest
import torch
from fuselm_bench import arguments, cases, fresh_process, harness, nf4_checkpoint, report, training


@pytest.mark.parametrize(
    "module",
    [training, arguments, report, fresh_process, harness, cases, nf4_checkpoint],
    ids=lambda m: m.__name__,
)
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_train_times_the_steps_after_warmup_and_meters_the_first():
    w = torch.nn.Parameter(torch.ones(4, 4))
    seen = []

    def forward(x):
        loss = (x @ w).sin().sum()
        return loss, torch.stack([loss.detach(), loss.detach() * 2])

    run = training.train(
        forward,
        [w],
        [torch.ones(2, 4)] * 5,
        lr=0.01,
        fused_adamw=False,
        warmup=2,
        measure_saved=True,
        on_step=lambda step, values: seen.append(step),
    )
    assert seen == [0, 1, 2, 3, 4] and len(run.logged) == 5 and run.logged[0][1] == 2 * run.logged[0][0]
    assert run.timed_steps == 3 and run.timed_s > 0 and run.seconds >= run.timed_s + run.warmup_s - 1e-9
    assert run.tokens_per_s(8) == pytest.approx(3 * 8 / run.timed_s)
    assert run.saved_bytes == 2 * 4 * 4 + 2 * 4 * 4  # the matmul's x and sin's input, fp32; w excluded
    none_timed = training.train(forward, [w], [torch.ones(2, 4)], lr=0.01, fused_adamw=False, warmup=1)
    assert (
        none_timed.timed_s is None and none_timed.tokens_per_s(8) is None and none_timed.saved_bytes is None
    )


def test_saved_tensor_meter_counts_live_storages_once():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    with training.SavedTensorMeter(exclude=[w]) as meter:
        y = (x @ w).sin()  # mm saves x (w excluded), sin saves its [4, 8] input
        z = (y * y).sum()  # saves y twice: one storage
        assert meter.live_bytes() == 3 * 4 * 8 * 4
        del y, z
        assert meter.live_bytes() == 0  # the graph is gone: nothing is saved any more


def test_build_llama_matches_transformers_own_build():
    """The shared build (default dtype set, then the constructor) gives the weights transformers' own
    ``_from_config(dtype=...)`` gives for the same seed: the e2e benchmark's init did not change."""
    pytest.importorskip("transformers")
    from fuselm_bench import e2e
    from transformers import LlamaForCausalLM

    config = training.causal_lm_config("llama", e2e.MODELS[e2e.DEFAULT_MODEL].settings(tiny=True), "sdpa")
    torch.manual_seed(0)
    ours = training.build_causal_lm(config, "cpu", torch.bfloat16)
    torch.manual_seed(0)
    theirs = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    for (name, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert ours.model.rotary_emb.inv_freq.dtype == torch.float32 and ours.training
    assert config._attn_implementation == "sdpa" and not config.use_cache
