"""The pretrained study's tables: table.md (every model and trained-here family on the same axes), band.md (how far
4-bit weights move each figure) and presets.md (the presets beside the checkpoints they mirror)."""

from __future__ import annotations

import statistics

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
FAMILIES_HERE = ("learned", "rope", "alibi", "t5_bias", "none")
REAL_HEAD_DIM = {"smollm2": 64, "gemma3": 256}  # their GGUF headers (Gemma 3's is not d_model / n_heads)


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
          presets: dict | None = None, geometry: dict | None = None) -> list[str]:
    """table.md's lines. ``trained``: the extrapolation benchmark's extrapolation.json (its block-0 figures);
    ``geometry``: the orthogonality study's summary.json groups (overlap and probe), for the trained-here rows."""
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
    geometry = geometry or {}
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
