"""Control arms of the study: a learned table that starts inside E's principal subspace, the sinusoidal
table scaled to the word norm or centred, and no weight decay on E and P."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from hydra.utils import instantiate

from pe_geometry.analysis import geometry as geo
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
