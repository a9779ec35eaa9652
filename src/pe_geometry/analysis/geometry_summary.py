"""What a run's geometry records say at its end: a few summary lines and the W&B charts and table.

``records`` is ``GeometryCallback.records``: training step -> the metrics logged at that step. The
headline figures are read at the first record (initialisation) and the last, each beside its chance
and, where the record has one, its spectra-keeping null.
"""

from __future__ import annotations

import re

from pe_geometry.analysis import metric_names as names
from pe_geometry.training.wandb_run import LineChart, Table

HEADLINE = tuple(names.input_metric(m) for m in ("abs_cos_mean", "overlap_k8", "angle_mean_k8_deg"))


def summary_lines(records: dict[int, dict[str, float]], n_shifts: int = 20) -> list[str]:
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
        lines.append(f"{name:<36} step {first}: {at_init:.4f}   step {last}: {records[last][name]:.4f}{beside}")
    return lines + probe_line(records, n_shifts) + attention_lines(records)


def _first_and_last(records: dict[int, dict[str, float]], key: str) -> tuple[int, int] | None:
    steps = [s for s in sorted(records) if key in records[s]]
    return (steps[0], steps[-1]) if steps else None


def probe_line(records: dict[int, dict[str, float]], n_shifts: int = 20) -> list[str]:
    """The position probe at the last block's input (the verdict's, every PE type has one), beside its null of
    ``n_shifts`` label shifts (its p's floor is 1 / (n_shifts + 1), said as a floor, not a p)."""
    layers = {int(m.group(1)) for r in records.values() for k in r
              if (m := re.fullmatch(rf"{names.PREFIX}/hidden/layer(\d+)/position_r2", k))}
    if not layers:
        return []
    layer = names.last_block_input(max(layers))  # the highest index is the stack's output, n_layers
    key = names.hidden_metric(layer, "position_r2")
    first, last = _first_and_last(records, key)
    null_mean, p_value, z = (records[last].get(names.companion(key, s)) for s in ("_null_mean", "_p", "_z"))
    beside = ""
    if None not in (null_mean, p_value):
        floor = 1 / (n_shifts + 1)
        # the shift null's p cannot go below 1/(n + 1): at the floor it is not a test result, z carries the reading
        said = (f"p at its floor {floor:.3f} ({n_shifts} shifts; read z)" if p_value <= floor * (1 + 1e-9)
                else f"p {p_value:.3f}")
        beside = f"   null {null_mean:.4f}, {said}" + (f", z {z:.0f}" if z is not None and z == z else "")
    return [f"{'position probe R² (block ' + str(layer) + ' input)':<36} step {first}: {records[first][key]:.4f}   "
            f"step {last}: {records[last][key]:.4f}{beside}"]


def _head_mean(record: dict[str, float], keys: list[str], suffix: str = "") -> float:
    """The mean over heads of key + suffix in one record (NaN where a head did not log it)."""
    return sum(record.get(k + suffix, float("nan")) for k in keys) / len(keys)


def attention_lines(records: dict[int, dict[str, float]]) -> list[str]:
    """Block 0 over its heads: the share of score variance from position (beside its rotation null where the encoding
    has one, RoPE/xPos) and how far the heads look (beside uniform attention's distance)."""
    last_record = records[max(records)]
    heads = sorted({int(m.group(1)) for k in last_record if (m := re.fullmatch(rf"{names.PREFIX}/attn/head(\d+)/positional_share", k))})
    lines = []
    for label, term, baseline, baseline_label in (("positional share", "positional", "_null_mean", "null"),
                                                  ("mean distance", None, "_chance", "uniform")):
        keys = [names.attention_share_metric(h, term) if term else names.attention_distance_metric(h) for h in heads]
        span = _first_and_last(records, keys[0]) if keys else None
        if span is None:
            continue
        first, last = span
        base = _head_mean(records[last], keys, baseline)
        beside = f"   {baseline_label} {base:.4f}" if base == base else ""  # NaN: no baseline logged
        lines.append(f"{'block 0 ' + label + ' (' + str(len(keys)) + ' heads)':<36} step {first}: "
                     f"{_head_mean(records[first], keys):.4f}   step {last}: {_head_mean(records[last], keys):.4f}{beside}")
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
