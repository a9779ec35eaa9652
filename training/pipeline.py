"""Build everything a config names and train it. ``train.py`` is a thin Hydra wrapper around ``train``."""

from __future__ import annotations

import inspect
import json
import logging
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")  # a logger.wandb.offline=false run still goes online
os.environ.setdefault("WANDB_SILENT", "true")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from hydra.utils import get_class, instantiate  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from training.task import LanguageModelTask  # noqa: E402
from training.validate import check_config  # noqa: E402

log = logging.getLogger(__name__)
PACKAGES = ("torch", "lightning", "hydra-core", "datasets", "tokenizers", "wandb", "numpy")


def build_model(cfg: DictConfig, datamodule) -> torch.nn.Module:
    """Instantiate the model from its group configs plus the facts only the data knows."""
    facts = {"vocab_size": datamodule.vocab_size, "mask_token_id": datamodule.mask_token_id}
    wanted = inspect.signature(get_class(cfg.model._target_)).parameters
    return instantiate(
        cfg.model,
        pe=instantiate(cfg.pe),
        embedding=instantiate(cfg.embedding),
        attention=instantiate(cfg.attention),
        **{k: v for k, v in facts.items() if k in wanted},
    )


def _instantiate_all(group: DictConfig | None) -> list:
    return [instantiate(node) for node in (group or {}).values() if node is not None and "_target_" in node]


def _git_commit() -> str | None:
    try:
        root = Path(__file__).resolve().parents[1]
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except OSError:
        return None


def write_run_info(cfg: DictConfig, output_dir: Path, datamodule, model: torch.nn.Module) -> None:
    """Resolved config, package versions, git commit and data facts, saved beside the run."""
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    info = {
        "git_commit": _git_commit(),
        "python": platform.python_version(),
        "packages": versions,
        "vocab_size": datamodule.vocab_size,
        "tokens": {split: datamodule.n_tokens(split) for split in datamodule.streams},
        "n_parameters": sum(p.numel() for p in model.parameters()),
    }
    (output_dir / "run_info.json").write_text(json.dumps(info, indent=2))


def train(cfg: DictConfig) -> dict[str, float]:
    """Check the config, build data/model/trainer, fit; returns the final logged metrics."""
    check_config(cfg)
    output_dir = Path(cfg.paths.output_dir)
    L.seed_everything(cfg.seed, workers=True, verbose=False)

    datamodule = instantiate(cfg.data)
    datamodule.prepare_data()
    datamodule.setup("fit")
    model = build_model(cfg, datamodule)
    if cfg.compile:
        model.compile()
    task = LanguageModelTask(model, max_steps=cfg.trainer.max_steps, **cfg.optimizer)

    trainer: L.Trainer = instantiate(cfg.trainer, callbacks=_instantiate_all(cfg.callbacks), logger=_instantiate_all(cfg.logger) or False)
    if trainer.is_global_zero:
        write_run_info(cfg, output_dir, datamodule, model)
    log.info(
        "%s: %s + %s, %d parameters, vocab %d, %d training tokens",
        cfg.run_name, type(model).__name__, cfg.pe._target_.rsplit(".", 1)[-1],
        sum(p.numel() for p in model.parameters()), datamodule.vocab_size, datamodule.n_tokens("train"),
    )
    trainer.fit(task, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    log.info("finished: %s; outputs in %s", {k: round(v, 4) for k, v in metrics.items()}, output_dir)
    return metrics
