"""The report's figures: one per geometry measure family, the losses, an overview and length extrapolation.

Every figure: one line per group (PE type) = mean over seeds, band = min–max over seeds, and the
measure's logged baselines (``analysis.metric_names.COMPANIONS``) in black or in each group's colour.
"""

from __future__ import annotations

import math
import re
import textwrap
from pathlib import Path

from pe_geometry.extras import needs_extra

with needs_extra("report", "the report"):
    import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator  # noqa: E402

from pe_geometry.analysis import metric_names as names  # noqa: E402
from pe_geometry.analysis.metric_names import COMPANIONS, TRAIN_LOSS, VAL_LOSS, MetricName  # noqa: E402
from pe_geometry.analysis.readers.runs import Group, aggregate, n_layers_of  # noqa: E402
from pe_geometry.analysis.report.tables import NA, fmt  # noqa: E402
from pe_geometry.analysis.study.size_curve import geometric_mean  # noqa: E402

STYLE = {
    "axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False, "axes.spines.right": False,
    "font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10, "legend.fontsize": 9, "figure.titlesize": 12,
}
# Hidden-state panels show the input of the last block: the deepest representation that still has to carry
# position for attention to use. The model output only predicts the next token and sheds position.
OVERVIEW_INPUT = ["abs_cos_mean", "overlap_k8", "var_share_P_in_E_k8", "norm_ratio_p_over_e"]
OVERVIEW_HIDDEN = ["position_r2"]
OLD_PROBE = {"position_r2": "position_probe_r2"}  # runs logged before the powered probe existed


def figure_name(name: MetricName) -> str:
    """File name of the figure of a measure family: <section>_<measure>.png."""
    return f"{name.section}_{re.sub(r'[^A-Za-z0-9_.-]+', '_', name.measure)}.png"


def overview_keys(n_layers: int) -> list[str]:
    """The overview's geometry panels: input level, then the last block's input."""
    probe = names.last_block_input(n_layers)
    return [names.input_metric(m) for m in OVERVIEW_INPUT] + [names.hidden_metric(probe, m) for m in OVERVIEW_HIDDEN]


def smooth(values: np.ndarray, span: float) -> np.ndarray:
    """Bias-corrected exponential moving average over ``span`` points."""
    alpha = 2.0 / (span + 1.0)
    out, avg, weight = np.empty_like(values, dtype=float), 0.0, 0.0
    for i, v in enumerate(values):
        avg, weight = (1 - alpha) * avg + alpha * v, (1 - alpha) * weight + alpha
        out[i] = avg / weight
    return out


def point_style(n_points: int) -> dict:
    """Marker settings for a line through n_points: a sparse line shows its points, and a line through one or two
    points (a short run's only validation, its only logged training loss) draws little or nothing without a marker
    big enough to see."""
    if n_points >= 30:
        return {"marker": None}
    return {"marker": "o", "ms": 6 if n_points <= 2 else 3}


def stacked_widths(n: int, thinnest: float = 1.2, thickest: float = 3.2) -> list[float]:
    """Line widths for n lines drawn in turn: the first thickest, each later one thinner, so a line drawn on top of an
    equal one (two arms with the same loss) leaves the one below showing at its edges instead of hiding it."""
    if n <= 1:
        return [1.8] * n
    return [thickest - (thickest - thinnest) * i / (n - 1) for i in range(n)]


def _plot_group_line(ax, group: Group, key: str, label: str | None, lw: float = 1.8) -> bool:
    agg = aggregate([r.series[key] for r in group.runs if key in r.series])
    if agg is None:
        return False
    steps, mean, lo, hi = agg
    ax.plot(steps, mean, group.style, color=group.color, lw=lw, label=label, **point_style(len(steps)))
    if len(group.runs) > 1:
        ax.fill_between(steps, lo, hi, color=group.color, alpha=0.15, lw=0)
    return True


def _train_loss(group: Group):
    """(steps, mean, min, max) over seeds of the training loss, each seed smoothed (EMA over ~1/12 of its points)."""
    train = [r.series[TRAIN_LOSS] for r in group.runs if TRAIN_LOSS in r.series]
    return aggregate([(s, smooth(v, max(1.0, len(v) / 12))) for s, v in train])


def _plot_baseline(ax, groups: list[Group], key: str, suffix: str):
    """Draw key+suffix: one labelled horizontal line if it is the same constant for every run; else one thin
    line per PE type in its colour (a baseline that depends on the run, e.g. chance for a subspace whose
    dimension the run's own spectrum sets, must be read against its own PE type, not a pooled mean).

    Returns a black legend handle (for the panel's own legend) or None if no run logged this baseline.
    """
    per_group = [(g, agg) for g in groups if (agg := aggregate([r.series[key + suffix] for r in g.runs if key + suffix in r.series]))]
    if not per_group:
        return None
    style, text = COMPANIONS[suffix]
    values = np.concatenate([np.concatenate([lo, hi]) for _, (_, _, lo, hi) in per_group])
    lo_all, hi_all = float(np.nanmin(values)), float(np.nanmax(values))
    if hi_all - lo_all <= 1e-9 + 1e-6 * abs(hi_all):
        return ax.axhline(hi_all, color="black", ls=style, lw=1.2, label=f"{text} = {fmt(hi_all)}", zorder=1)
    for g, (steps, mean, _, _) in per_group:
        ax.plot(steps, mean, color=g.color, ls=style, lw=1.0, alpha=0.8, zorder=1)
        spread = aggregate([r.series[key + "_null_std"] for r in g.runs if key + "_null_std" in r.series])
        if suffix == "_null_mean" and spread is not None and len(spread[0]) == len(steps):  # the null's ±2 std band
            ax.fill_between(steps, mean - 2 * spread[1], mean + 2 * spread[1], color=g.color, alpha=0.08, lw=0, zorder=0)
    note = " ± 2 std band" if suffix == "_null_mean" else ""
    # wrapped: a legend wider than its panel pushes the layout (and once pushed a y-label off the figure)
    return Line2D([], [], color="black", ls=style, lw=1.0, label=textwrap.fill(f"{text}{note} (each PE type, its colour)", 56))


def _baselines(ax, groups: list[Group], key: str) -> None:
    """Every logged baseline of key, with a small legend inside the panel (each panel has its own levels)."""
    lines = [line for suffix in COMPANIONS if (line := _plot_baseline(ax, groups, key, suffix)) is not None]
    if lines:  # below the panel: inside it, the legend hid the curves whatever place "best" chose
        ax.legend(handles=lines, loc="upper center", bbox_to_anchor=(0.5, -0.2), fontsize=7, frameon=False)


def _log_if_wide(ax, ratio: float = 20.0) -> None:
    """Log y axis when the plotted positive values span more than ``ratio`` (norms of e vs p, say)."""
    values = np.concatenate([line.get_ydata() for line in ax.get_lines()] or [np.array([])]).astype(float)
    values = values[np.isfinite(values)]
    if len(values) and values.min() > 0 and values.max() / values.min() > ratio:
        ax.set_yscale("log")


def _grid(n: int) -> tuple[int, int]:
    ncols = min(n, 3) if n != 4 else 2
    return math.ceil(n / ncols), ncols


def overhang(fig) -> float:
    """How far (inches) anything drawn reaches past the figure's edges: 0 when every label lies inside."""
    box = fig.get_tightbbox(fig.canvas.get_renderer())
    return max(0.0, -box.x0, -box.y0, box.x1 - fig.get_figwidth(), box.y1 - fig.get_figheight())


def _finish(fig, path: Path, groups: list[Group]) -> None:
    """One figure legend for the PE types (colour) and model layouts (line style); save; close."""
    handles = [Line2D([], [], color=g.color, ls=g.style, lw=2, label=g.label) for g in groups]
    if handles:
        title = "PE type" if len({g.model for g in groups}) == 1 else "model / PE type"
        fig.legend(handles=handles, loc="outside right center", frameon=False, title=title)  # upper: under a wide title
    # Constrained layout sizes the axes from the tick labels it finds before resizing them; the resized axes can get
    # longer tick labels (0.30 -> 0.325) that push a y-label past the edge. Each draw lays out again with the ticks of
    # the last one, which settles in a draw or two. Should anything still stick out, the PNG grows to hold it.
    for _ in range(3):
        fig.canvas.draw()
        if overhang(fig) <= 0.01:
            break
    fig.savefig(path, bbox_inches="tight" if overhang(fig) > 0.01 else None)
    plt.close(fig)


def _band_note(groups: list[Group]) -> str:
    seeds = sorted({len(g.runs) for g in groups})
    if seeds == [1]:
        return "one seed per PE type: its line (no band over seeds)"
    if len(seeds) == 1:
        return f"line: mean over {seeds[0]} seeds; band: min–max over seeds"
    return f"line: mean over each PE type's seeds ({'/'.join(map(str, seeds))}); band: min–max over seeds"


def plot_family(family: str, members: list[MetricName], groups: list[Group], path: Path) -> bool:
    """One panel per member (layer or head), one line per group; False if no group logged the family."""
    title, ylabel = names.describe(members[0].measure)
    present = [g for g in groups if any(m.key in r.series for m in members for r in g.runs)]
    if not present:
        return False
    rows, cols = _grid(len(members))
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(rows, cols, figsize=(max(4.3 * cols + 2.6, 9.0), 3.4 * rows + 0.8), squeeze=False,
                                 sharey=len(members) > 1, layout="constrained")
        for ax in axes.flat[len(members):]:
            ax.set_visible(False)
        for ax, member in zip(axes.flat, members):
            for g in present:
                _plot_group_line(ax, g, member.key, g.label)
            _baselines(ax, present, member.key)
            if member.panel is not None:
                ax.set_title(names.panel_title(member.panel, member.index, n_layers_of(present[0])))
            if member.measure.startswith("norm"):
                _log_if_wide(ax)
            ax.set_xlabel("training step")
            if len(members) == 1 or ax.get_subplotspec().is_first_col():
                ax.set_ylabel(ylabel)
        fig.suptitle(f"{title}\n{_band_note(present)}")
        _finish(fig, path, present)
    return True


def plot_loss(groups: list[Group], path: Path) -> bool:
    """Training loss (smoothed) and validation loss per group, side by side on one step axis."""
    if not any(TRAIN_LOSS in r.series or VAL_LOSS in r.series for g in groups for r in g.runs):
        return False
    with plt.rc_context(STYLE):
        # one step axis: a short run's single validation point sits where it was taken, beside the training curve
        fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(11.5, 4.2), layout="constrained", sharey=True, sharex=True)
        for g, lw in zip(groups, stacked_widths(len(groups))):
            agg = _train_loss(g)
            if agg is not None:
                steps, mean, lo, hi = agg
                ax_train.plot(steps, mean, g.style, color=g.color, lw=lw, label=g.label, **point_style(len(steps)))
                ax_train.fill_between(steps, lo, hi, color=g.color, alpha=0.15, lw=0)
            _plot_group_line(ax_val, g, VAL_LOSS, g.label, lw)
        ax_train.set_title("training loss (exponential moving average)")
        ax_val.set_title("validation loss")
        for ax in (ax_train, ax_val):
            ax.set_xlabel("training step")
            ax.set_xlim(left=0)
        ax_train.set_ylabel("cross-entropy (nats / token)")
        fig.suptitle(f"Loss per PE type\n{_band_note(groups)}")
        _finish(fig, path, groups)
    return True


def _plot_loss_panel(ax, groups: list[Group]) -> None:
    """The overview's loss panel: each group's smoothed training loss (thin) and validation loss (dots), so a run with
    one validation still shows how its loss went."""
    for g, lw in zip(groups, stacked_widths(len(groups))):
        agg = _train_loss(g)
        if agg is not None:
            steps, mean, _, _ = agg
            ax.plot(steps, mean, g.style, color=g.color, lw=lw * 0.6, alpha=0.6, **point_style(len(steps)))
        _plot_group_line(ax, g, VAL_LOSS, g.label, lw)
    ax.set_title("loss", fontsize=9.5)
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_xlim(left=0)
    # the arms' colours are the figure's legend; this one says which of each arm's two lines is which
    handles = [Line2D([], [], color="grey", lw=1.0, alpha=0.6, label="training (moving average), colour = arm"),
               Line2D([], [], color="grey", lw=1.8, marker="o", ms=3, label="validation, colour = arm")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.2), fontsize=7, frameon=False)


def _or_older(key: str, logged: set[str]) -> str:
    """key, or the name an older run logged the same panel under (OLD_PROBE) when key itself was not logged."""
    for new, old in OLD_PROBE.items():
        if key.endswith("/" + new) and key not in logged:
            return key[: -len(new)] + old
    return key


def plot_overview(groups: list[Group], path: Path) -> bool:
    n_layers = max((n_layers_of(g) or 0) for g in groups)
    logged = {k for g in groups for r in g.runs for k in r.series}
    keys = [k for k in (_or_older(k, logged) for k in overview_keys(n_layers)) if k in logged]
    panels = [VAL_LOSS, *keys] if VAL_LOSS in logged or TRAIN_LOSS in logged else keys
    if not panels:
        return False
    rows, cols = _grid(len(panels))
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(rows, cols, figsize=(4.3 * cols + 2.6, 3.4 * rows + 0.6), squeeze=False, layout="constrained")
        for ax in axes.flat[len(panels):]:
            ax.set_visible(False)
        for ax, key in zip(axes.flat, panels):
            present = [g for g in groups if any(key in r.series for r in g.runs)]
            if key == VAL_LOSS:
                _plot_loss_panel(ax, groups)
            else:
                for g in present:
                    _plot_group_line(ax, g, key, g.label)
                name = names.parse(key)
                title, ylabel = names.describe(name.measure)
                title = textwrap.fill(title, 48)
                if name.panel is not None:
                    title += f"\n({names.panel_title(name.panel, name.index, n_layers)})"
                ax.set_title(title, fontsize=9.5)
                ax.set_ylabel(ylabel)
                _baselines(ax, present, key)
                if name.measure.startswith("norm"):
                    _log_if_wide(ax)
            ax.set_xlabel("training step")
        fig.suptitle(f"Overview: loss, input-level and hidden-state geometry per PE type\n{_band_note(groups)}")
        _finish(fig, path, groups)
    return True


def plot_extrapolation(groups: list[Group], table: dict, path: Path) -> bool:
    multipliers = sorted({int(m) for g in table.values() for m in g["lengths"]})
    if not multipliers:
        return False
    seq_lens = {g["train_seq_len"] for g in table.values() if g.get("train_seq_len")}
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(8.5, 4.4), layout="constrained")
        offsets = np.linspace(-0.04, 0.04, len(groups)) if len(groups) > 1 else [0.0]  # side by side; one group on its tick
        n_missing = 0
        for offset, g in zip(offsets, groups):
            entry = table.get(g.label)
            if entry is None:
                continue
            xs, ys, lo, hi, missing = [], [], [], [], []
            for m in multipliers:
                cell = entry["lengths"].get(str(m))
                if cell is None:
                    continue
                if cell["loss"] == NA or cell["loss"].get("n", 0) == 0:
                    missing.append(m)
                    continue
                s = cell["loss"]
                xs.append(m * 2**offset)
                ys.append(s["mean"])
                lo.append(s["mean"] - s["min"])
                hi.append(s["max"] - s["mean"])
            if xs:
                ax.errorbar(xs, ys, yerr=[lo, hi], fmt=g.style, marker="o", color=g.color, lw=1.8, capsize=3, label=g.label)
            for m in missing:  # a length this PE cannot take (learned table too short): say so where its point would be
                ha = {multipliers[0]: "left", multipliers[-1]: "right"}.get(m, "center")
                ax.annotate(f"{g.label}: n/a", (m, 0.96 - 0.07 * n_missing), xycoords=("data", "axes fraction"), color=g.color,
                            fontsize=8.5, ha=ha, va="top", bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": g.color})
                n_missing += 1
        if n_missing:  # headroom for the n/a labels
            low, high = ax.get_ylim()
            ax.set_ylim(low, high + (high - low) * (0.08 + 0.09 * n_missing))
        ax.set_xscale("log", base=2)
        seq = next(iter(seq_lens)) if len(seq_lens) == 1 else None
        ax.set_xticks(multipliers)
        ax.set_xticklabels([f"{m}×" + (f"\n({m * seq} tokens)" if seq else "") for m in multipliers])
        ax.set_xlabel("evaluation block length (multiple of the training seq_len)")
        ax.set_ylabel("validation cross-entropy (nats / token)")
        n_tokens = {g.get("n_target_tokens") for g in table.values()}
        same = f"the same {next(iter(n_tokens)):,} target tokens at every length; " if len(n_tokens) == 1 else ""
        spread = "one seed per PE type" if all(len(g.runs) == 1 for g in groups) else "mean over seeds, bars: min–max"
        ax.set_title(f"Length extrapolation: validation loss on longer blocks\n{same}{spread}")
        _finish(fig, path, [g for g in groups if g.label in table])
    return True


def plot_size_curve(panels: list[tuple[str, dict]], path: Path) -> bool:
    """The dose-response across widths: one panel per figure (title, {arm: [SizePoint]}), each seed a dot, the line
    through each width's geometric mean (the mean the trend is fitted on, in log2); the dashed line at 1 is the null.
    False if no arm has two widths."""
    panels = [(title, curves) for title, curves in panels if any(len(points) > 1 for points in curves.values())]
    if not panels:
        return False
    labels = sorted({label for _, curves in panels for label in curves})
    colours = {label: f"C{i}" for i, label in enumerate(labels)}
    with plt.rc_context(STYLE):
        cols = min(len(panels), 3)  # five figures in one row were too small to read
        rows = -(-len(panels) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols + 2.4, 3.8 * rows + 0.2), squeeze=False, layout="constrained")
        for ax in axes.flat[len(panels):]:
            ax.set_visible(False)
        for ax, (title, curves) in zip(axes.flat, panels):
            widths = sorted({q.d_model for points in curves.values() for q in points})
            for label, points in curves.items():
                xs = [q.d_model for q in points]
                ax.plot(xs, [geometric_mean(q.ratios) for q in points], "-", color=colours[label], lw=1.8)
                for q in points:  # hollow: measured at the run's best-validation checkpoint, not at its end
                    ax.plot([q.d_model] * len(q.ratios), q.ratios, "o", color=colours[label], ms=4, alpha=0.7,
                            mfc="none" if q.at == "best" else colours[label])
            ax.axhline(1.0, color="black", ls="--", lw=1.2)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log", base=2)
            # plain numbers (0.25, 0.375, 0.5, ...) rather than powers of two: the ratio is read as a fraction of the null
            ax.yaxis.set_minor_locator(LogLocator(base=2, subs=(1.5,)))
            for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
                axis(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.set_xticks(widths, [str(d) for d in widths])
            ax.set_xlabel("d_model")
            ax.set_ylabel("measured / null mean")
            ax.set_title(textwrap.fill(title, 40))
        handles = [Line2D([], [], color=colours[lb], marker="o", lw=1.8, label=lb) for lb in labels]
        if any(q.at == "best" for _, curves in panels for points in curves.values() for q in points):
            handles.append(Line2D([], [], color="grey", marker="o", mfc="none", ls="none", label="at the best-validation step"))
        handles.append(Line2D([], [], color="black", ls="--", lw=1.2, label="the null (ratio 1)"))
        fig.legend(handles=handles, loc="outside right upper", frameon=False, title="arm (dots: seeds)")
        fig.savefig(path)
        plt.close(fig)
    return True
