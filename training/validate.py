"""Checks of a composed config, run before anything is built or trained.

Each problem raises ``ConfigError`` with one line that names the bad value and
what would be valid; ``train.py`` prints it and exits.
"""

from __future__ import annotations

import logging

from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_class
from omegaconf import DictConfig

from data.tokenizer import check_tokenizer_settings

log = logging.getLogger(__name__)
# Options renamed so their names explain themselves; the old names are kept as aliases (configs/<group>/<old>.yaml).
RENAMED_OPTIONS = {("embedding", "learned"): "plain", ("attention", "mha"): "explicit"}


class ConfigError(ValueError):
    """A config value that cannot work."""


def renamed_options() -> list[str]:
    """One line per group option given by its old name, naming the new one."""
    try:
        choices = HydraConfig.get().runtime.choices
    except ValueError:  # composed outside Hydra's run context
        return []
    return [f"{group}={old} is deprecated, use {group}={new} (the same settings)"
            for (group, old), new in RENAMED_OPTIONS.items() if choices.get(group) == old]


def _option(group: str, node: DictConfig) -> str:
    """The option name a config group was given (pe=rope), else its _target_'s class name."""
    try:
        return str(HydraConfig.get().runtime.choices[group])
    except (ValueError, KeyError):  # composed outside Hydra's run context
        return str(node.get("_target_", "")).rsplit(".", 1)[-1]


def check_positional_encoding(cfg: DictConfig) -> None:
    """Ask the encoding named by ``pe._target_`` whether it can work with the model and data sizes."""
    pe = cfg.pe
    try:
        pe_class = get_class(str(pe._target_))
    except Exception as err:  # Hydra raises ImportError or ValueError wrapped in its own types
        raise ConfigError(f"pe._target_={pe.get('_target_')!r} cannot be imported ({type(err).__name__})") from None
    settings = {k: v for k, v in pe.items() if not str(k).startswith("_")}
    try:
        pe_class.check_settings(int(cfg.model.d_model), int(cfg.model.n_heads), int(cfg.data.seq_len), **settings)
    except ValueError as err:
        raise ConfigError(f"pe={_option('pe', pe)}: {err}") from None


def check_config(cfg: DictConfig) -> None:
    for line in renamed_options():
        log.warning(line)
    m, data = cfg.model, cfg.data
    d_model, n_heads = int(m.d_model), int(m.n_heads)
    if d_model <= 0 or n_heads <= 0 or int(m.n_layers) <= 0:
        raise ConfigError(f"model sizes must be positive: d_model={d_model}, n_heads={n_heads}, n_layers={m.n_layers}")
    if d_model % n_heads:
        divisors = [h for h in range(1, min(d_model, 64) + 1) if d_model % h == 0]
        raise ConfigError(f"model.d_model={d_model} is not divisible by model.n_heads={n_heads}; valid n_heads: {divisors}")
    check_positional_encoding(cfg)
    if m.get("norm", "pre") not in ("pre", "post"):
        raise ConfigError(f"model.norm={m.norm!r}; valid: ['pre', 'post']")
    if int(data.seq_len) < 2 or int(data.batch_size) < 1:
        raise ConfigError(f"data.seq_len={data.seq_len} must be >= 2 and data.batch_size={data.batch_size} >= 1")
    try:
        check_tokenizer_settings(data.tokenizer, int(data.vocab_size))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if cfg.trainer.get("max_steps", -1) is not None and int(cfg.trainer.max_steps) <= 0:
        raise ConfigError(f"trainer.max_steps={cfg.trainer.max_steps} must be a positive number of steps")
    if float(cfg.optimizer.lr) <= 0:
        raise ConfigError(f"optimizer.lr={cfg.optimizer.lr} must be positive")
