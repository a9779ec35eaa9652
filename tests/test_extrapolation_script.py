"""experiments/extrapolation.py end to end on two tiny trained runs: the loss table, the RoPE scalings, and where
each family puts position in the attention (a second table and figure)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from pe_geometry.training.pipeline import train
from tests.conftest import tiny_train_config

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "extrapolation.py"


def load_script():
    spec = importlib.util.spec_from_file_location("extrapolation_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # trains two runs
def test_the_script_scores_every_run_and_places_each_family_on_the_attention_axes(tmp_path, tiny_corpus, cache_dir):
    sweep = tmp_path / "sweep"
    for pe in ("rope", "learned"):
        train(tiny_train_config(sweep / pe, tiny_corpus, cache_dir, [f"pe={pe}", "trainer.max_steps=3"]))
    out = tmp_path / "out"
    payload = load_script().main([str(sweep / "rope" / "run"), str(sweep / "learned" / "run"), "--out", str(out),
                                  "--multipliers", "1", "2", "--scalings", "linear"])
    assert set(payload["summary"]) == {"rope", "rope+linear", "learned"}
    rope = payload["summary"]["rope"]["attention"]
    assert "null_mean" in rope and "null_mean" not in payload["summary"]["learned"]["attention"]
    assert len(rope["distance_ratio"]) == 2  # the tiny model's two blocks
    assert all(0 < d["mean"] < 2 for d in rope["distance_ratio"])
    md = (out / "extrapolation.md").read_text()
    assert "## Where position enters the attention" in md
    rows = [line for line in md.splitlines() if line.startswith(("| rope ", "| learned ", "| rope+linear "))]
    assert len(rows) == 5  # rope and learned in both tables, rope+linear in the loss table only
    assert (out / "position_attention.png").stat().st_size > 10_000 and (out / "extrapolation.png").stat().st_size > 10_000
