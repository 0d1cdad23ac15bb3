"""The shared pieces of the lab: its model building, the argument parsers, the report helpers (their
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
