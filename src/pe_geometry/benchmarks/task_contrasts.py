"""Arms against their controls on the length tasks, seed by seed: exact permutation tests with Holm's correction,
chosen on the command line (exploratory) or by a committed analysis plan (confirmatory, ``--plan``)."""

from __future__ import annotations

import itertools
import math
import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from pe_geometry.analysis.measures.nulls import holm
from pe_geometry.benchmarks.length_tasks_scoring import METRIC_WORDS, METRICS


def seed_contrast(a: list[float], b: list[float]) -> dict:
    """Arm a against arm b on one figure, one value per seed: the difference of the seeds' means and its exact
    two-sided permutation p over every split of the pooled seeds (3 v 3: p >= 0.1; 5 v 5: p >= 0.008)."""
    pooled, n = a + b, len(a)
    observed = statistics.fmean(a) - statistics.fmean(b)
    splits = list(itertools.combinations(range(len(pooled)), n))
    extreme = 0
    for chosen in splits:
        rest = [pooled[i] for i in range(len(pooled)) if i not in chosen]
        extreme += abs(statistics.fmean(pooled[i] for i in chosen) - statistics.fmean(rest)) >= abs(observed) - 1e-12
    # the smallest p this many seeds allow (two splits at the extreme: 2 / C(n_a + n_b, n_a)): 3 v 5 cannot go below 0.036
    return {"difference": observed, "p": extreme / len(splits), "seeds": [len(a), len(b)], "p_floor": 2 / len(splits)}


def contrasts(runs: list[dict], pairs: list[tuple[str, str]], multiplier: int, tasks: list[str] | None = None,
              metric: str = "token_accuracy", seeds: list[int] | None = None) -> list[dict]:
    """Each (arm, control) pair on every task both were run on (of ``tasks``, None: all): ``metric`` at
    ``multiplier`` x, seed by seed (``seed_contrast``; of ``seeds`` only, None: every seed), Holm-corrected over every
    pair x task tested."""
    values: dict = defaultdict(dict)
    for r in runs:
        if (tasks is not None and r["task"] not in tasks) or (seeds is not None and r["seed"] not in seeds):
            continue
        cell = r["lengths"].get(str(multiplier), {})
        if cell.get(metric) is not None:
            values[(r["task"], r["family"])][r["seed"]] = cell[metric]
    rows = []
    for arm, control in pairs:
        tasks = sorted({t for t, f in values if f == arm} & {t for t, f in values if f == control})
        if not tasks:
            raise SystemExit(f"error: --contrast {arm!r} {control!r}: no task has both arms; arms: "
                             f"{sorted({f for _, f in values})}")
        for task in tasks:
            a, b = values[(task, arm)], values[(task, control)]
            rows.append({"task": task, "arm": arm, "control": control, "multiplier": multiplier, "metric": metric,
                         "arm_mean": statistics.fmean(a.values()), "control_mean": statistics.fmean(b.values()),
                         "arm_seeds": dict(sorted(a.items())), "control_seeds": dict(sorted(b.items())),
                         **seed_contrast(list(a.values()), list(b.values()))})
    for row, adjusted in zip(rows, holm([row["p"] for row in rows])):
        row["p_holm"] = adjusted
    return rows


def smallest_holm_p(plan: dict) -> float:
    """The smallest Holm-adjusted p a plan's family can reach: its number of tests times the exact permutation test's
    floor for its seeds (2 / C(2n, n), n seeds per arm). At or above the plan's alpha no test could have passed,
    whatever the data (5 v 5 seeds: 0.0079; 8 tests: 0.063)."""
    n = len(plan["seeds"])
    return min(1.0, len(plan["pairs"]) * 2 / math.comb(2 * n, n))


def contrast_preamble(rows: list[dict], plan: Path | None, out: Path | None = None,
                      plan_settings: dict | None = None) -> str:
    if plan is not None:
        link = os.path.relpath(plan.resolve(), out.resolve()) if out is not None else plan  # from the markdown's folder
        power = ""
        if plan_settings is not None and (floor := smallest_holm_p(plan_settings)) >= plan_settings["alpha"]:
            power = (f"**This plan could not reject any test**: Holm over its {len(plan_settings['pairs'])} tests "
                     f"from {len(plan_settings['seeds'])} v {len(plan_settings['seeds'])} seeds cannot go below "
                     f"{floor:.3g}, above its alpha {plan_settings['alpha']}; read its p's as the data's direction only. ")
        return (f"**Confirmatory**: the pairs, metric, length, seeds and alpha of [{plan.name}]({link}), committed before "
                f"these runs; these tests alone are the finding. {power}")
    return "**Exploratory** (`--contrast`: pairs chosen on the command line, not from a committed plan). " if rows else ""


def read_plan(path: Path) -> dict:
    """A committed analysis plan of contrasts (experiments/plans/passkey_confirmatory.yaml): one error line when a
    key it needs is missing."""
    import yaml

    plan = yaml.safe_load(Path(path).read_text())
    missing = [k for k in ("seeds", "task", "metric", "multiplier", "alpha", "arms", "pairs") if k not in (plan or {})]
    if missing:
        raise SystemExit(f"error: --plan {path} lacks {missing}")
    if plan["metric"] not in METRICS:
        raise SystemExit(f"error: --plan {path}: metric {plan['metric']!r}; valid: {list(METRICS)}")
    if (floor := smallest_holm_p(plan)) >= plan["alpha"]:  # said before any run is read: check a plan before its runs
        print(f"warning: --plan {path} cannot reject any test: Holm over {len(plan['pairs'])} tests from "
              f"{len(plan['seeds'])} v {len(plan['seeds'])} seeds floors at {floor:.3g} >= alpha {plan['alpha']} "
              "(fewer pairs or more seeds)", file=sys.stderr)
    return plan


def plan_pairs(plan: dict) -> list[tuple[str, str]]:
    """The plan's (arm, control) pairs as the labels the runs carry."""
    return [(plan["arms"][a]["label"], plan["arms"][c]["label"]) for a, c in plan["pairs"]]


def contrast_table(rows: list[dict]) -> str:
    metric = METRIC_WORDS.get(rows[0].get("metric", "token_accuracy"), "token accuracy") if rows else "token accuracy"
    lines = [f"| task | arm | control | {metric}, arm / control | per seed, arm; control | difference | "
             "seeds (smallest p they allow) | p (exact) | p (Holm) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        per_seed = "; ".join(", ".join(f"{v:.2f}" for v in r.get(k, {}).values()) or "–"
                             for k in ("arm_seeds", "control_seeds"))
        lines.append(f"| {r['task']} | {r['arm']} | {r['control']} | {r['arm_mean']:.2f} / {r['control_mean']:.2f} | "
                     f"{per_seed} | {r['difference']:+.2f} | {r['seeds'][0]} v {r['seeds'][1]} "
                     f"({r.get('p_floor', float('nan')):.3g}) | {r['p']:.3g} | {r['p_holm']:.3g} |")
    return "\n".join(lines)
