"""How an arm's seeds are combined into a verdict, and a report's verdicts corrected for many tests: checked against hand
computations."""

from __future__ import annotations

import json
import math

import pytest
from scipy import stats as scipy_stats

from pe_geometry.analysis.study.verdict import combine_seeds, correct_report, holm, reading


def _arm(label: str, input_figures: dict, hidden: dict | None = None) -> dict:
    """A group_verdict result as summary.json holds it (no Holm fields: they are computed when read)."""
    seeds = list(range(next(iter({**input_figures, **(hidden or {})}.values()))["n_seeds"]))
    input_figures = {name: {"init": {"n": 0}, **f} for name, f in input_figures.items()}  # no step-0 value logged
    return {"label": label, "seeds": seeds, "n_draws": 2000, "input": input_figures, "hidden": hidden or {}, "attn": {}}


def _alone(v: dict) -> dict:
    """One verdict as the only test of its report (Holm p = Fisher p)."""
    return correct_report([_arm("arm", {"overlap_k8": v})])[0]["input"]["overlap_k8"]


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
    assert reading(_alone(v)) == "seeds on both sides of the null: no verdict (Holm p 2.4e-07)"


def test_readings_in_plain_words():
    at_null = combine_seeds([0.09, 0.11], [0.1, 0.1], [0.5, 0.4], [-0.1, 0.6], side="less")
    assert reading(_alone(at_null)) == "not distinguishable from the null (Holm p 0.52; 0/2 seeds p < 0.05, seeds on both sides)"
    aligned = combine_seeds([0.3, 0.3], [0.1, 0.1], [0.001, 0.002], [9, 8], side="less")
    assert reading(_alone(aligned)) == "above the null in all 2 seeds (Holm p 2.8e-05): more aligned than the null"
    probe = combine_seeds([0.4, 0.5], [0.0, 0.0], [0.01, 0.01], [6, 7], side="greater")
    assert (reading(_alone(probe), toward="position readable", away="below the null")
            == "above the null in all 2 seeds (Holm p 0.001): position readable")


def test_one_seed_of_three_below_the_null_is_not_separated():
    """The centred sinusoidal table once read "separated (not in every seed)" on one seed's p 0.044 (Fisher p 0.14)."""
    v = combine_seeds([0.09, 0.12, 0.10], [0.125, 0.125, 0.125], [0.044, 0.62, 0.3], [-2.0, -0.5, -1.0], side="less")
    assert v["fisher_p"] == pytest.approx(0.142, abs=1e-3)
    assert reading(_alone(v)) == "not distinguishable from the null (Holm p 0.14; 1/3 seeds p < 0.05)"


def _report_of_12_tests() -> list[dict]:
    """Three arms x four input figures: one arm clearly separated in every seed, one figure with strong seeds on both
    sides of its null, the rest at the null."""
    clear = combine_seeds([0.05, 0.06, 0.05], [0.125] * 3, [0.001] * 3, [-6, -5, -6], side="less")
    split = combine_seeds([0.05, 0.06, 0.2], [0.125] * 3, [0.001] * 3, [-6, -5, 6], side="less")
    null = combine_seeds([0.12, 0.13, 0.125], [0.125, 0.125, 0.124], [0.5, 0.6, 0.7], [-0.3, 0.2, 0.1], side="less")
    figures = ["overlap_k8", "var_share_P_in_E_k8", "abs_cos_mean", "angle_mean_k8_deg"]
    return [_arm("clear", dict.fromkeys(figures, clear)), _arm("split", {"overlap_k8": split, **dict.fromkeys(figures[1:], null)}),
            _arm("null", dict.fromkeys(figures, null))]


def test_holm_over_the_report_keeps_a_consistent_arm_and_rejects_seeds_on_both_sides():
    corrected = correct_report(_report_of_12_tests())
    clear, split, null = (v["input"]["overlap_k8"] for v in corrected)
    assert clear["n_tests"] == 12 and clear["fisher_p"] < 1e-6 < clear["holm_p"] < 1e-5
    assert reading(clear) == "below the null in all 3 seeds (Holm p 2.8e-06): separated"
    assert split["holm_p"] < 0.05 and reading(split).startswith("seeds on both sides of the null: no verdict (Holm p ")
    assert reading(null) == "not distinguishable from the null (Holm p 1; 0/3 seeds p < 0.05, seeds on both sides)"
    assert all("holm_p" not in f for v in _report_of_12_tests() for f in v["input"].values())  # the input is left as it was


def test_the_position_probe_is_a_test_of_the_same_report():
    probe = combine_seeds([0.9, 0.95], [0.0, 0.0], [1 / 21, 1 / 21], [200, 220], side="greater")
    corrected = correct_report([_arm("a", dict.fromkeys(["overlap_k8", "abs_cos_mean"], _report_of_12_tests()[0]["input"]["overlap_k8"]),
                                     {"position_r2": probe})])
    assert {f["n_tests"] for section in ("input", "hidden") for f in corrected[0][section].values()} == {3}
    assert corrected[0]["hidden"]["position_r2"]["holm_p"] == pytest.approx(probe["fisher_p"])  # the largest p: times 1


def test_holm_adjusted_p_values_by_hand():
    # sorted: 0.005 x 4 = 0.02, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04 -> 0.06 (never below an earlier step)
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.6]) == [1.0, 1.0]  # 0.5 x 2 capped at 1; 0.6 cannot pass where 0.5 failed
    assert holm([0.02]) == [0.02] and holm([]) == []


def test_holm_matches_statsmodels():
    multitest = pytest.importorskip("statsmodels.stats.multitest")  # not a dependency: checked where it is installed
    p = [0.001, 0.2, 0.013, 0.04, 0.0005, 0.9, 0.04]
    assert holm(p) == pytest.approx(list(multitest.multipletests(p, method="holm")[1]))


def test_verdict_table_shows_the_holm_column_and_its_family():
    from pe_geometry.analysis.report.markdown import compact_verdict_table, verdict_tables

    corrected = correct_report(_report_of_12_tests())
    text = "\n".join(verdict_tables(corrected))
    assert "| Fisher p | Holm p (m tests) | reading |" in text
    assert "Holm correction at α = 0.05 over the 12 arm × figure tests of this report (12 input-figure rows in all)" in text
    assert "every seed's effect has the same sign" in text and "cannot say the separation was *learned*" in text
    row = next(line for line in text.splitlines() if line.startswith("| clear | top-8 subspace overlap"))
    assert row.endswith("| 2.4e-07 | 2.8e-06 (12) | below the null in all 3 seeds (Holm p 2.8e-06): separated |")
    compact = "\n".join(compact_verdict_table(corrected, ["overlap_k8"]))
    assert "p per seed · Holm p (m tests)" in compact and "0.001, 0.001, 0.001 · 2.8e-06 (12) |" in compact


def test_verdict_script_puts_several_reports_in_one_table(tmp_path, capsys):
    """pe-verdict reads each report's summary.json (without Holm fields, as older ones are); rows keep the report's name
    and the arm, and each report is its own Holm family."""
    from pe_geometry.cli.verdict import main

    for name, observed, arms in (("controls_learned", [0.05, 0.06], 1), ("dose_response", [0.02, 0.03], 2)):
        v = combine_seeds(observed, [0.12, 0.12], [0.002, 0.004], [-4.0, -3.5], side="less")
        verdicts = [_arm(label, {"overlap_k8": v}) for label in ("learned", "sinusoidal")[:arms]]
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps({"verdict": verdicts}))
    text = main([str(tmp_path / "controls_learned"), str(tmp_path / "dose_response"), "--compact", "--figures", "overlap_k8"])
    rows = [line for line in text.splitlines() if line.startswith("| controls") or line.startswith("| dose")]
    assert rows[0].startswith("| controls_learned: learned | 2 | 0.055 (0.12) · -0.065 ± 0.007 · 0.002, 0.004 · 1.0e-04 (1) |")
    assert rows[1].startswith("| dose_response: learned | 2 | 0.025 (0.12) · -0.095 ± 0.007 · 0.002, 0.004 · 2.0e-04 (2) |")
    assert rows[0].endswith("| below the null in all 2 seeds (Holm p 1.0e-04): separated |")
    assert "m in the Holm column" in text  # two families: no single m to name
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "summary.json").write_text("{}")
    with pytest.raises(SystemExit):
        main([str(tmp_path / "empty")])
    assert "has no verdict" in capsys.readouterr().err


def test_update_report_rewrites_only_the_verdict_section(tmp_path, capsys):
    from pe_geometry.cli.verdict import main

    report = tmp_path / "report"
    report.mkdir()
    (report / "summary.json").write_text(json.dumps({"verdict": _report_of_12_tests(), "word_rows": {"position_probe": "x"}}))
    before = b"# Report\r\n\nGenerated today.\n\n"  # a CR LF too: the rest must come back byte for byte
    after = b"## Key figures\n\n| a | b |\n## Verdict is not this\n"
    (report / "report.md").write_bytes(before + b"## Verdict\n\nold text: separated (not in every seed)\n\n" + after)
    main(["--update-report", str(report)])
    text = (report / "report.md").read_bytes()
    assert text.startswith(before) and text.endswith(after)
    section = text[len(before):-len(after)].decode()
    assert section.startswith("## Verdict\n\n") and section.endswith("|\n\n") and "not in every seed" not in section
    assert "| Holm p (m tests) |" in section and "below the null in all 3 seeds (Holm p 2.8e-06): separated" in section
    (report / "report.md").write_text("# Report\n\n## Key figures\n")
    with pytest.raises(SystemExit):
        main(["--update-report", str(report)])
    assert "no '## Verdict' section" in capsys.readouterr().err


def test_a_literal_bar_in_a_cell_does_not_split_the_markdown_table():
    """"mean |cos|" in a cell once split it in two: every row must have as many cells as the header."""
    import re

    from pe_geometry.analysis.report.tables import md_table

    lines = md_table(["figure", "end"], [["mean |cos| over pairs", "0.1"], ["overlap", "0.2"], ["already \\| escaped", "0.3"]])
    counts = {len(re.split(r"(?<!\\)\|", line)) for line in lines if line}
    assert counts == {4}  # leading and trailing bar + one separator between two cells


def test_seeds_all_at_their_nulls_p_floor_are_not_called_indistinguishable():
    """The position probe's null has 20 cyclic shifts: no seed can go below 1/21, so three seeds at z > 200 cannot pass
    Holm over 18 tests. The reading says the null was too coarse, not that the figure is at the null."""
    from pe_geometry.analysis.study.verdict import correct_report

    floor = 1 / 21
    probe = combine_seeds([0.99, 0.99, 0.99], [0.0, 0.0, 0.0], [floor] * 3, [225.0, 234.0, 242.0], side="greater")
    others = [combine_seeds([0.1, 0.1, 0.1], [0.1, 0.1, 0.1], [0.5, 0.6, 0.7], [0.1, 0.2, 0.3], side="less")] * 17
    verdicts = [{"label": "a", "seeds": [0, 1, 2], "input": {f"f{i}": o for i, o in enumerate(others)},
                 "hidden": {"position_r2": probe}, "attn": {}}]
    corrected = correct_report(verdicts)[0]["hidden"]["position_r2"]
    assert corrected["holm_p"] > 0.05
    text = reading(corrected, toward="position readable", away="below the null")
    assert text.startswith("above the null in all 3 seeds, each at its null's p floor (0.048; z 225)") and "read z" in text
    uneven = correct_report([{**verdicts[0], "hidden": {"position_r2": {**probe, "p": [floor, 0.06, 0.3]}}}])
    assert reading(uneven[0]["hidden"]["position_r2"]).startswith("not distinguishable from the null")
    # one seed (a sweep's default) at z 256: the same floor, said so, not "not distinguishable" (issue 50 item 9)
    single = combine_seeds([0.99], [0.0], [floor], [256.0], side="greater")
    one = correct_report([{"label": "a", "seeds": [0], "input": {f"f{i}": combine_seeds([0.1], [0.1], [0.5], [0.1], side="less")
                                                                    for i in range(17)},
                           "hidden": {"position_r2": single}, "attn": {}}])[0]["hidden"]["position_r2"]
    assert reading(one).startswith("above the null in the only seed, at its null's p floor (0.048; z 256)")
    weak = {**one, "z": [1.9]}  # a small z: the p is the effect's, not the floor's
    assert reading(weak).startswith("not distinguishable from the null")
