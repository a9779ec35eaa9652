"""The schema of train.py's config: every key typed, ranged and checked before anything is built.

``check_schema(cfg)`` checks each config node that names a class (``_target_``) against that class's constructor
(``pe_geometry.signatures``): a key it does not take is refused (``+model.d_modle=64``, ``pe.init`` with ``pe=rope``),
and a value is checked against the parameter's annotation, so ``model.dropout=2`` is one line naming the key, the
value and what would be valid, instead of a traceback from deep inside torch or a silent run. The constructor is the
one source of each key's default, type, range and doc; a class of ours, or a user's, needs nothing here.

What is not a constructor of ours is typed below: the top-level keys of configs/train.yaml, ``paths``, and the keys we
let users set on Lightning's and W&B's classes (``LIBRARY_SETTINGS``: Trainer, checkpoints, early stopping,
the W&B logger), whose own signatures do not say their ranges. Values the schema coerces (``seed='3'`` -> 3,
``train_files=a.txt`` -> ``[a.txt]``) are written back, so the run uses what was checked; booleans are strict
(``compile=yes`` is refused, not read as true). Checks that need more than one key (``d_model % n_heads``, the PE's own
limits, the tokenizer's vocabulary) stay in ``training.validate``, which calls this first.

``check_schema(cfg, import_classes=False)`` reads every signature from the source and imports nothing: what the
command line typed is answered in well under a second, before torch and Lightning load (``cli/train.py``).
"""

from __future__ import annotations

import json
import math
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from omegaconf import DictConfig, OmegaConf, open_dict
from pydantic import AllowInfNan, BaseModel, BeforeValidator, ConfigDict, Field, Strict, ValidationError, create_model, field_validator

from pe_geometry.configs import SUPPLIED
from pe_geometry.signatures import EMPTY, MAX_SEED, Param, Unreadable, constructor_params, describe

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


def _show(value: Any) -> str:
    """A value as the user would type it on the command line."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, default=str).replace(" ", "")
    return str(value)


def _errors(key: str, model: type[BaseModel], values: dict[str, Any],
            wording: dict[str, str] | None = None) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """Validate ``values`` with ``model``: (key, error line) pairs and the coerced values of the keys given.
    ``wording``: what each field must be, where the field's own description does not say it."""
    wording = wording or {}
    try:
        checked = model.model_validate(values)
    except ValidationError as err:
        lines = []
        for problem in err.errors():
            field = str(problem["loc"][0])
            info = model.model_fields.get(field)
            meaning = wording.get(field) or (info.description if info and info.description else problem["msg"])
            full = f"{key}.{field}" if key else field
            if problem["type"] == "extra_forbidden":
                valid = sorted(model.model_fields)
                lines.append((full, f"{full} is not a setting of {key or 'the config'}; valid: {valid}"))
            elif problem["type"] == "missing" and field not in values:
                lines.append((full, f"{full} is missing; it must be {meaning}"))
            else:
                lines.append((full, f"{full}={_show(values.get(field, problem['input']))} must be {meaning}"))
        return lines, {}
    given = set(values) & set(model.model_fields)
    return [], {k: v for k, v in checked.model_dump().items() if k in given}


def _as_checked(annotation: Any) -> Any:
    """A constructor's annotation as the config is checked against it: booleans strict (``compile=yes`` is refused,
    not read as true), numbers finite (no setting of ours means inf), and a list given one value is that value's list
    (``train_files=a.txt``)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is bool:
        return Annotated[bool, Strict()]
    if annotation is float:
        return Annotated[float, AllowInfNan(False)]
    if origin is Annotated:
        return Annotated[(_as_checked(args[0]), *args[1:])]
    if origin is list:
        return Annotated[annotation, BeforeValidator(lambda v: [v] if isinstance(v, str) else v)]
    if origin in (Union, UnionType):
        return Union[tuple(_as_checked(a) for a in args)]  # noqa: UP007
    if origin is tuple:
        return tuple[tuple(_as_checked(a) for a in args)] if args and Ellipsis not in args else annotation
    return annotation


def _derived_model(target: str, params: tuple[Param, ...]) -> tuple[type[BaseModel], dict[str, str]]:
    """A pydantic model of a constructor's annotated keywords, and the wording of each (``describe``)."""
    if target in _DERIVED:
        return _DERIVED[target]
    fields = {p.name: (_as_checked(p.annotation), None if p.default is EMPTY else p.default)
              for p in params if p.annotation is not EMPTY}
    model = create_model(f"Settings of {target}", __config__=ConfigDict(extra="ignore", arbitrary_types_allowed=True),
                         **fields)
    _DERIVED[target] = model, {p.name: describe(p.annotation) for p in params if p.annotation is not EMPTY}
    return _DERIVED[target]


_DERIVED: dict[str, tuple[type[BaseModel], dict[str, str]]] = {}


def check_node(key: str, node: Any, option: str | None = None,
               import_classes: bool = True) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """Check one ``_target_`` node: its keys against the class's constructor, its values against the constructor's
    annotations (``LIBRARY_SETTINGS`` for Lightning's and W&B's). ``import_classes=False``: a class whose source does
    not say its signature plainly is left for the full check."""
    if not isinstance(node, dict) or "_target_" not in node:
        return [(key, f"{key}={_show(node)} must be a config node with a _target_ (a class to build)")], {}
    target = str(node["_target_"])
    group = key.split(".", 1)[0]
    try:
        params = constructor_params(target, import_if_needed=import_classes)
    except Unreadable:
        params = None  # read when the run starts (the check that may import); until then any key is let through
    except (ImportError, AttributeError) as err:
        return [(key, f"{key}._target_={target} cannot be imported ({type(err).__name__}: {err})")], {}
    settings = {k: v for k, v in node.items() if k not in HYDRA_KEYS and not (isinstance(v, dict) and "_target_" in v)}
    if params is not None:
        accepted = set(params) - SUPPLIED.get(group, set())
        unknown = sorted(set(node) - HYDRA_KEYS - accepted)
        if unknown:
            name = f"{group}={option}" if option else f"{key} ({target})"
            valid = sorted(accepted) or f"none ({name} has no settings)"
            return [(f"{key}.{k}", f"{key}.{k} is not a setting of {name}; valid: {valid}") for k in unknown], {}
    if target in LIBRARY_SETTINGS:
        return _errors(key, LIBRARY_SETTINGS[target], settings)
    if params is None:
        return [], {}
    typed = tuple(p for name, p in params.items() if name not in SUPPLIED.get(group, set()))
    model, wording = _derived_model(target, typed)
    return _errors(key, model, settings, wording)



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
    record("", _errors("", TopLevelSettings, top))
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
        record("paths", _errors("paths", PathsSettings, node) if isinstance(node, dict) else not_a_group)
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
        raise SchemaError("; ".join(own or [line for _, line in problems]))
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
