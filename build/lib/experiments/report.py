"""Report of a sweep: geometry vs training step per PE type, losses, length extrapolation, MiniLM beside them.

    python experiments/report.py multirun/<date>/<time>                       # writes multirun/<date>/<time>/report/
    python experiments/report.py multirun/<date>/<time> --out some/dir
    python experiments/report.py RUNS --pretrained-json minilm.json           # reuse (or create) the MiniLM analysis
    python experiments/report.py RUNS --no-extrapolation --no-pretrained      # fast: only what the runs logged

Reads every run below the given directory (a run = a folder with ``config.yaml`` and
``csv/metrics.csv``), groups the runs by (model, PE type) and writes:

- ``<family>.png``: one figure per geometry measure found in the logs (every ``geometry/...``
  column; a measure logged per layer or per head gets one panel per layer/head), one line
  per PE type (mean over seeds, band = min-max over seeds), its ``_chance`` companion as a
  dashed line (and ``_random`` / ``_shuffled`` baselines, dotted / dash-dot);
- ``loss.png`` (training loss, smoothed, and validation loss), ``overview.png``,
  ``extrapolation.png`` (validation loss on 1x, 2x, 4x seq_len blocks);
- ``report.md``: a table per measure (init mean +- std, end mean +- std, chance, seeds),
  validation loss, length extrapolation, and the pretrained MiniLM checkpoint's figures
  (experiments/pretrained.py) beside the trained models' input-level figures;
- ``summary.json``: every number in the tables.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import argparse  # noqa: E402
import csv  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import textwrap  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import yaml  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

log = logging.getLogger("report")
ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "configs"
PE_ORDER = ["sinusoidal", "learned", "rope", "alibi", "none"]
PE_COLORS = {"sinusoidal": "#1f77b4", "learned": "#ff7f0e", "rope": "#2ca02c", "alibi": "#d62728", "none": "#6f6f6f"}
EXTRA_COLORS = ["#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]
MODEL_STYLES = ["-", "--", ":", "-."]
# Baselines logged next to a measure X, as X<suffix>: (line style, legend text).
COMPANIONS = {
    "_chance": ("--", "chance"),
    "_random": (":", "Gaussian matrices, same shapes"),
    "_shuffled": ("-.", "positions shuffled across rows"),
}
NA = "n/a"
STYLE = {
    "axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False, "axes.spines.right": False,
    "font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10, "legend.fontsize": 9, "figure.titlesize": 12,
}
TERMS = {"word_word": "word–word", "pos_pos": "position–position", "word_pos": "word–position",
         "pos_word": "position–word", "bias": "bias"}

# (regex on the measure's last name component, title, y-axis label). {0} = first regex group.
DESCRIPTIONS = [  # also the order of the measures in the report
    (r"abs_cos_mean", "Mean |cos| between word and position vectors", "mean |cosine|  (0 = orthogonal)"),
    (r"cos_mean", "Mean cosine between word and position vectors", "mean cosine"),
    (r"cos_std", "Spread of the word–position cosines", "std of cosine"),
    (r"angle_mean_deg", "Mean angle between word and position vectors", "angle (degrees; 90 = orthogonal)"),
    (r"angle_std_deg", "Spread of the word–position angles", "std of angle (degrees)"),
    (r"angle_min_deg", "Smallest word–position angle", "angle (degrees)"),
    (r"angle_max_deg", "Largest word–position angle", "angle (degrees)"),
    (r"overlap_k(\d+)", "Subspace overlap of the top-{0} word and top-{0} position directions", "overlap (0 = orthogonal, 1 = nested)"),
    (r"angle_mean_k(\d+)_deg", "Mean principal angle, top-{0} word vs position subspaces", "angle (degrees; 90 = orthogonal)"),
    (r"angle_min_k(\d+)_deg", "Smallest principal angle, top-{0} word vs position subspaces", "angle (degrees)"),
    (r"overlap_var(\d+)", "Subspace overlap of word and position rows ({0}%-variance subspaces)", "overlap (0 = orthogonal, 1 = nested)"),
    (r"k_E_var(\d+)", "Word directions explaining {0}% of the variance", "principal directions"),
    (r"k_P_var(\d+)", "Position directions explaining {0}% of the variance", "principal directions"),
    (r"erank_E", "Effective rank of the word rows", "effective rank (dimensions)"),
    (r"erank_P", "Effective rank of the position rows", "effective rank (dimensions)"),
    (r"norm_e_mean", "Mean norm of the word vectors (as the model scales them)", "L2 norm"),
    (r"norm_p_mean", "Mean norm of the position vectors", "L2 norm"),
    (r"norm_ratio_p_over_e", "Norm ratio position / word vector", "‖p‖ / ‖e‖"),
    (r"position_probe_r2", "Position read off the hidden states (ridge probe)", "held-out R²  (1 = exact position)"),
    (r"position_var_share", "Share of hidden-state variance between positions", "variance share (0–1)"),
    (r"overlap_pos_tok_k(\d+)", "Overlap of per-position and per-token mean subspaces (top {0})", "overlap (0 = orthogonal, 1 = nested)"),
    (r"(pos_pos|word_word|word_pos|pos_word|bias)_share", "Layer-1 attention: score variance from the {term} term",
     "share of score variance"),
    (r"n_positional_heads", "Layer-1 positional heads (position–position share > 0.5)", "heads"),
]
# What each baseline means, for the notes under the tables.
BASELINE_NOTES = {
    "input": "chance: expectation for isotropic random vectors / uniformly random subspaces in d_model dimensions "
             "(|cos| ≈ sqrt(2/(π d))); random: the same table on Gaussian matrices of the same shapes.",
    "hidden": "chance: position_probe_r2 — the same ridge probe with positions shuffled across rows; "
              "position_var_share — its exact expectation (T−1)/(N−1) for exchangeable rows; overlap — uniformly random "
              "subspaces. shuffled: the overlap with positions shuffled across rows (keeps the hidden states' anisotropy).",
    "attn": "No chance level: the five shares sum to 1 per head (a share can leave [0, 1] when terms cancel).",
}
# Hidden-state panels show the input of the last block: the deepest representation that still has to carry
# position for attention to use. The model output only predicts the next token and sheds position.
OVERVIEW_KEYS = ["geometry/abs_cos_mean", "geometry/overlap_k8", "geometry/norm_ratio_p_over_e",
                 "geometry/hidden/layer{probe}/position_probe_r2", "geometry/hidden/layer{probe}/overlap_pos_tok_k8"]


def probe_layer(n_layers: int) -> int:
    """Index of the last block's input in the hidden-state series (layer 0 = embedding output)."""
    return max(n_layers - 1, 0)
PRETRAINED_INPUT_ROWS = ["cos_mean", "cos_std", "abs_cos_mean", "abs_cos_over_chance", "angle_mean_deg", "angle_std_deg",
                         "overlap_k8", "overlap_var90", "angle_mean_k8_deg", "erank_E", "erank_P", "norm_ratio_p_over_e"]


# ----------------------------------------------------------------------------- reading runs


@dataclass
class Run:
    path: Path
    model: str
    pe: str
    seed: int
    config: dict
    series: dict[str, tuple[np.ndarray, np.ndarray]]  # metric -> (steps, values), sorted by step
    extrapolation: dict | None = None

    @property
    def group(self) -> tuple[str, str]:
        return self.model, self.pe


@dataclass
class Group:
    model: str
    pe: str
    label: str
    color: str
    style: str
    runs: list[Run] = field(default_factory=list)

    @property
    def seeds(self) -> list[int]:
        return [r.seed for r in self.runs]


def read_metrics(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """metrics.csv -> {column: (steps, values)}; empty cells skipped, a repeated step keeps its last value."""
    table: dict[str, dict[int, float]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if not row.get("step"):
                continue
            step = int(float(row["step"]))
            for key, value in row.items():
                if key in ("step", "epoch") or value in ("", None):
                    continue
                try:
                    table.setdefault(key, {})[step] = float(value)
                except ValueError:
                    continue
    return {k: (np.array(sorted(v)), np.array([v[s] for s in sorted(v)])) for k, v in table.items()}


def _option_targets(group: str) -> dict[str, str]:
    """_target_ -> option name for a config group (configs/<group>/*.yaml)."""
    targets = {}
    for path in sorted((CONFIG_DIR / group).glob("*.yaml")):
        try:
            node = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError:
            continue
        if isinstance(node, dict) and "_target_" in node:
            targets.setdefault(node["_target_"], path.stem)
    return targets


def _choice(config: dict, choices: dict, group: str) -> str:
    if choices.get(group):
        return str(choices[group])
    target = (config.get(group) or {}).get("_target_", "?")
    return _option_targets(group).get(target, str(target).rsplit(".", 1)[-1])


def load_run(run_dir: Path) -> Run:
    config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    choices = {}
    hydra_path = run_dir / ".hydra" / "hydra.yaml"
    if hydra_path.is_file():
        try:
            choices = yaml.safe_load(hydra_path.read_text())["hydra"]["runtime"]["choices"] or {}
        except (KeyError, TypeError, yaml.YAMLError):
            choices = {}
    pe = _choice(config, choices, "pe")
    if (config.get("embedding") or {}).get("scaled"):
        pe += " + scaled emb"  # x sqrt(d_model) embeddings change the geometry: never pool them with plain ones
    run = Run(run_dir, _choice(config, choices, "model"), pe, int(config.get("seed", 0)),
              config, read_metrics(run_dir / "csv" / "metrics.csv"))
    extrapolation = run_dir / "length_extrapolation.json"
    if extrapolation.is_file():
        try:
            run.extrapolation = json.loads(extrapolation.read_text())
        except json.JSONDecodeError:
            run.extrapolation = None
    return run


def find_runs(root: Path) -> list[Run]:
    """Every run directory below root (or root itself): config.yaml + csv/metrics.csv."""
    runs = []
    for metrics in sorted(root.rglob("csv/metrics.csv")):
        run_dir = metrics.parent.parent
        if not (run_dir / "config.yaml").is_file():
            log.warning("skipping %s: no config.yaml beside it", run_dir)
            continue
        try:
            runs.append(load_run(run_dir))
        except (OSError, ValueError, yaml.YAMLError) as err:
            log.warning("skipping %s: %s", run_dir, err)
    return runs


def group_runs(runs: list[Run]) -> list[Group]:
    """Groups by (model, PE type), PE types in the study's order, seeds ascending."""
    models = sorted({r.model for r in runs})
    def order(pe: str) -> tuple[int, str]:
        base = pe.split(" ")[0]
        return PE_ORDER.index(base) if base in PE_ORDER else len(PE_ORDER), pe

    pes = sorted({r.pe for r in runs}, key=order)
    extra = iter(EXTRA_COLORS * 4)
    colors = {pe: PE_COLORS.get(pe) or next(extra) for pe in pes}
    groups = []
    for model in models:
        for pe in pes:
            members = sorted((r for r in runs if r.group == (model, pe)), key=lambda r: (r.seed, str(r.path)))
            if members:
                label = pe if len(models) == 1 else f"{model} / {pe}"
                groups.append(Group(model, pe, label, colors[pe], MODEL_STYLES[models.index(model) % len(MODEL_STYLES)], members))
    return groups


# ----------------------------------------------------------------------------- numbers


def stats(values: list[float]) -> dict:
    """mean, std (ddof=1 over seeds), min, max, n, values; NaNs dropped."""
    v = np.array([x for x in values if x is not None and np.isfinite(x)], dtype=float)
    if len(v) == 0:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0, "values": []}
    return {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0, "min": float(v.min()),
            "max": float(v.max()), "n": int(len(v)), "values": [float(x) for x in v]}


def aggregate(series: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """(steps, mean, min, max) over seeds: on the steps every seed logged, else interpolated on their common range."""
    series = [(s, v) for s, v in series if len(s)]
    if not series:
        return None
    common = sorted(set.intersection(*(set(s.tolist()) for s, _ in series)))
    if len(common) >= 0.5 * min(len(s) for s, _ in series):
        steps = np.array(common)
        stack = np.stack([v[np.searchsorted(s, steps)] for s, v in series])
    else:  # seeds logged at different steps: interpolate on the union within the common range
        lo, hi = max(s[0] for s, _ in series), min(s[-1] for s, _ in series)
        steps = np.array(sorted({x for s, _ in series for x in s.tolist() if lo <= x <= hi}))
        if not len(steps):
            return None
        stack = np.stack([np.interp(steps, s, v) for s, v in series])
    return steps, np.nanmean(stack, axis=0), np.nanmin(stack, axis=0), np.nanmax(stack, axis=0)


def smooth(values: np.ndarray, span: float) -> np.ndarray:
    """Bias-corrected exponential moving average over ``span`` points."""
    alpha = 2.0 / (span + 1.0)
    out, avg, weight = np.empty_like(values, dtype=float), 0.0, 0.0
    for i, v in enumerate(values):
        avg, weight = (1 - alpha) * avg + alpha * v, (1 - alpha) * weight + alpha
        out[i] = avg / weight
    return out


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


# ----------------------------------------------------------------------------- measures


def split_family(key: str) -> tuple[str, str | None, int | None]:
    """'geometry/hidden/layer2/position_probe_r2' -> ('geometry/hidden/layer*/position_probe_r2', 'layer', 2)."""
    m = re.match(r"^(.*?)/(layer|head)(\d+)/(.*)$", key)
    if m is None:
        return key, None, None
    return f"{m.group(1)}/{m.group(2)}*/{m.group(4)}", m.group(2), int(m.group(3))


def geometry_measures(runs: list[Run]) -> dict[str, list[tuple[str | None, int | None, str]]]:
    """family -> [(panel kind, panel index, column)], for every geometry/... column that is not a baseline."""
    keys = sorted({k for r in runs for k in r.series if k.startswith("geometry/")})
    families: dict[str, list[tuple[str | None, int | None, str]]] = {}
    for key in keys:
        if key.endswith(tuple(COMPANIONS)):
            continue
        family, kind, index = split_family(key)
        families.setdefault(family, []).append((kind, index, key))
    for members in families.values():
        members.sort(key=lambda m: (m[1] is None, m[1] or 0))
    sections = ["input", "hidden", "attn"]
    return dict(sorted(families.items(), key=lambda kv: (sections.index(section_of(kv[0])), _description_index(kv[0]), kv[0])))


def _description_index(family: str) -> int:
    leaf = family.rsplit("/", 1)[-1]
    return next((i for i, (pattern, _, _) in enumerate(DESCRIPTIONS) if re.fullmatch(pattern, leaf)), len(DESCRIPTIONS))


def section_of(family: str) -> str:
    if family.startswith("geometry/hidden/"):
        return "hidden"
    if family.startswith("geometry/attn/"):
        return "attn"
    return "input"


def describe(family: str) -> tuple[str, str]:
    """(title, y label) of a measure family."""
    leaf = family.rsplit("/", 1)[-1]
    for pattern, title, ylabel in DESCRIPTIONS:
        m = re.fullmatch(pattern, leaf)
        if m:
            groups = m.groups()
            term = TERMS.get(groups[0], groups[0]) if groups else ""
            return title.format(*groups, term=term), ylabel
    return leaf.replace("_", " "), "value"


def panel_title(kind: str | None, index: int | None, n_layers: int | None) -> str:
    if kind == "layer":
        if index == 0:
            return "layer 0: embedding + PE (block 1 input)"
        if n_layers is not None and index == n_layers:
            return f"layer {index}: model output (after final norm)"
        return f"layer {index}: after block {index}"
    if kind == "head":
        return f"head {index}"
    return ""


def figure_name(family: str) -> str:
    section = section_of(family)
    leaf = family.rsplit("/", 1)[-1]
    return f"{section}_{re.sub(r'[^A-Za-z0-9_.-]+', '_', leaf)}.png"


def end_values(runs: list[Run], key: str) -> tuple[list[float], list[float], list[int], list[int]]:
    """Per seed: value at step 0 (first logged if no step 0), value at the last logged step, and those steps."""
    init, end, init_steps, end_steps = [], [], [], []
    for r in runs:
        if key not in r.series:
            continue
        steps, values = r.series[key]
        i0 = int(np.argmin(steps)) if 0 not in steps else int(np.where(steps == 0)[0][0])
        init.append(float(values[i0]))
        end.append(float(values[-1]))
        init_steps.append(int(steps[i0]))
        end_steps.append(int(steps[-1]))
    return init, end, init_steps, end_steps


def measure_summary(group: Group, key: str) -> dict | None:
    init, end, init_steps, end_steps = end_values(group.runs, key)
    if not init:
        return None
    out = {"init": stats(init), "end": stats(end), "init_step": min(init_steps), "end_step": max(end_steps),
           "n_seeds": len(init)}
    for suffix in COMPANIONS:
        c_init, c_end, _, _ = end_values(group.runs, key + suffix)
        if c_init:
            out[suffix.lstrip("_")] = {"init": stats(c_init), "end": stats(c_end)}
    return out


# ----------------------------------------------------------------------------- plots


def _n_layers(group: Group) -> int | None:
    try:
        return int(group.runs[0].config["model"]["n_layers"])
    except (KeyError, TypeError, ValueError):
        return None


def _plot_group_line(ax, group: Group, key: str, label: str | None) -> bool:
    agg = aggregate([r.series[key] for r in group.runs if key in r.series])
    if agg is None:
        return False
    steps, mean, lo, hi = agg
    ax.plot(steps, mean, group.style, color=group.color, lw=1.8, label=label, marker="o" if len(steps) < 30 else None, ms=3)
    if len(group.runs) > 1:
        ax.fill_between(steps, lo, hi, color=group.color, alpha=0.15, lw=0)
    return True


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
    return Line2D([], [], color="black", ls=style, lw=1.0, label=f"{text} (each PE type, its colour)")


def _baselines(ax, groups: list[Group], key: str) -> None:
    """Every logged baseline of key, with a small legend inside the panel (each panel has its own levels)."""
    lines = [line for suffix in COMPANIONS if (line := _plot_baseline(ax, groups, key, suffix)) is not None]
    if lines:
        ax.legend(handles=lines, loc="best", fontsize=7.5, framealpha=0.85)


def _log_if_wide(ax, ratio: float = 20.0) -> None:
    """Log y axis when the plotted positive values span more than ``ratio`` (norms of e vs p, say)."""
    values = np.concatenate([line.get_ydata() for line in ax.get_lines()] or [np.array([])]).astype(float)
    values = values[np.isfinite(values)]
    if len(values) and values.min() > 0 and values.max() / values.min() > ratio:
        ax.set_yscale("log")


def _grid(n: int) -> tuple[int, int]:
    ncols = min(n, 3) if n != 4 else 2
    return math.ceil(n / ncols), ncols


def _finish(fig, path: Path, groups: list[Group]) -> None:
    """One figure legend for the PE types (colour) and model layouts (line style); save; close."""
    handles = [Line2D([], [], color=g.color, ls=g.style, lw=2, label=g.label) for g in groups]
    if handles:
        title = "PE type" if len({g.model for g in groups}) == 1 else "model / PE type"
        fig.legend(handles=handles, loc="outside right upper", frameon=False, title=title)
    fig.savefig(path)
    plt.close(fig)


def _band_note(groups: list[Group]) -> str:
    seeds = sorted({len(g.runs) for g in groups})
    n = "/".join(str(s) for s in seeds)
    return f"line: mean over {n} seed(s); band: min–max over seeds"


def plot_family(family: str, members: list[tuple[str | None, int | None, str]], groups: list[Group], path: Path) -> bool:
    title, ylabel = describe(family)
    present = [g for g in groups if any(m[2] in r.series for m in members for r in g.runs)]
    if not present:
        return False
    rows, cols = _grid(len(members))
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(rows, cols, figsize=(max(4.3 * cols + 2.6, 9.0), 3.4 * rows + 0.8), squeeze=False,
                                 sharey=len(members) > 1, layout="constrained")
        for ax in axes.flat[len(members):]:
            ax.set_visible(False)
        for ax, (kind, index, key) in zip(axes.flat, members):
            for g in present:
                _plot_group_line(ax, g, key, g.label)
            _baselines(ax, present, key)
            if kind is not None:
                ax.set_title(panel_title(kind, index, _n_layers(present[0])))
            if family.rsplit("/", 1)[-1].startswith("norm"):
                _log_if_wide(ax)
            ax.set_xlabel("training step")
            if len(members) == 1 or ax.get_subplotspec().is_first_col():
                ax.set_ylabel(ylabel)
        fig.suptitle(f"{title}\n{_band_note(present)}")
        _finish(fig, path, present)
    return True


def plot_loss(groups: list[Group], path: Path) -> bool:
    if not any("train/loss" in r.series or "val/loss" in r.series for g in groups for r in g.runs):
        return False
    with plt.rc_context(STYLE):
        fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(11.5, 4.2), layout="constrained", sharey=True)
        for g in groups:
            train = [r.series["train/loss"] for r in g.runs if "train/loss" in r.series]
            smoothed = [(s, smooth(v, max(1.0, len(v) / 12))) for s, v in train]
            agg = aggregate(smoothed)
            if agg is not None:
                steps, mean, lo, hi = agg
                ax_train.plot(steps, mean, g.style, color=g.color, lw=1.8, label=g.label)
                ax_train.fill_between(steps, lo, hi, color=g.color, alpha=0.15, lw=0)
            agg = aggregate([r.series["val/loss"] for r in g.runs if "val/loss" in r.series])
            if agg is not None:
                steps, mean, lo, hi = agg
                ax_val.plot(steps, mean, g.style, color=g.color, lw=1.8, marker="o", ms=4, label=g.label)
                ax_val.fill_between(steps, lo, hi, color=g.color, alpha=0.15, lw=0)
        ax_train.set_title("training loss (exponential moving average)")
        ax_val.set_title("validation loss")
        for ax in (ax_train, ax_val):
            ax.set_xlabel("training step")
        ax_train.set_ylabel("cross-entropy (nats / token)")
        fig.suptitle(f"Loss per PE type\n{_band_note(groups)}")
        _finish(fig, path, groups)
    return True


def plot_overview(groups: list[Group], families: dict, path: Path) -> bool:
    n_layers = max((_n_layers(g) or 0) for g in groups)
    keys = [k.format(probe=probe_layer(n_layers)) for k in OVERVIEW_KEYS]
    keys = [k for k in keys if any(k in r.series for g in groups for r in g.runs)]
    panels = ["val/loss", *keys] if any("val/loss" in r.series for g in groups for r in g.runs) else keys
    if not panels:
        return False
    rows, cols = _grid(len(panels))
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(rows, cols, figsize=(4.3 * cols + 2.6, 3.4 * rows + 0.6), squeeze=False, layout="constrained")
        for ax in axes.flat[len(panels):]:
            ax.set_visible(False)
        for ax, key in zip(axes.flat, panels):
            present = [g for g in groups if any(key in r.series for r in g.runs)]
            for g in present:
                _plot_group_line(ax, g, key, g.label)
            if key == "val/loss":
                ax.set_title("validation loss")
                ax.set_ylabel("cross-entropy (nats / token)")
            else:
                family, kind, index = split_family(key)
                title, ylabel = describe(family)
                title = textwrap.fill(title, 48)
                if kind is not None:
                    title += f"\n({panel_title(kind, index, n_layers)})"
                ax.set_title(title, fontsize=9.5)
                ax.set_ylabel(ylabel)
                _baselines(ax, present, key)
                if family.rsplit("/", 1)[-1].startswith("norm"):
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
        offsets = np.linspace(-0.04, 0.04, max(1, len(groups)))
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
        ax.set_title(f"Length extrapolation: validation loss on longer blocks\n{same}mean over seeds, bars: min–max")
        _finish(fig, path, [g for g in groups if g.label in table])
    return True


# ----------------------------------------------------------------------------- extrapolation


def run_extrapolation(runs: list[Run], multipliers: list[int], max_batches: int, compute: bool) -> None:
    """Fill run.extrapolation: reuse a run's length_extrapolation.json if it covers the request, else evaluate."""
    for run in runs:
        cached = run.extrapolation
        ckpt = run.path / "checkpoints" / "last.ckpt"
        fresh = (
            cached is not None
            and set(multipliers) <= {int(m) for m in cached.get("multipliers", [])}
            and cached.get("max_batches") == max_batches
            and ckpt.is_file()
            and (run.path / "length_extrapolation.json").stat().st_mtime >= ckpt.stat().st_mtime
        )
        if fresh or not compute:
            continue
        if not ckpt.is_file():
            log.warning("%s: no checkpoints/last.ckpt, no length extrapolation", run.path)
            continue
        from experiments.extrapolation import evaluate_lengths  # torch + the model code: only when needed

        try:
            log.info("length extrapolation: %s", run.path.name)
            run.extrapolation = evaluate_lengths(run.path, multipliers, max_batches)
        except Exception as err:  # one broken run must not stop the report
            log.warning("%s: length extrapolation failed (%s: %s)", run.path, type(err).__name__, err)
            run.extrapolation = {"error": f"{type(err).__name__}: {err}", "lengths": {}}


def extrapolation_table(groups: list[Group], multipliers: list[int]) -> dict:
    """label -> {lengths: {m: {loss: stats | 'n/a', beyond: stats, reason}}, ...}."""
    table = {}
    for g in groups:
        results = [r.extrapolation for r in g.runs if r.extrapolation and r.extrapolation.get("lengths")]
        if not results:
            continue
        entry = {"model": g.model, "pe": g.pe, "n_seeds": len(results), "lengths": {},
                 "train_seq_len": results[0].get("train_seq_len"), "n_target_tokens": results[0].get("n_target_tokens"),
                 "pe_max_len": results[0].get("pe_max_len")}
        for m in multipliers:
            cells = [res["lengths"].get(str(m)) for res in results]
            cells = [c for c in cells if c is not None]
            if not cells:
                continue
            na = [c for c in cells if c["loss"] == NA]
            if na:
                entry["lengths"][str(m)] = {"loss": NA, "reason": na[0].get("reason", ""), "block_len": na[0].get("block_len")}
                continue
            entry["lengths"][str(m)] = {
                "loss": stats([c["loss"] for c in cells]),
                "loss_beyond_train_len": stats([c.get("loss_beyond_train_len") for c in cells]),
                "block_len": cells[0].get("block_len"),
                "untrained_positions": any(c.get("untrained_positions") for c in cells),
            }
        table[g.label] = entry
    return table


# ----------------------------------------------------------------------------- pretrained


def load_pretrained(path: Path | None, out_dir: Path) -> tuple[dict | None, str]:
    """The MiniLM analysis: from --pretrained-json if that file exists, else computed (and saved there and in out_dir)."""
    if path is not None and path.is_file():
        return json.loads(path.read_text()), f"read from {path}"
    try:
        from experiments.pretrained import analyse

        log.info("analysing the pretrained MiniLM checkpoint (experiments/pretrained.py)")
        results = analyse()
    except Exception as err:  # the report stays useful without it
        log.warning("pretrained analysis unavailable (%s: %s)", type(err).__name__, err)
        return None, f"unavailable ({type(err).__name__}: {err})"
    text = json.dumps(results, indent=2)
    (out_dir / "pretrained.json").write_text(text)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return results, "computed with experiments.pretrained.analyse()"


# ----------------------------------------------------------------------------- markdown


def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
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


def measure_rows(groups: list[Group], members: list, summaries: dict) -> tuple[list[str], list[list[str]]]:
    kind = members[0][0]
    baselines = [s.lstrip("_") for s in COMPANIONS if any(s.lstrip("_") in (summaries.get((g.label, m[2])) or {})
                                                         for g in groups for m in members)]
    found = [s for g in groups for m in members if (s := summaries.get((g.label, m[2])))]
    end_steps = {s["end_step"] for s in found}
    end_header = f"end (step {end_steps.pop()})" if len(end_steps) == 1 else "end"
    header = ["PE type"] + ([kind] if kind else []) + ["init (step 0)", end_header, *baselines, "end − init", "n seeds"]
    rows = []
    for g in groups:
        for _, index, key in members:
            s = summaries.get((g.label, key))
            if s is None:
                continue
            init_cell = fmt_stats(s["init"]) + ("" if s["init_step"] == 0 else f" (step {s['init_step']})")
            end_cell = fmt_stats(s["end"]) + ("" if end_header != "end" else f" (step {s['end_step']})")
            delta = s["end"]["mean"] - s["init"]["mean"] if s["end"]["n"] and s["init"]["n"] else None
            rows.append([g.label] + ([str(index)] if kind else []) + [init_cell, end_cell,
                        *[_baseline_cell(s, b) for b in baselines], fmt(delta), str(s["n_seeds"])])
    return header, rows


def write_markdown(ctx: dict) -> str:
    groups, families, summaries = ctx["groups"], ctx["families"], ctx["summaries"]
    runs = [r for g in groups for r in g.runs]
    cfg = runs[0].config
    m, d, t = cfg.get("model") or {}, cfg.get("data") or {}, cfg.get("trainer") or {}
    geometry_cfg = (cfg.get("callbacks") or {}).get("geometry") or {}
    cadence = (f"geometry every {geometry_cfg.get('every_n_steps', '?')} steps from step 0 (initialisation)" if geometry_cfg
               else "no geometry callback")
    lines = [f"# Positional-encoding geometry report: `{ctx['source']}`", ""]
    lines += [f"Generated {ctx['generated']} by `python experiments/report.py`. {len(runs)} runs in {len(groups)} groups "
              f"({', '.join(f'{g.label}: seeds {g.seeds}' for g in groups)}).", ""]
    lines += [f"Setup (first run): `{m.get('_target_', '?').rsplit('.', 1)[-1]}`, d_model {m.get('d_model')}, "
              f"{m.get('n_layers')} layers × {m.get('n_heads')} heads, seq_len {d.get('seq_len')}, batch {d.get('batch_size')}, "
              f"{t.get('max_steps')} steps; {cadence}.", ""]
    if ctx.get("tokens_rule"):
        rule = ctx["tokens_rule"]
        lines += [f"Input-level word rows: {rule.get('word_rows')} (covering {rule.get('share_of_training_tokens', 0):.1%} of the "
                  f"training tokens); position rows: {rule.get('position_rows')}; hidden-state probe: {rule.get('probe')}.", ""]
    lines += ["Every figure: one line per PE type = mean over seeds, shaded band = min–max over seeds; black dashed = chance, "
              "dotted = Gaussian matrices of the same shapes, dash-dot = positions shuffled. Tables: mean ± std over seeds "
              "(sample std).", ""]
    lines += ["![overview](overview.png)", ""] if "overview.png" in ctx["figures"] else []

    # key figures
    lines += ["## Key figures", ""]
    n_layers = max((_n_layers(g) or 0) for g in groups)
    key_cols = [("geometry/abs_cos_mean", "mean abs cos (word, pos)"), ("geometry/overlap_k8", "overlap top-8"),
                (f"geometry/hidden/layer{probe_layer(n_layers)}/position_probe_r2",
                 f"position probe R², layer {probe_layer(n_layers)} (last block's input)")]
    logged = {k for r in runs for k in r.series}
    key_cols = [(k, name) for k, name in key_cols if k in logged or (section_of(k) == "input" and any(
        x.startswith("geometry/") for x in logged))]
    header = ["PE type", "final val loss"] + [f"{name}: init → end (chance)" for _, name in key_cols]
    rows = []
    for g in groups:
        val = stats([r.series["val/loss"][1][-1] for r in g.runs if "val/loss" in r.series])
        row = [g.label, fmt_stats(val)]
        for key, _ in key_cols:
            s = summaries.get((g.label, key))
            if s is None:
                row.append("n/a (no position table)" if section_of(key) == "input" else "–")
                continue
            chance = s.get("chance", {}).get("end", {}).get("mean")
            row.append(f"{fmt(s['init']['mean'])} → {fmt(s['end']['mean'])} ({fmt(chance)})")
        rows.append(row)
    lines += md_table(header, rows)

    # losses
    lines += ["## Loss", "", "![loss](loss.png)", ""] if "loss.png" in ctx["figures"] else ["## Loss", ""]
    rows = []
    for g in groups:
        val = stats([r.series["val/loss"][1][-1] for r in g.runs if "val/loss" in r.series])
        best = stats([float(np.min(r.series["val/loss"][1])) for r in g.runs if "val/loss" in r.series])
        train = stats([float(np.mean(r.series["train/loss"][1][-5:])) for r in g.runs if "train/loss" in r.series])
        ppl = math.exp(val["mean"]) if val["n"] else None
        steps = sorted({int(r.series["val/loss"][0][-1]) for r in g.runs if "val/loss" in r.series})
        rows.append([g.label, fmt_stats(val), fmt(ppl), fmt_stats(best), fmt_stats(train), ", ".join(map(str, steps)), str(val["n"])])
    lines += md_table(["PE type", "final val loss (nats/token)", "val ppl", "best val loss", "train loss (last 5 logs)",
                       "at step", "n seeds"], rows)

    # extrapolation
    lines += ["## Length extrapolation", ""]
    table = ctx["extrapolation"]
    if table:
        mults = ctx["multipliers"]
        any_entry = next(iter(table.values()))
        lines += [f"Validation loss (nats/token) on blocks of m × seq_len tokens (seq_len {any_entry.get('train_seq_len')}), "
                  f"the same {any_entry.get('n_target_tokens'):,} target tokens at every length (`experiments/extrapolation.py`). "
                  "In brackets: loss on the positions past the training length only. n/a: the learned position table has no "
                  "row for that position (pe.max_len); † learned rows that exist but were never trained.", ""]
        if "extrapolation.png" in ctx["figures"]:
            lines += ["![extrapolation](extrapolation.png)", ""]
        rows = []
        for g in groups:
            entry = table.get(g.label)
            if entry is None:
                continue
            row = [g.label]
            for mult in mults:
                cell = entry["lengths"].get(str(mult))
                if cell is None:
                    row.append("–")
                elif cell["loss"] == NA:
                    row.append("n/a")
                else:
                    text = fmt_stats(cell["loss"])
                    beyond = cell.get("loss_beyond_train_len") or {}
                    if beyond.get("n"):
                        text += f" [{fmt(beyond['mean'])}]"
                    row.append(text + (" †" if cell.get("untrained_positions") else ""))
            base = entry["lengths"].get(str(mults[0]), {}).get("loss")
            last = entry["lengths"].get(str(mults[-1]), {}).get("loss")
            ok = isinstance(base, dict) and isinstance(last, dict) and base.get("n") and last.get("n")
            ratio = last["mean"] / base["mean"] if ok else None
            row += [f"{ratio:.3f}" if ratio else "n/a", str(entry["n_seeds"])]
            rows.append(row)
        lines += md_table(["PE type", *[f"{m}×" for m in mults], f"{mults[-1]}× / {mults[0]}×", "n seeds"], rows)
        reasons = {cell.get("reason") for e in table.values() for cell in e["lengths"].values() if cell.get("loss") == NA}
        lines += [f"n/a: {r}" for r in sorted(x for x in reasons if x)] + ([""] if reasons else [])
    else:
        lines += ["Not computed (`--no-extrapolation` and no `length_extrapolation.json` in the runs).", ""]

    # geometry sections
    titles = {"input": "Input-level geometry: word rows vs position rows (PE types with a position table)",
              "hidden": "Hidden-state geometry (every PE type)",
              "attn": "Layer-1 attention: score variance per word/position term (additive PE)"}
    for section in ("input", "hidden", "attn"):
        fams = {f: mem for f, mem in families.items() if section_of(f) == section}
        if not fams:
            continue
        lines += [f"## {titles[section]}", "", BASELINE_NOTES[section], ""]
        if section == "input":
            have = [g.label for g in groups if any(summaries.get((g.label, f)) for f in fams)]
            lacking = [g.label for g in groups if g.label not in have]
            if lacking:
                lines += [f"Not measurable for {', '.join(lacking)}: no position vectors are added to the input.", ""]
        for family, members in fams.items():
            title, ylabel = describe(family)
            lines += [f"### {title}", "", f"`{family}` — {ylabel}", ""]
            header, rows = measure_rows(groups, members, summaries)
            lines += md_table(header, rows)
            name = figure_name(family)
            if name in ctx["figures"]:
                lines += [f"![{title}]({name})", ""]
        if section == "input":
            lines += pretrained_section(ctx)

    if ctx["pretrained"] is not None and not any(section_of(f) == "input" for f in families):
        lines += pretrained_section(ctx)
    lines += pretrained_hidden_section(ctx)
    lines += ["## Files", "", "Figures: " + ", ".join(f"[{f}]({f})" for f in ctx["figures"]), "",
              "Numbers: [summary.json](summary.json). Runs:", ""]
    lines += [f"- `{r.path}` ({r.model}, {r.pe}, seed {r.seed})" for r in runs] + [""]
    return "\n".join(lines)


def pretrained_section(ctx: dict) -> list[str]:
    p, groups, summaries = ctx["pretrained"], ctx["groups"], ctx["summaries"]
    lines = ["### Pretrained checkpoint (MiniLM) beside the trained models", ""]
    if p is None:
        return lines + [f"Pretrained analysis {ctx['pretrained_source']}.", ""]
    model, seed_rows, freq, art = p.get("model", {}), p.get("seed_rows", {}), p.get("frequent_rows", {}), p.get("article", {})
    d = model.get("d_model")
    lines += [f"`experiments/pretrained.py` on {model.get('model_type')} (d_model {d}, {model.get('n_layers')} layers, "
              f"{model.get('n_positions')} learned positions; {ctx['pretrained_source']}). "
              f"Rows {seed_rows.get('rows')} (the article's rows) are {seed_rows.get('n_unused')} [unused*] tokens, "
              f"{seed_rows.get('n_ordinary')} ordinary ones; frequent tokens: {freq.get('n_rows')} most frequent tokens of the "
              f"Shakespeare plays ({freq.get('corpus_coverage', 0):.1%} of the corpus tokens). Trained models: input level at "
              "step 0 and at the end (mean over seeds), against every position row used in training. Chance depends on d, so "
              "compare each column with its own chance column; the ratio row divides by it.", ""]
    trained = [g for g in groups if summaries.get((g.label, "geometry/abs_cos_mean"))]
    d_trained = sorted({g.runs[0].config.get("model", {}).get("d_model") for g in trained})
    header = ["measure", f"article BERT-base (d {art.get('d_model')})", f"MiniLM rows {seed_rows.get('rows')}",
              "MiniLM frequent tokens", f"chance (d {d})"]
    for g in trained:
        header += [f"{g.label} init", f"{g.label} end"]
    if trained:
        header.append(f"chance (d {'/'.join(map(str, d_trained))})")

    def value(geo: dict, name: str):
        if name == "abs_cos_over_chance":
            a, c = geo.get("abs_cos_mean"), geo.get("abs_cos_mean_chance")
            return a / c if a is not None and c else None
        return geo.get(name)

    rows = []
    seed_geo, freq_geo = seed_rows.get("geometry", {}), freq.get("geometry", {})
    for name in PRETRAINED_INPUT_ROWS:
        row = [name.replace("abs_cos_over_chance", "mean abs cos / chance"), fmt(value(art, name)), fmt(value(seed_geo, name)),
               fmt(value(freq_geo, name)), "1" if name == "abs_cos_over_chance" else _chance_or_random(freq_geo, name)]
        chance_trained = None
        for g in trained:
            if name == "abs_cos_over_chance":
                s = summaries.get((g.label, "geometry/abs_cos_mean"))
                if s and s.get("chance"):
                    ci, ce = s["chance"]["init"]["mean"], s["chance"]["end"]["mean"]
                    row += [fmt(s["init"]["mean"] / ci), fmt(s["end"]["mean"] / ce)]
                    chance_trained = 1.0
                else:
                    row += ["–", "–"]
                continue
            s = summaries.get((g.label, f"geometry/{name}"))
            row += [fmt_stats(s["init"]) if s else "–", fmt_stats(s["end"]) if s else "–"]
            if s and s.get("chance"):
                chance_trained = fmt(s["chance"]["end"]["mean"])
            elif s and s.get("random") and chance_trained is None:
                chance_trained = f"random: {fmt(s['random']['end']['mean'])}"
        if trained:
            row.append(fmt(chance_trained) if not isinstance(chance_trained, str) else chance_trained)
        rows.append(row)
    lines += md_table(header, rows)
    attn = p.get("attention_layer0")
    if attn:
        lines += [f"MiniLM layer-0 attention: positional heads (position–position share > 0.5): {attn.get('positional_heads')} "
                  f"of {len(attn.get('shares', {}).get('pos_pos', []))}.", ""]
    return lines


def _chance_or_random(geo: dict, name: str) -> str:
    if f"{name}_chance" in geo:
        return fmt(geo[f"{name}_chance"])
    if f"{name}_random" in geo:
        return f"random: {fmt(geo[f'{name}_random'])}"
    return "–"


def pretrained_hidden_section(ctx: dict) -> list[str]:
    p = ctx["pretrained"]
    if not p or not p.get("hidden_states"):
        return []
    layers = p["hidden_states"]
    keys = [k for k in layers[0] if not k.endswith(tuple(COMPANIONS))]
    header = ["MiniLM layer"] + [h for k in keys for h in (k, f"{k} chance")]
    rows = [[str(i)] + [c for k in keys for c in (fmt(rep.get(k)), fmt(rep.get(f"{k}_chance")))] for i, rep in enumerate(layers)]
    return ["## Pretrained MiniLM: position in hidden states", "",
            "Same hidden-state measures on MiniLM (layer 0 = embedding output after LayerNorm; 32 Shakespeare windows of 64 "
            "tokens, [CLS]/[SEP] dropped), for comparison with the hidden-state tables above.", ""] + md_table(header, rows)


# ----------------------------------------------------------------------------- main


def build_report(
    source: Path,
    out: Path | None = None,
    pretrained_json: Path | None = None,
    extrapolation: bool = True,
    pretrained: bool = True,
    multipliers: tuple[int, ...] = (1, 2, 4),
    max_batches: int = 8,
) -> dict:
    """Read the runs under ``source``, write figures, report.md and summary.json to ``out``; returns the summary."""
    source = Path(source)
    out = Path(out) if out is not None else source / "report"
    runs = find_runs(source)
    if not runs:
        raise SystemExit(f"error: no runs under {source} (a run has config.yaml and csv/metrics.csv)")
    out.mkdir(parents=True, exist_ok=True)
    multipliers = sorted({int(m) for m in multipliers})
    run_extrapolation(runs, multipliers, max_batches, compute=extrapolation)
    groups = group_runs(runs)
    families = geometry_measures(runs)
    summaries = {(g.label, key): s for g in groups for members in families.values() for _, _, key in members
                 if (s := measure_summary(g, key)) is not None}
    summaries.update({(g.label, key): s for g in groups for key in ("val/loss", "train/loss") if (s := measure_summary(g, key))})

    figures = []
    if plot_overview(groups, families, out / "overview.png"):
        figures.append("overview.png")
    if plot_loss(groups, out / "loss.png"):
        figures.append("loss.png")
    ext_table = extrapolation_table(groups, multipliers)
    if ext_table and plot_extrapolation(groups, ext_table, out / "extrapolation.png"):
        figures.append("extrapolation.png")
    for family, members in families.items():
        name = figure_name(family)
        if plot_family(family, members, groups, out / name):
            figures.append(name)

    pre, pre_source = (load_pretrained(pretrained_json, out) if pretrained else (None, "skipped (--no-pretrained)"))
    tokens_rule = None
    for r in runs:
        path = r.path / "geometry_tokens.json"
        if path.is_file():
            tokens_rule = {k: v for k, v in json.loads(path.read_text()).items() if k != "tokens"}
            break
    ctx = {"source": str(source), "generated": datetime.datetime.now().isoformat(timespec="seconds"), "groups": groups,
           "families": families, "summaries": summaries, "figures": figures, "extrapolation": ext_table,
           "multipliers": multipliers, "pretrained": pre, "pretrained_source": pre_source, "tokens_rule": tokens_rule}
    (out / "report.md").write_text(write_markdown(ctx))

    summary = {
        "source": str(source),
        "generated": ctx["generated"],
        "runs": [{"dir": str(r.path), "model": r.model, "pe": r.pe, "seed": r.seed,
                  "final_step": int(max((s[-1] for s, _ in r.series.values() if len(s)), default=0))} for r in runs],
        "groups": {
            g.label: {
                "model": g.model, "pe": g.pe, "seeds": g.seeds,
                "measures": {key: s for (label, key), s in summaries.items() if label == g.label},
                "extrapolation": ext_table.get(g.label),
            }
            for g in groups
        },
        "figures": figures,
        "word_rows": tokens_rule,
        "pretrained": None if pre is None else {k: pre.get(k) for k in ("model", "article", "chance", "seed_rows", "frequent_rows",
                                                                         "attention_layer0", "hidden_states") if k in pre},
        "pretrained_source": pre_source,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    log.info("wrote %s (%d figures, report.md, summary.json)", out, len(figures))
    return summary


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("multirun", type=Path, help="a sweep directory (multirun/<date>/<time>) or any folder of runs")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: <multirun>/report)")
    parser.add_argument("--pretrained-json", type=Path, default=None,
                        help="MiniLM analysis from `python experiments/pretrained.py --json PATH`; computed and saved there if missing")
    parser.add_argument("--no-pretrained", action="store_true", help="skip the pretrained-checkpoint comparison")
    parser.add_argument("--no-extrapolation", action="store_true",
                        help="do not evaluate longer blocks (existing length_extrapolation.json files are still used)")
    parser.add_argument("--multipliers", type=int, nargs="+", default=[1, 2, 4], help="evaluation lengths as multiples of seq_len")
    parser.add_argument("--max-batches", type=int, default=8, help="validation tokens for extrapolation = max_batches x batch x seq_len")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    summary = build_report(args.multirun, args.out, args.pretrained_json, extrapolation=not args.no_extrapolation,
                           pretrained=not args.no_pretrained, multipliers=tuple(args.multipliers), max_batches=args.max_batches)
    print(f"report: {Path(args.out or args.multirun / 'report') / 'report.md'}")
    return summary


if __name__ == "__main__":
    main()
