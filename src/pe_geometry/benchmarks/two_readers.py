"""Two readers, one truth: each run's own geometry record beside pe-pretrained's reading of its transformers export.

    pe-bench readers RUN [RUN ...] --out DIR     # exports each run (pe-export) to DIR/exports/<run>, reads it both ways

For each run (a family pe-export writes: learned, rope, none): the run's last geometry record (metrics.csv) against
pe-pretrained's functions on the same word rows and blocks (must agree to float32 rounding: a larger difference is a
bug in one reader, and our model measured again on those inputs says which), and against pe-pretrained as a user runs
it (its own rows and windows of the plays: a different sample, read against the figure's sampling spread).
Writes DIR/two_readers.json and DIR/report.md (analysis/readers/two_readers.py says what each column is).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from pe_geometry.benchmarks.options import output_folder

EXPORTABLE = ("learned", "rope", "none")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", type=Path, help="run folders trained here (each with its metrics.csv)")
    parser.add_argument("--out", type=output_folder, required=True, help="folder for the exports, JSON and report")
    parser.add_argument("--no-defaults", action="store_true",
                        help="only the same-input comparison (skips pe-pretrained's own rows and windows)")


def check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refusals that need no torch, before anything is written: a folder that is no run, a family with no export."""
    from pe_geometry.analysis.readers.runs import load_run

    for run in args.runs:
        if not (run / "config.yaml").is_file():
            parser.error(f"{run}: not a run folder (no config.yaml)")
        family = load_run(run).pe.split(" + ")[0]
        if family not in EXPORTABLE:
            parser.error(f"{run}: pe={family} has no exact transformers architecture; exportable: {', '.join(EXPORTABLE)}")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    from pe_geometry.analysis.readers.two_readers import SAME_INPUT_TOLERANCE, compare, table
    from pe_geometry.model.export import ExportError, write_folder
    from pe_geometry.training.run_loader import load_trained_run

    results, started = {}, time.perf_counter()
    for run_dir in args.runs:
        loaded = load_trained_run(run_dir)
        pe = loaded.choices.get("pe", "?")
        folder = args.out / "exports" / run_dir.name
        if not (folder / "config.json").is_file():  # as pe-export writes it; the same-input column checks it exact
            try:
                write_folder(loaded.model, loaded.tokenizer, folder, training_length=int(loaded.config.data.seq_len))
            except ExportError as err:
                parser.error(f"{run_dir}: {err}")
        result = compare(loaded, run_dir, folder, defaults=not args.no_defaults)
        results[f"{run_dir.name} (pe={pe})"] = result
        print(f"{run_dir.name}: step {result['step']}, {result['model_type']}: "
              f"{sum(bool(r.agrees) for r in result['rows'])} of {sum(r.agrees is not None for r in result['rows'])} "
              f"figures agree on the same inputs (<= {SAME_INPUT_TOLERANCE:g} relative)")
    report = table(results)
    print(report)
    payload = {"tolerance_same_inputs": SAME_INPUT_TOLERANCE, "seconds": time.perf_counter() - started,
               "runs": {name: {"step": r["step"], "model_type": r["model_type"],
                               "rows": [dataclasses.asdict(row) | {"same_inputs_difference": row.same_inputs_difference,
                                                                   "defaults_t": row.defaults_t,
                                                                   "defaults_p": row.defaults_p}
                                        for row in r["rows"]]}
                        for name, r in results.items()}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "two_readers.json").write_text(json.dumps(payload, indent=1))
    command = " ".join(["pe-bench readers", *map(str, args.runs), "--out", str(args.out)])
    (args.out / "report.md").write_text(f"# Two readers, one truth\n\n{__doc__.split(chr(10), 1)[1].strip()}\n\n"
                                        f"Written by `{command}`.\n\n{report}\n")
    return payload
