"""The presets (experiment=smollm2_like, gemma3_like) read beside the checkpoints they mirror: each trained run's
positional share and attention distance per layer kind, pooled over seeds, and the real model's figures by the same
kinds from its pe-pretrained record."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from statistics import fmean

import numpy as np
import torch

from pe_geometry.analysis.measures.position_attention import position_attention_report
from pe_geometry.benchmarks.pretrained_report import block0_share
from pe_geometry.benchmarks.runs import run_dirs
from pe_geometry.training.run_loader import load_trained_run

PRESETS = {"smollm2_like": "smollm2", "gemma3_like": "gemma3"}  # experiment=<preset> mirrors pe-pretrained <model>
PRESET_BLOCKS = 16  # validation blocks at the training length: benchmarks/extrapolation_scoring.py's ATTENTION_BLOCKS
PRESET_NULL_DRAWS = 100  # block 0's rotation null: as many draws as pe-pretrained's


def preset_settings(quick: bool) -> dict:
    return {"n_blocks": 4, "n_draws": 3} if quick else {"n_blocks": PRESET_BLOCKS, "n_draws": PRESET_NULL_DRAWS}


def layer_kind(window: int | None) -> str:
    """A layer's kind in pe-pretrained's words: 'window 16', 'global'."""
    return "global" if window is None else f"window {window}"


def score_preset_run(run_dir: Path, datamodules: dict, n_blocks: int = PRESET_BLOCKS,
                     n_draws: int = PRESET_NULL_DRAWS) -> dict:
    """One finished preset run read on the first ``n_blocks`` validation blocks of its own data at its training
    length (position_attention_report, block 0's rotation null with ``n_draws`` draws), with what it is."""
    run = load_trained_run(run_dir, datamodules=datamodules)
    preset, max_steps = run.choices.get("experiment"), int(run.config.trainer.max_steps)
    if preset not in PRESETS:
        raise SystemExit(f"error: {run_dir} was trained with experiment={preset}, not one of {sorted(PRESETS)}")
    if run.step < max_steps:
        raise SystemExit(f"error: {run_dir} stopped at step {run.step} of {max_steps}: finish it (ckpt_path=auto)")
    seq_len = int(run.config.data.seq_len)
    stream = run.datamodule.streams["validation"]
    ids = torch.from_numpy(np.asarray(stream[: n_blocks * seq_len], dtype=np.int64)).view(-1, seq_len)
    report = position_attention_report(run.model.eval(), ids, n_draws=n_draws)
    attns = [block.attn for block in run.model.blocks]
    data = run.config.data
    return {"run": str(run_dir), "preset": preset, "seed": int(run.config.get("seed", 0)), "step": run.step,
            "seq_len": seq_len, "n_blocks": int(ids.shape[0]), "n_draws": n_draws,
            "tokens_seen": max_steps * int(data.batch_size) * seq_len, "vocab_size": int(data.vocab_size),
            "model": {"n_layers": len(attns), "d_model": int(run.config.model.d_model), "n_heads": attns[0].n_heads,
                      "n_kv_heads": attns[0].n_kv_heads, "d_head": attns[0].d_head, "qk_norm": bool(attns[0].qk_norm)},
            "layer_kinds": [layer_kind(a.window) for a in attns],
            "layer_bases": [getattr(a.pe, "base", None) for a in attns],
            "attention": report}


def _stats(values: list[float]) -> dict:
    return {"mean": fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0, "n": len(values)}


def real_base(r: dict, kind: str) -> float | None:
    """The RoPE base of a real model's layers of one kind (Gemma 3: sliding 1e4, full 1e6)."""
    rope = r["model"].get("rope_parameters") or {}
    part = rope.get("full_attention" if kind == "global" else "sliding_attention", rope)
    return part.get("rope_theta") if isinstance(part, dict) else None


def real_summary(r: dict) -> dict:
    """A real model's per-layer figures (pe-pretrained's attention_layers) by layer kind: each layer's share and
    distance over uniform's (means over heads), mean and sd over the layers of the kind; block 0's share and the mean
    of its heads' rotation nulls."""
    kinds: dict[str, list[dict]] = {}
    for a in r["attention_layers"]:
        kinds.setdefault(a["kind"], []).append(a)
    by_kind = {}
    for kind, rows in kinds.items():
        shares = [fmean(a["positional_share"]) for a in rows if a["positional_share"] is not None]
        by_kind[kind] = {"layers": [a["layer"] for a in rows], "base": real_base(r, kind),
                         "positional_share": _stats(shares) if shares else None,
                         "distance_ratio": _stats([fmean(a["mean_distance"]) / a["distance_chance"] for a in rows]),
                         "distance_chance": fmean([a["distance_chance"] for a in rows])}
    nulls = r["attention_layers"][0].get("positional_share_null")
    block0 = {"positional_share": block0_share(r),
              "null_mean": fmean([n["share_null_mean"] for n in nulls]) if nulls else None}
    return {"by_kind": by_kind, "block0": block0}


def preset_summary(runs: list[dict]) -> dict:
    """One preset's seeds: per layer kind (each seed's mean over the kind's layers of the mean over heads), per layer,
    and block 0's share and rotation null's mean (means over heads): mean and sd over seeds."""
    kinds = runs[0]["layer_kinds"]
    if any(run["layer_kinds"] != kinds for run in runs):
        raise SystemExit(f"error: the {runs[0]['preset']} runs differ in their layers: {[r['layer_kinds'] for r in runs]}")

    def share(run: dict, layer: int) -> float:
        return fmean(run["attention"]["positional_share_layers"][layer])

    def ratio(run: dict, layer: int) -> float:
        a = run["attention"]
        return fmean(a["mean_distance"][layer]) / a["distance_chance"][layer]

    by_kind = {}
    for kind in dict.fromkeys(kinds):
        layers = [i for i, k in enumerate(kinds) if k == kind]
        by_kind[kind] = {"layers": layers, "base": runs[0]["layer_bases"][layers[0]],
                         "positional_share": _stats([fmean([share(run, i) for i in layers]) for run in runs]),
                         "distance_ratio": _stats([fmean([ratio(run, i) for i in layers]) for run in runs]),
                         "distance_chance": runs[0]["attention"]["distance_chance"][layers[0]]}
    per_layer = [{"layer": i, "kind": kind, "base": runs[0]["layer_bases"][i],
                  "positional_share": _stats([share(run, i) for run in runs]),
                  "distance_ratio": _stats([ratio(run, i) for run in runs])} for i, kind in enumerate(kinds)]
    block0 = {"positional_share": _stats([fmean(run["attention"]["positional_share"]) for run in runs])}
    if all("null_mean" in run["attention"] for run in runs):
        block0["null_mean"] = _stats([fmean(run["attention"]["null_mean"]) for run in runs])
    return {"by_kind": by_kind, "layers": per_layer, "block0": block0}


RECIPE_KEYS = ("step", "seq_len", "tokens_seen", "vocab_size", "n_blocks", "n_draws")


def preset_comparison(runs: list[dict], real: dict[str, dict | None]) -> dict:
    """Scored preset runs (score_preset_run) grouped by preset, each beside its checkpoint's reading (``real``: name
    -> pe-pretrained's record, or None where there is none): {preset: {real, model, seeds, runs, summary,
    real_model, real_summary}}."""
    out = {}
    for preset in PRESETS:
        mine = sorted((r for r in runs if r["preset"] == preset), key=lambda r: r["seed"])
        if not mine:
            continue
        seeds = [r["seed"] for r in mine]
        if len(set(seeds)) < len(seeds):
            raise SystemExit(f"error: {preset}: seeds {seeds} repeat; give each sweep once")
        name, r = PRESETS[preset], real.get(PRESETS[preset])
        recipes = [{k: run[k] for k in RECIPE_KEYS} | {"model": run["model"]} for run in mine]
        if any(recipe != recipes[0] for recipe in recipes):
            raise SystemExit(f"error: {preset}: the seeds were trained or read differently: {recipes}")
        out[preset] = {"real": name, "model": mine[0]["model"], "seeds": seeds,
                       "recipe": {k: mine[0][k] for k in RECIPE_KEYS},
                       "runs": mine, "summary": preset_summary(mine)} | beside(r)
    return out


def beside(r: dict | None) -> dict:
    """The fields of a preset's entry that come from its checkpoint's reading (``r``: pe-pretrained's record)."""
    return {"real_model": None if r is None else r["model"], "real_windows": None if r is None else r.get("windows"),
            "real_summary": None if r is None else real_summary(r)}


def refresh_real(presets: dict, real: dict[str, dict | None]) -> dict:
    """Committed presets (``preset_comparison``'s) beside the checkpoints' current readings: a model read again (its
    JSON recomputed) moves the figures shown beside the trained presets, whose own runs need not be read again."""
    return {preset: entry | beside(real[entry["real"]]) if real.get(entry["real"]) is not None else entry
            for preset, entry in presets.items()}


def preset_study(folders: list[Path], real: dict[str, dict | None], n_blocks: int = PRESET_BLOCKS,
                 n_draws: int = PRESET_NULL_DRAWS) -> dict:
    runs, datamodules = [], {}
    for run_dir in run_dirs(folders):
        start = time.perf_counter()
        runs.append(score_preset_run(run_dir, datamodules, n_blocks, n_draws))
        print(f"{run_dir.name}: {runs[-1]['preset']} s{runs[-1]['seed']}: {time.perf_counter() - start:.0f} s", flush=True)
    return preset_comparison(runs, real)
