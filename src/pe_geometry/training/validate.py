"""Checks of a composed config, run before anything is built or trained.

Each problem raises ``ConfigError`` with one line that names the bad value and
what would be valid; ``train.py`` prints it and exits.
"""

from __future__ import annotations

import logging

from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_class
from omegaconf import DictConfig

from pe_geometry.data.tokenizer import check_tokenizer_settings
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


def check_positional_encoding(cfg: DictConfig) -> None:
    """Ask the encoding named by ``pe._target_`` whether it can work with the model and data sizes (and, for an
    encoding of causal stacks only, with the model's layout)."""
    pe = cfg.pe  # its keys and types were checked by the schema
    pe_class = get_class(str(pe._target_))
    settings = {k: v for k, v in pe.items() if not str(k).startswith("_")}
    sizes = (int(cfg.model.d_model), int(cfg.model.n_heads), int(cfg.data.seq_len))
    check_position_ids = getattr(pe_class, "check_position_ids", None)  # pe.randomize_positions (a user's may lack it)
    check_causal = getattr(pe_class, "check_causal", None)  # an encoding for causal stacks only (pe=forgetting)
    try:
        pe_class.check_settings(*sizes, **settings)
        if check_position_ids is not None:
            check_position_ids(sizes[2], **settings)
        if check_causal is not None:  # a decoder's stacks are all causal; an encoder (-decoder) has a bidirectional one
            check_causal(getattr(get_class(str(cfg.model._target_)), "objective", "") == "next-token")
    except ValueError as err:
        raise ConfigError(f"pe={_option('pe', pe)}: {err}") from None
    precision = str(cfg.get("trainer", {}).get("precision", "32-true"))
    warnings = getattr(pe_class, "settings_warnings", None)  # a user's own encoding may have none
    for line in warnings(*sizes, precision=precision, **settings) if warnings else []:  # works, but does not fit the run
        log.warning("pe=%s: %s", _option("pe", pe), line)


def check_attention(cfg: DictConfig) -> None:
    """Ask the attention named by ``attention._target_`` whether its keys work with the model and data sizes
    (``n_kv_heads`` must divide ``n_heads``, ``logn_scaling`` needs a training length); warn where they do not fit.
    A user's own attention class without ``check_settings`` is taken as it is."""
    attention = cfg.get("attention")
    if attention is None or "_target_" not in attention:
        return
    attention_class = get_class(str(attention._target_))
    settings = {k: v for k, v in attention.items() if not str(k).startswith("_")}
    sizes = (int(cfg.model.d_model), int(cfg.model.n_heads), int(cfg.data.seq_len))
    check = getattr(attention_class, "check_settings", None)
    try:
        if check is not None:
            check(*sizes, **settings)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    precision = str(cfg.get("trainer", {}).get("precision", "32-true"))
    warnings = getattr(attention_class, "settings_warnings", None)
    for line in warnings(*sizes, precision=precision, **settings) if warnings else []:
        log.warning("attention=%s: %s", _option("attention", attention), line)


def check_layer_pattern(cfg: DictConfig) -> None:
    """``model.layer_pattern``: its entries read (``model.transformer.layer_schemes``), each entry's pe settings known
    to the model's encoding family and workable with the sizes, its window accepted by the attention, and no per-layer
    encoding beside an encoding that adds its term to the input (it is added once, before every layer)."""
    pattern = cfg.model.get("layer_pattern")
    if pattern is None:
        return
    from pe_geometry.model.positional import PositionalEncoding
    from pe_geometry.model.transformer import layer_schemes

    try:
        schemes = layer_schemes(pattern, int(cfg.model.n_layers))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    pe_class = get_class(str(cfg.pe._target_))
    settings = {k: v for k, v in cfg.pe.items() if not str(k).startswith("_")}
    sizes = (int(cfg.model.d_model), int(cfg.model.n_heads), int(cfg.data.seq_len))
    for scheme in {s.entry: s for s in schemes}.values():
        where = f"model.layer_pattern[{scheme.entry}]"
        if scheme.pe is not None and pe_class.input_term is not PositionalEncoding.input_term:
            raise ConfigError(f"{where}.pe={scheme.pe!r}: pe={_option('pe', cfg.pe)} adds its term to the input, once "
                              "for every layer; a layer pattern sets encodings that act inside attention (rope, xpos, "
                              "alibi, t5_bias, fire, kerple, cope, forgetting, none)")
        if isinstance(scheme.pe, dict):  # the schema's own check (keys, types, ranges) on the layer's settings
            node = {"_target_": str(cfg.pe._target_), **settings, **scheme.pe}
            lines, _ = check_node("pe", node, _option("pe", cfg.pe))
            if lines:
                raise ConfigError("; ".join(line.replace("pe.", f"{where}.pe.", 1) for _, line in lines))
            try:
                pe_class.check_settings(*sizes, **{**settings, **scheme.pe})
            except ValueError as err:
                raise ConfigError(f"{where}.pe: {err}") from None
        attention = cfg.get("attention")
        check = getattr(get_class(str(attention._target_)), "check_settings", None) if attention else None
        if scheme.window != "inherit" and check is not None:
            own = {k: v for k, v in attention.items() if not str(k).startswith("_")}
            try:
                check(*sizes, **{**own, "window": scheme.window})
            except ValueError as err:
                raise ConfigError(f"{where}.window: {err}") from None


def check_model_parts(cfg: DictConfig) -> None:
    """A model that builds its own parts (model=xtransformers: x-transformers' modules) says which choices of the other
    groups it cannot honour (``check_parts``: our pe beside its own, an attention variant it would ignore), and such a
    model has none of the hook points the geometry recorder reads."""
    model_class = get_class(str(cfg.model._target_))
    check = getattr(model_class, "check_parts", None)
    if check is None:
        return

    def part(group: str) -> tuple[type, dict] | None:
        node = cfg.get(group)
        if node is None or "_target_" not in node:
            return None
        return get_class(str(node._target_)), {k: v for k, v in node.items() if not str(k).startswith("_")}

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
    """The tokenizer's vocabulary (a corpus), or the data class's own ``check_settings(model_objective, **settings)``
    (data=task: the task fits ``data.seq_len``, the model is a decoder)."""
    data = cfg.data
    check = getattr(get_class(str(data._target_)), "check_settings", None)
    try:
        if "tokenizer" in data:
            check_tokenizer_settings(data.tokenizer, int(data.vocab_size))
        if check is not None:
            objective = getattr(get_class(str(cfg.model._target_)), "objective", "")
            check(objective, **{k: v for k, v in data.items() if not str(k).startswith("_")})
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_run_settings(cfg: DictConfig) -> None:
    """Checks that need more than one key, or the machine: beyond what the schema's types and ranges say."""
    interval = cfg.trainer.get("val_check_interval")
    if isinstance(interval, float) and interval > 1:  # Lightning reads a float as a fraction of an epoch
        raise ConfigError(f"trainer.val_check_interval={interval} must be a positive number of steps or a fraction of an epoch in (0, 1]")
    limit = cfg.trainer.get("limit_val_batches")
    if isinstance(limit, float) and limit > 1:  # Lightning reads a float as a fraction of the validation set
        raise ConfigError(f"trainer.limit_val_batches={limit} must be a number of batches >= 0 or a fraction in [0, 1]")
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    if accelerator in ("gpu", "cuda") and not torch_cuda_available():
        if _choices().get("trainer") == "gpu":
            raise ConfigError("trainer=gpu: torch sees no CUDA GPU here (trainer.accelerator=gpu); valid on this machine: trainer=default")
        raise ConfigError(f"trainer.accelerator={accelerator}: torch sees no CUDA GPU here; valid on this machine: ['cpu', 'auto']")
    if accelerator == "mps" and not torch_mps_available():
        raise ConfigError("trainer.accelerator=mps: no Apple GPU (MPS) is available here; valid on this machine: ['cpu', 'auto']")
    geometry = (cfg.get("callbacks") or {}).get("geometry")
    if geometry is not None and int(geometry.get("fixed_k", 1)) > int(cfg.model.d_model):
        raise ConfigError(f"callbacks.geometry.fixed_k={geometry.fixed_k} must be at most model.d_model={cfg.model.d_model}")


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def torch_mps_available() -> bool:
    import torch

    return bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_available()


def check_config(cfg: DictConfig) -> None:
    """The schema (every key typed and ranged, unknown keys refused), then the checks across keys."""
    try:
        check_schema(cfg, _choices())
    except SchemaError as err:
        raise ConfigError(str(err)) from None
    m = cfg.model
    d_model, n_heads = int(m.d_model), int(m.n_heads)
    if d_model % n_heads:
        divisors = [h for h in range(1, min(d_model, 64) + 1) if d_model % h == 0]
        raise ConfigError(f"model.d_model={d_model} is not divisible by model.n_heads={n_heads}; valid n_heads: {divisors}")
    check_positional_encoding(cfg)
    check_attention(cfg)
    check_layer_pattern(cfg)
    check_model_parts(cfg)
    check_data(cfg)
    check_run_settings(cfg)
