"""How an arm's seeds are combined into a verdict: checked against hand computations."""

from __future__ import annotations

import math

import pytest
from scipy import stats as scipy_stats

from pe_geometry.analysis.verdict import combine_seeds, reading


def test_fisher_combination_matches_the_chi_square_formula():
    p = [0.01, 0.2, 0.6]
    v = combine_seeds([0.05, 0.06, 0.07], [0.1, 0.1, 0.1], p, [-2.5, -1.2, -0.5], side="less")
    statistic = -2 * sum(math.log(x) for x in p)  # Fisher 1925: chi-square with 2n degrees of freedom
    assert v["fisher_p"] == pytest.approx(scipy_stats.chi2.sf(statistic, df=2 * len(p)), rel=1e-12)
    assert v["effect"]["mean"] == pytest.approx(-0.04) and v["effect"]["std"] == pytest.approx(0.01)
    assert v["n_significant_same_side"] == 1 and v["direction"] == "less"


def test_a_seed_significant_on_the_other_side_does_not_count_as_agreement():
    v = combine_seeds([0.03, 0.03, 0.15], [0.1, 0.1, 0.1], [0.001, 0.001, 0.001], [-5, -5, 5], side="less")
    assert v["effect"]["mean"] < 0 and v["n_significant_same_side"] == 2
    assert reading(v) == "below the null in 2/3 seeds: separated (not in every seed)"


def test_readings_in_plain_words():
    at_null = combine_seeds([0.1, 0.11], [0.1, 0.1], [0.5, 0.4], [0.1, 0.6], side="less")
    assert reading(at_null) == "at the null (none of 2 seeds has p < 0.05)"
    aligned = combine_seeds([0.3, 0.3], [0.1, 0.1], [0.001, 0.002], [9, 8], side="less")
    assert reading(aligned) == "above the null in 2/2 seeds: more aligned than the null"
    probe = combine_seeds([0.4, 0.5], [0.0, 0.0], [0.01, 0.01], [6, 7], side="greater")
    assert reading(probe, toward="position readable", away="below the null") == "above the null in 2/2 seeds: position readable"


def test_verdict_script_puts_several_reports_in_one_table(tmp_path, capsys):
    """pe-verdict reads each report's summary.json; rows keep the report's name and the arm."""
    import json

    from pe_geometry.cli.verdict import main

    for name, observed in (("controls_learned", [0.05, 0.06]), ("dose_response", [0.02, 0.03])):
        v = combine_seeds(observed, [0.12, 0.12], [0.002, 0.004], [-4.0, -3.5], side="less")
        verdict = {"label": "learned", "seeds": [0, 1], "n_draws": 2000, "input": {"overlap_k8": {**v, "init": {"n": 0}}},
                   "hidden": {}, "attn": {}}
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps({"verdict": [verdict]}))
    text = main([str(tmp_path / "controls_learned"), str(tmp_path / "dose_response"), "--compact", "--figures", "overlap_k8"])
    rows = [line for line in text.splitlines() if line.startswith("| controls") or line.startswith("| dose")]
    assert rows[0].startswith("| controls_learned: learned | 2 | 0.055 (0.12) · -0.065 ± 0.007 · 0.002, 0.004 |")
    assert rows[1].startswith("| dose_response: learned | 2 | 0.025 (0.12) · -0.095 ± 0.007")
    assert rows[0].endswith("| below the null in 2/2 seeds: separated |")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "summary.json").write_text("{}")
    with pytest.raises(SystemExit):
        main([str(tmp_path / "empty")])
    assert "has no verdict" in capsys.readouterr().err


def test_a_literal_bar_in_a_cell_does_not_split_the_markdown_table():
    """"mean |cos|" in a cell once split it in two: every row must have as many cells as the header."""
    import re

    from pe_geometry.analysis.report.tables import md_table

    lines = md_table(["figure", "end"], [["mean |cos| over pairs", "0.1"], ["overlap", "0.2"], ["already \\| escaped", "0.3"]])
    counts = {len(re.split(r"(?<!\\)\|", line)) for line in lines if line}
    assert counts == {4}  # leading and trailing bar + one separator between two cells
