"""Validation loss of a trained run on blocks longer than it was trained on (length extrapolation).

The script: ``pe-extrapolate RUN [RUN ...]``.

For each multiplier m the same validation tokens (the start of the validation stream) are
cut into blocks of m x seq_len (+1) tokens, exactly as the datamodule cuts seq_len blocks,
so the losses of different lengths average over the same target tokens. The data and
model are rebuilt from ``checkpoints/last.ckpt`` and the run's config by
``training.run_loader.load_trained_run``, as training built them. For a decoder at m = 1 with
``max_batches`` equal to the run's ``trainer.limit_val_batches`` the loss is the run's last
``val/loss`` (an encoder's masks are drawn from a fixed seed here, so it differs slightly).

A learned position table cannot go past ``pe.max_len`` rows: that length is reported as
"n/a". Rows of a learned table between seq_len and max_len exist but never received a
gradient; those lengths get a number and ``untrained_positions: true``.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import torch
import yaml

from pe_geometry.model.transformer import EncoderDecoder, LanguageModel
from pe_geometry.training.run_loader import load_trained_run

log = logging.getLogger(__name__)
OUTPUT_NAME = "length_extrapolation.json"
NA = "n/a"
MASK_SEED = 1234  # the encoder's masked positions are drawn from this seed: every run and length sees the same draw
_DATAMODULES: dict[str, object] = {}  # one datamodule per data config within a process (a sweep's runs share one)


# ----------------------------------------------------------------------------- rebuild a run




# ----------------------------------------------------------------------------- per-token losses


def token_losses(model: LanguageModel, blocks: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-target cross-entropy (B, T') (NaN where a position has no target) and each target's position (T',).

    Decoder: next-token targets at positions 0..L-1. Encoder: masked-LM targets (masks drawn from
    ``generator``). Encoder-decoder: the decoder's targets, at decoder positions.
    """
    loss = model.loss(blocks, reduction="none", generator=generator)
    return loss, torch.arange(loss.shape[1])


def trained_positions(model: LanguageModel, seq_len: int) -> int:
    """How many target positions training used (decoder side of an encoder-decoder)."""
    if isinstance(model, EncoderDecoder):
        return seq_len - model.source_len(seq_len)
    return seq_len


def position_limit(model: LanguageModel) -> int | None:
    """The longest sequence the input position table accepts (LearnedPE.max_len), or None (no limit)."""
    max_len = getattr(model.input_stack.pe, "max_len", None)
    return None if max_len is None else int(max_len)


def _longest_input(model: LanguageModel, block_len: int) -> int:
    """The longest sequence one stack of the model reads from a block of block_len + 1 tokens."""
    if isinstance(model, EncoderDecoder):
        src_len = model.source_len(block_len)
        return max(src_len, block_len - src_len)
    return block_len


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate_lengths(
    run_dir: str | Path,
    multipliers: tuple[int, ...] | list[int] = (1, 2, 4),
    max_batches: int = 8,
    write: bool = True,
) -> dict:
    """Validation loss on blocks of m x seq_len tokens for each multiplier m; writes length_extrapolation.json.

    The number of target tokens is fixed: max_batches x batch_size x seq_len rounded up to a
    multiple of lcm(multipliers) x seq_len (so every length uses the same tokens), capped
    by the validation stream. Returns a JSON-ready dict; a length the model cannot take
    (learned PE past pe.max_len) has loss "n/a" and a reason. Never raises for a length.
    """
    run_dir = Path(run_dir)
    multipliers = sorted({int(m) for m in multipliers})
    if not multipliers or multipliers[0] < 1:
        raise ValueError(f"multipliers must be positive integers, got {multipliers}")
    run = load_trained_run(run_dir, datamodules=_DATAMODULES)
    cfg, datamodule, model, step = run.config, run.datamodule, run.model, run.step
    seq_len, batch_size = int(cfg.data.seq_len), int(cfg.data.batch_size)
    stream = torch.from_numpy(datamodule.streams["validation"].astype(np.int64))
    unit = math.lcm(*multipliers) * seq_len
    n_tokens = max_batches * batch_size * seq_len
    n_tokens = math.ceil(n_tokens / unit) * unit
    available = len(stream) - 1
    if n_tokens > available:
        n_tokens = (available // unit) * unit or (available // (multipliers[-1] * seq_len)) * multipliers[-1] * seq_len
    limit = position_limit(model)
    train_len = trained_positions(model, seq_len)
    choices = run.choices or _choices(run_dir)
    result = {
        "run_dir": str(run_dir),
        "model": choices.get("model") or type(model).__name__,
        "pe": choices.get("pe") or str(cfg.pe.get("_target_", "")).rsplit(".", 1)[-1],
        "seed": int(cfg.get("seed", 0)),
        "step": step,
        "objective": model.objective,
        "split": "validation",
        "train_seq_len": seq_len,
        "pe_max_len": limit,
        "n_target_tokens": n_tokens,
        "max_batches": max_batches,
        "multipliers": multipliers,
        "lengths": {},
    }
    generator_seed = MASK_SEED
    for m in multipliers:
        block_len = m * seq_len
        entry: dict = {"multiplier": m, "block_len": block_len}
        result["lengths"][str(m)] = entry
        n_blocks = n_tokens // block_len if n_tokens else 0
        longest = _longest_input(model, block_len)
        if n_blocks == 0:
            entry.update(loss=NA, reason=f"the validation stream ({len(stream)} tokens) is shorter than one block of {block_len}")
            continue
        if limit is not None and longest > limit:
            entry.update(loss=NA, reason=f"{longest} positions are past the learned position table (pe.max_len={limit})")
            continue
        blocks = torch.stack([stream[i * block_len : i * block_len + block_len + 1] for i in range(n_blocks)])
        generator = torch.Generator().manual_seed(generator_seed)
        per_batch = max(1, batch_size // m)
        try:
            losses, positions = [], None
            for start in range(0, n_blocks, per_batch):
                loss, positions = token_losses(model, blocks[start : start + per_batch], generator)
                losses.append(loss)
        except ValueError as err:  # e.g. LearnedPE: "... longer than the learned position table ..."
            entry.update(loss=NA, reason=str(err))
            continue
        loss = torch.cat(losses).double()
        within = loss[:, positions < train_len]
        beyond = loss[:, positions >= train_len]
        mean = _nanmean(loss)
        entry.update(
            loss=mean,
            ppl=math.exp(mean) if math.isfinite(mean) else NA,
            n_blocks=n_blocks,
            n_targets=int((~loss.isnan()).sum()),
            loss_within_train_len=_nanmean(within),
            loss_beyond_train_len=_nanmean(beyond) if beyond.numel() else None,
            untrained_positions=bool(limit is not None and longest > train_len),  # learned rows no gradient reached
        )
    if write:
        (run_dir / OUTPUT_NAME).write_text(json.dumps(result, indent=2))
    return result


def _nanmean(x: torch.Tensor) -> float:
    ok = ~x.isnan()
    return float(x[ok].mean()) if ok.any() else float("nan")


def _choices(run_dir: Path) -> dict:
    """Hydra's runtime.choices of a run (group -> option), {} if the run has no .hydra/hydra.yaml
    (for checkpoints written before they recorded their group choices)."""
    path = run_dir / ".hydra" / "hydra.yaml"
    if not path.is_file():
        return {}
    try:
        hydra_cfg = yaml.safe_load(path.read_text())
        return dict(hydra_cfg["hydra"]["runtime"]["choices"])
    except (KeyError, TypeError, yaml.YAMLError):
        return {}
