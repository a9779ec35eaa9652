"""pe-bench extrapolation (pe_geometry/benchmarks/extrapolation*.py) end to end on two tiny trained runs: the loss
table, the RoPE scalings, and where each family puts position in the attention (a second table and figure); and the
protocol's pieces (scalings, perplexity ratios, arm labels, kept entries, unfinished runs) without training."""

from __future__ import annotations

import math

import pytest
import torch

from pe_geometry.benchmarks import extrapolation_report as report
from pe_geometry.benchmarks import extrapolation_scoring as scoring
from pe_geometry.benchmarks.arms import arm_label
from pe_geometry.benchmarks.runs import run_dirs
from pe_geometry.cli.bench import main as bench
from pe_geometry.training.pipeline import train
from tests.conftest import tiny_train_config


@pytest.mark.slow  # trains two runs
def test_the_benchmark_scores_every_run_and_places_each_family_on_the_attention_axes(tmp_path, tiny_corpus, cache_dir, capsys):
    sweep = tmp_path / "sweep"
    arms = {"rope": ["pe=rope"], "learned": ["pe=learned"], "window": ["pe=rope", "attention.window=4"]}
    for name, overrides in arms.items():
        train(tiny_train_config(sweep / name, tiny_corpus, cache_dir, [*overrides, "trainer.max_steps=3"]))
    out = tmp_path / "out"
    argv = ["extrapolation", *(str(sweep / name / "run") for name in arms), "--out", str(out), "--multipliers", "1", "2",
            "--scalings", "linear", "--cache", str(tmp_path / "cache")]
    payload = bench(argv)
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
    again = bench(argv)  # every run scored before: read back from the cache, same numbers
    assert capsys.readouterr().out.count("scored before") == 3 and again["summary"] == payload["summary"]
    assert (out / "position_attention.png").stat().st_size > 10_000 and (out / "extrapolation.png").stat().st_size > 10_000


# -- the protocol's pieces, without training ------------------------------------------------------------------------


@pytest.mark.parametrize("m", [2, 4, 8, 16])
def test_dynamic_ntk_reads_m_times_the_training_length_with_ntks_base_at_factor_m(m):
    """dynamic NTK sets its factor from the length it reads; given the multiplier as its factor as well, a 16x window
    was read with NTK's base at factor 241 (m^2 - m + 1), not 16."""
    from pe_geometry.model.positional import RotaryPE

    L, d_model, n_heads = 64, 64, 4
    dynamic = RotaryPE(d_model, n_heads, training_length=L, **scoring.scaling_overrides("dynamic_ntk", m))
    d = d_model // n_heads
    expected = (10000.0 * m ** (d / (d - 2))) ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # bloc97's NTK base
    torch.testing.assert_close(dynamic.frequencies(m * L), expected, rtol=1e-12, atol=0)
    ntk = RotaryPE(d_model, n_heads, training_length=L, **scoring.scaling_overrides("ntk", m))
    torch.testing.assert_close(dynamic.frequencies(m * L), ntk.frequencies(m * L), rtol=1e-12, atol=0)
    for scaling in ("linear", "ntk", "yarn"):  # the others take the multiplier as their factor
        assert scoring.scaling_overrides(scaling, m) == {"scaling": scaling, "scaling_factor": float(m)}


def test_the_perplexity_ratio_is_exp_of_the_mean_loss_difference_not_the_mean_of_exps():
    """One seed's 200x made the sinusoidal row's '84': the arithmetic mean of exp(delta) is set by the worst seed."""
    deltas = [0.1, 0.2, math.log(200.0)]
    cell = scoring.perplexity_ratio(deltas)
    assert cell["ppl_ratio"] == pytest.approx(math.exp(sum(deltas) / 3))  # 6.5, not (1.1 + 1.2 + 200) / 3 = 67
    assert cell["ppl_ratio_min"] == pytest.approx(math.exp(0.1)) and cell["ppl_ratio_max"] == pytest.approx(200.0)
    assert report.ppl_cell(cell) == "6.46 [1.11–200]"
    runs = [{"family": "x", "seed": s, "lengths": {"1": {"loss": 4.0, "rel_se": 0.01},
                                                   "2": {"loss": 4.0 + d, "rel_se": 0.01, "ratio": (4.0 + d) / 4.0,
                                                         "ratio_se": 0.001}}} for s, d in enumerate(deltas)]
    two = scoring.summarise(runs, [1, 2])["x"]["lengths"]["2"]
    assert two["ppl_ratio"] == pytest.approx(cell["ppl_ratio"]) and two["ratio_se_mean"] == pytest.approx(0.001)
    assert "[seed min–max]" in report.markdown_table(scoring.summarise(runs, [1, 2]), [1, 2]).splitlines()[0]


def _config(*overrides: str):
    from tests.conftest import compose_train_config

    return compose_train_config(["experiment=extrapolation", *overrides])


@pytest.mark.parametrize("overrides, label", [
    (["pe=sinusoidal"], "sinusoidal (raw table)"),
    (["pe=sinusoidal", "pe.scale=word_norm"], "sinusoidal (word-norm table)"),
    (["pe=sinusoidal", "embedding=scaled"], "sinusoidal (embedding x sqrt(d))"),
    (["pe=t5_bias"], "t5_bias"),
    (["pe=t5_bias", "pe.max_distance=64"], "t5_bias (max_distance 64)"),
    (["pe=cope"], "cope"),
    (["pe=cope", "pe.p_max=64"], "cope (p_max 64)"),
    (["pe=rope", "attention.window=32"], "rope (window 32)"),
    (["pe=rope", "pe.scaling=ntk", "pe.scaling_factor=4"], "rope"),  # a way to read the run, not an arm
    (["pe=forgetting", "pe.rotary=true"], "forgetting (with RoPE)"),
    (["pe=rope", "pe.rotary_fraction=0.25"], "rope (rotary_fraction 0.25)"),
])
def test_an_arm_is_named_by_what_sets_it_apart_from_the_familys_defaults(overrides, label):
    """Arms trained with another setting of the same family must not pool with it (t5_bias at max_distance 64 was
    't5_bias'), and a sinusoidal table says how it sits against the word vectors."""
    pe = overrides[0].split("=", 1)[1]
    assert arm_label(pe, _config(*overrides)) == label


def test_a_run_of_another_depth_than_the_benchmarks_is_an_arm_of_its_own():
    """A 4-layer RoPE control (issue 41's per-layer schemes train at 4 layers) must not pool with the benchmark's
    2-layer 'rope', nor get its inference-time scalings' labels."""
    assert scoring.BENCHMARK_LAYERS == 2
    assert arm_label("rope", _config("pe=rope"), layers=2) == "rope"
    assert arm_label("rope", _config("pe=rope", "model.n_layers=4"), layers=2) == "rope (4 layers)"
    assert (arm_label("rope", _config("pe=rope", "model.n_layers=4", "model.layer_pattern=[{},{},{},{pe: none}]"),
                             layers=2) == "rope (layers [=; =; =; none])")  # an entry per layer: the depth is said
    assert (arm_label("rope", _config("pe=rope", "model.n_layers=4", "model.layer_pattern=[{},{pe: none}]"),
                             layers=2) == "rope (4 layers, layers [=; none])")  # cycled: the depth is not
    assert arm_label("rope", _config("pe=rope", "model.n_layers=4")) == "rope"  # no benchmark depth: not named


def test_kept_entries_are_renamed_replaced_where_rescored_and_refused_from_another_protocol(tmp_path):
    import json

    protocol = {"objective": "next-token", "target_len": 64, "n_windows": 138, "window_stride": 1025}
    runs = [protocol | {"family": f, "run": f"old/{f}", "seed": 0, "lengths": {}} for f in ("cope", "rope", "alibi")]
    earlier = tmp_path / "extrapolation.json"
    earlier.write_text(json.dumps({"multipliers": [1, 2], "runs": runs}))
    kept = scoring.kept_entries(earlier, {"cope": "cope (p_max 64)"}, {"rope"}, protocol, [1, 2])
    assert [r["family"] for r in kept] == ["cope (p_max 64)", "alibi"]
    with pytest.raises(SystemExit, match="scored by another protocol .n_windows 138 vs 10"):
        scoring.kept_entries(earlier, {}, set(), protocol | {"n_windows": 10}, [1, 2])
    with pytest.raises(SystemExit, match="--relabel sine=...: no such family"):
        scoring.kept_entries(earlier, {"sine": "x"}, set(), protocol, [1, 2])


def test_the_attention_table_has_a_column_per_layer_of_the_deepest_arm():
    """A 4-layer arm beside 2-layer ones: the header has four distance columns and a 2-layer row fills its last two
    with '–' (every row as wide as the header: the table once broke when the deepest arm was not first)."""

    def family(layers: int) -> dict:
        d = [{"mean": 0.5, "sd": 0.1}] * layers
        return {"attention": {"positional_share": {"mean": 0.4, "sd": 0.1}, "distance_ratio": d, "most_local_ratio": d},
                "lengths": {"1": {"loss_mean": 4.0}, "2": {"ratio_mean": 1.0, "ratio_sd": 0.0}}}

    table = report.attention_table({"a": family(2), "b": family(4)}, 2).splitlines()
    widths = {line.count("|") for line in table}
    assert len(widths) == 1 and "block 3" in table[0]
    assert [line for line in table if line.startswith("| a |")][0].endswith("– | – | 1.000 ± 0.000 |")


def test_a_killed_run_beside_finished_ones_is_refused_unless_included(tmp_path, capsys):
    """Before: a run killed at step 10 was scored beside finished runs without a word (pe-report flagged it)."""
    for name, step in (("finished", 10), ("killed", 4), ("stopped_early", 6)):
        (tmp_path / name / "checkpoints").mkdir(parents=True)
        callbacks = {"EarlyStop{'monitor': 'val/loss'}": {"wait_count": 3, "patience": 3}} if name == "stopped_early" else {}
        torch.save({"global_step": step, "run_config": {"trainer": {"max_steps": 10}}, "callbacks": callbacks},
                   tmp_path / name / "checkpoints" / "last.ckpt")
    with pytest.raises(SystemExit, match=r"error: 1 run\(s\) did not reach their trainer.max_steps .*killed; continue"):
        run_dirs([tmp_path])
    assert run_dirs([tmp_path], include_unfinished=True) == [tmp_path / n for n in ("finished", "killed", "stopped_early")]
    assert f"{tmp_path / 'killed'}: unfinished" in capsys.readouterr().out
    assert run_dirs([tmp_path / "finished", tmp_path / "stopped_early"]) == [tmp_path / "finished", tmp_path / "stopped_early"]
