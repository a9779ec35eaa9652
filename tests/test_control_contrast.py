"""Control arms against the arm they control (analysis/study/control_contrast.py, pe-verdict --contrast): changes from step
0 to the end, paired by seed, with a t-test and Holm over the rows."""

from __future__ import annotations

import json

import pytest
from scipy import stats as scipy_stats

from pe_geometry.analysis.study.control_contrast import contrast
from pe_geometry.analysis.study.verdict import combine_seeds

MIXED = "learned + mixed init k=8"
FROZEN, SHUFFLED = f"{MIXED} + frozen table", f"{MIXED} + rows shuffled per sequence"


def arm(label: str, seeds: list[int], start: list, end: list[float]) -> dict:
    v = combine_seeds(end, [0.125] * len(end), [0.001] * len(end), [-3.0] * len(end), side="less")
    v.update(run_seeds=seeds, init_per_seed=start)
    return {"label": label, "seeds": seeds, "input": {"overlap_k8": v}, "hidden": {}, "attn": {}}


def test_each_arms_change_is_paired_with_the_references_by_seed():
    verdicts = [arm(MIXED, [0, 1, 2], [1.0, 1.0, 1.0], [0.4, 0.5, 0.3]),
                # listed in another seed order, as a report may: pairing goes by seed, not by position in the list
                arm(FROZEN, [2, 0, 1], [1.0, 1.0, 1.0], [0.9, 0.8, 0.7]),
                arm(SHUFFLED, [0, 1, 2], [1.0, None, 1.0], [0.45, 0.6, 0.35])]  # seed 1 without a step 0: left out
    rows = {row["arm"]: row for row in contrast(verdicts, MIXED, ["overlap_k8"])}
    frozen = rows[FROZEN]
    assert frozen["seeds"] == [0, 1, 2]
    assert frozen["reference_change"]["values"] == pytest.approx([-0.6, -0.5, -0.7])
    assert frozen["arm_change"]["values"] == pytest.approx([-0.2, -0.3, -0.1])
    assert frozen["difference"]["values"] == pytest.approx([0.4, 0.2, 0.6])  # the frozen table falls 0.4 less
    assert frozen["p"] == pytest.approx(scipy_stats.ttest_1samp([0.4, 0.2, 0.6], 0).pvalue)
    assert rows[SHUFFLED]["seeds"] == [0, 2] and rows[SHUFFLED]["difference"]["values"] == pytest.approx([0.05, 0.05])
    assert rows[SHUFFLED]["p"] != rows[SHUFFLED]["p"]  # identical differences: no spread, no t-test (NaN), no Holm row
    assert frozen["holm_p"] == pytest.approx(frozen["p"]) and frozen["n_tests"] == 1 and "holm_p" not in rows[SHUFFLED]
    with pytest.raises(ValueError, match="no arm 'learned'.*its arms"):
        contrast(verdicts, "learned", ["overlap_k8"])


def test_pe_verdict_contrast_prints_the_table(tmp_path, capsys):
    from pe_geometry.cli.verdict import main

    summary = {"setup": {"d_model": 64}, "verdict": [arm(MIXED, [0, 1, 2], [1.0] * 3, [0.4, 0.5, 0.3]),
                                                     arm(FROZEN, [0, 1, 2], [1.0] * 3, [0.6, 0.8, 0.7])]}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    text = main([str(tmp_path), "--contrast", MIXED])
    row = next(line for line in text.splitlines() if line.startswith(f"| {FROZEN} |"))
    assert "| 0, 1, 2 | 1 / 1 | -0.6 ± 0.1 | -0.3 ± 0.1 | 0.2, 0.3, 0.4 | 0.3 ± 0.1 |" in row
    with pytest.raises(SystemExit):
        main([str(tmp_path), str(tmp_path), "--contrast", MIXED])
    assert "one REPORT" in capsys.readouterr().err
