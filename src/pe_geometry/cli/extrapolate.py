"""Validation loss of trained runs on blocks longer than they were trained on (length extrapolation).

    pe-extrapolate multirun/<date>/<time>/0_decoder-rope-s0   # writes length_extrapolation.json there
    pe-extrapolate RUN [RUN ...] --multipliers 1 2 4 8 --max-batches 8

How the lengths are cut and compared: analysis/readers/extrapolation.py.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pe_geometry.offline  # noqa: F401  (before anything that could reach a hub)
from pe_geometry.benchmarks.runs import refuse_task_runs
from pe_geometry.cli import console_script, positive_int
from pe_geometry.extras import exit_on_missing_extra


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (each with config.yaml and checkpoints/last.ckpt)")
    parser.add_argument("--multipliers", type=positive_int, nargs="+", default=[1, 2, 4],
                        help="block lengths as multiples of seq_len")
    parser.add_argument("--max-batches", type=positive_int, default=8,
                        help="validation tokens = max_batches x batch_size x seq_len")
    args = parser.parse_args(argv)
    missing = [str(run) for run in args.runs if not run.exists()]
    if missing:
        parser.error(f"no such run folder or checkpoint: {', '.join(missing)}")
    refuse_task_runs(args.runs)  # its loss on longer text is not what it learned (pe-bench tasks scores it)
    from pe_geometry.training.threads import use_idle_cores

    use_idle_cores()  # the cores idle now, as pe-train (OMP_NUM_THREADS=N to choose)
    with exit_on_missing_extra():  # here, not above: a bad option is refused before torch loads
        from pe_geometry.analysis.readers.extrapolation import NA, evaluate_lengths
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    results = []
    for run in args.runs:
        r = evaluate_lengths(run, args.multipliers, args.max_batches)
        cells = [f"{m}x={v['loss'] if v['loss'] == NA else format(v['loss'], '.4f')}" for m, v in r["lengths"].items()]
        print(f"{run}: {r['model']}/{r['pe']} s{r['seed']} step {r['step']}: " + "  ".join(cells))
        results.append(r)
    return results


cli = console_script(main)  # pe-extrapolate


if __name__ == "__main__":
    cli()
