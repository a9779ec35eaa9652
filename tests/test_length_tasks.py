"""pe-bench tasks (pe_geometry/benchmarks/length_tasks*.py): the quick length-tasks sweep (experiment=length_tasks_quick)
trained and read at 1x/2x/4x, its table's shape, every accuracy and interval in [0, 1], the chance line where
window_chance puts it; the contrasts and the analysis plan (benchmarks/task_contrasts.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pe_geometry.benchmarks import length_tasks_scoring as scoring
from pe_geometry.benchmarks import task_contrasts
from pe_geometry.benchmarks.length_tasks import WRITTEN, read_payload, rebuilt_markdown, write_payload
from pe_geometry.benchmarks.length_tasks_report import FULL_SIZE_NOTE
from pe_geometry.cli.bench import main as bench
from pe_geometry.data.task_datamodule import batch_seed
from pe_geometry.data.tasks import window_chance
from tests import forkserver
from tests.conftest import ROOT, compose_train_config


def test_the_evaluation_examples_depend_on_the_seed_task_and_length_alone():
    settings = {"task": "copy", "seq_len": 16, "passkey_digits": 5, "key_len": 2}
    a, b = scoring.examples(settings, 2, 8, seed=0), scoring.examples(settings, 2, 8, seed=0)
    assert torch.equal(a.blocks, b.blocks) and a.blocks.shape == (8, 33)
    assert not torch.equal(scoring.examples(settings, 2, 8, seed=1).blocks, a.blocks)
    seeds = {scoring.eval_seed(0, task, m, 64) for task in ("copy", "passkey") for m in (1, 2, 4)}
    assert len(seeds) == 6  # a stream of its own per task and length
    assert not seeds & {batch_seed(0, split, i) for split in ("train", "validation") for i in range(100)}


def test_the_bootstrap_interval_holds_the_rate_and_is_paired_across_runs():
    scores = {"exact_match": np.array([1.0, 0.0, 1.0, 1.0]), "correct": np.array([3.0, 1.0, 3.0, 3.0]),
              "n_answer": np.array([3.0, 3.0, 3.0, 3.0])}
    point = scoring.rates(scores)
    assert point == {"exact_match": 0.75, "token_accuracy": 10 / 12}
    greedy = scoring.rates({**scores, "greedy_exact_match": np.array([0.0, 0.0, 1.0, 1.0]),
                           "greedy_first_token": np.array([1.0, 0.0, 1.0, 1.0])})
    assert greedy["greedy_exact_match"] == 0.5 and greedy["greedy_first_token"] == 0.75
    # past the window: exact match of the beyond examples alone (two of them, one right); none beyond: undefined
    past = scoring.rates({**scores, "greedy_exact_match": np.array([0.0, 1.0, 1.0, 1.0]), "beyond": np.array([1, 1, 0, 0])})
    assert past["greedy_exact_match_beyond_L"] == 0.5
    assert scoring.rates({**scores, "greedy_exact_match": np.ones(4), "beyond": np.zeros(4)})["greedy_exact_match_beyond_L"] is None
    boot = scoring.rates(scores, scoring.resamples(4, 500, seed=0))
    for metric in ("exact_match", "token_accuracy"):  # teacher-forced scores only (older results): no greedy keys
        low, high = scoring.interval(boot[metric])
        assert 0.0 <= low <= point[metric] <= high <= 1.0
    assert np.array_equal(scoring.resamples(4, 5, seed=3), scoring.resamples(4, 5, seed=3))


def test_the_sweep_configs_compose(tmp_path):
    full = compose_train_config(["experiment=length_tasks"], tmp_path)
    assert str(full.data._target_).endswith("TaskDataModule") and full.callbacks.geometry is None
    quick = compose_train_config(["experiment=length_tasks_quick"], tmp_path)
    assert (quick.data.seq_len, quick.trainer.max_steps, quick.model.d_model) == (16, 150, 32)


@pytest.mark.slow  # trains two runs in a subprocess (a Hydra multirun), ~1 min on an idle 2-vCPU VM
def test_the_quick_sweep_is_trained_and_read_at_1x_2x_4x(tmp_path, capsys, monkeypatch):
    sweep = tmp_path / "sweep"
    result = forkserver.run(
        [sys.executable, str(ROOT / "train.py"), "-m", "experiment=length_tasks_quick", "logger=csv",
         f"hydra.sweep.dir={sweep}"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    payload = bench(["tasks", str(sweep), "--out", str(out), "--quick", "--contrast", "rope", "none"])

    assert payload["multipliers"] == [1, 2, 4]
    (contrast,) = payload["contrasts"]  # one seed each: the only split is the observed one
    assert (contrast["task"], contrast["seeds"], contrast["p"]) == ("copy", [1, 1], 1.0)
    assert "## Contrasts" in (out / "length_tasks.md").read_text()
    assert set(payload["summary"]) == {"copy"} and set(payload["summary"]["copy"]) == {"rope", "none"}
    assert len(payload["runs"]) == 2 and {r["seq_len"] for r in payload["runs"]} == {16}
    for run in payload["runs"]:
        for m in ("1", "2", "4"):
            cell = run["lengths"][m]
            assert cell["seq_len"] == 16 * int(m) and cell["examples"] == 128
            for metric in scoring.METRICS:
                low, high = cell[f"{metric}_ci"]
                if metric == "greedy_exact_match_beyond_L" and m == "1":  # nothing lies past L at L
                    assert cell[metric] is None and cell["examples_beyond_L"] == 0
                    continue
                assert 0.0 <= low <= cell[metric] <= high <= 1.0
            assert m == "1" or cell["examples_beyond_L"] > 0
    for family in payload["summary"]["copy"].values():
        assert family["seeds"] == [0] and sorted(family["lengths"]) == ["1", "2", "4"]
        assert all(0.0 <= c[metric] <= 1.0 for m, c in family["lengths"].items() for metric in scoring.METRICS
                   if not (m == "1" and metric == "greedy_exact_match_beyond_L"))

    # per example: the answer the model wrote by greedy decoding, so any reading can be recomputed
    cell = payload["runs"][0]["lengths"]["1"]
    assert len(cell["written"]) == cell["examples"] and len(cell["per_example"]["greedy_exact_match"]) == cell["examples"]
    assert cell["greedy_exact_match"] == np.mean(cell["per_example"]["greedy_exact_match"])

    # the chance line is window_chance at the training length on the very examples scored
    settings = {"task": "copy", "seq_len": 16, "passkey_digits": 5, "key_len": 2}
    for m in (1, 2, 4):
        token, exact = window_chance(scoring.examples(settings, m, 128, seed=0), 16)
        line = payload["chance"]["copy"]["16"][str(m)]["window"]
        assert (line["token_accuracy"], line["exact_match"]) == (token, exact)
    assert payload["chance"]["copy"]["16"]["1"]["window"]["token_accuracy"] == 1.0  # every source within L at 1x
    assert payload["chance"]["copy"]["16"]["2"]["uniform"]["token_accuracy"] == pytest.approx(1 / 26)

    # the table: per metric, a header, its rule, one row per family and two chance rows, a column per length
    md = (out / "length_tasks.md").read_text()
    for name in ("exact match, greedy decoding (the headline)", "first answer token, greedy decoding (a passkey's retrieval)",
                 "exact match, teacher-forced", "token accuracy, teacher-forced"):
        block = md.split(f"**copy, {name}**\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
        assert block[0] == "| family | 1x | 2x | 4x |" and len(block) == 2 + 2 + 2
        assert {row.split(" | ")[0] for row in block[2:4]} == {"| rope", "| none"}
        assert all(row.count("|") == 5 for row in block)
        assert block[-2].startswith("| a perfect model that sees only its last L = 16 tokens |")
    # at a glance: a row per family and the two chance rows, a column per task (token accuracy at 1x / 2x / 4x)
    glance = md.split("## At a glance\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert glance[0] == "| family | copy: token accuracy 1x / 2x / 4x (exact at 1x) |" and len(glance) == 2 + 2 + 2
    assert glance[-2].startswith("| chance: sees only its training length | 1.00 / ")

    # beside the accuracy, where each family puts position on the task's own examples at 1x: NoPE has no positional
    # share (exactly 0: nothing in its scores depends on position), RoPE a rotation null; a distance per layer
    for run in payload["runs"]:
        attention = run["attention"]
        assert len(attention["mean_distance"]) == 2 and len(attention["positional_share"]) == 4
        assert ("null_mean" in attention) == (run["family"] == "rope")
    assert payload["summary"]["copy"]["none"]["attention"]["positional_share"]["mean"] == pytest.approx(0.0, abs=1e-6)
    beside = md.split("**copy: accuracy beside where the family puts position**\n\n", 1)[1].splitlines()
    assert beside[0].startswith("| family | token acc. 1x | token acc. 2x | token acc. 4x | exact 1x | "
                                "block-0 positional share (null) | ")
    assert beside[0].count("distance / uniform, layer") == 2
    assert {beside[2].split(" | ")[0], beside[3].split(" | ")[0]} == {"| rope", "| none"}
    # the written answers in their compressed sidecar, put back by read_payload: the files hold what the call returned
    assert "written" not in (out / "length_tasks.json").read_text()
    assert read_payload(out) == json.loads(json.dumps(payload))

    # --cache: a second scoring of the same runs reads every run's scores back instead of scoring it again
    cache = tmp_path / "cache"
    first = bench(["tasks", str(sweep), "--out", str(tmp_path / "out1"), "--quick", "--cache", str(cache)])
    assert len(list(cache.glob("*.json"))) == 2

    def not_again(*args, **kwargs):
        raise AssertionError("a cached run was scored again")

    monkeypatch.setattr(scoring, "score_run", not_again)
    again = bench(["tasks", str(sweep), "--out", str(tmp_path / "out2"), "--quick", "--cache", str(cache)])
    assert again["summary"] == first["summary"] == payload["summary"] and again["chance"] == payload["chance"]
    assert (out / "length_tasks.png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "wrote" in printed
    # a first reader compared 0.000 here with the 0.156 training logged: both the tables printed and the report say why
    assert f"{FULL_SIZE_NOTE}\n\n**copy, exact match, greedy decoding (the headline)**" in printed
    assert FULL_SIZE_NOTE in md and "`data.sizes=up_to`" in FULL_SIZE_NOTE


def test_the_families_whose_seeds_disagree_are_named_for_two_more_seeds():

    def cell(low, high, seeds=3):
        return {"seeds": seeds, "exact_match_min": low, "exact_match_max": high, "token_accuracy_min": low,
                "token_accuracy_max": high}

    summary = {"copy": {"rope": {"lengths": {"1": cell(0.0, 0.9)}}, "none": {"lengths": {"1": cell(0.1, 0.2)}},
                        "alibi": {"lengths": {"1": cell(0.0, 0.9, seeds=5)}}},
               "passkey": {"learned": {"lengths": {"1": {"na": "past the table"}}}}}
    assert scoring.disagreeing(summary, [1, 2]) == {"copy": ["rope"]}  # 5 seeds already: not due again


def test_an_arm_is_named_against_the_suites_depth_for_its_task(tmp_path):
    """Associative recall is trained at 4 layers and the other tasks at 2: a 4-layer copy run (the per-layer schemes'
    RoPE control) is 'rope (4 layers)', never pooled with the suite's 'rope', and a 4-layer recall run is 'rope'."""
    deep = compose_train_config(["experiment=length_tasks", "pe=rope", "model.n_layers=4"], tmp_path)
    shallow = compose_train_config(["experiment=length_tasks", "pe=rope"], tmp_path)
    assert scoring.task_arm("rope", deep, "copy") == "rope (4 layers)"
    assert scoring.task_arm("rope", deep, "associative_recall") == "rope"
    assert scoring.task_arm("rope", shallow, "passkey") == "rope"
    assert scoring.task_arm("rope", shallow, "associative_recall") == "rope (2 layers)"


def test_a_contrast_is_an_exact_permutation_test_over_seeds_with_holm():
    # 3 v 3, fully separated: 2 of the 20 splits are as extreme (this one and its mirror)
    c = task_contrasts.seed_contrast([0.6, 0.7, 0.8], [0.1, 0.2, 0.3])
    assert c["difference"] == pytest.approx(0.5) and c["p"] == pytest.approx(2 / 20) and c["seeds"] == [3, 3]
    assert task_contrasts.seed_contrast([0.1, 0.2, 0.3], [0.1, 0.2, 0.3])["p"] == 1.0  # the same values: every split as extreme
    five = task_contrasts.seed_contrast([0.6, 0.7, 0.8, 0.9, 1.0], [0.1, 0.2, 0.3, 0.4, 0.5])
    assert five["p"] == pytest.approx(2 / 252)

    def run(task, family, seed, acc):
        return {"task": task, "family": family, "seed": seed, "lengths": {"4": {"token_accuracy": acc}}}

    runs = ([run("passkey", "a", s, 0.6 + 0.1 * s) for s in range(3)] + [run("passkey", "b", s, 0.1 * s) for s in range(3)]
            + [run("copy", "a", s, 0.5) for s in range(3)])  # copy has no 'b': not tested there
    rows = task_contrasts.contrasts(runs, [("a", "b")], 4)
    assert [(r["task"], r["arm"], r["control"]) for r in rows] == [("passkey", "a", "b")]
    assert rows[0]["p_holm"] == pytest.approx(rows[0]["p"]) and rows[0]["arm_mean"] == pytest.approx(0.7)
    assert [r["task"] for r in task_contrasts.contrasts(runs + [run("copy", "b", 0, 0.1)], [("a", "b")], 4)] == ["copy", "passkey"]
    assert [r["task"] for r in task_contrasts.contrasts(runs + [run("copy", "b", 0, 0.1)], [("a", "b")], 4, ["copy"])] == ["copy"]
    with pytest.raises(SystemExit, match="no task has both arms"):
        task_contrasts.contrasts(runs, [("a", "c")], 4)


def test_the_confirmatory_plan_names_the_arms_as_the_runs_will_be_named(tmp_path):
    """Each arm of experiments/plans/passkey_confirmatory.yaml, composed as its sweep composes it, carries the plan's
    label, so pe-bench tasks finds every pair; its seeds were never used by a committed run (0-4)."""
    plan = task_contrasts.read_plan(ROOT / "experiments" / "plans" / "passkey_confirmatory.yaml")
    assert plan["metric"] == "greedy_exact_match" and plan["multiplier"] == 4 and plan["alpha"] == 0.05
    assert not set(plan["seeds"]) & set(range(5)) and len(plan["seeds"]) == 5
    for name, arm in plan["arms"].items():
        pe = next(o.split("=", 1)[1] for o in arm["overrides"] if o.startswith("pe="))
        cfg = compose_train_config(["experiment=length_tasks", "data.task=passkey",
                                    f"data.passkey_decoys={plan['passkey_decoys']}", *arm["overrides"]], tmp_path)
        assert scoring.task_arm(pe, cfg, "passkey") == arm["label"], name
    assert all(a in plan["arms"] and c in plan["arms"] for a, c in plan["pairs"])


def test_the_plan_was_committed_before_its_results():
    import subprocess

    def first(path: str) -> int | None:
        out = subprocess.run(["git", "log", "--format=%ct", "--reverse", "--", path], cwd=ROOT, capture_output=True, text=True)
        return int(out.stdout.split()[0]) if out.returncode == 0 and out.stdout.split() else None

    plan = first("experiments/plans/passkey_confirmatory.yaml")
    if plan is None:
        pytest.skip("not a git checkout (or the plan is not committed yet)")
    results = first("experiments/results/passkey_confirmatory")
    assert results is None or plan < results


def test_a_planned_contrast_reads_its_metric_at_its_seeds_only(tmp_path):

    def run(family, seed, value, token=0.5):
        return {"task": "passkey", "family": family, "seed": seed,
                "lengths": {"4": {"greedy_exact_match": value, "token_accuracy": token}}}

    runs = ([run("a", s, 0.5 + 0.01 * s) for s in range(20, 25)] + [run("b", s, 0.1) for s in range(20, 25)]
            + [run("a", 0, 0.0), run("b", 0, 0.9)])  # an old seed: left out
    rows = task_contrasts.contrasts(runs, [("a", "b")], 4, ["passkey"], "greedy_exact_match", list(range(20, 25)))
    assert rows[0]["seeds"] == [5, 5] and rows[0]["arm_mean"] == pytest.approx(0.72) and rows[0]["p"] == pytest.approx(2 / 252)
    assert rows[0]["metric"] == "greedy_exact_match" and rows[0]["p_floor"] == pytest.approx(2 / 252)
    assert task_contrasts.seed_contrast([1, 2, 3], [4, 5, 6, 7, 8])["p_floor"] == pytest.approx(2 / 56)  # 3 v 5: 0.036
    bad = tmp_path / "plan.yaml"
    bad.write_text("seeds: [1]\n")
    with pytest.raises(SystemExit, match=r"lacks \['task', 'metric'"):
        task_contrasts.read_plan(bad)


def test_a_plan_that_cannot_reject_says_so():
    """Holm over m tests from an exact test with floor f cannot go below m f: the committed plan's 8 tests from 5 v 5
    seeds floor at 8 x 2/252 = 0.063 > 0.05, which its report must say; 3 tests would have reached 0.024."""
    plan = task_contrasts.read_plan(ROOT / "experiments" / "plans" / "passkey_confirmatory.yaml")
    assert task_contrasts.smallest_holm_p(plan) == pytest.approx(8 * 2 / 252)
    text = task_contrasts.contrast_preamble([], Path("p.yaml"), None, plan)
    assert "**This plan could not reject any test**" in text and "0.0635" in text
    three = {**plan, "pairs": plan["pairs"][:3]}
    assert task_contrasts.smallest_holm_p(three) == pytest.approx(3 * 2 / 252) and task_contrasts.smallest_holm_p(three) < three["alpha"]
    assert "could not reject" not in task_contrasts.contrast_preamble([], Path("p.yaml"), None, three)


def test_the_written_answers_go_to_a_sidecar_and_come_back_unchanged(tmp_path):
    """length_tasks.json held every written token id as an indented line (10-12 MB committed): now a compressed
    sidecar, the same bytes for the same answers, read back into the cells they came from."""
    cell = {"examples": 2, "exact_match": 0.5, "written": [[3, 4, 5], [6]]}
    payload = {"summary": {}, "runs": [{"run": "s/a", "lengths": {"1": dict(cell), "2": {"na": True}}},
                                       {"run": "s/b", "lengths": {"1": cell | {"written": [[7], [8, 9]]}}}]}
    kept = json.loads(json.dumps(payload))
    write_payload(tmp_path, payload)
    assert payload == kept  # the caller's payload keeps its answers
    assert "written" not in (tmp_path / "length_tasks.json").read_text()
    assert read_payload(tmp_path) == kept
    first = (tmp_path / WRITTEN).read_bytes()
    write_payload(tmp_path, payload)
    assert (tmp_path / WRITTEN).read_bytes() == first
    payload["runs"].reverse()  # a sidecar of another call (its runs in another order) is refused, not misassigned
    (tmp_path / "length_tasks.json").write_text(json.dumps(payload))
    with pytest.raises(SystemExit, match="names other runs than"):
        read_payload(tmp_path)


@pytest.mark.parametrize("folder", ["length_tasks_decoys", "passkey_confirmatory"])
def test_the_committed_results_hold_every_written_answer_and_rebuild_their_report(folder, monkeypatch):
    """The two committed suites whose answers moved to the sidecar: every cell scored has one answer per example, and
    the report rebuilt from the files is the committed one, byte for byte."""
    results = ROOT / "experiments" / "results" / folder
    monkeypatch.chdir(ROOT)  # the plan's path in the contrasts is relative to the repository's root
    payload = read_payload(results)
    cells = [c for r in payload["runs"] for c in r["lengths"].values() if "na" not in c]
    assert cells and all(len(c["written"]) == c["examples"] == len(c["per_example"]["greedy_exact_match"]) for c in cells)
    assert all(np.mean(c["per_example"]["greedy_exact_match"]) == c["greedy_exact_match"] for c in cells)
    assert rebuilt_markdown(results, payload) == (results / "length_tasks.md").read_text()
