"""The dose-response as a curve: each arm's separation against model width, read from several reports.

One report's verdict gives, per arm and seed, a figure's observed value and its null mean at one model
size. "Separation grows with size" is a claim about how the *ratio* observed / null mean moves from one
size to the next: the null itself moves with the width (the top-8 overlap's null is 8/d_model), so the
effect (observed - null) would shrink with d even where nothing changed, and the ratio is the figure that
is comparable across sizes (1 = at the null, below 1 = separated for the overlaps and |cos|).

The trend is tested on the width means: a least-squares line through one point per width, (log2 d_model,
the mean over seeds of log2 ratio), with the slope's standard error and a two-sided t-test p on n_widths - 2
degrees of freedom. The seeds of one width share everything but the seed, so they are replicates of one design
point, not independent points of the curve: fitting every seed would count each width several times and give
the slope too many degrees of freedom (with 3 widths, 1 is all there is). Each figure x arm is one test, and
``correct_trends`` adjusts their p's together (Holm): a curve read from several figures and arms is many tests.

Nothing checks that the reports differ in the width alone: the table prints each report's shape beside it, and
the width-only study (configs/experiment/width_curve.yaml) holds depth, head dimension, tokens and the
learning-rate rule fixed so that they do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from pe_geometry.extras import needs_extra

with needs_extra("report", "the size curve"):
    from scipy import stats as scipy_stats

from pe_geometry.analysis.measures.nulls import holm
from pe_geometry.analysis.study.verdict import SIGNIFICANCE


@dataclass
class SizePoint:
    """One arm of one report: its shape and, per seed, observed / null mean of one figure, with that seed's p."""
    label: str
    report: str
    setup: dict
    ratios: list[float]
    p: list[float]
    step: int | None = None  # the step of the weights the verdict measured (below max_steps while a sweep still runs)
    at: str = "last"  # which checkpoint: "best" = each run's lowest validation loss (pe-report --at best)
    seed_steps: list[int] = field(default_factory=list)  # the step each seed was measured at

    @property
    def d_model(self) -> int:
        return int(self.setup["d_model"])

    @property
    def n_separated(self) -> int:
        """Seeds below their null with p < 0.05 (the overlaps and |cos| separate downwards)."""
        return sum(1 for r, p in zip(self.ratios, self.p) if r < 1 and p < SIGNIFICANCE)


def report_setup(name: str, summary: dict) -> dict:
    """A report's shape (pe-report's summary.json "setup"); a clear error where it is missing or mixed."""
    setup = summary.get("setup")
    if not setup:
        raise ValueError(f"{name}: summary.json has no 'setup' (made before reports recorded the model's shape): "
                         f"run pe-report on its sweep again")
    if setup.get("d_model") is None:
        raise ValueError(f"{name}: its runs have no single d_model (they differ, or their configs lack it), so the report "
                         f"is not one size: report each size on its own")
    return setup


def seed_ratios(name: str, label: str, figure: str, f: dict) -> tuple[list[float], list[float]]:
    """Each seed's observed / null mean and its p, paired seed by seed. The verdict keeps one list per quantity; a
    list with a seed missing (a NaN dropped) would pair one seed's value with another's null, so it is refused."""
    observed, null, p = f["observed"].get("values") or [], f["null_mean"].get("values") or [], list(f["p"])
    if not len(observed) == len(null) == len(p):
        raise ValueError(f"{name}: arm {label!r}, {figure}: {len(observed)} observed values, {len(null)} null means and "
                         f"{len(p)} p-values cannot be paired seed by seed (a seed's value is missing or NaN)")
    if any(m <= 0 for m in null):
        raise ValueError(f"{name}: arm {label!r} has a null mean <= 0 for {figure}, so no ratio to it")
    return [o / m for o, m in zip(observed, null)], p


def size_points(reports: list[tuple[str, dict]], figure: str) -> dict[str, list[SizePoint]]:
    """Every arm's point per report, keyed by the arm's label and sorted by width. Arms are matched across reports
    by label (a sweep names its arms by PE type and control, so 'learned' at d 64 and 'learned' at d 128 are one
    curve). Refused, since the curve would mean nothing: two reports with the same arm at the same width (which one
    to plot is ambiguous), and reports of different model layouts or sequence lengths (a decoder at one width and an
    encoder at the next are not one curve)."""
    curves: dict[str, list[SizePoint]] = {}
    kinds: dict[tuple, str] = {}
    for name, summary in reports:
        setup = report_setup(name, summary)
        kinds.setdefault((setup.get("model"), setup.get("seq_len")), name)
        for v in summary.get("verdict") or []:
            f = v["input"].get(figure) or (v.get("input_kd8") or {}).get(figure)
            if f is None:
                continue
            ratios, p = seed_ratios(name, v["label"], figure, f)
            if not ratios:
                continue
            point = SizePoint(v["label"], name, setup, ratios, p, f.get("step"), v.get("at", "last"), f.get("seed_steps", []))
            same = [q for q in curves.get(v["label"], []) if q.d_model == point.d_model]
            if same:
                raise ValueError(f"arm {v['label']!r} at d_model {point.d_model} is in two reports ({same[0].report}, "
                                 f"{name}): give one report per size")
            curves.setdefault(v["label"], []).append(point)
    if len(kinds) > 1:
        described = "; ".join(f"{name}: {model}, seq_len {seq}" for (model, seq), name in kinds.items())
        raise ValueError(f"the reports are not sizes of one study (model layout or seq_len differ: {described})")
    return {label: sorted(points, key=lambda q: q.d_model) for label, points in curves.items()}


def trend(points: list[SizePoint]) -> dict | None:
    """The least-squares line of the width means of log2(ratio) on log2(d_model) (see the module docstring); None with
    fewer than three widths (no error for the slope) and where a ratio is 0 (no log)."""
    if any(r <= 0 for q in points for r in q.ratios) or len({q.d_model for q in points}) < 3:
        return None
    xs = np.array([math.log2(q.d_model) for q in points])
    ys = np.array([float(np.mean(np.log2(q.ratios))) for q in points])
    fit = scipy_stats.linregress(xs, ys)
    return {"slope": float(fit.slope), "se": float(fit.stderr), "p": float(fit.pvalue), "df": len(xs) - 2,
            "widths": [q.d_model for q in points], "seeds": [len(q.ratios) for q in points]}


def correct_trends(trends: dict[tuple[str, str], dict | None]) -> dict[tuple[str, str], dict | None]:
    """Each fitted trend (keyed by (figure, arm)) with ``holm_p`` and ``n_tests``: Holm over every trend fitted."""
    fitted = [key for key, t in trends.items() if t]
    adjusted = holm([trends[key]["p"] for key in fitted])
    out = dict(trends)
    for key, q in zip(fitted, adjusted):
        out[key] = {**trends[key], "holm_p": q, "n_tests": len(fitted)}
    return out


def geometric_mean(ratios: list[float]) -> float:
    """The mean the trend is fitted on (a mean of log2 ratios), back on the ratio scale: the plotted line's points."""
    return float(2 ** np.mean(np.log2(ratios)))
