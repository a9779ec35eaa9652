"""The dose-response as a curve: each arm's separation against model width, read from several reports.

One report's verdict gives, per arm and seed, a figure's observed value and its null mean at one model
size. "Separation grows with size" is a claim about how the *ratio* observed / null mean moves from one
size to the next: the null itself moves with the width (the top-8 overlap's null is 8/d_model), so the
effect (observed - null) would shrink with d even where nothing changed, and the ratio is the figure that
is comparable across sizes (1 = at the null, below 1 = separated for the overlaps and |cos|).

The trend is a least-squares line through every seed's point (log2 d_model, log2 ratio): its slope is
the change in log2(ratio) per doubling of the width (-1 = the ratio halves with each doubling), with the
slope's standard error and a two-sided t-test p (n points - 2 degrees of freedom). Seeds are independent
runs, so each is a point; sizes with more seeds weigh more. The sizes differ in more than the width
(depth and training length grow with them: each size's shape is printed beside it), so the slope is that
of the whole recipe, not of d_model alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from pe_geometry.extras import needs_extra

with needs_extra("report", "the size curve"):
    from scipy import stats as scipy_stats

from pe_geometry.analysis.verdict import SIGNIFICANCE


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
            f = v["input"].get(figure)
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
    """Least squares of log2(ratio) on log2(d_model) over every seed (see the module docstring); None with fewer
    than two widths or three seed points, where no line or no error can be fitted, and where a ratio is 0 (no log)."""
    if any(r <= 0 for q in points for r in q.ratios):
        return None
    xs = [math.log2(q.d_model) for q in points for _ in q.ratios]
    ys = [math.log2(r) for q in points for r in q.ratios]
    if len({q.d_model for q in points}) < 2 or len(xs) < 3:
        return None
    fit = scipy_stats.linregress(np.array(xs), np.array(ys))
    return {"slope": float(fit.slope), "se": float(fit.stderr), "p": float(fit.pvalue), "n": len(xs),
            "widths": sorted({q.d_model for q in points})}


def geometric_mean(ratios: list[float]) -> float:
    """The mean the trend is fitted on (a mean of log2 ratios), back on the ratio scale: the plotted line's points."""
    return float(2 ** np.mean(np.log2(ratios)))
