"""Every function of ``training.lightning_compat`` (our only uses of Lightning's private API) against a real, tiny
``Trainer``, in-process: CI runs this at the newest and at the lowest allowed Lightning (``.ci/run``), so a Lightning
release that moves one of them fails here, by name, rather than somewhere inside a resume or a stop signal."""

from __future__ import annotations

import re
import signal
from datetime import timedelta

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader, TensorDataset

from pe_geometry.training import lightning_compat as compat


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.layer(batch[0]).pow(2).mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(32, 2)), batch_size=2)

    def val_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(4, 2)), batch_size=2)


def trainer(tmp_path, callbacks, **settings) -> L.Trainer:
    """Validation every 2 steps (one batch), 6 steps, nothing printed."""
    return L.Trainer(**{"default_root_dir": tmp_path, "max_steps": 6, "val_check_interval": 2, "check_val_every_n_epoch": None,
                        "limit_val_batches": 1, "num_sanity_val_steps": 0, "logger": False, "enable_checkpointing": False,
                        "enable_progress_bar": False, "enable_model_summary": False, "accelerator": "cpu", "devices": 1,
                        "callbacks": callbacks, **settings})


class Hooks(L.Callback):
    """Runs ``on_batch(trainer, step)`` after each training batch, ``on_end(trainer)`` at the end of training, and records
    the steps that validated."""

    def __init__(self, on_batch=None, on_end=None) -> None:
        self.on_batch, self.on_end, self.validated = on_batch, on_end, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.on_batch:
            self.on_batch(trainer, trainer.global_step)

    def on_validation_end(self, trainer, pl_module) -> None:
        self.validated.append(trainer.global_step)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.on_end:
            self.on_end(trainer)


def test_validates_after_this_batch_is_lightnings_decision(tmp_path):
    said = {}
    hooks = Hooks(on_batch=lambda t, step: said.__setitem__(step, compat.validates_after_this_batch(t)))
    trainer(tmp_path, [hooks]).fit(Tiny())
    assert hooks.validated == [2, 4, 6]
    assert [step for step, yes in sorted(said.items()) if yes] == hooks.validated and len(said) == 6


def test_the_stop_flag_is_the_one_lightning_stops_on(tmp_path):
    seen = []

    def stop_at_3(t, step):
        if step == 3:
            compat.set_stop_flag(t, True)
            compat.set_stop_flag(t, False)
            seen.append(t.received_sigterm)
            compat.set_stop_flag(t, True)
            seen.append(t.received_sigterm)

    fit = trainer(tmp_path, [Hooks(on_batch=stop_at_3)])
    with pytest.raises(SIGTERMException):
        fit.fit(Tiny())
    assert seen == [False, True] and fit.global_step == 3  # stopped at the end of the step that raised it


def test_the_cluster_environment_is_the_one_the_trainer_was_given(tmp_path):
    assert isinstance(compat.cluster_environment(trainer(tmp_path, [])), ClusterEnvironment)
    slurm = SLURMEnvironment(auto_requeue=True)
    assert compat.cluster_environment(trainer(tmp_path, [], plugins=[slurm])) is slurm


def test_the_handler_put_back_after_fit_is_ours(tmp_path):
    def ours(signum, frame):
        pass

    before = signal.getsignal(signal.SIGTERM)
    try:
        trainer(tmp_path, [Hooks(on_end=lambda t: compat.restore_after_fit(t, signal.SIGTERM, ours))]).fit(Tiny())
        assert signal.getsignal(signal.SIGTERM) is ours
    finally:
        signal.signal(signal.SIGTERM, before)


def test_model_checkpoint_internals(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpts", filename="s{step}", every_n_train_steps=2, save_top_k=-1, save_last=True)
    assert compat.step_interval(checkpoint) == 2
    assert compat.step_interval(ModelCheckpoint()) is None  # no step grid (once an epoch)
    assert compat.step_interval(ModelCheckpoint(train_time_interval=timedelta(minutes=5))) is None
    seen = {}

    def at_step(t, step):  # (Lightning runs its checkpoint callbacks last: this step's own save comes after this)
        seen[step] = (compat.last_saved_step(checkpoint), compat.skips_saving(checkpoint, t))
        if step == 3:
            compat.save_top_k(checkpoint, t)
            compat.save_last(checkpoint, t)
            seen["saved 3"] = (compat.last_saved_step(checkpoint), compat.skips_saving(checkpoint, t))
        if step == 5:
            compat.mark_saved(checkpoint, 5)
            seen["marked 5"] = (compat.last_saved_step(checkpoint), compat.skips_saving(checkpoint, t))

    trainer(tmp_path, [checkpoint, Hooks(on_batch=at_step)], enable_checkpointing=True, limit_val_batches=0).fit(Tiny())
    assert seen[1] == seen[2] == (0, False) and seen[3] == (2, False)  # step 2 saved on the grid
    assert seen["saved 3"] == (3, True) and seen[4] == (3, False)  # saved by us: nothing left to save at step 3
    assert seen["marked 5"] == (5, True)
    assert torch.load(tmp_path / "ckpts" / "last.ckpt", weights_only=False)["global_step"] == 6
    assert {p.name for p in (tmp_path / "ckpts").glob("s*.ckpt")} == {"sstep=2.ckpt", "sstep=3.ckpt", "sstep=4.ckpt", "sstep=6.ckpt"}


def test_a_loggers_experiment_is_read_without_starting_it(tmp_path):
    logger = CSVLogger(tmp_path)
    assert compat.started_experiment(logger) is None
    started = logger.experiment
    assert compat.started_experiment(logger) is started
    compat.set_experiment(logger, "another")
    assert logger.experiment == "another"


def test_a_wandb_init_argument_is_left_out(tmp_path):
    pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger

    logger = WandbLogger(save_dir=str(tmp_path), offline=True)
    assert "anonymous" in logger._wandb_init  # what the function exists for: Lightning passes it
    compat.drop_wandb_init_argument(logger, "anonymous")
    assert "anonymous" not in logger._wandb_init and compat.started_experiment(logger) is None  # and nothing started


def test_the_summary_table_is_lightnings_own_from_the_columns_its_summary_gets(tmp_path):
    received = {}

    class Recording(ModelSummary):
        @staticmethod
        def summarize(summary_data, total_parameters, trainable_parameters, model_size, total_training_modes, *args, **kwargs):
            received.update(columns=summary_data, sizes=(total_parameters, trainable_parameters, model_size, total_training_modes))

    trainer(tmp_path, [Recording()], enable_model_summary=True, max_steps=1).fit(Tiny())
    assert [name for name, _ in received["columns"]][:3] == [" ", "Name", "Type"] and received["sizes"][:2] == (3, 3)
    table = compat.summary_table(received["columns"], *received["sizes"])
    assert re.search(r"^\s*0\s*\|\s*layer\s*\|\s*Linear\s*\|\s*3\s*\|", table, re.M)  # Tiny's 2 -> 1 layer
    assert re.search(r"^3\s+Total params$", table, re.M) and table.splitlines()[-1].endswith("Total Flops")


def test_a_resume_into_its_own_checkpoints_folder_gets_no_not_empty_warning(tmp_path):
    """Lightning's ModelCheckpoint warns whenever its folder holds files; ours continues its own run there (a new run
    into a run's folder is refused before it starts), so the warning would only be noise about the run itself."""
    import warnings

    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from pe_geometry.training.callbacks import StepCheckpoint

    (tmp_path / "step000002.ckpt").write_bytes(b"a checkpoint of this run")
    trainer = L.Trainer(default_root_dir=tmp_path, logger=False, enable_progress_bar=False, enable_model_summary=False)
    module = L.LightningModule()
    with warnings.catch_warnings(record=True) as lightning_says:
        warnings.simplefilter("always")
        ModelCheckpoint(dirpath=tmp_path).setup(trainer, module, "fit")
    assert any("exists and is not empty" in str(w.message) for w in lightning_says)  # the reference: Lightning warns
    with warnings.catch_warnings(record=True) as ours_says:
        warnings.simplefilter("always")
        StepCheckpoint(dirpath=tmp_path).setup(trainer, module, "fit")
    assert not any("exists and is not empty" in str(w.message) for w in ours_says)
