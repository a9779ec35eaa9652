"""One W&B run per training job, with the whole config, grouped by sweep, finished whatever happens.

- ``wandb_init_kwargs``: what ``WandbLogger`` passes to ``wandb.init`` beyond the yaml: the resolved
  config nested as in the yaml (so ``pe``, ``model.d_model``, ``seed`` can be filtered and grouped),
  ``group`` (the sweep folder of a ``-m`` call, identical in every job whatever the launcher; a
  single run is its own group), ``job_type`` (the experiment), and on resume the earlier run's id.
- ``finish``: ``wandb.finish`` for this job's run (with the exit code on failure), so the next job
  of a basic-launcher sweep, which runs in the same process, starts its own run.
- ``log_end_of_run``: the charts and tables callbacks offer for the end of the run (the ``WandbSummary``
  protocol, e.g. headline figures against their chance and a table at initialisation and at the end).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

log = logging.getLogger(__name__)


def WandbLoggerClass() -> type:  # noqa: N802 - stands for the class
    from lightning.pytorch.loggers import WandbLogger

    return WandbLogger


def wandb_loggers(loggers: Iterable) -> list:
    return [lg for lg in loggers if isinstance(lg, WandbLoggerClass())]


def sweep_group(output_dir: Path) -> str:
    """The W&B group: ``<sweep dir>`` for a job of a ``-m`` call, the run folder's name otherwise.

    Hydra resolves ``hydra.sweep.dir`` once, in the launching process, so it is the same string in
    every job (a ``${now:...}`` in the logger config is not: each joblib worker resolves its own).
    """
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        if hc.mode == RunMode.MULTIRUN:
            sweep = Path(hc.sweep.dir)
            return f"{sweep.parent.name}_{sweep.name}" if sweep.parent.name else sweep.name
    except ValueError:  # no Hydra context (a test composing the config itself)
        pass
    return output_dir.name


CHOICE_GROUPS = ("model", "pe", "embedding", "attention", "data", "experiment")


def wandb_init_kwargs(
    run_config: dict[str, Any], output_dir: Path, job_type: str, resume_id: str | None, resumed_from_step: int | None,
    choices: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``WandbLogger`` (passed on to ``wandb.init``).

    ``choices`` (the command line's group options, e.g. ``pe: rope``) become ``config.choices`` so
    runs group by option name; a resumed run leaves them out (its command line does not name them).
    """
    config = dict(run_config)
    if choices and resumed_from_step is None:
        config["choices"] = {g: choices.get(g) for g in CHOICE_GROUPS}
    kwargs: dict[str, Any] = {"group": sweep_group(output_dir), "job_type": job_type, "config": config}
    if resume_id is not None:
        # Offline W&B writes the resumed segment to a new offline-run-* folder with the same id;
        # `wandb sync` of both folders gives one run online. The link is kept in the config as well.
        kwargs |= {"id": resume_id, "resume": "allow"}
        config["resumed_from"] = {"wandb_run_id": resume_id, "step": resumed_from_step}
    return kwargs


def job_type(hydra_choices: dict[str, Any] | None) -> str:
    """The experiment's name (``experiment=quick`` -> ``quick``), ``default`` without one."""
    return str((hydra_choices or {}).get("experiment") or "default")


@dataclass(frozen=True)
class LineChart:
    """Lines over a shared x axis: ``ys[i]`` is the line named ``keys[i]``."""

    xs: list[int]
    ys: list[list[float]]
    keys: list[str]
    title: str
    xname: str = "step"


@dataclass(frozen=True)
class Table:
    columns: list[str]
    rows: list[list[Any]]


@runtime_checkable
class WandbSummary(Protocol):
    """A callback with charts and tables for the end of the run: W&B key -> LineChart or Table."""

    def wandb_summary(self) -> dict[str, LineChart | Table]: ...


def log_end_of_run(loggers: Iterable, callbacks: Iterable) -> None:
    """Log what the callbacks offering ``wandb_summary`` have for the end of the run to every W&B run."""
    runs = [lg.experiment for lg in wandb_loggers(loggers)]
    summary = {key: item for cb in callbacks if isinstance(cb, WandbSummary) for key, item in cb.wandb_summary().items()}
    if not runs or not summary:
        return
    import wandb

    def drawn(item: LineChart | Table) -> Any:
        if isinstance(item, Table):
            return wandb.Table(columns=item.columns, data=item.rows)
        return wandb.plot.line_series(xs=item.xs, ys=item.ys, keys=item.keys, title=item.title, xname=item.xname)

    charts = {key: drawn(item) for key, item in summary.items()}
    for run in runs:
        run.log(charts)


def finish(loggers: Iterable, exit_code: int) -> None:
    """End this job's W&B run (exit code 0 = finished, else failed); a no-op if none was started."""
    for lg in wandb_loggers(loggers):
        from pe_geometry.training.lightning_compat import started_experiment  # (Lightning is loaded by then)

        started = started_experiment(lg)
        if started is not None:  # started: finishing an unstarted logger would start one
            started.finish(exit_code=exit_code)
