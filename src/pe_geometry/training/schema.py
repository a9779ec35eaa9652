"""The schema of train.py's config: every key typed, ranged and checked before anything is built.

``check_schema(cfg)`` checks each config node that names a class (``_target_``) against that class's settings
dataclass (``pe_geometry.settings``, found by the target without importing the class): a key it does not have is
refused (``+model.d_modle=64``, ``pe.init`` with ``pe=rope``), a value is checked against the field's annotation, and
the dataclass's own cross-key rules run (``model.d_model`` divisible by ``model.n_heads``), so ``model.dropout=2`` is
one line naming the key, the value and what would be valid, instead of a traceback from deep inside torch or a silent
run. The dataclass is the one source of each key's default, type, range and doc; a user's class that registers one
needs nothing here, and one that does not is read from its constructor's signature once it is imported.

What is not a constructor of ours is typed below: the top-level keys of configs/train.yaml, ``paths``, and the keys we
let users set on Lightning's and W&B's classes (``LIBRARY_SETTINGS``: Trainer, checkpoints, early stopping,
the W&B logger), whose own signatures do not say their ranges. Values the schema coerces (``seed='3'`` -> 3,
``train_files=a.txt`` -> ``[a.txt]``) are written back, so the run uses what was checked; booleans are strict
(``compile=yes`` is refused, not read as true). Checks that need more than one key (``d_model % n_heads``, the PE's own
limits, the tokenizer's vocabulary) stay in ``training.validate``, which calls this first.

``check_schema(cfg, import_classes=False)`` imports no class: what the command line typed is answered in well under a
second, before torch and Lightning load (``cli/train.py``); a class without registered settings is then let through,
for the full check.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import typing
from typing import Any, Literal, get_args

from omegaconf import DictConfig, OmegaConf, open_dict
from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from pe_geometry.configs import SUPPLIED
from pe_geometry.settings.base import MAX_SEED, SettingsError, as_checked, field_problems, model_problems, show
from pe_geometry.settings.registry import settings_of
from pe_geometry.settings.wording import describe

# Keys Hydra's instantiate reads itself; they are not constructor arguments.
HYDRA_KEYS = {"_target_", "_partial_", "_convert_", "_recursive_", "_args_"}


class SchemaError(ValueError):
    """One or more config values that cannot work (``training.validate.ConfigError`` subclasses it)."""


def what(text: str, default: Any = None, **constraints: Any) -> Any:
    """A field whose errors read ``<key>=<value> must be <text>`` (the default only matters to pydantic: a config
    key the node does not have is not checked)."""
    return Field(default, description=text, **constraints)


class Settings(BaseModel):
    """A group's settings: unknown keys are refused, values coerced to their type."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class TargetSettings(Settings):
    """Settings of a node Hydra instantiates; the unknown-key check is the constructor's (see ``check_node``)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


# -- Lightning and W&B: the keys we let a config set on their classes ------------------------------
PRECISIONS = ("64", "64-true", "32", "32-true", "16", "16-mixed", "16-true", "bf16", "bf16-mixed", "bf16-true",
              "transformer-engine", "transformer-engine-float16")
ACCELERATORS = ("cpu", "gpu", "cuda", "mps", "tpu", "auto")


class TrainerSettings(TargetSettings):
    accelerator: Literal[ACCELERATORS] = what(f"one of {list(ACCELERATORS)}")  # type: ignore[valid-type]
    devices: int | str | list[int] = what("a positive number of devices, -1 (all), 'auto', or a list of device indices")

    @field_validator("precision", mode="before")
    @classmethod
    def _precision_as_text(cls, precision: Any) -> Any:
        return str(precision) if isinstance(precision, int) and not isinstance(precision, bool) else precision  # 16 -> "16"

    @field_validator("devices")
    @classmethod
    def _some_devices(cls, devices: int | str | list[int]) -> int | str | list[int]:
        ok = (devices == -1 or devices >= 1) if isinstance(devices, int) else (
            devices == "auto" or all(part.strip().lstrip("-").isdigit() for part in devices.split(",")) and devices.strip() not in ("0", "")
            if isinstance(devices, str) else bool(devices) and all(d >= 0 for d in devices))
        if not ok or isinstance(devices, bool):
            raise ValueError("no devices")
        return devices
    num_nodes: int = what("a positive integer", ge=1)
    max_steps: int = what("a positive number of steps", ge=1)
    max_epochs: int | None = what("an integer (-1: no limit)", ge=-1)
    # int | float: Lightning reads an int as a number of batches and a float as a fraction of an epoch
    val_check_interval: int | float | None = what("a positive number of steps or a fraction of an epoch in (0, 1]", gt=0)
    check_val_every_n_epoch: int | None = what("a positive integer or null", ge=1)
    limit_val_batches: int | float | None = what("a number of batches >= 0 or a fraction in [0, 1]", ge=0)
    num_sanity_val_steps: int | None = what("an integer >= -1", ge=-1)
    log_every_n_steps: int | None = what("a positive integer", ge=1)
    gradient_clip_val: float | None = what("a number >= 0, or null for no clipping", ge=0, allow_inf_nan=False)
    accumulate_grad_batches: int = what("an integer >= 1", ge=1)
    precision: Literal[PRECISIONS] = what(f"one of {list(PRECISIONS)}")  # type: ignore[valid-type]
    deterministic: bool | Literal["warn"] | None = what("true, false or 'warn'")
    enable_model_summary: bool | None = what("true or false", strict=True)


# -- callbacks and loggers -------------------------------------------------------------------------
class CheckpointSettings(TargetSettings):
    every_n_train_steps: int | None = what("an integer >= 0 (0: only last.ckpt), or null", ge=0)
    save_top_k: int = what("an integer >= -1 (-1: keep every checkpoint)", ge=-1)
    save_last: bool | Literal["link"] | None = what("true, false or 'link'")


# What a monitored callback may watch: the metrics LanguageModelTask logs (a typo would otherwise fail at the first
# validation, minutes into the run); the answer metrics only with data=task, and each with its own direction
# (``check_monitored``).
Monitored = Literal["val/loss", "val/ppl", "train/loss", "val/answer_accuracy", "val/answer_exact_match"]
MONITORED = list(get_args(Monitored))
HIGHER_IS_BETTER = ("val/answer_accuracy", "val/answer_exact_match")


class BestCheckpointSettings(CheckpointSettings):
    """Lightning's ModelCheckpoint itself: callbacks=early_stop's best_checkpoint (monitor set) or a user's own."""
    monitor: Monitored | None = what(f"one of {MONITORED}, or null")
    mode: Literal["min", "max"] = what("one of ['min', 'max']")


class EarlyStoppingSettings(TargetSettings):
    monitor: Monitored = what(f"one of {MONITORED}", ...)
    mode: Literal["min", "max"] = what("one of ['min', 'max']")
    patience: int = what("an integer >= 0 (validations without improvement before the stop)", ge=0)
    min_delta: float = what("a number >= 0", ge=0, allow_inf_nan=False)


class ThroughputSettings(TargetSettings):
    window_size: int = what("an integer >= 2", ge=2)


class LRMonitorSettings(TargetSettings):
    logging_interval: Literal["step", "epoch"] | None = what("one of ['step', 'epoch'] or null")


class WandbSettings(TargetSettings):
    offline: bool = what("true or false", strict=True)
    project: str = what("a project name", min_length=1)
    tags: list[Any] = what("a list of tags")  # a study tags runs with its group choices, which may be null


# -- top level -------------------------------------------------------------------------------------
class PathsSettings(Settings):
    output_dir: str = what("a directory path", ...)
    cache_dir: str = what("a directory path", ...)


class TopLevelSettings(Settings):
    """The keys of configs/train.yaml itself; each group is checked by ``check_node`` (or a model above)."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)
    seed: int = what(f"an integer in [0, {MAX_SEED}]", ge=0, le=MAX_SEED)
    compile: bool = what("true or false (torch.compile the model)", strict=True)
    matmul_precision: Literal["highest", "high", "medium"] = what("one of ['highest', 'high', 'medium']")
    ckpt_path: str | None = what("a checkpoint path, 'last', 'auto' (last.ckpt if the run folder has one), or null")
    branch: bool = what("true or false (with ckpt_path: a new run from that checkpoint, in its own folder)", strict=True)
    init_from: str | None = what("a transformers checkpoint folder to start from (pe-export's --out), or null")
    run_name: str = what("a string")
    model: Any = None
    pe: Any = None
    embedding: Any = None
    attention: Any = None
    data: Any = None
    optimizer: Any = None
    trainer: Any = None
    logger: Any = None
    callbacks: Any = None
    paths: Any = None


# The keys of other libraries' classes, by ``_target_``, and of our subclasses of them (their ``**kwargs`` go to
# Lightning's constructor, whose annotations say no ranges). Hydra accepts either spelling of Trainer.
LIBRARY_SETTINGS: dict[str, type[TargetSettings]] = {
    "lightning.Trainer": TrainerSettings,
    "lightning.pytorch.Trainer": TrainerSettings,
    "lightning.pytorch.callbacks.LearningRateMonitor": LRMonitorSettings,
    "pe_geometry.training.throughput.TokenThroughputMonitor": ThroughputSettings,
    "lightning.pytorch.callbacks.ModelCheckpoint": BestCheckpointSettings,
    "pe_geometry.training.callbacks.StepCheckpoint": CheckpointSettings,
    "pe_geometry.training.callbacks.BestCheckpoint": BestCheckpointSettings,
    "lightning.pytorch.callbacks.EarlyStopping": EarlyStoppingSettings,
    "pe_geometry.training.callbacks.EarlyStop": EarlyStoppingSettings,
    "lightning.pytorch.loggers.WandbLogger": WandbSettings,
}


_show = show


def import_target(target: str) -> Any:
    """``a.b.C`` -> the object (the longest importable module prefix, then attributes), quietly: Hydra's ``get_class``
    logs a multi-line error of its own before raising."""
    parts = target.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as err:
            if err.name is not None and not ".".join(parts[:cut]).startswith(err.name):
                raise  # the module exists and imports something missing: say that, not "no module"
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        if cut == len(parts) or not callable(obj):
            raise ImportError(f"{target} is not a class or a function")
        return obj
    raise ImportError(f"no module named {parts[0]!r}")


def signature_params(target: str) -> dict[str, inspect.Parameter] | None:
    """The keywords a class without registered settings takes (a user's, another library's), read from its imported
    constructor, ``**kwargs`` followed up the class hierarchy; None when the chain ends in a catch-all ``**kwargs``."""
    obj = import_target(target)
    functions = [obj] if not isinstance(obj, type) else [vars(k)["__init__"] for k in obj.__mro__[:-1] if "__init__" in vars(k)]
    out: dict[str, inspect.Parameter] = {}
    for function in functions:
        params = list(inspect.signature(function).parameters.values())[0 if function is obj else 1:]
        out = {**{p.name: p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}, **out}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return out
    return None


@functools.cache
def _signature_model(target: str, names: tuple[str, ...]) -> tuple[type[BaseModel], dict[str, str]]:
    """A pydantic model of a constructor's annotated keywords (``names``), and the wording of each."""
    obj = import_target(target)
    function = obj.__init__ if isinstance(obj, type) else obj
    try:
        hints = typing.get_type_hints(function, include_extras=True)
    except Exception:  # noqa: BLE001 - an annotation that does not evaluate: its parameters take any value
        hints = {}
    annotated = {name: hints[name] for name in names if name in hints}
    model = create_model(f"Settings of {target}", __config__=ConfigDict(extra="ignore", arbitrary_types_allowed=True),
                         **{name: (as_checked(a), None) for name, a in annotated.items()})
    return model, {name: describe(a) for name, a in annotated.items()}


def check_node(key: str, node: Any, option: str | None = None, import_classes: bool = True,
               rules: bool = True) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """Check one ``_target_`` node: its keys and values against the class's settings dataclass and (``rules``) that
    dataclass's own rules across its keys (``LIBRARY_SETTINGS`` for Lightning's and W&B's classes; the imported
    signature for a class without settings). ``import_classes=False``: a class without registered settings is left
    for the full check."""
    if not isinstance(node, dict) or "_target_" not in node:
        return [(key, f"{key}={_show(node)} must be a config node with a _target_ (a class to build)")], {}
    target = str(node["_target_"])
    group = key.split(".", 1)[0]
    nested = {k for k, v in node.items() if isinstance(v, dict) and "_target_" in v}  # built and checked on their own
    settings = {k: v for k, v in node.items() if k not in HYDRA_KEYS and k not in nested}
    name = f"{group}={option}" if option else f"{key} ({target})"

    def unknown(accepted: set[str]) -> list[tuple[str, str]]:
        valid = sorted(accepted) or f"none ({name} has no settings)"
        return [(f"{key}.{k}", f"{key}.{k} is not a setting of {name}; valid: {valid}") for k in sorted(set(settings) - accepted)]

    cls = settings_of(target)
    if cls is not None:
        problems = unknown({f.name for f in dataclasses.fields(cls)})
        if problems:
            return problems, {}
        problems, coerced = field_problems(cls, settings, key)
        if problems or not rules:
            return problems, ({} if problems else coerced)
        try:
            cls(**{**settings, **coerced})  # the dataclass's own rules across its keys
        except SettingsError as err:  # an encoding's name its option (pe=learned: ...), as its checks with the sizes do
            return [(key, f"pe={option}: {err}" if key == "pe" and option else str(err))], {}
        return [], coerced
    if not import_classes:
        return [], {}  # read when the run starts (the check that may import); until then any key is let through
    try:
        params = signature_params(target)
    except (ImportError, AttributeError) as err:
        return [(key, f"{key}._target_={target} cannot be imported ({type(err).__name__}: {err})")], {}
    if params is not None:
        problems = unknown(set(params) - SUPPLIED.get(group, set()))
        if problems:
            return problems, {}
    if target in LIBRARY_SETTINGS:
        return model_problems(key, LIBRARY_SETTINGS[target], settings)
    if params is None:
        return [], {}
    model, wording = _signature_model(target, tuple(p for p in params if p not in SUPPLIED.get(group, set())))
    return model_problems(key, model, settings, wording)


def _choice(choices: dict[str, Any], group: str) -> str | None:
    value = choices.get(group)
    return None if value in (None, "None") else str(value)


def check_schema(cfg: DictConfig, choices: dict[str, Any] | None = None, import_classes: bool = True) -> None:
    """Every key of a composed train config: known, typed, in range. Raises SchemaError with one line
    (several problems joined by "; "). Coerced values are written back into ``cfg``. ``import_classes=False``: read
    the constructors from their source only (no torch, no Lightning); one that does not say its signature plainly
    is left for the full check."""
    choices = choices or {}
    values = OmegaConf.to_container(cfg, resolve=True)
    problems: list[tuple[str, str]] = []
    fixes: dict[str, Any] = {}

    def record(key: str, found: tuple[list[tuple[str, str]], dict[str, Any]]) -> None:
        lines, coerced = found
        problems.extend(lines)
        fixes.update({f"{key}.{k}" if key else k: v for k, v in coerced.items()})

    top = {k: v for k, v in values.items()}
    record("", model_problems("", TopLevelSettings, top))
    for group in ("model", "pe", "embedding", "attention", "trainer", "optimizer"):  # (optimizer: a factory's keys)
        if group in values:
            record(group, check_node(group, values[group], _choice(choices, group), import_classes))
    if "data" in values:
        record("data", check_node("data", values["data"], _choice(choices, "data"), import_classes))
        corpus = values["data"].get("corpus") if isinstance(values["data"], dict) else None
        if corpus is not None:
            record("data.corpus", check_node("data.corpus", corpus, None, import_classes))
    if "paths" in values:
        node = values["paths"]
        not_a_group = ([("paths", "paths must be a config group")], {})
        record("paths", model_problems("paths", PathsSettings, node) if isinstance(node, dict) else not_a_group)
    for group in ("logger", "callbacks"):
        node = values.get(group)
        if node is None:
            continue
        if not isinstance(node, dict):
            problems.append((group, f"{group}={_show(node)} must be a group of named {group} (or null)"))
            continue
        for name, member in node.items():
            # a node without _target_ is settings for a member not chosen (experiment=orthogonality sets
            # logger.wandb.group; with logger=csv there is no wandb logger to take them): nothing is built from it
            if member is not None and not (isinstance(member, dict) and "_target_" not in member):
                record(f"{group}.{name}", check_node(f"{group}.{name}", member, f"{_choice(choices, group)} ({name})",
                                                    import_classes))
    problems.extend(check_monitored(values))
    if problems:
        # data.seed: ${seed} repeats seed's error: name the key the user set, not the ones that copy it
        own = [line for key, line in problems if not _is_interpolation(cfg, key)]
        # one line per problem: a list whose every item fails names the key once, not once per item
        raise SchemaError("; ".join(dict.fromkeys(own or [line for _, line in problems])))
    _write_back(cfg, fixes, values)


def check_monitored(values: dict) -> list[tuple[str, str]]:
    """The rules of a monitored callback that span keys: an answer metric is logged by data=task alone, and the
    direction must be the metric's (mode=min on an accuracy would keep the worst checkpoint and stop at the best)."""
    data_target = str((values.get("data") or {}).get("_target_", "")) if isinstance(values.get("data"), dict) else ""
    problems = []
    for name, member in (values.get("callbacks") or {}).items():
        if not isinstance(member, dict) or member.get("monitor") not in MONITORED:
            continue
        key, monitor, mode = f"callbacks.{name}", member["monitor"], member.get("mode", "min")
        if monitor in HIGHER_IS_BETTER and not data_target.endswith("TaskDataModule"):
            problems.append((f"{key}.monitor", f"{key}.monitor={monitor} is logged by data=task only; with this data: "
                                               "one of ['val/loss', 'val/ppl', 'train/loss']"))
        elif mode in ("min", "max") and (mode == "max") != (monitor in HIGHER_IS_BETTER):
            want = "max" if monitor in HIGHER_IS_BETTER else "min"
            problems.append((f"{key}.mode", f"{key}.mode={mode} with monitor={monitor}: set {key}.mode={want} "
                                            f"({monitor} is better when {'higher' if want == 'max' else 'lower'})"))
    return problems


def _is_interpolation(cfg: DictConfig, key: str) -> bool:
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent, throw_on_resolution_failure=False) if parent else cfg
    return OmegaConf.is_config(node) and leaf in node and OmegaConf.is_interpolation(node, leaf)


def _write_back(cfg: DictConfig, fixes: dict[str, Any], values: dict[str, Any]) -> None:
    """Store the values the schema coerced (a tuple becomes a list: OmegaConf has no tuples); a value that was
    already right, interpolations included, is left as it is."""
    with open_dict(cfg):
        for key, value in fixes.items():
            plain = list(value) if isinstance(value, tuple) else value
            given: Any = values
            for part in key.split("."):
                given = given.get(part) if isinstance(given, dict) else None
            if given != plain or type(given) is not type(plain):
                OmegaConf.update(cfg, key, plain, force_add=True)
