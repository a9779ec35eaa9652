"""The length-extrapolation benchmark: every trained run scored at 1x-16x its training length.

    python train.py -m experiment=extrapolation hydra/launcher=local_parallel     # 10 PE options x 3 seeds
    python experiments/extrapolation.py multirun/<date>/<time> --out experiments/results/extrapolation

Every run of the sweep folder(s) is rebuilt from its last checkpoint and scored with
``analysis.extrapolation.fixed_target_losses``: the same held-out target tokens (the last ``--target-len``
of each window) at every length, windows of every length ending at the same offsets, the longest ones not
overlapping, standard errors over windows. RoPE runs are also scored with each inference-time scaling
(``--scalings``; factor = the length multiplier, so a 4x window is scaled by 4). Writes:

- ``extrapolation.json``: every run's losses, errors and ratios, and the protocol;
- ``extrapolation.md``: per family, loss at 1x and the ratio to 1x at each length (mean +- sd over seeds),
  beside the ratios the ALiBi paper published (WikiText-103, trained at 1024 tokens);
- ``extrapolation.png``: loss vs length (log x-axis), one line per family, min-max band over seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from collections import defaultdict
from pathlib import Path
from statistics import mean, stdev

import pe_geometry.offline  # noqa: F401

# isort: split

import numpy as np
import torch

from pe_geometry.analysis.extrapolation import NA, fixed_target_losses
from pe_geometry.training.run_loader import load_trained_run

# Perplexity at 2x/4x/8x/16x over perplexity at 1x, Press et al. (2022), trained at 1024 tokens (WikiText-103).
# Our table reports loss ratios; a perplexity ratio r is a loss difference of log(r).
PUBLISHED_PPL_RATIO = {
    "sinusoidal": (2.64, 7.45, 14.7, 23.4),
    "rope": (1.61, 2.29, 3.36, 5.54),
    "t5_bias": (0.98, 1.03, 1.37, None),
    "alibi": (0.97, 0.96, 0.96, 0.96),
}


def run_dirs(folders: list[Path]) -> list[Path]:
    """Every run folder (one with checkpoints/last.ckpt) under the given sweep folders or run folders."""
    found = []
    for folder in folders:
        if (folder / "checkpoints" / "last.ckpt").is_file():
            found.append(folder)
        found += sorted(p.parent.parent for p in folder.glob("*/checkpoints/last.ckpt"))
    if not found:
        raise SystemExit(f"error: no run with checkpoints/last.ckpt under {[str(f) for f in folders]}")
    return found


def score_runs(folders: list[Path], multipliers: list[int], target_len: int | None, scalings: list[str]) -> list[dict]:
    results, datamodules = [], {}
    for run_dir in run_dirs(folders):
        run = load_trained_run(run_dir, datamodules=datamodules)
        seq_len = int(run.config.data.seq_len)
        stream = run.datamodule.streams["validation"]
        pe = run.choices.get("pe") or str(run.config.pe.get("_target_", "")).rsplit(".", 1)[-1]
        labels = [pe] + ([f"rope+{s}" for s in scalings] if pe == "rope" else [])
        base = None
        for label in labels:
            start = time.perf_counter()
            if base is None:
                scores = base = fixed_target_losses(run.model, stream, seq_len, multipliers, target_len)
            else:  # the RoPE run with an inference-time scaling, its factor set per length
                scaling = label.split("+", 1)[1]
                scores = scaled_rope_losses(run_dir, scaling, datamodules, stream, seq_len, multipliers, target_len, base)
            scores = scores | {"run": str(run_dir), "family": label, "seed": int(run.config.get("seed", 0)), "step": run.step,
                       "seconds": round(time.perf_counter() - start, 1)}
            results.append(scores)
            cells = [f"{m}x {v['loss']:.4f}" if v["loss"] != NA else f"{m}x n/a" for m, v in scores["lengths"].items()]
            print(f"{run_dir.name}: {label} s{scores['seed']}: " + "  ".join(cells), flush=True)
    return results


def scaled_rope_losses(run_dir: Path, scaling: str, datamodules: dict, stream, seq_len: int, multipliers: list[int],
                       target_len: int | None, base: dict) -> dict:
    """A RoPE run read with ``pe.scaling=<scaling>`` at factor = the multiplier, one length at a time.

    The 1x entry and every ratio's denominator are the unscaled run's (``base``), so the ratios compare
    the same targets. (dynamic_ntk sets its own factor from the length it reads; its factor is moot.)
    """
    merged = {k: v for k, v in base.items() if k != "lengths"} | {"lengths": {str(multipliers[0]): base["lengths"][str(multipliers[0])]}}
    for m in multipliers[1:]:
        scaled = load_trained_run(run_dir, datamodules=datamodules, pe_overrides={"scaling": scaling, "scaling_factor": float(m)})
        scores = fixed_target_losses(scaled.model, stream, seq_len, [multipliers[0], m], target_len)
        entry = scores["lengths"][str(m)]
        if entry["loss"] != NA:  # the ratio against the unscaled model's 1x loss, paired as fixed_target_losses pairs it
            entry["ratio"] = entry["loss"] / base["lengths"][str(multipliers[0])]["loss"]
            entry.pop("ratio_se", None)
        merged["lengths"][str(m)] = entry
    return merged


def summarise(results: list[dict], multipliers: list[int]) -> dict[str, dict]:
    """Per family and multiplier: seeds' loss and ratio (mean, sd, min, max), and why a length is n/a."""
    by_family: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        by_family[r["family"]].append(r)
    summary = {}
    for family, runs in by_family.items():
        cells = {}
        for m in multipliers:
            entries = [r["lengths"][str(m)] for r in runs]
            if any(e["loss"] == NA for e in entries):
                cells[str(m)] = {"na": next(e["reason"] for e in entries if e["loss"] == NA)}
                continue
            losses = [e["loss"] for e in entries]
            ratios = [e.get("ratio", 1.0) for e in entries]
            cells[str(m)] = {
                "loss_mean": mean(losses), "loss_sd": stdev(losses) if len(losses) > 1 else 0.0,
                "loss_min": min(losses), "loss_max": max(losses),
                "ratio_mean": mean(ratios), "ratio_sd": stdev(ratios) if len(ratios) > 1 else 0.0,
                "max_rel_se": max(e["rel_se"] for e in entries),
            }
        summary[family] = {"seeds": sorted(r["seed"] for r in runs), "lengths": cells}
    return summary


def markdown_table(summary: dict[str, dict], multipliers: list[int]) -> str:
    longer = [m for m in multipliers if m > 1]
    head = "| family | seeds | loss at 1x | " + " | ".join(f"{m}x / 1x" for m in longer) + " | published ppl ratio (2x/4x/8x/16x) |"
    lines = [head, "|" + "---|" * (4 + len(longer))]
    order = sorted(summary, key=lambda f: _sort_key(summary[f], multipliers))
    for family in order:
        cells = summary[family]["lengths"]
        one = cells[str(multipliers[0])]
        row = [family, str(len(summary[family]["seeds"])), f"{one['loss_mean']:.3f} ± {one['loss_sd']:.3f}"]
        for m in longer:
            c = cells[str(m)]
            row.append("n/a (past the table)" if "na" in c else f"{c['ratio_mean']:.3f} ± {c['ratio_sd']:.3f}")
        published = PUBLISHED_PPL_RATIO.get(family)
        row.append(" / ".join("–" if p is None else f"{p}" for p in published) if published else "")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _sort_key(entry: dict, multipliers: list[int]) -> tuple:
    """Families by their ratio at the longest length they can take (n/a last)."""
    for m in reversed(multipliers):
        c = entry["lengths"][str(m)]
        if "na" not in c:
            return (-m, c["ratio_mean"])
    return (0, math.inf)


def plot(summary: dict[str, dict], multipliers: list[int], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    cmap = plt.get_cmap("tab20")
    for i, family in enumerate(sorted(summary)):
        cells = summary[family]["lengths"]
        xs = [m for m in multipliers if "na" not in cells[str(m)]]
        ys = [cells[str(m)]["loss_mean"] for m in xs]
        lo = [cells[str(m)]["loss_min"] for m in xs]
        hi = [cells[str(m)]["loss_max"] for m in xs]
        style = "--" if "+" in family else "-"
        ax.plot(xs, ys, style, marker="o", ms=3, color=cmap(i), label=family)
        ax.fill_between(xs, lo, hi, color=cmap(i), alpha=0.15, linewidth=0)
    ax.set_xscale("log", base=2)
    ax.set_xticks(multipliers, [f"{m}x" for m in multipliers])
    ax.set_xlabel("window length / training length")
    ax.set_ylabel("loss on the same held-out targets (nats)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, help="sweep folders (or run folders) with trained runs")
    parser.add_argument("--out", type=Path, required=True, help="folder for extrapolation.{json,md,png}")
    parser.add_argument("--multipliers", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--target-len", type=int, default=None, help="scored tokens per window (default seq_len // 2)")
    parser.add_argument("--scalings", nargs="*", default=["linear", "ntk", "dynamic_ntk", "yarn"],
                        help="inference-time RoPE scalings to score the RoPE runs with (none: --scalings)")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    start = time.perf_counter()
    results = score_runs(args.folders, args.multipliers, args.target_len, args.scalings)
    summary = summarise(results, args.multipliers)
    args.out.mkdir(parents=True, exist_ok=True)
    first = results[0]
    protocol = (f"{first['objective']} runs; the same {first['target_len']} target tokens per window at every length, "
                f"{first['n_windows']} windows (one every {first['window_stride']} validation tokens), "
                "mean +- sd over seeds; ratio = loss / loss at 1x on the same targets")
    payload = {"protocol": protocol, "multipliers": args.multipliers, "summary": summary, "runs": results,
               "machine": f"{platform.machine()}, torch {torch.__version__}", "seconds": round(time.perf_counter() - start)}
    (args.out / "extrapolation.json").write_text(json.dumps(payload, indent=1))
    table = markdown_table(summary, args.multipliers)
    worst = max((c.get("max_rel_se", 0.0) for s in summary.values() for c in s["lengths"].values()), default=float("nan"))
    (args.out / "extrapolation.md").write_text(
        f"# Length extrapolation\n\n{protocol}.\n\nLargest standard error of a run's loss (over windows): "
        f"{100 * worst:.2f} % of the loss.\n\n{table}\n\n![loss vs length](extrapolation.png)\n")
    plot(summary, args.multipliers, args.out / "extrapolation.png", protocol[:110] + "...")
    print(table)
    print(f"wrote {args.out}/extrapolation.{{json,md,png}} in {time.perf_counter() - start:.0f} s")
    return payload


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
