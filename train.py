"""Train a Transformer from a Hydra config.

    python train.py                                  # decoder + sinusoidal PE on Shakespeare
    python train.py model=encoder pe=rope attention=explicit
    python train.py -m pe=sinusoidal,learned,rope,alibi,none seed=0,1,2
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import signal
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

# Nothing here imports torch or Lightning: `--help`, `--cfg job` and tab completion answer before
# they would load (measured by `python experiments/benchmark.py --cli`).
log = logging.getLogger("train")
MAX_NAME_CHARS = 120  # file systems allow 255 bytes per folder name; keep room for the time prefix


def run_folder_name(experiment: str | None, model: str, pe: str, overrides: str = "") -> str:
    """``quick_decoder-rope_trainer.max_steps-20+model.d_model-64``: what ran and the overrides that tell
    it apart (noise keys are excluded in configs/hydra/default.yaml). Only characters a Hydra override
    value and a shell word take unquoted, so the folder can be passed back as ``ckpt_path=<folder>/...``;
    a long override list is cut and given a short hash, so two different runs never share a name."""
    name = "_".join(part for part in (experiment or "default", f"{model}-{pe}", overrides) if part)
    name = re.sub(r"[^A-Za-z0-9_.+-]", "-", name)
    if len(name) > MAX_NAME_CHARS:
        name = name[: MAX_NAME_CHARS - 9] + "_" + hashlib.sha1(name.encode()).hexdigest()[:8]
    return name


OmegaConf.register_new_resolver("run_folder_name", run_folder_name, replace=True)


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> float | None:
    # heavy imports after Hydra has parsed the command line
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from data.corpus import CorpusError
    from training.pipeline import resume_command, train
    from training.task import NonFiniteLossError
    from training.validate import ConfigError

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
        print(f"error: stopped by SIGTERM; resume with {resume_command(cfg)}", file=sys.stderr)
        sys.exit(128 + signal.SIGTERM)
    except KeyboardInterrupt:
        # StepCheckpoint saved last.ckpt on the way out; exit 1 as Lightning's own Ctrl-C handler does.
        print(f"error: interrupted (Ctrl-C); resume with {resume_command(cfg)}", file=sys.stderr)
        sys.exit(1)
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
