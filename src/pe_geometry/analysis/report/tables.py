"""Numbers as table cells: formatting, markdown tables, one table per measure family."""

from __future__ import annotations

import math
import re

from pe_geometry.analysis.metric_names import COMPANIONS, MetricName
from pe_geometry.analysis.readers.runs import Group

NA = "n/a"  # what analysis.extrapolation writes for a length a model cannot take


def count(n, noun: str, plural: str | None = None) -> str:
    """'1 seed', '3 seeds': a number and its noun, singular for one (plural for anything else, '?' say)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def seed_list(seeds: list[int]) -> str:
    """'seed 0', 'seeds 0, 1, 2'."""
    return f"{'seed' if len(seeds) == 1 else 'seeds'} {', '.join(map(str, seeds))}"


def fmt(value, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    if isinstance(value, str):
        return value
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
        return f"{value:.{digits - 1}e}"
    return f"{value:.{digits}g}"


def fmt_stats(s: dict, digits: int = 4) -> str:
    if not s or s.get("n", 0) == 0:
        return "–"
    if s["n"] == 1:
        return fmt(s["mean"], digits)
    return f"{fmt(s['mean'], digits)} ± {fmt(s['std'], 2)}"


def _cell(value) -> str:
    """A table cell: a literal | (as in "mean |cos|") escaped, or markdown would split the cell there."""
    return re.sub(r"(?<!\\)\|", r"\\|", str(value))


def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines + [""]


def _baseline_cell(summary: dict, name: str) -> str:
    b = summary.get(name)
    if not b:
        return ""
    i, e = b["init"]["mean"], b["end"]["mean"]
    if i is None or e is None:
        return "–"
    if abs(i - e) <= 1e-9 + 1e-6 * abs(e):
        return fmt(e)
    return f"{fmt(i)} → {fmt(e)}"


def measure_rows(groups: list[Group], members: list[MetricName], summaries: dict) -> tuple[list[str], list[list[str]]]:
    """Header and rows of a measure family's table: one row per group (and layer/head), init, end, baselines."""
    kind = members[0].panel
    baselines = [s.lstrip("_") for s in COMPANIONS if any(s.lstrip("_") in (summaries.get((g.label, m.key)) or {})
                                                         for g in groups for m in members)]
    found = [s for g in groups for m in members if (s := summaries.get((g.label, m.key)))]
    end_steps = {s["end_step"] for s in found}
    end_header = f"end (step {end_steps.pop()})" if len(end_steps) == 1 else "end"
    header = ["PE type"] + ([kind] if kind else []) + ["init (step 0)", end_header, *baselines, "end − init", "n seeds"]
    rows = []
    for g in groups:
        for member in members:
            s = summaries.get((g.label, member.key))
            if s is None:
                continue
            init_cell = fmt_stats(s["init"]) + ("" if s["init_step"] == 0 else f" (step {s['init_step']})")
            end_cell = fmt_stats(s["end"]) + ("" if end_header != "end" else f" (step {s['end_step']})")
            delta = s["end"]["mean"] - s["init"]["mean"] if s["end"]["n"] and s["init"]["n"] else None
            rows.append([g.label] + ([str(member.index)] if kind else []) + [init_cell, end_cell,
                        *[_baseline_cell(s, b) for b in baselines], fmt(delta), str(s["n_seeds"])])
    return header, rows


