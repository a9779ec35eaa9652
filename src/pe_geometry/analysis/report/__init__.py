"""The sweep report, cut along its sections: ``build`` gathers the numbers and writes the files,
``figures`` draws, ``tables`` formats cells and per-measure tables, ``markdown`` writes report.md."""

from pe_geometry.analysis.report.build import build_report

__all__ = ["build_report"]
