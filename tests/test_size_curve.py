"""The dose-response across widths (analysis/study/size_curve.py, pe-verdict --by-size): ratios to the null, the trend
fitted through every seed, and the refusals that keep two sizes from being mixed up."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from pe_geometry.analysis.study.size_curve import size_points, trend
from pe_geometry.analysis.study.verdict import combine_seeds

SETUP = {"model": "DecoderLM", "n_layers": 2, "n_heads": 4, "seq_len": 64, "batch_size": 32, "max_steps": 1800}


def summary(d_model: int, arms: dict[str, tuple[list[float], list[float], list[float]]]) -> dict:
    """A report's summary.json at one width: per arm, observed, null mean and p per seed for the top-8 overlap."""
    verdicts = []
    for label, (observed, null, p) in arms.items():
        v = combine_seeds(observed, null, p, [-3.0] * len(p), side="less")
        verdicts.append({"label": label, "seeds": list(range(len(p))), "n_draws": 2000,
                         "input": {"overlap_k8": {**v, "init": {"n": 0}}}, "hidden": {}, "attn": {}})
    return {"setup": {**SETUP, "d_model": d_model}, "verdict": verdicts}


def test_ratio_is_each_seed_over_its_own_null_and_widths_are_sorted():
    reports = [("d128", summary(128, {"learned": ([0.02, 0.03], [0.0625, 0.06], [0.001, 0.2])})),
               ("d64", summary(64, {"learned": ([0.06, 0.09], [0.125, 0.12], [0.01, 0.02]), "sinusoidal": ([0.1], [0.125], [0.5])}))]
    curves = size_points(reports, "overlap_k8")
    assert [q.d_model for q in curves["learned"]] == [64, 128]
    assert curves["learned"][0].ratios == pytest.approx([0.48, 0.75])
    assert curves["learned"][1].ratios == pytest.approx([0.32, 0.5])
    # a seed counts as separated only below its null with p < 0.05
    assert curves["learned"][1].n_separated == 1 and curves["learned"][0].n_separated == 2
    assert len(curves["sinusoidal"]) == 1 and trend(curves["sinusoidal"]) is None
    # a seed exactly at 0 has no log: no line is fitted rather than a math error
    zero = size_points([("a", summary(64, {"x": ([0.0, 0.1], [0.1, 0.1], [0.01, 0.01])})),
                        ("b", summary(128, {"x": ([0.05, 0.05], [0.1, 0.1], [0.01, 0.01])}))], "overlap_k8")
    assert trend(zero["x"]) is None


def test_trend_is_the_least_squares_line_through_the_width_means_with_its_t_test():
    """Against numpy's polyfit and the textbook standard error of a slope, by hand, on one point per width: the seeds of
    a width are replicates, so 4 widths x 3 seeds is a test on 2 degrees of freedom, not 10."""
    rng = np.random.default_rng(0)
    widths, seeds = [32, 64, 128, 256], 3
    log_ratio = {d: [-0.6 * math.log2(d / 64) - 0.8 + rng.normal(0, 0.1) for _ in range(seeds)] for d in widths}
    reports = [(f"d{d}", summary(d, {"learned": ([0.1 * 2 ** y for y in log_ratio[d]], [0.1] * seeds, [0.01] * seeds)}))
               for d in widths]
    fit = trend(size_points(reports, "overlap_k8")["learned"])
    x = np.array([math.log2(d) for d in widths])
    y = np.array([np.mean(log_ratio[d]) for d in widths])
    slope, intercept = np.polyfit(x, y, 1)
    residual = y - (slope * x + intercept)
    se = math.sqrt(residual @ residual / (len(x) - 2) / ((x - x.mean()) @ (x - x.mean())))
    from scipy import stats as scipy_stats
    assert fit["slope"] == pytest.approx(slope, rel=1e-10) and fit["se"] == pytest.approx(se, rel=1e-10)
    assert fit["p"] == pytest.approx(2 * scipy_stats.t.sf(abs(slope / se), df=2), rel=1e-8)
    assert fit["df"] == 2 and fit["widths"] == widths and fit["seeds"] == [3] * 4 and -0.75 < fit["slope"] < -0.45
    # two widths: a line but no error for it, so no test
    assert trend(size_points(reports[:2], "overlap_k8")["learned"]) is None


def test_trends_are_holm_corrected_together_across_figures_and_arms():
    from pe_geometry.analysis.study.size_curve import correct_trends

    trends = {("overlap_k8", "learned"): {"p": 0.01}, ("overlap_k8", "sinusoidal"): {"p": 0.04},
              ("abs_cos_mean", "learned"): {"p": 0.03}, ("abs_cos_mean", "sinusoidal"): None}
    out = correct_trends(trends)
    assert out[("overlap_k8", "learned")]["holm_p"] == pytest.approx(0.03)  # 3 tests: 0.01 x 3
    assert out[("abs_cos_mean", "learned")]["holm_p"] == pytest.approx(0.06)  # 0.03 x 2
    assert out[("overlap_k8", "sinusoidal")]["holm_p"] == pytest.approx(0.06)  # 0.04 x 1, kept >= the one before
    assert out[("abs_cos_mean", "sinusoidal")] is None and {t["n_tests"] for t in out.values() if t} == {3}


def test_the_k_proportional_to_d_figures_are_read_from_their_own_section():
    d128 = summary(128, {"learned": ([0.05], [0.1], [0.01])})
    d128["verdict"][0]["input_kd8"] = {"overlap_kd8": d128["verdict"][0]["input"].pop("overlap_k8")}
    curves = size_points([("d64", summary(64, {"learned": ([0.06], [0.125], [0.01])})), ("d128", d128)], "overlap_kd8")
    assert [q.d_model for q in curves["learned"]] == [128]  # d64's report has no k = d/8 section: not read as one


def test_a_seed_missing_from_one_list_is_refused_not_paired_with_another_seeds_null():
    """The verdict drops a NaN from the observed values but not from the p-values: pairing the lists then would divide
    seed 1's value by seed 0's null."""
    reports = [("d64", summary(64, {"learned": ([math.nan, 0.05, 0.06], [0.2, 0.1, 0.125], [0.5, 0.01, 0.01])}))]
    with pytest.raises(ValueError, match="2 observed values, 3 null means and 3 p-values cannot be paired"):
        size_points(reports, "overlap_k8")


def test_reports_of_another_model_layout_are_not_one_curve():
    encoder = summary(128, {"learned": ([0.05], [0.1], [0.01])})
    encoder["setup"]["model"] = "EncoderMLM"
    with pytest.raises(ValueError, match="not sizes of one study.*EncoderMLM"):
        size_points([("d64", summary(64, {"learned": ([0.05], [0.1], [0.01])})), ("enc", encoder)], "overlap_k8")


def test_the_plotted_line_goes_through_the_mean_the_trend_is_fitted_on():
    from pe_geometry.analysis.study.size_curve import geometric_mean

    assert geometric_mean([0.25, 1.0]) == pytest.approx(0.5)  # 2 ** mean(-2, 0), not the arithmetic 0.625


def test_two_reports_with_one_arm_at_one_width_or_without_a_width_are_refused():
    arm = {"learned": ([0.05], [0.1], [0.01])}
    with pytest.raises(ValueError, match="'learned' at d_model 64 is in two reports"):
        size_points([("a", summary(64, arm)), ("b", summary(64, arm))], "overlap_k8")
    mixed = summary(64, arm)
    mixed["setup"]["d_model"] = None
    with pytest.raises(ValueError, match="no single d_model"):
        size_points([("mixed", mixed)], "overlap_k8")
    zero_null = summary(64, {"learned": ([0.05], [0.0], [0.01])})
    with pytest.raises(ValueError, match="null mean <= 0"):
        size_points([("zero", zero_null)], "overlap_k8")
    with pytest.raises(ValueError, match="no 'setup'"):
        size_points([("old", {"verdict": mixed["verdict"]})], "overlap_k8")


def test_pe_verdict_by_size_prints_the_curve_and_draws_it(tmp_path, capsys):
    from pe_geometry.cli.verdict import main

    for d, observed in ((64, [0.06, 0.07]), (128, [0.02, 0.025]), (256, [0.006, 0.008])):
        folder = tmp_path / f"d{d}"
        folder.mkdir()
        null = 8 / d
        arms = {"learned": (observed, [null, null], [0.001, 0.001]), f"only at {d}": ([null], [null], [0.9])}
        (folder / "summary.json").write_text(json.dumps(summary(d, arms)))
    folders = [str(tmp_path / f"d{d}") for d in (64, 128, 256)]
    text = main([*folders, "--by-size", "--figures", "overlap_k8", "--plot", str(tmp_path / "curve.png")])
    assert text.splitlines()[2] == (f"Made by `pe-verdict {' '.join(folders)} --by-size --figures overlap_k8 "
                                    f"--plot {tmp_path / 'curve.png'}` (analysis/study/size_curve.py).")
    rows = [line for line in text.splitlines() if line.startswith("| learned |")]
    assert rows[0].startswith("| learned | 64 | 2 layers, 1800 steps (d64) | 2 | 0.48, 0.56 | 0.52 ± 0.057 | 2/2 |")
    assert rows[1].startswith("| learned | 128 | 2 layers, 1800 steps (d128) | 2 | 0.32, 0.4 |")
    assert rows[3].startswith("| learned | 64, 128, 256 | -0.") and "(1 df) |" in rows[3]  # the trend row: 3 widths, 1 df
    assert "(1 tests) |" in rows[3]  # one figure x one fitted arm: Holm over 1 test
    assert "Left out, at one width only: only at 128, only at 256, only at 64." in text
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):  # the angle separates upwards: not a ratio below 1
        main([str(tmp_path / "d64"), str(tmp_path / "d128"), "--by-size", "--figures", "angle_mean_k8_deg"])
    assert "angle_mean_k8_deg is not one of" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one width: nothing to compare
        main([str(tmp_path / "d64"), "--by-size"])
    assert "no arm is in two reports of different widths" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(tmp_path / "d64"), "--plot", str(tmp_path / "x.png")])
    assert "use it with --by-size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(tmp_path / "d64"), str(tmp_path / "d128"), "--by-size", "--compact"])
    assert "choose one" in capsys.readouterr().err


def test_pe_verdict_by_size_says_what_it_could_not_fit_and_turns_bad_reports_into_one_error_line(tmp_path, capsys):
    from pe_geometry.cli.verdict import main

    two_seeds = {"learned": ([0.05, 0.06], [0.1, 0.1], [0.01, 0.01])}
    reports = {"a": summary(64, {"learned": ([0.05], [0.1], [0.01])}), "b": summary(128, {"learned": ([0.02], [0.05], [0.01])}),
               "c": summary(256, two_seeds)}
    reports["c"]["setup"]["max_steps"] = None  # runs of different lengths in one report
    reports["b"]["verdict"][0]["input"]["overlap_k8"]["step"] = 600  # a sweep still training: its weights at step 600
    for name, data in reports.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(data))
    text = main([str(tmp_path / "a"), str(tmp_path / "b"), "--by-size", "--figures", "overlap_k8", "abs_cos_mean",
                 "--plot", str(tmp_path / "new" / "folder" / "curve.png")])
    assert "No trend fitted for learned: fewer than 3 widths" in text  # 2 widths: no error for the slope
    assert "| learned | 128 | 2 layers, step 600 of 1800 (b) | 1 | 0.4 |" in text
    assert "No arm has this figure in two reports of different widths." in text  # abs_cos_mean is in neither
    assert (tmp_path / "new" / "folder" / "curve.png").is_file()
    text = main([str(tmp_path / "a"), str(tmp_path / "c"), "--by-size", "--figures", "overlap_k8"])
    assert "| learned | 256 | 2 layers, mixed steps (c) | 2 | 0.5, 0.6 |" in text
    reports["b"]["setup"]["model"] = "EncoderMLM"
    (tmp_path / "b" / "summary.json").write_text(json.dumps(reports["b"]))
    with pytest.raises(SystemExit):
        main([str(tmp_path / "a"), str(tmp_path / "b"), "--by-size"])
    assert "error: the reports are not sizes of one study" in capsys.readouterr().err


def test_a_size_read_at_its_best_validation_checkpoint_says_so_with_each_seeds_step():
    """A report made with pe-report --at best: its row names the steps, not the configured length as if run to it."""
    from pe_geometry.analysis.report.markdown import size_curve_table

    best = summary(256, {"learned": ([0.01, 0.012], [0.03125, 0.03125], [0.001, 0.001])})
    best["setup"]["max_steps"] = 18400
    best["verdict"][0]["at"] = "best"
    best["verdict"][0]["input"]["overlap_k8"].update(step=4800, seed_steps=[4200, 4800])
    curves = size_points([("d128", summary(128, {"learned": ([0.02], [0.0625], [0.001])})), ("d256", best)], "overlap_k8")
    assert [q.at for q in curves["learned"]] == ["last", "best"] and curves["learned"][1].seed_steps == [4200, 4800]
    rows = [line for line in size_curve_table(curves, {}) if line.startswith("| learned")]
    assert "1800 steps (d128)" in rows[0]
    assert "best val at steps 4200, 4800 of 18400 (d256)" in rows[1]
