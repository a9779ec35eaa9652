"""Checks of a composed config, run before anything is built or trained.

Each problem raises ``ConfigError`` with one line that names the bad value and
what would be valid; ``train.py`` prints it and exits.
"""

from __future__ import annotations

import inspect
import logging
import math

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
    accepted = [name for name in inspect.signature(pe_class.__init__).parameters if name not in ("self", "d_model", "n_heads")]
    unknown = sorted(set(settings) - set(accepted))
    if unknown:  # e.g. control=mixed_init (pe.init) with pe=rope given on the command line
        raise ConfigError(f"pe={_option('pe', pe)} has no setting {', '.join('pe.' + k for k in unknown)}; valid: {accepted}")
    try:
        pe_class.check_settings(int(cfg.model.d_model), int(cfg.model.n_heads), int(cfg.data.seq_len), **settings)
    except ValueError as err:
        raise ConfigError(f"pe={_option('pe', pe)}: {err}") from None


MAX_SEED = 2**32 - 1  # numpy's seed range, which seed_everything enforces


def _number(cfg: DictConfig, key: str, kind: type, what: str) -> int | float:
    """``cfg.<key>`` as an int or float, or one line naming the key, its value and what it must be."""
    value = cfg
    for part in key.split("."):
        value = value.get(part) if value is not None else None
    try:
        if isinstance(value, bool) or value is None:
            raise TypeError
        number = kind(value)
        if kind is int and number != float(value):
            raise ValueError
    except (TypeError, ValueError):
        raise ConfigError(f"{key}={value} must be {what}") from None
    return number


def check_run_settings(cfg: DictConfig) -> None:
    """Seed, optimiser, trainer and callback values that would otherwise fail deep inside Lightning or numpy."""
    seed = _number(cfg, "seed", int, f"an integer in [0, {MAX_SEED}]")
    if not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"seed={seed} must be an integer in [0, {MAX_SEED}]")
    if cfg.trainer.get("max_steps") is None:
        raise ConfigError("trainer.max_steps=null: give a positive number of steps (the learning-rate schedule decays over it)")
    max_steps = _number(cfg, "trainer.max_steps", int, "a positive number of steps")
    if max_steps <= 0:
        raise ConfigError(f"trainer.max_steps={max_steps} must be a positive number of steps")
    lr = _number(cfg, "optimizer.lr", float, "a positive number")
    if not math.isfinite(lr) or lr <= 0:
        raise ConfigError(f"optimizer.lr={cfg.optimizer.lr} must be positive and finite")
    interval = cfg.trainer.get("val_check_interval")
    if interval is not None:
        valid = "a positive number of steps or a fraction of an epoch in (0, 1]"
        value = _number(cfg, "trainer.val_check_interval", float, valid)
        if value <= 0 or (value != int(value) and value > 1):
            raise ConfigError(f"trainer.val_check_interval={interval} must be {valid}")
    if _number(cfg, "trainer.accumulate_grad_batches", int, "an integer >= 1") < 1:
        raise ConfigError(f"trainer.accumulate_grad_batches={cfg.trainer.accumulate_grad_batches} must be an integer >= 1")
    geometry = (cfg.get("callbacks") or {}).get("geometry")
    if geometry is not None:
        for key in ("n_tokens", "every_n_steps", "probe_batch_size"):
            if key in geometry and _number(cfg, f"callbacks.geometry.{key}", int, "an integer >= 1") < 1:
                raise ConfigError(f"callbacks.geometry.{key}={geometry[key]} must be an integer >= 1")
    fraction = cfg.data.get("corpus", {}).get("val_fraction")
    if fraction is not None:
        value = _number(cfg, "data.corpus.val_fraction", float, "a fraction in (0, 1)")
        if not 0 < value < 1:
            raise ConfigError(f"data.corpus.val_fraction={fraction} must be a fraction in (0, 1) of the training documents")


def check_config(cfg: DictConfig) -> None:
    for line in renamed_options():
        log.warning(line)
    for key in ("model.d_model", "model.n_heads", "model.n_layers", "data.seq_len", "data.batch_size", "data.vocab_size"):
        _number(cfg, key, int, "an integer")
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
    check_run_settings(cfg)
