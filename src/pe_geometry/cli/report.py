"""Report of a sweep: geometry vs training step per PE type, losses, length extrapolation, MiniLM beside them.

    pe-report multirun/<date>/<time>                       # writes multirun/<date>/<time>/report/
    pe-report multirun/<date>/<time> --out some/dir
    pe-report RUNS --pretrained minilm                     # MiniLM beside them: minutes once, then kept in the cache
    pe-report RUNS --pretrained-json minilm.json           # reuse (or create) the MiniLM analysis at that path
    pe-report RUNS --no-extrapolation --pretrained none    # fast: only what the runs logged
    pe-report RUNS --at best                               # the verdict at each run's best-validation checkpoint

What it writes: see analysis/report/build.py.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pe_geometry.offline  # noqa: F401  (before anything that could reach a hub)
from pe_geometry.analysis.report.sources import PRETRAINED_MODES, reportable_runs  # torch-free, as the checks here
from pe_geometry.benchmarks.options import json_file, output_folder
from pe_geometry.cli import console_script, int_at_least, positive_int
from pe_geometry.extras import exit_on_missing_extra


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("multirun", type=Path, help="a sweep directory (multirun/<date>/<time>) or any folder of runs")
    parser.add_argument("--out", type=output_folder, default=None, help="output folder (default: <multirun>/report)")
    parser.add_argument("--pretrained", choices=PRETRAINED_MODES, default="auto",
                        help="the MiniLM checkpoint beside the runs. auto (default): shown when its analysis is kept "
                             "in the cache ($PE_CACHE_DIR, else ~/.cache/pe_geometry: one for every folder), else "
                             "left out, saying so (the report stays fast); minilm: computed when none is kept (minutes, "
                             "once; later reports from any folder reuse it); none: left out")
    parser.add_argument("--pretrained-json", type=json_file, default=None,
                        help="MiniLM analysis from `pe-pretrained --json PATH`; computed and saved there if missing")
    parser.add_argument("--no-pretrained", action="store_const", const="none", dest="pretrained",
                        help="the same as --pretrained none")
    parser.add_argument("--no-extrapolation", action="store_true",
                        help="do not evaluate longer blocks (existing length_extrapolation.json files are still used)")
    parser.add_argument("--multipliers", type=positive_int, nargs="+", default=[1, 2, 4],
                        help="evaluation lengths as multiples of seq_len")
    parser.add_argument("--max-batches", type=positive_int, default=8,
                        help="validation tokens for extrapolation = max_batches x batch x seq_len")
    parser.add_argument("--no-verdict", action="store_true",
                        help="do not re-measure final weights against the null (existing verdict.json files are still used)")
    parser.add_argument("--null-draws", type=int_at_least(2), default=None,
                        help="Haar rotations per verdict null, >= 2 so the null has a spread (default: 2000)")
    parser.add_argument("--at", choices=["last", "best"], default="last",
                        help="weights the verdict measures: last (default) or best = checkpoints/best.ckpt, the lowest val/loss")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    runs = reportable_runs(args.multirun)  # no run, or none with a logged row: one line before torch loads
    from pe_geometry.training.threads import use_idle_cores

    use_idle_cores()  # the cores idle now, as pe-train (OMP_NUM_THREADS=N to choose)
    with exit_on_missing_extra():  # a missing extra: one error line naming it, exit code 2
        from pe_geometry.analysis.report import build_report  # here: a bad option is refused before torch loads

        summary = build_report(args.multirun, args.out, args.pretrained_json, extrapolation=not args.no_extrapolation,
                               pretrained=args.pretrained, multipliers=tuple(args.multipliers),
                               max_batches=args.max_batches, verdict=not args.no_verdict, at=args.at, runs=runs,
                               **({"null_draws": args.null_draws} if args.null_draws else {}))
    print(f"report: {Path(args.out or args.multirun / 'report') / 'report.md'}")
    return summary


cli = console_script(main)  # pe-report


if __name__ == "__main__":
    cli()
