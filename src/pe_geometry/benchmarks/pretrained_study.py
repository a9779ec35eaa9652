"""The real checkpoints beside the trained-here runs, on the same axes; and the quantisation band.

    pe-bench pretrained --out experiments/results/pretrained            # minilm smollm2 gemma3
    pe-bench pretrained --out DIR --models minilm --quick               # a smoke run (seconds)
    pe-bench pretrained --out experiments/results/pretrained --presets SWEEP_DIR [SWEEP_DIR ...]

1. ``pe-pretrained``'s whole record (analysis.pretrained.analyse) of each model -> ``<model>.json`` (an existing file
   is kept: a stopped study continues where it stopped; --force recomputes).
2. The band: MiniLM (fp32) measured again with its weights round-tripped through each quantised file's own scheme
   (analysis.quantisation: the file's type per role, K-quants through their stand-ins) -> ``band.json``, ``band.md``:
   how far 4-bit weights move each figure on a model whose fp32 weights we have.
3. ``table.md``: per model (and per trained-here family, from the extrapolation benchmark's block-0 figures, ``--trained``)
   the input-level overlap against its null (learned tables), the probe's R^2 at relative depths 0, 1/4, 1/2, 3/4, 1,
   block 0's positional share, every head's share against its rotation null (RoPE), and attention distance over
   uniform's at blocks 0-1.
4. With ``--presets``: the trained ``experiment=smollm2_like`` / ``experiment=gemma3_like`` runs (a sweep folder or run
   folders), each read on the first 16 validation blocks of its own data at its training length (as
   pe-bench extrapolation's runs), beside the checkpoint it mirrors, per layer kind (windowed, global): every
   layer's positional share and attention distance over uniform's, mean +- sd over seeds, and block 0's share against
   its rotation null -> ``presets.json``, ``presets.md``; ``table.md`` gets their block-0 rows (a later run without
   ``--presets`` reads ``presets.json`` back).

The trained-here rows read the committed results of this repository (``--trained``, ``--trained-geometry``; by
default their paths from the repository's root): without them table.md has the real models' rows alone. The tables:
benchmarks/pretrained_report.py; the presets' readings: benchmarks/presets.py.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

TRAINED = Path("experiments/results/extrapolation/extrapolation.json")  # the ten families trained here, 3 seeds
TRAINED_GEOMETRY = Path("experiments/results/orthogonality/summary.json")  # the same recipe's geometry records


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", nargs="+", default=["minilm", "smollm2", "gemma3"])
    parser.add_argument("--quick", action="store_true", help="few windows and draws: a smoke run")
    parser.add_argument("--force", action="store_true", help="recompute models whose JSON exists")
    parser.add_argument("--no-band", action="store_true")
    parser.add_argument("--presets", nargs="+", type=Path, metavar="SWEEP_DIR",
                        help="finished experiment=smollm2_like / gemma3_like sweeps (or runs): read beside the checkpoint "
                             "each mirrors -> presets.json, presets.md")
    parser.add_argument("--trained", type=Path, default=TRAINED, metavar="EXTRAPOLATION_JSON",
                        help=f"the extrapolation benchmark's results: table.md's trained-here rows (default {TRAINED})")
    parser.add_argument("--trained-geometry", type=Path, default=TRAINED_GEOMETRY, metavar="SUMMARY_JSON",
                        help=f"the orthogonality study's summary.json: their overlap and probe (default {TRAINED_GEOMETRY})")


def settings(quick: bool) -> dict:
    if quick:
        return {"probe_permutations": 5, "attention_null_draws": 3, "n_windows": 8, "seq_len": 32}
    return {}  # analyse's defaults: 32 windows x 64 tokens, 100 probe draws, 100 rotation draws


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """``pe-bench pretrained``: each model's record, the band, the presets, table.md."""
    # here, not above: `pe-bench --help` loads neither torch nor transformers
    from pe_geometry.analysis.readers.pretrained import analyse, quantisation_band
    from pe_geometry.benchmarks.presets import PRESETS, preset_settings, preset_study, refresh_real
    from pe_geometry.benchmarks.pretrained_report import band_markdown, presets_markdown, table

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
    elif (args.out / "presets.json").exists():  # the committed presets, beside the checkpoints as read now
        presets = refresh_real(json.loads((args.out / "presets.json").read_text()), results)
        (args.out / "presets.json").write_text(json.dumps(presets, indent=2))
        (args.out / "presets.md").write_text("\n".join(presets_markdown(presets)))
    trained = json.loads(args.trained.read_text()) if args.trained.exists() else None
    geometry = json.loads(args.trained_geometry.read_text())["groups"] if args.trained_geometry.exists() else {}
    if trained is None:
        print(f"no trained-here rows: {args.trained} not found (--trained)", flush=True)
    text = "\n".join(table(results, trained, band_result, presets, geometry))
    (args.out / "table.md").write_text(text)
    print(text)

