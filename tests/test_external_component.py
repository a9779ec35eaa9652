"""A positional encoding and an attention variant written outside the package: one class and one yaml each, selected on
the command line, trained, checked (a bad value is one line) and resumed, with no edit to pe_geometry."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, TINY

SETTINGS = '''
"""The settings of a user's encoding: torch-free, registered for its class, found through the entry point."""
from dataclasses import dataclass
from typing import Annotated

from annotated_types import Gt

from pe_geometry.settings import component
from pe_geometry.settings.positional import EncodingSettings


@component("my_parts.QuietSinusoid")
@dataclass(frozen=True)
class QuietSettings(EncodingSettings):
    amplitude: Annotated[float, Gt(0)] = 0.5
'''

MODULE = '''
"""A user's own parts: a sinusoidal table at a chosen amplitude (with settings of its own: first-class), and attention
with a fixed temperature (read from its constructor: settings added with +)."""
from typing import Annotated

import torch
from annotated_types import Gt
from torch import Tensor

from my_parts_settings import QuietSettings
from pe_geometry.model.attention import ExplicitAttention
from pe_geometry.model.positional import PositionalEncoding, sinusoidal_table


class QuietSinusoid(PositionalEncoding):
    Settings = QuietSettings

    def __init__(self, d_model: int, n_heads: int, **settings) -> None:
        super().__init__(d_model, n_heads, **settings)
        self.register_buffer("anchor", torch.zeros(0), persistent=False)  # follows the model's device

    def input_term(self, seq_len: int, start_pos: int = 0, positions=None) -> Tensor:
        table = sinusoidal_table(start_pos + seq_len, self.d_model).to(self.anchor.device)
        return self.settings.amplitude * table[start_pos:]


class TemperedAttention(ExplicitAttention):
    def __init__(self, d_model: int, n_heads: int, pe=None, dropout: float = 0.0,
                 temperature: Annotated[float, Gt(0)] = 2.0) -> None:
        super().__init__(d_model, n_heads, pe, dropout)
        self.temperature = temperature

    def attend(self, q: Tensor, k: Tensor, v: Tensor, bias, causal: bool, window=None) -> Tensor:
        return super().attend(q / self.temperature, k, v, bias, causal, window)
'''


@pytest.fixture
def user_dir(tmp_path) -> Path:
    (tmp_path / "my_parts.py").write_text(MODULE, encoding="utf-8")
    (tmp_path / "my_parts_settings.py").write_text(SETTINGS, encoding="utf-8")
    # what `pip install` of a package with `[project.entry-points."pe_geometry.settings"] my_parts = "my_parts_settings"`
    # leaves on the path: the entry point pe_geometry loads before Hydra composes
    dist = tmp_path / "my_parts-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my_parts\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[pe_geometry.settings]\nmy_parts = my_parts_settings\n")
    (tmp_path / "conf" / "pe").mkdir(parents=True)
    (tmp_path / "conf" / "attention").mkdir()
    (tmp_path / "conf" / "pe" / "quiet.yaml").write_text(
        "defaults:\n  - /settings/QuietSettings@_here_\n  - _self_\n_target_: my_parts.QuietSinusoid\n_partial_: true\n")
    (tmp_path / "conf" / "attention" / "tempered.yaml").write_text("_target_: my_parts.TemperedAttention\n_partial_: true\n")
    return tmp_path


def train(user_dir: Path, tiny_corpus, *args: str) -> subprocess.CompletedProcess:
    overrides = [
        "--config-dir", str(user_dir / "conf"), "pe=quiet", "attention=tempered", "logger=csv", "data=text_files",
        f"data.corpus.train_files=[{tiny_corpus['train']}]", f"data.corpus.val_files=[{tiny_corpus['validation']}]",
        f"paths.cache_dir={user_dir / 'cache'}", f"hydra.run.dir={user_dir / 'run'}", *TINY,
        "~callbacks.geometry", "~callbacks.sample", *args,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(user_dir), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *overrides], cwd=user_dir, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # runs train.py in subprocesses
def test_a_users_encoding_and_attention_train_check_and_resume(user_dir, tiny_corpus):
    # the encoding with settings of its own is first-class: a bare override, checked before torch loads
    bad = train(user_dir, tiny_corpus, "pe.amplitude=-1", "+attention.temperature=0")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == ["error: pe.amplitude=-1 must be a number > 0"]  # (before torch loads)
    # the attention without settings is read from its constructor once imported: its value is checked there
    bad = train(user_dir, tiny_corpus, "+attention.temperature=0")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == ["error: attention.temperature=0 must be a number > 0"]
    typo = train(user_dir, tiny_corpus, "+pe.amplitdue=1")
    assert typo.stderr.strip().splitlines() == [
        "error: pe.amplitdue is not a setting of pe=quiet; valid: ['amplitude', 'randomize_positions']"]
    shown = train(user_dir, tiny_corpus, "--cfg", "job", "--package", "pe")
    assert "amplitude: 0.5" in shown.stdout, shown.stdout + shown.stderr

    first = train(user_dir, tiny_corpus, "pe.amplitude=0.25", "trainer.max_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = train(user_dir, tiny_corpus, "ckpt_path=auto", "trainer.max_steps=4")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    checkpoint = torch.load(user_dir / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == 4
    config = checkpoint["run_config"]
    # every default is stored, not only what was typed: a later change of the class's default rebuilds the same model
    assert config["pe"] == {"_target_": "my_parts.QuietSinusoid", "_partial_": True, "amplitude": 0.25,
                            "randomize_positions": None}
    assert config["attention"]["_target_"] == "my_parts.TemperedAttention"


def test_settings_of_loads_a_packages_entry_point(user_dir, monkeypatch):
    """``settings_of`` finds a class outside the package through its ``pe_geometry.settings`` entry point, once."""
    from pe_geometry.settings import REGISTRY, SettingsError, registry

    monkeypatch.syspath_prepend(str(user_dir))
    registry.load_plugins.cache_clear()
    try:
        found = registry.settings_of("my_parts.QuietSinusoid")
        assert found is not None and found.__name__ == "QuietSettings" and registry.load_plugins() == ("my_parts_settings",)
        with pytest.raises(SettingsError, match=r"^pe.amplitude=0 must be a number > 0$"):
            found(amplitude=0)
    finally:
        REGISTRY.pop("my_parts.QuietSinusoid", None)
        registry.load_plugins.cache_clear()
        sys.modules.pop("my_parts_settings", None)
