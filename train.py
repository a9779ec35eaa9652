"""Train a Transformer from a Hydra config.

    python train.py                                  # decoder + sinusoidal PE on Shakespeare
    python train.py model=encoder pe=rope attention=explicit
    python train.py -m pe=sinusoidal,learned,rope,alibi,none seed=0,1,2
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

import hydra
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig

from data.corpus import CorpusError
from training.task import NonFiniteLossError
from training.validate import ConfigError

log = logging.getLogger("train")


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> float | None:
    from training.pipeline import train  # heavy imports after Hydra has parsed the command line

    try:
        metrics = train(cfg)
    except (ConfigError, CorpusError) as err:
        log.error("error: %s", err)
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except NonFiniteLossError as err:
        log.error("error: %s", err)
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    except SIGTERMException:
        # Lightning raises it (a SystemExit with status 0) once StepCheckpoint has saved last.ckpt;
        # exit 143 = 128 + SIGTERM so a scheduler does not take a pre-empted run for a finished one.
        print(f"error: stopped by SIGTERM; resume with ckpt_path={cfg.paths.output_dir}/checkpoints/last.ckpt", file=sys.stderr)
        sys.exit(128 + signal.SIGTERM)
    return metrics.get("val/loss")  # for Hydra sweepers that optimise a value


def unusable_run_dir(argv: list[str]) -> str | None:
    """Hydra creates ``hydra.run.dir``/``hydra.sweep.dir`` before ``main`` runs and reports a failure
    as a traceback: check an explicitly given one first, so it is one line like any bad input."""
    for arg in argv:
        key, sep, value = arg.partition("=")
        value = value.strip("'\"")
        if not sep or key.lstrip("+") not in ("hydra.run.dir", "hydra.sweep.dir") or "${" in value:
            continue
        path = Path(value).expanduser().absolute()
        existing = next(p for p in (path, *path.parents) if p.exists())
        if not existing.is_dir():
            return f"{key}={value} cannot be created: {existing} is a file, not a directory"
        if not os.access(existing, os.W_OK):
            return f"{key}={value} cannot be created: {existing} is not writable"
    return None


if __name__ == "__main__":
    if problem := unusable_run_dir(sys.argv[1:]):
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    main()
