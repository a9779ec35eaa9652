"""The report and figure of issue 51's experiment (``analysis.training_length``'s results dict)."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from pe_geometry.analysis.nulls import holm

FIGURE_WORDS = {
    "overlap_k8": "top-8 subspace overlap",
    "var_share_P_in_E_k8": "share of P's variance in E's top-8",
    "abs_cos_mean": "mean |cos| over word x position pairs",
}
ARM_WORDS = {
    "learned": "learned table",
    "mixed_frozen": "mixed start, frozen",
    "mixed_shuffled": "mixed start, shuffled rows",
    "word_norm": "fixed sinusoidal (word norm)",
    "nope": "NoPE",
}


def _fmt(x: float, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.{digits}g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.1e}"


def _pm(mean: float, sd: float) -> str:
    return f"{mean:.3f} ± {sd:.3f}"


def _ms(values: list[float]) -> str:
    v = np.asarray(values, dtype=float)
    return f"{v.mean():.3f} ± {v.std(ddof=1):.3f}" if len(v) > 1 else f"{v.mean():.3f}"


def cell_table(results: dict) -> tuple[list[str], list[dict]]:
    """Every (depth, arm, length) x figure against its null: r mean ± sd over seeds, the seeds' two-sided p, Fisher's
    p over the seeds, Holm over every row x figure (an exploratory family: the planned tests are the finding)."""
    groups: dict = defaultdict(list)
    for c in results["cells"]:
        groups[(c["depth"], c["arm"], c["length"])].append(c)
    rows = []
    for (depth, arm, length), cells in sorted(groups.items()):
        row = {"depth": depth, "arm": arm, "length": length, "seeds": len(cells),
               "val_loss": [c.get("val_loss_last") for c in cells],
               "last_is_best": all(c.get("val_loss_last") is not None and c["val_loss_last"] <= c["val_loss_min"] + 1e-9 for c in cells)}
        for name in FIGURE_WORDS:
            if any(c["figures"] is None for c in cells):
                continue
            from scipy import stats

            ps = [max(c["figures"][f"{name}_p"], 1e-12) for c in cells]
            row[name] = {"r": [c["figures"][f"{name}_ratio"] for c in cells], "p": ps,
                         "fisher": float(stats.combine_pvalues(ps, method="fisher").pvalue)}
        rows.append(row)
    tested = [(i, name) for i, row in enumerate(rows) for name in FIGURE_WORDS if name in row]
    for (i, name), p in zip(tested, holm([rows[i][name]["fisher"] for i, name in tested]), strict=True):
        rows[i][name]["holm"] = p
    lines = ["| depth | arm | steps | seeds | val loss (last) | last = best val | "
             + " | ".join(f"{w}: r (value / null mean) · p per seed · Holm p ({len(tested)})" for w in FIGURE_WORDS.values()) + " |",
             "|" + "---|" * (6 + len(FIGURE_WORDS))]
    for row in rows:
        cells = [str(row["depth"]), ARM_WORDS.get(row["arm"], row["arm"]), str(row["length"]), str(row["seeds"]),
                 _ms([v for v in row["val_loss"] if v is not None]), "yes" if row["last_is_best"] else "no"]
        for name in FIGURE_WORDS:
            if name not in row:
                cells.append("no table")
                continue
            f = row[name]
            cells.append(f"{_ms(f['r'])} · {', '.join(_fmt(p, 2) for p in f['p'])} · {_fmt(f['holm'], 2)}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines, rows


def tests_table(results: dict) -> list[str]:
    lines = ["| test | question | per seed | mean ± sd | t (df) | p | Holm p | reading |", "|---|---|---|---|---|---|---|---|"]
    for t in results["planned_tests"]:
        if not t["ran"]:
            lines.append(f"| {t['id']} | {t['spec']} | | | | | | {t['reading']} |")
            continue
        values = t.get("values") or ([t["D"]] if "D" in t else t.get("a", []))
        if t["spec"]["kind"] == "welch":
            per_seed = f"a {', '.join(_fmt(v) for v in t['a'])}; b {', '.join(_fmt(v) for v in t['b'])}"
            mean = f"a - b = {_fmt(t['difference'])}"
            tdf = f"{_fmt(t['t'])} (Welch)"
        elif t["spec"]["kind"] == "rotation_pretrained":
            per_seed, mean, tdf = f"D {_fmt(t['D'])}", "one model", "rank of 20 random"
        else:
            per_seed = ", ".join(_fmt(v) for v in values)
            mean = f"{_fmt(t['mean'])} ± {_fmt(t['sd'])}"
            tdf = f"{_fmt(t['t'])} ({t['df']})"
        lines.append(f"| {t['id']} | {t['question']} | {per_seed} | {mean} | {tdf} | {_fmt(t['p'], 2)} | "
                     f"{_fmt(t['holm_p'], 2)} | {t['reading']} |")
    return lines


def cross_table(results: dict) -> list[str]:
    groups: dict = defaultdict(list)
    for c in results["cross_reads"]:
        groups[(c["depth"], c["arm"])].append(c)
    lines = ["| depth | arm | own E (r) | phantom: the NoPE run's E (r) | swap: the learned arm's seed-0 E (r) | "
             "own E, P turned at random (r) |", "|---|---|---|---|---|---|"]
    own = defaultdict(list)
    longest = max(results["plan"]["lengths"])
    for c in results["cells"]:
        if c["length"] == longest and c["figures"] is not None:
            own[(c["depth"], c["arm"])].append(c["figures"]["overlap_k8_ratio"])
    def read(cs: list[dict], kind: str) -> str:
        got = [c[kind]["overlap_k8_ratio"] for c in cs if kind in c]
        return f"{_ms(got)} ({len(got)})" if got else "n/a"

    for (depth, arm), cs in sorted(groups.items()):
        lines.append(f"| {depth} | {ARM_WORDS.get(arm, arm)} | {_ms(own[(depth, arm)]) if own[(depth, arm)] else 'n/a'} | "
                     f"{read(cs, 'phantom')} | {read(cs, 'swap')} | {read(cs, 'random_orientation')} |")
    return lines


def rotation_table(results: dict) -> list[str]:
    groups: dict = defaultdict(list)
    for r in results["rotation"]:
        groups[(r["depth"], r["arm"], r["rotate"])].append(r)
    lines = ["| depth | arm | rotated | loss | rise, adversarial | rise, random (mean ± sd of 20) | D per seed | "
             "adversarial above every random | p per seed (rank) |", "|---|---|---|---|---|---|---|---|---|"]
    for (depth, arm, rotate), rs in sorted(groups.items()):
        lines.append(
            f"| {depth} | {ARM_WORDS.get(arm, arm)} | {rotate} | {_ms([r['loss'] for r in rs])} | "
            f"{_ms([r['delta_adversarial'] for r in rs])} | "
            f"{', '.join(_pm(r['delta_random_mean'], r['delta_random_std']) for r in rs)} | "
            f"{', '.join(_fmt(r['D']) for r in rs)} | {', '.join('yes' if r['above_every_random'] else 'no' for r in rs)} | "
            f"{', '.join(_fmt(r['p'], 2) for r in rs)} |")
    for r in results["rotation_pretrained"]:
        lines.append(f"| {r['model_type']} ({r['model'].rsplit('/', 2)[-2]}) | its learned table | {r['rotate']} | "
                     f"drift 0 | {_fmt(r['delta_adversarial'])} | {r['delta_random_mean']:.3g} ± {r['delta_random_std']:.2g} | "
                     f"{_fmt(r['D'])} | {'yes' if r['above_every_random'] else 'no'} | {_fmt(r['p'], 2)} |")
    return lines


def write_report(results: dict) -> str:
    plan = results["plan"]
    ran = {(c["depth"], c["arm"]) for c in results["cells"]}
    cut = [f"depth {b['depth']}: {a}" for b in plan["run_order"] for a in b["arms"] if (b["depth"], a) not in ran]
    cell_lines, _ = cell_table(results)
    text = [
        "# Does the separation grow with training, and does the model need it? (issue 51)",
        "",
        "Plan: [experiments/plans/training_length.yaml](../../plans/training_length.yaml), committed before the runs. "
        f"d_model 64, the width curve's recipe with a warmup-stable-decay schedule; lengths {plan['lengths']} steps "
        f"(each a decay over its last 1/7, branched off one trunk per run), depths {plan['depths']}, seeds {plan['seeds']}. "
        "r = a figure's value over the mean of its spectra-keeping rotation null (2000 draws): 1 is the null, below 1 "
        "separated.",
        "",
        "Cut by the budget (the plan's run order, cut from its end): " + (", ".join(cut) if cut else "nothing") + ".",
        "",
        "## The planned tests (the finding)",
        "",
        f"Holm over the {sum(t['ran'] for t in results['planned_tests'])} tests that ran, alpha {plan['alpha']}; a "
        "reading needs Holm p < alpha and every seed on the same side.",
        "",
        *tests_table(results),
        "",
        "## Every figure against its null, at every length (exploratory)",
        "",
        "p per seed: the rotation null's two-sided empirical p (floor 1/2001); Fisher over the seeds, Holm over every "
        "row x figure of this table.",
        "",
        *cell_lines,
        "",
        "## Is it E, P or the pair? (exploratory)",
        "",
        "The top-8 overlap r at the longest length of each arm's P against: its own E; the final E of the NoPE run of "
        "the same seed and depth (an E that never saw a table); the learned arm's seed-0 E (one common E); its own E "
        "with P turned by one Haar rotation (reads at the null by construction: the sanity check).",
        "",
        *cross_table(results),
        "",
        "## The rotation test",
        "",
        "Validation loss (16 fixed batches) after rotating the model's own table P about the origin: adversarial = P's "
        "top-8 principal directions onto E's top-8; random = 20 Haar rotations. D = adversarial rise - mean random "
        "rise. For E (rotate E): E's top-8 onto P's, on the input side only. MiniLM: the drift of its pooled output "
        "(it has no masked-LM head).",
        "",
        *rotation_table(results),
        "",
        "![figures](figures.png)",
        "",
    ]
    return "\n".join(text)


def write_figure(results: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plan = results["plan"]
    names = [plan["figure"], *plan["secondary_figures"]]
    depths = plan["depths"]
    arms = [a for a in plan["arms"] if a != "nope"]
    colours = dict(zip(arms, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    fig, axes = plt.subplots(len(depths), len(names), figsize=(5 * len(names), 3.6 * len(depths)), squeeze=False)
    longest = max(plan["lengths"])
    for i, depth in enumerate(depths):
        for j, name in enumerate(names):
            ax = axes[i, j]
            for arm in arms:
                curves = [c for c in results["curves"] if c["depth"] == depth and c["arm"] == arm]
                trunks = [c for c in curves if c["part"] == "trunk" and len(c["step"]) > 1]
                if trunks:
                    n = min(len(c["step"]) for c in trunks)
                    steps = np.asarray(trunks[0]["step"][:n])
                    r = np.array([np.asarray(c[name][:n]) / np.asarray(c[f"{name}_null_mean"][:n]) for c in trunks])
                    band = np.mean([np.asarray(c[f"{name}_null_std"][:n]) / np.asarray(c[f"{name}_null_mean"][:n]) for c in trunks], 0)
                    ax.plot(steps, r.mean(0), color=colours[arm], label=f"{ARM_WORDS[arm]} ({len(trunks)} seeds)")
                    ax.fill_between(steps, 1 - 2 * band, 1 + 2 * band, color=colours[arm], alpha=0.06, linewidth=0)
                for c in curves:
                    if c["part"] == "branch" and c["step"]:
                        ax.plot(c["step"], np.asarray(c[name]) / np.asarray(c[f"{name}_null_mean"]), color=colours[arm],
                                linewidth=0.7, linestyle="--", alpha=0.6)
                ends = defaultdict(list)
                for cell in results["cells"]:
                    if cell["depth"] == depth and cell["arm"] == arm and cell["figures"] is not None:
                        ends[cell["length"]].append(cell["figures"][f"{name}_ratio"])
                for length, values in ends.items():
                    ax.errorbar([length], [np.mean(values)], yerr=[np.std(values, ddof=1)] if len(values) > 1 else None,
                                marker="o", color=colours[arm], markersize=4, capsize=2)
            ax.axhline(1.0, color="grey", linewidth=0.8)
            ax.set_xscale("symlog", linthresh=100)
            ax.set_xlim(0, longest * 1.05)
            ax.set_title(f"depth {depth}: {FIGURE_WORDS[name]}", fontsize=9)
            ax.set_xlabel("step")
            ax.set_ylabel("value / null mean")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.text(0.5, 0.005, "line: trunk, mean over seeds; dashed: decay branches; dots: each length's end (mean ± sd); "
             "band: the null's ±2 sd", ha="center", fontsize=7)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
