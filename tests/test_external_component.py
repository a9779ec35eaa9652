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

MODULE = '''
"""A user's own parts: a sinusoidal table at a chosen amplitude, and attention with a fixed temperature."""
from typing import Annotated

import torch
from annotated_types import Gt
from torch import Tensor

from pe_geometry.model.attention import ExplicitAttention
from pe_geometry.model.positional import PositionalEncoding, sinusoidal_table


class QuietSinusoid(PositionalEncoding):
    def __init__(self, d_model: int, n_heads: int, amplitude: Annotated[float, Gt(0)] = 0.5) -> None:
        super().__init__(d_model, n_heads)
        self.amplitude = amplitude
        self.register_buffer("anchor", torch.zeros(0), persistent=False)  # follows the model's device

    def input_term(self, seq_len: int, start_pos: int = 0) -> Tensor:
        table = sinusoidal_table(start_pos + seq_len, self.d_model).to(self.anchor.device)
        return self.amplitude * table[start_pos:]


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
    (tmp_path / "conf" / "pe").mkdir(parents=True)
    (tmp_path / "conf" / "attention").mkdir()
    (tmp_path / "conf" / "pe" / "quiet.yaml").write_text("_target_: my_parts.QuietSinusoid\n_partial_: true\n")
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
    bad = train(user_dir, tiny_corpus, "+pe.amplitude=-1", "+attention.temperature=0")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "error: pe.amplitude=-1 must be a number > 0; attention.temperature=0 must be a number > 0"]
    typo = train(user_dir, tiny_corpus, "+pe.amplitdue=1")
    assert typo.stderr.strip().splitlines() == ["error: pe.amplitdue is not a setting of pe=quiet; valid: ['amplitude']"]

    first = train(user_dir, tiny_corpus, "+pe.amplitude=0.25", "trainer.max_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = train(user_dir, tiny_corpus, "ckpt_path=auto", "trainer.max_steps=4")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    checkpoint = torch.load(user_dir / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == 4
    config = checkpoint["run_config"]
    assert config["pe"] == {"_target_": "my_parts.QuietSinusoid", "_partial_": True, "amplitude": 0.25}
    assert config["attention"]["_target_"] == "my_parts.TemperedAttention"
