"""Issue 51's scoring (analysis/study/training_length.py): the plan is what pe-bench training-length reads, planted answers read as
planted, the tests by hand, and a test whose runs are missing is reported as not run."""

from __future__ import annotations

import math
import subprocess

import pytest
import torch

from pe_geometry.analysis.study.training_length import null_figures, planned_tests, slope_per_seed
from pe_geometry.benchmarks import training_length as driver
from pe_geometry.cli.bench import main as bench
from tests.conftest import ROOT

PLAN = ROOT / "experiments" / "plans" / "training_length.yaml"


def test_the_plan_is_read_by_the_script_and_its_units_follow_its_run_order():
    plan = driver.read_plan(PLAN)
    assert plan["figure"] == "overlap_k8" and plan["alpha"] == 0.05 and plan["correction"] == "holm"
    units = driver.units(plan)
    assert units[0] == (2, "learned", 0) and len(units) == sum(len(b["arms"]) for b in plan["run_order"]) * len(plan["seeds"])
    assert [driver.decay_start(n, plan) for n in plan["lengths"]] == [1200, 2400, 4800]  # on the checkpoint cadence (200)
    assert {t["id"] for t in plan["tests"]} == {f"T{i}" for i in range(1, 13)}


def test_the_plan_was_committed_before_any_result():
    """git log: the plan's first commit precedes every commit of the results folder."""
    def first(path: str) -> int | None:
        out = subprocess.run(["git", "log", "--format=%ct", "--reverse", "--", path], cwd=ROOT, capture_output=True, text=True)
        stamps = out.stdout.split()
        return int(stamps[0]) if out.returncode == 0 and stamps else None

    plan = first("experiments/plans/training_length.yaml")
    results = first("experiments/results/training_length")
    if plan is None:
        pytest.skip("not a git checkout")
    assert results is None or plan < results


def test_a_table_built_inside_E_top_k_reads_as_overlapping_and_a_random_one_at_the_null():
    g = torch.Generator().manual_seed(0)
    E = torch.randn(300, 32, generator=g) * torch.linspace(3, 0.3, 32)
    _, _, Vh = torch.linalg.svd(E - E.mean(0), full_matrices=False)
    inside = torch.randn(64, 8, generator=g) @ Vh[:8]  # rows in E's top-8 principal subspace
    planted = null_figures(E, inside, draws=200)
    assert planted["overlap_k8"] == pytest.approx(1.0) and planted["overlap_k8_ratio"] == pytest.approx(32 / 8)  # the most it can be
    assert planted["overlap_k8_p"] < 0.01
    random = null_figures(E, torch.randn(64, 32, generator=g), draws=200)
    assert 0.5 < random["overlap_k8_ratio"] < 1.6


def test_slope_per_seed_by_hand():
    # seed 0 halves r per doubling of steps: slope ln(1/2); seed 1 flat
    slopes = slope_per_seed({1400: [1.0, 0.7], 2800: [0.5, 0.7], 5600: [0.25, 0.7]})
    assert slopes == pytest.approx([math.log(0.5), 0.0], abs=1e-12)


def _cells(plan, ratio_of):
    cells = {}
    for depth in plan["depths"]:
        for arm in plan["arms"]:
            for s in plan["seeds"]:
                for n in plan["lengths"]:
                    r = ratio_of(depth, arm, s, n)
                    if r is not None:
                        cells[(depth, arm, s, n)] = {"figures": {"overlap_k8_ratio": r}}
    return cells


def test_planned_tests_read_a_planted_fall_and_say_what_did_not_run():
    plan = driver.read_plan(PLAN)
    noise = {0: 1.0, 1: 1.03, 2: 0.97}

    def ratio(depth, arm, seed, n):
        if depth == 4 and arm != "learned":
            return None  # cut by the budget
        if arm == "learned":
            return 0.9 * (1400 / n) ** 0.5 * noise[seed]  # falls: slope -0.5 ln 2 per doubling
        wobble = {(0, 1400): 1.02, (0, 2800): 0.97, (0, 5600): 1.01, (1, 1400): 0.98, (1, 2800): 1.03, (1, 5600): 0.99,
                  (2, 1400): 1.0, (2, 2800): 0.99, (2, 5600): 1.02}
        return noise[seed] * wobble[(seed, n)]  # flat, up to noise
    tests = {t["id"]: t for t in planned_tests(plan, _cells(plan, ratio), {}, {}, {})}
    assert tests["T1"]["ran"] and tests["T1"]["mean"] == pytest.approx(-0.5 * math.log(2), abs=1e-9)
    assert tests["T1"]["reading"] == "falls with training (separation grows)"
    assert tests["T3"]["reading"] == "no change with training length shown (Holm)"
    assert not tests["T8"]["ran"] and tests["T8"]["reading"].startswith("not run")  # no phantom reads given
    assert not tests["T12"]["ran"]
    ran = [t for t in tests.values() if t["ran"]]
    ps = sorted(t["p"] for t in ran)
    # Holm over the plan's whole family: the tests that did not run count as p = 1, never a smaller family
    assert min(t["holm_p"] for t in ran) == pytest.approx(min(1.0, ps[0] * len(plan["tests"])))
    assert tests["T6"]["difference"] == pytest.approx(0, abs=1e-12) and tests["T6"]["p"] == pytest.approx(1)  # no depth effect planted


def test_a_rotation_test_needs_every_seed_above_every_random():
    plan = driver.read_plan(PLAN)
    rotations = {(2, "learned", s, "P"): {"D": d, "above_every_random": a} for s, (d, a) in
                 enumerate([(0.2, True), (0.25, True), (0.22, False)])}
    tests = {t["id"]: t for t in planned_tests(plan, {}, {}, rotations, {})}
    assert tests["T9"]["ran"] and tests["T9"]["reading"] == "a need for the separation not shown (Holm)"


@pytest.mark.slow  # four tiny pe-train runs in subprocesses, then the scoring: ~1 min on an idle 2-vCPU VM
def test_the_experiment_trains_trunks_and_branches_and_scores_them(tmp_path, tiny_corpus, cache_dir):
    """The driver end to end on a tiny plan: a trunk of 14 steps and a branch to 7 off its step-6 checkpoint per arm;
    a second call trains nothing; the scorer reads every run (figures, phantom read, rotation test) into a report."""
    import json

    import yaml

    from tests.conftest import TINY
    from tests.test_reliability import corpus_args

    plan = yaml.safe_load(PLAN.read_text())
    plan |= {"lengths": [7, 14], "seeds": [0], "depths": [1],
             "arms": {"learned": ["control=learned_baseline"], "nope": ["pe=none"]},
             "run_order": [{"depth": 1, "arms": ["learned", "nope"]}],
             "tests": [{"id": "T1", "kind": "slope", "depth": 1, "arm": "learned"},
                       {"id": "T8", "kind": "phantom", "depth": 1, "arm": "learned"},
                       {"id": "T9", "kind": "rotation", "depth": 1, "arm": "learned", "rotate": "P"}],
             "rotation": {"k": 4, "n_random": 2, "val_batches": 1, "seed": 0}}
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(yaml.safe_dump(plan))
    tiny = [o for o in TINY if not o.startswith(("trainer.max_steps", "model.n_layers", "callbacks.checkpoint"))]
    settings = [*corpus_args(tiny_corpus), f"paths.cache_dir={cache_dir}", *tiny, "trainer.val_check_interval=7",
                "callbacks.geometry.every_n_steps=7", "optimizer.warmup_steps=1", "model.n_heads=2"]
    root = tmp_path / "runs"
    args = ["train", "--plan", str(plan_file), "--root", str(root), "--jobs", "1", "--set", *settings]
    bench(["training-length", *args])
    for arm in ("learned", "nope"):
        assert driver.finished_step(root / "L1" / f"{arm}-s0" / "trunk") == 14
        assert driver.finished_step(root / "L1" / f"{arm}-s0" / "b7") == 7
    branch = torch.load(root / "L1" / "learned-s0" / "b7" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert branch["run_config"]["optimizer"]["decay_start"] == 6 and branch["run_config"]["branch"] is True
    stamp = (root / "L1" / "learned-s0" / "trunk" / "checkpoints" / "last.ckpt").stat().st_mtime_ns
    bench(["training-length", *args])  # everything finished: nothing trains again
    assert (root / "L1" / "learned-s0" / "trunk" / "checkpoints" / "last.ckpt").stat().st_mtime_ns == stamp

    out = tmp_path / "results"
    bench(["training-length", "score", "--plan", str(plan_file), "--root", str(root), "--out", str(out)])
    results = json.loads((out / "results.json").read_text())
    tests = {t["id"]: t for t in results["planned_tests"]}
    assert not tests["T1"]["ran"]  # a slope over one seed has no t-test: reported, not dropped
    assert {(c["arm"], c["length"]) for c in results["cells"]} == {("learned", 7), ("learned", 14), ("nope", 7), ("nope", 14)}
    assert "phantom" in results["cross_reads"][0] and len(results["rotation"]) == 1
    assert "## The planned tests" in (out / "report.md").read_text() and (out / "figures.png").stat().st_size > 10_000
