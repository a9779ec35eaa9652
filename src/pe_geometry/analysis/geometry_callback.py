"""Record word/position geometry during training, as metrics every logger receives.

``GeometryCallback`` measures at initialisation (before the first optimiser step),
every ``every_n_steps`` steps and at the end, and logs flat ``geometry/...`` metrics
(each with its ``..._chance`` companion where one exists) at the training step, so
CSV and W&B curves line up across runs. What is measured is ``analysis.record.record`` (no Lightning there; a
checkpoint reader calls it too), on rows chosen once in ``setup``:

- ``input``: the word rows actually used (the ``n_tokens`` most frequent training tokens, scaled as the model
  scales them) against the position rows actually used (``0..seq_len-1``);
- ``hidden``: a fixed probe batch of validation blocks (``probe_batch_size``); at the first and last record and
  every ``position_probe_every_n_steps`` steps, also the powered position probe on ``position_probe_blocks``
  validation blocks;
- ``attention``: block 0 on the first 4 probe blocks.

The callback itself only chooses when, on which rows, and where the figures go (the measures, their cost and
memory: analysis/record.py). ``records`` keeps every logged dict by training step. At the end of the run the
callback offers the headline figures at initialisation and at the end (``summary_lines``, for the run summary)
and their charts (``wandb_summary``, for W&B): ``analysis.geometry_summary``, through the protocols of
``training.summary`` and ``training.wandb_run``.

It runs on global rank 0 only, under ``torch.no_grad`` with the RNG state saved and
restored, and puts the model back in training mode, so it never changes training.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch import Tensor

from pe_geometry.analysis import geometry_summary
from pe_geometry.analysis.measures.probes import frequent_token_ids
from pe_geometry.analysis.record import record
from pe_geometry.files import atomic_write_text
from pe_geometry.model.transformer import LanguageModel
from pe_geometry.settings.training import GeometryCallbackSettings
from pe_geometry.training.wandb_run import LineChart, Table

log = logging.getLogger(__name__)


class GeometryCallback(L.Callback):
    """The geometry recorder; its settings (when, on which rows, with which nulls): ``GeometryCallbackSettings``."""

    Settings = GeometryCallbackSettings

    def __init__(self, **settings: Any) -> None:
        self.settings = s = self.Settings(**settings)
        self.every_n_steps, self.n_tokens, self.measures = s.every_n_steps, s.n_tokens, tuple(s.measures)
        self.probe_batch_size, self.fixed_k, self.threshold, self.seed = s.probe_batch_size, s.fixed_k, s.positional_head_threshold, s.seed
        # The nulls have their own fixed seeds (0), not the run's: every run is tested against the same rotations
        # and the same relabellings, so seeds differ only by what they trained.
        self.null_draws, self.probe_every = s.null_draws, s.position_probe_every_n_steps
        self.n_probe_blocks, self.probe_permutations = s.position_probe_blocks, s.position_probe_permutations
        self.chunk_tokens, self.attention_null_draws = s.chunk_tokens, s.attention_null_draws
        self.position_blocks = torch.empty(0, 0, dtype=torch.long)  # chosen in setup
        self._last_step: int | None = None
        self.records: dict[int, dict[str, float]] = {}  # training step -> the metrics logged at that step

    # -- what to measure on, chosen once -------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        dm = trainer.datamodule
        tokenizer = dm.tokenizer
        counts = self.choose_rows_of(dm)
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

    def choose_rows_of(self, datamodule) -> Tensor:
        """``choose_rows`` on a datamodule's streams, its special tokens excluded from the word rows (what setup
        measures on; a reader of a finished run calls it to measure on the same rows)."""
        specials = [datamodule.tokenizer.token_to_id(t) for t in ("<unk>", "<mask>", "<eos>")]
        return self.choose_rows(datamodule.streams["train"], datamodule.streams["validation"], datamodule.vocab_size,
                                datamodule.seq_len, specials)

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
        """All enabled measures as flat ``geometry/...`` metrics (the powered position probe if asked):
        ``analysis.record.record`` on the rows ``setup`` chose, with this callback's settings."""
        return record(model, self.probe, word_ids=self.token_ids,
                      position_blocks=self.position_blocks if position_probe_now else None, measures=self.measures,
                      fixed_k=self.fixed_k, positional_head_threshold=self.threshold, seed=self.seed,
                      null_draws=self.null_draws, position_probe_permutations=self.probe_permutations,
                      chunk_tokens=self.chunk_tokens, attention_null_draws=self.attention_null_draws)

    # -- a resumed run keeps its whole record --------------------------------------------
    # The records travel in each checkpoint (Lightning saves a callback's state_dict there), so a resumed run's summary
    # reads its start from step 0, not from the step it resumed at (a few dozen floats per record).
    def state_dict(self) -> dict[str, Any]:
        return {"records": {int(step): dict(metrics) for step, metrics in self.records.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.records = {int(step): dict(metrics) for step, metrics in state_dict.get("records", {}).items()}

    # -- the end of the run -------------------------------------------------------------
    def summary_lines(self) -> list[str]:
        """The headline figures at initialisation and at the end, beside chance and null (training.summary)."""
        return geometry_summary.summary_lines(self.records, self.probe_permutations)

    def wandb_summary(self) -> dict[str, LineChart | Table]:
        """The headline figures against chance as charts, and the angle table (training.wandb_run)."""
        return geometry_summary.wandb_charts(self.records)
