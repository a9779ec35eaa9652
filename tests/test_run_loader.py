"""Loading a trained run back (training/run_loader.py), the prompt both samplers give a model, the optimiser
built from its config, and the generation benchmark's options.

Checkpoints here are written by hand, as a LanguageModelTask checkpoint holds them (``model.``-prefixed
weights, the run's config, its step): loading needs no training, so these tests stay fast.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import OmegaConf

from pe_geometry.model import EncoderMLM
from pe_geometry.model.sampling import prompt_ids
from pe_geometry.training.optimizer import warmup_cosine
from pe_geometry.training.run_loader import RunLoadError, build_datamodule, build_model, load_trained_run
from pe_geometry.training.sample import SampleTextCallback
from tests.conftest import CONFIG_DIR, MODEL_TYPES, compose_train_config, tiny_train_config


def write_checkpoint(run_dir: Path, cfg, model: torch.nn.Module, step: int = 7) -> Path:
    """A checkpoint as training writes it: the task's weights under ``model.``, the step, the resolved config."""
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    state = {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}, "global_step": step,
             "run_config": OmegaConf.to_container(cfg, resolve=True), "group_choices": {"pe": "rope"}}
    torch.save(state, ckpt)
    return ckpt


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory, tiny_corpus, cache_dir) -> dict[str, tuple[Path, dict]]:
    """model type -> (run folder with a hand-written checkpoint of random weights, those weights)."""
    runs = {}
    for model_type in MODEL_TYPES:
        root = tmp_path_factory.mktemp(model_type)
        cfg = tiny_train_config(root, tiny_corpus, cache_dir, [f"model={model_type}", "pe=rope"])
        torch.manual_seed(1)
        model = build_model(cfg, build_datamodule(cfg))
        write_checkpoint(root / "run", cfg, model)
        runs[model_type] = (root / "run", {k: v.clone() for k, v in model.state_dict().items()})
    return runs


# -- the loader ------------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_a_run_folder_and_its_checkpoint_load_the_saved_weights(model_type, saved_runs):
    run_dir, weights = saved_runs[model_type]
    for path in (run_dir, run_dir / "checkpoints" / "last.ckpt"):
        run = load_trained_run(path)
        assert run.checkpoint_path == run_dir / "checkpoints" / "last.ckpt" and run.step == 7 and run.choices == {"pe": "rope"}
        assert not run.model.training
        assert run.model.state_dict().keys() == weights.keys()
        assert all(torch.equal(run.model.state_dict()[k], v) for k, v in weights.items())
        assert run.model.vocab_size == run.tokenizer.get_vocab_size() == run.datamodule.vocab_size


def test_runs_on_the_same_data_share_one_datamodule(saved_runs):
    shared: dict = {}
    decoder = load_trained_run(saved_runs["decoder"][0], datamodules=shared)
    encoder = load_trained_run(saved_runs["encoder"][0], datamodules=shared)
    assert decoder.datamodule is encoder.datamodule and len(shared) == 1


def test_every_problem_is_one_line_naming_the_file(tmp_path, saved_runs):
    with pytest.raises(RunLoadError, match=r"^ckpt_path=\S+nope.ckpt: no checkpoint file there$"):
        load_trained_run(tmp_path / "nope.ckpt")
    (tmp_path / "empty_run").mkdir()
    with pytest.raises(RunLoadError, match=r"empty_run: no checkpoint \S+empty_run/checkpoints/last.ckpt$"):
        load_trained_run(tmp_path / "empty_run")
    (tmp_path / "bad.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(RunLoadError, match=r"^ckpt_path=\S+bad.ckpt is not a readable Lightning checkpoint \(\w+: "):
        load_trained_run(tmp_path / "bad.ckpt")
    bare = tmp_path / "bare" / "checkpoints" / "last.ckpt"  # weights, but no run_config: not a checkpoint of pe-train
    bare.parent.mkdir(parents=True)
    torch.save({"state_dict": {}, "global_step": 1}, bare)
    (bare.parent.parent / "config.yaml").write_text("seed: 0\n")  # a config beside it is not read: the checkpoint's own only
    with pytest.raises(RunLoadError, match=r"^ckpt_path=\S+bare/checkpoints/last.ckpt: the checkpoint has no run_config \("):
        load_trained_run(bare)

    run_dir, weights = saved_runs["decoder"]
    other = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    other["state_dict"]["model.head.weight"] = torch.zeros(999, weights["head.weight"].shape[1])  # another tokenizer's vocabulary
    torch.save(other, tmp_path / "other_vocab.ckpt")
    with pytest.raises(RunLoadError, match=r"other_vocab.ckpt: the rebuilt tokenizer has 300 tokens, the run had 999$"):
        load_trained_run(tmp_path / "other_vocab.ckpt")


def test_a_resume_checkpoint_reads_through_the_loader_and_keeps_its_messages(tmp_path, saved_runs):
    """train.py's resume finds and reads the file as the loader does (``training.resume``), and also insists on optimiser
    states."""
    from pe_geometry.training.resume import read_checkpoint
    from pe_geometry.training.validate import ConfigError

    ckpt = saved_runs["decoder"][0] / "checkpoints" / "last.ckpt"  # weights only: fine to sample from, not to resume
    with pytest.raises(ConfigError, match=r"is not a readable Lightning checkpoint \(KeyError: 'optimizer_states'\)"):
        read_checkpoint(str(ckpt), tmp_path)
    with pytest.raises(ConfigError, match=r"^ckpt_path=last: no checkpoint file at \S+/checkpoints/last.ckpt$"):
        read_checkpoint("last", tmp_path)


def test_ckpt_path_auto_resumes_a_run_folder_that_has_one_and_starts_one_that_has_none(tmp_path):
    """``auto`` is how a stopped sweep continues: each job's folder either holds its last.ckpt or nothing yet. A new
    run (ckpt_path null) into a folder holding a run is refused instead of overwriting its checkpoints."""
    from pe_geometry.training.resume import read_checkpoint
    from pe_geometry.training.validate import ConfigError

    assert read_checkpoint("auto", tmp_path) == (None, tmp_path, None, None)  # nothing there: a new run
    (tmp_path / "checkpoints").mkdir()
    state = {"global_step": 7, "state_dict": {}, "optimizer_states": [{}]}
    torch.save(state, tmp_path / "checkpoints" / "last.ckpt")
    path, run_dir, step, read = read_checkpoint("auto", tmp_path)
    assert (path, run_dir, step, read["global_step"]) == (tmp_path / "checkpoints" / "last.ckpt", tmp_path, 7, 7)
    with pytest.raises(ConfigError, match=r"already holds a run \(checkpoints/last.ckpt\).*ckpt_path=last.*ckpt_path=auto"):
        read_checkpoint(None, tmp_path)


def test_a_new_single_run_into_a_run_folder_is_refused_before_hydra_writes_there(tmp_path):
    """``hydra.run.dir=<run>`` without ckpt_path: Hydra would overwrite the run's .hydra/ before any check, so the
    command line is checked first; a resume, a sweep or an empty folder pass."""
    from pe_geometry.training.run_folder import overwrites_a_run

    assert overwrites_a_run([f"hydra.run.dir={tmp_path}"]) is None
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_bytes(b"x")
    message = overwrites_a_run(["pe=rope", f"hydra.run.dir={tmp_path}"])
    assert message is not None and message.startswith(f"hydra.run.dir={tmp_path} already holds a run") and "ckpt_path=last" in message
    assert overwrites_a_run([f"hydra.run.dir={tmp_path}", "ckpt_path=last"]) is None
    assert overwrites_a_run([f"hydra.run.dir={tmp_path}", "ckpt_path=auto"]) is None
    assert overwrites_a_run(["-m", f"hydra.run.dir={tmp_path}"]) is None


# -- one prompt for generate.py and the end-of-training sample ---------------------------------------
def generate_options(ckpt: Path, prompt: str, max_new_tokens: int):
    cfg = OmegaConf.load(CONFIG_DIR / "generate.yaml")
    del cfg["defaults"], cfg["hydra"]
    cfg.merge_with({"ckpt_path": str(ckpt), "prompt": prompt, "num_samples": 1, "max_new_tokens": max_new_tokens,
                    "temperature": 0, "top_k": None, "top_p": None, "device": "cpu"})
    return cfg


def end_of_training_sample(run, prompt: str, max_new_tokens: int) -> str:
    """What SampleTextCallback logs for this model at the end of a run."""
    callback = SampleTextCallback(prompt=prompt, max_new_tokens=max_new_tokens, temperature=0, top_k=None, top_p=None)
    trainer = SimpleNamespace(datamodule=run.datamodule, global_step=5, loggers=[])
    callback.on_train_end(trainer, SimpleNamespace(model=run.model, training=False, device=torch.device("cpu")))
    return callback.text


@pytest.mark.parametrize("model_type", ["decoder", "encoder_decoder"])
def test_a_one_token_prompt_gives_both_samplers_the_same_tokens_and_text(model_type, saved_runs, monkeypatch):
    """generate.py fed the encoder-decoder a one-token prompt it refused (it needs a source and a first decoder
    token), and fed a decoder no <eos> where the end-of-training sample did: the same prompt, other text."""
    import pe_geometry.model.sampling as sampling
    import pe_geometry.training.sample as sample
    from pe_geometry.cli.generate import run as generate_cli

    run_dir, _ = saved_runs[model_type]
    run = load_trained_run(run_dir)
    assert len(run.tokenizer.encode("R").ids) == 1
    prompts = []

    def recording(real):
        def generate(model, prompt, *args, **kwargs):
            prompts.append(prompt[0].tolist())
            return real(model, prompt, *args, **kwargs)
        return generate

    monkeypatch.setattr(sampling, "generate", recording(sampling.generate))  # generate.py imports it when it runs
    monkeypatch.setattr(sample, "generate", recording(sample.generate))
    (from_cli,) = generate_cli(generate_options(run_dir / "checkpoints" / "last.ckpt", "R", 6))
    from_callback = end_of_training_sample(run, "R", 6)
    eos = run.tokenizer.token_to_id("<eos>")
    assert prompts == [[eos, *run.tokenizer.encode("R").ids]] * 2
    assert from_cli == from_callback and from_cli.startswith("R") and len(from_cli) > 1


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_what_each_model_reads_for_a_prompt(model_type, saved_runs):
    run = load_trained_run(saved_runs[model_type][0])
    eos, mask = run.tokenizer.token_to_id("<eos>"), run.tokenizer.token_to_id("<mask>")
    if isinstance(run.model, EncoderMLM):  # fills the blanks of the text as it is
        assert prompt_ids(run.model, [mask], eos) == [mask]
    else:  # a new document, as after every <eos> in training; the empty prompt too
        assert prompt_ids(run.model, [7], eos) == [eos, 7] and prompt_ids(run.model, [], eos) == [eos]


def test_generate_fills_a_one_token_blank_with_an_encoder(saved_runs):
    from pe_geometry.cli.generate import run as generate_cli

    (text,) = generate_cli(generate_options(saved_runs["encoder"][0] / "checkpoints" / "last.ckpt", "<mask>", 0))
    assert text and "<mask>" not in text


# -- the optimiser, built from configs/optimizer -----------------------------------------------------
def test_the_optimizer_config_builds_adamw_with_its_settings_and_schedule(tmp_path):
    cfg = compose_train_config(["optimizer.lr=0.002", "optimizer.betas=[0.8,0.9]", "optimizer.warmup_steps=4",
                                "optimizer.min_lr_ratio=0.25"], tmp_path)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    built = instantiate(cfg.optimizer)(model, max_steps=20)
    optimizer, schedule = built["optimizer"], built["lr_scheduler"]["scheduler"]
    assert isinstance(optimizer, torch.optim.AdamW) and built["lr_scheduler"]["interval"] == "step"
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]  # the matrix decays; bias and norm do not
    assert [len(g["params"]) for g in optimizer.param_groups] == [1, 3] and optimizer.defaults["betas"] == (0.8, 0.9)
    lrs = []
    for _ in range(21):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert lrs == pytest.approx([0.002 * warmup_cosine(step, 4, 20, 0.25) for step in range(21)])
    assert lrs[0] == pytest.approx(0.0005) and lrs[3] == pytest.approx(0.002) and lrs[20] == pytest.approx(0.0005)
    assert warmup_cosine(12, 4, 20, 0.25) == pytest.approx(0.25 + 0.75 * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_a_misspelt_optimizer_key_names_the_valid_ones(tmp_path):
    from pe_geometry.training.validate import ConfigError, check_config

    valid = (r"\['betas', 'decay_start', 'fused', 'lr', 'lr_base_width', 'min_lr_ratio', 'no_decay_embeddings', "
             r"'warmup_steps', 'weight_decay'\]$")
    with pytest.raises(ConfigError, match=r"^optimizer.momentum is not a setting of optimizer=adamw; valid: " + valid):
        check_config(compose_train_config(["+optimizer.momentum=0.9"], tmp_path))


# -- the model's config ----------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_the_model_yaml_keys_become_its_model_config(model_type, tmp_path):
    cfg = compose_train_config([f"model={model_type}", "model.d_model=48", "model.n_heads=3", "model.d_ff=100",
                                "model.norm=post"], tmp_path)
    model = build_model(cfg, SimpleNamespace(vocab_size=40, mask_token_id=1))
    config = model.config
    assert (config.vocab_size, config.d_model, config.n_heads, config.n_layers, config.mlp_width, config.norm) == (
        40, 48, 3, cfg.model.n_layers, 100, "post")
    assert isinstance(model, get_class(cfg.model._target_)) and model.blocks[0].mlp.up.out_features == 100
    with pytest.raises(InstantiationException, match="unexpected keyword argument 'd_modle'"):  # not a ModelConfig field
        build_model(compose_train_config([f"model={model_type}", "+model.d_modle=4"], tmp_path),
                    SimpleNamespace(vocab_size=40, mask_token_id=1))


# -- the generation benchmark ----------------------------------------------------------------------
def test_the_generation_benchmark_takes_every_attention_option(capsys):
    """It offered sdpa and a retired alias, and refused attention=explicit."""
    from experiments import benchmark_generate as bench

    options = sorted(p.stem for p in (CONFIG_DIR / "attention").glob("*.yaml"))
    assert "explicit" in options and bench.ATTENTION_OPTIONS == options
    for attention in options:
        kernel = get_class(OmegaConf.load(CONFIG_DIR / "attention" / f"{attention}.yaml")._target_)
        assert type(bench.build_decoder("rope", attention).blocks[0].attn) is kernel
    bench.main(["--attention", "explicit", "--pe", "none", "--new-tokens", "3"])
    out = capsys.readouterr().out
    assert "attention=explicit" in out and "\nnone " in out and "tokens differ" not in out
