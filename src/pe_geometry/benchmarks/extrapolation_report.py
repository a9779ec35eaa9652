"""extrapolation.md and its figures: the loss table beside the published ratios, where each family puts position in
the attention, and how far to trust a ratio (the seeds' spread against the evaluation's error)."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import numpy as np

from pe_geometry.benchmarks.extrapolation_scoring import ATTENTION_BLOCKS, is_scaled
from pe_geometry.extras import needs_extra

with needs_extra("report", "pe-bench extrapolation's figures"):
    import matplotlib

# Perplexity at 2x/4x/8x/16x over perplexity at 1x, Press et al. (2022), trained at 1024 tokens (WikiText-103).
# Our table reports loss ratios; a perplexity ratio r is a loss difference of log(r). Keyed by our arm's label: their
# sinusoidal model (fairseq's language model) multiplies the embedding by sqrt(d_model), as the original Transformer.
PUBLISHED_PPL_RATIO = {
    "sinusoidal (embedding x sqrt(d))": (2.64, 7.45, 14.7, 23.4),
    "rope": (1.61, 2.29, 3.36, 5.54),
    "t5_bias": (0.98, 1.03, 1.37, None),
    "alibi": (0.97, 0.96, 0.96, 0.96),
}



ATTENTION_NOTE = (
    "On the first {blocks} validation blocks at the training length (analysis.position_attention). Block 0 positional "
    "share: the share of the score variance along the keys a query sees that comes from position-dependent terms (the "
    "four position terms of the input for sinusoidal/learned, the encoding's own term otherwise: a rotation's change to "
    "q.k, the score bias; NoPE 0), mean over heads; its null (RoPE/xPos): the same q and k with each head's rotation "
    "pairs mixed by a random orthogonal matrix (20 draws). Distance / uniform: each head's mean |i - j| under its "
    "attention weights over uniform attention's (1 = no preference, < 1 = local), mean over heads, the most local head "
    "in brackets. Mean +- sd over seeds.")


FLAT_NOTE = (
    "Reading the ratios: a model that reads nothing past its training length scores a little below 1, not 1 (0.994 "
    "for RoPE with a 32-token window, the flattest arm): at 1x the first targets of a window have less than a training "
    "length of text before them, at 2x and beyond every target has a full one. The perplexity ratio (the published "
    "figures' unit) is exp of the seeds' mean loss difference, with exp of the smallest and largest seed's difference "
    "in brackets.")


def uncertainty_note(summary: dict[str, dict], worst_rel_se: float) -> str:
    """Which error bounds a ratio: the evaluation's (windows) or the seeds'. Their ratio over every trained family and
    length past 1x."""
    folds = [c["ratio_sd"] / c["ratio_se_mean"] for s in summary.values() for c in s["lengths"].values()
             if c.get("ratio_se_mean") and "ratio_sd" in c]
    text = f"Largest standard error of a run's loss (over windows): {100 * worst_rel_se:.2f} % of the loss."
    if folds:
        wider = sum(f > 1 for f in folds)
        text += (f" The seeds' spread of a ratio (sd, the ± in the table) is wider than its evaluation error (the "
                 f"ratio's standard error over windows, paired by window, mean over seeds) in {wider} of {len(folds)} "
                 f"family x length cells (median {np.median(folds):.1f}x, {min(folds):.1f}x to {max(folds):.0f}x): "
                 "quote the seed spread, not the evaluation error alone.")
    return text


def relabel_note(relabel: dict[str, str]) -> str:
    return ("; renamed: " + ", ".join(f"'{old}' is '{new}'" for old, new in relabel.items())) if relabel else ""



def markdown_table(summary: dict[str, dict], multipliers: list[int]) -> str:
    longer = [m for m in multipliers if m > 1]
    head = ("| family | seeds | loss at 1x | " + " | ".join(f"{m}x / 1x" for m in longer)
            + f" | ppl ratio, ours ({'/'.join(f'{m}x' for m in longer)}): exp(mean Δ) [seed min–max]"
            " | published ppl ratio (2x/4x/8x/16x) |")
    lines = [head, "|" + "---|" * (5 + len(longer))]
    order = sorted(summary, key=lambda f: _sort_key(summary[f], multipliers))
    for family in order:
        cells = summary[family]["lengths"]
        one = cells[str(multipliers[0])]
        row = [family, str(len(summary[family]["seeds"])), f"{one['loss_mean']:.3f} ± {one['loss_sd']:.3f}"]
        for m in longer:
            c = cells[str(m)]
            row.append("n/a (past the table)" if "na" in c else f"{c['ratio_mean']:.3f} ± {c['ratio_sd']:.3f}")
        row.append(" / ".join("n/a" if "na" in cells[str(m)] else ppl_cell(cells[str(m)]) for m in longer))
        published = PUBLISHED_PPL_RATIO.get(family)
        row.append(" / ".join("–" if p is None else f"{p}" for p in published) if published else "")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def attention_table(summary: dict[str, dict], multiplier: int) -> str:
    """Where each family puts position in the attention, beside its ratio at ``multiplier`` x (trained families only)."""
    families = [f for f in sorted(summary, key=lambda f: _sort_key(summary[f], [1, multiplier])) if summary[f]["attention"]
                and not is_scaled(f)]
    if not families:
        return ""
    n_layers = max(len(summary[f]["attention"]["distance_ratio"]) for f in families)  # the deepest arm's; others: –
    head = (["family", "block 0 positional share", "its null (RoPE/xPos)"]
            + [f"distance / uniform, block {i} (most local head)" for i in range(n_layers)] + [f"{multiplier}x / 1x loss"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for family in families:
        a, cell = summary[family]["attention"], summary[family]["lengths"][str(multiplier)]
        null = f"{a['null_mean']['mean']:.3f} (sd {a['null_std']['mean']:.3f})" if "null_mean" in a else "–"
        row = [family, f"{a['positional_share']['mean']:.3f} ± {a['positional_share']['sd']:.3f}", null]
        row += [f"{d['mean']:.2f} ± {d['sd']:.2f} ({m['mean']:.2f})" for d, m in zip(a["distance_ratio"], a["most_local_ratio"])]
        row += ["–"] * (n_layers - len(a["distance_ratio"]))
        row.append("n/a" if "na" in cell else f"{cell['ratio_mean']:.3f} ± {cell['ratio_sd']:.3f}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def common_multiplier(summary: dict[str, dict], multipliers: list[int]) -> int:
    """The longest length every trained family (not the RoPE scalings) can be scored at."""
    trained = [s for f, s in summary.items() if not is_scaled(f)]
    return max(m for m in multipliers if all("na" not in s["lengths"][str(m)] for s in trained))


def plot_attention(summary: dict[str, dict], multiplier: int, path: Path) -> None:
    """Two panels, one point per family (seed mean, sd bars): block 0's positional share and block 0's attention
    distance over uniform, each against the loss ratio at ``multiplier`` x."""
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = sorted(f for f in summary if not is_scaled(f) and summary[f]["attention"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8), sharey=True)
    cmap = plt.get_cmap("tab10")
    for i, family in enumerate(families):
        a, cell = summary[family]["attention"], summary[family]["lengths"][str(multiplier)]
        y, y_sd = cell["ratio_mean"], cell["ratio_sd"]
        for ax, x in zip(axes, (a["positional_share"], a["distance_ratio"][0])):
            ax.errorbar(x["mean"], y, xerr=x["sd"], yerr=y_sd, fmt="o", color=cmap(i % 10), capsize=2, label=family)
            ax.annotate(family, (x["mean"], y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    axes[0].set_xlabel("block 0: share of score variance from position (mean over heads)")
    axes[1].set_xlabel("block 0: mean attention distance / uniform attention's")
    axes[0].set_ylabel(f"loss at {multiplier}x / loss at 1x (same targets)")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle("Where position enters the attention, and how each family extrapolates (trained length, seed mean ± sd)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _ppl(value: float) -> str:
    return f"{value:.3g}" if value < 1000 else f"{value:.2e}"


def ppl_cell(cell: dict) -> str:
    """'2.41 [1.9–3.0]': the seeds' geometric-mean perplexity ratio and its range over seeds (one seed: no range)."""
    low, high = cell["ppl_ratio_min"], cell["ppl_ratio_max"]
    spread = "" if low == high else f" [{_ppl(low)}–{_ppl(high)}]"
    return _ppl(cell["ppl_ratio"]) + spread


def _sort_key(entry: dict, multipliers: list[int]) -> tuple:
    """Families by their ratio at the longest length they can take (n/a last)."""
    for m in reversed(multipliers):
        c = entry["lengths"][str(m)]
        if "na" not in c:
            return (-m, c["ratio_mean"])
    return (0, math.inf)


def plot(summary: dict[str, dict], multipliers: list[int], path: Path, title: str) -> None:
    """Loss vs length, one line per family with its min-max band over seeds; the right panel zooms on the families
    whose loss stays within 1.5x of their 1x loss (a family that blows up would flatten every other line)."""
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 9))
    cmap = plt.get_cmap("tab20")
    kept = []  # the zoom's y-range: families that never leave 1.5x their 1x loss
    for i, family in enumerate(sorted(summary)):
        cells = summary[family]["lengths"]
        xs = [m for m in multipliers if "na" not in cells[str(m)]]
        ys = [cells[str(m)]["loss_mean"] for m in xs]
        lo = [cells[str(m)]["loss_min"] for m in xs]
        hi = [cells[str(m)]["loss_max"] for m in xs]
        if max(ys) < 1.5 * ys[0]:
            kept += lo + hi
        style = "--" if is_scaled(family) else (":" if "(" in family else "-")
        for ax in axes:
            ax.plot(xs, ys, style, marker="o", ms=3, color=cmap(i % 20), label=family)
            ax.fill_between(xs, lo, hi, color=cmap(i % 20), alpha=0.15, linewidth=0)
    if kept:
        pad = 0.03 * (max(kept) - min(kept))
        axes[1].set_ylim(min(kept) - pad, max(kept) + pad)
    for ax, name in zip(axes, ("every family", "zoom: families within 1.5x of their 1x loss")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(multipliers, [f"{m}x" for m in multipliers])
        ax.set_xlabel("window length / training length")
        ax.set_ylabel("loss on the same held-out targets (nats)")
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
    # below the panels: over thirty families would cover the lines inside either panel
    handles, labels = axes[0].get_legend_handles_labels()
    ncol = 4
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8)
    fig.suptitle(textwrap.fill(title, 150), fontsize=9)
    fig.tight_layout(rect=(0, min(0.5, 0.02 + 0.028 * -(-len(labels) // ncol)), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(summary: dict[str, dict], runs: list[dict], kept: list[dict], relabel: dict[str, str], protocol: str,
             multipliers: list[int]) -> str:
    """extrapolation.md: the protocol, where the entries come from, the loss table and the attention table."""
    worst = max((c.get("max_rel_se", 0.0) for s in summary.values() for c in s["lengths"].values()), default=float("nan"))
    attention = attention_table(summary, common_multiplier(summary, multipliers))
    kept_note = (f" {len(kept)} of them ({', '.join(sorted({r['family'] for r in kept}))}) kept from an earlier "
                 f"extrapolation.json (`--keep`; scored by the same protocol){relabel_note(relabel)}." if kept else "")
    return (
        f"# Length extrapolation\n\n{protocol}.\n\n{len(runs)} scored entries from the sweep folders "
        f"{', '.join(sorted({r['run'].split('/')[0] for r in runs}))} (`pe-bench extrapolation <folders> "
        f"--out <here>`; each run's loss, standard error and ratio at every length in extrapolation.json).{kept_note}\n\n"
        f"{uncertainty_note(summary, worst)}\n\n{FLAT_NOTE}\n\n{markdown_table(summary, multipliers)}\n\n"
        "![loss vs length](extrapolation.png)\n\n"
        f"## Where position enters the attention\n\n{ATTENTION_NOTE.format(blocks=ATTENTION_BLOCKS)}\n\n{attention}\n\n"
        "![position in the attention vs extrapolation](position_attention.png)\n")
