"""Names of runs and output folders, as OmegaConf resolvers the configs use.

Importing this module registers them (``${run_folder_name:...}`` in configs/hydra/default.yaml,
``${arm:...}`` in configs/train.yaml's run_name and the sweep's job folders). It imports nothing heavy,
so train.py's ``--help`` stays fast.
"""

from __future__ import annotations

import hashlib
import re

from omegaconf import OmegaConf

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


def arm_name(model: str, pe: str, control: str | None = None) -> str:
    """``decoder-learned``, or ``decoder-learned-untied_head`` for a control arm: a sweep's run names and
    job folders must tell its arms apart (configs/control/; ``baseline`` and ``<pe>_baseline`` are the study itself)."""
    if control is not None and (str(control) == "baseline" or str(control).endswith("_baseline")):
        control = None
    return "-".join(str(part) for part in (model, pe, control) if part not in (None, "", "None", "null"))


OmegaConf.register_new_resolver("run_folder_name", run_folder_name, replace=True)
OmegaConf.register_new_resolver("arm", arm_name, replace=True)
