"""Greedy answers (analysis/readers/task_scoring.py) against a decode run by hand, and the passkey's decoys."""

from __future__ import annotations

import pytest
import torch

from pe_geometry.analysis.readers.task_scoring import answer_span, greedy_answers
from pe_geometry.data.tasks import DIGIT_IDS, NEEDLE, TASK_VOCAB, TOKEN_ID, make_batch
from pe_geometry.model.positional import LearnedPE
from pe_geometry.model.transformer import DecoderLM


def hand_decode(model, prompt: torch.Tensor, n: int) -> list[int]:
    """Greedy decoding without a cache: the whole text read again for every token."""
    text = prompt.clone()
    for _ in range(n):
        text = torch.cat([text, model(text[None])[0, -1].argmax()[None]])
    return text[len(prompt):].tolist()


def test_greedy_answers_equal_a_hand_run_decode():
    torch.manual_seed(0)
    model = DecoderLM(vocab_size=len(TASK_VOCAB), d_model=16, n_heads=2, n_layers=2, pe=LearnedPE).eval()
    batch = make_batch("passkey", 6, 40, 3, sizes="up_to", passkey_digits=3)
    got = greedy_answers(model, batch.blocks, batch.answer_mask)
    for b in range(6):
        start, length = answer_span(batch.answer_mask[b])
        written = hand_decode(model, batch.blocks[b, :start], length)
        truth = batch.blocks[b, start : start + length].tolist()
        assert got["written"][b] == written
        assert got["exact_match"][b] == float(written == truth) and got["first_token"][b] == float(written[0] == truth[0])
        assert got["correct"][b] == sum(w == t for w, t in zip(written, truth)) and got["n_answer"][b] == length
    assert len({answer_span(m) for m in batch.answer_mask}) > 1  # sizes up_to: several prompt lengths, grouped


def test_an_oracle_that_copies_the_answer_scores_one():
    """A model whose every next token is the true one (here: the blocks fed to a lookup) writes every answer."""
    batch = make_batch("copy", 4, 20, 1, sizes="full")

    class Oracle(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

    oracle = Oracle()
    truth = {tuple(b[:k].tolist()): int(b[k]) for b in batch.blocks for k in range(1, len(b))}
    import pe_geometry.analysis.readers.task_scoring as scoring

    def fake_generate(model, prompt, n, temperature):
        out = prompt
        for _ in range(n):
            out = torch.cat([out, torch.tensor([[truth[tuple(r.tolist())]] for r in out])], 1)
        return out

    original, scoring.generate = scoring.generate, fake_generate
    try:
        got = greedy_answers(oracle, batch.blocks, batch.answer_mask)
    finally:
        scoring.generate = original
    assert got["exact_match"].tolist() == [1.0] * 4 and got["first_token"].tolist() == [1.0] * 4


def test_a_split_answer_is_refused():
    with pytest.raises(ValueError, match="not contiguous"):
        answer_span(torch.tensor([0, 1, 0, 1], dtype=torch.bool))


def test_decoys_leave_one_keyed_needle_among_unkeyed_numbers():
    batch = make_batch("passkey", 8, 120, 5, sizes="full", passkey_digits=5, passkey_decoys=6)
    plain = make_batch("passkey", 8, 120, 5, sizes="full", passkey_digits=5)
    digits = set(DIGIT_IDS.tolist())
    for b, p in zip(batch.blocks, plain.blocks, strict=True):
        ids = b.tolist()
        query = ids.index(TOKEN_ID["?"])
        needle = [i for i, t in enumerate(ids) if t == TOKEN_ID[NEEDLE]]
        assert len(needle) == 2  # one keyed needle: "# d1..d5 #"
        key = ids[needle[0] + 1 : needle[1]]
        assert ids[query + 1 : query + 6] == key  # the answer is the keyed number
        runs, run = [], []
        for t in ids[:query]:
            if t in digits:
                run.append(t)
            elif run:
                runs.append(run)
                run = []
        assert len(runs) == 7 and all(len(r) == 5 for r in runs)  # the needle + 6 decoys, none touching another
        assert sum(t in digits for t in p.tolist()[: p.tolist().index(TOKEN_ID["?"])]) == 5  # no decoys: the needle only
    assert batch.blocks.shape == plain.blocks.shape and torch.equal(batch.answer_mask, plain.answer_mask)


def test_greedy_exact_match_is_teacher_forced_exact_match_on_a_partly_trained_model():
    """Greedy decoding writes the whole answer right exactly when every answer token is the argmax given the true
    prefix (by induction over the answer), so the two exact matches agree per example; token accuracy does not. The
    committed no-decoy table's exact match therefore is the greedy one. A model trained a little, so some examples
    are right and some wrong (a random model gets none right and would pass a broken check)."""
    from pe_geometry.data.tasks import answer_accuracy

    torch.manual_seed(0)
    model = DecoderLM(vocab_size=len(TASK_VOCAB), d_model=32, n_heads=2, n_layers=2, pe=LearnedPE)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(120):
        batch = make_batch("copy", 32, 12, step, sizes="up_to")
        logits = model(batch.blocks[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch.blocks[:, 1:], reduction="none")
        loss = (loss * batch.answer_mask[:, 1:]).sum() / batch.answer_mask[:, 1:].sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    batch = make_batch("copy", 64, 12, 10_000, sizes="up_to")
    with torch.no_grad():
        forced = answer_accuracy(model(batch.blocks[:, :-1]), batch.blocks, batch.answer_mask)
    greedy = greedy_answers(model, batch.blocks, batch.answer_mask)
    assert 0 < greedy["exact_match"].mean() < 1  # some right, some wrong: the agreement below is not 0 = 0
    assert greedy["exact_match"].tolist() == forced.exact_match.double().tolist()
    right = forced.exact_match.numpy()
    assert (greedy["correct"][right] == forced.correct.double().numpy()[right]).all()
    assert (greedy["correct"] != forced.correct.double().numpy()).any()  # token counts differ: a wrong token derails


def test_beyond_window_marks_the_examples_a_window_model_cannot_answer():
    """A passkey whose needle lies before the last L tokens is beyond; one whose needle is within them is not (the
    answer at t reads the input at t - 1, which sees t - L .. t - 1: the window_chance rule)."""
    from pe_geometry.data.tasks import beyond_window, window_chance

    batch = make_batch("passkey", 64, 128, 7, sizes="full", passkey_digits=5)
    for window in (16, 32, 64):
        beyond = beyond_window(batch, window)
        positions = torch.arange(batch.blocks.shape[1])
        for b in range(len(batch.blocks)):
            answer = batch.answer_mask[b].nonzero().flatten()
            farthest = int((positions[answer] - batch.sources[b, answer]).max())
            assert bool(beyond[b]) == (farthest > window)
        # a window model answers every example that is not beyond, and a beyond one only by guessing its unseen digits
        # (at most 1/10 each): its exact match is the share within, plus at most a tenth of the rest
        within = float((~beyond).double().mean())
        assert within <= window_chance(batch, window)[1] <= within + 0.1 * (1 - within)
    assert 0 < beyond_window(batch, 32).double().mean() < 1
