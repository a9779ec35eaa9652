"""The sweep report, cut along its sections: ``sources`` finds the runs, ``build`` gathers the numbers and writes the
files, ``figures`` draws, ``tables`` formats cells and per-measure tables, ``markdown`` writes report.md."""

from __future__ import annotations

__all__ = ["build_report"]


def __getattr__(name: str):
    """``build_report`` on first use (it loads torch and matplotlib): ``sources`` alone stays light."""
    if name == "build_report":
        from pe_geometry.analysis.report.build import build_report

        return build_report
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
