"""pe.randomize_positions (Ruoss et al. 2023): in training each sequence reads its tokens at a sorted random subset of
[0, N); in evaluation and cached decoding at 0 .. T-1, exactly the plain model. Every family that reads position ids
takes it, the drawn ids enter each formula where the plain ones did, NoPE and CoPE refuse it in one line. For every
encoding option (tests/test_encoding_conformance.py, ``randomized``): evaluation and cached decoding are the plain
model, training is not, drawn ids 0 .. T-1 are the plain training pass, and a family without ids refuses it."""

from __future__ import annotations

import math

import pytest
import torch

from pe_geometry.analysis.readers.runs import read_run_rows
from pe_geometry.model import DecoderLM, EncoderMLM, ExplicitAttention, SDPAttention
from pe_geometry.model.positional import RANDOMIZABLE_FAMILIES, alibi_slopes, random_positions, sinusoidal_table
from pe_geometry.model.transformer import record_attention
from pe_geometry.training.pipeline import train
from pe_geometry.training.validate import ConfigError, check_config
from tests.conftest import PE_TYPES, compose_train_config, fast_loop_keeps
from tests.test_attention import live, pe_factory

N = 96  # positions drawn from, in the tests' models (sequences of 20-24 tokens)
REFUSING = ("cope", "forgetting", "none")


def build(pe: str, n: int | None = N, attention=SDPAttention, model_cls=DecoderLM, **settings) -> torch.nn.Module:
    """A seeded model (every PE weight made non-trivial): the same weights with and without the option."""
    torch.manual_seed(0)
    extra = {"mask_token_id": 1} if model_cls is EncoderMLM else {}
    model = model_cls(vocab_size=50, d_model=32, n_heads=4, n_layers=2, attention=attention,
                      pe=pe_factory(pe, randomize_positions=n, **settings), **extra)
    return live(model)


def recording_draws(model) -> list[torch.Tensor]:
    """Keep every position tensor the model's input stack draws (the forward uses them as drawn)."""
    pe, drawn = model.input_stack.pe, []
    original = pe.draw_positions

    def draw(*args, **kwargs):
        positions = original(*args, **kwargs)
        if positions is not None:
            drawn.append(positions)
        return positions

    pe.draw_positions = draw
    return drawn


# -- the draw ------------------------------------------------------------------------------------------------------------
def test_positions_are_sorted_distinct_within_range_and_differ_across_the_batch():
    torch.manual_seed(3)
    positions = random_positions(64, 32, 100)
    assert positions.shape == (64, 32) and positions.dtype == torch.long
    assert (positions >= 0).all() and (positions < 100).all()
    assert (positions.diff(dim=1) > 0).all()  # sorted and distinct
    assert len({tuple(row) for row in positions.tolist()}) == 64  # each sequence its own
    # uniform: every id of [0, 100) is drawn with probability 32/100
    counts = torch.bincount(random_positions(4000, 32, 100).flatten(), minlength=100).float() / 4000
    assert counts.sub(0.32).abs().max() < 0.05
    assert torch.equal(random_positions(5, 100, 100), torch.arange(100).expand(5, 100))  # N = T: the plain ids


def test_draws_come_from_the_global_generator_so_a_reseeded_run_draws_the_same():
    torch.manual_seed(11)
    first = random_positions(4, 16, 64)
    torch.manual_seed(11)
    assert torch.equal(random_positions(4, 16, 64), first)
    assert not torch.equal(random_positions(4, 16, 64), first)


def test_positions_are_drawn_only_while_training_with_the_option():
    model = build("rope")
    pe = model.input_stack.pe
    assert pe.draw_positions(2, 8) is not None
    assert model.eval().input_stack.pe.draw_positions(2, 8) is None
    assert build("rope", n=None).input_stack.pe.draw_positions(2, 8) is None
    assert build("rope", n=0).input_stack.pe.draw_positions(2, 8) is None  # 0: off
    with pytest.raises(ValueError, match="cannot take 24 distinct positions of \\[0, 16\\)"):
        build("rope", n=16)(torch.zeros(2, 24, dtype=torch.long))


def test_the_families_that_take_it_are_those_whose_class_reads_position_ids():
    classes = {pe: type(pe_factory(pe)(d_model=32, n_heads=4)) for pe in PE_TYPES}  # each yaml's class
    assert sorted(RANDOMIZABLE_FAMILIES) == sorted(pe for pe, cls in classes.items() if cls.Settings.takes_position_ids)
    assert sorted(set(PE_TYPES) - set(RANDOMIZABLE_FAMILIES)) == sorted(REFUSING)


# -- the drawn ids enter each formula ------------------------------------------------------------------------------------
def test_rope_rotates_token_t_by_its_drawn_position_times_theta():
    model = build("rope").train()
    drawn = recording_draws(model)
    idx = torch.randint(50, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), record_attention(model, points=("q_pre", "q", "k_pre", "k")) as rec:
        model(idx)
    (positions,) = drawn
    d_head = 8
    theta = 10000.0 ** (-torch.arange(0, d_head, 2, dtype=torch.float64) / d_head)  # (dh/2,)
    angle = positions.double()[:, None, :, None] * theta  # (B, 1, T, dh/2): pos_t * theta_i
    for block in rec.values():
        for pre, post in (("q_pre", "q"), ("k_pre", "k")):
            x = block[pre].double()
            even, odd = x[..., 0::2], x[..., 1::2]
            expected = torch.stack((even * angle.cos() - odd * angle.sin(), even * angle.sin() + odd * angle.cos()), -1)
            torch.testing.assert_close(block[post].double(), expected.flatten(-2), rtol=1e-5, atol=1e-5)


def test_alibi_biases_by_the_difference_of_the_drawn_ids():
    model = build("alibi", attention=ExplicitAttention).train()
    drawn = recording_draws(model)
    idx = torch.randint(50, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), record_attention(model, points=("score_bias",)) as rec:
        model(idx)
    (positions,) = drawn
    distance = (positions[:, :, None] - positions[:, None, :]).abs().float()  # (B, T, T)
    expected = -alibi_slopes(4)[None, :, None, None] * distance[:, None]
    torch.testing.assert_close(rec[0]["score_bias"], expected)
    assert distance.max() > 20  # ids past the block's length were drawn


def test_a_sinusoidal_model_adds_the_table_row_of_each_drawn_position():
    stack = build("sinusoidal").train().input_stack
    idx = torch.randint(50, (3, 20), generator=torch.Generator().manual_seed(1))
    positions = stack.pe.draw_positions(*idx.shape)
    with torch.no_grad():
        torch.testing.assert_close(stack.embed(idx, positions=positions),
                                   stack.embedding(idx) + sinusoidal_table(N, 32)[positions])


# -- training, and the config check -------------------------------------------------------------------------------------
TINY_TASK = [
    "data=task", "data.task=copy", "model.d_model=32", "model.n_heads=4", "model.n_layers=2",
    "data.seq_len=16", "data.batch_size=4", "data.val_examples=8", "pe.randomize_positions=64",
    "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=1", "trainer.enable_model_summary=false", "callbacks=no_geometry",
    "callbacks.checkpoint.every_n_train_steps=2", "~callbacks.progress_bar", "~callbacks.sample",
    "optimizer.warmup_steps=1", "logger=csv",
]


@pytest.mark.parametrize("pe", fast_loop_keeps(RANDOMIZABLE_FAMILIES, keep=["rope"]))
def test_every_family_that_takes_it_trains_with_it(pe, tmp_path):
    cfg = compose_train_config([*TINY_TASK, f"pe={pe}"], output_dir=tmp_path / "run")
    check_config(cfg)
    metrics = train(cfg)
    assert math.isfinite(metrics["train/loss"]) and 0.0 <= metrics["val/answer_accuracy"] <= 1.0


def test_a_resumed_run_draws_the_positions_the_straight_run_drew(tmp_path):
    def losses():
        return {int(r["step"]): float(r["train/loss"]) for r in read_run_rows(tmp_path / "run") if r["train/loss"]}

    straight = [*TINY_TASK, "pe=rope", "trainer.max_steps=4", "trainer.val_check_interval=4"]
    train(compose_train_config(straight, output_dir=tmp_path / "run"))
    a = losses()
    step2 = tmp_path / "run" / "checkpoints" / "step000002.ckpt"
    train(compose_train_config([*straight, f"ckpt_path={step2}"], output_dir=tmp_path / "run"))
    b = losses()
    assert sorted(a) == sorted(b) == list(range(4))
    assert all(math.isclose(a[s], b[s], rel_tol=1e-6) for s in a), (a, b)


FAMILIES = "the families that take it: pe=sinusoidal, learned, rope, xpos, alibi, t5_bias, fire, kerple"
REFUSALS = [
    (["pe=none", "pe.randomize_positions=64"],
     f"pe=none: pe.randomize_positions=64 draws position ids, and NoPE has none (no positional encoding); {FAMILIES}"),
    (["pe=cope", "pe.randomize_positions=64"],
     "pe=cope: pe.randomize_positions=64 draws position ids, and CoPE has none (its positions are counts of the keys a "
     f"query's gates open); {FAMILIES}"),
    (["pe=learned", "pe.max_len=128", "pe.randomize_positions=256"],
     "pe=learned: pe.randomize_positions=256 is past the learned position table (pe.max_len=128): positions are drawn "
     "from [0, pe.randomize_positions); raise pe.max_len or lower pe.randomize_positions"),
    (["pe=learned", "pe.shuffle=true", "pe.randomize_positions=256"],
     "pe=learned: pe.randomize_positions=256 with pe.shuffle=true: the shuffle control already reads the rows in a "
     "random order; choose one"),
    (["pe=rope", "data.seq_len=64", "pe.randomize_positions=32"],
     "pe=rope: pe.randomize_positions=32 must be at least data.seq_len=64: each block draws data.seq_len distinct "
     "positions of [0, pe.randomize_positions)"),
    (["pe=alibi", "pe.randomize_positions=-1"],
     "pe.randomize_positions=-1 must be an integer in [0, 1048576] (positions drawn from in training; 0: off), or null for off"),
    (["pe=alibi", "pe.randomize_positions=1000000000000"],  # passed every check, then the first step asked for 128 TB
     "pe.randomize_positions=1000000000000 must be an integer in [0, 1048576] (positions drawn from in training; 0: off), "
     "or null for off"),
]


@pytest.mark.parametrize("overrides,message", REFUSALS, ids=[" ".join(o) for o, _ in REFUSALS])
def test_a_setting_that_cannot_work_is_one_line(overrides, message, tmp_path):
    cfg = compose_train_config(overrides, tmp_path)
    with pytest.raises(ConfigError) as err:
        check_config(cfg)
    assert str(err.value) == message


def test_off_by_default_and_zero_is_off(tmp_path):
    for pe in PE_TYPES:
        cfg = compose_train_config([f"pe={pe}"], tmp_path)
        assert cfg.pe.randomize_positions is None
    check_config(compose_train_config(["pe=none", "pe.randomize_positions=0"], tmp_path))
