"""Our decoders as transformers checkpoints (model/export/, ``pe-export``): exact or refused.

The reference is transformers' own model (GPT-2, GPT-NeoX) built from the exported config with our weights copied in:
its logits must equal ours (float32, <= 1e-5 relative) at the training length and past it where the family allows,
its greedy ``generate`` must pick our greedy tokens, and ours -> transformers -> ours must give the very tensors back.
Trained runs (3 steps, written by the real pipeline) cover each family end to end; every other setting (RoPE's
scalings and partial rotations, an untied head) is checked on models whose every weight is drawn at random (biases and
LayerNorm gains too, so a weight put in the wrong place shows).
"""

from __future__ import annotations

import subprocess
import sys
from functools import partial

import pytest
import torch

pytest.importorskip("transformers")

from pe_geometry.cli.export import main as export_main  # noqa: E402
from pe_geometry.model import DecoderLM, EncoderDecoder, EncoderMLM  # noqa: E402
from pe_geometry.model.attention import SDPAttention  # noqa: E402
from pe_geometry.model.embedding import TokenEmbedding  # noqa: E402
from pe_geometry.model.export import (  # noqa: E402
    SUPPORTED,
    ExportError,
    architecture_for,
    read_folder,
    transformers_model,
    write_folder,
)
from pe_geometry.model.export.tokenizer import fast_tokenizer  # noqa: E402
from pe_geometry.model.forgetting import ForgettingPE  # noqa: E402
from pe_geometry.model.positional import (  # noqa: E402
    ALiBiPE,
    CoPE,
    FirePE,
    KerplePE,
    LearnedPE,
    NoPE,
    RotaryPE,
    SinusoidalPE,
    T5BiasPE,
    XPosPE,
)
from pe_geometry.model.sampling import generate  # noqa: E402
from pe_geometry.training.run_loader import load_trained_run  # noqa: E402
from tests.conftest import ROOT, tiny_train_config  # noqa: E402

TOLERANCE = 1e-5  # max |ours - theirs| / max |ours|; float32 rounding gives ~3e-7
V, D, H, LAYERS, TRAINED_AT = 61, 32, 4, 2, 16


def relative_difference(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / ours.abs().max())


def random_weights(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter drawn at random (an init leaves biases at 0 and gains at 1, where a swapped map still passes)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def decoder(pe, **settings) -> DecoderLM:
    torch.manual_seed(0)
    return random_weights(DecoderLM(vocab_size=V, d_model=D, n_heads=H, n_layers=LAYERS, pe=pe, **settings))


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- every setting a family exports with, on random weights ---------------------------------------------------------
ROPE = partial(RotaryPE, training_length=TRAINED_AT)
EXACT = {
    "learned": partial(LearnedPE, max_len=96),
    "rope": ROPE,
    "rope_partial_neox": partial(ROPE, rotary_fraction=0.5),
    "rope_partial_p_rope": partial(ROPE, rotary_fraction=0.5, partial_rotary="p_rope", base=500.0),
    "rope_linear": partial(ROPE, scaling="linear", scaling_factor=4),
    "rope_ntk": partial(ROPE, scaling="ntk", scaling_factor=4),
    "rope_ntk_p_rope": partial(ROPE, scaling="ntk", scaling_factor=4, rotary_fraction=0.5, partial_rotary="p_rope"),
    "rope_llama3": partial(ROPE, scaling="llama3", scaling_factor=8, low_freq_factor=0.5, high_freq_factor=2.0),
    "rope_llama3_partial": partial(ROPE, scaling="llama3", scaling_factor=4, rotary_fraction=0.5),
    "rope_yarn_dims": partial(ROPE, scaling="yarn", scaling_factor=4, yarn_ramp="dims"),
    "none": NoPE,
}


@pytest.mark.parametrize("name", list(EXACT))
def test_transformers_computes_our_logits_past_the_training_length(name):
    model = decoder(EXACT[name])
    architecture = architecture_for(model, TRAINED_AT)
    assert architecture.model_type == ("gpt2" if name == "learned" else "gpt_neox")
    theirs = transformers_model(architecture)
    ids = torch.randint(V, (2, 96), generator=torch.Generator().manual_seed(1))  # 6x the training length
    with torch.no_grad():
        assert relative_difference(model(ids), theirs(ids).logits) <= TOLERANCE
        if name != "none":  # the encoding is really in play: the same weights without it compute something else
            unrotated = decoder(NoPE)
            unrotated.load_state_dict({k: v for k, v in model.state_dict().items() if "pe." not in k}, strict=False)
            assert relative_difference(unrotated(ids), theirs(ids).logits) > 1e-3


@pytest.mark.parametrize("name", ["learned", "rope_partial_p_rope", "rope_yarn_dims", "none"])
def test_an_untied_head_exports_as_its_own_matrix(name):
    model = decoder(EXACT[name], embedding=partial(TokenEmbedding, tie_weights=False))
    architecture = architecture_for(model, TRAINED_AT)
    theirs = transformers_model(architecture)
    assert not theirs.config.tie_word_embeddings
    assert not torch.equal(theirs.lm_head.weight, theirs.get_input_embeddings().weight)
    ids = torch.randint(V, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert relative_difference(model(ids), theirs(ids).logits) <= TOLERANCE
    assert same_state(architecture.from_transformers(theirs.state_dict()), model.state_dict())


@pytest.mark.parametrize("name", list(EXACT))
def test_ours_to_transformers_to_ours_gives_the_same_tensors(name):
    model = decoder(EXACT[name])
    architecture = architecture_for(model, TRAINED_AT)
    back = architecture.from_transformers(transformers_model(architecture).state_dict())
    assert same_state(back, model.state_dict())


@pytest.mark.parametrize("name", ["learned", "rope_partial_p_rope", "rope_llama3", "none"])
def test_greedy_generation_agrees_token_for_token(name):
    """transformers' ``generate`` (its own KV cache) against ours: the same tokens, and at every step the logits our
    full pass gives that position (random weights repeat a token under greedy decoding; the logits still differ)."""
    model = decoder(EXACT[name])
    theirs = transformers_model(architecture_for(model, TRAINED_AT))
    prompt = torch.randint(V, (2, 5), generator=torch.Generator().manual_seed(3))
    ours = generate(model, prompt, 80, temperature=0, context=None)
    with torch.no_grad():
        out = theirs.generate(prompt, max_new_tokens=80, do_sample=False, eos_token_id=None, min_new_tokens=80,
                              output_logits=True, return_dict_in_generate=True)
        full = model(ours[:, :-1])[:, 4:]  # the logits each new token was drawn from
    assert out.sequences.tolist() == ours.tolist()
    assert relative_difference(full, torch.stack(out.logits, dim=1)) <= TOLERANCE


def test_rope_pairs_are_reordered_per_head_not_across_heads():
    """GPT-NeoX rotates dims (i, i + R/2) where ours rotates (2i, 2i + 1): the query rows of each head are reordered;
    the value rows, which no rotation reads, keep their order."""
    model = decoder(partial(ROPE, rotary_fraction=0.5))  # R = 4 of d_head 8: rows 0 2 1 3 4 5 6 7 of each head
    qkv = architecture_for(model).to_transformers()["gpt_neox.layers.0.attention.query_key_value.weight"]
    q = model.blocks[0].attn.q.weight
    v = model.blocks[0].attn.kv.weight[D:]
    per_head = qkv.view(H, 3, D // H, D)
    assert torch.equal(per_head[1, 0], q[8:16][[0, 2, 1, 3, 4, 5, 6, 7]])
    assert torch.equal(per_head[1, 2], v[8:16])


# -- refusals: one line, naming what differs and what is exportable -------------------------------------------------
REFUSED = {
    "pe=alibi": lambda: decoder(ALiBiPE),
    "pe=sinusoidal": lambda: decoder(SinusoidalPE),
    "pe=xpos": lambda: decoder(XPosPE),
    "pe=t5_bias": lambda: decoder(T5BiasPE),
    "pe=fire": lambda: decoder(FirePE),
    "pe=kerple": lambda: decoder(KerplePE),
    "pe=cope": lambda: decoder(CoPE),
    "pe=forgetting": lambda: decoder(ForgettingPE),
    "pe.shuffle=true": lambda: decoder(partial(LearnedPE, shuffle=True)),
    "pe.scaling=dynamic_ntk": lambda: decoder(partial(ROPE, scaling="dynamic_ntk", scaling_factor=2)),
    "pe.yarn_ramp=turns": lambda: decoder(partial(ROPE, scaling="yarn", scaling_factor=2)),
    "model.norm=post": lambda: decoder(ROPE, norm="post"),
    "model.layer_pattern": lambda: decoder(ROPE, layer_pattern=[{"pe": "none"}, {}]),
    "embedding.scaled=true": lambda: decoder(ROPE, embedding=partial(TokenEmbedding, scaled=True)),
    "attention.n_kv_heads=2": lambda: decoder(ROPE, attention=partial(SDPAttention, n_kv_heads=2)),
    "attention.qk_norm=True": lambda: decoder(ROPE, attention=partial(SDPAttention, qk_norm=True)),
    "attention.window=4": lambda: decoder(ROPE, attention=partial(SDPAttention, window=4)),
    "attention.logn_scaling=True": lambda: decoder(ROPE, attention=partial(SDPAttention, logn_scaling=True,
                                                                           training_length=TRAINED_AT)),
    "model=encoder: BERT": lambda: EncoderMLM(vocab_size=V, mask_token_id=1, d_model=D, n_heads=H, pe=LearnedPE),
    "model=encoder_decoder": lambda: EncoderDecoder(vocab_size=V, d_model=D, n_heads=H, pe=ROPE),
}


@pytest.mark.parametrize("named", list(REFUSED))
def test_what_has_no_exact_architecture_is_refused_in_one_line(named, tmp_path):
    model = REFUSED[named]()
    with pytest.raises(ExportError) as refusal:
        architecture_for(model, TRAINED_AT)
    line = str(refusal.value)
    assert "\n" not in line and named in line and line.endswith(SUPPORTED)
    with pytest.raises(ExportError):  # and nothing is written
        write_folder(model, None, tmp_path / "out", TRAINED_AT)
    assert not (tmp_path / "out").exists()


def test_alibi_refusal_names_each_candidate_and_its_difference():
    line = str(pytest.raises(ExportError, architecture_for, decoder(ALiBiPE)).value)
    assert all(word in line for word in ("BLOOM", "tanh GELU", "MPT", "no biases", "Falcon", "sqrt(d_head)"))


# -- trained runs, end to end ---------------------------------------------------------------------------------------
FAMILIES = {"learned": ["pe=learned", "pe.max_len=32"], "rope": ["pe=rope", "pe.rotary_fraction=0.5"], "none": ["pe=none"]}


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_corpus, cache_dir) -> dict[str, tuple]:
    """family -> (its trained run loaded back, the folder pe-export wrote from it, what pe-export returned)."""
    from pe_geometry.training.pipeline import train

    out = {}
    for family, overrides in FAMILIES.items():
        root = tmp_path_factory.mktemp(family)
        train(tiny_train_config(root, tiny_corpus, cache_dir, [*overrides, "callbacks=no_geometry"]))
        result = export_main([str(root / "run"), "--out", str(root / "hf")])
        out[family] = (load_trained_run(root / "run"), root / "hf", result)
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_trained_run_exports_exactly(family, exported):
    from transformers import AutoModelForCausalLM

    run, folder, result = exported[family]
    assert result["model_type"] == ("gpt2" if family == "learned" else "gpt_neox")
    assert {p.name for p in folder.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    theirs = AutoModelForCausalLM.from_pretrained(folder).eval()
    seq_len = int(run.config.data.seq_len)
    stream = torch.as_tensor(run.datamodule.streams["validation"].astype("int64"))
    lengths = [seq_len, 2 * seq_len] if family == "learned" else [seq_len, 4 * seq_len]  # the table holds 2x
    assert set(result["max_relative_difference"]) == {seq_len, 2 * seq_len}  # what pe-export checked itself
    for n in lengths:
        ids = stream[:n][None]
        with torch.no_grad():
            assert relative_difference(run.model(ids), theirs(ids).logits) <= TOLERANCE
    if family == "learned":  # both stop at the table's end
        with pytest.raises(ValueError, match="pe.max_len=32"):
            run.model(stream[:33][None])
        assert theirs.config.n_positions == 32
    assert same_state(architecture_for(run.model).from_transformers(theirs.state_dict()), run.model.state_dict())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_transformers_greedy_generation_is_ours(family, exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, folder, _ = exported[family]
    theirs = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer("To be, or not to be", return_tensors="pt").input_ids
    # to the end of a learned table (32 positions); the others past 4x the training length (16)
    new = 32 - prompt.shape[1] if family == "learned" else 60
    ours = generate(run.model, prompt, new, temperature=0, context=None)
    with torch.no_grad():
        out = theirs.generate(prompt, max_new_tokens=new, do_sample=False, eos_token_id=None, min_new_tokens=new)
    assert out.tolist() == ours.tolist()


def test_the_exported_tokenizer_reads_text_as_the_run_and_pe_generate_do(exported, tiny_corpus):
    from transformers import AutoTokenizer

    from pe_geometry.data.tokenizer import train_tokenizer
    from pe_geometry.model.sampling import prompt_ids

    run, folder, _ = exported["rope"]
    text = tiny_corpus["validation"].read_text()[:400]
    ids = AutoTokenizer.from_pretrained(folder)(text).input_ids
    assert ids == prompt_ids(run.model, run.tokenizer.encode(text).ids, run.tokenizer.token_to_id("<eos>"))
    assert AutoTokenizer.from_pretrained(folder).decode(ids, skip_special_tokens=True) == text
    char = train_tokenizer([text], "char", 40)  # the other kind of vocabulary
    assert fast_tokenizer(char).decode(fast_tokenizer(char)("to be").input_ids, skip_special_tokens=True) == "to be"


def test_read_folder_gives_back_the_exported_weights(exported):
    from pe_geometry.training.run_loader import build_model

    run, folder, _ = exported["rope"]
    fresh = build_model(run.config, run.datamodule)
    assert not same_state(fresh.state_dict(), run.model.state_dict())
    read_folder(fresh, folder, run.tokenizer, int(run.config.data.seq_len))
    assert same_state(fresh.state_dict(), run.model.state_dict())


# -- pe-export's bad input: one error line, exit code 2, nothing written ----------------------------------------------
def run_cli(argv: list[str], monkeypatch, capsys) -> tuple[int, list[str]]:
    from pe_geometry.cli.export import cli

    monkeypatch.setattr(sys, "argv", ["pe-export", *argv])
    with pytest.raises(SystemExit) as stop:
        cli()
    return stop.value.code, capsys.readouterr().err.strip().splitlines()


def test_pe_export_refuses_in_one_line(exported, tmp_path, monkeypatch, capsys, tiny_corpus, cache_dir):
    run, folder, _ = exported["rope"]
    code, err = run_cli([str(run.checkpoint_path), "--out", str(folder)], monkeypatch, capsys)  # taken
    assert code == 2 and len(err) == 1 and err[0].startswith("error: --out ") and "not an empty folder" in err[0]
    code, err = run_cli([str(tmp_path / "nothing"), "--out", str(tmp_path / "o")], monkeypatch, capsys)
    assert code == 2 and err == [f"error: {tmp_path / 'nothing'}: no such run folder or checkpoint file"]
    assert not (tmp_path / "o").exists()
    from pe_geometry.training.pipeline import train

    train(tiny_train_config(tmp_path, tiny_corpus, cache_dir, ["pe=alibi", "trainer.max_steps=1", "callbacks=no_geometry"]))
    code, err = run_cli([str(tmp_path / "run"), "--out", str(tmp_path / "o")], monkeypatch, capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: pe=alibi: ") and not (tmp_path / "o").exists()


@pytest.mark.slow
def test_a_quick_run_exported_and_read_by_a_fresh_python(tmp_path, tiny_corpus):
    """As a user: pe-train, pe-export, then a Python without pe_geometry loads the folder and generates what
    pe-generate does (greedy, reading the whole text)."""
    run, out = tmp_path / "run", tmp_path / "hf"
    train = [sys.executable, str(ROOT / "train.py"), "experiment=quick", "trainer.max_steps=5", "model.d_model=32",
             "model.n_layers=2", "pe=rope", "data=text_files", f"data.corpus.train_files=[{tiny_corpus['train']}]",
             f"data.corpus.val_files=[{tiny_corpus['validation']}]", "data.vocab_size=300", "data.seq_len=32",
             "data.batch_size=4", f"paths.cache_dir={tmp_path / 'cache'}", "logger=csv", "callbacks=no_geometry",
             f"paths.output_dir={run}"]
    subprocess.run(train, check=True, capture_output=True, timeout=300)
    exported = subprocess.run([sys.executable, "-m", "pe_geometry.cli.export", str(run), "--out", str(out)],
                              capture_output=True, text=True, timeout=300)
    assert exported.returncode == 0, exported.stderr
    assert "gpt_neox" in exported.stdout and "logits equal ours" in exported.stdout
    fresh = ("import sys; sys.modules['pe_geometry'] = None\n"  # transformers alone reads the folder
             "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
             f"m = AutoModelForCausalLM.from_pretrained({str(out)!r}); t = AutoTokenizer.from_pretrained({str(out)!r})\n"
             "ids = t('To be, or not', return_tensors='pt').input_ids\n"
             "print(t.decode(m.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None, min_new_tokens=20)[0],"
             " skip_special_tokens=True))")
    theirs = subprocess.run([sys.executable, "-c", fresh], capture_output=True, text=True, timeout=300)
    assert theirs.returncode == 0, theirs.stderr
    ours = subprocess.run([sys.executable, "-m", "pe_geometry.cli.generate", f"ckpt_path={run}", "prompt='To be, or not'",
                           "temperature=0", "max_new_tokens=20", "context=full", "num_samples=1"],
                          capture_output=True, text=True, timeout=300)
    assert ours.returncode == 0, ours.stderr
    assert theirs.stdout.strip() and theirs.stdout.strip() in ours.stdout


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_every_exported_file_keeps_the_umask_s_mode(umask, tmp_path):
    """safetensors writes its file 0600 whatever the umask: a teammate could not read shared weights."""
    import os

    from pe_geometry.data.tokenizer import train_tokenizer

    tokenizer = train_tokenizer(["to be or not to be that is the question"] * 20, "char", V)
    before = os.umask(umask)
    try:
        write_folder(decoder(ROPE), tokenizer, tmp_path / "out", training_length=TRAINED_AT)
    finally:
        os.umask(before)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "out").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o666 & ~umask}, modes
