"""The schema of train.py's config: every key typed, ranged and checked in one place.

``check_schema(cfg)`` runs before anything is built. Each config node that names a class
(``_target_``) is checked twice:

- its keys against the class's constructor, so a typo (``+model.d_modle=64``) or a setting another
  option has (``pe.init`` with ``pe=rope``) is refused whatever the class, ours or a user's;
- its values against the typed settings below (pydantic models, one per class we ship), so
  ``model.dropout=2`` or ``trainer.precision=fp7`` is one line naming the key, the value and what
  would be valid, instead of a traceback from deep inside torch or Lightning, or a silent run.

Top-level keys and the keyless group ``paths`` are models of their own; so are the settings of the optimisers
we ship (``OPTIMIZERS``), so that ``optimizer.momentum`` is refused naming AdamW's settings. Values the
schema coerces (``seed='3'`` -> 3, ``train_files=a.txt`` -> ``[a.txt]``) are written back, so the run uses
what was checked; booleans are strict (``compile=yes`` is refused, not read as true). Checks that need
more than one key (``d_model % n_heads``, the PE's own limits, the tokenizer's vocabulary) stay in
``training.validate``, which calls this first.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import math
from typing import Annotated, Any, Literal

from omegaconf import DictConfig, OmegaConf, open_dict
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_SEED = 2**32 - 1  # numpy's seed range, which seed_everything enforces
# A learned table of more rows than this is a typo (pe.max_len=1e9 asked torch for 128 GB), not a plan.
MAX_LEARNED_POSITIONS = 1 << 20
# Keys Hydra's instantiate reads itself; they are not constructor arguments.
HYDRA_KEYS = {"_target_", "_partial_", "_convert_", "_recursive_", "_args_"}


class SchemaError(ValueError):
    """One or more config values that cannot work (``training.validate.ConfigError`` subclasses it)."""


def what(text: str, default: Any = ..., **constraints: Any) -> Any:
    """A field whose errors read ``<key>=<value> must be <text>``."""
    return Field(default, description=text, **constraints)


Fraction01 = Annotated[float, Field(ge=0, lt=1)]
Positive = Annotated[int, Field(ge=1)]


class Settings(BaseModel):
    """A group's settings: unknown keys are refused, values coerced to their type."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class TargetSettings(Settings):
    """Settings of a node Hydra instantiates; the unknown-key check is the constructor's (see ``check_node``)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


# -- model / pe / embedding / attention ------------------------------------------------------------
class ModelSettings(TargetSettings):
    d_model: int = what("a positive integer", 128, ge=1)
    n_heads: int = what("a positive integer", 4, ge=1)
    n_layers: int = what("a positive integer", 4, ge=1)
    d_ff: int | None = what("a positive integer, or null for 4 * d_model", None, ge=1)
    dropout: float = what("a probability in [0, 1)", 0.0, ge=0, lt=1)
    norm: Literal["pre", "post"] = what("one of ['pre', 'post']", "pre")


class EncoderSettings(ModelSettings):
    mask_prob: float = what("a fraction in (0, 1)", 0.15, gt=0, lt=1)


class EncoderDecoderSettings(ModelSettings):
    src_fraction: float = what("a fraction in (0, 1)", 0.5, gt=0, lt=1)


class SinusoidalSettings(TargetSettings):
    max_len: int = what(f"an integer in [1, {MAX_LEARNED_POSITIONS}]", 512, ge=1, le=MAX_LEARNED_POSITIONS)
    scale: Literal["none", "word_norm"] = what("one of ['none', 'word_norm']", "none")
    center: bool = what("true or false", False, strict=True)


class LearnedSettings(TargetSettings):
    max_len: int = what(f"an integer in [1, {MAX_LEARNED_POSITIONS}] (rows of the learned table)", 512, ge=1, le=MAX_LEARNED_POSITIONS)
    init: Literal["normal", "mixed"] = what("one of ['normal', 'mixed']", "normal")
    init_k: int = what("a positive integer", 8, ge=1)
    freeze: bool = what("true or false", False, strict=True)  # the table stays at its initialisation (a control)
    shuffle: bool = what("true or false", False, strict=True)  # each sequence reads the rows in a random order (a control)


# model.positional.ROPE_SCALINGS (kept here so the schema imports no torch; tests/test_pe_families.py checks they agree)
ROPE_SCALINGS = ("none", "linear", "ntk", "dynamic_ntk", "yarn")


class RotarySettings(TargetSettings):
    base: float = what("a number > 1", 10000.0, gt=1, allow_inf_nan=False)
    scaling: Literal[ROPE_SCALINGS] = what(f"one of {list(ROPE_SCALINGS)}", "none")  # type: ignore[valid-type]
    scaling_factor: float = what("a number >= 1 (times the training length)", 1.0, ge=1, allow_inf_nan=False)
    training_length: int | None = what("a positive integer (the length trained at), or null", None, ge=1)
    yarn_alpha: float | None = what("a number >= 0, or null for the rescaled default", None, ge=0, allow_inf_nan=False)
    yarn_beta: float | None = what("a number > 0, or null for the rescaled default", None, gt=0, allow_inf_nan=False)
    yarn_attention_factor: float | None = what("a number > 0, or null for 0.1 ln(s) + 1", None, gt=0, allow_inf_nan=False)


class XPosSettings(TargetSettings):
    base: float = what("a number > 1", 10000.0, gt=1, allow_inf_nan=False)
    gamma: float = what("a number > 0", 0.4, gt=0, allow_inf_nan=False)
    scale_base: float = what("a number > 0 (tokens)", 512.0, gt=0, allow_inf_nan=False)
    training_length: int = what("a positive integer (the length trained at)", 512, ge=1)


class T5BiasSettings(TargetSettings):
    num_buckets: int = what("an integer >= 4", 32, ge=4)
    max_distance: int = what("an integer >= 2 (tokens)", 128, ge=2)


class FireSettings(TargetSettings):
    mlp_width: int = what("a positive integer", 32, ge=1)
    init_c: float = what("a number > 0", 0.1, gt=0, allow_inf_nan=False)
    init_threshold: float = what("a number >= 1 (tokens)", 512.0, ge=1, allow_inf_nan=False)


class CoPESettings(TargetSettings):
    p_max: int = what("an integer >= 2", 16, ge=2)


class AttentionSettings(TargetSettings):
    """Both kernels' keys (model.attention.MultiHeadAttention); n_kv_heads | n_heads and logn_scaling's training length
    are checked across keys by ``training.validate``."""

    n_kv_heads: int | None = what("a positive integer dividing model.n_heads (1: multi-query), or null for model.n_heads",
                                  None, ge=1)
    qk_norm: bool = what("true or false", False, strict=True)
    qk_norm_scale: float = what("a number > 0 (the learned temperature's start)", 10.0, gt=0, allow_inf_nan=False)
    window: int | None = what("a positive number of positions a query sees, or null for all", None, ge=1)
    logn_scaling: bool = what("true or false", False, strict=True)
    training_length: int | None = what("an integer >= 2 (the length trained at), or null", None, ge=2)


class EmbeddingSettings(TargetSettings):
    scaled: bool = what("true or false", False, strict=True)
    tie_weights: bool = what("true or false", True, strict=True)


# -- data ------------------------------------------------------------------------------------------
class DataSettings(TargetSettings):
    tokenizer: Literal["bpe", "char"] = what("one of ['bpe', 'char']", "bpe")
    vocab_size: int = what("an integer", 2048)  # its range depends on the tokenizer: training.validate
    seq_len: int = what("an integer >= 2", 128, ge=2)
    batch_size: int = what("a positive integer", 32, ge=1)
    cache_dir: str = what("a directory path", ".cache/data")
    num_workers: int = what("an integer >= 0 (DataLoader worker processes)", 0, ge=0)
    seed: int = what(f"an integer in [0, {MAX_SEED}]", 0, ge=0, le=MAX_SEED)
    num_proc: int = what("a positive integer", 1, ge=1)
    tokenizer_sample_chars: int = what("a positive number of characters", 20_000_000, ge=1)


class ShakespeareSettings(TargetSettings):
    validation_plays: list[str] = what("a non-empty list of play names", min_length=1)
    max_train_plays: int | None = what("a positive integer, or null for every play", None, ge=1)


class TextFilesSettings(TargetSettings):
    train_files: list[str] = what("a non-empty list of text files: data.corpus.train_files=[a.txt,b.txt]", min_length=1)
    val_files: list[str] | None = what("a list of text files, or null to hold out val_fraction of the training text", None)
    val_fraction: float = what("a fraction in (0, 1) of the training documents", 0.1, gt=0, lt=1)
    encoding_errors: Literal["strict", "replace"] = what("one of ['strict', 'replace']", "strict")

    @field_validator("train_files", "val_files", mode="before")
    @classmethod
    def _one_file(cls, files: Any) -> Any:
        return [files] if isinstance(files, str) else files  # train_files=my.txt is one file, not a list of characters


class HFDataSettings(DataSettings):
    path: str = what("a hub name, a save_to_disk folder, or parquet|json|csv|text|arrow", min_length=1)
    val_size: int | float = what("a fraction in (0, 1) or a number of documents >= 1", 0.05, gt=0)  # an int counts documents
    max_docs: int | None = what("a positive integer, or null for every document", None, ge=1)
    streaming: bool = what("true or false", False, strict=True)
    text_column: str = what("a column name", "text", min_length=1)


# -- optimiser and trainer -------------------------------------------------------------------------
class OptimizerSettings(Settings):
    """``training.optimizer.adamw_warmup_cosine``: AdamW and its warm-up + cosine schedule."""

    lr: float = what("positive and finite", 1e-3, gt=0, allow_inf_nan=False)
    weight_decay: float = what("a number >= 0", 0.1, ge=0, allow_inf_nan=False)
    betas: tuple[Fraction01, Fraction01] = what("two numbers in [0, 1), e.g. [0.9,0.95]", (0.9, 0.95))
    warmup_steps: int = what("an integer >= 0", 100, ge=0)
    min_lr_ratio: float = what("a fraction in [0, 1] of optimizer.lr", 0.1, ge=0, le=1)
    no_decay_embeddings: bool = what("true or false", False, strict=True)
    fused: bool = what("true or false", False, strict=True)  # torch's fused AdamW kernel (trainer=gpu sets it)
    lr_base_width: int | None = what("a positive integer (the d_model optimizer.lr is meant for), or null", None, ge=1)


PRECISIONS = ("64", "64-true", "32", "32-true", "16", "16-mixed", "16-true", "bf16", "bf16-mixed", "bf16-true",
              "transformer-engine", "transformer-engine-float16")
ACCELERATORS = ("cpu", "gpu", "cuda", "mps", "tpu", "auto")


class TrainerSettings(TargetSettings):
    accelerator: Literal[ACCELERATORS] = what(f"one of {list(ACCELERATORS)}", "auto")  # type: ignore[valid-type]
    devices: int | str | list[int] = what("a positive number of devices, -1 (all), 'auto', or a list of device indices", 1)

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
    num_nodes: int = what("a positive integer", 1, ge=1)
    max_steps: int = what("a positive number of steps", 1200, ge=1)
    max_epochs: int | None = what("an integer (-1: no limit)", -1, ge=-1)
    # int | float: Lightning reads an int as a number of batches and a float as a fraction of an epoch
    val_check_interval: int | float | None = what("a positive number of steps or a fraction of an epoch in (0, 1]", None, gt=0)
    check_val_every_n_epoch: int | None = what("a positive integer or null", None, ge=1)
    limit_val_batches: int | float | None = what("a number of batches >= 0 or a fraction in [0, 1]", None, ge=0)
    num_sanity_val_steps: int | None = what("an integer >= -1", None, ge=-1)
    log_every_n_steps: int | None = what("a positive integer", None, ge=1)
    gradient_clip_val: float | None = what("a number >= 0, or null for no clipping", None, ge=0, allow_inf_nan=False)
    accumulate_grad_batches: int = what("an integer >= 1", 1, ge=1)
    precision: Literal[PRECISIONS] = what(f"one of {list(PRECISIONS)}", "32-true")  # type: ignore[valid-type]
    deterministic: bool | Literal["warn"] | None = what("true, false or 'warn'", None)
    enable_model_summary: bool | None = what("true or false", None, strict=True)


# -- callbacks and loggers -------------------------------------------------------------------------
class CheckpointSettings(TargetSettings):
    every_n_train_steps: int | None = what("an integer >= 0 (0: only last.ckpt), or null", None, ge=0)
    save_top_k: int = what("an integer >= -1 (-1: keep every checkpoint)", -1, ge=-1)
    save_last: bool | Literal["link"] | None = what("true, false or 'link'", None)


# What a monitored callback may watch: the metrics LanguageModelTask logs (a typo would otherwise fail at the first
# validation, minutes into the run).
Monitored = Literal["val/loss", "val/ppl", "train/loss"]


class BestCheckpointSettings(CheckpointSettings):
    """Lightning's ModelCheckpoint itself: callbacks=early_stop's best_checkpoint (monitor set) or a user's own."""
    monitor: Monitored | None = what("one of ['val/loss', 'val/ppl', 'train/loss'], or null", None)
    mode: Literal["min", "max"] = what("one of ['min', 'max']", "min")


class EarlyStoppingSettings(TargetSettings):
    monitor: Monitored = what("one of ['val/loss', 'val/ppl', 'train/loss']")
    mode: Literal["min", "max"] = what("one of ['min', 'max']", "min")
    patience: int = what("an integer >= 0 (validations without improvement before the stop)", 3, ge=0)
    min_delta: float = what("a number >= 0", 0.0, ge=0, allow_inf_nan=False)


class GeometrySettings(TargetSettings):
    every_n_steps: int = what("an integer >= 1", 100, ge=1)
    n_tokens: int = what("an integer >= 1", 1000, ge=1)
    measures: list[Literal["input", "hidden", "attention"]] = what("a list of ['input', 'hidden', 'attention']",
                                                                     ["input", "hidden", "attention"])
    probe_batch_size: int = what("an integer >= 1", 8, ge=1)
    fixed_k: int = what("an integer >= 1", 8, ge=1)
    positional_head_threshold: float = what("a fraction in (0, 1)", 0.5, gt=0, lt=1)
    seed: int = what(f"an integer in [0, {MAX_SEED}]", 0, ge=0, le=MAX_SEED)
    null_draws: int = what("an integer >= 2 (a null needs a spread)", 100, ge=2)
    position_probe_every_n_steps: int = what("an integer >= 1", 500, ge=1)
    position_probe_blocks: int = what("an integer >= 5 (5-fold cross-validation by block)", 128, ge=5)
    position_probe_permutations: int = what("an integer >= 2", 20, ge=2)
    chunk_tokens: int = what("an integer >= 1", 8192, ge=1)
    attention_null_draws: int = what("an integer >= 2 (a null needs a spread)", 20, ge=2)


class ProgressSettings(TargetSettings):
    log_every_n_steps: int = what("an integer >= 1", 50, ge=1)


class SampleSettings(TargetSettings):
    prompt: str = what("a string", "ROMEO:\n")
    max_new_tokens: int = what("an integer >= 0 (0: no sample)", 48, ge=0)
    temperature: float = what("a number >= 0 (0: greedy)", 0.8, ge=0, allow_inf_nan=False)
    top_k: int | None = what("an integer >= 0 (0 or null: off)", 40, ge=0)
    top_p: float | None = what("a fraction in (0, 1] (1 or null: off)", 0.95, gt=0, le=1)
    blank_every: int = what("an integer >= 1", 6, ge=1)
    seed: int = what(f"an integer in [0, {MAX_SEED}]", 0, ge=0, le=MAX_SEED)
    context: Literal["train", "full"] = what("one of ['train', 'full']", "train")


class ThroughputSettings(TargetSettings):
    window_size: int = what("an integer >= 2", 20, ge=2)


class LRMonitorSettings(TargetSettings):
    logging_interval: Literal["step", "epoch"] | None = what("one of ['step', 'epoch'] or null", None)


class WandbSettings(TargetSettings):
    offline: bool = what("true or false", True, strict=True)
    project: str = what("a project name", "pe-geometry", min_length=1)
    tags: list[Any] = what("a list of tags", [])  # a study tags runs with its group choices, which may be null


# -- top level -------------------------------------------------------------------------------------
class PathsSettings(Settings):
    output_dir: str = what("a directory path")
    cache_dir: str = what("a directory path")


class TopLevelSettings(Settings):
    """The keys of configs/train.yaml itself; each group is checked by ``check_node`` (or a model above)."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)
    seed: int = what(f"an integer in [0, {MAX_SEED}]", 0, ge=0, le=MAX_SEED)
    compile: bool = what("true or false (torch.compile the model)", False, strict=True)
    matmul_precision: Literal["highest", "high", "medium"] = what("one of ['highest', 'high', 'medium']", "highest")
    ckpt_path: str | None = what("a checkpoint path, 'last', 'auto' (last.ckpt if the run folder has one), or null", None)
    run_name: str = what("a string", "")
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


# The typed settings of each class we ship, by its ``_target_`` (Hydra accepts either spelling of Trainer).
SETTINGS: dict[str, type[TargetSettings]] = {
    "pe_geometry.model.DecoderLM": ModelSettings,
    "pe_geometry.model.EncoderMLM": EncoderSettings,
    "pe_geometry.model.EncoderDecoder": EncoderDecoderSettings,
    "pe_geometry.model.SinusoidalPE": SinusoidalSettings,
    "pe_geometry.model.LearnedPE": LearnedSettings,
    "pe_geometry.model.RotaryPE": RotarySettings,
    "pe_geometry.model.XPosPE": XPosSettings,
    "pe_geometry.model.T5BiasPE": T5BiasSettings,
    "pe_geometry.model.FirePE": FireSettings,
    "pe_geometry.model.CoPE": CoPESettings,
    "pe_geometry.model.TokenEmbedding": EmbeddingSettings,
    "pe_geometry.model.ExplicitAttention": AttentionSettings,
    "pe_geometry.model.SDPAttention": AttentionSettings,
    "pe_geometry.data.datamodule.TextDataModule": DataSettings,
    "pe_geometry.data.hf.HFDataModule": HFDataSettings,
    "pe_geometry.data.corpus.ShakespeareCorpus": ShakespeareSettings,
    "pe_geometry.data.corpus.TextFilesCorpus": TextFilesSettings,
    "lightning.Trainer": TrainerSettings,
    "lightning.pytorch.Trainer": TrainerSettings,
    "pe_geometry.training.callbacks.StepCheckpoint": CheckpointSettings,
    "pe_geometry.analysis.geometry_callback.GeometryCallback": GeometrySettings,
    "pe_geometry.training.progress.StepProgress": ProgressSettings,
    "pe_geometry.training.sample.SampleTextCallback": SampleSettings,
    "pe_geometry.training.throughput.TokenThroughputMonitor": ThroughputSettings,
    "lightning.pytorch.callbacks.LearningRateMonitor": LRMonitorSettings,
    "lightning.pytorch.callbacks.ModelCheckpoint": BestCheckpointSettings,
    "pe_geometry.training.callbacks.BestCheckpoint": BestCheckpointSettings,
    "lightning.pytorch.callbacks.EarlyStopping": EarlyStoppingSettings,
    "pe_geometry.training.callbacks.EarlyStop": EarlyStoppingSettings,
    "lightning.pytorch.loggers.WandbLogger": WandbSettings,
}
# The optimisers we ship, by ``_target_``: their keys are checked as a group of their own (unknown keys refused).
OPTIMIZERS: dict[str, type[Settings]] = {
    "pe_geometry.training.optimizer.adamw_warmup_cosine": OptimizerSettings,
}
# Constructor arguments the pipeline passes itself (the data's vocabulary, the model's width, ...): not config keys.
SUPPLIED = {
    "model": {"vocab_size", "mask_token_id", "pe", "embedding", "attention"},
    "pe": {"d_model", "n_heads"},
    "embedding": {"vocab_size", "d_model"},
    "attention": {"d_model", "n_heads", "pe", "dropout"},  # dropout: model.dropout
    "trainer": {"callbacks", "logger", "plugins"},
    "logger": {"resume_step", "config", "group", "job_type", "id", "resume"},
    "optimizer": {"model", "max_steps"},  # LanguageModelTask calls the bound factory with them
}


def import_class(target: str) -> type:
    """``a.b.C`` -> the class (the longest importable module prefix, then attributes), quietly: Hydra's
    ``get_class`` logs its own multi-line error before raising."""
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        if not callable(obj):
            raise ImportError(f"{target} is not a class or a function")
        return obj
    raise ImportError(f"no module named {parts[0]!r}")


def constructor_keys(cls: type) -> set[str] | None:
    """The keyword arguments ``cls(...)`` accepts, following ``**kwargs`` up the class hierarchy, or into the
    dataclass a class names as what its ``**kwargs`` build (``config_type``: a model layout's ``**settings``
    are the fields of ``ModelConfig``); None when the chain ends in a catch-all ``**kwargs`` (any key may be meant)."""
    names: set[str] = set()
    forwarded = getattr(cls, "config_type", None)
    if not isinstance(cls, type):  # a factory function as _target_: its own parameters
        params = inspect.signature(cls).parameters.values()
        if any(p.kind is p.VAR_KEYWORD for p in params):
            return None
        return {p.name for p in params if p.kind is not p.VAR_POSITIONAL}
    for klass in cls.__mro__:
        if "__init__" not in vars(klass) or klass is object:
            continue
        params = inspect.signature(vars(klass)["__init__"]).parameters.values()
        names |= {p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return names
        if dataclasses.is_dataclass(forwarded):
            return names | {field.name for field in dataclasses.fields(forwarded)}
    return None  # **kwargs all the way up (e.g. a logger forwarding to wandb.init)


def _show(value: Any) -> str:
    """A value as the user would type it on the command line."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, default=str).replace(" ", "")
    return str(value)


def _errors(key: str, model: type[BaseModel], values: dict[str, Any]) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """Validate ``values`` with ``model``: (key, error line) pairs and the coerced values of the keys given."""
    try:
        checked = model.model_validate(values)
    except ValidationError as err:
        lines = []
        for problem in err.errors():
            field = str(problem["loc"][0])
            info = model.model_fields.get(field)
            full = f"{key}.{field}" if key else field
            if problem["type"] == "extra_forbidden":
                valid = sorted(model.model_fields)
                lines.append((full, f"{full} is not a setting of {key or 'the config'}; valid: {valid}"))
            elif problem["type"] == "missing" and field not in values:
                lines.append((full, f"{full} is missing; it must be {info.description if info else 'set'}"))
            else:
                shown = values.get(field, problem["input"])
                meaning = info.description if info and info.description else problem["msg"]
                lines.append((full, f"{full}={_show(shown)} must be {meaning}"))
        return lines, {}
    given = set(values) & set(model.model_fields)
    return [], {k: v for k, v in checked.model_dump().items() if k in given}


def check_node(key: str, node: Any, option: str | None = None) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """Check one ``_target_`` node: its keys against the class's constructor, its values against ``SETTINGS``."""
    if not isinstance(node, dict) or "_target_" not in node:
        return [(key, f"{key}={_show(node)} must be a config node with a _target_ (a class to build)")], {}
    target = str(node["_target_"])
    try:
        cls = import_class(target)
    except (ImportError, AttributeError) as err:
        return [(key, f"{key}._target_={target} cannot be imported ({type(err).__name__}: {err})")], {}
    group = key.split(".", 1)[0]
    settings = {k: v for k, v in node.items() if k not in HYDRA_KEYS and not (isinstance(v, dict) and "_target_" in v)}
    accepted = constructor_keys(cls)
    if accepted is not None:
        accepted -= SUPPLIED.get(group, set())
        unknown = sorted(set(node) - HYDRA_KEYS - accepted)
        if unknown:
            name = f"{group}={option}" if option else f"{key} ({target})"
            valid = sorted(accepted) or f"none ({name} has no settings)"
            return [(f"{key}.{k}", f"{key}.{k} is not a setting of {name}; valid: {valid}") for k in unknown], {}
    model = SETTINGS.get(target)
    if model is None:
        return [], {}
    return _errors(key, model, settings)


def check_optimizer(node: Any, option: str | None = None) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """The optimizer group: one we ship is checked against its settings (``OPTIMIZERS``), any other ``_target_``
    (a user's own factory) against its parameters, like every other node."""
    if isinstance(node, dict) and node.get("_target_") in OPTIMIZERS:
        settings = {k: v for k, v in node.items() if k not in HYDRA_KEYS}
        return _errors("optimizer", OPTIMIZERS[node["_target_"]], settings)
    return check_node("optimizer", node, option)


def _choice(choices: dict[str, Any], group: str) -> str | None:
    value = choices.get(group)
    return None if value in (None, "None") else str(value)


def check_schema(cfg: DictConfig, choices: dict[str, Any] | None = None) -> None:
    """Every key of a composed train config: known, typed, in range. Raises SchemaError with one line
    (several problems joined by "; "). Coerced values are written back into ``cfg``."""
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
    for group in ("model", "pe", "embedding", "attention", "trainer"):
        if group in values:
            record(group, check_node(group, values[group], _choice(choices, group)))
    if "data" in values:
        record("data", check_node("data", values["data"], _choice(choices, "data")))
        corpus = values["data"].get("corpus") if isinstance(values["data"], dict) else None
        if corpus is not None:
            record("data.corpus", check_node("data.corpus", corpus))
    if "optimizer" in values:
        record("optimizer", check_optimizer(values["optimizer"], _choice(choices, "optimizer")))
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
                record(f"{group}.{name}", check_node(f"{group}.{name}", member, f"{_choice(choices, group)} ({name})"))
    if problems:
        # data.seed: ${seed} repeats seed's error: name the key the user set, not the ones that copy it
        own = [line for key, line in problems if not _is_interpolation(cfg, key)]
        raise SchemaError("; ".join(own or [line for _, line in problems]))
    _write_back(cfg, fixes, values)


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
