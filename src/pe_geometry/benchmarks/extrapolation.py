"""The length-extrapolation benchmark: every trained run scored at 1x-16x its training length.

    pe-train -m experiment=extrapolation hydra/launcher=local_parallel        # 10 PE options x 3 seeds
    pe-train -m experiment=extrapolation_peer hydra/launcher=local_parallel   # x-transformers' own: 7 x 3
    pe-bench extrapolation multirun/<date>/<time> --out experiments/results/extrapolation

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

The scoring: benchmarks/extrapolation_scoring.py; the tables and figures: benchmarks/extrapolation_report.py.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from pe_geometry.benchmarks.options import at_least, one_of, output_folder
from pe_geometry.benchmarks.runs import found_run_dirs, refuse_task_runs
from pe_geometry.settings.positional import ROPE_SCALINGS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folders", nargs="+", type=Path, help="sweep folders (or run folders) with trained runs")
    parser.add_argument("--include-unfinished", action="store_true",
                        help="score runs killed before trainer.max_steps where they stopped (refused otherwise)")
    parser.add_argument("--out", type=output_folder, required=True, help="folder for extrapolation.{json,md,png}, position_attention.png")
    parser.add_argument("--multipliers", type=at_least(1), nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--target-len", type=at_least(1), default=None,
                        help="scored tokens per window (default seq_len: at 1x, every target of the training window)")
    parser.add_argument("--scalings", nargs="*", type=one_of(ROPE_SCALINGS[1:]), default=["linear", "ntk", "dynamic_ntk", "yarn"],
                        help="inference-time RoPE scalings to score the RoPE runs with (none: --scalings)")
    parser.add_argument("--mask-draws", type=at_least(1), default=4,
                        help="masked-LM runs: independent mask draws scored per window (1 leaves ~10 of 64 targets; "
                             "4 brings the loss's standard error under 1 %%); decoders ignore it")
    parser.add_argument("--cache", type=output_folder, default=None,
                        help="folder keeping each run's scores: a rerun scores only new or retrained runs")
    parser.add_argument("--keep", type=Path, default=None, metavar="EXTRAPOLATION_JSON",
                        help="an earlier extrapolation.json (same protocol) whose families this call does not score "
                             "again are kept beside the new ones")
    parser.add_argument("--relabel", nargs="*", default=[], metavar="OLD=NEW",
                        help="with --keep: rename a kept family (e.g. cope='cope (p_max 64)')")


def check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """What is refused before torch loads: --relabel without --keep, no runs, a data=task run."""
    relabel = [pair for pair in args.relabel if "=" in pair]
    if len(relabel) != len(args.relabel) or (relabel and args.keep is None):
        parser.error("--relabel takes OLD=NEW pairs, with --keep")
    refuse_task_runs(found_run_dirs(args.folders))


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    """``pe-bench extrapolation``: score, summarise, write extrapolation.{json,md,png} and position_attention.png."""
    import torch  # here, not above: `pe-bench --help` loads neither torch nor Lightning

    from pe_geometry.benchmarks.extrapolation_report import common_multiplier, markdown, markdown_table, plot, plot_attention
    from pe_geometry.benchmarks.extrapolation_scoring import kept_entries, score_runs, summarise

    check(args, parser)  # a Python caller of run() gets the same refusals
    relabel = dict(pair.split("=", 1) for pair in args.relabel)
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
    (args.out / "extrapolation.md").write_text(markdown(summary, runs, kept, relabel, protocol, args.multipliers))
    plot(summary, args.multipliers, args.out / "extrapolation.png",
         protocol.replace("mean ± sd over seeds", "line: mean over seeds, band: min-max over seeds"))
    plot_attention(summary, common_multiplier(summary, args.multipliers), args.out / "position_attention.png")
    print(markdown_table(summary, args.multipliers))
    print(f"wrote {args.out}/extrapolation.{{json,md,png}} in {time.perf_counter() - start:.0f} s")
    return payload
