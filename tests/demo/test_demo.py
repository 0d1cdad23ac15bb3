"""CPU tests of ``fuselm demo``: the shipped corpus, the two training runs, the outputs, the CLI."""

from __future__ import annotations

import dataclasses
import doctest
import json
import sys
from importlib import resources

import pytest
import torch

from fuselm.cli import main
from fuselm.demo import train as demo
from fuselm.ops._common.testing import assert_numerics

# A few seconds for both runs on 2 cores: GQA, tied embeddings, the 256-byte vocabulary, fp32.
TINY = dict(
    hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=256,
)  # fmt: skip


def tiny_settings(steps: int = 8) -> demo.DemoSettings:
    return dataclasses.replace(
        demo.default_settings("cpu", steps=steps, batch=2, seq=64), size=TINY, warmup=1
    )


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One demo run (module-scoped: the runs are the expensive part) and the folder it wrote to."""
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("demo")
    settings = tiny_settings()
    return settings, demo.run_demo(settings, out, progress=False, log=lambda *a: None), out


# ---- corpus and batches ----


def test_corpus_ships_with_the_package():
    text = resources.files("fuselm.demo").joinpath("corpus.txt").read_text(encoding="utf-8")
    assert 20_000 <= len(text.encode()) <= 40_000
    assert demo.load_corpus() == text.encode()
    words = text.split()
    assert len(words) > 3000 and len(set(words)) > 1000  # prose, not a repeated line
    assert all(b < 128 for b in demo.load_corpus())  # plain text: one byte per character


def test_batches_are_seeded_byte_windows():
    data = demo.load_corpus()
    a = demo.sample_batches(data, steps=3, batch=2, seq=16, seed=0)
    b = demo.sample_batches(data, steps=3, batch=2, seq=16, seed=0)
    c = demo.sample_batches(data, steps=3, batch=2, seq=16, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))
    for row in a[0]:
        window = bytes(row.tolist())
        assert window in data
    with pytest.raises(ValueError, match="seq"):
        demo.sample_batches(b"abc", steps=1, batch=1, seq=4, seed=0)


def test_default_settings():
    cpu = demo.default_settings("cpu")
    assert cpu.size == demo.CPU_SIZE and cpu.dtype == torch.float32
    gpu = demo.default_settings("cuda", steps=5, seq=512)
    assert gpu.size["vocab_size"] == 128256 and gpu.size["hidden_size"] == 2048
    assert gpu.size["num_hidden_layers"] == 16
    assert gpu.dtype == torch.bfloat16 and (gpu.steps, gpu.batch, gpu.seq) == (5, 2, 512)
    with pytest.raises(ValueError, match="device"):
        demo.default_settings("tpu")
    with pytest.raises(ValueError, match="steps"):
        demo.default_settings("cpu", steps=0)


def test_build_model_matches_transformers_own_build():
    """The demo's build (default dtype set, then the constructor) gives the weights transformers' own
    ``_from_config(dtype=...)`` gives for the same seed, with fp32 rotary buffers, sdpa and no cache."""
    pytest.importorskip("transformers")
    from transformers import LlamaForCausalLM

    settings = dataclasses.replace(tiny_settings(), dtype=torch.bfloat16)
    torch.manual_seed(0)
    ours = demo.build_model(settings)
    torch.manual_seed(0)
    theirs = LlamaForCausalLM._from_config(ours.config, dtype=torch.bfloat16, attn_implementation="sdpa")
    for (name, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert ours.model.rotary_emb.inv_freq.dtype == torch.float32 and ours.training
    assert ours.config._attn_implementation == "sdpa" and not ours.config.use_cache
    assert ours.config.tie_word_embeddings and ours.config.vocab_size == 256


def test_saved_tensor_meter_counts_live_storages_once():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    with demo.SavedTensorMeter(exclude=[w]) as meter:
        y = (x @ w).sin()  # mm saves x (w excluded), sin saves its [4, 8] input
        z = (y * y).sum()  # saves y twice: one storage
        assert meter.live_bytes() == 3 * 4 * 8 * 4
        del y, z
        assert meter.live_bytes() == 0  # the graph is gone: nothing is saved any more


def test_compare():
    c = demo.compare([4.0, 2.0], [4.0, 2.002])
    assert c["max_abs"] == pytest.approx(0.002) and c["max_rel"] == pytest.approx(0.001)
    assert c["curve_rel"] == pytest.approx(0.002 / 20**0.5)
    with pytest.raises(ValueError, match="same nonzero length"):
        demo.compare([1.0], [1.0, 2.0])


# ---- the two runs ----


def test_runs_write_png_and_json(tiny_run):
    settings, result, out = tiny_run
    assert result.paths == {"json": str(out / demo.JSON_NAME), "png": str(out / demo.PNG_NAME)}
    assert (out / demo.PNG_NAME).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads((out / demo.JSON_NAME).read_text())
    assert record["settings"]["steps"] == settings.steps and record["settings"]["dtype"] == "float32"
    for name in ("hf", "fuselm"):
        run = record["runs"][name]
        assert len(run["losses"]) == settings.steps and run["peak_bytes"] is None
        assert run["tokens_per_s"] > 0 and run["saved_bytes"] > 0
    assert record["comparison"] == pytest.approx(result.comparison)
    table = demo.format_table(result)
    assert "| HF transformers, eager |" in table and "| fuselm.hf.patch |" in table
    assert "n/a (CPU)" in table and "loss agreement" in table


def test_runs_learn(tiny_run):
    _, result, _ = tiny_run
    for run in (result.hf, result.fuselm):
        assert run.losses[0] == pytest.approx(torch.log(torch.tensor(256.0)).item(), rel=0.05)
        assert run.losses[-1] < run.losses[0] - 0.5


def test_fuselm_saves_less_for_backward(tiny_run):
    # the patched MLP keeps gate and up (not act(gate) and the product); the fused loss keeps no logits
    _, result, _ = tiny_run
    assert result.fuselm.saved_bytes < result.hf.saved_bytes


def test_loss_curves_agree_by_the_numerics_rule(tiny_run):
    """The numerics rule of docs/design.md on the loss curve: the fuselm fp32 run must be as close to a
    float64 run (HF, unpatched, same init and batches) as the HF fp32 run is, up to fp32's atol."""
    settings, result, _ = tiny_run
    state = demo.initial_state(settings)
    batches = demo.sample_batches(
        demo.load_corpus(), steps=settings.steps, batch=settings.batch, seq=settings.seq, seed=settings.seed
    )
    model = demo.build_model(settings, torch.float64, state)
    f64 = demo.train(model, batches, lr=settings.lr, name="fp64", warmup=settings.warmup, progress=False)
    assert_numerics(
        "loss curve",
        torch.tensor(result.fuselm.losses),
        torch.tensor(result.hf.losses),
        torch.tensor(f64.losses, dtype=torch.float64),
        dtype=torch.float32,
    )
    assert result.comparison["curve_rel"] == pytest.approx(
        demo.compare(result.hf.losses, result.fuselm.losses)["curve_rel"]
    )


def test_patch_is_undone_after_the_run(tiny_run):
    import fuselm.hf

    assert not fuselm.hf.is_patched("llama")
    model = demo.build_model(tiny_run[0])
    assert not fuselm.hf.is_patched(model)


# ---- the command line ----


def test_cli_demo(tmp_path, capsys):
    pytest.importorskip("transformers")
    argv = ["demo", "--device", "cpu", "--steps", "3", "--batch", "1", "--seq", "32", "--out", str(tmp_path)]
    threads = torch.get_num_threads()
    assert main([*argv, "--no-progress"]) == 0
    assert torch.get_num_threads() == threads  # the CPU demo runs on one thread, then restores the count
    printed = capsys.readouterr().out
    assert "| fuselm.hf.patch |" in printed and "wrote " in printed
    assert (tmp_path / demo.JSON_NAME).exists() and (tmp_path / demo.PNG_NAME).exists()
    assert json.loads((tmp_path / demo.JSON_NAME).read_text())["settings"]["seq"] == 32


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--steps", "0"], "positive integer"),
        (["demo", "--batch", "two"], "positive integer"),
        (["demo", "--device", "tpu"], "invalid choice"),
        (["demo", "--seq", "1000000"], "at most the corpus length"),
    ],
)
def test_cli_demo_bad_arguments(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_cli_demo_cuda_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["demo", "--device", "cuda"]) == 2
    assert "--device cuda: no CUDA device available" in capsys.readouterr().err


def test_cli_demo_without_transformers(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    assert main(["demo", "--device", "cpu"]) == 1
    assert 'pip install "fuselm[demo]"' in capsys.readouterr().err


def test_cli_help_lists_demo(capsys):
    assert main(["--help"]) == 0
    assert "demo" in capsys.readouterr().out


def test_docstring_examples_run():
    pytest.importorskip("transformers")
    failed, attempted = doctest.testmod(demo, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert attempted > 10 and failed == 0
