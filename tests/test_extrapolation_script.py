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
def test_the_script_scores_every_run_and_places_each_family_on_the_attention_axes(tmp_path, tiny_corpus, cache_dir, capsys):
    sweep = tmp_path / "sweep"
    arms = {"rope": ["pe=rope"], "learned": ["pe=learned"], "window": ["pe=rope", "attention.window=4"]}
    for name, overrides in arms.items():
        train(tiny_train_config(sweep / name, tiny_corpus, cache_dir, [*overrides, "trainer.max_steps=3"]))
    out = tmp_path / "out"
    argv = [*(str(sweep / name / "run") for name in arms), "--out", str(out), "--multipliers", "1", "2",
            "--scalings", "linear", "--cache", str(tmp_path / "cache")]
    payload = load_script().main(argv)
    # an attention variant is an arm of its own, not read with the RoPE scalings
    assert set(payload["summary"]) == {"rope", "rope+linear", "learned", "rope (window 4)"}
    assert payload["summary"]["rope (window 4)"]["attention"] is not None
    rope = payload["summary"]["rope"]["attention"]
    assert "null_mean" in rope and "null_mean" not in payload["summary"]["learned"]["attention"]
    assert len(rope["distance_ratio"]) == 2  # the tiny model's two blocks
    assert all(0 < d["mean"] < 2 for d in rope["distance_ratio"])
    md = (out / "extrapolation.md").read_text()
    assert "## Where position enters the attention" in md
    rows = [line for line in md.splitlines() if line.startswith(("| rope ", "| learned ", "| rope+linear ", "| rope (window 4) "))]
    assert len(rows) == 7  # rope, learned and the window arm in both tables, rope+linear in the loss table only
    again = load_script().main(argv)  # every run scored before: read back from the cache, same numbers
    assert capsys.readouterr().out.count("scored before") == 3 and again["summary"] == payload["summary"]
    assert (out / "position_attention.png").stat().st_size > 10_000 and (out / "extrapolation.png").stat().st_size > 10_000
