"""Each component's settings dataclass (pe_geometry.settings) is the one source of its keys' defaults, types, ranges
and docs: the class takes it and restates nothing, the yaml extends its stored node, the composed config holds every
default, and the check of a value (cross-key ones included) imports no torch."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Literal

import pytest
from annotated_types import Ge, Gt, Interval, MinLen
from omegaconf import OmegaConf

from pe_geometry.configs import CONFIG_DIR, SUPPLIED
from pe_geometry.settings import REGISTRY, defaults, settings_of
from pe_geometry.settings.wording import describe
from pe_geometry.training.schema import LIBRARY_SETTINGS, import_target
from tests.conftest import compose_train_config

HYDRA_KEYS = {"_target_", "_partial_", "_convert_", "defaults"}


def shipped_nodes() -> list[tuple[Path, str, dict]]:
    """Every node a shipped yaml names a ``_target_`` in: (file, group, node)."""
    found = []

    def visit(path: Path, node, group: str) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("_target_"), str):
                found.append((path, group, node))
            for value in node.values():
                visit(path, value, group)

    for path in sorted(CONFIG_DIR.glob("*/*.yaml")):
        visit(path, OmegaConf.to_container(OmegaConf.load(path), resolve=False), path.parent.name)
    return found


# Our subclasses of other libraries' classes (their keys are the library's: LIBRARY_SETTINGS types what we let a config
# set) and classes that take no settings.
NOT_SETTINGS = {
    "pe_geometry.training.callbacks.ResumableCSVLogger",  # Lightning's CSVLogger
    "pe_geometry.training.sweep.SweepReport",  # a Hydra callback, no settings
    "pe_geometry.training.throughput.TokenThroughputMonitor",  # Lightning's ThroughputMonitor (window_size: LIBRARY_SETTINGS)
    "hydra_plugins.pe_geometry.launchers.IsolatedJoblibLauncher",
    "hydra_plugins.pe_geometry.launchers.SlurmLauncher",
}
OURS = sorted({node["_target_"] for _, _, node in shipped_nodes()
               if node["_target_"].split(".")[0] in ("pe_geometry", "hydra_plugins")})


@pytest.mark.parametrize("target", OURS)
def test_every_component_of_ours_has_settings_and_its_class_restates_none(target):
    if target in NOT_SETTINGS or target in LIBRARY_SETTINGS:
        return
    settings = settings_of(target)
    assert settings is not None, f"{target} has no registered settings dataclass"
    obj = import_target(target)
    if isinstance(obj, type):
        assert obj.Settings is settings
    group = settings.group.split(".")[0]
    nested = {key for _, _, node in shipped_nodes() if node["_target_"] == target
              for key, value in node.items() if isinstance(value, dict) and "_target_" in value}
    function = obj.__init__ if isinstance(obj, type) else obj
    params = list(inspect.signature(function).parameters.values())[1 if isinstance(obj, type) else 0:]
    own = {p.name for p in params if p.kind is not p.VAR_KEYWORD} - SUPPLIED.get(group, set()) - nested
    assert not own, f"{target} takes {sorted(own)} besides its settings: a default restated outside {settings.__name__}"
    assert any(p.kind is p.VAR_KEYWORD for p in params), f"{target} does not take its settings as keywords"


@pytest.mark.parametrize("path,group,node", [(p, g, n) for p, g, n in shipped_nodes()
                                              if settings_of(n["_target_"]) is not None], ids=lambda v: getattr(v, "name", ""))
def test_each_yaml_extends_its_settings_and_sets_only_their_keys(path, group, node):
    settings = settings_of(node["_target_"])
    text = path.read_text(encoding="utf-8")
    assert f"/settings/{settings.__name__}@" in text, f"{path.name} does not extend /settings/{settings.__name__}"
    fields = {f.name for f in dataclasses.fields(settings)}
    nested = {k for k, v in node.items() if isinstance(v, dict) and "_target_" in v}
    assert set(node) - HYDRA_KEYS - nested <= fields


def test_the_composed_config_holds_every_default():
    cfg = compose_train_config(["pe=rope", "pe.base=500"])
    assert cfg.pe.base == 500 and cfg.pe.training_length == cfg.data.seq_len  # typed, and the yaml's interpolation
    for key, value in defaults(settings_of("pe_geometry.model.RotaryPE")).items():
        if key not in ("base", "training_length"):
            assert cfg.pe[key] == value, key
    assert "d_model" not in cfg.pe  # supplied by the model: not a key
    assert cfg.model.n_heads == defaults(settings_of(cfg.model._target_))["n_heads"]


def test_a_changed_default_reaches_the_composed_config(monkeypatch):
    """The composed default is the dataclass's, not a copy: change it, the config follows."""
    from pe_geometry.settings import registry
    from pe_geometry.settings.positional import CoPESettings

    original = registry.defaults
    monkeypatch.setattr(registry, "defaults", lambda cls: {**original(cls), "p_max": 7} if cls is CoPESettings else original(cls))
    monkeypatch.setenv("PE_TEST_COMPOSE_CACHE", "0")
    try:
        assert compose_train_config(["pe=cope"]).pe.p_max == 7
    finally:
        monkeypatch.undo()
        registry.store_in_hydra()  # the true defaults back in the store for the tests after this one


def test_lightnings_classes_keep_what_their_yaml_says():
    cfg = compose_train_config([])
    assert "dirpath" in cfg.callbacks.checkpoint and "verbose" not in cfg.callbacks.checkpoint  # ModelCheckpoint's own
    assert "barebones" not in cfg.trainer


def test_every_registered_settings_names_a_class_that_takes_it():
    for target, settings in REGISTRY.items():
        if not target.startswith("pe_geometry."):
            continue  # (a plugin's, registered by another test)
        obj = import_target(target)
        if isinstance(obj, type):
            assert issubclass(obj.Settings, settings) or obj.Settings is settings, target


@pytest.mark.parametrize("annotation,words", [
    (Annotated[int, Ge(1)], "a positive integer"),
    (Annotated[int, Ge(2)], "an integer >= 2"),
    (Annotated[int, Interval(ge=0, le=9)], "an integer in [0, 9]"),
    (Annotated[float, Gt(1)], "a number > 1"),
    (Annotated[float, Interval(gt=0, lt=1)], "a fraction in (0, 1)"),
    (Annotated[float, Interval(ge=0, lt=1), "a probability"], "a probability in [0, 1)"),
    (Annotated[int | None, Ge(1), "null for 4 * d_model"], "a positive integer, or null for 4 * d_model"),
    (Annotated[int, Ge(0), "DataLoader workers"], "an integer >= 0 (DataLoader workers)"),
    (Literal["pre", "post"], "one of ['pre', 'post']"),
    (list[Literal["a", "b"]], "a list of ['a', 'b']"),
    (Annotated[list[str], MinLen(1)], "a non-empty list of strings"),
    (bool, "true or false"),
    (bool | None, "true or false, or null"),
])
def test_an_annotation_is_worded_as_the_error_line_ends(annotation, words):
    assert describe(annotation) == words


def test_the_settings_import_no_torch():
    probe = "import sys, pe_geometry.settings; print('torch' in sys.modules, 'lightning' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == ["False", "False"], result.stderr


def run_refused(tmp_path: Path, *overrides: str) -> tuple[list[str], list[str], float]:
    """pe-train with these overrides: (what was imported and the exit code, the stderr lines, seconds)."""
    probe = (f"import sys, runpy; sys.argv = ['pe-train', *{list(overrides)!r}];\n"
             "try:\n    runpy.run_module('pe_geometry.cli.train', run_name='__main__')\n"
             "except SystemExit as stop:\n"
             "    print('torch' in sys.modules, 'lightning' in sys.modules, stop.code)")
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    return result.stdout.split(), result.stderr.strip().splitlines(), time.perf_counter() - start


@pytest.mark.slow
@pytest.mark.parametrize("overrides,line", [
    (("model.dropout=2", "pe=rope", "+pe.bsae=1"),
     "error: model.dropout=2 must be a probability in [0, 1); pe.bsae is not a setting of pe=rope; valid: "
     "['base', 'high_freq_factor', 'low_freq_factor', 'partial_rotary', 'randomize_positions', 'rotary_fraction', "
     "'scaling', 'scaling_factor', 'training_length', 'yarn_alpha', 'yarn_attention_factor', 'yarn_beta', 'yarn_ramp']"),
    (("model.d_model=33",), "error: model.d_model=33 is not divisible by model.n_heads=4; valid n_heads: [1, 3, 11, 33]"),
    (("pe=learned", "pe.max_len=64", "data.seq_len=128"),
     "error: pe=learned: data.seq_len=128 is longer than the learned position table (pe.max_len=64); raise pe.max_len "
     "or shorten data.seq_len"),
    (("pe=rope", "model.d_model=36"),
     "error: pe=rope: RoPE needs an even head dimension, got model.d_model/model.n_heads = 36/4 = 9"),
    (("attention.n_kv_heads=3",),
     "error: attention.n_kv_heads=3 must divide model.n_heads=4 (each key/value head serves n_heads/n_kv_heads query "
     "heads); valid: [1, 2, 4] or null"),
])
def test_a_bad_value_cross_key_ones_included_is_answered_before_torch_loads(tmp_path, overrides, line):
    """One error line, exit 2, and neither torch nor Lightning imported (they cost seconds); the time is measured by
    ``experiments/benchmark.py --cli``, not asserted here."""
    imported, stderr, took = run_refused(tmp_path, *overrides)
    assert imported == ["False", "False", "2"], stderr
    assert stderr == [line]
    assert not list(Path(tmp_path).glob("outputs/*/*/*")), "a refused run leaves no folder"
    print(f"answered in {took:.2f} s")


def test_a_scaling_at_factor_one_is_said_at_the_start():
    """``pe.scaling=llama3`` alone leaves every frequency as trained (factor 1): the run warns, naming the fix."""
    from pe_geometry.settings import Sizes
    from pe_geometry.settings.positional import RotarySettings

    (line,) = RotarySettings(scaling="llama3", training_length=64).warnings(Sizes(32, 2, 64))
    assert line.startswith("pe.scaling=llama3 at pe.scaling_factor=1 changes no frequency")
    assert RotarySettings(scaling="llama3", scaling_factor=4.0, training_length=64).warnings(Sizes(32, 2, 64)) == []
    assert RotarySettings(scaling="dynamic_ntk", training_length=64).warnings(Sizes(32, 2, 64)) == []  # it scales past L
