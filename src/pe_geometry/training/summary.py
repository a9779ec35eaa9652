"""The few lines a run ends with: how well it fit, where geometry went against chance, what to run next."""

from __future__ import annotations

import math
import shlex
from pathlib import Path

from pe_geometry.analysis.metric_names import companion
from pe_geometry.training.wandb_run import HEADLINE_GEOMETRY

REPORT_SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "report.py"


def script_path(script: Path, start_dir: Path) -> str:
    """``experiments/report.py`` when started in the repository, else the script's absolute path."""
    try:
        return str(script.relative_to(start_dir.resolve()))
    except ValueError:
        return str(script)


def geometry_records(callbacks) -> dict[int, dict[str, float]]:
    """``GeometryCallback.records`` (step -> logged metrics) if the run has a geometry callback, else ``{}``."""
    for callback in callbacks:
        records = getattr(callback, "records", None)
        if isinstance(records, dict) and type(callback).__name__ == "GeometryCallback":
            return records
    return {}


def run_summary(metrics: dict[str, float], records: dict[int, dict[str, float]], output_dir: Path, wandb_dirs: list[list[Path]],
                start_dir: Path = Path(".")) -> str:
    """A short multi-line text: final val loss and perplexity, headline geometry at init and end beside chance,
    the run folder and the commands that make its report and upload its W&B run."""
    lines = ["run summary"]
    val = metrics.get("val/loss")
    if val is not None and math.isfinite(val):
        lines.append(f"  final val/loss {val:.4f}  (perplexity {math.exp(min(val, 50)):.1f})")
    if records:
        first, last = min(records), max(records)
        for name in HEADLINE_GEOMETRY:
            if name in records[last]:
                chance = records[last].get(companion(name, "_chance"))
                at_init = records[first].get(name, float("nan"))
                beside = f"   chance {chance:.4f}" if chance is not None else ""
                null_mean, null_std, p_value = (records[last].get(name + suffix) for suffix in ("_null_mean", "_null_std", "_p"))
                if None not in (null_mean, null_std, p_value):  # the spectra-keeping null: is the end value an effect?
                    beside += f"   null {null_mean:.4f} ± {null_std:.4f}, p {p_value:.3f}"
                lines.append(f"  {name:<28} step {first}: {at_init:.4f}   step {last}: {records[last][name]:.4f}{beside}")
    lines.append(f"  run folder: {output_dir}")
    if (output_dir / "csv" / "metrics.csv").is_file():  # the report reads the CSV log (absent with logger=none)
        lines.append(f"  report:     python {script_path(REPORT_SCRIPT, start_dir)} {shlex.quote(str(output_dir))}")
    for segments in wandb_dirs:  # one list of offline-run folders per W&B run
        lines.append("  W&B upload: wandb sync " + " ".join(shlex.quote(str(d)) for d in segments))
    return "\n".join(lines)
