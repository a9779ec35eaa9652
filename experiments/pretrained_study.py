"""The real checkpoints beside the trained-here runs, on the same axes; and the quantisation band.

    python experiments/pretrained_study.py --out experiments/results/pretrained            # minilm smollm2 gemma3
    python experiments/pretrained_study.py --out DIR --models minilm --quick               # a smoke run (seconds)

1. ``pe-pretrained``'s whole record (analysis.pretrained.analyse) of each model -> ``<model>.json`` (an existing file
   is kept: a stopped study continues where it stopped; --force recomputes).
2. The band: MiniLM (fp32) measured again with its weights round-tripped through each quantised file's own scheme
   (analysis.quantisation: the file's type per role, K-quants through their stand-ins) -> ``band.json``, ``band.md``:
   how far 4-bit weights move each figure on a model whose fp32 weights we have.
3. ``table.md``: per model (and per trained-here family, from the committed extrapolation benchmark's block-0 figures)
   the input-level overlap against its null (learned tables), the probe's R^2 at relative depths 0, 1/4, 1/2, 3/4, 1,
   block 0's positional share, every head's share against its rotation null (RoPE), and attention distance over
   uniform's at blocks 0-1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import pe_geometry.offline  # noqa: F401  (before anything that could reach a hub)
from pe_geometry.analysis.pretrained import analyse, quantisation_band

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


def probe_by_depth(r: dict) -> list[float]:
    """The probe's R^2 at the block input nearest each relative depth (0 = the embedding output, 1 = the output)."""
    layers = r["hidden_states"]
    return [layers[round(depth * (len(layers) - 1))]["position_r2"] for depth in DEPTHS]


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


def table(results: dict[str, dict], trained: dict | None, band_result: dict | None) -> list[str]:
    head = ["model", "encoding", "layers x d", "overlap_k8 / null (input)", "probe R² at depth 0 / ¼ / ½ / ¾ / 1",
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
        quantised = f", {r['quantisation']['matrix']}" if r["quantisation"] else ""
        lines.append(f"| {name} ({m['model_type']}{quantised}) | {m['encoding']} | {m['n_layers']} x {m['d_model']} | "
                     f"{overlap} | {probe} | {_fmt(share)} | {against_null(r)} | "
                     f"{distance_ratio(r, 0):.2f}; {distance_ratio(r, 1):.2f} |")
    geometry = json.loads(TRAINED_GEOMETRY.read_text())["groups"] if TRAINED_GEOMETRY.exists() else {}
    for family in FAMILIES_HERE if trained else ():
        a = trained["summary"][family]["attention"]
        null = f"null mean {a['null_mean']['mean']:.3f}" if "null_mean" in a else "–"
        d0, d1 = (x["mean"] for x in a["distance_ratio"])
        overlap = probe = ""
        measures = geometry.get(family, {}).get("measures", {})
        if "geometry/overlap_k8" in measures:
            m = measures["geometry/overlap_k8"]
            overlap = f"{m['end']['mean']:.3f} / {m['null_mean']['end']['mean']:.3f}"
        r2 = [measures.get(f"geometry/hidden/layer{i}/position_r2", {}).get("end", {}).get("mean") for i in range(3)]
        if None not in r2:  # 2 blocks: inputs 0, 1 and the output are depths 0, 1/2, 1
            probe = f"{r2[0]:.2f} / – / {r2[1]:.2f} / – / {r2[2]:.2f}"
        lines.append(f"| trained here: {family} | {family} | 2 x 64 | {overlap} | {probe} | "
                     f"{a['positional_share']['mean']:.3f} ± {a['positional_share']['sd']:.3f} | {null} (block 0) | "
                     f"{d0:.2f}; {d1:.2f} |")
    if band_result is not None:
        worst = max(band_result["max_abs_diff"].items(), key=lambda kv: kv[1])
        lines += ["", f"Quantisation band (band.md, MiniLM round-tripped through each file's scheme): the largest move of "
                  f"any figure is {worst[1]:.3g} ({worst[0]}); probe R² moves by at most "
                  f"{max(v for k, v in band_result['max_abs_diff'].items() if k.startswith('probe/')):.3g}."]
    return lines + [""]


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", nargs="+", default=["minilm", "smollm2", "gemma3"])
    parser.add_argument("--quick", action="store_true", help="few windows and draws: a smoke run")
    parser.add_argument("--force", action="store_true", help="recompute models whose JSON exists")
    parser.add_argument("--no-band", action="store_true")
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
    trained = json.loads(TRAINED.read_text()) if TRAINED.exists() else None
    text = "\n".join(table(results, trained, band_result))
    (args.out / "table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
