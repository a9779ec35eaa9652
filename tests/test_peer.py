"""The peer (model=xtransformers, pe_geometry/model/peer.py): x-transformers' own modules behind our decoder's
interface, trained by pe-train and read back by the run loader, as the length-extrapolation benchmark's peer arms.

The adapter is x-transformers called directly (same weights, same logits); every family is causal, x-transformers' own
module for it, and runs past the training length; what the peer cannot honour (our pe beside its own, an attention
variant, the geometry recorder, a bad family) is one line; a tiny run trains, loads back with the logits and the
validation loss it logged, and is labelled and scored by pe-bench extrapolation's protocol.
"""

from __future__ import annotations

import importlib.util
import math
import typing

import pytest
import torch

x_transformers = pytest.importorskip("x_transformers")

from pe_geometry.benchmarks.arms import arm_label  # noqa: E402
from pe_geometry.model.peer import PEER_FLAGS, PeerFamily, XTransformersLM  # noqa: E402
from pe_geometry.training.validate import ConfigError, check_config  # noqa: E402
from tests.conftest import compose_train_config, tiny_train_config  # noqa: E402

FAMILIES = list(typing.get_args(PeerFamily))
V, D, H, LAYERS, T = 40, 32, 4, 2, 16


def peer(family: str, seed: int = 0, **settings) -> XTransformersLM:
    torch.manual_seed(seed)
    return XTransformersLM(vocab_size=V, peer_pe=family, d_model=D, n_heads=H, n_layers=LAYERS, **settings).eval()


def _partial(cls, **keywords):
    import functools

    return functools.partial(cls, **keywords)


def test_every_family_has_its_flag():
    assert set(PEER_FLAGS) == set(FAMILIES) == {"rope", "xpos", "alibi", "t5_bias", "cope", "none", "dynamic_bias"}


# -- the adapter is x-transformers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_adapter_is_x_transformers_called_directly_with_the_same_weights(family, tie):
    """The direct build ties its head as x-transformers does (a closure, tie_embedding_scale 1); the adapter shares
    E's parameter with x-transformers' own bias-free head: the same logits."""
    from pe_geometry.model.embedding import TokenEmbedding

    torch.manual_seed(0)
    model = XTransformersLM(V, peer_pe=family, d_model=D, n_heads=H, n_layers=LAYERS,
                            embedding=_partial(TokenEmbedding, tie_weights=tie)).eval()
    direct = x_transformers.TransformerWrapper(**XTransformersLM.wrapper_kwargs(V, family, D, H, LAYERS, 4 * D, 0.0, "pre",
                                                                               tie)).eval()
    weights = {k.removeprefix("net."): v for k, v in model.state_dict().items()}
    if tie:
        assert weights.pop("to_logits.weight").data_ptr() == weights["token_emb.emb.weight"].data_ptr()  # one tensor
    direct.load_state_dict(weights)  # strict: every parameter and buffer of the one is the other's
    idx = torch.randint(V, (3, T))
    with torch.no_grad():
        assert torch.equal(model(idx), direct(idx))
    assert (model.net.to_logits.weight is model.net.token_emb.emb.weight) == tie


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_is_causal_and_reads_past_the_training_length(family):
    model = peer(family)
    idx = torch.randint(V, (2, T))
    changed = idx.clone()
    changed[:, T // 2:] = (changed[:, T // 2:] + 1) % V
    with torch.no_grad():
        before, after = model(idx), model(changed)
        long = model(torch.randint(V, (1, 8 * T)))  # no position table: any length
    torch.testing.assert_close(before[:, : T // 2], after[:, : T // 2], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, T // 2:], after[:, T // 2:])
    assert long.shape == (1, 8 * T, V) and torch.isfinite(long).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_family_is_x_transformers_own_module_and_nothing_else_places_tokens(family):
    """No absolute table (x-transformers adds one beside ALiBi, CoPE and the dynamic bias unless told not to), none of
    our encodings, and exactly the family's own module, rotating every dimension of a head as our RoPE does."""
    from pe_geometry.model.positional import PositionalEncoding

    xt = importlib.import_module("x_transformers.x_transformers")
    model = peer(family)
    layers = model.net.attn_layers
    assert type(model.net.pos_emb).__name__ == "always" and not any(isinstance(m, PositionalEncoding) for m in model.modules())
    rotary, bias = layers.rotary_pos_emb, layers.rel_pos
    copes = [m for m in model.modules() if isinstance(m, xt.CoPE)]
    expected_bias = {"alibi": xt.AlibiPositionalBias, "t5_bias": xt.RelativePositionBias,
                     "dynamic_bias": xt.DynamicPositionBias}.get(family)
    assert (rotary is not None) == (family in ("rope", "xpos"))
    if rotary is not None:
        assert rotary.inv_freq.numel() * 2 == D // H and (rotary.scale is not None) == (family == "xpos")
    assert (type(bias) if bias is not None else None) is expected_bias
    assert len(copes) == (LAYERS if family == "cope" else 0)
    assert [m.heads for m in model.modules() if isinstance(m, xt.Attention)] == [H] * LAYERS
    assert model.net.attn_layers.attn_dim_head == D // H


def test_the_recipe_flags_are_ours_where_x_transformers_has_them():
    """Pre-norm LayerNorm (a plain gain: no unit offset) and a final norm, a 4x GELU MLP with biases, no dropout;
    model.norm=post and model.d_ff are honoured."""
    xt = importlib.import_module("x_transformers.x_transformers")
    model = peer("rope")
    layers = model.net.attn_layers
    ffs = [m for m in model.modules() if isinstance(m, xt.FeedForward)]
    assert len(ffs) == LAYERS and all(isinstance(f.ff[0][-1], torch.nn.GELU) for f in ffs)
    assert all(f.ff[0][0].out_features == 4 * D and f.ff[0][0].bias is not None for f in ffs)
    assert layers.pre_norm and isinstance(layers.final_norm, xt.LayerNorm) and not layers.final_norm.unit_offset
    assert not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
    post = peer("rope", norm="post", d_ff=3 * D)
    assert not post.net.attn_layers.pre_norm and [f.ff[0][0].out_features for f in post.modules()
                                                  if isinstance(f, xt.FeedForward)] == [3 * D] * LAYERS


def test_our_optimiser_treats_its_embedding_and_position_parameters_as_ours():
    """optimizer.no_decay_embeddings and lr_base_width read them: the token embedding (the tied head is it) and the
    family's own parameters."""
    from pe_geometry.training.optimizer import embedding_parameters, weight_decay_groups

    model = peer("t5_bias")
    kept = {id(p) for p in embedding_parameters(model)}
    assert kept == {id(model.net.token_emb.emb.weight), id(model.net.attn_layers.rel_pos.relative_attention_bias.weight)}
    decay, no_decay = weight_decay_groups(model, 0.1, no_decay_embeddings=True)
    assert not kept & {id(p) for p in decay["params"]} and kept <= {id(p) for p in no_decay["params"]}
    rope = peer("rope")
    assert [id(p) for p in embedding_parameters(rope)] == [id(rope.net.token_emb.emb.weight)]


# -- what the peer cannot honour: one line -------------------------------------------------------------------------
def test_model_xtransformers_sets_pe_none_and_leaves_the_geometry_recorder_out(tmp_path):
    cfg = compose_train_config(["model=xtransformers"], tmp_path)
    assert cfg.pe._target_.endswith("NoPE") and cfg.callbacks.get("geometry") is None
    assert cfg.model.peer_pe == "rope" and cfg.model._target_ == "pe_geometry.model.peer.XTransformersLM"
    check_config(cfg)


def test_a_bad_peer_pe_is_one_line_naming_the_valid_choices(tmp_path):
    valid = str(FAMILIES).replace("[", r"\[").replace("]", r"\]")
    with pytest.raises(ConfigError, match=rf"^model.peer_pe=alibi2 must be one of {valid}$"):
        check_config(compose_train_config(["model=xtransformers", "model.peer_pe=alibi2"], tmp_path))
    with pytest.raises(ValueError, match=rf"^model.peer_pe=alibi2 must be one of {valid}$"):
        XTransformersLM(V, peer_pe="alibi2")


@pytest.mark.parametrize(("overrides", "message"), [
    (["pe=rope"], r"^model=xtransformers builds its position encoding from model.peer_pe \(x-transformers' own\); "
                  r"pe=rope would add ours beside it: leave pe out \(model=xtransformers sets pe=none\)$"),
    (["attention.window=8"], r"^model=xtransformers builds x-transformers' own attention: attention.window would be "
                             r"ignored; leave it at the default$"),
    (["embedding=scaled"], r"^model=xtransformers reads its tokens with x-transformers' plain embedding: use "
                           r"embedding=plain \(embedding.tie_weights is honoured\)$"),
    (["callbacks=default"], r"^model=xtransformers: the geometry recorder reads our models' embedding and attention "
                            r"hook points, which the modules of x-transformers do not have; use callbacks=no_geometry$"),
])
def test_what_the_peer_would_ignore_is_refused_in_one_line(overrides, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        check_config(compose_train_config(["model=xtransformers", *overrides], tmp_path))


def test_a_peer_built_with_our_encoding_refuses_it_too():
    """The pipeline's factories, as build_model passes them: the constructor checks what validate checks."""
    from pe_geometry.model.positional import NoPE, RotaryPE

    assert XTransformersLM(V, peer_pe="alibi", d_model=D, n_heads=H, n_layers=LAYERS, pe=_partial(NoPE)).peer_pe == "alibi"
    with pytest.raises(ValueError, match=r"pe=RotaryPE would add ours beside it"):
        XTransformersLM(V, peer_pe="alibi", d_model=D, n_heads=H, n_layers=LAYERS, pe=_partial(RotaryPE, base=500.0))


# -- trained, loaded back, labelled and scored --------------------------------------------------------------------
def test_a_tiny_peer_run_trains_and_loads_back_with_its_logits_and_validation_loss(tmp_path, tiny_corpus, cache_dir):
    """rope: the family whose FLOPs cannot be counted on the meta device (x-transformers' rotary calls autocast), so
    the run logs tokens/s without them; the text sample is skipped (generation is through our KV cache)."""
    from pe_geometry.analysis.measures.position_attention import NoHookPoints, position_attention_report
    from pe_geometry.analysis.readers.extrapolation import fixed_target_losses
    from pe_geometry.training.pipeline import train
    from pe_geometry.training.run_loader import load_trained_run

    cfg = tiny_train_config(tmp_path, tiny_corpus, cache_dir, ["model=xtransformers", "model.peer_pe=rope"])
    metrics = train(cfg)
    assert math.isfinite(metrics["train/loss"]) and math.isfinite(metrics["val/loss"])
    run = load_trained_run(tmp_path / "run")
    assert isinstance(run.model, XTransformersLM) and run.step == 3 and run.config.pe._target_.endswith("NoPE")
    saved = torch.load(run.checkpoint_path, map_location="cpu", weights_only=False)["state_dict"]
    assert {k: v for k, v in run.model.state_dict().items()}.keys() == {k.removeprefix("model.") for k in saved}
    assert all(torch.equal(v, saved[f"model.{k}"]) for k, v in run.model.state_dict().items())
    # the logged validation loss (limit_val_batches=1: the first validation batch) is the rebuilt model's
    batch = next(iter(run.datamodule.val_dataloader()))
    with torch.no_grad():
        assert run.model.loss(batch).item() == pytest.approx(metrics["val/loss"], rel=1e-5)
        direct = x_transformers.TransformerWrapper(**XTransformersLM.wrapper_kwargs(
            run.model.vocab_size, "rope", 32, 4, 2, 128, 0.0, "pre", True)).eval()
        direct.load_state_dict({k.removeprefix("net."): v for k, v in run.model.state_dict().items()
                                if k != "net.to_logits.weight"})
        assert torch.equal(run.model(batch[:, :-1]), direct(batch[:, :-1]))
    # the benchmark's protocol and label
    scores = fixed_target_losses(run.model, run.datamodule.streams["validation"], 16, [1, 2, 4], max_windows=2)
    assert all(math.isfinite(scores["lengths"][m]["loss"]) for m in ("1", "2", "4"))
    assert arm_label("none", run.config, layers=2) == "peer x-transformers: rope"
    with pytest.raises(NoHookPoints, match=r"^XTransformersLM \(built from x-transformers\) has none of our attention"):
        position_attention_report(run.model, batch[:, :-1])
    # resumed from its step-2 checkpoint (as pe-train ckpt_path=... does), it ends with the uninterrupted run's weights
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    written = last.stat().st_mtime_ns
    train(compose_train_config([f"ckpt_path={tmp_path / 'run' / 'checkpoints' / 'step000002.ckpt'}"], tmp_path / "resume"))
    again = torch.load(last, map_location="cpu", weights_only=False)
    assert last.stat().st_mtime_ns > written and again["global_step"] == 3  # step 3 trained again, and written
    assert again["state_dict"].keys() == saved.keys() and all(torch.equal(again["state_dict"][k], saved[k]) for k in saved)


def test_a_peer_arm_is_named_by_its_family_and_a_depth_not_the_benchmarks(tmp_path):
    config = compose_train_config(["model=xtransformers", "model.peer_pe=t5_bias", "model.n_layers=2"], tmp_path)
    assert arm_label("none", config, layers=2) == "peer x-transformers: t5_bias"
    deeper = compose_train_config(["model=xtransformers", "model.peer_pe=alibi", "model.n_layers=4"], tmp_path)
    assert arm_label("none", deeper, layers=2) == "peer x-transformers: alibi (4 layers)"
    assert arm_label("none", compose_train_config(["pe=none"], tmp_path), layers=4) == "none"  # ours: as before


def test_the_peer_sweep_is_every_family_at_the_benchmarks_shape_and_seeds(tmp_path):
    from omegaconf import OmegaConf

    from pe_geometry.configs import CONFIG_DIR

    peer_sweep = OmegaConf.load(CONFIG_DIR / "experiment" / "extrapolation_peer.yaml").hydra.sweeper.params
    ours = OmegaConf.load(CONFIG_DIR / "experiment" / "extrapolation.yaml").hydra.sweeper.params
    assert peer_sweep["model.peer_pe"].split(",") == FAMILIES and peer_sweep.seed == ours.seed and peer_sweep.pe == "none"
    cfg = compose_train_config(["experiment=extrapolation_peer"], tmp_path)
    benchmark = compose_train_config(["experiment=extrapolation"], tmp_path)
    check_config(cfg)
    for key in ("data", "optimizer", "trainer"):
        assert OmegaConf.to_container(cfg[key]) == OmegaConf.to_container(benchmark[key]), key
    shape = ("d_model", "n_heads", "n_layers")
    assert {k: cfg.model[k] for k in shape} == {k: benchmark.model[k] for k in shape}
    assert cfg.pe._target_.endswith("NoPE") and cfg.callbacks.get("geometry") is None
