"""Train a Transformer from a Hydra config.

    python train.py                                  # decoder + sinusoidal PE on Shakespeare
    python train.py model=encoder pe=rope attention=mha
    python train.py -m pe=sinusoidal,learned,rope,alibi,none seed=0,1,2
"""

from __future__ import annotations

import logging
import sys

import hydra
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
    return metrics.get("val/loss")  # for Hydra sweepers that optimise a value


if __name__ == "__main__":
    main()
