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
from collections import defaultdict
from pathlib import Path

import numpy as np

from pe_geometry.analysis.measures.nulls import holm
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
    from pe_geometry.analysis.study.verdict import final_input_rows

    E, P, _ = final_input_rows(run, words_without_table=True)
    return E, P


def null_figures(E, P, draws: int = DRAWS) -> dict:
    """rotation_null's figures with each figure's ratio to its null mean (``<figure>_ratio``)."""
    from pe_geometry.analysis.measures.nulls import rotation_null

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
    from pe_geometry.analysis.readers.runs import read_run_rows

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

    from pe_geometry.analysis.study.rotation_test import haar_rotation

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
    if finished(common, longest) and common != here:  # a self-pair is the arm's own read, not a swap
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
    if len(v) < 2:  # no spread, no test
        return {"values": v.tolist(), "mean": float(v.mean()), "sd": float("nan"), "t": float("nan"), "df": 0,
                "p": float("nan"), "same_sign": True}
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
        row: dict = {"id": spec["id"], "spec": spec, "question": question(spec, longest)}
        kind = spec["kind"]
        if kind == "slope":
            by_length = {n: ratios(spec["depth"], spec["arm"], n) for n in plan["lengths"]}
            if all(v is not None for v in by_length.values()):
                row |= {"ratios": by_length} | one_sample(slope_per_seed(by_length))
        elif kind == "welch":
            a, b = ratios(spec["a"]["depth"], spec["a"]["arm"], longest), ratios(spec["b"]["depth"], spec["b"]["arm"], longest)
            if a is not None and b is not None:
                row |= welch(np.log(a).tolist(), np.log(b).tolist())
        elif kind == "phantom":
            got = [cross.get((spec["depth"], spec["arm"], s), {}).get("phantom") for s in seeds]
            if all(g is not None for g in got):
                row |= one_sample([math.log(g[f"{figure}_ratio"]) for g in got])
        elif kind == "rotation":
            got = [rotations.get((spec["depth"], spec["arm"], s, spec["rotate"])) for s in seeds]
            if all(g is not None for g in got):
                row |= one_sample([g["D"] for g in got])
                row["above_every_random"] = [g["above_every_random"] for g in got]
        elif kind == "rotation_pretrained":
            got = pretrained.get((spec["model"], spec["rotate"]))
            if got is not None:
                row |= {"p": got["p"], "D": got["D"], "same_sign": got["D"] > 0, "above_every_random": [got["above_every_random"]],
                        "n_random": got["n_random"]}
        row["ran"] = "p" in row and math.isfinite(row["p"])
        if "p" in row and not row["ran"]:
            row["why_not"] = "too few seeds for its test"
        out.append(row)
    # Holm over the plan's whole family, as committed: a test that did not run counts as p = 1, so the family is never
    # made smaller (and the correction weaker) by what the budget cut
    adjusted = holm([r["p"] if r["ran"] else 1.0 for r in out])
    for row, p in zip(out, adjusted, strict=True):
        if row["ran"]:
            row["holm_p"] = p
    for row in out:
        row["reading"] = _reading(row, plan["alpha"])
    return out


def question(spec: dict, longest: int) -> str:
    """A planned test in words."""
    kind = spec["kind"]
    if kind == "slope":
        return f"does r change with training length ({spec['arm']}, depth {spec['depth']})? slope of ln r per doubling"
    if kind == "welch":
        a, b = spec["a"], spec["b"]
        return f"ln r at {longest} steps: {a['arm']} depth {a['depth']} vs {b['arm']} depth {b['depth']}"
    if kind == "phantom":
        return f"{spec['arm']}'s P against the same seed's NoPE E (depth {spec['depth']}): ln r vs 0"
    if kind == "rotation":
        return (f"rotating {spec['rotate']} ({spec['arm']}, depth {spec['depth']}): does the adversarial rotation hurt "
                "more than random ones? D vs 0")
    return f"{spec.get('model')}: does the adversarial rotation of {spec['rotate']} move the output more than random ones?"


def _reading(row: dict, alpha: float) -> str:
    if not row["ran"]:
        return f"not run ({row.get('why_not', 'its runs did not all finish within the budget')})"
    passed = row["holm_p"] < alpha and row["same_sign"]
    kind = row["spec"]["kind"]
    if kind == "slope":
        if not passed:
            return "no change with training length shown (Holm)"
        return "falls with training (separation grows)" if row["mean"] < 0 else "rises with training (separation shrinks)"
    if kind == "welch":
        return ("differs: " + ("a below b" if row["difference"] < 0 else "a above b")) if passed else "no difference shown (Holm)"
    if kind == "phantom":
        return ("P avoids an E it never saw: " + ("below" if row["mean"] < 0 else "above") + " the null") if passed \
            else "not distinguishable from the null (Holm)"
    if kind in ("rotation", "rotation_pretrained"):
        needs = passed and all(row.get("above_every_random", [False]))
        if kind == "rotation_pretrained":
            needs = row["p"] < alpha and row["holm_p"] < alpha and row["D"] > 0
        if needs:
            return "adversarial hurts more than random: sensitive in E's top directions"
        return "a need for the separation not shown (Holm)"
    return ""


# ----------------------------------------------------------------------------- everything


def score_experiment(root: Path, plan: dict, out: Path, rotation_runs: bool = True) -> dict:
    """Read every run the plan names that finished, run the plan's tests, write results.json, report.md and
    figures.png into ``out``."""
    from pe_geometry.analysis.study.rotation_test import pretrained_rotation_test, run_rotation_test

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
    write_figure(results, out / "figures.png")
    atomic_write_text(out / "report.md", write_report(results))
    return results


def trunk_curves(root: Path, plan: dict) -> list[dict]:
    """Each trunk's logged geometry series (the callback's: value, null mean and sd every 100 steps) of the plan's
    figures, then each branch's, so a curve shows every length's decay."""
    from pe_geometry.analysis.readers.runs import read_run_rows

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


# ----------------------------------------------------------------------------- the report and its figure

FIGURE_WORDS = {
    "overlap_k8": "top-8 subspace overlap",
    "var_share_P_in_E_k8": "share of P's variance in E's top-8",
    "abs_cos_mean": "mean |cos| over word x position pairs",
}
ARM_WORDS = {
    "learned": "learned table",
    "mixed_frozen": "mixed start, frozen",
    "mixed_shuffled": "mixed start, shuffled rows",
    "word_norm": "fixed sinusoidal (word norm)",
    "nope": "NoPE",
}


def _fmt(x: float, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.{digits}g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.1e}"


def _pm(mean: float, sd: float) -> str:
    return f"{mean:.3f} ± {sd:.3f}"


def _ms(values: list[float]) -> str:
    v = np.asarray(values, dtype=float)
    return f"{v.mean():.3f} ± {v.std(ddof=1):.3f}" if len(v) > 1 else f"{v.mean():.3f}"


def grouped(rows: list[dict], *keys: str) -> dict[tuple, list[dict]]:
    """``rows`` by the values of ``keys`` (depth, arm, ...), in their order."""
    groups: dict = defaultdict(list)
    for row in rows:
        groups[tuple(row[k] for k in keys)].append(row)
    return groups


def cell_table(results: dict) -> tuple[list[str], list[dict]]:
    """Every (depth, arm, length) x figure against its null: r mean ± sd over seeds, the seeds' two-sided p, Fisher's
    p over the seeds, Holm over every row x figure (an exploratory family: the planned tests are the finding)."""
    groups = grouped(results["cells"], "depth", "arm", "length")
    rows = []
    for (depth, arm, length), cells in sorted(groups.items()):
        row = {"depth": depth, "arm": arm, "length": length, "seeds": len(cells),
               "val_loss": [c.get("val_loss_last") for c in cells],
               "last_is_best": all(c.get("val_loss_last") is not None and c["val_loss_last"] <= c["val_loss_min"] + 1e-9 for c in cells)}
        for name in FIGURE_WORDS:
            if any(c["figures"] is None for c in cells):
                continue
            from scipy import stats

            ps = [max(c["figures"][f"{name}_p"], 1e-12) for c in cells]
            row[name] = {"r": [c["figures"][f"{name}_ratio"] for c in cells], "p": ps,
                         "fisher": float(stats.combine_pvalues(ps, method="fisher").pvalue)}
        rows.append(row)
    tested = [(i, name) for i, row in enumerate(rows) for name in FIGURE_WORDS if name in row]
    for (i, name), p in zip(tested, holm([rows[i][name]["fisher"] for i, name in tested]), strict=True):
        rows[i][name]["holm"] = p
    lines = ["| depth | arm | steps | seeds | val loss (last) | last = best val | "
             + " | ".join(f"{w}: r (value / null mean) · p per seed · Holm p ({len(tested)})" for w in FIGURE_WORDS.values()) + " |",
             "|" + "---|" * (6 + len(FIGURE_WORDS))]
    for row in rows:
        cells = [str(row["depth"]), ARM_WORDS.get(row["arm"], row["arm"]), str(row["length"]), str(row["seeds"]),
                 _ms([v for v in row["val_loss"] if v is not None]), "yes" if row["last_is_best"] else "no"]
        for name in FIGURE_WORDS:
            if name not in row:
                cells.append("no table")
                continue
            f = row[name]
            cells.append(f"{_ms(f['r'])} · {', '.join(_fmt(p, 2) for p in f['p'])} · {_fmt(f['holm'], 2)}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines, rows


def tests_table(results: dict) -> list[str]:
    lines = ["| test | question | per seed | mean ± sd | t (df) | p | Holm p | reading |", "|---|---|---|---|---|---|---|---|"]
    for t in results["planned_tests"]:
        if not t["ran"]:
            lines.append(f"| {t['id']} | {t['question']} | | | | | | {t['reading']} |")
            continue
        values = t.get("values") or ([t["D"]] if "D" in t else t.get("a", []))
        if t["spec"]["kind"] == "welch":
            per_seed = f"a {', '.join(_fmt(v) for v in t['a'])}; b {', '.join(_fmt(v) for v in t['b'])}"
            mean = f"a - b = {_fmt(t['difference'])}"
            tdf = f"{_fmt(t['t'])} (Welch)"
        elif t["spec"]["kind"] == "rotation_pretrained":
            per_seed, mean, tdf = f"D {_fmt(t['D'])}", "one model", f"rank of {t['n_random']} random"
        else:
            per_seed = ", ".join(_fmt(v) for v in values)
            mean = f"{_fmt(t['mean'])} ± {_fmt(t['sd'])}"
            tdf = f"{_fmt(t['t'])} ({t['df']})"
        lines.append(f"| {t['id']} | {t['question']} | {per_seed} | {mean} | {tdf} | {_fmt(t['p'], 2)} | "
                     f"{_fmt(t['holm_p'], 2)} | {t['reading']} |")
    return lines


def cross_table(results: dict) -> list[str]:
    groups = grouped(results["cross_reads"], "depth", "arm")
    lines = ["| depth | arm | own E (r) | phantom: the NoPE run's E (r) | swap: the learned arm's seed-0 E (r) | "
             "own E, P turned at random (r) |", "|---|---|---|---|---|---|"]
    own = defaultdict(list)
    longest = max(results["plan"]["lengths"])
    for c in results["cells"]:
        if c["length"] == longest and c["figures"] is not None:
            own[(c["depth"], c["arm"])].append(c["figures"]["overlap_k8_ratio"])

    def read(cs: list[dict], kind: str) -> str:
        got = [c[kind]["overlap_k8_ratio"] for c in cs if kind in c]
        return f"{_ms(got)} ({len(got)})" if got else "n/a"

    for (depth, arm), cs in sorted(groups.items()):
        lines.append(f"| {depth} | {ARM_WORDS.get(arm, arm)} | {_ms(own[(depth, arm)]) if own[(depth, arm)] else 'n/a'} | "
                     f"{read(cs, 'phantom')} | {read(cs, 'swap')} | {read(cs, 'random_orientation')} |")
    return lines


def rotation_table(results: dict) -> list[str]:
    groups = grouped(results["rotation"], "depth", "arm", "rotate")
    n_random = results["plan"]["rotation"]["n_random"]
    lines = [f"| depth | arm | rotated | loss | rise, adversarial | rise, random (mean ± sd of {n_random}) | rise, away (onto the "
             "other's bottom-8) | D per seed | adversarial above every random | p per seed (rank) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (depth, arm, rotate), rs in sorted(groups.items()):
        lines.append(
            f"| {depth} | {ARM_WORDS.get(arm, arm)} | {rotate} | {_ms([r['loss'] for r in rs])} | "
            f"{_ms([r['delta_adversarial'] for r in rs])} | "
            f"{', '.join(_pm(r['delta_random_mean'], r['delta_random_std']) for r in rs)} | "
            f"{_ms([r['delta_away'] for r in rs])} | "
            f"{', '.join(_fmt(r['D']) for r in rs)} | {', '.join('yes' if r['above_every_random'] else 'no' for r in rs)} | "
            f"{', '.join(_fmt(r['p'], 2) for r in rs)} |")
    for r in results["rotation_pretrained"]:
        lines.append(f"| {r['model_type']} ({r['model'].rsplit('/', 2)[-2]}) | its learned table | {r['rotate']} | "
                     f"drift 0 | {_fmt(r['delta_adversarial'])} | {r['delta_random_mean']:.3g} ± {r['delta_random_std']:.2g} | "
                     f"{_fmt(r['delta_away'])} | "
                     f"{_fmt(r['D'])} | {'yes' if r['above_every_random'] else 'no'} | {_fmt(r['p'], 2)} |")
    return lines


STABLE_WINDOWS = ((900, 1200), (2100, 2400), (4500, 4800))  # constant-rate stretches of the trunk before each decay


def stable_window_table(results: dict) -> list[str]:
    """Each trunk's r averaged over the constant-rate stretch before each length's decay: the length's effect without
    the decay's (a referee's point: when P trains, most of the fall at each length's end is made by its decay)."""
    names = [results["plan"]["figure"], *results["plan"]["secondary_figures"][:1]]
    groups = grouped([c for c in results["curves"] if c["part"] == "trunk"], "depth", "arm")
    lines = ["| depth | arm | " + " | ".join(f"{FIGURE_WORDS[n]}: r over steps {a}-{b}, per seed" for n in names
                                         for a, b in STABLE_WINDOWS) + " |", "|" + "---|" * (2 + len(names) * 3)]
    for (depth, arm), curves in sorted(groups.items()):
        cells = []
        for name in names:
            for a, b in STABLE_WINDOWS:
                per_seed = []
                for c in sorted(curves, key=lambda c: c["seed"]):
                    r = [v / m for s, v, m in zip(c["step"], c[name], c[f"{name}_null_mean"], strict=True) if a <= s <= b]
                    if r:
                        per_seed.append(float(np.mean(r)))
                cells.append(", ".join(f"{v:.2f}" for v in per_seed) if per_seed else "n/a")
        lines.append(f"| {depth} | {ARM_WORDS.get(arm, arm)} | " + " | ".join(cells) + " |")
    return lines


def write_report(results: dict) -> str:
    plan = results["plan"]
    ran = {(c["depth"], c["arm"]) for c in results["cells"]}
    cut = [f"depth {b['depth']}: {a}" for b in plan["run_order"] for a in b["arms"] if (b["depth"], a) not in ran]
    cell_lines, _ = cell_table(results)
    text = [
        "# Does the separation grow with training, and does the model need it? (issue 51)",
        "",
        "Plan: [experiments/plans/training_length.yaml](../../plans/training_length.yaml), committed before the runs. "
        f"d_model 64, the width curve's recipe with a warmup-stable-decay schedule; lengths {plan['lengths']} steps "
        f"(each a decay over its last 1/7, branched off one trunk per run), depths {plan['depths']}, seeds {plan['seeds']}. "
        "r = a figure's value over the mean of its spectra-keeping rotation null (2000 draws): 1 is the null, below 1 "
        "separated.",
        "",
        "Cut by the budget (the plan's run order, cut from its end): " + (", ".join(cut) if cut else "nothing") + ".",
        "",
        "## The planned tests (the finding)",
        "",
        f"Holm over the plan's {len(results['planned_tests'])} tests (one that did not run counts as p = 1), alpha "
        f"{plan['alpha']}; a reading needs Holm p < alpha and every seed on the same side. With 3 seeds a t-test has 2 "
        f"df: the first Holm threshold, {plan['alpha'] / len(results['planned_tests']):.4f}, needs |t| near 15.",
        "",
        *tests_table(results),
        "",
        "## Every figure against its null, at every length (exploratory)",
        "",
        "p per seed: the rotation null's two-sided empirical p (floor 1/2001); Fisher over the seeds, Holm over every "
        "row x figure of this table.",
        "",
        *cell_lines,
        "",
        "## Without the decays: the constant-rate stretches (exploratory)",
        "",
        "Each length ends with its own learning-rate decay (its last 1/7), so r at a length's end mixes training length "
        "with decay length. r averaged over the trunk's constant-rate stretch before each decay (mean over the "
        "callback's reads every 100 steps; its null mean logged beside each read):",
        "",
        *stable_window_table(results),
        "",
        "## Is it E, P or the pair? (exploratory)",
        "",
        "The top-8 overlap r at the longest length of each arm's P against: its own E; the final E of the NoPE run of "
        "the same seed and depth (an E that never saw a table); the learned arm's seed-0 E (one common E); its own E "
        "with P turned by one Haar rotation (reads at the null by construction: the sanity check).",
        "",
        *cross_table(results),
        "",
        "## The rotation test",
        "",
        "Validation loss (16 fixed batches) after rotating the model's own table P about the origin: adversarial = P's "
        "top-8 principal directions onto E's top-8; random = 20 Haar rotations. D = adversarial rise - mean random "
        "rise. For E (rotate E): E's top-8 onto P's, on the input side only. MiniLM: the drift of its pooled output "
        "(it has no masked-LM head).",
        "",
        *rotation_table(results),
        "",
        "![figures](figures.png)",
        "",
    ]
    return "\n".join(text)


def write_figure(results: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plan = results["plan"]
    names = [plan["figure"], *plan["secondary_figures"]]
    depths = [d for d in plan["depths"] if any(c["depth"] == d for c in results["curves"])] or plan["depths"][:1]
    arms = [a for a in plan["arms"] if a != "nope"]
    colours = dict(zip(arms, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    fig, axes = plt.subplots(len(depths), len(names), figsize=(5 * len(names), 3.6 * len(depths)), squeeze=False)
    longest = max(plan["lengths"])
    for i, depth in enumerate(depths):
        for j, name in enumerate(names):
            ax = axes[i, j]
            for arm in arms:
                curves = [c for c in results["curves"] if c["depth"] == depth and c["arm"] == arm]
                trunks = [c for c in curves if c["part"] == "trunk" and c["step"] and c["step"][-1] == longest]
                if trunks:
                    n = min(len(c["step"]) for c in trunks)
                    steps = np.asarray(trunks[0]["step"][:n])
                    r = np.array([np.asarray(c[name][:n]) / np.asarray(c[f"{name}_null_mean"][:n]) for c in trunks])
                    band = np.mean([np.asarray(c[f"{name}_null_std"][:n]) / np.asarray(c[f"{name}_null_mean"][:n]) for c in trunks], 0)
                    ax.plot(steps, r.mean(0), color=colours[arm], label=f"{ARM_WORDS[arm]} ({len(trunks)} seeds)")
                    ax.fill_between(steps, 1 - 2 * band, 1 + 2 * band, color=colours[arm], alpha=0.06, linewidth=0)
                for c in curves:
                    if c["part"] == "branch" and c["step"]:
                        ax.plot(c["step"], np.asarray(c[name]) / np.asarray(c[f"{name}_null_mean"]), color=colours[arm],
                                linewidth=0.7, linestyle="--", alpha=0.6)
                ends = defaultdict(list)
                for cell in results["cells"]:
                    if cell["depth"] == depth and cell["arm"] == arm and cell["figures"] is not None:
                        ends[cell["length"]].append(cell["figures"][f"{name}_ratio"])
                for length, values in ends.items():
                    ax.errorbar([length], [np.mean(values)], yerr=[np.std(values, ddof=1)] if len(values) > 1 else None,
                                marker="o", color=colours[arm], markersize=4, capsize=2)
            ax.axhline(1.0, color="grey", linewidth=0.8)
            ax.set_xlim(0, longest * 1.03)
            if name != "abs_cos_mean":  # the mixed start begins near 4.5 x the null: clipped so the ends can be read
                ax.set_ylim(0, 2)
            ax.set_title(f"depth {depth}: {FIGURE_WORDS[name]}", fontsize=9)
            ax.set_xlabel("step")
            ax.set_ylabel("value / null mean")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.text(0.5, 0.005, "line: trunk, mean over seeds; dashed: decay branches; dots: each length's end (mean ± sd); "
             "band: the null's ±2 sd; the mixed starts begin near 4.5 x the null (clipped at 2)", ha="center", fontsize=7)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
