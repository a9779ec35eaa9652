"""Build a run's parts from its config, and load a trained run back: the one way every consumer does it.

Training builds the datamodule and the model with ``build_datamodule`` and ``build_model``. Everything
that reads a finished run (``pe-generate``, length extrapolation, the verdict) calls ``load_trained_run``,
which rebuilds them the same way from the run's resolved config and loads the checkpoint's weights:

    run = load_trained_run("outputs/<day>/<run>")      # or the checkpoint file itself
    run.model, run.tokenizer, run.config, run.step

The config is the one stored in the checkpoint (``run_config``), else the ``config.yaml`` of the run folder
the checkpoint sits in. Configs written before the package was namespaced still load (their ``_target_``s
say ``model.RotaryPE``), and a relative ``data.cache_dir`` resolves against the working directory, as it
did for the run. Every problem is one ``RunLoadError`` line naming the file.
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

from pe_geometry.configs import with_current_targets
from pe_geometry.model.transformer import LanguageModel
from pe_geometry.training.validate import ConfigError

LAST_CHECKPOINT = Path("checkpoints") / "last.ckpt"
WEIGHTS_PREFIX = "model."  # LanguageModelTask keeps the network as ``self.model``
# Data settings that change how batches are served, not which tokens or tokenizer: runs differing only
# in these share one rebuilt datamodule.
SERVING_KEYS = ("seed", "batch_size", "num_workers")


class RunLoadError(ConfigError):
    """A run or checkpoint that cannot be loaded; the message is one line naming the file and why."""


# -- building from a config --------------------------------------------------------------------------
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
    facts = {"vocab_size": datamodule.vocab_size, "mask_token_id": datamodule.mask_token_id}
    wanted = inspect.signature(get_class(cfg.model._target_)).parameters
    return instantiate(
        cfg.model,
        pe=instantiate(cfg.pe),
        embedding=instantiate(cfg.embedding),
        attention=instantiate(cfg.attention),
        **{k: v for k, v in facts.items() if k in wanted},
    )


# -- reading a saved run -----------------------------------------------------------------------------
def read_checkpoint_file(path: Path, required: tuple[str, ...] = ("state_dict",)) -> dict:
    """The checkpoint at ``path`` (on the CPU), read once; a truncated or foreign file, or one without the
    ``required`` entries, is one error line instead of a traceback from deep inside torch."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)  # ours carry numpy RNG states
        for key in required:
            checkpoint[key]  # noqa: B018 - raises KeyError when missing
    except Exception as err:
        raise RunLoadError(f"ckpt_path={path} is not a readable Lightning checkpoint ({type(err).__name__}: {err})") from None
    return checkpoint




def saved_config(checkpoint: dict, ckpt_path: Path) -> DictConfig:
    """The run's resolved config: the checkpoint's ``run_config``, else ``<run>/config.yaml`` beside ``checkpoints/``.

    ``_target_``s are spelled as this version does, and a relative ``data.cache_dir`` (older runs) is made
    absolute against the working directory: the runs were started with ``hydra.job.chdir=false``.
    """
    stored = checkpoint.get("run_config")
    if stored is None:
        config_file = ckpt_path.parent.parent / "config.yaml"
        if not config_file.is_file():
            raise RunLoadError(f"ckpt_path={ckpt_path}: the checkpoint has no run_config and there is no {config_file}")
        stored = OmegaConf.to_container(OmegaConf.load(config_file), resolve=True)
    cfg = OmegaConf.create(with_current_targets(OmegaConf.to_container(OmegaConf.create(stored), resolve=True)))
    cache_dir = cfg.get("data", {}).get("cache_dir")
    if cache_dir is not None and not Path(cache_dir).is_absolute():
        with open_dict(cfg):
            cfg.data.cache_dir = str(Path(cache_dir).absolute())
    return cfg


def load_weights(model: LanguageModel, checkpoint: dict, ckpt_path: Path) -> None:
    """The network's weights from a LanguageModelTask checkpoint into ``model`` (every key must match)."""
    weights = {k.removeprefix(WEIGHTS_PREFIX): v for k, v in checkpoint["state_dict"].items() if k.startswith(WEIGHTS_PREFIX)}
    head = weights.get("head.weight")
    if head is not None and head.shape[0] != model.vocab_size:  # a cache rebuilt with another tokenizer
        raise RunLoadError(f"{ckpt_path}: the rebuilt tokenizer has {model.vocab_size} tokens, the run had {head.shape[0]}")
    model.load_state_dict(weights)


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint file as given, or a run folder's ``checkpoints/last.ckpt``."""
    path = Path(path).expanduser()
    if path.is_dir():
        ckpt = path / LAST_CHECKPOINT
        if not ckpt.is_file():
            raise RunLoadError(f"{path}: no checkpoint {ckpt}")
        return ckpt
    if not path.is_file():
        raise RunLoadError(f"ckpt_path={path}: no checkpoint file there")
    return path


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

    A run trained before ``pe.training_length`` existed gets its ``data.seq_len``. Keys and values are checked as a
    training config's are (``pe.scaling`` on a learned table is refused, naming the valid keys)."""
    from pe_geometry.training.schema import check_node

    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    if not given:
        return
    node = {**OmegaConf.to_container(cfg.pe, resolve=True), **given}
    accepted = inspect.signature(get_class(str(node["_target_"]))).parameters
    if "training_length" in accepted and node.get("training_length") is None:
        node["training_length"] = int(cfg.data.seq_len)
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
    cfg = saved_config(checkpoint, ckpt)
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
        checkpoint_path=ckpt, choices=dict(checkpoint.get("group_choices") or {}),
    )
