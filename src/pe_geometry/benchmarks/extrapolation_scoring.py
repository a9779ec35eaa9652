"""Each trained run's loss at 1x-16x its training length on the same held-out targets, and the summary over seeds.

``score_runs`` rebuilds every run from its last checkpoint and scores it with ``analysis.extrapolation.
fixed_target_losses``; a RoPE run also with each inference-time scaling (``scaled_rope_losses``); ``kept_entries``
reads an earlier extrapolation.json back; ``summarise`` pools a family's seeds. The command: benchmarks/extrapolation.py.
"""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from pathlib import Path
from statistics import mean, stdev

import numpy as np
import torch
from omegaconf import OmegaConf

from pe_geometry.analysis.measures.position_attention import NoHookPoints, position_attention_report
from pe_geometry.analysis.readers.extrapolation import NA, fixed_target_losses
from pe_geometry.benchmarks.arms import arm_label
from pe_geometry.benchmarks.runs import refuse_task_runs, run_dirs
from pe_geometry.configs import CONFIG_DIR
from pe_geometry.training.run_loader import load_trained_run

ATTENTION_BLOCKS = 16  # validation blocks at the training length for the attention figures (the first ones)


# experiment=extrapolation's depth (it trains at the study's size): a run of another depth is an arm of its own
BENCHMARK_LAYERS = int(OmegaConf.load(CONFIG_DIR / "experiment" / "orthogonality.yaml").model.n_layers)


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
    dirs = list(run_dirs(folders, include_unfinished))
    refuse_task_runs(dirs)  # before any run is scored: nothing written
    for run_dir in dirs:
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
        raise SystemExit(f"error: --keep {path}: not an extrapolation.json pe-bench extrapolation wrote ({err})") from None
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
