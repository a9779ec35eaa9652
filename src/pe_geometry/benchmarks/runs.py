"""The runs a benchmark scores: every finished run folder under the sweep folders it is given."""

from __future__ import annotations

from pathlib import Path

from pe_geometry.analysis.readers.runs import checkpoint_ending


def run_dirs(folders: list[Path], include_unfinished: bool = False) -> list[Path]:
    """Every run folder (one with checkpoints/last.ckpt) under the given sweep folders or run folders. A run killed or
    stopped before its trainer.max_steps (``analysis.runs.checkpoint_ending``; an early stop is an end) would be scored
    at the step it reached beside finished runs: refused in one line naming it, unless ``include_unfinished``, when it
    is scored and named on stdout."""
    found = []
    for folder in folders:
        if (folder / "checkpoints" / "last.ckpt").is_file():
            found.append(folder)
        found += sorted(p.parent.parent for p in folder.glob("*/checkpoints/last.ckpt"))
    if not found:
        raise SystemExit(f"error: no run with checkpoints/last.ckpt under {[str(f) for f in folders]}")
    unfinished = [d for d in found if checkpoint_ending(d / "checkpoints" / "last.ckpt") == "unfinished"]
    if unfinished and not include_unfinished:
        raise SystemExit(f"error: {len(unfinished)} run(s) did not reach their trainer.max_steps (killed or stopped): "
                         f"{', '.join(map(str, unfinished))}; continue them (ckpt_path=auto on the sweep), or pass "
                         "--include-unfinished to score them where they stopped")
    for d in unfinished:
        print(f"{d}: unfinished (killed or stopped before trainer.max_steps), scored at the step it reached", flush=True)
    return found
