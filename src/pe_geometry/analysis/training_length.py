"""Scoring issue 51's experiment from its committed plan (experiments/plans/training_length.yaml).

Layout the training step writes: ``<root>/L<depth>/<arm>-s<seed>/trunk`` (the longest length, warmup-stable-decay)
and ``.../b<length>`` (a decay branch per shorter length). Every run is read at its last step:

- ``cell_figures``: the input figures of E (the callback's word rows) and P (rows 0..seq_len-1) with their
  spectra-keeping rotation null (``rotation_null``, 2000 draws), as ratios r = value / null mean;
- ``cross_reads``: the phantom (an arm's P against the same seed's NoPE E), the swap (every arm's P against one
  common E: the learned arm's, seed 0, same depth) and the random orientation (P turned by one Haar rotation against
  its own E: reads at the null by construction, the sanity check of the other two);
- the rotation test (``analysis.rotation_test``) at the longest length;
- ``planned_tests``: the plan's tests, Holm over the family; a test whose runs did not all finish is "not run".

``score_experiment`` writes ``results.json``, ``report.md`` and ``figures.png`` into the output folder.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from pe_geometry.analysis.nulls import holm
from pe_geometry.files import atomic_write_text

DRAWS = 2000
FIGURES_FILE = "training_length_figures.json"
ROTATION_FILE = "rotation_test_{rotate}.json"


# ----------------------------------------------------------------------------- where the runs are


def run_dir(root: Path, depth: int, arm: str, seed: int, length: int, longest: int) -> Path:
    unit = Path(root) / f"L{depth}" / f"{arm}-s{seed}"
    return unit / ("trunk" if length == longest else f"b{length}")


def last_step(run: Path) -> int | None:
    last = run / "checkpoints" / "last.ckpt"
    if not last.is_file():
        return None
    import torch

    return int(torch.load(last, map_location="cpu", weights_only=False)["global_step"])


def finished(run: Path, length: int) -> bool:
    return last_step(run) == length


# ----------------------------------------------------------------------------- figures of one run


def input_rows(run: Path):
    from pe_geometry.analysis.verdict import final_input_rows

    E, P, _ = final_input_rows(run)
    return E, P


def null_figures(E, P, draws: int = DRAWS) -> dict:
    """rotation_null's figures with each figure's ratio to its null mean (``<figure>_ratio``)."""
    from pe_geometry.analysis.nulls import rotation_null

    out = rotation_null(E, P, n_draws=draws, seed=0, fixed_k=8)
    for name in ("overlap_k8", "var_share_P_in_E_k8", "abs_cos_mean"):
        out[f"{name}_ratio"] = out[name] / out[f"{name}_null_mean"]
    return out


def cell_figures(run: Path, draws: int = DRAWS) -> dict:
    """The run's input figures against the null (cached in the run folder beside its checkpoint) and its validation
    loss: at the last step and the lowest of the run's validation points (is the last the best?)."""
    cache = run / FIGURES_FILE
    ckpt = run / "checkpoints" / "last.ckpt"
    if cache.is_file() and cache.stat().st_mtime >= ckpt.stat().st_mtime:
        cached = json.loads(cache.read_text())
        if cached.get("draws") == draws:
            return cached
    from pe_geometry.analysis.runs import read_run_rows

    E, P = input_rows(run)
    result: dict = {"draws": draws, "step": last_step(run)}
    result["figures"] = None if P is None else null_figures(E, P, draws)
    val = [(int(r["step"]), float(r["val/loss"])) for r in read_run_rows(run) if r.get("val/loss") not in (None, "")]
    if val:
        result["val_loss_last"] = val[-1][1]
        result["val_loss_min"] = min(v for _, v in val)
        result["val_loss_min_step"] = min(val, key=lambda sv: sv[1])[0]
    atomic_write_text(cache, json.dumps(result, indent=1))
    return result


def cross_reads(root: Path, depth: int, arm: str, seed: int, longest: int, draws: int = DRAWS) -> dict:
    """Phantom, swap and random-orientation reads of one arm's final P (see the module docstring); {} parts when a
    run they need did not finish."""
    import torch

    from pe_geometry.analysis.rotation_test import haar_rotation

    here = run_dir(root, depth, arm, seed, longest, longest)
    out: dict = {}
    if not finished(here, longest):
        return out
    E, P = input_rows(here)
    if P is None:
        return out
    nope = run_dir(root, depth, "nope", seed, longest, longest)
    if finished(nope, longest):
        out["phantom"] = null_figures(input_rows(nope)[0], P, draws)
    common = run_dir(root, depth, "learned", 0, longest, longest)
    if finished(common, longest):
        out["swap"] = null_figures(input_rows(common)[0], P, draws)
    R = haar_rotation(P.shape[1], torch.Generator().manual_seed(1000 + seed))
    out["random_orientation"] = null_figures(E, (P.double() @ R.T).float(), draws)
    return out


# ----------------------------------------------------------------------------- tests


def slope_per_seed(ratios_by_length: dict[int, list[float]]) -> list[float]:
    """Per seed: the least-squares slope of ln r on log2(steps) (ratios_by_length: length -> one r per seed)."""
    lengths = sorted(ratios_by_length)
    x = np.log2(lengths)
    y = np.log(np.array([ratios_by_length[n] for n in lengths]))  # (lengths, seeds)
    return [float(np.polyfit(x, y[:, s], 1)[0]) for s in range(y.shape[1])]


def one_sample(values: list[float]) -> dict:
    """Two-sided one-sample t-test of the mean against 0, and whether every value has the same sign."""
    from scipy import stats

    v = np.asarray(values, dtype=float)
    t = stats.ttest_1samp(v, 0.0)
    return {"values": v.tolist(), "mean": float(v.mean()), "sd": float(v.std(ddof=1)), "t": float(t.statistic),
            "df": len(v) - 1, "p": float(t.pvalue), "same_sign": bool(np.all(v > 0) or np.all(v < 0))}


def welch(a: list[float], b: list[float]) -> dict:
    """Two-sided Welch t-test of a - b; same_sign: every a on one side of every b."""
    from scipy import stats

    a_, b_ = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    t = stats.ttest_ind(a_, b_, equal_var=False)
    return {"a": a_.tolist(), "b": b_.tolist(), "difference": float(a_.mean() - b_.mean()), "t": float(t.statistic),
            "p": float(t.pvalue), "same_sign": bool(a_.min() > b_.max() or a_.max() < b_.min())}


def planned_tests(plan: dict, cells: dict, cross: dict, rotations: dict, pretrained: dict) -> list[dict]:
    """Every test of the plan with its p, Holm over those that ran, and the reading the plan's rule gives."""
    figure, longest, seeds = plan["figure"], max(plan["lengths"]), plan["seeds"]

    def ratios(depth: int, arm: str, length: int) -> list[float] | None:
        got = [cells.get((depth, arm, s, length)) for s in seeds]
        if any(c is None or c.get("figures") is None for c in got):
            return None
        return [c["figures"][f"{figure}_ratio"] for c in got]

    out = []
    for spec in plan["tests"]:
        row: dict = {"id": spec["id"], "spec": spec}
        kind = spec["kind"]
        if kind == "slope":
            by_length = {n: ratios(spec["depth"], spec["arm"], n) for n in plan["lengths"]}
            if all(v is not None for v in by_length.values()):
                row |= {"ratios": by_length} | one_sample(slope_per_seed(by_length))
                row["question"] = f"does r change with training length ({spec['arm']}, depth {spec['depth']})?"
        elif kind == "welch":
            a, b = ratios(spec["a"]["depth"], spec["a"]["arm"], longest), ratios(spec["b"]["depth"], spec["b"]["arm"], longest)
            if a is not None and b is not None:
                row |= welch(np.log(a).tolist(), np.log(b).tolist())
                row["question"] = (f"ln r at {longest}: {spec['a']['arm']} depth {spec['a']['depth']} vs "
                                   f"{spec['b']['arm']} depth {spec['b']['depth']}")
        elif kind == "phantom":
            got = [cross.get((spec["depth"], spec["arm"], s), {}).get("phantom") for s in seeds]
            if all(g is not None for g in got):
                row |= one_sample([math.log(g[f"{figure}_ratio"]) for g in got])
                row["question"] = f"{spec['arm']}'s P against the NoPE run's E (depth {spec['depth']}): ln r vs 0"
        elif kind == "rotation":
            got = [rotations.get((spec["depth"], spec["arm"], s, spec["rotate"])) for s in seeds]
            if all(g is not None for g in got):
                row |= one_sample([g["D"] for g in got])
                row["above_every_random"] = [g["above_every_random"] for g in got]
                row["question"] = (f"rotating {spec['rotate']} ({spec['arm']}, depth {spec['depth']}): does the "
                                   "adversarial rotation hurt more than random ones?")
        elif kind == "rotation_pretrained":
            got = pretrained.get((spec["model"], spec["rotate"]))
            if got is not None:
                row |= {"p": got["p"], "D": got["D"], "same_sign": got["D"] > 0, "above_every_random": [got["above_every_random"]],
                        "question": f"{spec['model']}: does the adversarial rotation of {spec['rotate']} move the output more?"}
        row["ran"] = "p" in row
        out.append(row)
    ran = [r for r in out if r["ran"]]
    for row, p in zip(ran, holm([r["p"] for r in ran]), strict=True):
        row["holm_p"] = p
    for row in out:
        row["reading"] = _reading(row, plan["alpha"])
    return out


def _reading(row: dict, alpha: float) -> str:
    if not row["ran"]:
        return "not run (its runs did not all finish within the budget)"
    passed = row["holm_p"] < alpha and row["same_sign"]
    kind = row["spec"]["kind"]
    if kind == "slope":
        if not passed:
            return "no change with training length detected"
        return "falls with training (separation grows)" if row["mean"] < 0 else "rises with training (separation shrinks)"
    if kind == "welch":
        return ("differs: " + ("a below b" if row["difference"] < 0 else "a above b")) if passed else "no difference detected"
    if kind == "phantom":
        return ("P avoids an E it never saw: " + ("below" if row["mean"] < 0 else "above") + " the null") if passed \
            else "not distinguishable from the null"
    if kind in ("rotation", "rotation_pretrained"):
        needs = passed and all(row.get("above_every_random", [False]))
        if kind == "rotation_pretrained":
            needs = row["p"] < alpha and row["holm_p"] < alpha and row["D"] > 0
        return "the model needs its separation (adversarial hurts more)" if needs else "no need for the separation detected"
    return ""


# ----------------------------------------------------------------------------- everything


def score_experiment(root: Path, plan: dict, out: Path, rotation_runs: bool = True) -> dict:
    """Read every run the plan names that finished, run the plan's tests, write results.json, report.md and
    figures.png into ``out``."""
    from pe_geometry.analysis.rotation_test import pretrained_rotation_test, run_rotation_test

    root, out = Path(root), Path(out)
    lengths, longest, seeds = sorted(plan["lengths"]), max(plan["lengths"]), plan["seeds"]
    cells, cross, rotations, pretrained = {}, {}, {}, {}
    for depth in plan["depths"]:
        for arm in plan["arms"]:
            for seed in seeds:
                for length in lengths:
                    run = run_dir(root, depth, arm, seed, length, longest)
                    if finished(run, length):
                        cells[(depth, arm, seed, length)] = cell_figures(run)
                if arm != "nope":
                    cross[(depth, arm, seed)] = cross_reads(root, depth, arm, seed, longest)
    rot = plan["rotation"]
    wanted = {(t["depth"], t["arm"], t["rotate"]) for t in plan["tests"] if t["kind"] == "rotation"}
    # the exploratory rotation reads: every arm with a table at every depth, P rotated
    wanted |= {(d, a, "P") for d in plan["depths"] for a in plan["arms"] if a != "nope"}
    for depth, arm, rotate in sorted(wanted) if rotation_runs else []:
        for seed in seeds:
            run = run_dir(root, depth, arm, seed, longest, longest)
            if not finished(run, longest):
                continue
            cache = run / ROTATION_FILE.format(rotate=rotate)
            if cache.is_file() and cache.stat().st_mtime >= (run / "checkpoints" / "last.ckpt").stat().st_mtime:
                result = json.loads(cache.read_text())
            else:
                result = run_rotation_test(run, rotate=rotate, k=rot["k"], n_random=rot["n_random"],
                                           val_batches=rot["val_batches"], seed=rot["seed"])
                atomic_write_text(cache, json.dumps(result, indent=1))
            rotations[(depth, arm, seed, rotate)] = result
    for spec in (t for t in plan["tests"] if t["kind"] == "rotation_pretrained"):
        cache = out / f"rotation_{spec['model']}_{spec['rotate']}.json"
        if cache.is_file():
            pretrained[(spec["model"], spec["rotate"])] = json.loads(cache.read_text())
        else:
            result = pretrained_rotation_test(spec["model"], rotate=spec["rotate"], k=rot["k"], n_random=rot["n_random"],
                                              seed=rot["seed"])
            out.mkdir(parents=True, exist_ok=True)
            atomic_write_text(cache, json.dumps(result, indent=1))
            pretrained[(spec["model"], spec["rotate"])] = result
    tests = planned_tests(plan, cells, cross, rotations, pretrained)
    results = {
        "plan": plan,
        "cells": [{"depth": d, "arm": a, "seed": s, "length": n} | c for (d, a, s, n), c in sorted(cells.items())],
        "cross_reads": [{"depth": d, "arm": a, "seed": s} | c for (d, a, s), c in sorted(cross.items()) if c],
        "rotation": [{"depth": d, "arm": a, "seed": s} | r for (d, a, s, _), r in sorted(rotations.items())],
        "rotation_pretrained": list(pretrained.values()),
        "planned_tests": tests,
        "curves": trunk_curves(root, plan),
    }
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "results.json", json.dumps(results, indent=1, default=float))
    from pe_geometry.analysis.training_length_report import write_figure, write_report

    write_figure(results, out / "figures.png")
    atomic_write_text(out / "report.md", write_report(results))
    return results


def trunk_curves(root: Path, plan: dict) -> list[dict]:
    """Each trunk's logged geometry series (the callback's: value, null mean and sd every 100 steps) of the plan's
    figures, then each branch's, so a curve shows every length's decay."""
    from pe_geometry.analysis.runs import read_run_rows

    longest = max(plan["lengths"])
    names = [plan["figure"], *plan["secondary_figures"]]
    curves = []
    for depth in plan["depths"]:
        for arm in plan["arms"]:
            if arm == "nope":
                continue
            for seed in plan["seeds"]:
                for length in sorted(plan["lengths"]):
                    run = run_dir(root, depth, arm, seed, length, longest)
                    if not (run / "checkpoints" / "last.ckpt").is_file():
                        continue
                    rows = [r for r in read_run_rows(run) if r.get(f"geometry/{names[0]}") not in (None, "")]
                    series = {"step": [int(r["step"]) for r in rows]}
                    for name in names:
                        series[name] = [float(r[f"geometry/{name}"]) for r in rows]
                        series[f"{name}_null_mean"] = [float(r[f"geometry/{name}_null_mean"]) for r in rows]
                        series[f"{name}_null_std"] = [float(r[f"geometry/{name}_null_std"]) for r in rows]
                    curves.append({"depth": depth, "arm": arm, "seed": seed, "length": length,
                                   "part": "trunk" if length == longest else "branch"} | series)
    return curves
