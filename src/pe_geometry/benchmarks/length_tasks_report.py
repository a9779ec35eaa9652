"""length_tasks.md and length_tasks.png: the glance table, per task and metric every family beside the chance lines,
accuracy beside where each family puts position, the passkey's depth x length grid, and the contrasts."""

from __future__ import annotations

from pathlib import Path

from pe_geometry.benchmarks.length_tasks_scoring import DISAGREE, METRIC_WORDS, METRICS
from pe_geometry.benchmarks.task_contrasts import contrast_preamble, contrast_table
from pe_geometry.extras import needs_extra

with needs_extra("report", "pe-bench tasks' figure"):
    import matplotlib


# why a run's 1x scores here are below what it logged in training (a reader saw 0.156 logged and 0.000 scored): said in
# length_tasks.md and above the tables pe-bench tasks prints
FULL_SIZE_NOTE = ("Every example here is full-size (as large as the block holds), so the 1x scores are below the "
                  "`val/answer_accuracy` and `val/answer_exact_match` a run logs in training, which read examples of every "
                  "size up to that (`data.sizes=up_to`, the default).")


def glance_table(summary: dict, chance: dict, multipliers: list[int]) -> str:
    """One row per family, one column per task: token accuracy at 1x / the middle length / the longest (exact match
    at 1x in brackets), the seeds' mean; the last rows: what a model that sees only its training length scores."""
    shown = [multipliers[0], multipliers[len(multipliers) // 2], multipliers[-1]]
    tasks = sorted(summary)
    families = sorted({f for t in tasks for f in summary[t]})
    head = "| family | " + " | ".join(f"{t}: token accuracy {' / '.join(f'{m}x' for m in shown)} (exact at {shown[0]}x)"
                                     for t in tasks) + " |"
    lines = [head, "|" + "---|" * (len(tasks) + 1)]

    def cell(entry: dict | None) -> str:
        if entry is None:
            return "–"
        cells = [entry["lengths"][str(m)] for m in shown]
        values = " / ".join("n/a" if "na" in c else f"{c['token_accuracy']:.2f}" for c in cells)
        return values + ("" if "na" in cells[0] else f" ({cells[0]['exact_match']:.2f})")

    for family in families:
        lines.append(f"| {family} | " + " | ".join(cell(summary[t].get(family)) for t in tasks) + " |")
    for line, name in (("window", "chance: sees only its training length"), ("uniform", "chance: uniform guess")):
        cells = []
        for t in tasks:
            by_length = chance.get(t, {})
            by_m = by_length[sorted(by_length)[0]] if by_length else {}
            if not all(str(m) in by_m for m in shown):
                cells.append("–")
                continue
            values = " / ".join(f"{by_m[str(m)][line]['token_accuracy']:.2f}" for m in shown)
            cells.append(f"{values} ({by_m[str(shown[0])][line]['exact_match']:.2f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)



def _cell(cell: dict, metric: str) -> str:
    if "na" in cell:
        return "n/a"
    if cell[metric] is None:  # no example of this length lies past L
        return "–"
    low, high = cell[f"{metric}_ci"]
    seeds = f"; seeds {cell[f'{metric}_min']:.2f}–{cell[f'{metric}_max']:.2f}" if cell["seeds"] > 1 else ""
    return f"{cell[metric]:.3f} ({low:.2f}–{high:.2f}{seeds})"


def metric_in(entry: dict, metric: str) -> bool:
    return any(metric in cell for cell in entry["lengths"].values())


def markdown_tables(summary: dict, chance: dict, multipliers: list[int]) -> str:
    """Per task and metric: one row per family, one column per length, and the two chance lines."""
    parts = []
    for task in sorted(summary):
        present = [m for m in METRICS if any(metric_in(entry, m) for entry in summary[task].values())]
        for metric, name in ((m, METRIC_WORDS[m]) for m in present):
            head = "| family | " + " | ".join(f"{m}x" for m in multipliers) + " |"
            lines = [f"**{task}, {name}**", "", head, "|" + "---|" * (len(multipliers) + 1)]
            for family, entry in sorted(summary[task].items(), key=lambda kv: _order(kv[1], metric, multipliers)):
                lines.append(f"| {family} | " + " | ".join(_cell(entry["lengths"][str(m)], metric) for m in multipliers) + " |")
            for seq_len, by_m in sorted(chance.get(task, {}).items()):
                for line in ("window", "uniform"):
                    label = (f"a perfect model that sees only its last L = {seq_len} tokens" if line == "window"
                             else "chance: uniform guess")
                    # a window model writes the whole answer right exactly when it sees the needle: its greedy lines are
                    # its exact match (first token included, for a passkey); uniform guessing: the first token's 1/10
                    chance_metric = "exact_match" if metric.startswith("greedy") else metric
                    if metric == "greedy_first_token" and line == "uniform":
                        chance_metric = "token_accuracy"
                    if metric == "greedy_exact_match_beyond_L":  # past the window a window model cannot answer
                        cells = ["–" if m == 1 else ("0.000" if line == "window" else "≈ 0") for m in multipliers]
                    else:
                        cells = [f"{by_m[str(m)][line][chance_metric]:.3f}" if str(m) in by_m else "" for m in multipliers]
                    lines.append(f"| {label} | " + " | ".join(cells) + " |")
            parts.append("\n".join(lines))
    return "\n\n".join(parts)


def position_tables(summary: dict, multipliers: list[int]) -> str:
    """Per task: each family's token accuracy at 1x, the middle and the longest length (and exact match at 1x) beside
    where it puts position at 1x (block 0's positional share of the score variance, the rotation null's mean for a
    rotation; per layer, the attention distance over uniform attention's), seeds' mean ± sd."""
    shown = sorted({multipliers[0], multipliers[len(multipliers) // 2], multipliers[-1]})
    parts = []
    for task in sorted(summary):
        entries = summary[task]
        n_layers = max((len(e["attention"]["distance_ratio"]) for e in entries.values() if e.get("attention")), default=0)
        head = ("| family | " + " | ".join(f"token acc. {m}x" for m in shown) + f" | exact {shown[0]}x | "
                "block-0 positional share (null) | "
                + " | ".join(f"distance / uniform, layer {i}" for i in range(n_layers)) + " |")
        lines = [f"**{task}: accuracy beside where the family puts position**", "", head,
                 "|" + "---|" * (len(shown) + 3 + n_layers)]
        for family, entry in sorted(entries.items(), key=lambda kv: _order(kv[1], "exact_match", multipliers)):
            cells = ["n/a" if "na" in entry["lengths"][str(m)] else f"{entry['lengths'][str(m)]['token_accuracy']:.2f}"
                     for m in shown]
            first = entry["lengths"][str(shown[0])]
            cells.append("n/a" if "na" in first else f"{first['exact_match']:.2f}")
            a = entry.get("attention")
            if a:
                share = f"{a['positional_share']['mean']:.3f} ± {a['positional_share']['sd']:.3f}"
                share += f" ({a['null_mean']['mean']:.3f})" if "null_mean" in a else ""
                cells += [share] + [f"{d['mean']:.2f} ± {d['sd']:.2f}" for d in a["distance_ratio"]]
            else:
                cells += ["–"] * (1 + n_layers)
            lines.append(f"| {family} | " + " | ".join(cells) + " |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def _order(entry: dict, metric: str, multipliers: list[int]) -> tuple:
    """Families by their score at the longest length they can be read at (best first, n/a last)."""
    for m in reversed(multipliers):
        cell = entry["lengths"][str(m)]
        if "na" not in cell and cell[metric] is not None:
            return (-m, -cell[metric])
    return (0, 0.0)


def depth_tables(grid: dict, multipliers: list[int]) -> str:
    parts = []
    for family, by_m in sorted(grid.items()):
        shown = [m for m in multipliers if str(m) in by_m]
        lines = [f"**passkey, {family}: exact match by the needle's depth (rows) and length (columns)**", "",
                 "| depth | " + " | ".join(f"{m}x" for m in shown) + " |", "|" + "---|" * (len(shown) + 1)]
        for i, first in enumerate(by_m[str(shown[0])]):
            values = [by_m[str(m)][i]["exact_match"] for m in shown]
            lines.append(f"| {first['depth']:.1f}–{first['depth'] + 1 / len(by_m[str(shown[0])]):.1f} | "
                         + " | ".join("–" if v is None else f"{v:.2f}" for v in values) + " |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def plot(summary: dict, chance: dict, multipliers: list[int], path: Path) -> None:
    """Token accuracy (top) and exact match (bottom) vs length, a column per task: one line per family (seed mean),
    band: the seeds' min-max; dashed: the window chance, dotted: uniform guessing."""
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted(summary)
    fig, axes = plt.subplots(2, len(tasks), figsize=(4.2 * len(tasks), 7), squeeze=False)
    families = sorted({f for t in tasks for f in summary[t]})
    # ten distinct hues, then the same hues dashed, then dash-dotted, each with its own marker: tab20's pairs of
    # near-identical blues (and its wrap at 20) made two of 21 arms look alike
    colors, styles, markers = plt.get_cmap("tab10").colors, ("-", "--", "-."), ("o", "s", "^")
    for col, task in enumerate(tasks):
        for row, metric in enumerate(("token_accuracy", "exact_match")):
            ax = axes[row][col]
            for family, entry in summary[task].items():
                xs = [m for m in multipliers if "na" not in entry["lengths"][str(m)]]
                cells = [entry["lengths"][str(m)] for m in xs]
                k = families.index(family)
                color, style, marker = colors[k % 10], styles[k // 10 % 3], markers[k // 10 % 3]
                ax.plot(xs, [c[metric] for c in cells], style, marker=marker, ms=3, color=color, label=family)
                ax.fill_between(xs, [c[f"{metric}_min"] for c in cells], [c[f"{metric}_max"] for c in cells],
                                color=color, alpha=0.15, linewidth=0)
            for seq_len, by_m in chance.get(task, {}).items():
                xs = [m for m in multipliers if str(m) in by_m]
                for line, style in (("window", "--"), ("uniform", ":")):
                    ax.plot(xs, [by_m[str(m)][line][metric] for m in xs], style, color="black", linewidth=1,
                            label=f"chance ({'window L ' + seq_len if line == 'window' else 'uniform'})")
            ax.set_xscale("log", base=2)
            ax.set_xticks(multipliers, [f"{m}x" for m in multipliers])
            ax.set_ylim(-0.02, 1.02)
            ax.set_title(f"{task}: {metric.replace('_', ' ')}", fontsize=10)
            ax.set_xlabel("length / training length")
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes.flat:  # every family once, whichever panel has it
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    fig.tight_layout()
    # below the panels, as wide as they are (a column per 4.2-inch panel, long labels: one panel, one column); the
    # saved figure grows to hold it instead of cutting labels at its edges
    # handles long enough to tell dashed from dash-dotted (the same hue marks arms 1, 11 and 21)
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=max(1, min(6, len(tasks))),
               fontsize=8, handlelength=4, markerscale=1.5)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def markdown(payload: dict, plan_path: Path | None, plan: dict | None, out: Path, contrast_at: int) -> str:
    """length_tasks.md from the payload length_tasks.json holds (``plan``: the analysis plan read from ``plan_path``)."""
    runs, summary, chance, multipliers = payload["runs"], payload["summary"], payload["chance"], payload["multipliers"]
    tested, due, depth = payload["contrasts"], payload["seeds_disagree"], depth_tables(payload["passkey_by_depth"], multipliers)
    sweeps = ", ".join(sorted({r["run"].split("/")[0] for r in runs}))
    return (
        f"# Length generalisation on tasks\n\n{len(runs)} runs from {sweeps} (`pe-bench tasks "
        f"<folders> --out <here>`); {payload['protocol']}. Chance lines (`data.tasks.window_chance` on the same examples): "
        "a model that sees only its last L (training length) tokens, and uniform guessing over the answer alphabet. "
        f"{FULL_SIZE_NOTE}\n\n"
        f"## At a glance\n\n{glance_table(summary, chance, multipliers)}\n\n## Per task\n\n"
        f"{markdown_tables(summary, chance, multipliers)}\n\n![accuracy vs length](length_tasks.png)\n\n"
        + (f"## Contrasts\n\n{contrast_preamble(tested, plan_path, out, plan)}Each arm against its control, "
           f"{METRIC_WORDS.get(tested[0]['metric'], 'token accuracy') if tested else ''} at {contrast_at}x, one "
           "value per seed: the difference of the seeds' means, its exact two-sided permutation p over the seeds, and "
           f"Holm's correction over the {len(tested)} tests.\n\n{contrast_table(tested)}\n\n" if tested else "")
        + f"## Accuracy beside position\n\n{position_tables(summary, multipliers)}\n"
        + (f"\n## Passkey: depth x length\n\n{depth}\n" if depth else "")
        + (f"\n## Seeds that disagree\n\nAt {multipliers[0]}x a metric's seed range is wider than {DISAGREE} "
           "with fewer than 5 seeds: " + "; ".join(f"{t}: {', '.join(f)}" for t, f in due.items()) + "\n" if due else ""))
