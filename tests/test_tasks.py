"""data/tasks.py and data=task: each task's answers recomputed from the example itself, sizes as stated, the same
examples at a seed, only the answers scored, an oracle at 1.0 and a uniform guesser at chance, bad settings refused."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pe_geometry.data.task_datamodule import TaskDataModule, batch_seed, task_tokenizer
from pe_geometry.data.tasks import (
    DIGITS,
    LETTERS,
    PAD_ID,
    SIZES,
    TASK_VOCAB,
    TASKS,
    accuracy_by_depth,
    answer_accuracy,
    block_length,
    largest_size,
    make_batch,
    window_chance,
)
from pe_geometry.training.task import answer_loss
from pe_geometry.training.validate import ConfigError, check_config
from tests.conftest import compose_train_config, fast_loop_keeps


def text(ids) -> str:
    return "".join(TASK_VOCAB[int(i)] for i in ids)


def example(blocks: torch.Tensor, mask: torch.Tensor, b: int) -> tuple[str, str, int]:
    """(the example without its <eos> padding, the answer text, where the padding starts)."""
    ids = blocks[b].tolist()
    end = len(ids)
    while end and ids[end - 1] == PAD_ID:
        end -= 1
    return text(ids[:end]), text(blocks[b][mask[b]]), end


# -- each task's answers, recomputed from what the example says -----------------------------------------------------------
def check_copy(s: str, answer: str) -> int:
    string, copied = s.split("|")
    assert set(string) <= set(LETTERS) and copied == string == answer
    return len(string)


def check_associative_recall(s: str, answer: str, key_len: int = 2) -> int:
    pairs, queries = s.split("|")
    width = key_len + 1
    table = {pairs[i : i + key_len]: pairs[i + key_len] for i in range(0, len(pairs), width)}
    assert len(table) * width == len(pairs) and len(queries) == len(pairs)  # distinct keys, each queried
    asked = [queries[i : i + key_len] for i in range(0, len(queries), width)]
    assert sorted(asked) == sorted(table) and all(set(k) <= set(LETTERS) for k in asked)
    assert answer == "".join(table[k] for k in asked) and set(answer) <= set(DIGITS)
    return len(table)


def check_passkey(s: str, answer: str, digits: int = 5) -> int:
    before, number, after = s.split("#")
    filler, asked = after.split("?")
    assert len(number) == digits and set(number) <= set(DIGITS) and asked == number == answer
    assert set(before + filler) <= set(LETTERS + " ")
    return len(before) + len(filler)


def check_addition(s: str, answer: str) -> int:
    a, rest = s.split("+")
    b, total = rest.split("=")
    n = len(a)
    assert len(b) == n and total == answer and len(total) == n + 1
    assert total == str(int(a[::-1]) + int(b[::-1])).zfill(n + 1)[::-1]  # every number least significant digit first
    return n


CHECKS = {"copy": check_copy, "associative_recall": check_associative_recall, "passkey": check_passkey,
          "addition": check_addition}


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("seq_len", [13, 64, 131])
@pytest.mark.parametrize("task", TASKS)
def test_every_answer_is_right_and_every_length_as_stated(task, seq_len, sizes):
    made = make_batch(task, 24, seq_len, generator=7, sizes=sizes)
    largest = largest_size(task, seq_len)
    assert made.blocks.shape == made.answer_mask.shape == (24, seq_len + 1) and made.blocks.dtype == torch.long
    assert block_length(task, largest) <= seq_len + 1 < block_length(task, largest + 1)  # the largest size that fits
    for b in range(24):
        s, answer, end = example(made.blocks, made.answer_mask, b)
        size = CHECKS[task](s, answer)
        assert size == int(made.sizes[b]) and 1 <= size <= largest and end == block_length(task, size)
        if sizes == "full":
            assert size == largest
        # the answer is the example's last tokens, and nothing else is scored
        assert made.answer_mask[b].nonzero().flatten().tolist()[-1] == end - 1
        assert not made.answer_mask[b, end:].any() and int(made.answer_mask[b].sum()) == len(answer)
        if task == "passkey":
            assert made.depth[b] == pytest.approx(s.index("#") / size)


def test_up_to_sizes_cover_every_size_from_one():
    made = make_batch("addition", 400, 32, generator=0, sizes="up_to")
    assert set(made.sizes.tolist()) == set(range(1, largest_size("addition", 32) + 1))


@pytest.mark.parametrize("task", TASKS)
def test_the_same_seed_gives_the_same_examples_and_another_seed_others(task):
    one, again, other = (make_batch(task, 8, 48, generator=seed) for seed in (3, 3, 4))
    assert torch.equal(one.blocks, again.blocks) and torch.equal(one.answer_mask, again.answer_mask)
    assert not torch.equal(one.blocks, other.blocks)


def test_associative_recall_keys_of_other_lengths():
    made = make_batch("associative_recall", 4, 80, generator=0, key_len=3)
    for b in range(4):
        s, answer, _ = example(made.blocks, made.answer_mask, b)
        assert check_associative_recall(s, answer, key_len=3) == 80 // 8


def test_passkey_filler_is_play_text_and_validation_uses_the_held_out_plays():
    from pe_geometry.data.tasks import play_filler

    train, held_out = play_filler("train"), play_filler("validation")
    assert len(train) > 10 * len(held_out) > 10**5
    as_bytes = np.array([ord(t) if len(t) == 1 else ord("?") for t in TASK_VOCAB], dtype=np.uint8)
    assert "to be or not to be that is the question" in as_bytes[train.numpy()].tobytes().decode()
    made = make_batch("passkey", 4, 64, generator=0, passkey_digits=3, filler=held_out)
    for b in range(4):
        s, answer, _ = example(made.blocks, made.answer_mask, b)
        check_passkey(s, answer, digits=3)


# -- scoring ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("task", TASKS)
def test_an_oracle_scores_one_and_only_answer_tokens_count(task):
    made = make_batch(task, 16, 40, generator=1, sizes="up_to")
    oracle = made.blocks[:, 1:].clone()
    score = answer_accuracy(oracle, made.blocks, made.answer_mask)
    assert score.exact_match.all() and score.token_accuracy == 1.0 and score.exact_match_rate == 1.0
    logits = torch.nn.functional.one_hot(oracle, len(TASK_VOCAB)).float()  # logits take the same path
    assert answer_accuracy(logits, made.blocks, made.answer_mask).token_accuracy == 1.0
    unscored = ~made.answer_mask[:, 1:]
    wrong_elsewhere = torch.where(unscored, (oracle + 1) % len(TASK_VOCAB), oracle)
    assert answer_accuracy(wrong_elsewhere, made.blocks, made.answer_mask).exact_match_rate == 1.0
    first_answer = made.answer_mask[0, 1:].nonzero()[0, 0]
    one_wrong = oracle.clone()
    one_wrong[0, first_answer] = (one_wrong[0, first_answer] + 1) % len(TASK_VOCAB)
    score = answer_accuracy(one_wrong, made.blocks, made.answer_mask)
    assert score.exact_match.tolist() == [False] + [True] * 15
    assert int(score.correct.sum()) == int(made.answer_mask.sum()) - 1


@pytest.mark.parametrize("task,seq_len", fast_loop_keeps([("copy", 2), ("associative_recall", 6), ("passkey", 5), ("addition", 5)],
                                                          keep=[("copy", 2)]))
def test_a_uniform_guesser_scores_chance(task, seq_len):
    """Predictions uniform over the answer alphabet: per token 1/A, exact match A^-k (k answer tokens), as
    ``window_chance(batch, 0)`` says; the smallest size of each task, so that exact match is measurable."""
    made = make_batch(task, 20000, seq_len, generator=2, passkey_digits=1)
    guesses = made.alphabet[torch.randint(0, len(made.alphabet), made.blocks[:, 1:].shape, generator=torch.Generator().manual_seed(0))]
    score = answer_accuracy(guesses, made.blocks, made.answer_mask)
    per_token, exact = window_chance(made, 0)
    assert per_token == pytest.approx(1 / len(made.alphabet))
    k = int(made.answer_mask[0].sum())
    assert exact == pytest.approx(len(made.alphabet) ** -k)
    for observed, expected, n in ((score.token_accuracy, per_token, int(score.n_answer.sum())), (score.exact_match_rate, exact, 20000)):
        assert abs(observed - expected) < 4 * math.sqrt(expected * (1 - expected) / n)


@pytest.mark.parametrize("task", TASKS)
def test_a_model_that_sees_its_training_length_is_perfect_at_1x_and_at_chance_as_computed_beyond(task):
    seq_len = 48
    assert window_chance(make_batch(task, 64, seq_len, generator=0), seq_len) == (1.0, 1.0)
    longer = make_batch(task, 1000, 2 * seq_len, generator=0)
    expected, _ = window_chance(longer, seq_len)
    # simulate it: right where the answer's source is within the last seq_len tokens, a uniform guess elsewhere
    t = torch.arange(longer.blocks.shape[1])
    seen = (t - longer.sources <= seq_len)[:, 1:]
    guesses = longer.alphabet[torch.randint(0, len(longer.alphabet), seen.shape, generator=torch.Generator().manual_seed(1))]
    simulated = answer_accuracy(torch.where(seen, longer.blocks[:, 1:], guesses), longer.blocks, longer.answer_mask)
    n = int(simulated.n_answer.sum())
    assert abs(simulated.token_accuracy - expected) < 4 * math.sqrt(0.25 / n)
    assert 1 / len(longer.alphabet) - 1e-12 <= expected < 1.0


@pytest.mark.parametrize("task,at_2x", [("copy", 0.0385), ("associative_recall", 0.53), ("passkey", 0.53), ("addition", 0.1)])
def test_the_chance_the_docstrings_state(task, at_2x):
    """The per-token figures each generator's docstring gives for L = 64 at 2x (2000 examples, seed 0)."""
    assert window_chance(make_batch(task, 2000, 128, generator=0), 64)[0] == pytest.approx(at_2x, abs=0.005)


def test_accuracy_by_depth():
    rows = accuracy_by_depth(torch.tensor([1, 0, 1, 1]), torch.tensor([0.0, 0.05, 0.5, 1.0]), bins=4)
    assert rows[0] == (0.0, 0.5, 2) and rows[2] == (0.5, 1.0, 1) and rows[3] == (0.75, 1.0, 1)
    assert rows[1][2] == 0 and math.isnan(rows[1][1])


class Stub(torch.nn.Module):
    """A 'decoder' whose logits are a leaf tensor, to see which of them the loss reaches."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def logits_and_targets(self, block, generator=None):
        return self.logits, block[:, 1:]


def test_the_training_loss_reads_the_answer_tokens_only():
    made = make_batch("passkey", 6, 40, generator=0, sizes="up_to")
    logits = torch.randn(6, 40, len(TASK_VOCAB), requires_grad=True)
    loss, _ = answer_loss(Stub(logits), made.blocks, made.answer_mask)
    loss.backward()
    touched = logits.grad.abs().sum(-1) > 0
    assert torch.equal(touched, made.answer_mask[:, 1:])
    scored = made.answer_mask[:, 1:]
    expected = torch.nn.functional.cross_entropy(logits[scored], made.blocks[:, 1:][scored])
    assert loss.item() == pytest.approx(expected.item())


# -- the datamodule -----------------------------------------------------------------------------------------------------
def test_the_datamodule_serves_the_seeded_batches_and_resumes_where_it_stopped():
    dm = TaskDataModule(task="addition", seq_len=20, batch_size=4, seed=5, val_examples=10)
    batches = iter(dm.train_dataloader())
    first = [next(batches) for _ in range(3)]
    expected = make_batch("addition", 4, 20, generator=batch_seed(5, "train", 1), sizes="up_to")
    assert torch.equal(first[1][0], expected.blocks) and torch.equal(first[1][1], expected.answer_mask)
    resumed = TaskDataModule(task="addition", seq_len=20, batch_size=4, seed=5, val_examples=10)
    resumed.load_state_dict({"batches": 2})
    assert torch.equal(next(iter(resumed.train_dataloader()))[0], first[2][0])
    val = list(dm.val_dataloader())
    assert [len(b) for b, _ in val] == [4, 4, 2] and all(torch.equal(a[0], b[0]) for a, b in zip(val, dm.val_dataloader()))
    assert not any(torch.equal(v[0], t[0][: len(v[0])]) for v, t in zip(val, first))  # held out: its own seed stream
    assert dm.vocab_size == len(TASK_VOCAB) and dm.n_tokens("validation") == 10 * 21


def test_ddp_ranks_take_disjoint_batches():
    from pe_geometry.data.task_datamodule import FromBatch

    ranks = [list(FromBatch(10, start=1, rank=r, world_size=2)) for r in (0, 1)]
    assert ranks == [[2, 4, 6, 8], [3, 5, 7, 9]] and [len(FromBatch(10, 1, r, 2)) for r in (0, 1)] == [4, 4]


def test_the_task_tokenizer_reads_and_writes_the_task_vocabulary():
    tokenizer = task_tokenizer()
    ids = tokenizer.encode("ab 12+3=|?#").ids
    assert text(ids) == "ab 12+3=|?#" and tokenizer.decode(ids) == "ab 12+3=|?#"
    assert [tokenizer.token_to_id(t) for t in ("<unk>", "<mask>", "<eos>")] == [0, 1, 2]


# -- the config ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("task", TASKS)
def test_data_task_composes_and_checks(task, tmp_path):
    cfg = compose_train_config(["data=task", f"data.task={task}", "experiment=quick"], output_dir=tmp_path)
    check_config(cfg)
    assert cfg.data.seq_len == 64 and cfg.data.sizes == "up_to" and cfg.data.seed == cfg.seed


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["data.task=cpy"], r"data.task=cpy must be one of \['copy', 'associative_recall', 'passkey', 'addition'\]"),
        (["data.sizes=all"], r"data.sizes=all must be one of \['full', 'up_to'\]"),
        (["data.task=passkey", "data.seq_len=12"],
         r"data.seq_len=12 is too short for data.task=passkey with data.passkey_digits=5: one example needs data.seq_len >= 13"),
        (["data.task=addition", "data.seq_len=4"], r"data.seq_len=4 is too short for data.task=addition: .* data.seq_len >= 5"),
        (["data.task=associative_recall", "data.key_len=5"], r"data.key_len=5 must be an integer in \[1, 4\]"),
        (["+data.vocab_size=300"], r"data.vocab_size is not a setting of data=task; valid: \['batch_size', 'key_len'"),
        (["model=encoder"], r"data=task scores answers as next tokens: it trains model=decoder, not a masked-lm model"),
    ],
)
def test_bad_task_settings_are_one_clear_line(overrides, message, tmp_path):
    cfg = compose_train_config(["data=task", *overrides], output_dir=tmp_path)
    with pytest.raises(ConfigError, match=message):
        check_config(cfg)


def test_make_batch_refuses_an_unknown_task_naming_the_valid_ones():
    with pytest.raises(ValueError, match=r"task='cpy' is not a task; valid: \['copy', 'associative_recall', 'passkey', 'addition'\]"):
        make_batch("cpy", 2, 16, generator=0)
    with pytest.raises(ValueError, match=r"seq_len=3 is too short for task=addition: one example needs seq_len >= 5"):
        make_batch("addition", 2, 3, generator=0)


def test_the_task_settings_check_the_fit_and_the_models_objective():
    from pe_geometry.settings import SettingsError
    from pe_geometry.settings.data import TaskDataSettings

    TaskDataSettings(task="addition", seq_len=5).check_objective("next-token")
    with pytest.raises(SettingsError, match=r"data=task scores answers as next tokens: it trains model=decoder, not a seq2seq model"):
        TaskDataSettings().check_objective("seq2seq")
    with pytest.raises(SettingsError, match=r"data.seq_len=4 is too short for data.task=addition: one example needs data.seq_len >= 5"):
        TaskDataSettings(task="addition", seq_len=4)
