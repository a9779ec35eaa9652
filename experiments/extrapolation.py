"""The length-extrapolation benchmark: every trained run scored at 1x-16x its training length.

    python train.py -m experiment=extrapolation hydra/launcher=local_parallel     # 10 PE options x 3 seeds
    python train.py -m experiment=extrapolation_peer hydra/launcher=local_parallel  # x-transformers' own: 7 x 3
    python experiments/extrapolation.py multirun/<date>/<time> --out experiments/results/extrapolation

Every run of the sweep folder(s) is rebuilt from its last checkpoint and scored with
``analysis.extrapolation.fixed_target_losses``: the same held-out target tokens (the last ``--target-len``
of each window; by default the training length, so the 1x loss is the loss at the training length and a longer
window only adds context before the same targets) at every length, windows of every length ending at the same
offsets, the longest ones not overlapping, standard errors over windows (half the training length as targets
left the error at 1.1-1.2 % of the loss with the 138 windows of 16 x 64 tokens the validation split holds; the
whole window brings it under 1 %). RoPE runs are also scored with each inference-time scaling
(``--scalings``; factor = the length multiplier, so a 4x window is scaled by 4). Writes:

- ``extrapolation.json``: every run's losses, errors and ratios, and the protocol;
- ``extrapolation.md``: per family, loss at 1x and the ratio to 1x at each length (mean +- sd over seeds), the
  perplexity ratio exp(mean loss difference) with its seed range, beside the ratios the ALiBi paper published
  (WikiText-103, trained at 1024 tokens);
- ``extrapolation.png``: loss vs length (log x-axis), one line per family, min-max band over seeds;
- beside them, where each family puts position in the attention (``analysis.position_attention``, at the training
  length): block 0's positional share of score variance and every head's attention distance, as a second table and
  ``position_attention.png`` (both against the loss ratio at the longest length every family can be scored at).
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
from omegaconf import OmegaConf

from pe_geometry.analysis.extrapolation import NA, fixed_target_losses
from pe_geometry.analysis.position_attention import NoHookPoints, position_attention_report
from pe_geometry.analysis.runs import checkpoint_ending
from pe_geometry.configs import CONFIG_DIR
from pe_geometry.training.run_loader import load_trained_run

# Perplexity at 2x/4x/8x/16x over perplexity at 1x, Press et al. (2022), trained at 1024 tokens (WikiText-103).
# Our table reports loss ratios; a perplexity ratio r is a loss difference of log(r). Keyed by our arm's label: their
# sinusoidal model (fairseq's language model) multiplies the embedding by sqrt(d_model), as the original Transformer.
PUBLISHED_PPL_RATIO = {
    "sinusoidal (embedding x sqrt(d))": (2.64, 7.45, 14.7, 23.4),
    "rope": (1.61, 2.29, 3.36, 5.54),
    "t5_bias": (0.98, 1.03, 1.37, None),
    "alibi": (0.97, 0.96, 0.96, 0.96),
}


ATTENTION_BLOCKS = 16  # validation blocks at the training length for the attention figures (the first ones)


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


def run_dirs(folders: list[Path], include_unfinished: bool = False) -> list[Path]:
    """Every run folder (one with checkpoints/last.ckpt) under the given sweep folders or run folders. A run killed or
    stopped before its trainer.max_steps (``analysis.runs.checkpoint_ending``; an early stop is an end) would be scored
    at the step it reached beside finished runs: refused in one line naming it, unless ``include_unfinished``, when it
    is scored and named on stdout."""
    found = []
    for folder in folders:
        if (folder / "checkpoints" / "last.ckpt").is_file():
            found.append(folder)
        found += sorted(p.parent.parent for p in folder.glob("*/checkpoints/last.ckpt"))
    if not found:
        raise SystemExit(f"error: no run with checkpoints/last.ckpt under {[str(f) for f in folders]}")
    unfinished = [d for d in found if checkpoint_ending(d / "checkpoints" / "last.ckpt") == "unfinished"]
    if unfinished and not include_unfinished:
        raise SystemExit(f"error: {len(unfinished)} run(s) did not reach their trainer.max_steps (killed or stopped): "
                         f"{', '.join(map(str, unfinished))}; continue them (ckpt_path=auto on the sweep), or pass "
                         "--include-unfinished to score them where they stopped")
    for d in unfinished:
        print(f"{d}: unfinished (killed or stopped before trainer.max_steps), scored at the step it reached", flush=True)
    return found


def attention_variant(config) -> list[str]:
    """How a run's attention differs from plain multi-head attention, as label parts: [] or ['window 32', 'logn']."""
    attention = config.get("attention") or {}
    parts = []
    if attention.get("n_kv_heads") not in (None, config.model.get("n_heads")):
        parts.append(f"{attention.n_kv_heads} kv heads")
    if attention.get("qk_norm"):
        parts.append("qk_norm")
    if attention.get("window") is not None:
        parts.append(f"window {attention.window}")
    if attention.get("logn_scaling"):
        parts.append("logn")
    return parts


# Keys of a PE that change what is trained, not how a trained model is read: they never name an arm.
READ_ONLY_PE_KEYS = {"_target_", "_partial_", "max_len", "scaling", "scaling_factor", "training_length", "yarn_alpha",
                     "yarn_beta", "yarn_attention_factor"}


SWITCH_WORDS = {"rotary": "with RoPE"}  # a PE setting switched on, in words: pe=forgetting pe.rotary=true


def pe_variant(config) -> list[str]:
    """How a run's position encoding and embedding differ from the family's defaults, as label parts.

    The defaults are the constructor's (``pe_geometry.signatures``), so a run trained with ``pe.max_distance=64`` is
    'max_distance 64' and one trained at the defaults adds nothing. A sinusoidal table always says how it sits
    against the word vectors: 'raw table' (added as the formula gives it, ~35x the word rows' norm at d 64 with
    embedding=plain), 'word-norm table' (pe.scale=word_norm) or with the embedding x sqrt(d_model) of the original
    Transformer (embedding=scaled)."""
    from pe_geometry.signatures import EMPTY, Unreadable, constructor_params

    pe_node, parts = config.get("pe") or {}, []
    try:
        settings = constructor_params(str(pe_node.get("_target_", "")))
    except (Unreadable, ImportError, AttributeError, ValueError):
        settings = None
    embedding_scaled = bool((config.get("embedding") or {}).get("scaled", False))
    if str(pe_node.get("_target_", "")).endswith("SinusoidalPE"):
        parts.append("word-norm table" if pe_node.get("scale") == "word_norm"
                     else "embedding x sqrt(d)" if embedding_scaled else "raw table")
    elif embedding_scaled:
        parts.append("embedding x sqrt(d)")
    if settings is not None:
        defaults = {name: param.default for name, param in settings.items() if param.default is not EMPTY}
        for key, value in pe_node.items():
            if key in READ_ONLY_PE_KEYS or key not in defaults or (key == "scale" and parts[:1] == ["word-norm table"]):
                continue
            if value != defaults[key]:
                parts.append(SWITCH_WORDS.get(key, key) if value is True else f"{key} {value}")
    return parts


# experiment=extrapolation's depth (it trains at the study's size): a run of another depth is an arm of its own
BENCHMARK_LAYERS = int(OmegaConf.load(CONFIG_DIR / "experiment" / "orthogonality.yaml").model.n_layers)


def arm_label(pe: str, config, layers: int | None = None) -> str:
    """A run's arm: its ``pe=`` option with what sets it apart, e.g. 'rope (window 32)', 't5_bias (max_distance 64)',
    'sinusoidal (word-norm table)'; with ``layers`` (the benchmark's depth), a run of another depth says its own
    ('rope (4 layers)'), so it is never pooled with the benchmark's arm of the same family. A peer run
    (model=xtransformers: x-transformers' own modules, pe=none) is its ``model.peer_pe`` family: 'peer x-transformers: rope'."""
    model = config.get("model") or {}
    if str(model.get("_target_", "")).endswith(".XTransformersLM"):  # pe_geometry/model/peer.py
        pe = f"peer x-transformers: {model.get('peer_pe', 'rope')}"
    pattern = (config.get("model") or {}).get("layer_pattern")
    depth = int((config.get("model") or {}).get("n_layers", layers or 0))
    # a pattern with an entry per layer spells the depth out already: its arm reads the same in every task
    named = layers is not None and depth != layers and not (pattern and len(pattern) == depth)
    parts = ([f"{depth} layers"] if named else []) + pe_variant(config) + attention_variant(config)
    if pattern:  # a scheme per layer: never pooled with the plain family
        from pe_geometry.analysis.runs import pattern_label

        parts.append(pattern_label(pattern))
    return f"{pe} ({', '.join(parts)})" if parts else pe


def is_scaled(family: str) -> bool:
    """A RoPE run read with an inference-time scaling (not a trained arm of its own)."""
    return family.startswith("rope+")


def score_runs(folders: list[Path], multipliers: list[int], target_len: int | None, scalings: list[str],
               cache: Path | None = None, mask_draws: int = 1, include_unfinished: bool = False) -> list[dict]:
    """Every run's scores (one entry per label: the run, and a RoPE run once per scaling). With ``cache`` (a
    folder), a run's entries are kept there and reused while its checkpoint step and the protocol are the same,
    so a sweep can be scored as its runs finish and the final call only scores what is new."""
    results, datamodules = [], {}
    protocol = {"multipliers": multipliers, "target_len": target_len or "seq_len", "scalings": scalings,
                "attention_blocks": ATTENTION_BLOCKS}
    for run_dir in run_dirs(folders, include_unfinished):
        cached = cache / f"{run_dir.parent.name}--{run_dir.name}.json" if cache is not None else None
        run = load_trained_run(run_dir, datamodules=datamodules)
        masked = run.model.objective == "masked-lm"
        run_protocol = protocol | ({"mask_draws": mask_draws} if masked else {})  # a decoder's scores do not depend on it
        if cached is not None and cached.is_file():
            kept = json.loads(cached.read_text())
            if kept["protocol"] == run_protocol and kept["run"] == str(run_dir) and kept["step"] == run.step:
                results += kept["entries"]
                print(f"{run_dir.name}: scored before (step {run.step})", flush=True)
                continue
        entries = score_run(run_dir, run, datamodules, multipliers, target_len, scalings, mask_draws)
        if cached is not None:
            cached.parent.mkdir(parents=True, exist_ok=True)
            cached.write_text(json.dumps({"protocol": run_protocol, "run": str(run_dir), "step": run.step, "entries": entries}))
        results += entries
    return results


def score_run(run_dir: Path, run, datamodules: dict, multipliers: list[int], target_len: int | None,
              scalings: list[str], mask_draws: int = 1) -> list[dict]:
    seq_len = int(run.config.data.seq_len)
    target_len = target_len or seq_len  # every target of the training window: the 1x loss is the training-length loss
    stream = run.datamodule.streams["validation"]
    pe = run.choices.get("pe") or str(run.config.pe.get("_target_", "")).rsplit(".", 1)[-1]
    arm = arm_label(pe, run.config, layers=BENCHMARK_LAYERS)
    labels = [arm] + ([f"rope+{s}" for s in scalings] if arm == "rope" else [])
    blocks = torch.from_numpy(np.asarray(stream[: ATTENTION_BLOCKS * seq_len], dtype=np.int64)).view(-1, seq_len)
    try:
        attention = position_attention_report(run.model.eval(), blocks)  # at the training length
    except NoHookPoints as err:  # a peer built from other modules (model=xtransformers): its loss is scored, not this
        attention = None
        print(f"{run_dir.name}: no position-attention figures ({err})", flush=True)
    entries, base = [], None
    for label in labels:
        start = time.perf_counter()
        if base is None:
            scores = base = fixed_target_losses(run.model, stream, seq_len, multipliers, target_len, mask_draws=mask_draws)
        else:  # the RoPE run with an inference-time scaling, its factor set per length
            scaling = label.split("+", 1)[1]
            scores = scaled_rope_losses(run_dir, scaling, datamodules, stream, seq_len, multipliers, target_len, base,
                                        mask_draws)
        scores = scores | {"run": str(run_dir), "family": label, "seed": int(run.config.get("seed", 0)), "step": run.step,
                           "seconds": round(time.perf_counter() - start, 1)} | ({"attention": attention} if attention else {})
        entries.append(scores)
        cells = [f"{m}x {v['loss']:.4f}" if v["loss"] != NA else f"{m}x n/a" for m, v in scores["lengths"].items()]
        print(f"{run_dir.name}: {label} s{scores['seed']}: " + "  ".join(cells), flush=True)
    return entries


def scaling_overrides(scaling: str, multiplier: int) -> dict:
    """The ``pe`` settings that read a RoPE run at ``multiplier`` x its training length with ``scaling`` at factor
    ``multiplier``.

    linear, ntk and yarn take the factor as it is. dynamic_ntk computes its own from the length L it reads,
    base * (s L / L_train - (s - 1))^(d/(d-2)), so its s must stay 1: then a window of m x L_train gets NTK's base
    at factor m. Setting s = m as well (as this benchmark once did) gives the base at factor m^2 - m + 1 (3, 13, 57
    and 241 at 2x, 4x, 8x and 16x)."""
    return {"scaling": scaling, "scaling_factor": 1.0 if scaling == "dynamic_ntk" else float(multiplier)}


def scaled_rope_losses(run_dir: Path, scaling: str, datamodules: dict, stream, seq_len: int, multipliers: list[int],
                       target_len: int | None, base: dict, mask_draws: int = 1) -> dict:
    """A RoPE run read with ``pe.scaling=<scaling>`` at factor = the multiplier (``scaling_overrides``), one length at
    a time.

    The 1x entry and every ratio's denominator are the unscaled run's (``base``), so the ratios compare
    the same targets.
    """
    merged = {k: v for k, v in base.items() if k != "lengths"} | {"lengths": {str(multipliers[0]): base["lengths"][str(multipliers[0])]}}
    for m in multipliers[1:]:
        scaled = load_trained_run(run_dir, datamodules=datamodules, pe_overrides=scaling_overrides(scaling, m))
        scores = fixed_target_losses(scaled.model, stream, seq_len, [multipliers[0], m], target_len, mask_draws=mask_draws)
        entry = scores["lengths"][str(m)]
        if entry["loss"] != NA:  # the ratio against the unscaled model's 1x loss, paired as fixed_target_losses pairs it
            entry["ratio"] = entry["loss"] / base["lengths"][str(multipliers[0])]["loss"]
            entry.pop("ratio_se", None)
        merged["lengths"][str(m)] = entry
    return merged


PROTOCOL_KEYS = ("objective", "target_len", "n_windows", "window_stride", "mask_draws")


def kept_entries(path: Path, relabel: dict[str, str], rescored: set[str], like: dict, multipliers: list[int]) -> list[dict]:
    """The entries of an earlier extrapolation.json to show beside this call's: every family this call did not score
    again, renamed by ``relabel`` (an arm's label once left out a setting that now names it, e.g. 'cope' trained at
    p_max 64). Refused unless they were scored by the same protocol (targets, windows, mask draws, lengths)."""
    try:
        earlier = json.loads(path.read_text())
        runs, kept_multipliers = earlier["runs"], earlier["multipliers"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise SystemExit(f"error: --keep {path}: not an extrapolation.json this script wrote ({err})") from None
    unknown = sorted(set(relabel) - {r["family"] for r in runs})
    if unknown:
        raise SystemExit(f"error: --relabel {unknown[0]}=...: no such family in {path}; "
                         f"its families: {sorted({r['family'] for r in runs})}")
    kept = [r | {"family": relabel.get(r["family"], r["family"])} for r in runs]
    kept = [r for r in kept if r["family"] not in rescored]
    for r in kept:
        differ = [k for k in PROTOCOL_KEYS if r.get(k) != like.get(k)]
        if differ or kept_multipliers != multipliers:
            what = ", ".join(f"{k} {r.get(k)} vs {like.get(k)}" for k in differ) or f"multipliers {kept_multipliers}"
            raise SystemExit(f"error: --keep {path}: {r['run']} was scored by another protocol ({what})")
    return kept


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
                "ratio_min": min(ratios), "ratio_max": max(ratios),
                **perplexity_ratio([e["loss"] - r["lengths"][str(multipliers[0])]["loss"] for e, r in zip(entries, runs)]),
                "max_rel_se": max(e["rel_se"] for e in entries),
            }
            ratio_se = [e["ratio_se"] for e in entries if e.get("ratio_se")]  # paired by window; a scaled read has none
            if len(ratio_se) == len(entries) > 1:
                cells[str(m)]["ratio_se_mean"] = mean(ratio_se)
        summary[family] = {"seeds": sorted(r["seed"] for r in runs), "lengths": cells,
                           "attention": summarise_attention([r["attention"] for r in runs if "attention" in r])}
    return summary


def perplexity_ratio(deltas: list[float]) -> dict:
    """Perplexity at m x over perplexity at 1x, the published figures' unit, from each seed's loss difference on the
    same targets: exp(mean delta), the geometric mean of the seeds' ratios, with exp of the seeds' smallest and
    largest delta as its spread. (The arithmetic mean of exp(delta) lets one seed that blows up set the figure.)"""
    return {"ppl_ratio": math.exp(mean(deltas)), "ppl_ratio_min": math.exp(min(deltas)),
            "ppl_ratio_max": math.exp(max(deltas)), "log_ppl_ratio_sd": stdev(deltas) if len(deltas) > 1 else 0.0}


def summarise_attention(reports: list[dict]) -> dict | None:
    """Seeds' block-0 positional share (mean over heads) and, per layer, attention distance over uniform attention's
    (mean over heads, and the most local head's): mean and sd over seeds."""
    if not reports:
        return None

    def stats(values: list[float]) -> dict:
        return {"mean": mean(values), "sd": stdev(values) if len(values) > 1 else 0.0}

    out = {"positional_share": stats([mean(r["positional_share"]) for r in reports])}
    if all("null_mean" in r for r in reports):
        out["null_mean"] = stats([mean(r["null_mean"]) for r in reports])
        out["null_std"] = stats([mean(r["null_std"]) for r in reports])
    n_layers = len(reports[0]["mean_distance"])
    ratios = [[[d / r["distance_chance"][layer] for d in r["mean_distance"][layer]] for layer in range(n_layers)] for r in reports]
    out["distance_ratio"] = [stats([mean(run[layer]) for run in ratios]) for layer in range(n_layers)]
    out["most_local_ratio"] = [stats([min(run[layer]) for run in ratios]) for layer in range(n_layers)]
    return out


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
    import matplotlib

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
    import textwrap

    import matplotlib

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


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, help="sweep folders (or run folders) with trained runs")
    parser.add_argument("--include-unfinished", action="store_true",
                        help="score runs killed before trainer.max_steps where they stopped (refused otherwise)")
    parser.add_argument("--out", type=Path, required=True, help="folder for extrapolation.{json,md,png}, position_attention.png")
    parser.add_argument("--multipliers", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--target-len", type=int, default=None,
                        help="scored tokens per window (default seq_len: at 1x, every target of the training window)")
    parser.add_argument("--scalings", nargs="*", default=["linear", "ntk", "dynamic_ntk", "yarn"],
                        help="inference-time RoPE scalings to score the RoPE runs with (none: --scalings)")
    parser.add_argument("--mask-draws", type=int, default=4,
                        help="masked-LM runs: independent mask draws scored per window (1 leaves ~10 of 64 targets; "
                             "4 brings the loss's standard error under 1 %%); decoders ignore it")
    parser.add_argument("--cache", type=Path, default=None,
                        help="folder keeping each run's scores: a rerun scores only new or retrained runs")
    parser.add_argument("--keep", type=Path, default=None, metavar="EXTRAPOLATION_JSON",
                        help="an earlier extrapolation.json (same protocol) whose families this call does not score "
                             "again are kept beside the new ones")
    parser.add_argument("--relabel", nargs="*", default=[], metavar="OLD=NEW",
                        help="with --keep: rename a kept family (e.g. cope='cope (p_max 64)')")
    args = parser.parse_args(argv)
    relabel = dict(pair.split("=", 1) for pair in args.relabel if "=" in pair)
    if len(relabel) != len(args.relabel) or (relabel and args.keep is None):
        parser.error("--relabel takes OLD=NEW pairs, with --keep")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    start = time.perf_counter()
    results = score_runs(args.folders, args.multipliers, args.target_len, args.scalings, cache=args.cache,
                         mask_draws=args.mask_draws, include_unfinished=args.include_unfinished)
    first = results[0]
    # runs named by sweep folder and run folder, not by this machine's absolute paths (the results are committed)
    runs = [r | {"run": "/".join(Path(r["run"]).parts[-2:])} for r in results]
    kept = (kept_entries(args.keep, relabel, {r["family"] for r in runs}, first, args.multipliers)
            if args.keep is not None else [])
    runs += kept
    summary = summarise(runs, args.multipliers)
    args.out.mkdir(parents=True, exist_ok=True)
    masks = f" (the masked ones among them, {first['mask_draws']} mask draws per window)" if "mask_draws" in first else ""
    protocol = (f"{first['objective']} runs; the same {first['target_len']} target tokens per window at every length{masks}, "
                f"{first['n_windows']} windows (one every {first['window_stride']} validation tokens); "
                "ratio = loss / loss at 1x on the same targets, mean ± sd over seeds")
    payload = {"protocol": protocol, "multipliers": args.multipliers, "summary": summary, "runs": runs,
               "machine": f"{platform.machine()}, torch {torch.__version__}", "seconds": round(time.perf_counter() - start)}
    (args.out / "extrapolation.json").write_text(json.dumps(payload, indent=1))
    table = markdown_table(summary, args.multipliers)
    worst = max((c.get("max_rel_se", 0.0) for s in summary.values() for c in s["lengths"].values()), default=float("nan"))
    common = common_multiplier(summary, args.multipliers)
    attention = attention_table(summary, common)
    kept_note = (f" {len(kept)} of them ({', '.join(sorted({r['family'] for r in kept}))}) kept from an earlier "
                 f"extrapolation.json (`--keep`; scored by the same protocol){relabel_note(relabel)}." if kept else "")
    (args.out / "extrapolation.md").write_text(
        f"# Length extrapolation\n\n{protocol}.\n\n{len(runs)} scored entries from the sweep folders "
        f"{', '.join(sorted({r['run'].split('/')[0] for r in runs}))} (`python experiments/extrapolation.py <folders> "
        f"--out <here>`; each run's loss, standard error and ratio at every length in extrapolation.json).{kept_note}\n\n"
        f"{uncertainty_note(summary, worst)}\n\n{FLAT_NOTE}\n\n{table}\n\n![loss vs length](extrapolation.png)\n\n"
        f"## Where position enters the attention\n\n{ATTENTION_NOTE.format(blocks=ATTENTION_BLOCKS)}\n\n{attention}\n\n"
        "![position in the attention vs extrapolation](position_attention.png)\n")
    plot(summary, args.multipliers, args.out / "extrapolation.png",
         protocol.replace("mean ± sd over seeds", "line: mean over seeds, band: min-max over seeds"))
    plot_attention(summary, common, args.out / "position_attention.png")
    print(table)
    print(f"wrote {args.out}/extrapolation.{{json,md,png}} in {time.perf_counter() - start:.0f} s")
    return payload


if __name__ == "__main__":
    from pe_geometry.cli import console_script

    np.seterr(all="ignore")
    console_script(main)()  # bad input: one error line, exit code 2
