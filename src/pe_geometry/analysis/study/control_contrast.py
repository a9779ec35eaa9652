"""Control arms read against the arm they control: how far a figure moved from step 0 to the end, seed by seed.

"Orthogonality is learned" (claim C4) is read from differences, not from one arm alone. A learned table started
inside E's top-8 subspace (mixed init) leaves it as training goes on, but so would a table that never moves,
because E's own top-8 directions change as E gains structure (a frozen table), and so might a table trained on
rows that say nothing about position (rows shuffled per sequence). The reading is therefore each arm's change
(end - step 0) minus the reference arm's change, paired by seed: the arms of a seed share their initialisation
(same E, same start of P), so a seed's difference is free of the start's own spread.

Per control arm and figure: the reference's change, the arm's change, their paired difference (mean, sd), a
two-sided one-sample t-test of the differences against 0 (seeds - 1 degrees of freedom), and Holm over every
arm x figure of the table (``holm`` from analysis/study/verdict.py).
"""

from __future__ import annotations

import math

import numpy as np

from pe_geometry.extras import needs_extra

with needs_extra("report", "the control contrast"):
    from scipy import stats as scipy_stats

from pe_geometry.analysis.measures.nulls import holm
from pe_geometry.analysis.readers.runs import stats


def changes(verdict: dict, figure: str) -> dict[int, tuple[float, float]]:
    """{seed: (step-0 value, end value)} of one arm's figure (a verdict of analysis/study/verdict.py with run_seeds and
    init_per_seed); seeds without a logged step 0 are left out."""
    f = (verdict.get("input") or {}).get(figure)
    if not f or "run_seeds" not in f or "init_per_seed" not in f:
        return {}
    ends = f["observed"]["values"]
    if not len(ends) == len(f["run_seeds"]) == len(f["init_per_seed"]):
        raise ValueError(f"arm {verdict['label']!r}, {figure}: {len(ends)} end values for {len(f['run_seeds'])} seeds "
                         "(a seed's value is missing or NaN): the seeds cannot be paired")
    return {seed: (start, end) for seed, start, end in zip(f["run_seeds"], f["init_per_seed"], ends) if start is not None}


def contrast(verdicts: list[dict], reference: str, figures: list[str]) -> list[dict]:
    """One row per (control arm, figure): both arms' changes and their paired difference, Holm over the rows."""
    by_label = {v["label"]: v for v in verdicts}
    if reference not in by_label:
        raise ValueError(f"no arm {reference!r} in the report; its arms: {sorted(by_label)}")
    rows = []
    for figure in figures:
        ref = changes(by_label[reference], figure)
        for label, v in by_label.items():
            other = changes(v, figure)
            seeds = sorted(set(ref) & set(other))
            if label == reference or not seeds:
                continue
            ref_change = [ref[s][1] - ref[s][0] for s in seeds]
            arm_change = [other[s][1] - other[s][0] for s in seeds]
            difference = [a - r for a, r in zip(arm_change, ref_change)]
            p = (float(scipy_stats.ttest_1samp(difference, 0.0).pvalue)
                 if len(seeds) > 1 and np.std(difference) > 0 else math.nan)
            rows.append({"arm": label, "figure": figure, "seeds": seeds, "reference_change": stats(ref_change),
                         "arm_change": stats(arm_change), "difference": stats(difference), "p": p,
                         "start": stats([other[s][0] for s in seeds]), "reference_start": stats([ref[s][0] for s in seeds])})
    tested = [i for i, row in enumerate(rows) if not math.isnan(row["p"])]
    for i, q in zip(tested, holm([rows[i]["p"] for i in tested])):
        rows[i].update(holm_p=q, n_tests=len(tested))
    return rows
