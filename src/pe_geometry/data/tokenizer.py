"""Tokenizers trained with the ``tokenizers`` library on a bounded sample of the training split.

``bpe``: byte-level BPE (GPT-2 style), so any text round-trips without <unk>.
``char``: one token per character, the ``vocab_size - 3`` most frequent kept.
The special tokens come first, so their ids are fixed: <unk>=0, <mask>=1, <eos>=2.

Long runs without whitespace are cut into pieces of at most ``MAX_RUN_CHARS``
characters before byte-level BPE sees them. BPE training rescans a whole
pre-token on every merge, so one huge "word" (a minified file, a base64 blob, a
line of a million letters) makes training quadratic in its length: a 400 k
character line of random letters took minutes. Ordinary text has no runs this
long, so its tokenization is unchanged; a long run is encoded as consecutive
pieces and still decodes to the exact original text.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

# the special tokens and the vocabulary's range: torch-free, so a config is checked before anything loads
from pe_geometry.settings.data import SPECIAL_TOKENS, check_tokenizer_settings

log = logging.getLogger(__name__)

MAX_RUN_CHARS = 64  # longest piece without whitespace that BPE training sees
_LONG_RUN = re.compile(rf"\S{{{MAX_RUN_CHARS + 1},}}")


def bpe_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """Cut whitespace-free runs into MAX_RUN_CHARS pieces, then GPT-2's byte-level split."""
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(rf"\S{{{MAX_RUN_CHARS}}}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])


def train_tokenizer(texts: Iterable[str], kind: str, vocab_size: int) -> Tokenizer:
    check_tokenizer_settings(kind, vocab_size)
    if kind == "bpe":
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
        tokenizer.pre_tokenizer = bpe_pre_tokenizer()
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


def training_sample(batches: Iterable[list[str]], max_chars: int) -> Iterator[str]:
    """The documents of ``batches`` in order until ``max_chars`` characters (the last one may be cut).

    Logs how many documents and characters the tokenizer was trained on, and how
    many long whitespace-free runs it saw cut into MAX_RUN_CHARS pieces.
    """
    n_docs = n_chars = n_long_runs = 0
    for batch in batches:
        for text in batch:
            if n_chars >= max_chars:
                break
            text = (text or "")[: max_chars - n_chars]
            n_docs, n_chars = n_docs + 1, n_chars + len(text)
            n_long_runs += sum(1 for _ in _LONG_RUN.finditer(text))
            yield text
        else:
            continue
        break
    log.info("tokenizer trained on the first %d documents (%d characters) of the training split", n_docs, n_chars)
    if n_long_runs:
        log.warning(
            "%d runs of more than %d characters without whitespace were cut into %d-character pieces "
            "(keeps tokenizer training linear in their length)", n_long_runs, MAX_RUN_CHARS, MAX_RUN_CHARS,
        )
