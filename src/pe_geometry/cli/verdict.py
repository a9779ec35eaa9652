"""Verdict tables of several reports side by side (the README's study table is printed by this script).

    pe-verdict experiments/results/controls_learned experiments/results/controls_sinusoidal
    pe-verdict REPORT... --figures overlap_k8 var_share_P_in_E_k8    # fewer input figures
    pe-verdict REPORT... --compact --figures overlap_k8 var_share_P_in_E_k8  # one row per arm
    pe-verdict REPORT... --by-size --plot size_curve.png   # the dose-response: each arm's ratio to its null vs d_model
    pe-verdict --update-report REPORT...   # rewrite each REPORT/report.md's "## Verdict" section from its summary.json
    pe-verdict REPORT --contrast 'learned + mixed init k=8'   # each other arm's change from step 0 against this arm's

Reads each report's summary.json (written by pe-report) and prints one set of markdown
tables, a block of rows per report, in the order given. Each report is its own family for
the Holm correction (analysis/study/verdict.py), recomputed here from its Fisher p's, so an older
summary.json reads under the same rule. With --update-report, instead of a table, each
report's verdict section is rewritten in place and the rest of report.md kept byte for byte
(the run folders behind a committed report need not be on the machine). With --by-size the
reports are sizes of one study: each arm (matched by label) gets its measured / null ratio
per seed at each width and a fitted trend per doubling of d_model on the width means, Holm-corrected over
figures x arms (analysis/study/size_curve.py). With --contrast ARM, each other arm of the report is read against
ARM: how far each input figure moved from step 0 to the end, paired by seed (analysis/study/control_contrast.py).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path

from pe_geometry.cli import console_script
from pe_geometry.extras import exit_on_missing_extra
from pe_geometry.files import atomic_write_text

with exit_on_missing_extra():  # a missing extra: one error line naming it, exit code 2
    from pe_geometry.analysis.report.figures import plot_size_curve
    from pe_geometry.analysis.report.markdown import (
        compact_verdict_table,
        contrast_table,
        size_curve_table,
        verdict_markdown,
        verdict_tables,
    )
    from pe_geometry.analysis.study.control_contrast import contrast
    from pe_geometry.analysis.study.size_curve import correct_trends, size_points, trend
    from pe_geometry.analysis.study.verdict import INPUT_FIGURES, SCALED_K_FIGURES, correct_report

# The size curve reads a ratio to the null where below 1 means separated: the angle separates upwards, so it is left out.
# The k = d/8 figures are in a report made since they existed (its runs' verdict.json are recomputed on the next pe-report).
SIZE_FIGURES = [f for f, _, side in INPUT_FIGURES + SCALED_K_FIGURES if side == "less"]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", type=Path, nargs="+", help="report folders (with summary.json)")
    parser.add_argument("--figures", nargs="+", default=None, choices=[f for f, _, _ in INPUT_FIGURES],
                        help="input-level figures to show (default: all)")
    parser.add_argument("--compact", action="store_true", help="one row per arm (input figures only; reading from the first)")
    parser.add_argument("--by-size", action="store_true",
                        help=f"the reports are sizes of one study: each arm's measured / null ratio against d_model and its trend "
                             f"(figures: {', '.join(SIZE_FIGURES)})")
    parser.add_argument("--plot", type=Path, default=None, help="with --by-size: write the curve to this PNG")
    parser.add_argument("--contrast", metavar="ARM", default=None,
                        help="one report: each other arm's change of each input figure (end - step 0) against ARM's, "
                             "paired by seed (e.g. the controls of a mixed-init table)")
    parser.add_argument("--update-report", action="store_true",
                        help="rewrite the '## Verdict' section of each REPORT/report.md from its summary.json (nothing else)")
    args = parser.parse_args(argv)
    from pe_geometry.training.threads import use_idle_cores

    use_idle_cores()  # the cores idle now, as pe-train (OMP_NUM_THREADS=N to choose)
    if args.plot and not args.by_size:
        parser.error("--plot draws the size curve: use it with --by-size")
    if args.compact and args.by_size:
        parser.error("--compact and --by-size are two different tables: choose one")
    if args.contrast is not None and (args.compact or args.by_size or args.update_report or len(args.reports) > 1):
        parser.error("--contrast reads the arms of one report: give one REPORT, without --compact, --by-size or --update-report")
    if args.update_report and (args.compact or args.by_size or args.figures):
        parser.error("--update-report writes the report's whole verdict section: no --compact, --by-size or --figures")
    summaries = []
    for folder in args.reports:
        path = folder / "summary.json" if folder.is_dir() else folder
        if not path.is_file():
            parser.error(f"{path}: no summary.json (run pe-report on the sweep first)")
        try:
            summary = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as err:  # a corrupt summary.json, or a file that is not one
            parser.error(f"{path}: not a summary.json pe-report wrote ({type(err).__name__}: {err})")
        if not isinstance(summary, dict) or not summary.get("verdict"):
            parser.error(f"{path}: the report has no verdict (made with --no-verdict, or before verdicts existed)")
        summaries.append(((folder if folder.is_dir() else folder.parent).resolve().name, summary))
    if args.by_size:
        command = "pe-verdict " + shlex.join(sys.argv[1:] if argv is None else argv)
        return by_size(parser, summaries, args.figures or SIZE_FIGURES, args.plot, command)
    if args.contrast is not None:
        figures = [f for f, _, _ in INPUT_FIGURES if not args.figures or f in args.figures]
        try:
            rows = contrast(summaries[0][1]["verdict"], args.contrast, figures)
        except ValueError as err:
            parser.error(str(err))
        if not rows:
            parser.error(f"no other arm shares a seed and a logged step 0 with {args.contrast!r}: nothing to contrast")
        text = "\n".join(contrast_table(rows, args.contrast))
        print(text)
        return text
    if args.update_report:
        text = "\n".join(update_report(parser, folder, summary) for folder, (_, summary) in zip(args.reports, summaries))
        print(text)
        return text
    verdicts = []
    for folder, (_, summary) in zip(args.reports, summaries):
        found = correct_report(summary["verdict"])  # each report is its own family
        prefix = folder.name if len(args.reports) > 1 else None
        verdicts += [{**v, "label": f"{prefix}: {v['label']}" if prefix else v["label"]} for v in found]
    figures = args.figures or [f for f, _, _ in INPUT_FIGURES]
    text = "\n".join(compact_verdict_table(verdicts, figures) if args.compact else verdict_tables(verdicts, args.figures))
    print(text)
    return text


def update_report(parser: argparse.ArgumentParser, folder: Path, summary: dict) -> str:
    """Rewrite the "## Verdict" section of folder/report.md (up to the next "## " heading) from the summary's verdicts,
    as pe-report would write it now; every other byte of the file stays as it was."""
    path = (folder if folder.is_dir() else folder.parent) / "report.md"
    if not path.is_file():
        parser.error(f"{path}: no report.md to update")
    text = path.read_bytes().decode("utf-8")  # bytes, not read_text: no newline translation of the rest
    heading = re.search(r"^## Verdict\n", text, re.M)
    if heading is None:
        parser.error(f"{path}: no '## Verdict' section to rewrite")
    following = re.compile(r"^## ", re.M).search(text, heading.end())
    end = following.start() if following else len(text)
    section = "\n".join(verdict_markdown(summary["verdict"], (summary.get("word_rows") or {}).get("position_probe"))) + "\n"
    atomic_write_text(path, text[:heading.start()] + section + text[end:])
    return f"updated {path}"


def by_size(parser: argparse.ArgumentParser, summaries: list[tuple[str, dict]], figures: list[str], plot: Path | None,
            command: str) -> str:
    """The --by-size tables (one per figure), headed by the command that prints them, and, if asked, the figure."""
    wrong = [f for f in figures if f not in SIZE_FIGURES]
    if wrong:
        parser.error(f"--by-size reads a ratio where below 1 is separated; {', '.join(wrong)} "
                     f"{'is' if len(wrong) == 1 else 'are'} not one of: {', '.join(SIZE_FIGURES)}")
    titles = {f: t for f, t, _ in INPUT_FIGURES + SCALED_K_FIGURES}
    lines, panels = ["# The dose-response across widths", "", f"Made by `{command}` (analysis/study/size_curve.py).", ""], []
    every: dict[str, dict] = {}
    for figure in figures:
        try:
            every[figure] = size_points(summaries, figure)
        except ValueError as err:
            parser.error(str(err))
    # one Holm family: every figure x arm whose trend could be fitted
    trends = correct_trends({(figure, label): trend(points) for figure, curves in every.items()
                             for label, points in curves.items() if len(points) > 1})
    for figure, curves in every.items():
        one_width = sorted(label for label, points in curves.items() if len(points) == 1)
        curves = {label: points for label, points in curves.items() if len(points) > 1}
        lines += [f"### {titles[figure]}", ""]
        if not curves:
            lines += ["No arm has this figure in two reports of different widths.", ""]
        else:
            lines += size_curve_table(curves, {label: trends[(figure, label)] for label in curves})
        if one_width:
            lines += [f"Left out, at one width only: {', '.join(one_width)}.", ""]
        panels.append((titles[figure], curves))
    if not any(panel_curves for _, panel_curves in panels):
        parser.error("no arm is in two reports of different widths (arms are matched by label): nothing to compare")
    if plot is not None:
        plot.parent.mkdir(parents=True, exist_ok=True)
        plot_size_curve(panels, plot)
    text = "\n".join(lines)
    print(text)
    return text


cli = console_script(main)  # pe-verdict


if __name__ == "__main__":
    cli()
