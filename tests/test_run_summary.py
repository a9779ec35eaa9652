"""The end of a run: the summary lines callbacks contribute, the next commands, and the W&B charts (no training)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pe_geometry.analysis.geometry_callback import GeometryCallback
from pe_geometry.training.summary import run_summary
from pe_geometry.training.wandb_run import LineChart, Table


def geometry_callback(records: dict[int, dict[str, float]]) -> GeometryCallback:
    callback = GeometryCallback()
    callback.records = records
    return callback


RECORDS = {0: {"geometry/overlap_k8": 0.31, "geometry/overlap_k8_chance": 0.25},
           40: {"geometry/overlap_k8": 0.12, "geometry/overlap_k8_chance": 0.25}}


def run_with_csv_log(tmp_path: Path) -> Path:
    (tmp_path / "csv").mkdir()
    (tmp_path / "csv" / "metrics.csv").write_text("step\n")
    return tmp_path


def test_summary_names_loss_geometry_against_chance_and_the_next_commands(tmp_path):
    run = run_with_csv_log(tmp_path)
    records = {step: dict(metrics) for step, metrics in RECORDS.items()}
    text = run_summary({"val/loss": math.log(100.0)}, [geometry_callback(records)], run, [[run / "wandb" / "offline-run-x"]])
    assert "final val/loss 4.6052  (perplexity 100.0)" in text
    (line,) = [line for line in text.splitlines() if "overlap_k8" in line]
    assert line.startswith("  geometry/overlap_k8 ") and line.endswith("step 0: 0.3100   step 40: 0.1200   chance 0.2500")
    assert f"report:     pe-report {run}" in text and f"wandb sync {run}/wandb/offline-run-x" in text
    records[40].update({"geometry/overlap_k8_null_mean": 0.25, "geometry/overlap_k8_null_std": 0.04, "geometry/overlap_k8_p": 0.0099})
    text = run_summary({}, [geometry_callback(records)], run, [])
    assert "step 40: 0.1200   chance 0.2500   null 0.2500 ± 0.0400, p 0.010" in text  # the end value against its null


def test_an_online_wandb_run_gets_no_sync_line(tmp_path):
    """An online run has no offline folder: its empty list once printed a bare "wandb sync" with nothing to upload."""
    online = run_summary({}, [], tmp_path, [[]])
    assert "wandb sync" not in online
    segments = [tmp_path / "wandb" / "offline-run-a", tmp_path / "wandb" / "offline-run-b"]  # a resumed offline run
    both = run_summary({}, [], tmp_path, [[], segments])
    assert [line for line in both.splitlines() if "wandb sync" in line] == [
        f"  W&B upload: wandb sync {segments[0]} {segments[1]}"]


def test_only_callbacks_that_offer_lines_add_to_the_summary(tmp_path):
    class Talks:
        def summary_lines(self) -> list[str]:
            return ["first line", "second line"]

    class Silent:
        records = RECORDS  # looks like a geometry callback, but offers nothing

    text = run_summary({}, [Silent(), Talks(), geometry_callback({})], tmp_path, [])
    lines = text.splitlines()
    assert lines[1:3] == ["  first line", "  second line"]
    assert "geometry/" not in text  # a geometry callback without records has nothing to say
    assert "pe-report" not in text  # no CSV log: nothing for the report to read


def test_wandb_summary_charts_each_headline_figure_and_the_angle_table():
    records = {
        0: {"geometry/overlap_k8": 0.31, "geometry/overlap_k8_chance": 0.25, "geometry/cos_mean": 0.02,
            "geometry/cos_mean_chance": 0.0, "geometry/cos_mean_random": 0.001},
        5: {"geometry/overlap_k8": 0.2},  # a record without the chance: not a point of the chart
        40: {"geometry/overlap_k8": 0.12, "geometry/overlap_k8_chance": 0.25, "geometry/cos_mean": -0.01,
             "geometry/cos_mean_chance": 0.0, "geometry/cos_mean_random": 0.002},
    }
    charts = geometry_callback(records).wandb_summary()
    assert set(charts) == {"charts/overlap_k8_vs_chance", "tables/angle_table"}
    chart = charts["charts/overlap_k8_vs_chance"]
    assert isinstance(chart, LineChart)
    assert chart.xs == [0, 40] and chart.ys == [[0.31, 0.12], [0.25, 0.25]]
    assert chart.keys == ["geometry/overlap_k8", "geometry/overlap_k8_chance"]
    table = charts["tables/angle_table"]
    assert isinstance(table, Table)
    assert table.columns == ["measure", "init (step 0)", "end (step 40)", "chance", "random matrices"]
    assert table.rows == [["cos_mean", 0.02, -0.01, 0.0, 0.002]]
    assert geometry_callback({}).wandb_summary() == {}


@pytest.mark.parametrize("records", [{}, {0: {"geometry/hidden/layer0/position_var_share": 0.1}}])
def test_no_headline_figures_no_geometry_lines(records):
    """RoPE, ALiBi and no PE log hidden-state geometry only: the summary then has no headline line to print."""
    assert geometry_callback(records).summary_lines() == []


def test_a_rope_run_ends_with_its_probe_and_block_0_attention_beside_their_baselines():
    """RoPE and ALiBi add no input table: their summary once had no geometry at all, although the probe and block 0's
    attention were logged. Now: the probe at the last block's input (2 blocks: states 0, 1, 2 -> block 1's input) and
    block 0's positional share and distance, averaged over heads, each beside its null or chance."""
    def step(r2: dict[int, float], share: tuple[float, float], distance: tuple[float, float]) -> dict[str, float]:
        record = {f"geometry/hidden/layer{i}/position_r2": v for i, v in r2.items()}
        for h in (0, 1):
            record[f"geometry/attn/head{h}/positional_share"] = share[h]
            record[f"geometry/attn/head{h}/positional_share_null_mean"] = 0.1 * (h + 1)
            record[f"geometry/attn/head{h}/mean_distance"] = distance[h]
            record[f"geometry/attn/head{h}/mean_distance_chance"] = 10.0
        return record

    records = {0: step({0: 0.0, 1: 0.05, 2: 0.01}, (0.2, 0.4), (10.0, 12.0)),
               100: step({0: 0.0, 1: 0.5, 2: 0.9}, (0.6, 0.8), (3.0, 5.0)),
               50: {"geometry/attn/head0/positional_share": 0.0}}  # a record without the probe does not count as its end
    records[100].update({"geometry/hidden/layer1/position_r2_null_mean": -0.01, "geometry/hidden/layer1/position_r2_p": 0.0476})
    lines = geometry_callback(records).summary_lines()
    # p 1/21 is the floor of the 20 shifts: said as a floor, not read as a test's p (issue 50)
    assert lines[0].split() == ["position", "probe", "R²", "(block", "1", "input)", "step", "0:", "0.0500", "step", "100:",
                                "0.5000", "null", "-0.0100,", "p", "at", "its", "floor", "0.048", "(20", "shifts;", "read", "z)"]
    records[100].update({"geometry/hidden/layer1/position_r2_p": 0.2, "geometry/hidden/layer1/position_r2_z": 1.3})
    assert geometry_callback(records).summary_lines()[0].endswith("null -0.0100, p 0.200, z 1")
    assert lines[1].startswith("block 0 positional share (2 heads)") and lines[1].split()[-6:] == [
        "0.3000", "step", "100:", "0.7000", "null", "0.1500"]
    assert lines[2].startswith("block 0 mean distance (2 heads)") and lines[2].split()[-6:] == [
        "11.0000", "step", "100:", "4.0000", "uniform", "10.0000"]


def test_lightning_lines_print_once_where_the_root_logger_prints_them(monkeypatch):
    """Lightning's package logger has its own stderr handler and propagates to the root's (Hydra's console and
    train.log): "GPU available: False" came twice. With root handlers, Lightning's own goes; without, it stays."""
    import logging

    from pe_geometry.training.pipeline import one_line_per_lightning_record

    lightning_log, root = logging.getLogger("lightning"), logging.getLogger()
    own = logging.StreamHandler()
    monkeypatch.setattr(lightning_log, "handlers", [own])
    monkeypatch.setattr(root, "handlers", [])
    one_line_per_lightning_record()
    assert lightning_log.handlers == [own]  # nothing else would print Lightning's lines
    monkeypatch.setattr(root, "handlers", [logging.StreamHandler()])
    one_line_per_lightning_record()
    assert lightning_log.handlers == []


def test_a_task_run_says_its_answer_accuracy_and_a_text_run_does_not(tmp_path):
    run = run_with_csv_log(tmp_path)
    metrics = {"val/loss": 0.5, "val/answer_accuracy": 0.8125, "val/answer_exact_match": 0.25}
    text = run_summary(metrics, [], run, [])
    assert ("  final answer accuracy 0.812 of answer tokens, exact match 0.250 of examples (sizes as data.sizes draws them; "
            "pe-bench tasks scores full-size ones)") in text.splitlines()
    assert "answer accuracy" not in run_summary({"val/loss": 0.5}, [], run, [])
