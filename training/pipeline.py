"""Build everything a config names and train it. ``train.py`` is a thin Hydra wrapper around ``train``."""

from __future__ import annotations

import inspect
import json
import logging
import platform
import subprocess
import warnings
from importlib import metadata
from pathlib import Path

import offline  # noqa: F401  (sets the offline environment before lightning/wandb load)

# isort: split

import lightning as L  # noqa: E402
import torch  # noqa: E402
from hydra.utils import get_class, instantiate  # noqa: E402
from omegaconf import DictConfig, OmegaConf, open_dict  # noqa: E402

from training.callbacks import AtomicCheckpointIO  # noqa: E402
from training.task import LanguageModelTask  # noqa: E402
from training.validate import ConfigError, check_config  # noqa: E402

log = logging.getLogger(__name__)
# Our datamodule restores the data position itself (see EpochShuffleSampler), so this warning is moot.
warnings.filterwarnings("ignore", message=".*resuming from a checkpoint that ended before the epoch ended.*")
warnings.filterwarnings("ignore", message=".*litlogger.*")
warnings.filterwarnings("ignore", message=".*LeafSpec.*")  # a torch/lightning deprecation, not ours
PACKAGES = ("torch", "lightning", "hydra-core", "datasets", "tokenizers", "wandb", "numpy")


def build_model(cfg: DictConfig, datamodule) -> torch.nn.Module:
    """Instantiate the model from its group configs plus the facts only the data knows."""
    facts = {"vocab_size": datamodule.vocab_size, "mask_token_id": datamodule.mask_token_id}
    wanted = inspect.signature(get_class(cfg.model._target_)).parameters
    return instantiate(
        cfg.model,
        pe=instantiate(cfg.pe),
        embedding=instantiate(cfg.embedding),
        attention=instantiate(cfg.attention),
        **{k: v for k, v in facts.items() if k in wanted},
    )


def _instantiate_all(group: DictConfig | None, **extra) -> list:
    """Instantiate each ``_target_`` node of a group; ``extra`` kwargs go to the nodes that declare them."""
    objects = []
    for node in (group or {}).values():
        if node is None or "_target_" not in node:
            continue
        wanted = inspect.signature(get_class(node._target_)).parameters
        objects.append(instantiate(node, **{k: v for k, v in extra.items() if k in wanted}))
    return objects


def resolve_checkpoint(ckpt_path: str | None, output_dir: Path) -> tuple[Path | None, Path, int | None]:
    """Where to resume from, which run directory to continue, and at which step.

    ``ckpt_path=last`` means this run directory's ``checkpoints/last.ckpt``. A
    checkpoint inside ``<run>/checkpoints/`` continues that run's directory, so its
    CSV series and later checkpoints stay in one place. The file is read once here,
    so a truncated or foreign file is one clear error instead of a traceback mid-setup.
    """
    if ckpt_path is None:
        return None, output_dir, None
    path = output_dir / "checkpoints" / "last.ckpt" if str(ckpt_path) == "last" else Path(ckpt_path).expanduser()
    if not path.is_file():
        raise ConfigError(f"ckpt_path={ckpt_path}: no checkpoint file at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
        step = int(state["global_step"])
        state["state_dict"], state["optimizer_states"]  # noqa: B018 - a Lightning checkpoint has both
    except Exception as err:
        raise ConfigError(f"ckpt_path={path} is not a readable Lightning checkpoint ({type(err).__name__}: {err})") from None
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else output_dir
    return path, run_dir, step


def _git_commit() -> str | None:
    try:
        root = Path(__file__).resolve().parents[1]
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except OSError:
        return None


def write_run_info(cfg: DictConfig, output_dir: Path, datamodule, model: torch.nn.Module) -> None:
    """Resolved config, package versions, git commit and data facts, saved beside the run."""
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
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
    (output_dir / "run_info.json").write_text(json.dumps(info, indent=2))


def check_writable(output_dir: Path) -> None:
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe = output_dir / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"paths.output_dir={output_dir} is not writable ({err.strerror})") from None


def train(cfg: DictConfig) -> dict[str, float]:
    """Check the config, build data/model/trainer, fit; returns the final logged metrics."""
    check_config(cfg)
    ckpt_path, output_dir, resume_step = resolve_checkpoint(cfg.ckpt_path, Path(cfg.paths.output_dir))
    if output_dir != Path(cfg.paths.output_dir):
        log.info("resuming %s at step %d: continuing in %s", ckpt_path, resume_step, output_dir)
        with open_dict(cfg):
            cfg.paths.output_dir = str(output_dir)  # checkpoints and logs continue in the original run
    check_writable(output_dir)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    torch.set_float32_matmul_precision(cfg.get("matmul_precision", "highest"))

    datamodule = instantiate(cfg.data)
    if not isinstance(datamodule, L.LightningDataModule):
        raise ConfigError(f"data._target_={cfg.data._target_} did not build a LightningDataModule")
    datamodule.prepare_data()
    datamodule.setup("fit")
    model = build_model(cfg, datamodule)
    if cfg.compile:
        model.compile()
    task = LanguageModelTask(model, max_steps=cfg.trainer.max_steps, **OmegaConf.to_container(cfg.optimizer, resolve=True))

    loggers = _instantiate_all(cfg.logger, resume_step=resume_step)
    trainer: L.Trainer = instantiate(
        cfg.trainer, callbacks=_instantiate_all(cfg.callbacks), logger=loggers or False, plugins=[AtomicCheckpointIO()]
    )
    if trainer.is_global_zero:
        write_run_info(cfg, output_dir, datamodule, model)
    log.info(
        "%s: %s + %s, %d parameters, vocab %d, %d training tokens",
        cfg.run_name, type(model).__name__, cfg.pe._target_.rsplit(".", 1)[-1],
        sum(p.numel() for p in model.parameters()), datamodule.vocab_size, datamodule.n_tokens("train"),
    )
    # Our own checkpoints carry RNG states (numpy arrays), which torch's weights_only loader refuses.
    trainer.fit(task, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=False)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    log.info("finished: %s; outputs in %s", {k: round(v, 4) for k, v in metrics.items()}, output_dir)
    return metrics
