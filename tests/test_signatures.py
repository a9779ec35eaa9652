"""The constructor is the one source of a config key's default, type, range and doc (pe_geometry.signatures).

Its signature is read from the source (no import: a wrong value is answered before torch loads) and, where the source
does not say it plainly, by importing the class; the two readings must agree for every class the configs name.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Literal

import pytest
from annotated_types import Ge, Gt, Interval, MinLen
from omegaconf import OmegaConf

from pe_geometry.configs import CONFIG_DIR, SUPPLIED
from pe_geometry.signatures import EMPTY, Unreadable, describe, imported_params, source_params
from tests.conftest import compose_train_config


def shipped_targets() -> dict[str, str]:
    """Every ``_target_`` a shipped yaml names -> the group it is in."""
    found: dict[str, str] = {}

    def visit(node, group: str) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("_target_"), str):
                found[node["_target_"]] = group
            for value in node.values():
                visit(value, group)

    for path in CONFIG_DIR.glob("*/*.yaml"):
        visit(OmegaConf.to_container(OmegaConf.load(path), resolve=False), path.parent.name)
    return found


OURS = sorted(t for t in shipped_targets() if t.startswith("pe_geometry."))


def test_the_configs_name_classes_of_every_layer():
    assert {"pe_geometry.model.RotaryPE", "pe_geometry.model.DecoderLM", "pe_geometry.model.SDPAttention",
            "pe_geometry.data.datamodule.TextDataModule", "pe_geometry.training.optimizer.adamw_warmup_cosine",
            "pe_geometry.analysis.geometry_callback.GeometryCallback"} <= set(OURS)


@pytest.mark.parametrize("target", OURS)
def test_the_source_reading_equals_the_imported_signature(target):
    """What is answered before torch loads is what the class takes: names, defaults and annotations. A class the
    source cannot read (its ``**kwargs`` go to another library's) is read by import: never differently."""
    by_import = imported_params(target)
    try:
        from_source = source_params(target)
    except Unreadable:
        assert target in READ_BY_IMPORT
        return
    assert (from_source is None) == (by_import is None)
    if by_import is None:
        return
    assert list(from_source) == list(by_import)
    supplied = SUPPLIED.get(shipped_targets()[target], set())
    for name, param in by_import.items():
        if name in supplied:
            continue  # built by the pipeline (the model's pe factory): not a config key
        assert (from_source[name].name, from_source[name].default) == (param.name, param.default), name
        component = isinstance(param.annotation, type) and param.annotation.__module__ != "builtins"
        if from_source[name].owner.startswith("pe_geometry.") and not component:  # (a node of its own: data.corpus)
            assert from_source[name].annotation == param.annotation, name


# Lightning's Callback subclasses whose **kwargs go to Lightning (their keys: training.schema.LIBRARY_SETTINGS)
READ_BY_IMPORT = {"pe_geometry.training.sweep.SweepReport", "pe_geometry.training.throughput.TokenThroughputMonitor"}


def test_a_setting_of_ours_has_no_default_in_the_yaml_and_one_in_the_composed_config():
    rope = OmegaConf.load(CONFIG_DIR / "pe" / "rope.yaml")
    assert set(rope) == {"_target_", "_partial_", "training_length"}  # an interpolation stays
    cfg = compose_train_config(["pe=rope", "pe.base=500"])
    assert cfg.pe.base == 500 and cfg.pe.scaling == "none" and cfg.pe.training_length == cfg.data.seq_len
    assert "d_model" not in cfg.pe  # supplied by the model: not a key


def test_a_changed_default_reaches_the_composed_config(monkeypatch):
    """The composed default is read from the constructor, not copied: change the source, the config follows."""
    import pe_geometry.signatures as signatures
    from hydra_plugins.pe_geometry.constructor_defaults import _Filling
    from pe_geometry.signatures import Param

    original = signatures.source_params

    def patched(target):
        params = original(target)
        if target == "pe_geometry.model.CoPE":
            params = {**params, "p_max": Param("p_max", int, 7, "pe_geometry.model.positional")}
        return params

    monkeypatch.setattr(signatures, "source_params", patched)
    # composed afresh: the config source keeps each file it has filled (constructor_defaults._Filling), the tests'
    # composition the first stage of each (conftest.compose_train_config)
    monkeypatch.setattr(_Filling, "_loaded", {})
    monkeypatch.setenv("PE_TEST_COMPOSE_CACHE", "0")
    assert compose_train_config(["pe=cope"]).pe.p_max == 7


def test_lightnings_classes_keep_what_their_yaml_says():
    cfg = compose_train_config([])
    assert "dirpath" in cfg.callbacks.checkpoint and "verbose" not in cfg.callbacks.checkpoint  # ModelCheckpoint's own
    assert "barebones" not in cfg.trainer


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


def test_a_class_the_source_cannot_read_plainly_is_read_by_import(tmp_path, monkeypatch):
    (tmp_path / "made_at_run_time.py").write_text(
        "WIDTH = int('3')\n"
        "class Built:\n"
        "    def __init__(self, width: int = WIDTH, name: str = 'x'):\n"
        "        self.width = width\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    from pe_geometry.signatures import constructor_params

    source = source_params("made_at_run_time.Built")
    assert source["width"].default is EMPTY and source["name"].default == "x"  # WIDTH is computed when it runs
    assert constructor_params("made_at_run_time.Built")["width"].default is EMPTY  # read from source first
    assert imported_params("made_at_run_time.Built")["width"].default == 3


@pytest.mark.slow
def test_a_bad_value_is_answered_before_torch_loads(tmp_path):
    """One error line, exit 2, and neither torch nor Lightning imported (they cost seconds)."""
    probe = ("import sys, runpy; sys.argv = ['pe-train', 'model.dropout=2', 'pe=rope', '+pe.bsae=1'];\n"
             "try:\n    runpy.run_module('pe_geometry.cli.train', run_name='__main__')\n"
             "except SystemExit as stop:\n"
             "    print('torch' in sys.modules, 'lightning' in sys.modules, stop.code)")
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    took = time.perf_counter() - start
    assert result.stdout.split() == ["False", "False", "2"], result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: model.dropout=2 must be a probability in [0, 1); pe.bsae is not a setting of pe=rope; valid: "
        "['base', 'high_freq_factor', 'low_freq_factor', 'partial_rotary', 'randomize_positions', 'rotary_fraction', "
        "'scaling', 'scaling_factor', 'training_length', 'yarn_alpha', 'yarn_attention_factor', 'yarn_beta', 'yarn_ramp']"]
    assert not list(Path(tmp_path).glob("outputs/*/*/*")), "a refused run leaves no folder"
    print(f"answered in {took:.2f} s")



def test_a_filled_config_file_is_read_again_when_it_changes(tmp_path):
    """The config source keeps each file it has filled (constructor_defaults._Filling): an edited file is read again,
    and each caller gets its own copy."""
    from hydra_plugins.pe_geometry.constructor_defaults import ConstructorDefaultsFileSource

    source = ConstructorDefaultsFileSource(provider="test", path=str(tmp_path))
    (tmp_path / "pe").mkdir()
    path = tmp_path / "pe" / "mine.yaml"
    path.write_text("_target_: pe_geometry.model.CoPE\n")
    first = source.load_config("pe/mine")
    assert first.config.p_max == 16 and first.config is not source.load_config("pe/mine").config  # filled; a copy
    first.config.p_max = 3  # a caller's change stays its own
    assert source.load_config("pe/mine").config.p_max == 16
    path.write_text("_target_: pe_geometry.model.CoPE\np_max: 64\n")
    assert source.load_config("pe/mine").config.p_max == 64
