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

``fixed_target_losses`` is the benchmark's protocol (``pe-bench extrapolation``): averaging over
every position of a long block mixes in the positions a short block also has, so a longer block's loss
is mostly *within* the trained length. There, the scored tokens are the same at every length: the last
``target_len`` tokens of each window, windows of every length ending at the same stream offsets, the
longest windows not overlapping. Only the context before those tokens grows. Standard errors are
over windows (tokens inside one window are not independent), and the ratio to 1x is paired by window.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
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
    stack = getattr(model, "input_stack", None)  # a peer (model=xtransformers) has no table of ours, nor a limit
    max_len = getattr(getattr(stack, "pe", None), "max_len", None)
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
    if str(cfg.data.get("_target_", "")).endswith("TaskDataModule"):  # its stream is examples, not text to extrapolate on
        raise ValueError(f"{run_dir} was trained on a task (data=task): pe-bench tasks scores its answers at longer lengths")
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


@torch.no_grad()
def fixed_target_losses(
    model: LanguageModel,
    stream: np.ndarray | torch.Tensor,
    seq_len: int,
    multipliers: tuple[int, ...] | list[int] = (1, 2, 4, 8, 16),
    target_len: int | None = None,
    max_windows: int | None = None,
    tokens_per_batch: int = 8192,
    mask_seed: int = MASK_SEED,
    mask_draws: int = 1,
) -> dict:
    """Loss on the same target tokens with windows of m x seq_len tokens for each multiplier m.

    Window w ends at stream offset (w + 1)(L_max + 1) for every length (L_max = max(m) x seq_len), so the
    longest windows do not overlap and every length scores the same ``target_len`` tokens per window
    (default seq_len // 2: at 1x each scored token still sees at least half a training window).
    Decoder: the last target_len next-token targets of a block of L + 1 tokens. Masked-LM encoder: the
    masked tokens among the last target_len of L tokens, masks drawn once per stream token (``mask_seed``),
    so a token is masked (and replaced) alike at every length; ``mask_draws`` independent draws (seeds mask_seed,
    mask_seed + 1, ...) each score the window once, so a window holds about mask_draws x 15 % of its targets (a
    single draw leaves ~10 of 64, and the loss's standard error near 1.8 %). Encoder-decoder: not covered (n/a).

    Returns {"multipliers", "target_len", "n_windows", "lengths": {m: {...}}}; each length has ``loss``
    (mean over targets), ``se`` (over windows), ``n_targets``, and for m > 1 ``ratio`` (loss / loss at 1x)
    and ``ratio_se`` (paired by window: the delta method on the per-window differences), or ``loss: "n/a"``
    with a ``reason`` (a learned table shorter than the window).
    """
    multipliers = sorted({int(m) for m in multipliers})
    if not multipliers or multipliers[0] < 1:
        raise ValueError(f"multipliers must be positive integers, got {multipliers}")
    target_len = seq_len // 2 if target_len is None else int(target_len)
    if not 1 <= target_len <= seq_len:
        raise ValueError(f"target_len={target_len} must be between 1 and seq_len={seq_len}")
    stream = torch.as_tensor(np.asarray(stream, dtype=np.int64))
    longest = multipliers[-1] * seq_len
    n_windows = len(stream) // (longest + 1)
    if max_windows is not None:
        n_windows = min(n_windows, int(max_windows))
    result: dict = {"multipliers": multipliers, "target_len": target_len, "n_windows": n_windows,
                    "window_stride": longest + 1, "objective": model.objective, "lengths": {}}
    if mask_draws < 1:
        raise ValueError(f"mask_draws={mask_draws} must be >= 1")
    if n_windows < 2:
        raise ValueError(f"the stream ({len(stream)} tokens) holds {n_windows} windows of {longest + 1} tokens; need >= 2")
    ends = (torch.arange(n_windows) + 1) * (longest + 1)
    limit = position_limit(model)
    encoder = model.objective == "masked-lm"
    draws = []  # per mask draw: one uniform per stream token (the same masks at every length), replacement ids
    for d in range(mask_draws if encoder else 0):
        g = torch.Generator().manual_seed(mask_seed + d)
        draws.append((torch.rand(len(stream), generator=g), torch.randint(model.vocab_size, (len(stream),), generator=g)))
    if encoder:
        result["mask_draws"] = mask_draws
    device = next(model.parameters()).device
    sums: dict[int, torch.Tensor] = {}  # m -> (n_windows,) summed target loss per window
    counts = torch.zeros(n_windows)
    for m in multipliers:
        L = m * seq_len
        entry: dict = {"multiplier": m, "window": L}
        result["lengths"][str(m)] = entry
        if model.objective == "seq2seq":
            entry.update(loss=NA, reason="encoder-decoder: not in this protocol")
            continue
        if limit is not None and L > limit:
            entry.update(loss=NA, reason=f"{L} positions are past the learned position table (pe.max_len={limit})")
            continue
        starts = ends - (L if encoder else L + 1)
        index = starts[:, None] + torch.arange(L if encoder else L + 1)[None]  # (W, window)
        per_window = torch.zeros(n_windows, dtype=torch.float64)
        step = max(1, tokens_per_batch // L)
        for lo in range(0, n_windows, step):
            idx = index[lo : lo + step]
            tokens = stream[idx].to(device)
            if encoder:
                loss, n_chosen = torch.zeros(tokens.shape, device=device), torch.zeros(len(idx))
                for draw, random_ids in draws:
                    u = draw[idx].to(device)
                    chosen = u < model.mask_prob
                    chosen[:, : L - target_len] = False  # score the last target_len only (the rest keep their masks)
                    inputs = torch.where(u < 0.8 * model.mask_prob, model.mask_token_id, tokens)
                    inputs = torch.where((u >= 0.8 * model.mask_prob) & (u < 0.9 * model.mask_prob), random_ids[idx].to(device), inputs)
                    logits = model(inputs)
                    token_loss = F.cross_entropy(logits.transpose(1, 2).float(), tokens, reduction="none")
                    loss = loss + torch.where(chosen, token_loss, torch.zeros_like(token_loss))
                    n_chosen += chosen.sum(1).float().cpu()
                if m == multipliers[0]:
                    counts[lo : lo + step] = n_chosen
            else:
                loss = model.loss(tokens, reduction="none")[:, -target_len:]
                if m == multipliers[0]:
                    counts[lo : lo + step] = float(target_len)
            per_window[lo : lo + step] = loss.double().sum(1).cpu()
        sums[m] = per_window
        loss, se = _ratio(per_window, counts.double())
        entry.update(loss=loss, se=se, rel_se=se / loss if loss else float("nan"))
        entry["n_targets"] = int(counts.sum())
        base = multipliers[0]
        if m != base and base in sums:
            ratio, ratio_se = _ratio(per_window, sums[base])
            entry.update(ratio=ratio, ratio_se=ratio_se)
    return result


def _ratio(numerators: torch.Tensor, denominators: torch.Tensor) -> tuple[float, float]:
    """sum(a) / sum(b) over windows, and its standard error over windows (the ratio estimator's delta method).

    With b = each window's target count it is the mean loss; with b = each window's summed loss at 1x it is the
    ratio of two lengths' losses on the same targets, paired by window. Windows with no target are left out.
    """
    keep = denominators > 0
    a, b = numerators[keep], denominators[keep]
    ratio, w = float(a.sum() / b.sum()), len(a)
    residual = a - ratio * b
    se = float((residual.pow(2).sum() / (w - 1)).sqrt() * math.sqrt(w) / b.sum()) if w > 1 else float("nan")
    return ratio, se


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
