"""A plain override of a key the chosen option lacks is one line before Hydra composes
(``pe_geometry.training.option_keys``), and the check agrees with Hydra's own composition on every case: it speaks
only where Hydra would refuse with "Could not override", and never where Hydra composes."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException

from pe_geometry.training.option_keys import key_of_another_option, option_keys
from tests.conftest import compose_train_config

CASES = [
    # (command line, Hydra refuses it)
    (["pe=alibi", "pe.rotary_fraction=0.5"], True),
    (["pe.rotary_fraction=0.5"], True),                          # the default option, sinusoidal
    (["pe=rope", "pe.rotary_fraction=0.5"], False),
    (["pe=xpos", "pe.rotary_fraction=0.5"], False),
    (["attention.bogus=1"], True),
    (["attention=explicit", "attention.window=8"], False),
    (["experiment=length_tasks_quick", "pe.base=10"], True),     # a single run of it keeps the default pe
    (["experiment=length_tasks_quick", "data.task=copy"], False),
    (["experiment=extrapolation_peer", "model.peer_pe=alibi"], False),
    (["model=xtransformers", "model.peer_pe=rope"], False),
    (["model=xtransformers", "pe.base=10"], True),               # the peer sets pe=none
    (["data=task", "data.task=copy"], False),
    (["data.task=copy"], True),                                   # the default data, shakespeare, has no task
    (["control=untied_head", "embedding.tie_weights=true"], False),
    (["embedding=scaled", "embedding.tie_weights=false"], False),
    (["optimizer.lr=0.1"], False),
    (["trainer.max_steps=3"], False),
    (["model.d_model=64"], False),
    (["+pe.rotary_fraction=0.5"], False),                         # `+` adds a key: the schema answers it, not this
]


def hydra_refuses(overrides: list[str]) -> bool:
    try:
        compose_train_config(overrides)
    except ConfigCompositionException as error:
        return "Could not override" in str(error) or "not in struct" in str(error)
    return False


@pytest.mark.parametrize("argv,refused", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_the_check_agrees_with_hydras_composition(argv, refused):
    assert hydra_refuses(argv) is refused  # the reference: what Hydra itself does with the command
    line = key_of_another_option(argv)
    if refused:
        assert line is not None and "\n" not in line
    else:
        assert line is None


def test_the_line_names_the_option_its_settings_and_the_options_that_take_the_key():
    line = key_of_another_option(["pe=alibi", "pe.rotary_fraction=0.5"])
    assert line == ("pe.rotary_fraction is not a setting of pe=alibi (its settings: randomize_positions); "
                    "it is a setting of pe=rope, pe=xpos")
    assert key_of_another_option(["attention.bogus=1"]).endswith("no attention option has it")


def test_a_sweep_over_the_group_is_left_to_each_job():
    assert key_of_another_option(["-m", "pe=alibi,rope", "pe.rotary_fraction=0.5"]) is None
    assert key_of_another_option(["-m", "experiment=length_tasks_quick", "pe.base=10"]) is None  # it sweeps pe


def test_option_keys_are_the_yaml_keys_and_the_settings_fields():
    keys = option_keys("pe", "rope")
    assert {"_target_", "training_length", "base", "rotary_fraction", "scaling"} <= keys
    assert option_keys("model", "xtransformers") is None  # a global package file: not read plainly
    assert option_keys("pe", "no_such_option") is None


@pytest.mark.slow
def test_through_pe_train_it_is_one_line_exit_2_and_no_folder(tmp_path):
    import os
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "pe_geometry.cli.train", "pe=alibi", "pe.rotary_fraction=0.5"],
                            cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: pe.rotary_fraction is not a setting of pe=alibi (its settings: randomize_positions); "
        "it is a setting of pe=rope, pe=xpos"]
    assert not (tmp_path / "outputs").exists()
