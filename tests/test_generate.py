"""Sampling: the KV cache gives the logits of a full forward pass, filters keep what they should,
seeds fix the text, and generate.py / the end-of-training sample work from a real checkpoint."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from omegaconf import DictConfig, OmegaConf

from pe_geometry.model import DecoderLM, EncoderDecoder, EncoderMLM, ExplicitAttention, KVCache, LearnedPE, SDPAttention
from pe_geometry.model.sampling import Decoding, fill_masks, generate, next_token, token_nll, top_k_filter, top_p_filter
from tests import forkserver
from tests.conftest import CONFIG_DIR, PE_TYPES, ROOT, fast_loop_covers, tiny_train_config
from tests.test_attention import build, live

NEG_INF = float("-inf")


def incremental_logits(model, idx: torch.Tensor, src: torch.Tensor | None) -> torch.Tensor:
    """Logits of idx read through one KVCache: a 5-token prefill, 7 single tokens, then the rest as a chunk."""
    cache = KVCache()
    step = (lambda ids: model(ids, cache=cache)) if src is None else (lambda ids: model(src, ids, cache=cache))
    pieces = [idx[:, :5], *(idx[:, t : t + 1] for t in range(5, 12)), idx[:, 12:]]
    logits = torch.cat([step(piece) for piece in pieces], dim=1)
    assert cache.length == idx.shape[1]
    return logits


@pytest.mark.parametrize("model_cls,pe,attention", fast_loop_covers([DecoderLM, EncoderDecoder], PE_TYPES,
                                                                     [ExplicitAttention, SDPAttention]))
def test_cached_decoding_gives_the_logits_of_a_full_forward_pass(model_cls, pe, attention):
    model = live(build(model_cls, pe, attention)).eval()  # every PE weight at random: CoPE's table starts at zero
    idx = torch.randint(50, (2, 20), generator=torch.Generator().manual_seed(1))
    src = idx[:, :7] if model_cls is EncoderDecoder else None
    with torch.no_grad():
        full = model(idx) if src is None else model(src, idx)
        cached = incremental_logits(model, idx, src)
    assert (cached - full).abs().max().item() <= 1e-5


def test_cached_decoding_past_the_initial_sinusoidal_table():
    """The sinusoidal table grows on demand; a cached step past its initial size gets the right row."""
    from pe_geometry.model import SinusoidalPE

    torch.manual_seed(0)
    model = DecoderLM(vocab_size=50, d_model=32, n_heads=4, n_layers=2, pe=lambda **kw: SinusoidalPE(**kw, max_len=8)).eval()
    idx = torch.randint(50, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cached = incremental_logits(model, idx, None)
        model.decoder.pe.table = model.decoder.pe.table[:8]  # back to the initial size for the full pass
        full = model(idx)
    assert (cached - full).abs().max().item() <= 1e-5


def test_cache_keeps_keys_already_rotated_and_encoder_output_once():
    model = build(EncoderDecoder, "rope", SDPAttention).eval()
    calls = []
    model.encoder.register_forward_hook(lambda *_: calls.append(1))
    cache = KVCache()
    with torch.no_grad():
        for t in range(4):
            model(torch.ones(1, 3, dtype=torch.long), torch.full((1, 1), t), cache=cache)
    assert len(calls) == 1  # the encoder ran on the first step only
    k, v = cache.get(model.decoder.blocks[0].attn)
    assert k.shape == v.shape == (1, 4, 4, 8)  # (B, H, tokens so far, d_head)
    assert cache.get(model.decoder.blocks[0].cross_attn)[0].shape == (1, 4, 3, 8)  # the 3 source tokens


@pytest.mark.parametrize("capacity", [None, 1, 6, 40])
@pytest.mark.parametrize("keep", [None, 1, 3])
def test_cache_buffer_holds_what_concatenation_would(capacity, keep):
    """Appends of 1-5 tokens into a buffer that starts too small, grows, or has room for all: each call returns the
    earlier keys (at most ``keep``) followed by the new ones, exactly as torch.cat of the whole history would; views
    handed out earlier are not overwritten by later appends."""
    layer, cache, rng = torch.nn.Identity(), KVCache(capacity), torch.Generator().manual_seed(0)
    history_k, history_v, handed = torch.zeros(2, 3, 0, 4), torch.zeros(2, 3, 0, 4), []
    for T in [5, 1, 1, 2, 1, 4, 1, 1, 3, 1, 1, 1]:
        k, v = torch.randn(2, 3, T, 4, generator=rng), torch.randn(2, 3, T, 4, generator=rng)
        history_k, history_v = torch.cat((history_k, k), dim=2), torch.cat((history_v, v), dim=2)
        seen_k, seen_v = cache.append(layer, k, v, keep)
        assert torch.equal(seen_k, history_k) and torch.equal(seen_v, history_v)
        handed.append((seen_k, seen_k.clone()))
        if keep is not None:  # the window: what the next call sees of the past
            history_k, history_v = history_k[:, :, -keep:], history_v[:, :, -keep:]
        assert torch.equal(cache.get(layer)[0], history_k) and torch.equal(cache.get(layer)[1], history_v)
    assert all(torch.equal(view, copy) for view, copy in handed)


def test_generate_sizes_the_cache_once(monkeypatch):
    """generate knows the text's final length: each layer's buffer is allocated once, at prompt + new tokens - 1."""
    model = live(build(DecoderLM, "rope", SDPAttention)).eval()
    sizes, original = [], KVCache.append

    def spy(self, layer, k, v, keep=None):
        seen = original(self, layer, k, v, keep)
        sizes.append(self._buffers[layer][0].shape[2])
        return seen

    monkeypatch.setattr(KVCache, "append", spy)
    generate(model, torch.ones(1, 3, dtype=torch.long), max_new_tokens=6, temperature=0)
    assert set(sizes) == {3 + 6 - 1}


@pytest.mark.parametrize("model_cls,pe", fast_loop_covers([DecoderLM, EncoderDecoder], PE_TYPES))
def test_greedy_text_is_the_same_with_and_without_the_cache(model_cls, pe):
    model = live(build(model_cls, pe, SDPAttention)).eval()
    prompt = torch.randint(50, (2, 6), generator=torch.Generator().manual_seed(2))
    cached = generate(model, prompt, 30, temperature=0, use_cache=True)
    uncached = generate(model, prompt, 30, temperature=0, use_cache=False)
    assert cached.shape == (2, 36) and torch.equal(cached[:, :6], prompt)
    assert torch.equal(cached, uncached)


def test_the_same_seed_gives_the_same_sample_and_another_seed_another():
    model = build(DecoderLM, "rope", SDPAttention).eval()
    prompt = torch.zeros(3, 2, dtype=torch.long)

    def sample(seed: int, use_cache: bool = True) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return generate(model, prompt, 40, temperature=1.5, top_k=20, top_p=0.95, generator=g, use_cache=use_cache)

    first = sample(0)
    assert torch.equal(first, sample(0))
    assert torch.equal(first, sample(0, use_cache=False))
    assert not torch.equal(first, sample(1))
    assert not torch.equal(first[0], first[1])  # the samples of one batch differ from each other


# prompt_len: shorter than the window, then already longer than it
@pytest.mark.parametrize("model_cls,pe,attention,prompt_len", fast_loop_covers([DecoderLM, EncoderDecoder], PE_TYPES,
                                                                                [ExplicitAttention, SDPAttention], [3, 13]))
def test_windowed_cached_logits_equal_an_uncached_forward_over_the_last_n_tokens(model_cls, pe, attention, prompt_len):
    """At every step, before and after the window starts to slide, the cached logits are those of a plain
    forward pass over the last N tokens (the encoder-decoder: its last source window, its last decoder window)."""
    model = live(build(model_cls, pe, attention)).eval()
    context = 10
    prompt = torch.randint(50, (2, prompt_len), generator=torch.Generator().manual_seed(4))
    decoding = Decoding(model, prompt, context=context, use_cache=True)
    source_window = model.source_len(context) if model_cls is EncoderDecoder else None
    decoder_window = context - source_window if source_window else context
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _ in range(3 * context):
            window = decoding.tokens[:, -decoder_window:]
            if model_cls is EncoderDecoder:
                expected = model(decoding.source[:, -source_window:], window)[:, -1]
            else:
                expected = model(window)[:, -1]
            assert (decoding.logits() - expected).abs().max().item() <= 1e-5
            decoding.append(torch.randint(50, (2, 1), generator=g))
    assert decoding.tokens.shape[1] > 2 * context  # the window slid for most of the steps


@pytest.mark.parametrize("pe", PE_TYPES)
def test_windowed_generation_is_the_same_with_and_without_the_cache(pe):
    model = build(DecoderLM, pe, SDPAttention).eval()
    prompt = torch.randint(50, (2, 4), generator=torch.Generator().manual_seed(2))
    cached = generate(model, prompt, 30, temperature=0, context=8)
    assert cached.shape == (2, 34) and torch.equal(cached, generate(model, prompt, 30, temperature=0, context=8, use_cache=False))


def test_context_lets_a_learned_table_write_past_its_size_and_full_context_cannot():
    model = DecoderLM(vocab_size=20, d_model=16, n_heads=2, n_layers=1, pe=lambda **kw: LearnedPE(**kw, max_len=10)).eval()
    prompt = torch.zeros(1, 4, dtype=torch.long)
    assert generate(model, prompt, 40, context=10).shape == (1, 44)  # each token reads at most 10 positions
    with pytest.raises(ValueError, match="43 positions needed but the LearnedPE table has 10"):
        generate(model, prompt, 40, context=None)
    with pytest.raises(ValueError, match="12 positions needed"):  # a window larger than the table is refused too
        generate(model, prompt, 40, context=12)


def test_token_nll_is_the_cross_entropy_of_the_window_the_text_was_read_through():
    model = build(DecoderLM, "sinusoidal", SDPAttention).eval()
    tokens = torch.randint(50, (2, 25), generator=torch.Generator().manual_seed(6))
    nll = token_nll(model, tokens, context=8)
    assert nll.shape == (2, 24)
    with torch.no_grad():
        in_window = torch.nn.functional.cross_entropy(model(tokens[:, :8]).transpose(1, 2), tokens[:, 1:9], reduction="none")
        last = torch.nn.functional.cross_entropy(model(tokens[:, -9:-1])[:, -1], tokens[:, -1], reduction="none")
    assert torch.allclose(nll[:, :8], in_window, atol=1e-5)  # the first 8 targets: one ordinary forward
    assert torch.allclose(nll[:, -1], last, atol=1e-5)  # the last target: read from the 8 tokens before it
    assert not torch.allclose(token_nll(model, tokens, context=None)[:, -1], last, atol=1e-3)  # full context differs


def test_the_encoder_fills_each_blank_from_the_window_centred_on_it():
    model = build(EncoderMLM, "learned", SDPAttention).eval()
    ids = torch.randint(2, 50, (1, 30), generator=torch.Generator().manual_seed(3))
    ids[:, [2, 15, 28]] = model.mask_token_id
    filled = fill_masks(model, ids, context=8)
    with torch.no_grad():
        for blank, start in ((2, 0), (15, 11), (28, 22)):  # clipped at the start, centred, clipped at the end
            logits = model(ids[:, start : start + 8])[0, blank - start]
            logits[model.mask_token_id] = NEG_INF
            assert filled[0, blank] == logits.argmax()
    assert torch.equal(fill_masks(model, ids[:, :8], context=8), fill_masks(model, ids[:, :8]))  # short text: one pass


def test_top_k_keeps_the_k_largest_logits():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [0.0, -1.0, 5.0, 5.0]])
    assert top_k_filter(logits, 2).tolist() == [[NEG_INF, 4.0, 3.0, NEG_INF], [NEG_INF, NEG_INF, 5.0, 5.0]]
    assert torch.equal(top_k_filter(logits, None), logits) and torch.equal(top_k_filter(logits, 10), logits)


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.tensor([0.5, 0.05, 0.25, 0.2]).log()[None]  # probabilities 0.5, 0.05, 0.25, 0.2
    # sorted 0.5, 0.25, 0.2, 0.05: 0.5 < 0.6, 0.5 + 0.25 >= 0.6 -> keep {0.5, 0.25}
    assert torch.isfinite(top_p_filter(logits, 0.6))[0].tolist() == [True, False, True, False]
    assert torch.isfinite(top_p_filter(logits, 0.9))[0].tolist() == [True, False, True, True]
    assert torch.isfinite(top_p_filter(logits, 0.1))[0].tolist() == [True, False, False, False]  # the top token stays
    assert torch.equal(top_p_filter(logits, 1.0), logits)


def test_next_token_greedy_and_filtered_sampling():
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0]])
    assert next_token(logits, temperature=0).tolist() == [1]
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([next_token(logits, 1.0, top_k=2, generator=g) for _ in range(200)])
    assert set(draws.flatten().tolist()) == {1, 2}  # only the two largest logits can be drawn
    hot = torch.stack([next_token(logits, 100.0, generator=g) for _ in range(400)])
    assert set(hot.flatten().tolist()) == {0, 1, 2, 3}  # a high temperature flattens the distribution


def test_learned_table_length_limit_is_a_clear_error():
    model = DecoderLM(vocab_size=20, d_model=16, n_heads=2, n_layers=1, pe=lambda **kw: LearnedPE(**kw, max_len=10))
    with pytest.raises(ValueError, match=r"12 positions needed but the LearnedPE table has 10 \(pe.max_len\)"):
        generate(model, torch.zeros(1, 4, dtype=torch.long), 9)
    assert generate(model, torch.zeros(1, 4, dtype=torch.long), 7).shape == (1, 11)  # 10 positions read: fits


@pytest.mark.parametrize("pe", PE_TYPES)
def test_encoder_fills_only_the_blanks_with_its_best_guess(pe):
    model = build(EncoderMLM, pe, SDPAttention).eval()
    ids = torch.randint(2, 50, (2, 12), generator=torch.Generator().manual_seed(3))
    ids[:, [3, 7]] = model.mask_token_id
    filled = fill_masks(model, ids)
    with torch.no_grad():
        logits = model(ids)
    logits[..., model.mask_token_id] = NEG_INF
    keep = ids != model.mask_token_id
    assert torch.equal(filled[keep], ids[keep])
    assert torch.equal(filled[:, [3, 7]], logits[:, [3, 7]].argmax(-1))
    assert not (filled == model.mask_token_id).any()


# -- from a real checkpoint ---------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_runs(tmp_path_factory, tiny_corpus, cache_dir):
    """Tiny decoder (learned PE, so it has a length limit) and encoder runs of 5 steps, with what
    the end-of-training sample callback logged for each."""
    import logging

    from pe_geometry.training.pipeline import train

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            samples.append(record.getMessage())

    sample_log, handler = logging.getLogger("pe_geometry.training.sample"), Keep()
    sample_log.addHandler(handler)
    sample_log.setLevel(logging.INFO)
    runs = {}
    try:
        for model, pe in (("decoder", "learned"), ("encoder", "rope")):
            samples: list[str] = []
            root = tmp_path_factory.mktemp(model)
            overrides = [f"model={model}", f"pe={pe}", "trainer.max_steps=5", "callbacks=no_geometry"]
            train(tiny_train_config(root, tiny_corpus, cache_dir, overrides))
            runs[model], runs[f"{model}_samples"] = root / "run", samples
    finally:
        sample_log.removeHandler(handler)
    return runs


def generate_options(ckpt, **options) -> DictConfig:

    cfg = OmegaConf.load(CONFIG_DIR / "generate.yaml")
    del cfg["defaults"], cfg["hydra"]
    cfg.merge_with({"ckpt_path": str(ckpt), "num_samples": 2, "max_new_tokens": 12, **options})
    return cfg


def test_generate_rebuilds_the_model_from_the_run_config(trained_runs):
    from pe_geometry.cli.generate import run

    ckpt = trained_runs["decoder"] / "checkpoints" / "last.ckpt"
    texts = run(generate_options(ckpt, prompt="HAMLET:"))
    assert len(texts) == 2 and all(t.startswith("HAMLET:") and len(t) > len("HAMLET:") for t in texts)
    assert texts == run(generate_options(ckpt, prompt="HAMLET:"))
    assert run(generate_options(ckpt, prompt="HAMLET:", temperature=0, use_cache=False)) == run(
        generate_options(ckpt, prompt="HAMLET:", temperature=0)
    )


def test_generate_fills_in_the_blanks_with_an_encoder_checkpoint(trained_runs):
    from pe_geometry.cli.generate import GenerateError, run

    ckpt = trained_runs["encoder"] / "checkpoints" / "last.ckpt"
    (text,) = run(generate_options(ckpt, prompt="To be, or not to <mask>, that is the <mask>", num_samples=1))
    assert text.startswith("To be, or not to") and "<mask>" not in text and text.count(" ") >= 8
    with pytest.raises(GenerateError, match="mark them with <mask>"):
        run(generate_options(ckpt, prompt="no blanks here"))


def test_a_rope_run_is_read_with_an_inference_scaling_it_was_not_trained_with(trained_runs):
    """pe-generate's ``pe.scaling=yarn pe.scaling_factor=4`` over a run trained with scaling=none: same weights,
    other angles; a setting the run's encoding does not have is one line naming the valid ones."""
    from pe_geometry.cli.generate import run
    from pe_geometry.training.run_loader import RunLoadError, load_trained_run

    plain = load_trained_run(trained_runs["encoder"])
    scaled = load_trained_run(trained_runs["encoder"], pe_overrides={"scaling": "yarn", "scaling_factor": 4, "yarn_beta": None})
    pe = scaled.model.encoder.pe
    assert (pe.scaling, pe.scaling_factor, pe.training_length) == ("yarn", 4.0, 16)  # training_length: the run's data.seq_len
    assert all(torch.equal(a, b) for a, b in zip(plain.model.state_dict().values(), scaled.model.state_dict().values()))
    ids = torch.randint(5, 50, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert not torch.allclose(plain.model(ids), scaled.model(ids))
    ckpt = trained_runs["encoder"] / "checkpoints" / "last.ckpt"
    options = {"prompt": "To be, or not to <mask>", "num_samples": 1, "context": "full"}
    (text,) = run(generate_options(ckpt, **options, pe={"scaling": "ntk", "scaling_factor": 2.0}))
    assert "<mask>" not in text
    with pytest.raises(RunLoadError, match=r"pe.scaling is not a setting of pe \(pe_geometry.model.LearnedPE\); valid: \["):
        load_trained_run(trained_runs["decoder"], pe_overrides={"scaling": "yarn"})
    with pytest.raises(RunLoadError, match=r"pe.scaling=cubic must be one of"):
        load_trained_run(trained_runs["encoder"], pe_overrides={"scaling": "cubic"})


def test_the_default_run_ends_with_a_sample(trained_runs):
    (decoder_sample,) = trained_runs["decoder_samples"]
    header = "sample after 5 steps:\nROMEO:\n"
    assert decoder_sample.startswith(header) and len(decoder_sample) > len(header) + 10
    (encoder_sample,) = trained_runs["encoder_samples"]
    assert "(blanks, true->filled: " in encoder_sample and encoder_sample.count("'->'") == 8  # 48 tokens, every 6th blank


def generate_cli(args: list[str], cwd, monkeypatch, capsys) -> subprocess.CompletedProcess:
    """``python generate.py <args>`` in this process: its console entry point ``cli()`` (Hydra's main included) with
    ``sys.argv`` set, in ``cwd``; the exit code, stdout and stderr as a subprocess would give them, less the ~7 s of
    imports a new interpreter pays. (A subprocess where the process is the point: test_cli_is_a_console_script.)"""
    from hydra.core.global_hydra import GlobalHydra

    from pe_geometry.cli.generate import cli

    GlobalHydra.instance().clear()  # (a composition by an earlier test leaves it initialised; the script starts without)
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", [str(ROOT / "generate.py"), *args])
    code = 0
    try:
        cli()
    except SystemExit as stop:
        code = stop.code
    finally:
        GlobalHydra.instance().clear()
    printed = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, printed.out, printed.err)


@pytest.mark.slow  # runs generate.py in a subprocess
def test_cli_is_a_console_script(trained_runs, tmp_path):
    """The script as a user runs it: samples on stdout and exit code 0; bad input is one ``error:`` line, exit code 2,
    no traceback. (What it prints and refuses: the in-process tests below, which call the same entry point.)"""
    ckpt = trained_runs["decoder"] / "checkpoints" / "last.ckpt"

    def cli(*args: str) -> subprocess.CompletedProcess:
        return forkserver.run([sys.executable, str(ROOT / "generate.py"), *args], cwd=tmp_path, capture_output=True, text=True, timeout=300)

    sampled = cli(f"ckpt_path={ckpt}", "prompt=HAMLET: To be", "max_new_tokens=10", "num_samples=2", "seed=3")
    assert sampled.returncode == 0, sampled.stderr[-2000:]
    assert sampled.stdout.count("--- sample") == 2 and "HAMLET: To be" in sampled.stdout
    refused = cli("ckpt_path=/nope/last.ckpt")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert [line for line in refused.stderr.splitlines() if line.strip()] == ["error: ckpt_path=/nope/last.ckpt: no checkpoint file there"]
    assert not list(tmp_path.iterdir())  # generation writes no output directory


def test_cli_samples_and_reports_bad_input_in_one_line(trained_runs, tmp_path, monkeypatch, capsys):
    ckpt = trained_runs["decoder"] / "checkpoints" / "last.ckpt"

    def cli(*args: str) -> subprocess.CompletedProcess:
        return generate_cli(list(args), tmp_path, monkeypatch, capsys)

    args = [f"ckpt_path={ckpt}", "prompt=HAMLET: To be", "max_new_tokens=10", "num_samples=2", "seed=3"]
    first = cli(*args)
    assert first.returncode == 0, first.stderr[-2000:]
    assert first.stdout.count("--- sample") == 2 and "HAMLET: To be" in first.stdout
    assert cli(*args).stdout == first.stdout
    assert not list(tmp_path.iterdir())  # generation writes no output directory

    for bad, message in [
        (["ckpt_path=/nope/last.ckpt"], "error: ckpt_path=/nope/last.ckpt: no checkpoint file there"),
        ([f"ckpt_path={ckpt}", "tempreature=0.5"], "error: tempreature is not an option of pe-generate; did you mean temperature?"),
        ([f"ckpt_path={ckpt}", "top_p=1.5"], "error: top_p=1.5 must be in (0, 1]"),
        ([f"ckpt_path={ckpt}", "max_new_tokens=600", "context=full"], "positions needed but the LearnedPE table has"),
        ([f"ckpt_path={ckpt}", "context=everything"], "error: context='everything'; valid: train (the training length"),
    ]:
        result = cli(*bad)
        assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]
        assert "Traceback" not in result.stderr and not result.stdout
        assert len([line for line in result.stderr.splitlines() if line.startswith("error:")]) == 1


def test_cli_reads_at_most_the_training_length_unless_context_full(trained_runs, tmp_path, monkeypatch, capsys):
    """The learned table (512 rows) of a model trained on 16 tokens: 600 new tokens work by default, each drawn
    from the last 16; context=full says what the model was trained on and reads everything it can place."""
    ckpt = trained_runs["decoder"] / "checkpoints" / "last.ckpt"

    def cli(*args: str) -> subprocess.CompletedProcess:
        return generate_cli([f"ckpt_path={ckpt}", "num_samples=1", "temperature=0", *args], tmp_path, monkeypatch, capsys)

    windowed = cli("max_new_tokens=600")
    assert windowed.returncode == 0, windowed.stderr[-2000:]
    assert "context=train: each token is drawn from the last 16 tokens (the training length)" in windowed.stderr
    full = cli("max_new_tokens=40", "context=full")
    assert full.returncode == 0, full.stderr[-2000:]
    assert "context=full: the model was trained on 16 tokens and reads all 40 here" in full.stderr
    short = cli("max_new_tokens=8")
    assert short.returncode == 0 and "context=" not in short.stderr  # nothing to say when the text fits the training length
    assert windowed.stdout[:60] == cli("max_new_tokens=600", "context=16").stdout[:60]  # train = its seq_len


def test_the_end_of_training_sample_reads_through_the_training_length(monkeypatch):
    """The callback hands generate the datamodule's seq_len (context=train) or None (context=full)."""
    from types import SimpleNamespace

    from pe_geometry.training import sample as sample_module

    seen = []
    monkeypatch.setattr(sample_module, "generate", lambda model, prompt, n, context=None, **kw: seen.append(context) or prompt)
    model = build(DecoderLM, "rope", SDPAttention)
    tokenizer = SimpleNamespace(encode=lambda text: SimpleNamespace(ids=[3, 4]), token_to_id=lambda token: 0, decode=str)
    trainer = SimpleNamespace(datamodule=SimpleNamespace(tokenizer=tokenizer, seq_len=16), global_step=5, loggers=[])
    task = SimpleNamespace(model=model, training=False, device=torch.device("cpu"))
    for context in ("train", "full"):
        sample_module.SampleTextCallback(context=context).on_train_end(trainer, task)
    assert seen == [16, None]
    with pytest.raises(ValueError, match=r"callbacks.sample.context=window must be one of \['train', 'full'\]"):
        sample_module.SampleTextCallback(context="window")
