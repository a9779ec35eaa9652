"""The run's resolved config travels inside every checkpoint, and a resume is checked against it.

A resume rebuilds the model, PE, embedding, attention, data and optimiser settings from the
checkpoint's ``run_config``, so ``python train.py ckpt_path=<a RoPE run>/checkpoints/last.ckpt``
continues a RoPE model whatever the defaults say. A command-line override that contradicts the
checkpoint on one of those settings is one error naming every differing key, raised before anything
in the run directory is written. Everything else (``trainer.max_steps``, logger and callback
cadence, devices) may change on resume; the changes are recorded in ``config-resume-step<N>.yaml``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lightning as L
from omegaconf import DictConfig, OmegaConf, open_dict

from training.validate import ConfigError

CONFIG_GROUPS_DIR = Path(__file__).resolve().parents[1] / "configs"

# Settings that define what is being trained: a resume takes them from the checkpoint.
FIXED_ON_RESUME = (
    "model", "pe", "embedding", "attention", "data", "optimizer", "seed", "run_name",
    "trainer.precision", "trainer.accumulate_grad_batches", "trainer.gradient_clip_val",
)
# ...except these, which say where or how fast, not what.
FREE_WITHIN_FIXED = ("data.num_workers", "data.cache_dir")


def is_fixed_on_resume(key: str) -> bool:
    """``model.d_model`` -> True, ``trainer.max_steps`` -> False (dotted config keys)."""
    def under(prefixes: Iterable[str]) -> bool:
        return any(key == p or key.startswith(p + ".") for p in prefixes)

    return under(FIXED_ON_RESUME) and not under(FREE_WITHIN_FIXED)


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> ``{"model.d_model": 64, ...}``; lists stay values."""
    if isinstance(node, dict) and node:
        out: dict[str, Any] = {}
        for key, value in node.items():
            out |= flatten(value, f"{prefix}{key}.")
        return out
    return {prefix[:-1]: node}


def overridden_keys(overrides: Iterable[str]) -> set[str]:
    """The dotted keys a list of Hydra command-line overrides sets.

    ``model.d_model=64`` sets ``model.d_model``; a group choice (``pe=rope``) sets the whole ``pe``
    subtree; ``experiment=quick`` sets every key of that experiment file. ``hydra.*`` is ignored.
    """
    keys: set[str] = set()
    for override in overrides:
        key, _, value = override.partition("=")
        key = key.lstrip("~+")
        if key.startswith("hydra") or "/" in key:
            continue
        if key == "experiment" and value not in ("", "null"):
            path = CONFIG_GROUPS_DIR / "experiment" / f"{value}.yaml"
            if path.is_file():
                node = OmegaConf.to_container(OmegaConf.load(path))
                node.pop("defaults", None)
                keys |= set(flatten(node))
            continue
        keys.add(key)
    return keys


def contradictions(current: dict[str, Any], saved: dict[str, Any], overridden: set[str]) -> dict[str, tuple[Any, Any]]:
    """``{key: (saved, current)}`` for fixed-on-resume keys the user overrode to a different value."""
    flat_now, flat_saved = flatten(current), flatten(saved)
    out = {}
    for key in sorted(set(flat_now) | set(flat_saved)):
        if not is_fixed_on_resume(key) or flat_now.get(key) == flat_saved.get(key):
            continue
        if any(key == o or key.startswith(o + ".") for o in overridden):
            out[key] = (flat_saved.get(key, "<absent>"), flat_now.get(key, "<absent>"))
    return out


def saved_run_config(checkpoint: dict, ckpt_path: Path) -> dict[str, Any] | None:
    """The checkpoint's ``run_config``, else its run directory's ``config.yaml`` (older checkpoints)."""
    if isinstance(checkpoint.get("run_config"), dict):
        return checkpoint["run_config"]
    legacy = ckpt_path.parent.parent / "config.yaml"
    if ckpt_path.parent.name == "checkpoints" and legacy.is_file():
        return OmegaConf.to_container(OmegaConf.load(legacy), resolve=True)
    return None


def apply_resume_config(cfg: DictConfig, saved: dict[str, Any], overrides: Iterable[str], ckpt_path: Path) -> dict[str, tuple]:
    """Rebuild ``cfg``'s fixed settings from ``saved``; returns the free keys that changed ``{key: (old, new)}``.

    Raises ConfigError listing every fixed key the overrides contradict.
    """
    current = OmegaConf.to_container(cfg, resolve=True)
    bad = contradictions(current, saved, overridden_keys(overrides))
    if bad:
        listed = "; ".join(f"{k}: checkpoint {old!r}, command line {new!r}" for k, (old, new) in bad.items())
        raise ConfigError(
            f"ckpt_path={ckpt_path} was trained with other settings ({listed}). A resume keeps "
            f"{', '.join(FIXED_ON_RESUME)} from the checkpoint (it may change {', '.join(FREE_WITHIN_FIXED)}, trainer.max_steps, "
            "logger, callbacks, paths and devices); drop those overrides, or start a new run without ckpt_path"
        )
    with open_dict(cfg):
        for top in ("model", "pe", "embedding", "attention", "data", "optimizer", "seed", "run_name"):
            if top in saved:
                free = {k: OmegaConf.select(cfg, k) for k in FREE_WITHIN_FIXED if k.startswith(top + ".")}
                cfg[top] = saved[top]
                for key, value in free.items():
                    OmegaConf.update(cfg, key, value, force_add=True)
        for key in ("precision", "accumulate_grad_batches", "gradient_clip_val"):
            if key in saved.get("trainer", {}):
                cfg.trainer[key] = saved["trainer"][key]
    flat_now, flat_saved = flatten(OmegaConf.to_container(cfg, resolve=True)), flatten(saved)
    return {
        k: (flat_saved.get(k), flat_now.get(k))
        for k in sorted(set(flat_now) | set(flat_saved))
        if flat_now.get(k) != flat_saved.get(k) and k not in ("ckpt_path", "paths.output_dir")
    }


class RunConfigInCheckpoint(L.Callback):
    """Puts the run's resolved config (``checkpoint["run_config"]``) and its W&B run id in every checkpoint."""

    def __init__(self, run_config: dict[str, Any]) -> None:
        self.run_config = run_config

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        checkpoint["run_config"] = self.run_config
        from training.wandb_run import wandb_loggers  # a light import; wandb itself is only touched if used

        for logger in wandb_loggers(trainer.loggers):
            checkpoint["wandb_run_id"] = logger.version
