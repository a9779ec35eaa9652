"""What a run's geometry records say at its end: a few summary lines and the W&B charts and table.

``records`` is ``GeometryCallback.records``: training step -> the metrics logged at that step. The
headline figures are read at the first record (initialisation) and the last, each beside its chance
and, where the record has one, its spectra-keeping null.
"""

from __future__ import annotations

from pe_geometry.analysis import metric_names as names
from pe_geometry.training.wandb_run import LineChart, Table

HEADLINE = tuple(names.input_metric(m) for m in ("abs_cos_mean", "overlap_k8", "angle_mean_k8_deg"))


def summary_lines(records: dict[int, dict[str, float]]) -> list[str]:
    """One line per headline figure the last record holds: its value at the first and last record, beside chance
    and the null (mean ± std, p) when logged. No records, no lines."""
    if not records:
        return []
    first, last = min(records), max(records)
    lines = []
    for name in HEADLINE:
        if name not in records[last]:
            continue
        chance = records[last].get(names.companion(name, "_chance"))
        at_init = records[first].get(name, float("nan"))
        beside = f"   chance {chance:.4f}" if chance is not None else ""
        null_mean, null_std, p_value = (records[last].get(names.companion(name, s)) for s in ("_null_mean", "_null_std", "_p"))
        if None not in (null_mean, null_std, p_value):  # the spectra-keeping null: is the end value an effect?
            beside += f"   null {null_mean:.4f} ± {null_std:.4f}, p {p_value:.3f}"
        lines.append(f"{name:<28} step {first}: {at_init:.4f}   step {last}: {records[last][name]:.4f}{beside}")
    return lines


def wandb_charts(records: dict[int, dict[str, float]]) -> dict[str, LineChart | Table]:
    """Each headline figure and its chance as one chart over the steps; the pairwise cos/angle table (the seed
    article's) at initialisation and at the end, each row with its chance and its Gaussian-matrix baseline."""
    if not records:
        return {}
    steps = sorted(records)
    first, last = records[steps[0]], records[steps[-1]]
    charts: dict[str, LineChart | Table] = {}
    for name in HEADLINE:
        chance = names.companion(name, "_chance")
        pts = [s for s in steps if name in records[s] and chance in records[s]]
        if pts:
            charts[f"charts/{name.removeprefix('geometry/')}_vs_chance"] = LineChart(
                xs=pts, ys=[[records[s][name] for s in pts], [records[s][chance] for s in pts]],
                keys=[name, chance], title=f"{name} and its chance")
    # the pairwise table's measures are the ones logged with a Gaussian-matrix baseline
    pairwise = sorted(k for k in last if names.companion(k, "_random") in last and not k.endswith(("_random", "_chance")))
    if pairwise:
        columns = ["measure", f"init (step {steps[0]})", f"end (step {steps[-1]})", "chance", "random matrices"]
        rows = [[k.removeprefix("geometry/"), first.get(k), last[k], last.get(names.companion(k, "_chance")),
                 last[names.companion(k, "_random")]] for k in pairwise]
        charts["tables/angle_table"] = Table(columns=columns, rows=rows)
    return charts
