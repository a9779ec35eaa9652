"""Control arms of the study: a learned table that starts inside E's principal subspace, the sinusoidal
table scaled to the word norm or centred, and no weight decay on E and P."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from hydra.utils import instantiate

from pe_geometry.analysis.measures import geometry as geo
from pe_geometry.model.embedding import INIT_STD, TokenEmbedding
from pe_geometry.model.positional import LearnedPE, SinusoidalPE, sinusoidal_table
from pe_geometry.model.transformer import DecoderLM, EncoderDecoder
from pe_geometry.training.task import LanguageModelTask
from tests.conftest import compose_train_config

D, K, VOCAB = 64, 8, 300


def _decoder(pe, tie: bool = True, scaled: bool = False, seed: int = 0) -> DecoderLM:
    torch.manual_seed(seed)
    embedding = partial(TokenEmbedding, scaled=scaled, tie_weights=tie)
    return DecoderLM(VOCAB, d_model=D, n_heads=4, n_layers=1, embedding=embedding, pe=pe)


def _top_k_overlap(model) -> float:
    E, P = model.W_E.detach(), model.W_pos.detach()
    return geo.subspace_overlap(geo.top_principal_directions(E, k=K), geo.top_principal_directions(P, k=K))


@pytest.mark.parametrize("tie", [True, False])
def test_mixed_init_puts_p_inside_the_final_e_top_k_subspace(tie):
    mixed = _decoder(partial(LearnedPE, init="mixed", init_k=K), tie=tie)
    normal = _decoder(partial(LearnedPE), tie=tie)
    chance = geo.subspace_overlap_chance(K, K, D)  # 8/64
    assert _top_k_overlap(mixed) == pytest.approx(1.0, abs=1e-6)
    assert abs(_top_k_overlap(normal) - chance) < 0.1  # ~0.16 for one draw; 1.0 would be the bug
    # the final E (std INIT_STD), not nn.Embedding's own N(0, 1) init that _finish_init replaced
    assert mixed.W_E.std().item() == pytest.approx(INIT_STD, rel=0.1)
    # rows as long as the normal init's, on average
    assert mixed.W_pos.norm(dim=-1).mean().item() == pytest.approx(normal.W_pos.norm(dim=-1).mean().item(), rel=0.1)


def test_mixed_init_differs_across_seeds_and_reaches_every_stack():
    a, b = (_decoder(partial(LearnedPE, init="mixed"), seed=s).W_pos for s in (0, 1))
    assert not torch.allclose(a, b)
    torch.manual_seed(0)
    model = EncoderDecoder(VOCAB, d_model=D, n_heads=4, n_layers=1, pe=partial(LearnedPE, init="mixed", init_k=K))
    for stack in (model.encoder, model.decoder):  # each stack's own table, inside the shared E's subspace
        U = geo.top_principal_directions(model.W_E.detach(), k=K)
        assert geo.subspace_overlap(U, geo.top_principal_directions(stack.pe.weight.detach(), k=K)) == pytest.approx(1.0, abs=1e-6)


def test_sinusoidal_defaults_are_the_formula():
    model = _decoder(partial(SinusoidalPE, max_len=100))
    assert torch.equal(model.W_pos, sinusoidal_table(100, D))


@pytest.mark.parametrize("scaled", [False, True])
def test_word_norm_table_has_the_embedding_init_row_norm(scaled):
    model = _decoder(partial(SinusoidalPE, max_len=100, scale="word_norm"), scaled=scaled)
    target = INIT_STD * math.sqrt(D) * (math.sqrt(D) if scaled else 1.0)
    assert model.W_pos.norm(dim=-1).mean().item() == pytest.approx(target, rel=1e-5)
    # same direction per row as the formula (a pure rescaling), and the measured E rows are that long too
    assert torch.allclose(model.W_pos / model.W_pos.norm(dim=-1, keepdim=True), sinusoidal_table(100, D) / math.sqrt(D / 2), atol=1e-5)
    assert (model.W_E * model.embed_scale).norm(dim=-1).mean().item() == pytest.approx(target, rel=0.05)


def test_centred_table_has_zero_mean_row_and_keeps_its_shift_when_it_grows():
    pe = _decoder(partial(SinusoidalPE, max_len=100, center=True, scale="word_norm")).decoder.pe
    first = pe.position_table.clone()
    assert first.mean(0).abs().max().item() < 1e-6
    assert first.mean(0).norm() < 1e-4 * sinusoidal_table(100, D).mean(0).norm()  # the raw mean row is far from 0
    grown = pe.input_term(150)
    assert grown.shape == (150, D) and torch.allclose(grown[:100], first, atol=1e-6)  # same offset and factor


def _weight_decay_of(model, no_decay_embeddings: bool) -> dict[int, float]:
    """Each parameter's weight decay in the optimiser configs/optimizer builds, as control=no_decay sets it or not."""
    cfg = compose_train_config(["control=no_decay"] if no_decay_embeddings else [])
    task = LanguageModelTask(model, optimizer=instantiate(cfg.optimizer), max_steps=10)
    optimizer = task.configure_optimizers()["optimizer"]
    return {id(p): group["weight_decay"] for group in optimizer.param_groups for p in group["params"]}


@pytest.mark.parametrize("tie", [True, False])
def test_no_decay_embeddings_exempts_exactly_e_and_p(tie):
    model = _decoder(partial(LearnedPE), tie=tie)
    default, exempt = _weight_decay_of(model, False), _weight_decay_of(model, True)
    assert default[id(model.W_E)] == 0.1 and default[id(model.W_pos)] == 0.1
    assert exempt[id(model.W_E)] == 0.0 and exempt[id(model.W_pos)] == 0.0
    assert exempt[id(model.head.weight)] == (0.0 if tie else 0.1)  # a tied head is E itself
    others = [p for n, p in model.named_parameters() if p.dim() >= 2 and p is not model.W_E and p is not model.W_pos
              and p is not model.head.weight]
    assert others and all(exempt[id(p)] == 0.1 for p in others)
    assert len(exempt) == len(list(model.parameters()))  # every parameter in exactly one group


def test_untied_head_option_gives_a_separate_matrix():
    tied = _decoder(partial(LearnedPE), tie=True)
    assert tied.head.weight is tied.W_E
    model = _decoder(partial(LearnedPE), tie=False)
    assert model.head.weight is not model.W_E and not torch.equal(model.head.weight, model.W_E)


# -- the C4 controls of the width curve: a frozen table, a table read in a random order per sequence ---------------


def _train_steps(model, steps: int = 3, seed: int = 0) -> None:
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        idx = torch.randint(0, VOCAB, (4, 16))
        loss = model(idx).logsumexp(-1).mean()  # any loss that reaches every parameter
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def test_frozen_table_keeps_the_mixed_start_while_the_rest_trains():
    trained = _decoder(partial(LearnedPE, init="mixed", init_k=K))
    frozen = _decoder(partial(LearnedPE, init="mixed", init_k=K, freeze=True))
    assert torch.equal(trained.W_pos, frozen.W_pos)  # the same start: the control differs only in training P
    start_P, start_E = frozen.W_pos.detach().clone(), frozen.W_E.detach().clone()
    _train_steps(frozen)
    _train_steps(trained)
    assert torch.equal(frozen.W_pos, start_P)
    assert not torch.equal(frozen.W_E, start_E)  # E (and everything else) still trains
    assert not torch.equal(trained.W_pos, start_P)
    # the optimiser the run builds leaves it out, so weight decay cannot shrink it either
    cfg = compose_train_config(["control=mixed_frozen"])
    optimizer = LanguageModelTask(frozen, optimizer=instantiate(cfg.optimizer), max_steps=10).configure_optimizers()["optimizer"]
    assert all(p is not frozen.W_pos for group in optimizer.param_groups for p in group["params"])


def test_shuffled_table_gives_each_sequence_a_permutation_of_the_rows():
    from pe_geometry.model.transformer import shuffled_rows

    rows = torch.arange(6.0).repeat_interleave(2).view(6, 2)  # row i = (i, i)
    torch.manual_seed(0)
    out = shuffled_rows(rows, batch_size=5)
    assert out.shape == (5, 6, 2)
    for sequence in out:  # each a permutation of all six rows, each row whole
        assert sorted(sequence[:, 0].tolist()) == list(range(6)) and torch.equal(sequence[:, 0], sequence[:, 1])
    assert len({tuple(s[:, 0].tolist()) for s in out}) > 1  # not one order for the whole batch
    # in the model: the input is E[x] + P[order], so a shuffled model's input rows are the plain model's, reordered
    plain = _decoder(partial(LearnedPE))
    shuffled = _decoder(partial(LearnedPE, shuffle=True))
    assert torch.equal(plain.W_pos, shuffled.W_pos)
    idx = torch.randint(0, VOCAB, (3, 10))
    torch.manual_seed(1)
    x = shuffled.decoder.embed(idx)
    torch.manual_seed(1)
    order = torch.rand(3, 10).argsort(dim=1)
    assert torch.allclose(x, plain.decoder.embedding(idx) + plain.W_pos[order])
    assert not torch.allclose(x, plain.decoder.embed(idx))


def test_width_scaled_lr_scales_only_the_hidden_matrices():
    """optimizer.lr_base_width: muP's Adam rule, hidden matrices at lr * base / d_model; E, P, norms, biases at lr."""
    from pe_geometry.training.optimizer import adamw_warmup_cosine

    for tie in (True, False):
        model = _decoder(partial(LearnedPE), tie=tie)  # d_model 64
        groups = adamw_warmup_cosine(model, 10, lr=1e-3, warmup_steps=0, lr_base_width=16)["optimizer"].param_groups
        lr = {id(p): g["initial_lr"] for g in groups for p in g["params"]}
        assert len(lr) == len(list(model.parameters()))
        assert lr[id(model.W_E)] == lr[id(model.W_pos)] == 1e-3
        attention = model.decoder.blocks[0].attn
        assert lr[id(attention.q.weight)] == pytest.approx(1e-3 * 16 / 64) and lr[id(attention.q.bias)] == 1e-3
        assert lr[id(model.decoder.blocks[0].ln_mlp.weight)] == 1e-3
        assert lr[id(model.head.weight)] == (1e-3 if tie else pytest.approx(1e-3 * 16 / 64))  # a tied head is E
        same = adamw_warmup_cosine(model, 10, lr=1e-3, warmup_steps=0, lr_base_width=64)["optimizer"].param_groups
        assert {g["initial_lr"] for g in same} == {1e-3}  # at the base width, one rate


@pytest.mark.parametrize("arm, key, value", [("mixed_frozen", "freeze", True), ("mixed_shuffled", "shuffle", True)])
def test_c4_control_arms_compose(arm, key, value):
    cfg = compose_train_config([f"control={arm}"])
    assert cfg.pe.init == "mixed" and cfg.pe[key] is value and cfg.pe._target_.endswith("LearnedPE")


def test_generating_from_a_shuffled_table_says_its_text_is_not_reproducible(tmp_path, tiny_corpus, cache_dir, monkeypatch, capsys):
    from pe_geometry.training.pipeline import train
    from tests.conftest import tiny_train_config
    from tests.test_generate import generate_cli  # generate.py's entry point, in this process

    train(tiny_train_config(tmp_path, tiny_corpus, cache_dir, ["pe=learned", "pe.shuffle=true"]))
    result = generate_cli([f"ckpt_path={tmp_path / 'run' / 'checkpoints' / 'last.ckpt'}", "max_new_tokens=2", "num_samples=1"],
                          tmp_path, monkeypatch, capsys)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "trained with pe.shuffle=true" in result.stderr
