"""Every config composes; every bad value is caught before training with one clear line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.core.hydra_config import HydraConfig
from hydra.errors import MissingConfigException

from pe_geometry.training.validate import ConfigError, check_config
from tests import forkserver
from tests.conftest import CONFIG_DIR, ROOT, compose_train_config

GROUPS = sorted(p.name for p in CONFIG_DIR.iterdir() if p.is_dir() and p.name != "hydra")


def group_options():
    for group in GROUPS:
        for option in sorted((CONFIG_DIR / group).glob("*.yaml")):
            yield group, option.stem


@pytest.mark.parametrize("group,option", list(group_options()))
def test_every_config_option_composes(group, option, tmp_path, monkeypatch):
    overrides = [f"{group}={option}"]
    if (group, option) == ("trainer", "gpu"):  # as on a GPU machine; without one: tests/test_presets.py
        monkeypatch.setattr("pe_geometry.training.validate.torch_cuda_available", lambda: True)
    if (group, option) == ("data", "text_files"):
        overrides.append("data.corpus.train_files=[x.txt]")
    cfg = compose_train_config(overrides, output_dir=tmp_path)
    assert HydraConfig.get().runtime.choices[group] == option
    check_config(cfg)  # the shipped options are all valid together with the defaults


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model.d_model=100", "model.n_heads=3"], r"model.d_model=100 is not divisible by model.n_heads=3; valid n_heads: \[1, 2, 4, 5"),
        (["pe=rope", "model.d_model=12", "model.n_heads=4"], r"pe=rope: RoPE needs an even head dimension.*12/4 = 3"),
        (["pe=sinusoidal", "model.d_model=33", "model.n_heads=3"], r"pe=sinusoidal: sinusoidal PE needs an even model.d_model.*33"),
        (["pe=learned", "data.seq_len=600"], r"data.seq_len=600 is longer than the learned position table \(pe.max_len=512\)"),
        (["pe=rope", "control=mixed_init"],
         r"pe.init is not a setting of pe=rope; valid: \['base', 'high_freq_factor', .*'scaling', .*\]; pe.init_k is not"),
        (["pe=learned", "pe.init=orthogonal"], r"pe.init=orthogonal must be one of \['normal', 'mixed'\]"),
        (["pe=learned", "pe.init_k=0"], r"pe.init_k=0 must be a positive integer"),
        (["pe.scale=double"], r"pe.scale=double must be one of \['none', 'word_norm'\]"),
        (["pe._target_=pe_geometry.model.NoSuchPE"], r"pe._target_=pe_geometry.model.NoSuchPE cannot be imported"),
        (["data.vocab_size=100"], r"data.vocab_size=100 is too small for the bpe tokenizer: it needs at least 259"),
        (["data.tokenizer=wordpiece"], r"data.tokenizer=wordpiece must be one of \['bpe', 'char'\]"),
        (["trainer.max_steps=0"], r"trainer.max_steps=0 must be a positive"),
        (["optimizer.lr=-0.001"], r"optimizer.lr=-0.001 must be a number > 0"),
        (["model.norm=sandwich"], r"model.norm=sandwich must be one of \['pre', 'post'\]"),
    ],
)
def test_bad_values_are_rejected_with_a_clear_message(overrides, message, tmp_path):
    cfg = compose_train_config(overrides, output_dir=tmp_path)
    with pytest.raises(ConfigError, match=message):
        check_config(cfg)


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PE_CACHE_DIR": str(cwd / "cache")}
    return forkserver.run(
        [sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={cwd / 'run'}"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )


@pytest.mark.slow  # runs train.py in a subprocess
def test_cli_unknown_option_lists_valid_choices(tmp_path):
    result = run_cli("pe=sinusodal", cwd=tmp_path)
    assert result.returncode != 0
    assert "Could not find 'pe/sinusodal'" in result.stderr
    for option in ("alibi", "learned", "none", "rope", "sinusoidal"):
        assert option in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow  # runs train.py in a subprocess
def test_cli_bad_value_is_one_line_and_nothing_is_trained(tmp_path):
    result = run_cli("model.n_heads=3", cwd=tmp_path)
    assert result.returncode == 2
    assert "error: model.d_model=128 is not divisible by model.n_heads=3" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("old,valid", [("embedding=learned", ["plain", "scaled"]), ("attention=mha", ["explicit", "sdpa"])])
def test_old_option_names_are_unknown_options_that_list_the_valid_ones(old, valid, tmp_path):
    """embedding=learned (now plain; pe=learned is the position table) and attention=mha (now explicit) are gone:
    they fail like any unknown option, with Hydra's list of the valid ones, instead of training something."""
    group, name = old.split("=")
    with pytest.raises(MissingConfigException, match=f"Could not find '{group}/{name}'") as err:
        compose_train_config([old], output_dir=tmp_path)
    assert all(f"\t{option}\n" in str(err.value) for option in valid)


# -- the tests' composition (conftest.compose_train_config) is Hydra's ---------------------------------------------
SAME_AS_HYDRA = [
    [],
    ["pe=rope", "model.dropout=0.2", "model.d_model=32"],
    ["model.d_model=32", "pe=alibi", "model=encoder", "~callbacks.progress_bar", "+callbacks.x._target_=a.b"],
    ["experiment=length_tasks", "seed=3", "data.task=copy"],
    ["data=text_files", "data.corpus.train_files=one.txt", "seed='7'", "model.layer_pattern=[{},{pe: none}]"],
    ["pe=rope", "pe.base=500", "pe=learned"],  # the last choice wins, and pe.base is then not a key of pe
    ["model.nonexistent=1"],
    ["+pe.base=1"],
    ["pe=nonexistent"],
    ["~model.nonexistent"],
]


@pytest.mark.parametrize("overrides", SAME_AS_HYDRA, ids=lambda o: " ".join(o) or "defaults")
def test_the_tests_composition_is_hydras_own(overrides, monkeypatch, tmp_path):
    """The first stage of a composition is cached per set of group choices (conftest.compose_train_config): the config,
    Hydra's own node (overrides, choices, override_dirname, the working folder) and the errors must be those of one
    ``compose`` call, in another folder than the one the cached stage was composed in."""
    from omegaconf import OmegaConf

    def composed(cache: str):
        monkeypatch.setenv("PE_TEST_COMPOSE_CACHE", cache)
        try:
            cfg = compose_train_config(overrides)
        except Exception as error:  # noqa: BLE001 (the errors must be the same too)
            return type(error).__name__, str(error)
        return OmegaConf.to_container(cfg), OmegaConf.to_container(HydraConfig.get(), resolve=False)

    composed("1")  # cached here
    monkeypatch.chdir(tmp_path)
    hydras = composed("0")
    assert composed("1") == hydras
