"""The real checkpoints beside the trained-here runs, on the same axes; and the quantisation band.

    python experiments/pretrained_study.py --out experiments/results/pretrained            # minilm smollm2 gemma3
    python experiments/pretrained_study.py --out DIR --models minilm --quick               # a smoke run (seconds)
    python experiments/pretrained_study.py --out experiments/results/pretrained --presets SWEEP_DIR [SWEEP_DIR ...]

1. ``pe-pretrained``'s whole record (analysis.pretrained.analyse) of each model -> ``<model>.json`` (an existing file
   is kept: a stopped study continues where it stopped; --force recomputes).
2. The band: MiniLM (fp32) measured again with its weights round-tripped through each quantised file's own scheme
   (analysis.quantisation: the file's type per role, K-quants through their stand-ins) -> ``band.json``, ``band.md``:
   how far 4-bit weights move each figure on a model whose fp32 weights we have.
3. ``table.md``: per model (and per trained-here family, from the committed extrapolation benchmark's block-0 figures)
   the input-level overlap against its null (learned tables), the probe's R^2 at relative depths 0, 1/4, 1/2, 3/4, 1,
   block 0's positional share, every head's share against its rotation null (RoPE), and attention distance over
   uniform's at blocks 0-1.
4. With ``--presets``: the trained ``experiment=smollm2_like`` / ``experiment=gemma3_like`` runs (a sweep folder or run
   folders), each read on the first 16 validation blocks of its own data at its training length (as
   experiments/extrapolation.py's runs), beside the checkpoint it mirrors, per layer kind (windowed, global): every
   layer's positional share and attention distance over uniform's, mean +- sd over seeds, and block 0's share against
   its rotation null -> ``presets.json``, ``presets.md``; ``table.md`` gets their block-0 rows (a later run without
   ``--presets`` reads ``presets.json`` back).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import pe_geometry.offline  # noqa: F401  (before anything that could reach a hub)

# isort: split

import numpy as np
import torch

from pe_geometry.analysis.position_attention import position_attention_report
from pe_geometry.analysis.pretrained import analyse, quantisation_band
from pe_geometry.training.run_loader import load_trained_run

sys.path.insert(0, str(Path(__file__).resolve().parent))  # experiments/ scripts share their helpers
from extrapolation import run_dirs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TRAINED = ROOT / "experiments/results/extrapolation/extrapolation.json"  # the ten families trained here, 3 seeds
TRAINED_GEOMETRY = ROOT / "experiments/results/orthogonality/summary.json"  # the same recipe's geometry records
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
FAMILIES_HERE = ("learned", "rope", "alibi", "t5_bias", "none")


def settings(quick: bool) -> dict:
    if quick:
        return {"probe_permutations": 5, "attention_null_draws": 3, "n_windows": 8, "seq_len": 32}
    return {}  # analyse's defaults: 32 windows x 64 tokens, 100 probe draws, 100 rotation draws


# ----------------------------------------------------------------------------- figures


def _mean(values: list[float]) -> float:
    return statistics.fmean(values)


def block0_share(r: dict) -> float | None:
    """Block 0's positional share, mean over heads (a learned table: the input split's four position terms)."""
    if "attention_layer0" in r:
        return _mean(r["attention_layer0"]["shares"]["positional"])
    a = r["attention_layers"][0]
    return None if a["positional_share"] is None else _mean(a["positional_share"])


def against_null(r: dict) -> str:
    """Every head's share against its rotation null: heads below their null's median (sign test p), and the mean
    share beside the null's."""
    n = r.get("rotation_null")
    if n is None:
        return "–"
    return (f"{n['below_null_median']}/{n['n_heads']} below (p {n['sign_test_p']:.1g}); "
            f"{n['share_mean']:.2f} vs {n['null_mean']:.2f}")


def probe_by_depth(r: dict, figure: str = "position_r2") -> list[float]:
    """The probe's R^2 at the block input nearest each relative depth (0 = the embedding output, 1 = the output);
    ``figure`` "log_position_r2": the probe of log(1 + position), which a compressive code (fine near the start,
    coarse far out) fits better than position itself."""
    layers = r["hidden_states"]
    return [layers[round(depth * (len(layers) - 1))][figure] for depth in DEPTHS]


def window_tokens(r: dict) -> str:
    """The tokens a real model's probe was read on per window (a compressive code caps linear R^2 lower at longer
    windows, so every R^2 is read with its window)."""
    w = r.get("windows") or {}
    return str(w["seq_len"])


def distance_ratio(r: dict, layer: int) -> float:
    a = r["attention_layers"][layer]
    return _mean(a["mean_distance"]) / a["distance_chance"]


# ----------------------------------------------------------------------------- the band


def band_markdown(result: dict, schemes: dict[str, dict]) -> list[str]:
    names = list(result["schemes"])
    lines = ["# How far 4-bit weights move each figure: MiniLM (fp32) round-tripped through each file's scheme", "",
             "MiniLM-L6's fp32 weights quantised and dequantised with the gguf package's reference code, each weight "
             "with the type the named GGUF file gives its role (word table, q/k, other matrices; K-quants through the "
             "stand-in of analysis.quantisation.STAND_IN, whose band is within 0.97-1.35x of the real Q4_K's on the "
             "hidden states), then measured exactly as the fp32 model. |Δ| = |quantised − fp32|; read a figure of a "
             "quantised file as ± this band.", ""]
    for name in names:
        s = schemes[name]
        lines.append(f"- `{name}`: word table {s['embedding']}, q/k {s['qk']}, other matrices {s['matrix']} "
                     f"(types used on MiniLM: {result['types'][name]})")
    lines += ["", "| figure | fp32 | " + " | ".join(f"{n} |Δ|" for n in names) + " |",
              "|---|---|" + "---|" * len(names)]
    for figure, value in result["fp32"].items():
        cells = [f"{result['schemes'][n][figure]['abs_diff']:.2g}" for n in names]
        lines.append(f"| {figure} | {value:.4f} | " + " | ".join(cells) + " |")
    return lines + [""]


# ----------------------------------------------------------------------------- the table


def _fmt(x: float | None, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def table(results: dict[str, dict], trained: dict | None, band_result: dict | None,
          presets: dict | None = None) -> list[str]:
    head = ["model", "encoding", "layers x d", "overlap_k8 / null (input)", "window (tokens)",
            "probe R², position, at depth 0 / ¼ / ½ / ¾ / 1", "probe R², log position, at depth 0 / ¼ / ½ / ¾ / 1",
            "block 0 positional share", "every head vs its rotation null: below its median; mean share vs null",
            "distance / uniform, block 0; 1"]
    lines = ["# Real checkpoints beside the trained-here runs, on the same axes", "",
             "Real models: `pe-pretrained` on 32 windows of 64 tokens of the shipped plays under each model's own "
             "tokenizer (probe: grouped-CV ridge, null of 100 cyclic shifts, R² null mean ~0 throughout; share: the "
             "variance share of the scores from what the encoding adds, for learned tables block 0's four position "
             "terms; the rotation null: each head's q and k turned by a random orthogonal matrix before the rotation, 100 "
             "draws; under it a head is as likely below its median as above: sign test over all heads). Trained here (mean over 3 "
             "seeds, d 64, 2 blocks, 1800 steps on the plays): shares and distances from the extrapolation benchmark's "
             "runs, overlap and probe from the orthogonality study's (the same recipe; its probe reads 128 validation "
             "blocks).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in results.items():
        m = r["model"]
        overlap = "–"
        if "frequent_rows" in r:
            g = r["frequent_rows"]["geometry"]
            overlap = f"{g['overlap_k8']:.3f} / {g['overlap_k8_null_mean']:.3f}"
        share = block0_share(r)
        probe = " / ".join(f"{v:.2f}" for v in probe_by_depth(r))
        log_probe = " / ".join(f"{v:.2f}" for v in probe_by_depth(r, "log_position_r2"))
        quantised = f", {r['quantisation']['matrix']}" if r["quantisation"] else ""
        lines.append(f"| {name} ({m['model_type']}{quantised}) | {m['encoding']} | {m['n_layers']} x {m['d_model']} | "
                     f"{overlap} | {window_tokens(r)} | {probe} | {log_probe} | {_fmt(share)} | {against_null(r)} | "
                     f"{distance_ratio(r, 0):.2f}; {distance_ratio(r, 1):.2f} |")
    geometry = json.loads(TRAINED_GEOMETRY.read_text())["groups"] if TRAINED_GEOMETRY.exists() else {}
    for family in FAMILIES_HERE if trained else ():
        a = trained["summary"][family]["attention"]
        null = f"null mean {a['null_mean']['mean']:.3f}" if "null_mean" in a else "–"
        d0, d1 = (x["mean"] for x in a["distance_ratio"])
        overlap = ""
        probes = {"position_r2": "", "log_position_r2": ""}
        measures = geometry.get(family, {}).get("measures", {})
        if "geometry/overlap_k8" in measures:
            m = measures["geometry/overlap_k8"]
            overlap = f"{m['end']['mean']:.3f} / {m['null_mean']['end']['mean']:.3f}"
        for figure in probes:
            r2 = [measures.get(f"geometry/hidden/layer{i}/{figure}", {}).get("end", {}).get("mean") for i in range(3)]
            if None not in r2:  # 2 blocks: inputs 0, 1 and the output are depths 0, 1/2, 1
                probes[figure] = f"{r2[0]:.2f} / – / {r2[1]:.2f} / – / {r2[2]:.2f}"
        lines.append(f"| trained here: {family} | {family} | 2 x 64 | {overlap} | 64 | {probes['position_r2']} | "
                     f"{probes['log_position_r2']} | "
                     f"{a['positional_share']['mean']:.3f} ± {a['positional_share']['sd']:.3f} | {null} (block 0) | "
                     f"{d0:.2f}; {d1:.2f} |")
    for preset, p in (presets or {}).items():
        m, b0, layers = p["model"], p["summary"]["block0"], p["summary"]["layers"]
        null = f"null mean {b0['null_mean']['mean']:.3f}" if b0.get("null_mean") else "–"
        d0, d1 = (f"{layers[i]['distance_ratio']['mean']:.2f}" if i < len(layers) else "–" for i in (0, 1))
        lines.append(f"| trained here: {preset} | {scheme_words(p)} | {m['n_layers']} x {m['d_model']} |  | "
                     f"{p['recipe']['seq_len']} |  |  | "
                     f"{b0['positional_share']['mean']:.3f} ± {b0['positional_share']['sd']:.3f} | {null} (block 0) | "
                     f"{d0}; {d1} |")
    if presets:
        pairs = ", ".join(f"{k} beside {v['real']} ({_seeds(len(v['seeds']))})" for k, v in presets.items())
        lines += ["", f"The presets (trained here: {pairs}; {presets_recipe(presets)}), per layer kind beside the "
                  "checkpoint each mirrors: presets.md."]
    if band_result is not None:
        worst = max(band_result["max_abs_diff"].items(), key=lambda kv: kv[1])
        lines += ["", f"Quantisation band (band.md, MiniLM round-tripped through each file's scheme): the largest move of "
                  f"any figure is {worst[1]:.3g} ({worst[0]}); probe R² moves by at most "
                  f"{max(v for k, v in band_result['max_abs_diff'].items() if k.startswith('probe/')):.3g}."]
    return lines + [""]


# ----------------------------------------------------------------------------- the presets

PRESETS = {"smollm2_like": "smollm2", "gemma3_like": "gemma3"}  # experiment=<preset> mirrors pe-pretrained <model>
PRESET_BLOCKS = 16  # validation blocks at the training length: experiments/extrapolation.py's ATTENTION_BLOCKS
PRESET_NULL_DRAWS = 100  # block 0's rotation null: as many draws as pe-pretrained's
REAL_HEAD_DIM = {"smollm2": 64, "gemma3": 256}  # their GGUF headers (Gemma 3's is not d_model / n_heads)


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
    return {"mean": _mean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0, "n": len(values)}


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
        shares = [_mean(a["positional_share"]) for a in rows if a["positional_share"] is not None]
        by_kind[kind] = {"layers": [a["layer"] for a in rows], "base": real_base(r, kind),
                         "positional_share": _stats(shares) if shares else None,
                         "distance_ratio": _stats([_mean(a["mean_distance"]) / a["distance_chance"] for a in rows]),
                         "distance_chance": _mean([a["distance_chance"] for a in rows])}
    nulls = r["attention_layers"][0].get("positional_share_null")
    block0 = {"positional_share": block0_share(r),
              "null_mean": _mean([n["share_null_mean"] for n in nulls]) if nulls else None}
    return {"by_kind": by_kind, "block0": block0}


def preset_summary(runs: list[dict]) -> dict:
    """One preset's seeds: per layer kind (each seed's mean over the kind's layers of the mean over heads), per layer,
    and block 0's share and rotation null's mean (means over heads): mean and sd over seeds."""
    kinds = runs[0]["layer_kinds"]
    if any(run["layer_kinds"] != kinds for run in runs):
        raise SystemExit(f"error: the {runs[0]['preset']} runs differ in their layers: {[r['layer_kinds'] for r in runs]}")

    def share(run: dict, layer: int) -> float:
        return _mean(run["attention"]["positional_share_layers"][layer])

    def ratio(run: dict, layer: int) -> float:
        a = run["attention"]
        return _mean(a["mean_distance"][layer]) / a["distance_chance"][layer]

    by_kind = {}
    for kind in dict.fromkeys(kinds):
        layers = [i for i, k in enumerate(kinds) if k == kind]
        by_kind[kind] = {"layers": layers, "base": runs[0]["layer_bases"][layers[0]],
                         "positional_share": _stats([_mean([share(run, i) for i in layers]) for run in runs]),
                         "distance_ratio": _stats([_mean([ratio(run, i) for i in layers]) for run in runs]),
                         "distance_chance": runs[0]["attention"]["distance_chance"][layers[0]]}
    per_layer = [{"layer": i, "kind": kind, "base": runs[0]["layer_bases"][i],
                  "positional_share": _stats([share(run, i) for run in runs]),
                  "distance_ratio": _stats([ratio(run, i) for run in runs])} for i, kind in enumerate(kinds)]
    block0 = {"positional_share": _stats([_mean(run["attention"]["positional_share"]) for run in runs])}
    if all("null_mean" in run["attention"] for run in runs):
        block0["null_mean"] = _stats([_mean(run["attention"]["null_mean"]) for run in runs])
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
                       "runs": mine, "summary": preset_summary(mine),
                       "real_model": None if r is None else r["model"],
                       "real_windows": None if r is None else r.get("windows"),
                       "real_summary": None if r is None else real_summary(r)}
    return out


def preset_study(folders: list[Path], real: dict[str, dict | None], n_blocks: int = PRESET_BLOCKS,
                 n_draws: int = PRESET_NULL_DRAWS) -> dict:
    runs, datamodules = [], {}
    for run_dir in run_dirs(folders):
        start = time.perf_counter()
        runs.append(score_preset_run(run_dir, datamodules, n_blocks, n_draws))
        print(f"{run_dir.name}: {runs[-1]['preset']} s{runs[-1]['seed']}: {time.perf_counter() - start:.0f} s", flush=True)
    return preset_comparison(runs, real)


def _base(base: float | None) -> str:
    return "" if base is None else f" (base {base:.0e})".replace("e+0", "e")


def scheme_words(p: dict) -> str:
    kinds = p["summary"]["by_kind"]
    return "rope: " + ", ".join(f"{len(k['layers'])} x {kind}{_base(k['base'])}" for kind, k in kinds.items())


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def _seeds(n: int) -> str:
    return f"{n} seed{'' if n == 1 else 's'}"


def presets_recipe(presets: dict) -> str:
    p = next(iter(presets.values()))["recipe"]
    return f"{p['step']} steps at {p['seq_len']} tokens, read on {p['n_blocks']} validation blocks"


def _windows_read(w: dict | None) -> str:
    """How pe-pretrained read a model: its windows, and the first token it set before the text (its <bos>)."""
    if not w:
        return "its own windows"
    first = " (a <bos> first: heads that rest on it lengthen the distances)" if w["text_positions"][0] > 0 else ""
    return f"{w['n']} windows of {w['seq_len']} tokens{first}"


def _pm(s: dict | None, digits: int = 3) -> str:
    return "–" if s is None else f"{s['mean']:.{digits}f} ± {s['sd']:.{digits}f}"


def preset_differences(preset: dict) -> list[str]:
    """What sets a preset's reading apart from its checkpoint's beyond size and data: the heads and the windows."""
    m, rm, seq_len = preset["model"], preset["real_model"] or {}, preset["recipe"]["seq_len"]
    real, name = preset["real"], preset["runs"][0]["preset"]
    real_head = REAL_HEAD_DIM.get(real) or rm.get("d_model", 0) // max(rm.get("n_heads", 1), 1)
    pairs = ("the same rotation frequencies for the same base" if real_head == m["d_head"] else
             f"{real_head // 2} rotation pairs there, {m['d_head'] // 2} here, spanning the same range of frequencies "
             "for the same base")
    lines = [f"Heads: {rm.get('n_heads', '?')} query heads to {rm.get('n_kv_heads', '?')} KV in {real}, "
             f"{m['n_heads']} to {m['n_kv_heads']} here; {real_head} dims a head there, {m['d_head']} here ({pairs})"
             + ("; QK-norm in both." if m["qk_norm"] else ".")]

    def widths(kinds) -> list[int]:
        return sorted({int(kind.split()[1]) for kind in kinds if kind.startswith("window")})

    windows = widths(preset["summary"]["by_kind"])
    real_windows = widths((preset["real_summary"] or {}).get("by_kind", {}))
    read = (preset.get("real_windows") or {}).get("seq_len", 64)
    for w in real_windows:
        lines.append(
            f"Window: {real}'s local layers see a {w}-token window. " + (
                f"At the {read}-token windows it is read on here that window covers every earlier position, so in "
                "the real model's reading a local layer sees exactly the keys a global layer sees: whatever differs "
                "between its local and global layers (share, distance) is learnt (with the base), not imposed by the "
                "mask." if w >= read else f"It is shorter than the {read}-token windows it is read on."))
    for w in windows:
        lines.append(
            f"In {name} the {w}-token window covers {w} of the {seq_len} positions of a block: its local layers are "
            "local by construction (their uniform attention's distance, in brackets, is already short; the ratio is "
            "taken over it), so its local/global contrast is partly the mask's"
            + (", where the real model's is learnt." if real_windows and max(real_windows) >= read else "."))
    if not real_windows and not windows:
        lines.append(f"Every layer is global in both: the 'global' row pools {rm.get('n_layers', '?')} layers there, "
                     f"{m['n_layers']} here.")
    return lines


def presets_markdown(presets: dict) -> list[str]:
    lines = ["# The presets beside the checkpoints they mirror, on the same axes", "",
             "`experiment=smollm2_like` (RoPE base 1e5 over 64-dim heads, 3 query heads per KV head, 2 layers x 192) "
             "beside SmolLM2-135M, and `experiment=gemma3_like` (6 layers x 128: layers 1-5 a 16-token window with "
             "base 1e4, layer 6 global with base 1e6, 1 KV head, QK-norm) beside Gemma 3 270M, each layer read by "
             "analysis.position_attention's two figures (the real models' per-layer readings are pe-pretrained's, "
             "<model>.json `attention_layers`, by the same estimator). Positional share: the share of a layer's score "
             "variance along the keys a query sees that comes from what the rotation adds (mean over heads, then over "
             "the layers of a kind). Distance / uniform: the mean |i - j| under the attention weights over uniform "
             "attention's over the same keys (< 1 local; uniform's distance in brackets). Trained here: mean ± sd over "
             "the seeds of each seed's figure; the real models are one model each: ± is the sd over the layers of the "
             "kind. Block 0's share against its rotation null: each head's q and k turned by a random orthogonal "
             "matrix before the rotation (the mean over heads of the null's mean).", ""]
    for preset, p in presets.items():
        m, rec, s = p["model"], p["recipe"], p["summary"]
        real, rm, rs = p["real"], p["real_model"], p["real_summary"]
        here = f"{preset} ({m['n_layers']} x {m['d_model']}, {_seeds(len(p['seeds']))})"
        lines += [f"## {preset} beside {real}", "",
                  f"Trained here: seeds {p['seeds']}, {rec['step']} steps on the plays at {rec['seq_len']} tokens; "
                  f"read on the first {rec['n_blocks']} validation blocks at {rec['seq_len']} tokens; block 0's null "
                  f"{rec['n_draws']} draws.", "",
                  "| model | layer kind | layers | positional share | distance / uniform (uniform's) |",
                  "|---|---|---|---|---|"]
        if rs is not None:
            name = f"{real} ({rm['n_layers']} x {rm['d_model']})"
            for kind, k in rs["by_kind"].items():
                lines.append(f"| {name} | {kind}{_base(k['base'])} | {len(k['layers'])} of {rm['n_layers']} | "
                             f"{_pm(k['positional_share'])} (over layers) | {_pm(k['distance_ratio'], 2)} "
                             f"({k['distance_chance']:.2f}) |")
        else:
            lines.append(f"| {real} | – (no {real}.json) | | | |")
        for kind, k in s["by_kind"].items():
            lines.append(f"| {here} | {kind}{_base(k['base'])} | {len(k['layers'])} of {m['n_layers']} | "
                         f"{_pm(k['positional_share'])} | {_pm(k['distance_ratio'], 2)} ({k['distance_chance']:.2f}) |")
        b0 = s["block0"]
        lines += ["", "| model | block 0 positional share | its rotation null's mean |", "|---|---|---|"]
        if rs is not None:
            lines.append(f"| {real} | {_fmt(rs['block0']['positional_share'])} | {_fmt(rs['block0']['null_mean'])} |")
        lines += [f"| {here} | {_pm(b0['positional_share'])} | {_pm(b0.get('null_mean'))} |", "",
                  "Per layer, trained here:", "", "| layer | kind | positional share | distance / uniform |",
                  "|---|---|---|---|"]
        lines += [f"| {row['layer']} | {row['kind']}{_base(row['base'])} | {_pm(row['positional_share'])} | "
                  f"{_pm(row['distance_ratio'], 2)} |" for row in s["layers"]]
        theirs = ("" if rm is None else f"{real} is {rm['n_layers']} layers x {rm['d_model']} "
                  f"({rm['n_parameters'] / 1e6:.0f}M parameters), trained on trillions of tokens of web text at "
                  "contexts of thousands of tokens, read as shipped (quantised: band.md bounds what that moves); ")
        lines += ["", "What differs, so that the rows are not over-read:", "",
                  f"- Size and data: {theirs}{preset} is {m['n_layers']} x {m['d_model']}, trained {rec['step']} steps "
                  f"on the plays at {rec['seq_len']} tokens ({_count(rec['tokens_seen'])} tokens seen, a BPE "
                  f"vocabulary of {rec['vocab_size']}). Equal figures would say the scheme gives them, not that the "
                  "models are alike.",
                  f"- Reading: {real} on {_windows_read(p['real_windows'])} under its own tokenizer; {preset} on its "
                  f"own first {rec['n_blocks']} validation blocks of {rec['seq_len']} tokens, no <bos>.",
                  *(f"- {line}" for line in preset_differences(p)), ""]
    return lines


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", nargs="+", default=["minilm", "smollm2", "gemma3"])
    parser.add_argument("--quick", action="store_true", help="few windows and draws: a smoke run")
    parser.add_argument("--force", action="store_true", help="recompute models whose JSON exists")
    parser.add_argument("--no-band", action="store_true")
    parser.add_argument("--presets", nargs="+", type=Path, metavar="SWEEP_DIR",
                        help="finished experiment=smollm2_like / gemma3_like sweeps (or runs): read beside the checkpoint "
                             "each mirrors -> presets.json, presets.md")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    kw = settings(args.quick)
    results = {}
    for name in args.models:
        path = args.out / f"{name}.json"
        if path.exists() and not args.force:
            results[name] = json.loads(path.read_text())
            continue
        start = time.perf_counter()
        results[name] = analyse(name, **kw)  # one model in memory at a time
        path.write_text(json.dumps(results[name], indent=2))
        print(f"{name}: {time.perf_counter() - start:.0f} s -> {path}", flush=True)
    band_result = None
    quantised = {name: r["quantisation"] for name, r in results.items() if r["quantisation"]}
    if quantised and not args.no_band:
        path = args.out / "band.json"
        if path.exists() and not args.force:
            band_result = json.loads(path.read_text())
        else:
            start = time.perf_counter()
            band_result = quantisation_band(quantised, **kw)["figures"]
            path.write_text(json.dumps(band_result, indent=2))
            print(f"band: {time.perf_counter() - start:.0f} s -> {path}", flush=True)
        (args.out / "band.md").write_text("\n".join(band_markdown(band_result, quantised)))
    presets = None
    if args.presets:
        real = {}
        for name in PRESETS.values():
            path = args.out / f"{name}.json"
            real[name] = results.get(name) or (json.loads(path.read_text()) if path.exists() else None)
        presets = preset_study(args.presets, real, **preset_settings(args.quick))
        (args.out / "presets.json").write_text(json.dumps(presets, indent=2))
        (args.out / "presets.md").write_text("\n".join(presets_markdown(presets)))
    elif (args.out / "presets.json").exists():
        presets = json.loads((args.out / "presets.json").read_text())
    trained = json.loads(TRAINED.read_text()) if TRAINED.exists() else None
    text = "\n".join(table(results, trained, band_result, presets))
    (args.out / "table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
