"""Tokenizers trained with the ``tokenizers`` library on the training split.

``bpe``: byte-level BPE (GPT-2 style), so any text round-trips without <unk>.
``char``: one token per character, the ``vocab_size - 3`` most frequent kept.
The special tokens come first, so their ids are fixed: <unk>=0, <mask>=1, <eos>=2.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<unk>", "<mask>", "<eos>")
TOKENIZER_KINDS = ("bpe", "char")
BYTE_ALPHABET = len(pre_tokenizers.ByteLevel.alphabet())  # 256


def min_vocab_size(kind: str) -> int:
    """The smallest vocab_size a tokenizer of this kind can have."""
    return len(SPECIAL_TOKENS) + (BYTE_ALPHABET if kind == "bpe" else 1)


def check_tokenizer_settings(kind: str, vocab_size: int) -> None:
    if kind not in TOKENIZER_KINDS:
        raise ValueError(f"unknown tokenizer {kind!r}; valid: {list(TOKENIZER_KINDS)}")
    needed = min_vocab_size(kind)
    if vocab_size < needed:
        detail = f"{BYTE_ALPHABET} byte symbols + " if kind == "bpe" else "1 character + "
        raise ValueError(
            f"data.vocab_size={vocab_size} is too small for the {kind} tokenizer: it needs at least "
            f"{needed} ({detail}{len(SPECIAL_TOKENS)} special tokens {list(SPECIAL_TOKENS)})"
        )


def train_tokenizer(texts: Iterable[str], kind: str, vocab_size: int) -> Tokenizer:
    check_tokenizer_settings(kind, vocab_size)
    if kind == "bpe":
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
    else:
        tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
        tokenizer.decoder = decoders.Fuse()
        trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer
