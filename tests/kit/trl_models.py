"""Tiny models, a word-level tokenizer and in-memory datasets for TRL's trainers (no downloads).

The language: sentences of a small grammar ("the red cat sees a dog ."), whose words are the whole
vocabulary of a word-level tokenizer built here (padded with filler words to 128 ids). Models are
Llama-shaped (hidden 32, 2 layers) with the same 128 ids.
"""

from __future__ import annotations

import contextlib
import random

import torch

transformers = __import__("pytest").importorskip("transformers")
datasets = __import__("pytest").importorskip("datasets")

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
DETERMINERS = ["the", "a", "one", "some"]
ADJECTIVES = ["red", "big", "old", "small", "green", "quiet", "fast", "happy"]
NOUNS = ["cat", "dog", "bird", "fish", "tree", "house", "car", "boat", "child", "king"]
VERBS = ["sees", "likes", "finds", "takes", "wants", "makes", "hears", "calls"]
WORDS = [*DETERMINERS, *ADJECTIVES, *NOUNS, *VERBS, "and", "then", "."]
VOCAB = 128  # model vocabulary (>= the tokenizer's size)


def tokenizer():
    """A word-level PreTrainedTokenizerFast of VOCAB ids: SPECIALS, WORDS and filler words (split on
    whitespace)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    fillers = [f"w{i}" for i in range(VOCAB - len(SPECIALS) - len(WORDS))]  # rare words up to VOCAB
    vocab = {word: i for i, word in enumerate([*SPECIALS, *WORDS, *fillers])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    out = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )
    out.padding_side = "left"  # generation (GRPO, RLOO) wants prompts aligned on the right
    return out


def model(seed: int = 0, dtype: torch.dtype = torch.float32, **config):
    """A Llama-shaped causal LM from a config (hidden 32, 2 layers, 4 heads / 2 kv heads, vocab VOCAB)."""
    kwargs = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    kwargs.update(config)
    cfg = transformers.LlamaConfig(**kwargs)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).to(dtype)


def clone(m, dtype: torch.dtype):
    """The same weights in another dtype (a fresh model object)."""
    twin = type(m)(m.config)
    twin.load_state_dict(m.state_dict())
    return twin.to(dtype)


def _phrase(rng: random.Random) -> str:
    return " ".join([rng.choice(DETERMINERS), rng.choice(ADJECTIVES), rng.choice(NOUNS)])


def _sentence(rng: random.Random) -> tuple[str, str]:
    """(prompt, completion): "the red cat sees" / "a big dog ." """
    return f"{_phrase(rng)} {rng.choice(VERBS)}", f"{_phrase(rng)} ."


def language_modeling(n: int, seed: int = 0):
    """{"text"}: whole sentences."""
    rng = random.Random(seed)
    return datasets.Dataset.from_list([{"text": " ".join(_sentence(rng))} for _ in range(n)])


def prompt_completion(n: int, seed: int = 0):
    """{"prompt", "completion"} (completion-only loss in SFT)."""
    rng = random.Random(seed)
    rows = [_sentence(rng) for _ in range(n)]
    return datasets.Dataset.from_list([{"prompt": p, "completion": " " + c} for p, c in rows])


def preference(n: int, seed: int = 0):
    """{"prompt", "chosen", "rejected"}: the chosen completion ends with ".", the rejected one rambles."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt, chosen = _sentence(rng)
        rejected = f"{_phrase(rng)} and {_phrase(rng)} then"
        rows.append({"prompt": prompt, "chosen": " " + chosen, "rejected": " " + rejected})
    return datasets.Dataset.from_list(rows)


def unpaired_preference(n: int, seed: int = 0):
    """{"prompt", "completion", "label"} (KTO): alternately desirable and undesirable."""
    rows = preference(n, seed)
    good = [i % 2 == 0 for i in range(n)]
    return datasets.Dataset.from_list(
        [
            {"prompt": r["prompt"], "completion": r["chosen"] if ok else r["rejected"], "label": ok}
            for r, ok in zip(rows, good, strict=True)
        ]
    )


def prompts(n: int, seed: int = 0):
    """{"prompt"}: the first half of sentences (GRPO, RLOO)."""
    rng = random.Random(seed)
    return datasets.Dataset.from_list([{"prompt": _sentence(rng)[0]} for _ in range(n)])


def reward_nouns(completions, **kwargs) -> list[float]:
    """A Python reward: +1 per noun in the completion, -0.5 per other word (completions are strings)."""
    nouns = set(NOUNS)
    return [sum(1.0 if w in nouns else -0.5 for w in text.split()) for text in completions]


@contextlib.contextmanager
def lm_head(kind: str):
    """TRL's fused LM head (``trl.trainer.utils._ChunkedLogProbFunction``) inside the block: "fuselm"
    (``fuselm.trl.patch()``), "trl" (its own kernel) or "exact" (:class:`kit.oracles.ExactTrlHead`, float64
    exact); TRL's own is back afterwards."""
    from trl.trainer import utils as trl_utils

    import fuselm.trl

    from .oracles import ExactTrlHead

    if kind not in ("fuselm", "trl", "exact"):
        raise ValueError(f"kind must be 'fuselm', 'trl' or 'exact', got {kind!r}")
    original = trl_utils._ChunkedLogProbFunction
    if kind == "fuselm":
        fuselm.trl.patch()
    elif kind == "exact":
        trl_utils._ChunkedLogProbFunction = ExactTrlHead
    try:
        yield
    finally:
        fuselm.trl.unpatch()
        trl_utils._ChunkedLogProbFunction = original
