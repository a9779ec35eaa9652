"""The runs a benchmark scores: every finished run folder under the sweep folders it is given."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from pe_geometry.analysis.readers.runs import checkpoint_ending


def found_run_dirs(folders: list[Path]) -> list[Path]:
    """Every run folder (one with checkpoints/last.ckpt) under the given sweep folders or run folders, read without
    torch (a command refuses an empty folder before any model loads); none is one error line."""
    found = []
    for folder in folders:
        if (folder / "checkpoints" / "last.ckpt").is_file():
            found.append(folder)
        found += sorted(p.parent.parent for p in folder.glob("*/checkpoints/last.ckpt"))
    if not found:
        raise SystemExit(f"error: no run with checkpoints/last.ckpt under {[str(f) for f in folders]}")
    return found


def run_dirs(folders: list[Path], include_unfinished: bool = False) -> list[Path]:
    """Every run folder under the given sweep folders or run folders (``found_run_dirs``). A run killed or
    stopped before its trainer.max_steps (``analysis.runs.checkpoint_ending``; an early stop is an end) would be scored
    at the step it reached beside finished runs: refused in one line naming it, unless ``include_unfinished``, when it
    is scored and named on stdout."""
    found = found_run_dirs(folders)
    unfinished = [d for d in found if checkpoint_ending(d / "checkpoints" / "last.ckpt") == "unfinished"]
    if unfinished and not include_unfinished:
        raise SystemExit(f"error: {len(unfinished)} run(s) did not reach their trainer.max_steps (killed or stopped): "
                         f"{', '.join(map(str, unfinished))}; continue them (ckpt_path=auto on the sweep), or pass "
                         "--include-unfinished to score them where they stopped")
    for d in unfinished:
        print(f"{d}: unfinished (killed or stopped before trainer.max_steps), scored at the step it reached", flush=True)
    return found


def trained_on_a_task(run_dir: Path) -> bool:
    """The resolved config of the run (a run folder, or a checkpoint in its checkpoints/) names the task data module
    (read without torch, so a command refuses a run of the other kind before any model loads)."""
    run_dir = Path(run_dir)
    config = (run_dir.parent.parent if run_dir.is_file() else run_dir) / "config.yaml"  # a checkpoint: <run>/checkpoints/x.ckpt
    target = str(OmegaConf.select(OmegaConf.load(config), "data._target_", default="")) if config.is_file() else ""
    return target.endswith("TaskDataModule")


def refuse_task_runs(dirs: list[Path]) -> None:
    """One error line (exit code 2) naming the first data=task run among ``dirs``, before any run is scored: its loss
    on longer text is not what it learned."""
    if tasks := [d for d in dirs if trained_on_a_task(d)]:
        raise SystemExit(f"error: {tasks[0]} was trained on a task (data=task): its answers past the training length "
                         f"are scored by pe-bench tasks, not by this text benchmark ({len(tasks)} such run(s))")


def refuse_text_runs(dirs: list[Path]) -> None:
    """One error line (exit code 2) naming the first run among ``dirs`` not trained with data=task, before any run is
    scored (it was found only when its turn came, after the task runs before it had been scored)."""
    if text := [d for d in dirs if not trained_on_a_task(d)]:
        raise SystemExit(f"error: {text[0]} was not trained with data=task: pe-bench tasks reads task runs only; "
                         f"pe-bench extrapolation scores a text run ({len(text)} such run(s))")
