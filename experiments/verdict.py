"""Verdict tables of several reports side by side (the README's study table is printed by this script).

    python experiments/verdict.py experiments/results/controls_learned experiments/results/controls_sinusoidal
    python experiments/verdict.py REPORT... --figures overlap_k8 var_share_P_in_E_k8    # fewer input figures
    python experiments/verdict.py REPORT... --compact --figures overlap_k8 var_share_P_in_E_k8  # one row per arm

Reads each report's summary.json (written by experiments/report.py) and prints one set of markdown
tables, a block of rows per report, in the order given.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import json  # noqa: E402

from analysis.report.markdown import compact_verdict_table, verdict_tables  # noqa: E402
from analysis.verdict import INPUT_FIGURES  # noqa: E402


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
            parser.error(f"{path}: no summary.json (run experiments/report.py on the sweep first)")
        found = json.loads(path.read_text()).get("verdict")
        if not found:
            parser.error(f"{path}: the report has no verdict (made with --no-verdict, or before verdicts existed)")
        prefix = folder.name if len(args.reports) > 1 else None
        verdicts += [{**v, "label": f"{prefix}: {v['label']}" if prefix else v["label"]} for v in found]
    figures = args.figures or [f for f, _, _ in INPUT_FIGURES]
    text = "\n".join(compact_verdict_table(verdicts, figures) if args.compact else verdict_tables(verdicts, args.figures))
    print(text)
    return text


if __name__ == "__main__":
    main()
