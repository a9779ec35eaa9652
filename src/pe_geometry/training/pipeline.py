"""Build everything a config names and train it. ``train.py`` is a thin Hydra wrapper around ``train``."""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import warnings
from contextlib import ExitStack
from importlib import metadata
from pathlib import Path

import pe_geometry.offline  # noqa: F401  (sets the offline environment before lightning/wandb load)

# isort: split

import lightning as L  # noqa: E402
import torch  # noqa: E402
from hydra.utils import get_class, instantiate, to_absolute_path  # noqa: E402
from lightning.pytorch.callbacks import LearningRateMonitor  # noqa: E402
from lightning.pytorch.utilities import rank_zero  # noqa: E402
from omegaconf import DictConfig, OmegaConf, open_dict  # noqa: E402

from pe_geometry.extras import without_unavailable_loggers  # noqa: E402
from pe_geometry.files import atomic_write_text  # noqa: E402
from pe_geometry.training import interrupt, wandb_run  # noqa: E402
from pe_geometry.training.callbacks import AtomicCheckpointIO, StepCheckpoint, remove_partial_writes  # noqa: E402
from pe_geometry.training.checkpoint_io import RunConfigInCheckpoint  # noqa: E402
from pe_geometry.training.interrupt import GracefulStop  # noqa: E402
from pe_geometry.training.lightning_compat import drop_wandb_init_argument  # noqa: E402
from pe_geometry.training.progress import ParameterSummary, ValidateAtEnd  # noqa: E402
from pe_geometry.training.resume import prepare_resume  # noqa: E402
from pe_geometry.training.run_folder import adopt_staged_output, claim_run_folder  # noqa: E402
from pe_geometry.training.run_loader import accepted_kwargs, build_datamodule, build_model  # noqa: E402
from pe_geometry.training.summary import run_summary  # noqa: E402
from pe_geometry.training.task import LanguageModelTask  # noqa: E402
from pe_geometry.training.threads import choose_threads, torch_default_threads  # noqa: E402
from pe_geometry.training.validate import ConfigError, check_config  # noqa: E402

log = logging.getLogger(__name__)
# Our datamodule restores the data position itself (see EpochShuffleSampler), so this warning is moot.
warnings.filterwarnings("ignore", message=".*resuming from a checkpoint that ended before the epoch ended.*")
warnings.filterwarnings("ignore", message=".*LeafSpec.*")  # a torch/lightning deprecation, not ours


class _NoAdverts(logging.Filter):
    """Lightning logs a "try installing litlogger" tip on every start; it says nothing about the run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in str(record.msg)


rank_zero.rank_zero_module.log.addFilter(_NoAdverts())


def one_line_per_lightning_record() -> None:
    """Lightning's package logger (``lightning``) has a stderr handler of its own and also passes each record on to the
    root logger, which Hydra has given a console and a train.log handler: every Lightning line ("GPU available: ...")
    came twice on the terminal. Where the root logger has handlers, Lightning's own is dropped; without them (Hydra's
    logging disabled, a notebook) it stays, and Lightning's lines still show."""
    if logging.getLogger().handlers:
        lightning_log = logging.getLogger("lightning")
        for handler in list(lightning_log.handlers):
            if type(handler) is logging.StreamHandler:
                lightning_log.removeHandler(handler)
PACKAGES = ("torch", "lightning", "hydra-core", "datasets", "tokenizers", "wandb", "numpy")


def _instantiate_all(group: DictConfig | None, **extra) -> list:
    """Instantiate each ``_target_`` node of a group; ``extra`` kwargs go to the nodes that declare them."""
    return [instantiate(node, **accepted_kwargs(node._target_, **extra))
            for node in (group or {}).values() if node is not None and "_target_" in node]


def _git_commit() -> str | None:
    try:
        root = Path(__file__).resolve().parents[1]
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except OSError:
        return None


def write_run_info(cfg: DictConfig, output_dir: Path, datamodule, model: torch.nn.Module, resume_step: int | None = None,
                   resume_changes: dict[str, tuple] | None = None) -> None:
    """Resolved config, package versions, git commit and data facts, saved beside the run.

    A resumed segment writes ``config-resume-step<N>.yaml`` (with the settings it changed) and
    ``run_info-resume-step<N>.json``, so the files of the first segment are never overwritten.
    """
    output_dir.mkdir(parents=True, exist_ok=True)
    suffix = "" if resume_step is None else f"-resume-step{resume_step}"
    text = OmegaConf.to_yaml(cfg, resolve=True)
    if resume_step is not None:
        changed = {k: {"checkpoint": old, "now": new} for k, (old, new) in (resume_changes or {}).items()}
        text += "\n" + OmegaConf.to_yaml({"resume": {"step": resume_step, "changed": changed}})
    atomic_write_text(output_dir / f"config{suffix}.yaml", text)
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
    atomic_write_text(output_dir / f"run_info{suffix}.json", json.dumps(info, indent=2))


def check_writable(output_dir: Path) -> None:
    """One line at start when the run folder cannot take a file: read-only, full, or a file in the way."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        # One probe per process (DDP ranks probe the same folder), named like the temp files a run start sweeps.
        probe = output_dir / f".write-test.{os.getpid()}.tmp"
        try:
            probe.write_bytes(b"ok")  # on a full disk the file is made, and the write fails when flushed
        finally:
            if probe.exists():
                probe.unlink()
    except OSError as err:
        raise ConfigError(f"paths.output_dir={output_dir} is not writable ({err.strerror})") from None


def absolute_input_paths(cfg: DictConfig) -> None:
    """Cache and input files resolve against the directory the user started in (Hydra's
    ``runtime.cwd``), so ``hydra.job.chdir=true`` neither rebuilds the cache in the run folder nor
    loses a relative text file; a missing file's error then names the absolute path tried."""
    with open_dict(cfg):
        for key in ("paths.cache_dir", "data.cache_dir"):
            if OmegaConf.select(cfg, key) is not None:
                OmegaConf.update(cfg, key, to_absolute_path(str(OmegaConf.select(cfg, key))))
        corpus = cfg.data.get("corpus") or {}
        for key in ("train_files", "val_files"):
            if key in corpus and not OmegaConf.is_missing(corpus, key) and corpus[key] is not None:
                files = corpus[key]  # one file may be given as a string: a list of one, not of its characters
                corpus[key] = [to_absolute_path(str(f)) for f in ([files] if isinstance(files, str) else files)]
        # data=hf: local files and a save_to_disk folder; a hub name or a builder name (parquet, json...) is kept as is
        files = cfg.data.get("data_files")
        if files is not None:
            if isinstance(files, str):
                cfg.data.data_files = to_absolute_path(files)
            elif OmegaConf.is_dict(files):
                for split, value in files.items():
                    files[split] = to_absolute_path(value) if isinstance(value, str) else [to_absolute_path(str(f)) for f in value]
            else:
                cfg.data.data_files = [to_absolute_path(str(f)) for f in files]
        path = cfg.data.get("path")
        if isinstance(path, str) and not OmegaConf.is_missing(cfg.data, "path") and Path(to_absolute_path(path)).is_dir():
            cfg.data.path = to_absolute_path(path)


def _hydra_task_overrides() -> tuple[list[str], dict]:
    """The command line's overrides and the group choices, when running under Hydra."""
    from hydra.core.hydra_config import HydraConfig

    try:
        hc = HydraConfig.get()
    except ValueError:
        return [], {}
    return list(hc.overrides.task), dict(hc.runtime.choices)


def build_loggers(cfg: DictConfig, run_config: dict, output_dir: Path, resume_step: int | None, wandb_id: str | None,
                  choices: dict) -> list:
    loggers = []
    nodes, missing = without_unavailable_loggers(cfg.logger)  # logger=default without wandb: CSV only, said once
    for line in missing:
        log.warning(line)
    for node in nodes.values():
        if node is None or "_target_" not in node:
            continue
        cls = get_class(node._target_)
        extra = accepted_kwargs(node._target_, resume_step=resume_step)
        if issubclass(cls, wandb_run.WandbLoggerClass()):
            extra = wandb_run.wandb_init_kwargs(run_config, output_dir, wandb_run.job_type(choices), wandb_id, resume_step, choices)
            extra["tags"] = [*map(str, node.get("tags") or []), *(cfg[g]._target_.rsplit(".", 1)[-1] for g in ("model", "pe"))]
            if node.get("group"):  # a study config that names its group keeps it
                extra["group"] = str(node.group)
        # partial first: `config` (W&B's run config, full of `_target_`s) must reach the logger as a plain dict
        logger = instantiate(node, _partial_=True)(**extra)
        if "job_type" in extra:
            # WandbLogger always passes `anonymous` (None by default), which this wandb deprecates with a warning
            drop_wandb_init_argument(logger, "anonymous")
        loggers.append(logger)
    for logger in loggers:
        if not wandb_run.wandb_loggers([logger]):
            logger.log_hyperparams(run_config)  # the CSV logger's hparams.yaml: the whole config, as W&B's
    return loggers


def build_callbacks(cfg: DictConfig, run_config: dict, has_logger: bool, choices: dict | None = None) -> list:
    callbacks = _instantiate_all(cfg.callbacks)
    if not has_logger:  # logger=none: the LR monitor would stop the run for want of somewhere to write
        callbacks = [cb for cb in callbacks if not isinstance(cb, LearningRateMonitor)]
    # The step checkpoint last (Lightning keeps the order among checkpoint callbacks): it saves after its step's
    # validation, so it must hold what every other callback made of that validation (the early stop's count, the
    # best val/loss of callbacks=early_stop).
    callbacks.sort(key=lambda cb: isinstance(cb, StepCheckpoint))
    if cfg.trainer.get("enable_model_summary", True):
        callbacks.append(ParameterSummary())
    # GracefulStop turns SIGTERM/Ctrl-C into a stop between optimiser steps, so the saved checkpoint is exact
    return [*callbacks, RunConfigInCheckpoint(run_config, choices), ValidateAtEnd(), GracefulStop()]


def check_batch_fits(cfg: DictConfig, datamodule) -> None:
    """A batch larger than the training split is a typo (data.batch_size=1e9 trained on every block at once)."""
    blocks = max(0, (datamodule.n_tokens("train") - 1) // int(cfg.data.seq_len))
    if int(cfg.data.batch_size) > blocks:
        raise ConfigError(f"data.batch_size={cfg.data.batch_size} is larger than the training split, which holds {blocks} blocks "
                          f"of data.seq_len={cfg.data.seq_len} tokens; valid: 1 to {blocks}")


def init_weights_from(cfg: DictConfig, model: torch.nn.Module, datamodule) -> None:
    """``init_from=DIR``: a new run starts from the weights of a transformers checkpoint folder (what pe-export writes,
    or any GPT-2 / GPT-NeoX folder whose config is what this run's config builds, key by key, and whose tokenizer, if it
    has one, is the run's), so its step 0 (the geometry callback's first record) is that model. Anything else is one
    ConfigError line naming the key that differs (model/export/folder.py)."""
    folder = cfg.get("init_from")
    if folder is None:
        return
    from pe_geometry.model.export import ExportError, read_folder

    path = Path(to_absolute_path(str(folder)))
    try:
        read_folder(model, path, getattr(datamodule, "tokenizer", None), int(cfg.data.seq_len))
    except ExportError as err:
        raise ConfigError(str(err)) from None
    log.info("init_from=%s: the model starts from that checkpoint's weights", path)


def train(cfg: DictConfig) -> dict[str, float]:
    """Check the config, build data/model/trainer, fit; returns the final logged metrics.

    On resume the checkpoint's config is checked and applied before anything is written. The run folder is this
    process's alone while it writes there (``run_folder.claim_run_folder``; ``RunFolderInUse`` if another live run
    holds it).
    """
    interrupt.run_starting()
    one_line_per_lightning_record()
    with ExitStack() as run_folder_lock:  # held until the run's last write (its summary, W&B's finish)
        return _train(cfg, run_folder_lock)


def _train(cfg: DictConfig, run_folder_lock: ExitStack) -> dict[str, float]:
    overrides, choices = _hydra_task_overrides()
    as_given = OmegaConf.to_container(cfg, resolve=False)  # before paths are made absolute: a resume keeps what derives from what
    absolute_input_paths(cfg)
    start = prepare_resume(cfg, overrides, choices, as_given)  # the checkpoint's config, checked: cfg is now the run's
    ckpt_path, output_dir, resume_step, resume_changes, choices = start.checkpoint, start.run_dir, start.step, start.changes, start.choices
    if ckpt_path is not None:
        absolute_input_paths(cfg)  # what the command line set, relative to where it was typed
    check_config(cfg)
    check_writable(output_dir)
    first_process = all(int(os.environ.get(k, 0)) == 0 for k in ("LOCAL_RANK", "NODE_RANK", "RANK", "SLURM_PROCID"))
    if first_process:  # (DDP's other ranks write into rank 0's folder, while rank 0 holds it)
        run_folder_lock.enter_context(claim_run_folder(output_dir))  # before anything of this run is written there
    if resume_step is not None and first_process:
        adopt_staged_output(output_dir, resume_step)  # the checks passed: the resume's .hydra/ and log join its run
    if int(os.environ.get("LOCAL_RANK", 0)) == 0 and int(os.environ.get("NODE_RANK", 0)) == 0:  # DDP's other ranks start later
        remove_partial_writes(output_dir)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    torch.set_float32_matmul_precision(cfg.get("matmul_precision", "highest"))
    if str(cfg.trainer.get("devices", 1)) == "1" and int(cfg.trainer.get("num_nodes", 1)) == 1:  # (DDP sets its own)
        n_threads, why = choose_threads(torch_default_threads())
        torch.set_num_threads(n_threads)
        log.info("torch threads: %d (%s)", n_threads, why)

    datamodule = build_datamodule(cfg)
    check_batch_fits(cfg, datamodule)
    model = build_model(cfg, datamodule)
    if ckpt_path is None:  # (a resumed run's weights are its checkpoint's)
        init_weights_from(cfg, model, datamodule)
    if cfg.compile:
        model.compile()
    task = LanguageModelTask(model, optimizer=instantiate(cfg.optimizer), max_steps=cfg.trainer.max_steps)

    run_config = OmegaConf.to_container(cfg, resolve=True)
    run_choices = choices
    loggers = build_loggers(cfg, run_config, output_dir, resume_step, start.wandb_id, choices)
    exit_code = 1
    try:
        trainer: L.Trainer = instantiate(
            cfg.trainer, callbacks=build_callbacks(cfg, run_config, bool(loggers), run_choices),
            logger=loggers or False,
            plugins=[AtomicCheckpointIO()],
            enable_model_summary=False,  # ParameterSummary (in build_callbacks) prints it when the config asks
        )
        if trainer.is_global_zero:
            write_run_info(cfg, output_dir, datamodule, model, resume_step, resume_changes)
        log.info(
            "%s: %s + %s, %d parameters, vocab %d, %d training tokens",
            cfg.run_name, type(model).__name__, cfg.pe._target_.rsplit(".", 1)[-1],
            sum(p.numel() for p in model.parameters()), datamodule.vocab_size, datamodule.n_tokens("train"),
        )
        try:
            # Our own checkpoints carry RNG states (numpy arrays), which torch's weights_only loader refuses.
            trainer.fit(task, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=False)
        except SystemExit as stop:
            if type(stop) is SystemExit and trainer.interrupted:
                raise KeyboardInterrupt from None  # Lightning ends a Ctrl-C in sys.exit(1); say what it was
            raise
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        if trainer.is_global_zero:
            wandb_run.log_end_of_run(loggers, trainer.callbacks)
            # every segment of a resumed run is its own offline folder with the same run id: upload them all
            wandb_dirs = [sorted(Path(lg.experiment.dir).parent.parent.glob(f"offline-run-*-{lg.version}"))
                          for lg in wandb_run.wandb_loggers(loggers)]
            log.info("%s", run_summary(metrics, trainer.callbacks, output_dir, wandb_dirs))
        exit_code = 0
    finally:
        wandb_run.finish(loggers, exit_code)  # the next job of a sweep (same process) must get its own run
    return metrics
