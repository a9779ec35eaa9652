"""The few lines a run ends with: how well it fit, what its callbacks have to say, what to run next.

Training knows no measure by name: a callback with something to report at the end offers
``summary_lines`` (the ``SummaryLines`` protocol) and its lines are printed in callback order.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol, runtime_checkable

from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

from pe_geometry.training.callbacks import ran_out_of_patience


@runtime_checkable
class SummaryLines(Protocol):
    """A callback that adds lines to the end-of-run summary (unindented; the summary indents them)."""

    def summary_lines(self) -> list[str]: ...


def callback_lines(callbacks: Iterable) -> list[str]:
    """Every line the callbacks offering ``summary_lines`` have to add, in callback order (and Lightning's own
    early stop and best-checkpoint callbacks, which know nothing of the protocol)."""
    return [line for callback in callbacks
            for line in (callback.summary_lines() if isinstance(callback, SummaryLines) else lightning_lines(callback))]


def lightning_lines(callback) -> list[str]:
    """Whether an EarlyStopping ended the run, and where a ModelCheckpoint watching a metric kept its best."""
    if isinstance(callback, EarlyStopping) and ran_out_of_patience(callback):
        return [f"stopped early: {callback.monitor} had not improved for {callback.wait_count} validations "
                f"(best {float(callback.best_score):.4f})"]
    if isinstance(callback, ModelCheckpoint) and callback.monitor and callback.best_model_path:
        return [f"best {callback.monitor} {float(callback.best_model_score):.4f}: {callback.best_model_path}"]
    return []


def run_summary(metrics: dict[str, float], callbacks: Iterable, output_dir: Path, wandb_dirs: list[list[Path]]) -> str:
    """A short multi-line text: final val loss and perplexity, the callbacks' lines, the run folder and the
    commands that make its report and upload its W&B run.

    ``wandb_dirs``: one list of offline-run folders per W&B run (a resumed run has one per segment); an
    online run has none, and gets no upload line (it is on the server already).
    """
    lines = ["run summary"]
    val = metrics.get("val/loss")
    if val is not None and math.isfinite(val):
        lines.append(f"  final val/loss {val:.4f}  (perplexity {math.exp(min(val, 50)):.1f})")
    tokens, exact = metrics.get("val/answer_accuracy"), metrics.get("val/answer_exact_match")
    if tokens is not None and exact is not None:  # data=task: the loss is per answer token; these are what it means
        lines.append(f"  final answer accuracy {tokens:.3f} of answer tokens, exact match {exact:.3f} of examples "
                     "(sizes as data.sizes draws them; pe-bench tasks scores full-size ones)")
    lines += [f"  {line}" for line in callback_lines(callbacks)]
    lines.append(f"  run folder: {output_dir}")
    if (output_dir / "csv" / "metrics.csv").is_file():  # the report reads the CSV log (absent with logger=none)
        lines.append(f"  report:     pe-report {shlex.quote(str(output_dir))}")
    for segments in wandb_dirs:
        if segments:
            lines.append("  W&B upload: wandb sync " + " ".join(shlex.quote(str(d)) for d in segments))
    return "\n".join(lines)
