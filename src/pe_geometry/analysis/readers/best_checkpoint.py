"""The best-validation checkpoint of a run that kept step checkpoints but trained on past it.

A run trained with ``callbacks.best_checkpoint`` (experiment=dose_response_d256) keeps ``checkpoints/best.ckpt``
itself, and ``callbacks.early_stopping`` ends it there. An older run, or one that ran to its full budget, has only its
step checkpoints: this module validates each of them exactly as training validates (the run's own
``LanguageModelTask.validation_step``, its ``trainer.limit_val_batches``, through Lightning's ``validate``), applies
the rule ``EarlyStopping`` applies (the lowest val/loss, until ``patience`` validations in a row fail to improve on it)
and writes that checkpoint as ``checkpoints/best.ckpt``, with every validation in ``best_checkpoint.json``:

    python -m pe_geometry.analysis.readers.best_checkpoint RUN [RUN ...] [--patience 3]

Where training logged val/loss at a checkpoint's step, the two numbers are compared and the file records the largest
difference: a decoder's validation is deterministic, so it is ~0. A masked-LM's masks are drawn afresh, so its
numbers are close, not equal. ``pe-report --at best`` then measures the geometry at ``best.ckpt``.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import lightning as L
import torch

from pe_geometry.analysis.metric_names import VAL_LOSS
from pe_geometry.analysis.readers.runs import load_run
from pe_geometry.files import atomic_write_bytes, atomic_write_text
from pe_geometry.training.checkpoint_io import RunLoadError, read_checkpoint_file, step_checkpoints
from pe_geometry.training.run_loader import load_trained_run, load_weights
from pe_geometry.training.task import LanguageModelTask

log = logging.getLogger(__name__)
BEST_FILE = "best_checkpoint.json"


def early_stopping_choice(losses: list[tuple[int, float]], patience: int) -> tuple[int, int | None]:
    """(best step, step the run would have stopped at or None) under Lightning's EarlyStopping rule (mode min,
    min_delta 0): a validation improves when strictly below the best so far; ``patience`` in a row that do not, stop."""
    if patience < 1:
        raise ValueError(f"patience={patience} must be >= 1")
    best_step, best, wait = None, float("inf"), 0
    for step, loss in losses:
        if loss < best:
            best_step, best, wait = step, loss, 0
        else:
            wait += 1
            if wait >= patience:
                return best_step, step
    if best_step is None:
        raise ValueError("no finite validation loss to choose from")
    return best_step, None


def validation_loss(model: torch.nn.Module, datamodule: L.LightningDataModule, limit_val_batches) -> float:
    """val/loss as training logs it: Lightning's validate over the run's validation batches."""
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, limit_val_batches=limit_val_batches)
    [metrics] = trainer.validate(LanguageModelTask(model), dataloaders=datamodule.val_dataloader(), verbose=False)
    return float(metrics[VAL_LOSS])


def logged_val_losses(run_dir: Path) -> dict[int, float]:
    """step -> the val/loss training logged (csv/metrics.csv); empty when the run has no such log."""
    try:
        steps, values = load_run(run_dir).series.get(VAL_LOSS, ((), ()))
    except Exception:  # a run without readable logs still gets its choice, without the cross-check
        return {}
    return {int(s): float(v) for s, v in zip(steps, values, strict=True)}


def choose_best(run_dir: str | Path, patience: int = 3, force: bool = False) -> dict:
    """Validate the step checkpoints of ``run_dir``, write ``checkpoints/best.ckpt`` and ``best_checkpoint.json``."""
    run_dir = Path(run_dir)
    best_path = run_dir / "checkpoints" / "best.ckpt"
    if best_path.is_file() and not force:
        raise RunLoadError(f"{best_path} exists (kept by the run's own callback, or chosen before): pass --force to choose again")
    checkpoints = step_checkpoints(run_dir)
    if not checkpoints:
        raise RunLoadError(f"{run_dir}: no checkpoints/step<N>.ckpt to choose from (train with callbacks.checkpoint.every_n_train_steps)")
    first = load_trained_run(checkpoints[0][1])
    limit = first.config.get("trainer", {}).get("limit_val_batches", 1.0)
    losses = []
    for step, path in checkpoints:
        load_weights(first.model, read_checkpoint_file(path), path)
        loss = validation_loss(first.model, first.datamodule, limit)
        log.info("%s: step %d val/loss %.4f", run_dir.name, step, loss)
        losses.append((step, loss))
    best_step, stopped_at = early_stopping_choice(losses, patience)
    # Lightning logs a validation at the index of the batch before it (step - 1), the checkpoint's global_step is step
    logged = logged_val_losses(run_dir)
    shared = [abs(loss - logged[step - 1]) for step, loss in losses if step - 1 in logged]
    chosen = dict(checkpoints)[best_step]
    atomic_write_bytes(best_path, chosen.read_bytes())
    result = {
        "chosen_from": "step checkpoints, validated after training (analysis.best_checkpoint)",
        "patience": patience,
        "best_step": best_step,
        "best_val_loss": dict(losses)[best_step],
        "stopped_at": stopped_at,  # None: the rule never stopped within the checkpoints there are
        "last_step": losses[-1][0],
        "val_loss": {str(step): loss for step, loss in losses},
        "compared_with_logged": {"n_steps": len(shared), "max_abs_diff": max(shared) if shared else None},
    }
    atomic_write_text(run_dir / BEST_FILE, json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+", help="run folders with checkpoints/step<N>.ckpt")
    parser.add_argument("--patience", type=int, default=3, help="validations without a new lowest before the rule stops (default 3)")
    parser.add_argument("--force", action="store_true", help="choose again where checkpoints/best.ckpt exists")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # not its device lines once per checkpoint
    results = []
    for run in args.runs:
        try:
            result = choose_best(run, args.patience, args.force)
        except (RunLoadError, ValueError) as err:
            raise SystemExit(f"error: {err}") from None
        stop = f", the rule stops at step {result['stopped_at']}" if result["stopped_at"] is not None else ", the rule never stopped"
        check = result["compared_with_logged"]
        same = (f"; {check['n_steps']} steps also logged in training, largest difference {check['max_abs_diff']:.2e}"
                if check["n_steps"] else "")
        print(f"{run}: best val/loss {result['best_val_loss']:.4f} at step {result['best_step']} of {result['last_step']}{stop}{same}")
        results.append(result)
    return results


if __name__ == "__main__":
    main()
