"""Names of runs and output folders, as OmegaConf resolvers the configs use.

Importing this module registers them (``${run_folder_name:...}`` in configs/hydra/default.yaml,
``${arm:...}`` and ``${sweep_job_name:...}`` in configs/train.yaml's run_name and the sweep's job folders).
It imports nothing heavy, so train.py's ``--help`` stays fast.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from omegaconf import OmegaConf

MAX_NAME_CHARS = 120  # file systems allow 255 bytes per folder name; keep room for the time prefix


def run_folder_name(experiment: str | None, model: str, pe: str, overrides: str = "") -> str:
    """``quick_decoder-rope_trainer.max_steps-20+model.d_model-64``: what ran and the overrides that tell
    it apart (noise keys are excluded in configs/hydra/default.yaml). Only characters a Hydra override
    value and a shell word take unquoted, so the folder can be passed back as ``ckpt_path=<folder>/...``;
    a long override list is cut and given a short hash, so two different runs never share a name."""
    return safe_name("_".join(part for part in (experiment or "default", f"{model}-{pe}", overrides) if part))


def safe_name(name: str) -> str:
    """Only characters a Hydra override value and a shell word take unquoted; cut to MAX_NAME_CHARS with a hash.
    A structured value stays readable: ``model.layer_pattern=[{},{},{pe: none}]`` ->
    ``model.layer_pattern--same-same-pe-none`` (an empty entry, a layer like the model's, is ``same``; each run of
    other characters one ``-``; none at the end)."""
    name = re.sub(r"[^A-Za-z0-9_.+-]+", "-", name.replace("{}", "same")).rstrip("-") or "-"
    if len(name) > MAX_NAME_CHARS:
        name = name[: MAX_NAME_CHARS - 9] + "_" + hashlib.sha1(name.encode()).hexdigest()[:8]
    return name


def hydra_value(text: str) -> str:
    """``text`` as the value of a Hydra override: bare where Hydra's lexer reads it as one string, else single-quoted
    with Hydra's escapes (a space, '=' or ',' in a bare value is a parse error or another override)."""
    if text and all(c.isalnum() or c in "_-./:+@~" for c in text):
        return text
    # Inside quotes Hydra reads a backslash as an escape only before a quote (or the closing one): double those runs
    escaped = re.sub(r"(\\+)(?=')|(\\+)$", lambda m: m.group(0) * 2, text)
    return "'" + escaped.replace("'", "\\'") + "'"


def arm_name(model: str, pe: str, control: str | None = None) -> str:
    """``decoder-learned``, or ``decoder-learned-untied_head`` for a control arm: a sweep's run names and
    job folders must tell its arms apart (configs/control/; ``baseline`` and ``<pe>_baseline`` are the study itself)."""
    if control is not None and (str(control) == "baseline" or str(control).endswith("_baseline")):
        control = None
    return "-".join(str(part) for part in (model, pe, control) if part not in (None, "", "None", "null"))


# What a sweep job's name carries already (the arm and the seed, ``decoder-learned-untied_head-s0``)
IN_JOB_NAME = ("model", "pe", "control", "seed")


def sweep_job_name(base: str) -> str:
    """``decoder-sinusoidal-s0_optimizer.lr-0.002``: in a ``-m`` sweep, ``base`` (the arm and the seed) and this
    job's values of the other keys the sweep varies, so its folder and W&B run say what sets it apart. Noise keys
    (hydra.job.config.override_dirname.exclude_keys: paths, cadence, logger) are left out as in a run folder's
    name. ``base`` alone in a single run and in a sweep over the arm and seed only (the studies)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return base
    hydra = HydraConfig.get()
    dirname = hydra.job.config.override_dirname
    # experiment is in a run folder's name (so excluded from override_dirname), not in a job's
    left_out = (set(dirname.exclude_keys) - {"experiment"}) | set(IN_JOB_NAME)
    varied = swept_keys(Path(hydra.runtime.cwd, hydra.sweep.dir)) - left_out  # (a job may run in its own folder: chdir)
    items = sorted(o for o in hydra.overrides.task if o.split("=", 1)[0].lstrip("~+") in varied)
    if not items:
        return base
    return safe_name(base + "_" + dirname.item_sep.join(items).replace("=", dirname.kv_sep))


def swept_keys(sweep_dir: Path) -> set[str]:
    """The keys a sweep varies (``optimizer.lr=1e-3,2e-3``, ``seed=range(3)``, ``hydra.sweeper.params``), read from
    the ``multirun.yaml`` Hydra's sweeper saves in the sweep folder before it launches a job: a job's own config
    holds only its values, whatever launcher (and machine) runs it, so this file is where it can see the sweep."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    path = sweep_dir / "multirun.yaml"
    if not path.is_file():  # a sweeper that does not save it
        return set()
    master = OmegaConf.load(path)
    params = OmegaConf.to_container(OmegaConf.select(master, "hydra.sweeper.params") or OmegaConf.create(), resolve=False)
    lines = [*(f"{key}={value}" for key, value in params.items()), *master.hydra.overrides.task]
    return {o.key_or_group for o in OverridesParser.create().parse_overrides(lines) if o.is_sweep_override()}


OmegaConf.register_new_resolver("run_folder_name", run_folder_name, replace=True)
OmegaConf.register_new_resolver("arm", arm_name, replace=True)
OmegaConf.register_new_resolver("sweep_job_name", sweep_job_name, replace=True)
