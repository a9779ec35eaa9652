"""Checks of a composed config, run before anything is built or trained.

Each problem raises ``ConfigError`` with one line that names the bad value and what would be valid; ``train.py``
prints it and exits. Every check of a value reads the components' settings dataclasses (``pe_geometry.settings``,
torch-free), so ``check_config(cfg, import_classes=False)`` answers a bad value, cross-key ones included
(``model.d_model=33`` with 4 heads, a learned table shorter than ``data.seq_len``), before torch and Lightning load.
What needs the imported classes runs in the full check: a class without registered settings (read from its
constructor), the warnings of settings that work but do not fit, the parts a peer model refuses, the devices.
"""

from __future__ import annotations

import logging
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from pe_geometry.settings import Settings, SettingsError, Sizes, settings_of
from pe_geometry.settings.data import DataSettings
from pe_geometry.settings.model import layer_schemes
from pe_geometry.settings.positional import EncodingSettings, attention_families
from pe_geometry.training.schema import SchemaError, check_node, check_schema

log = logging.getLogger(__name__)


class ConfigError(SchemaError):
    """A config value that cannot work."""


def _choices() -> dict:
    """The group options the run was composed from (pe=rope, ...), to name them in errors."""
    try:
        return dict(HydraConfig.get().runtime.choices)
    except ValueError:  # composed outside Hydra's run context
        return {}


def _option(group: str, node: DictConfig) -> str:
    """The option name a config group was given (pe=rope), else its _target_'s class name."""
    return str(_choices().get(group) or str(node.get("_target_", "")).rsplit(".", 1)[-1])


def _own(node: Any) -> dict[str, Any]:
    """A node's settings: its keys without Hydra's (``_target_``, ``_partial_``) and without nested components."""
    values = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node)
    return {k: v for k, v in values.items() if not str(k).startswith("_") and not (isinstance(v, dict) and "_target_" in v)}


def _settings(node: Any, **changes: Any) -> Settings | None:
    """The node's settings dataclass, built from its keys (the schema has checked them), or None for a class without
    registered settings (a user's)."""
    if node is None or "_target_" not in node:
        return None
    cls = settings_of(str(node._target_))
    return None if cls is None else cls(**{**_own(node), **changes})


def _sizes(cfg: DictConfig) -> Sizes:
    return Sizes(int(cfg.model.d_model), int(cfg.model.n_heads), int(cfg.data.seq_len))


def _objective(cfg: DictConfig) -> str:
    """What the model is trained on (its settings' ``objective``: next-token, masked-lm, seq2seq)."""
    settings = settings_of(str(cfg.model._target_))
    return settings.objective if settings is not None else getattr(get_class(str(cfg.model._target_)), "objective", "")


def _warn(group: str, node: DictConfig, lines: list[str]) -> None:
    for line in lines:  # works, but does not fit the run
        log.warning("%s=%s: %s", group, _option(group, node), line)


def check_positional_encoding(cfg: DictConfig, import_classes: bool = True) -> None:
    """Ask the encoding's settings whether they work with the model and data sizes (and, for an encoding of causal
    stacks only, with the model's layout); with the classes imported, warn where they work but do not fit."""
    try:
        settings = _settings(cfg.pe)
        if isinstance(settings, EncodingSettings):
            settings.check(_sizes(cfg))
            # a decoder's stacks are all causal; an encoder (-decoder) has a bidirectional one
            settings.check_causal(_objective(cfg) == "next-token")
    except SettingsError as err:
        raise ConfigError(f"pe={_option('pe', cfg.pe)}: {err}") from None
    if import_classes and settings is not None:
        precision = str(cfg.get("trainer", {}).get("precision", "32-true"))
        sizes = _sizes(cfg)
        pe_class = get_class(str(cfg.pe._target_))  # (T5's warning counts buckets with the model's own code)
        _warn("pe", cfg.pe, pe_class.settings_warnings(sizes.d_model, sizes.n_heads, sizes.seq_len, precision, **_own(cfg.pe)))


def check_attention(cfg: DictConfig, import_classes: bool = True) -> None:
    """Ask the attention's settings whether they work with the model's sizes (``n_kv_heads`` must divide
    ``n_heads``); warn where they do not fit. A user's own attention class without settings is taken as it is."""
    attention = cfg.get("attention")
    try:
        settings = _settings(attention)
        if settings is not None:
            settings.check(_sizes(cfg))
    except SettingsError as err:
        raise ConfigError(str(err)) from None
    if import_classes and settings is not None:
        _warn("attention", attention, settings.warnings(_sizes(cfg), str(cfg.get("trainer", {}).get("precision", "32-true"))))


def check_layer_pattern(cfg: DictConfig) -> None:
    """``model.layer_pattern``: each entry's pe settings known to the model's encoding family and workable with the
    sizes, its window accepted by the attention, and no per-layer encoding beside an encoding that adds its term to the
    input (it is added once, before every layer). The entries themselves were read by the model's settings."""
    pattern = cfg.model.get("layer_pattern")
    if pattern is None:
        return
    try:
        schemes = layer_schemes(pattern, int(cfg.model.n_layers))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    pe_settings = settings_of(str(cfg.pe._target_))
    for scheme in {s.entry: s for s in schemes}.values():
        where = f"model.layer_pattern[{scheme.entry}]"
        if scheme.pe is not None and pe_settings is not None and pe_settings.adds_to_input:
            raise ConfigError(f"{where}.pe={scheme.pe!r}: pe={_option('pe', cfg.pe)} adds its term to the input, once "
                              "for every layer; a layer pattern sets encodings that act inside attention "
                              f"({', '.join(attention_families())})")
        if isinstance(scheme.pe, dict):  # the schema's own check (keys, types, ranges) on the layer's settings
            node = {"_target_": str(cfg.pe._target_), **_own(cfg.pe), **scheme.pe}
            lines, _ = check_node("pe", node, _option("pe", cfg.pe), rules=False)  # its rules: below, naming the entry
            if lines:
                raise ConfigError("; ".join(line.replace("pe.", f"{where}.pe.", 1) for _, line in lines))
            try:
                layer = _settings(cfg.pe, **scheme.pe)
                if layer is not None:
                    layer.check(_sizes(cfg))
            except SettingsError as err:
                raise ConfigError(f"{where}.pe: {err}") from None
        attention = cfg.get("attention")
        if scheme.window != "inherit" and attention is not None and "_target_" in attention:
            try:
                _settings(attention, window=scheme.window)
            except SettingsError as err:
                raise ConfigError(f"{where}.window: {err}") from None


def check_model_parts(cfg: DictConfig) -> None:
    """A model that builds its own parts (model=xtransformers: x-transformers' modules) says which choices of the other
    groups it cannot honour (``check_parts``: our pe beside its own, an attention variant it would ignore), and such a
    model has none of the hook points the geometry recorder reads."""
    model_class = get_class(str(cfg.model._target_))
    check = getattr(model_class, "check_parts", None)  # (a model of ours builds every part it is given)
    if check is None:
        return

    def part(group: str) -> tuple[type, dict] | None:
        node = cfg.get(group)
        if node is None or "_target_" not in node:
            return None
        return get_class(str(node._target_)), _own(node)

    pe = part("pe")
    try:
        check(pe[0] if pe else None, part("embedding"), part("attention"), pe_option=_option("pe", cfg.pe) if pe else None)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    geometry = (cfg.get("callbacks") or {}).get("geometry")
    if geometry is not None and "_target_" in geometry:
        raise ConfigError(f"model={_option('model', cfg.model)}: the geometry recorder reads our models' embedding and "
                          f"attention hook points, which the modules of {getattr(model_class, 'peer', 'this model')} do "
                          "not have; use callbacks=no_geometry")


def check_data(cfg: DictConfig) -> None:
    """The data settings' rule about the model (data=task: the model is a decoder); the rest of the data's rules (the
    tokenizer's vocabulary, the task fits ``data.seq_len``) are its settings' own, run by the schema."""
    settings = _settings(cfg.data)
    try:
        if isinstance(settings, DataSettings):
            settings.check_objective(_objective(cfg))
    except SettingsError as err:
        raise ConfigError(str(err)) from None


def check_callbacks(cfg: DictConfig) -> None:
    """Each callback's settings against the model's sizes (``callbacks.geometry.fixed_k`` at most ``model.d_model``)."""
    for node in (cfg.get("callbacks") or {}).values():
        if node is None or "_target_" not in node:
            continue
        try:
            settings = _settings(node)
            if settings is not None:
                settings.check(_sizes(cfg))
        except SettingsError as err:
            raise ConfigError(str(err)) from None


def check_run_settings(cfg: DictConfig) -> None:
    """Checks that need more than one key: beyond what the schema's types and ranges say."""
    interval = cfg.trainer.get("val_check_interval")
    if isinstance(interval, float) and interval > 1:  # Lightning reads a float as a fraction of an epoch
        raise ConfigError(f"trainer.val_check_interval={interval} must be a positive number of steps or a fraction of an epoch in (0, 1]")
    limit = cfg.trainer.get("limit_val_batches")
    if isinstance(limit, float) and limit > 1:  # Lightning reads a float as a fraction of the validation set
        raise ConfigError(f"trainer.limit_val_batches={limit} must be a number of batches >= 0 or a fraction in [0, 1]")


def check_devices(cfg: DictConfig) -> None:
    """The accelerator the trainer asks for is on this machine (asks torch)."""
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    if accelerator in ("gpu", "cuda") and not torch_cuda_available():
        if _choices().get("trainer") == "gpu":
            raise ConfigError("trainer=gpu: torch sees no CUDA GPU here (trainer.accelerator=gpu); valid on this machine: trainer=default")
        raise ConfigError(f"trainer.accelerator={accelerator}: torch sees no CUDA GPU here; valid on this machine: ['cpu', 'auto']")
    if accelerator == "mps" and not torch_mps_available():
        raise ConfigError("trainer.accelerator=mps: no Apple GPU (MPS) is available here; valid on this machine: ['cpu', 'auto']")


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def torch_mps_available() -> bool:
    import torch

    return bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_available()


def check_config(cfg: DictConfig, import_classes: bool = True) -> None:
    """The schema (every key typed and ranged, unknown keys refused, each component's own rules), then the checks
    across components. ``import_classes=False``: only what the settings dataclasses say (no torch, no Lightning)."""
    try:
        check_schema(cfg, _choices(), import_classes=import_classes)
    except SchemaError as err:
        raise ConfigError(str(err)) from None
    check_positional_encoding(cfg, import_classes)
    check_attention(cfg, import_classes)
    check_layer_pattern(cfg)
    check_data(cfg)
    check_callbacks(cfg)
    check_run_settings(cfg)
    if import_classes:
        check_model_parts(cfg)
        check_devices(cfg)
