"""Verdict tables of several reports side by side (the README's study table is printed by this script).

    pe-verdict experiments/results/controls_learned experiments/results/controls_sinusoidal
    pe-verdict REPORT... --figures overlap_k8 var_share_P_in_E_k8    # fewer input figures
    pe-verdict REPORT... --compact --figures overlap_k8 var_share_P_in_E_k8  # one row per arm

Reads each report's summary.json (written by pe-report) and prints one set of markdown
tables, a block of rows per report, in the order given.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pe_geometry.extras import exit_on_missing_extra

with exit_on_missing_extra():  # a missing extra: one error line naming it, exit code 2
    from pe_geometry.analysis.report.markdown import compact_verdict_table, verdict_tables
    from pe_geometry.analysis.verdict import INPUT_FIGURES


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", type=Path, nargs="+", help="report folders (with summary.json)")
    parser.add_argument("--figures", nargs="+", default=None, choices=[f for f, _, _ in INPUT_FIGURES],
                        help="input-level figures to show (default: all)")
    parser.add_argument("--compact", action="store_true", help="one row per arm (input figures only; reading from the first)")
    args = parser.parse_args(argv)
    verdicts = []
    for folder in args.reports:
        path = folder / "summary.json" if folder.is_dir() else folder
        if not path.is_file():
            parser.error(f"{path}: no summary.json (run pe-report on the sweep first)")
        found = json.loads(path.read_text()).get("verdict")
        if not found:
            parser.error(f"{path}: the report has no verdict (made with --no-verdict, or before verdicts existed)")
        prefix = folder.name if len(args.reports) > 1 else None
        verdicts += [{**v, "label": f"{prefix}: {v['label']}" if prefix else v["label"]} for v in found]
    figures = args.figures or [f for f, _, _ in INPUT_FIGURES]
    text = "\n".join(compact_verdict_table(verdicts, figures) if args.compact else verdict_tables(verdicts, args.figures))
    print(text)
    return text


def cli() -> None:
    """The console script ``pe-verdict``. ``main`` returns its result to a caller; a console script would hand that
    to ``sys.exit``, which prints it and exits with 1, so this returns nothing (exit code 0)."""
    main()


if __name__ == "__main__":
    cli()
