"""Build a run's parts from its config, and load a trained run back: the one way every consumer does it.

Training builds the datamodule and the model with ``build_datamodule`` and ``build_model``. Everything
that reads a finished run (``pe-generate``, length extrapolation, the verdict) calls ``load_trained_run``,
which rebuilds them the same way from the run's resolved config and loads the checkpoint's weights:

    run = load_trained_run("outputs/<day>/<run>")      # or the checkpoint file itself
    run.model, run.tokenizer, run.config, run.step

The config is the one stored in the checkpoint (``run_config``; ``training.checkpoint_io`` finds the checkpoint and
reads it, as for a resume). Every problem is one ``RunLoadError`` line naming the file.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from pe_geometry.model.transformer import LanguageModel
from pe_geometry.training.checkpoint_io import RunLoadError, find_checkpoint, read_checkpoint_file, saved_config, saved_group_choices
from pe_geometry.training.validate import ConfigError

WEIGHTS_PREFIX = "model."  # LanguageModelTask keeps the network as ``self.model``
# Data settings that change how batches are served, not which tokens or tokenizer: runs differing only
# in these share one rebuilt datamodule.
SERVING_KEYS = ("seed", "batch_size", "num_workers")


# -- building from a config --------------------------------------------------------------------------
def accepted_kwargs(target: str, **candidates: Any) -> dict[str, Any]:
    """Those of ``candidates`` that the class (or function) a ``_target_`` names declares as parameters: facts only
    the run knows (the vocabulary, a resume's step), passed to the components that ask for them."""
    wanted = inspect.signature(get_class(str(target))).parameters
    return {k: v for k, v in candidates.items() if k in wanted}


def build_datamodule(cfg: DictConfig) -> L.LightningDataModule:
    """``instantiate(cfg.data)``, then ``prepare_data()`` and ``setup("fit")``: token streams ready to read."""
    datamodule = instantiate(cfg.data)
    if not isinstance(datamodule, L.LightningDataModule):
        raise ConfigError(f"data._target_={cfg.data._target_} did not build a LightningDataModule")
    datamodule.prepare_data()
    datamodule.setup("fit")
    return datamodule


def build_model(cfg: DictConfig, datamodule: Any) -> LanguageModel:
    """Instantiate the model from its group configs plus the facts only the data knows (vocabulary, mask id)."""
    return instantiate(
        cfg.model,
        pe=instantiate(cfg.pe),
        embedding=instantiate(cfg.embedding),
        attention=instantiate(cfg.attention),
        **accepted_kwargs(cfg.model._target_, vocab_size=datamodule.vocab_size, mask_token_id=datamodule.mask_token_id),
    )


# -- reading a saved run -----------------------------------------------------------------------------
def load_weights(model: LanguageModel, checkpoint: dict, ckpt_path: Path) -> None:
    """The network's weights from a LanguageModelTask checkpoint into ``model`` (every key must match)."""
    weights = {k.removeprefix(WEIGHTS_PREFIX): v for k, v in checkpoint["state_dict"].items() if k.startswith(WEIGHTS_PREFIX)}
    head = weights.get("head.weight")
    if head is not None and head.shape[0] != model.vocab_size:  # a cache rebuilt with another tokenizer
        raise RunLoadError(f"{ckpt_path}: the rebuilt tokenizer has {model.vocab_size} tokens, the run had {head.shape[0]}")
    model.load_state_dict(weights)


def data_key(cfg: DictConfig) -> str:
    """What identifies a run's rebuilt data: its data config without ``SERVING_KEYS``."""
    return OmegaConf.to_yaml({k: v for k, v in cfg.data.items() if k not in SERVING_KEYS})


@dataclass
class TrainedRun:
    """A trained run rebuilt from its checkpoint: the model (eval mode, on ``device``) and what it was trained on."""

    config: DictConfig
    datamodule: L.LightningDataModule
    model: LanguageModel
    step: int  # the checkpoint's global step (-1 if it has none)
    checkpoint_path: Path
    choices: dict[str, Any] = field(default_factory=dict)  # the run's group options (pe=rope, ...), if recorded

    @property
    def tokenizer(self) -> Any:
        return self.datamodule.tokenizer


def apply_pe_overrides(cfg: DictConfig, overrides: dict[str, Any] | None, ckpt_path: Path) -> None:
    """Set the run's ``pe`` keys named in ``overrides`` (None values: as trained), e.g. RoPE scaled at inference
    (``{"scaling": "yarn", "scaling_factor": 4}``): settings that change no weight, so the checkpoint still loads.

    Keys and values are checked as a training config's are (``pe.scaling`` on a learned table is refused, naming the
    valid keys)."""
    from pe_geometry.training.schema import check_node

    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    if not given:
        return
    node = {**OmegaConf.to_container(cfg.pe, resolve=True), **given}
    problems, _ = check_node("pe", node)
    if problems:
        raise RunLoadError(f"{ckpt_path}: " + "; ".join(line for _, line in problems))
    settings = {k: v for k, v in node.items() if not str(k).startswith("_")}
    try:
        get_class(str(node["_target_"])).check_settings(int(cfg.model.d_model), int(cfg.model.n_heads), int(cfg.data.seq_len),
                                                        **settings)
    except ValueError as err:
        raise RunLoadError(f"{ckpt_path}: {err}") from None
    with open_dict(cfg):
        cfg.pe = node


def load_trained_run(path: str | Path, device: str | torch.device = "cpu",
             datamodules: dict[str, L.LightningDataModule] | None = None, pe_overrides: dict[str, Any] | None = None) -> TrainedRun:
    """Rebuild a trained run from a checkpoint file or a run folder (its ``checkpoints/last.ckpt``).

    The datamodule (and its tokenizer) comes from the data cache the run used, rebuilt identically if it is
    gone. ``datamodules``: a dict shared across calls, so runs on the same data (a sweep's) build it once.
    ``pe_overrides``: ``pe`` settings to read the run with instead of its own (``apply_pe_overrides``; RoPE's
    ``scaling`` for a run trained without it).
    """
    ckpt = find_checkpoint(path)
    checkpoint = read_checkpoint_file(ckpt)
    saved = saved_config(checkpoint)
    if saved is None:
        raise RunLoadError(f"ckpt_path={ckpt}: the checkpoint has no run_config (it was not written by pe-train)")
    cfg = OmegaConf.create(saved)
    apply_pe_overrides(cfg, pe_overrides, ckpt)
    if datamodules is None:
        datamodule = build_datamodule(cfg)
    else:
        key = data_key(cfg)
        if key not in datamodules:
            datamodules[key] = build_datamodule(cfg)
        datamodule = datamodules[key]
    model = build_model(cfg, datamodule)
    load_weights(model, checkpoint, ckpt)
    return TrainedRun(
        config=cfg, datamodule=datamodule, model=model.to(device).eval(), step=int(checkpoint.get("global_step", -1)),
        checkpoint_path=ckpt, choices=dict(saved_group_choices(checkpoint) or {}),
    )
