"""Record word/position geometry during training, as metrics every logger receives.

``GeometryCallback`` measures at initialisation (before the first optimiser step),
every ``every_n_steps`` steps and at the end, and logs flat ``geometry/...`` metrics
(each with its ``..._chance`` companion where one exists) at the training step, so
CSV and W&B curves line up across runs. Three families, each optional:

- ``input``: the pairwise table of the claims' source (docs/CLAIMS.md) and the subspace/norm measures between
  the word rows actually used (the ``n_tokens`` most frequent training tokens, scaled
  as the model scales them) and the position rows actually used (``0..seq_len-1``).
  Only for encodings that add a table to the input (sinusoidal, learned). Each figure also
  gets its spectra-keeping null (``analysis.nulls``, ``null_draws`` rotations of P):
  ``_null_mean``, ``_null_std``, ``_z``, ``_p``; plus the variance-weighted overlaps.
- ``hidden``: position vs token structure of the hidden states at the input of each
  block and at the output, on a fixed probe batch of validation blocks. Works for
  every PE type (RoPE, ALiBi and none included). At the first and last record and every
  ``position_probe_every_n_steps`` steps, also the powered position probe
  (``analysis.position_probe``: ``position_probe_blocks`` blocks, grouped CV, a null of
  ``position_probe_permutations`` relabellings): ``position_r2``, ``log_position_r2``.
- ``attention``: block 0's scores, every family on one axis (``analysis.position_attention``):
  per head, ``positional_share``, the share of score variance from all position-dependent terms (for
  an input-table encoding, split into every word/position/bias term by ``analysis.attention_split``;
  otherwise the encoding's own term, with a null of ``attention_null_draws`` random pair assignments
  for RoPE/xPos), ``mean_distance`` (how far each head looks, beside uniform attention's ``_chance``),
  and the count of positional heads by the share.

Metric names come from ``analysis.metric_names``; ``records`` keeps every logged dict by
training step. At the end of the run the callback offers the headline figures at initialisation
and at the end (``summary_lines``, for the run summary) and their charts (``wandb_summary``, for
W&B): ``analysis.geometry_summary``, through the protocols of ``training.summary`` and
``training.wandb_run``.

It runs on global rank 0 only, under ``torch.no_grad`` with the RNG state saved and
restored, and puts the model back in training mode, so it never changes training.

Cost and memory (docs/BENCHMARKS.md, "Geometry record scaling"; experiments/benchmark_geometry_scaling.py):
the hidden states are computed on the model's device ``chunk_tokens`` tokens at a time, one layer alive at a
time, and summed there into the measures' sufficient statistics (``geometry.HiddenStateSums``,
``position_probe.PositionProbeSums``); the attention split never builds its (T, T) terms. So a record holds one
chunk's activations plus the sums, whatever the number of blocks. float64 only where a figure is a difference
of large sums (the probe's cross-products and SSE, the hidden measures' total variance); the forward passes,
the attention split and the input-level tables stay float32. On a CPU, small work runs on one thread.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch import Tensor

from pe_geometry.analysis import geometry as geo
from pe_geometry.analysis import geometry_summary, position_attention
from pe_geometry.analysis import metric_names as names
from pe_geometry.analysis.attention_split import first_layer_attention_split, positional_heads
from pe_geometry.analysis.nulls import _PARALLEL_MACS, _threads, null_summary, rotation_null
from pe_geometry.analysis.position_probe import PositionProbeSums
from pe_geometry.analysis.probes import frequent_token_ids
from pe_geometry.data.cache import atomic_write_text
from pe_geometry.model.transformer import LanguageModel
from pe_geometry.training.wandb_run import LineChart, Table

log = logging.getLogger(__name__)
MEASURES = ("input", "hidden", "attention")


def _threads_for(macs: float) -> contextlib.AbstractContextManager:
    """The caller's torch threads for CPU work of >= _PARALLEL_MACS multiply-adds, one thread below (the null's rule).

    Factorisations, reductions and small products sync their threads so often that on a busy 2-core machine the
    second thread mostly waits: measured under load (load average ~8), the hidden measures of a d 128 model took
    4.8 s on 2 threads and 0.05 s on 1. Large products still gain from every core. No effect on a GPU.
    """
    return contextlib.nullcontext() if macs >= _PARALLEL_MACS else _threads(1)


class GeometryCallback(L.Callback):
    def __init__(
        self,
        every_n_steps: int = 100,
        n_tokens: int = 1000,
        measures: Sequence[str] = MEASURES,
        probe_batch_size: int = 8,
        fixed_k: int = 8,
        positional_head_threshold: float = 0.5,
        seed: int = 0,
        null_draws: int = 100,
        position_probe_every_n_steps: int = 500,
        position_probe_blocks: int = 128,
        position_probe_permutations: int = 20,
        chunk_tokens: int = 8192,
        attention_null_draws: int = 20,
    ) -> None:
        unknown = sorted(set(measures) - set(MEASURES))
        if unknown:
            raise ValueError(f"unknown geometry measure(s) {unknown}; valid: {list(MEASURES)}")
        if every_n_steps <= 0:
            raise ValueError(f"callbacks.geometry.every_n_steps={every_n_steps} must be positive")
        self.every_n_steps, self.n_tokens, self.measures = every_n_steps, n_tokens, tuple(measures)
        self.probe_batch_size, self.fixed_k, self.threshold, self.seed = probe_batch_size, fixed_k, positional_head_threshold, seed
        minimum = {"null_draws": (null_draws, 2), "position_probe_every_n_steps": (position_probe_every_n_steps, 1),
                   "position_probe_blocks": (position_probe_blocks, 5), "position_probe_permutations": (position_probe_permutations, 2),
                   "chunk_tokens": (chunk_tokens, 1), "attention_null_draws": (attention_null_draws, 2)}
        for key, (value, least) in minimum.items():
            if value < least:
                raise ValueError(f"callbacks.geometry.{key}={value} must be >= {least}")
        # The nulls have their own fixed seeds (0), not the run's: every run is tested against the same rotations
        # and the same relabellings, so seeds differ only by what they trained.
        self.null_draws, self.probe_every = null_draws, position_probe_every_n_steps
        self.n_probe_blocks, self.probe_permutations = position_probe_blocks, position_probe_permutations
        self.chunk_tokens, self.attention_null_draws = chunk_tokens, attention_null_draws
        self.position_blocks = torch.empty(0, 0, dtype=torch.long)  # chosen in setup
        self._last_step: int | None = None
        self.records: dict[int, dict[str, float]] = {}  # training step -> the metrics logged at that step

    # -- what to measure on, chosen once -------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        dm = trainer.datamodule
        tokenizer = dm.tokenizer
        specials = [tokenizer.token_to_id(t) for t in ("<unk>", "<mask>", "<eos>")]
        counts = self.choose_rows(dm.streams["train"], dm.streams["validation"], dm.vocab_size, dm.seq_len, specials)
        # trainer.log_dir broadcasts from rank 0 in DDP, so every rank must read it (a rank-0-only
        # read deadlocks the others); only rank 0 writes.
        log_dir = trainer.log_dir
        if trainer.is_global_zero and log_dir is not None:
            rule = {
                "word_rows": f"the {len(self.token_ids)} most frequent training tokens (special tokens excluded)",
                "position_rows": f"positions 0..{self.seq_len - 1} (the positions seen in training)",
                "probe": f"the first {len(self.probe)} validation blocks of {self.seq_len} tokens",
                "position_probe": f"the first {len(self.position_blocks)} validation blocks of {self.seq_len} tokens",
                "share_of_training_tokens": float(counts.sum() / len(dm.streams["train"])),
                "tokens": [tokenizer.id_to_token(int(i)) for i in self.token_ids],
            }
            atomic_write_text(Path(trainer.default_root_dir) / "geometry_tokens.json", json.dumps(rule, indent=1))

    def choose_rows(self, train: np.ndarray, validation: np.ndarray, vocab_size: int, seq_len: int,
                    specials: Sequence[int]) -> Tensor:
        """What every record measures, from the token streams (setup's choice): the word rows, the
        hidden-state probe's blocks and the position probe's blocks. Returns the word rows' counts."""
        self.token_ids, counts = frequent_token_ids(train, vocab_size, self.n_tokens, specials)
        self.seq_len = seq_len
        val = torch.from_numpy(validation[: self.probe_batch_size * seq_len].astype(np.int64))
        self.probe = val[: (len(val) // seq_len) * seq_len].view(-1, seq_len)  # (B, T) fixed blocks
        long = torch.from_numpy(validation[: self.n_probe_blocks * seq_len].astype(np.int64))
        self.position_blocks = long[: (len(long) // seq_len) * seq_len].view(-1, seq_len)  # >= 128 blocks: power
        return counts

    # -- when -------------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Step 0 (initialisation), or a resume step on the cadence (re-measured exactly as the first segment did).
        # A resume off the cadence (a Ctrl-C checkpoint) is not measured: the uninterrupted run has no row there.
        if trainer.global_step % self.every_n_steps == 0:
            self._record(trainer, pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        # The last step is final here already: when it falls on the cadence, on_train_end finds it recorded
        # and skips it, so the probe (final records only, off its own cadence) would be missing at the end.
        last = trainer.max_steps is not None and 0 < trainer.max_steps <= trainer.global_step
        if trainer.global_step % self.every_n_steps == 0 or last:
            self._record(trainer, pl_module, final=last)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._record(trainer, pl_module, final=True)

    # -- what -------------------------------------------------------------------------
    def _record(self, trainer: L.Trainer, pl_module: L.LightningModule, final: bool = False) -> None:
        step = trainer.global_step
        if not trainer.is_global_zero or step == self._last_step:
            return
        self._last_step = step
        model: LanguageModel = pl_module.model
        if not all(p.isfinite().all() for p in model.parameters()):  # an SVD of NaN weights raises LinAlgError
            log.warning("geometry not measured at step %d: the weights hold nan/inf", step)
            return
        was_training = model.training
        model.eval()
        # The powered position probe costs ~10x a record: its own cadence (step 0 included) and the last record.
        # Chosen by the step alone, so a resumed run re-measures its resume step exactly as the first segment did.
        with_probe = final or step % self.probe_every == 0
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                metrics = self.measure(model, position_probe_now=with_probe)
        except torch.linalg.LinAlgError as err:  # finite but exploding weights: nan/inf hidden states
            log.warning("geometry not measured at step %d: %s", step, err)
            return
        finally:
            model.train(was_training)
        self.records[step] = metrics
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def measure(self, model: LanguageModel, position_probe_now: bool = False) -> dict[str, float]:
        """All enabled measures as flat ``geometry/...`` metrics (the powered position probe if asked)."""
        metrics: dict[str, float] = {}
        device = model.W_E.device
        W_pos = model.W_pos
        if "input" in self.measures and W_pos is not None:
            E = model.W_E[self.token_ids.to(device)].float().cpu()
            P = W_pos[: self.seq_len].float().cpu()
            with _threads_for(0):  # SVDs of (1000, d) and (seq_len, d): factorisations, one thread
                report = geo.geometry_report(E, P, embed_scale=model.embed_scale, seed=self.seed)
            report |= rotation_null(E, P, n_draws=self.null_draws, seed=0, fixed_k=self.fixed_k)  # same observed values
            metrics.update({names.input_metric(k): v for k, v in report.items()})
        if "hidden" in self.measures:
            metrics.update(self.hidden_measures(model, position_probe_now))
        if "attention" in self.measures:
            metrics.update(self.attention_measures(model))
        return metrics

    def attention_measures(self, model: LanguageModel) -> dict[str, float]:
        """Block 0 on 4 probe blocks: per-head positional share of the score variance for every family (the seven
        split terms for an input-table encoding, the encoding's own term otherwise; with the rotation null for
        RoPE/xPos), each head's mean attention distance beside uniform attention's, and the positional-head count."""
        idx = self.probe[:4].to(model.W_E.device)
        metrics: dict[str, float] = {}
        with _threads_for(4 * self.seq_len**2 * model.d_model * 3):  # 4 blocks: S, then S_c [K_e | K_p] (all heads)
            if model.W_pos is not None:
                shares = first_layer_attention_split(model, idx)
            else:
                shares = {"positional": position_attention.relative_position_shares(model, idx)}
                if position_attention.has_rotation(model):
                    draws = position_attention.rotation_share_draws(model, idx, self.attention_null_draws).cpu().numpy()
                    for h, value in enumerate(shares["positional"].tolist()):
                        metrics |= null_summary(names.attention_share_metric(h, "positional"), value, draws[:, h])
            distance, chance = position_attention.mean_attention_distance(model, idx, n_blocks=1)
        for name, per_head in shares.items():
            for h, value in enumerate(per_head.tolist()):
                metrics[names.attention_share_metric(h, name)] = value
        for h, (value, uniform) in enumerate(zip(distance[0].tolist(), chance[0].tolist())):
            metrics[names.attention_distance_metric(h)] = value
            metrics[names.companion(names.attention_distance_metric(h), "_chance")] = uniform
        metrics[names.N_POSITIONAL_HEADS_ALL_TERMS] = float(len(positional_heads(shares, self.threshold)))
        return metrics

    def hidden_measures(self, model: LanguageModel, position_probe_now: bool = False) -> dict[str, float]:
        """hidden_state_report of every layer on the probe blocks, and position_probe's figures if asked.

        The hidden states are computed on the model's device ``chunk_tokens`` tokens at a time (whole
        blocks, at least one), one layer alive at a time (``iter_hidden_states``), and summed into
        HiddenStateSums / PositionProbeSums there: what a record holds is one chunk's activations plus
        the sums (float64: (2 T + n_tok) D per layer for the hidden measures, 5 D^2 + 210 D for the
        probe with 20 relabellings), never the (blocks, T, D) states of every layer. When the probe
        runs, its blocks start with the probe blocks (both are the first validation blocks), so one
        pass feeds both.
        """
        device = model.W_E.device
        n_states = len(model.blocks) + 1
        hidden = [geo.HiddenStateSums(self.probe, seed=self.seed) for _ in range(n_states)]
        probe_sums = None
        passes = [(self.probe, True, False)]  # (blocks, feeds the hidden measures, feeds the probe)
        if position_probe_now and len(self.position_blocks) >= 5:
            probe_sums = PositionProbeSums(len(self.position_blocks), self.seq_len, n_layers=n_states,
                                           n_permutations=self.probe_permutations, seed=0)
            shared = self.position_blocks[: len(self.probe)].equal(self.probe)
            passes = [(self.position_blocks, True, True)] if shared else [*passes, (self.position_blocks, False, True)]
        step = max(1, self.chunk_tokens // self.seq_len)  # blocks per chunk
        D = model.d_model
        for blocks, to_hidden, to_probe in passes:
            for first in range(0, len(blocks), step):
                chunk = blocks[first : first + step].to(device)
                # the forward runs inside the generator, under the outer setting; the sums under the inner one
                with _threads_for(chunk.numel() * 12 * D * D):  # a block's products: ~12 d^2 multiply-adds a token
                    for i, H in enumerate(model.iter_hidden_states(chunk)):
                        with _threads_for(chunk.numel() * D * D):  # the probe's x^T x
                            if to_hidden and first < len(self.probe):
                                hidden[i].add(H[: len(self.probe) - first], first)
                            if to_probe:
                                probe_sums.add(H, first, layer=i)
        metrics = {}
        with _threads_for(0):  # (d, d) eighs and products of d x d by d x 9 C: one thread
            for i, sums in enumerate(hidden):
                metrics.update({names.hidden_metric(i, k): v for k, v in sums.report(self.fixed_k).items()})
            if probe_sums is not None:
                for i in range(n_states):
                    metrics.update({names.hidden_metric(i, k): v for k, v in probe_sums.report(i).items()})
        return metrics

    # -- the end of the run -------------------------------------------------------------
    def summary_lines(self) -> list[str]:
        """The headline figures at initialisation and at the end, beside chance and null (training.summary)."""
        return geometry_summary.summary_lines(self.records)

    def wandb_summary(self) -> dict[str, LineChart | Table]:
        """The headline figures against chance as charts, and the angle table (training.wandb_run)."""
        return geometry_summary.wandb_charts(self.records)
