"""Build a run's datamodule from its config, the same way for training, evaluation and benchmarks."""

from __future__ import annotations

import lightning as L
from hydra.utils import instantiate
from omegaconf import DictConfig

from pe_geometry.training.validate import ConfigError


def build_datamodule(cfg: DictConfig) -> L.LightningDataModule:
    """``instantiate(cfg.data)``, then ``prepare_data()`` and ``setup("fit")``: token streams ready to read."""
    datamodule = instantiate(cfg.data)
    if not isinstance(datamodule, L.LightningDataModule):
        raise ConfigError(f"data._target_={cfg.data._target_} did not build a LightningDataModule")
    datamodule.prepare_data()
    datamodule.setup("fit")
    return datamodule
