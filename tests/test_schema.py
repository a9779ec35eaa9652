# ruff: noqa: E501  (the table keeps each case and its message on one line)
"""The config schema: every key typed and ranged in one place, unknown keys refused, one line per problem.

BAD_VALUES holds every value an outside audit named (it found 13 tracebacks and 11 silent runs in 56 tries) and more; each
row is the command-line overrides and the start of the one line the run must print (``error: <line>``, exit 2).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from pe_geometry.training import validate
from pe_geometry.training.pipeline import train
from pe_geometry.training.validate import ConfigError, check_config
from tests.conftest import ROOT, compose_train_config

BAD_VALUES = [
    (['model.d_model=0'], 'model.d_model=0 must be a positive integer'),
    (['model.d_model=abc'], 'model.d_model=abc must be a positive integer'),
    (['model.n_heads=0'], 'model.n_heads=0 must be a positive integer'),
    (['model.n_layers=0'], 'model.n_layers=0 must be a positive integer'),
    (['model.n_layers=1.5'], 'model.n_layers=1.5 must be a positive integer'),
    (['model.d_ff=-1'], 'model.d_ff=-1 must be a positive integer, or null for 4 * d_model'),
    (['model.d_ff=abc'], 'model.d_ff=abc must be a positive integer, or null for 4 * d_model'),
    (['model.dropout=2'], 'model.dropout=2 must be a probability in [0, 1)'),
    (['model.dropout=-0.1'], 'model.dropout=-0.1 must be a probability in [0, 1)'),
    (['model.norm=side'], "model.norm=side must be one of ['pre', 'post']"),
    (['+model.d_modle=64'], 'model.d_modle is not a setting of model=decoder; valid: '),
    (['model.d_model=100', 'model.n_heads=3'], 'model.d_model=100 is not divisible by model.n_heads=3; valid n_heads: [1, 2, 4, 5, 10, 20, 25, 50]'),
    (['model=encoder', 'model.mask_prob=0'], 'model.mask_prob=0 must be a fraction in (0, 1)'),
    (['model=encoder', 'model.mask_prob=1.5'], 'model.mask_prob=1.5 must be a fraction in (0, 1)'),
    (['model=encoder_decoder', 'model.src_fraction=1'], 'model.src_fraction=1 must be a fraction in (0, 1)'),
    (['pe=learned', 'pe.max_len=1e9'], 'pe.max_len=1000000000.0 must be an integer in [1, 1048576] (rows of the learned table)'),
    (['pe=learned', 'pe.max_len=0'], 'pe.max_len=0 must be an integer in [1, 1048576] (rows of the learned table)'),
    (['pe=learned', 'data.seq_len=600'], 'pe=learned: data.seq_len=600 is longer than the learned position table (pe.max_len=512); raise pe.max_len or shorten data.seq_len'),
    (['pe=learned', 'pe.init=orthogonal'], "pe.init=orthogonal must be one of ['normal', 'mixed']"),
    (['pe=learned', 'pe.init_k=0'], 'pe.init_k=0 must be a positive integer'),
    (['pe.scale=double'], "pe.scale=double must be one of ['none', 'word_norm']"),
    (['pe.center=maybe'], 'pe.center=maybe must be true or false'),
    (['pe=rope', 'pe.base=0.5'], 'pe.base=0.5 must be a number > 1'),
    (['pe=rope', 'model.d_model=12', 'model.n_heads=4'], 'pe=rope: RoPE needs an even head dimension, got model.d_model/model.n_heads = 12/4 = 3'),
    (['pe=rope', '+pe.init=mixed'], 'pe.init is not a setting of pe=rope; valid: '),
    (['pe=rope', 'control=mixed_init'], 'pe.init is not a setting of pe=rope; valid: '),
    (['pe=alibi', '+pe.max_len=5'], 'pe.max_len is not a setting of pe=alibi; valid: '),
    (['pe._target_=pe_geometry.model.NoSuchPE'], "pe._target_=pe_geometry.model.NoSuchPE cannot be imported (AttributeError: module 'pe_geometry.model' has no attribute 'NoSuchPE')"),
    (['embedding.scaled=maybe'], 'embedding.scaled=maybe must be true or false'),
    (['embedding.tie_weights=2'], 'embedding.tie_weights=2 must be true or false'),
    (['+embedding.dim=3'], 'embedding.dim is not a setting of embedding=plain; valid: '),
    (['+attention.dropout=0.1'], 'attention.dropout is not a setting of attention=sdpa; valid: '),
    (['+attention.windw=4'], "attention.windw is not a setting of attention=sdpa; valid: ['logn_scaling', 'n_kv_heads', 'qk_norm', 'qk_norm_scale', 'training_length', 'window']"),
    (['data.seq_len=1'], 'data.seq_len=1 must be an integer >= 2'),
    (['data.seq_len=abc'], 'data.seq_len=abc must be an integer >= 2'),
    (['data.batch_size=0'], 'data.batch_size=0 must be a positive integer'),
    (['data.vocab_size=100'], "data.vocab_size=100 is too small for the bpe tokenizer: it needs at least 259 (256 byte symbols + 3 special tokens ['<unk>', '<mask>', '<eos>'])"),
    (['data.tokenizer=wordpiece'], "data.tokenizer=wordpiece must be one of ['bpe', 'char']"),
    (['data.tokenizer=char', 'data.vocab_size=2'], "data.vocab_size=2 is too small for the char tokenizer: it needs at least 4 (1 character + 3 special tokens ['<unk>', '<mask>', '<eos>'])"),
    (['data.num_workers=-1'], 'data.num_workers=-1 must be an integer >= 0 (DataLoader worker processes)'),
    (['data.num_proc=0'], 'data.num_proc=0 must be a positive integer'),
    (['data.tokenizer_sample_chars=0'], 'data.tokenizer_sample_chars=0 must be a positive number of characters'),
    (['+data.foo=1'], 'data.foo is not a setting of data=shakespeare; valid: '),
    (['data=text_files', 'data.corpus.train_files=[]'], 'data.corpus.train_files=[] must be a non-empty list of text files: data.corpus.train_files=[a.txt,b.txt]'),
    (['data=text_files', 'data.corpus.train_files=[x.txt]', 'data.corpus.val_fraction=1.5'], 'data.corpus.val_fraction=1.5 must be a fraction in (0, 1) (of the training documents)'),
    (['data=text_files', 'data.corpus.train_files=[x.txt]', 'data.corpus.encoding_errors=ignore'], "data.corpus.encoding_errors=ignore must be one of ['strict', 'replace']"),
    (['data.corpus.validation_plays=[]'], 'data.corpus.validation_plays=[] must be a non-empty list of play names'),
    (['data.corpus.max_train_plays=0'], 'data.corpus.max_train_plays=0 must be a positive integer, or null for every play'),
    (['data=hf', 'data.path=parquet', 'data.val_size=0'], 'data.val_size=0 must be a fraction in (0, 1) or a number of documents >= 1'),
    (['data=hf', 'data.path=parquet', 'data.streaming=maybe'], 'data.streaming=maybe must be true or false'),
    (['optimizer.lr=0'], 'optimizer.lr=0 must be a number > 0'),
    (['optimizer.lr=nan'], 'optimizer.lr=nan must be a number > 0'),
    (['optimizer.lr=-1'], 'optimizer.lr=-1 must be a number > 0'),
    (['optimizer.lr=abc'], 'optimizer.lr=abc must be a number > 0'),
    (['optimizer.weight_decay=-0.1'], 'optimizer.weight_decay=-0.1 must be a number >= 0'),
    (['optimizer.betas=[1.5,0.9]'], 'optimizer.betas=[1.5,0.9] must be a pair of numbers in [0, 1), e.g. [0.9,0.95]'),
    (['optimizer.betas=abc'], 'optimizer.betas=abc must be a pair of numbers in [0, 1), e.g. [0.9,0.95]'),
    (['optimizer.betas=[0.9]'], 'optimizer.betas=[0.9] must be a pair of numbers in [0, 1), e.g. [0.9,0.95]'),
    (['optimizer.warmup_steps=-5'], 'optimizer.warmup_steps=-5 must be an integer >= 0'),
    (['optimizer.min_lr_ratio=5'], 'optimizer.min_lr_ratio=5 must be a fraction in [0, 1] (of optimizer.lr)'),
    (['optimizer.no_decay_embeddings=maybe'], 'optimizer.no_decay_embeddings=maybe must be true or false'),
    (['+optimizer.momentum=0.9'], 'optimizer.momentum is not a setting of optimizer=adamw; valid: '),
    (['trainer.precision=fp7'], "trainer.precision=fp7 must be one of ['64', '64-true', '32', '32-true', '16', '16-mixed', '16-true', 'bf16', 'bf16-mixed', 'bf16-true', 'transformer-engine', 'transformer-engine-float16']"),
    (['trainer.accelerator=quantum'], "trainer.accelerator=quantum must be one of ['cpu', 'gpu', 'cuda', 'mps', 'tpu', 'auto']"),
    (['trainer.devices=0'], "trainer.devices=0 must be a positive number of devices, -1 (all), 'auto', or a list of device indices"),
    (['trainer.devices=[]'], "trainer.devices=[] must be a positive number of devices, -1 (all), 'auto', or a list of device indices"),
    (['trainer.max_steps=0'], 'trainer.max_steps=0 must be a positive number of steps'),
    (['trainer.max_steps=null'], 'trainer.max_steps=null must be a positive number of steps'),
    (['trainer.max_steps=-1'], 'trainer.max_steps=-1 must be a positive number of steps'),
    (['trainer.accumulate_grad_batches=0'], 'trainer.accumulate_grad_batches=0 must be an integer >= 1'),
    (['trainer.gradient_clip_val=-1'], 'trainer.gradient_clip_val=-1 must be a number >= 0, or null for no clipping'),
    (['trainer.val_check_interval=0'], 'trainer.val_check_interval=0 must be a positive number of steps or a fraction of an epoch in (0, 1]'),
    (['trainer.val_check_interval=1.5'], 'trainer.val_check_interval=1.5 must be a positive number of steps or a fraction of an epoch in (0, 1]'),
    (['trainer.limit_val_batches=1.5'], 'trainer.limit_val_batches=1.5 must be a number of batches >= 0 or a fraction in [0, 1]'),
    (['trainer.limit_val_batches=-1'], 'trainer.limit_val_batches=-1 must be a number of batches >= 0 or a fraction in [0, 1]'),
    (['trainer.log_every_n_steps=0'], 'trainer.log_every_n_steps=0 must be a positive integer'),
    (['trainer.num_nodes=0'], 'trainer.num_nodes=0 must be a positive integer'),
    (['+trainer.foo=1'], 'trainer.foo is not a setting of trainer=default; valid: '),
    (['trainer.enable_model_summary=maybe'], 'trainer.enable_model_summary=maybe must be true or false'),
    (['callbacks.checkpoint.every_n_train_steps=-1'], 'callbacks.checkpoint.every_n_train_steps=-1 must be an integer >= 0 (0: only last.ckpt), or null'),
    (['callbacks.geometry.measures=[bogus]'], 'callbacks.geometry.measures=["bogus"] must be a list of [\'input\', \'hidden\', \'attention\']'),
    (['callbacks.geometry.n_tokens=0'], 'callbacks.geometry.n_tokens=0 must be a positive integer'),
    (['callbacks.geometry.every_n_steps=0'], 'callbacks.geometry.every_n_steps=0 must be a positive integer'),
    (['callbacks.geometry.fixed_k=1000'], 'callbacks.geometry.fixed_k=1000 must be at most model.d_model=128'),
    (['callbacks.geometry.null_draws=1'], 'callbacks.geometry.null_draws=1 must be an integer >= 2 (so that the null has a spread)'),
    (['callbacks.geometry.position_probe_blocks=4'], 'callbacks.geometry.position_probe_blocks=4 must be an integer >= 5 (5-fold cross-validation by block)'),
    (['callbacks.progress_bar.log_every_n_steps=0'], 'callbacks.progress_bar.log_every_n_steps=0 must be a positive integer'),
    (['callbacks.sample.temperature=-1'], 'callbacks.sample.temperature=-1 must be a number >= 0 (0: greedy)'),
    (['callbacks.sample.top_p=1.5'], 'callbacks.sample.top_p=1.5 must be a fraction in (0, 1] (1 or null: off)'),
    (['callbacks.throughput.window_size=1'], 'callbacks.throughput.window_size=1 must be an integer >= 2'),
    (['+callbacks.geometry.foo=1'], 'callbacks.geometry.foo is not a setting of callbacks=default (geometry); valid: '),
    (['+callbacks.foo=1'], 'callbacks.foo=1 must be a config node with a _target_ (a class to build)'),
    (['callbacks.geometry._target_=nope.Nope'], "callbacks.geometry._target_=nope.Nope cannot be imported (ImportError: no module named 'nope')"),
    (['logger.wandb.offline=maybe'], 'logger.wandb.offline=maybe must be true or false'),
    (['+logger.csv.foo=1'], 'logger.csv.foo is not a setting of logger=default (csv); valid: '),
    (['pe=rope', 'pe.randomize_positions=1000000000000'],  # once a 128 TB allocation at the first step
     'pe.randomize_positions=1000000000000 must be an integer in [0, 1048576] (positions drawn from in training; 0: off), or null for off'),
    (['seed=-1'], 'seed=-1 must be an integer in [0, 4294967295]'),
    (['seed=2**40'], 'seed=2**40 must be an integer in [0, 4294967295]'),
    (['seed=abc'], 'seed=abc must be an integer in [0, 4294967295]'),
    (['compile=maybe'], 'compile=maybe must be true or false (torch.compile the model)'),
    (['matmul_precision=ultra'], "matmul_precision=ultra must be one of ['highest', 'high', 'medium']"),
    (['+foo=1'], 'foo is not a setting of the config; valid: '),
]


@pytest.mark.parametrize("overrides,message", BAD_VALUES, ids=[" ".join(o) for o, _ in BAD_VALUES])
def test_every_bad_value_is_one_line_naming_the_key_and_what_is_valid(overrides, message, tmp_path):
    cfg = compose_train_config(overrides, tmp_path)
    with pytest.raises(ConfigError) as err:
        check_config(cfg)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_the_shipped_defaults_pass_and_keep_their_types(default_train_config):
    cfg = default_train_config
    before = OmegaConf.to_container(cfg)
    check_config(cfg)
    assert OmegaConf.to_container(cfg) == before  # nothing coerced, interpolations kept
    assert type(cfg.trainer.val_check_interval) is int and type(cfg.trainer.limit_val_batches) is int  # steps, not fractions


def test_one_corpus_file_given_as_a_string_is_made_absolute_as_one_file(tmp_path, monkeypatch):
    """The pipeline makes input paths absolute before the schema turns a string into a list: it once made
    'tiny.txt' into ['/.../t', '/.../i', ...] ("corpus file(s) not found")."""
    from pe_geometry.training.pipeline import absolute_input_paths

    monkeypatch.chdir(tmp_path)
    cfg = compose_train_config(["data=text_files", "data.corpus.train_files=tiny.txt", "data.corpus.val_files=val.txt"], tmp_path)
    absolute_input_paths(cfg)
    assert list(cfg.data.corpus.train_files) == [str(tmp_path / "tiny.txt")]
    assert list(cfg.data.corpus.val_files) == [str(tmp_path / "val.txt")]


def test_values_are_coerced_to_their_type_and_written_back(tmp_path):
    cfg = compose_train_config(["data=text_files", "data.corpus.train_files=one.txt", "seed='7'",
                                "optimizer.lr=1", "trainer.max_steps=1e3"], tmp_path)
    check_config(cfg)
    assert cfg.data.corpus.train_files == ["one.txt"]  # one file, not a list of its characters
    assert cfg.seed == 7 and cfg.data.seed == 7 and type(cfg.optimizer.lr) is float
    assert cfg.trainer.max_steps == 1000 and type(cfg.trainer.max_steps) is int
    cfg = compose_train_config(["trainer.precision=32", "trainer.devices='1'"], tmp_path)
    check_config(cfg)  # Lightning's own spellings: an int precision, devices as text
    assert cfg.trainer.precision == "32" and cfg.trainer.devices == "1"
    cfg = compose_train_config(["data=hf", "data.path=parquet", "data.val_size=100"], tmp_path)
    check_config(cfg)
    assert cfg.data.val_size == 100 and type(cfg.data.val_size) is int  # a number of documents stays one (HFCorpus refuses 100.0)


def test_an_accelerator_this_machine_lacks_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(validate, "torch_cuda_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^trainer.accelerator=gpu: torch sees no CUDA GPU here; valid on this machine: \['cpu', 'auto'\]$"):
        check_config(compose_train_config(["trainer.accelerator=gpu"], tmp_path))
    monkeypatch.setattr(validate, "torch_cuda_available", lambda: True)
    check_config(compose_train_config(["trainer.accelerator=gpu"], tmp_path))


def test_several_problems_are_one_line_and_a_copied_value_is_named_once(tmp_path):
    with pytest.raises(ConfigError) as err:
        check_config(compose_train_config(["model.dropout=2", "optimizer.lr=-1", "seed=-3"], tmp_path))
    assert str(err.value).count("must be") == 3 and "data.seed" not in str(err.value)  # data.seed is ${seed}


def test_a_users_own_class_is_checked_against_its_constructor(tmp_path):
    cfg = compose_train_config(["+callbacks.timer._target_=lightning.pytorch.callbacks.Timer", "+callbacks.timer.duraton=1"], tmp_path)
    with pytest.raises(ConfigError, match=r"^callbacks.timer.duraton is not a setting of .*valid: \[.*'duration'"):
        check_config(cfg)


def test_a_factory_function_as_target_is_checked_against_its_parameters(tmp_path):
    check_config(compose_train_config(["+callbacks.x._target_=pe_geometry.training.names.arm_name", "+callbacks.x.model=m", "+callbacks.x.pe=p"], tmp_path))
    with pytest.raises(ConfigError, match=r"^callbacks.x.modle is not a setting of .*valid: \['control', 'model', 'pe'\]"):
        check_config(compose_train_config(["+callbacks.x._target_=pe_geometry.training.names.arm_name", "+callbacks.x.modle=m"], tmp_path))


def test_a_batch_larger_than_the_training_split_is_refused(tmp_path, tiny_corpus, cache_dir):
    from tests.conftest import tiny_train_config

    cfg = tiny_train_config(tmp_path, tiny_corpus, cache_dir, ["data.batch_size=1e9"])
    with pytest.raises(ConfigError, match=r"^data.batch_size=1000000000 is larger than the training split, which holds \d+ blocks"):
        train(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow  # runs train.py in subprocesses (the in-process test above covers every value; this the exit code and the folder)
@pytest.mark.parametrize("override,chdir", [("+model.d_modle=64", False), ("model.dropout=2", True)])
def test_through_the_command_line_a_bad_value_is_one_error_line_exit_2_and_no_run_folder(override, chdir, tmp_path):
    args = [override, *(["hydra.job.chdir=true"] if chdir else [])]  # chdir: the job runs inside the folder it then removes
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    message = next(m for o, m in BAD_VALUES if o == [override])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and errors and errors[0].startswith(f"error: {message}") and len(errors) == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []  # no stub outputs/<date>/<time>_.../ with Hydra's .hydra/ and train.log
