"""Checks of a composed config, run before anything is built or trained.

Each problem raises ``ConfigError`` with one line that names the bad value and
what would be valid; ``train.py`` prints it and exits.
"""

from __future__ import annotations

from omegaconf import DictConfig

from data.tokenizer import check_tokenizer_settings


class ConfigError(ValueError):
    """A config value that cannot work."""


def _target_name(node: DictConfig) -> str:
    return str(node.get("_target_", "")).rsplit(".", 1)[-1]


def check_config(cfg: DictConfig) -> None:
    m, pe, data = cfg.model, cfg.pe, cfg.data
    d_model, n_heads = int(m.d_model), int(m.n_heads)
    if d_model <= 0 or n_heads <= 0 or int(m.n_layers) <= 0:
        raise ConfigError(f"model sizes must be positive: d_model={d_model}, n_heads={n_heads}, n_layers={m.n_layers}")
    if d_model % n_heads:
        divisors = [h for h in range(1, min(d_model, 64) + 1) if d_model % h == 0]
        raise ConfigError(f"model.d_model={d_model} is not divisible by model.n_heads={n_heads}; valid n_heads: {divisors}")
    kind = _target_name(pe)
    if kind == "SinusoidalPE" and d_model % 2:
        raise ConfigError(f"pe=sinusoidal needs an even model.d_model (sin/cos pairs), got {d_model}")
    if kind == "RotaryPE" and (d_model // n_heads) % 2:
        raise ConfigError(
            f"pe=rope needs an even head dimension, got model.d_model/model.n_heads = {d_model}/{n_heads} = {d_model // n_heads}"
        )
    if kind == "LearnedPE" and int(data.seq_len) > int(pe.max_len):
        raise ConfigError(
            f"data.seq_len={data.seq_len} is longer than the learned position table (pe.max_len={pe.max_len}); "
            "raise pe.max_len or shorten data.seq_len"
        )
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
