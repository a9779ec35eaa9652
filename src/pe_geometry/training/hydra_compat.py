"""Every use of Hydra's private API, and of its launcher plugins', one named function each: the one module to read when
Hydra or a launcher plugin changes.

pyproject.toml allows ``hydra-core>=1.3.2,<1.4``, ``hydra-joblib-launcher`` and ``hydra-submitit-launcher``
``>=1.2,<1.3`` and ``joblib>=1.2,<2``; each function says the versions it was checked at, and
``tests/test_hydra_compat.py`` runs every one against the real Hydra and plugins, which CI does at both bounds
(``.ci/run``: the newest allowed versions, then the lowest, ``.ci/lowest_constraints.py``). Why each is needed (there is
no public way to do it) is said where it is used: ``training.sweep`` (a failed job's error),
``hydra_plugins.pe_geometry.launchers`` (the launchers that go on past a killed job), ``tests/conftest.py`` (a test's
config composed from a cached one) and ``tests/test_processes.py`` (a signal while Hydra composes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from hydra.core.utils import JobReturn
from omegaconf import DictConfig


# -- a job's result -------------------------------------------------------------------------------------------------
def job_error(job_return: JobReturn) -> Any:
    """What a job that failed raised, without raising it again (``JobReturn.return_value`` re-raises it and writes
    to stderr). Checked at hydra-core 1.3.2 and 1.3.8 (``JobReturn._return_value``, which its setter sets)."""
    return job_return._return_value


# -- composing ------------------------------------------------------------------------------------------------------
def is_group_choice(override: Any) -> bool:
    """Whether Hydra takes a parsed override (``OverridesParser.parse_overrides``) as the choice of a config group's
    option (``pe=rope``: it builds the defaults list) rather than a value applied to the composed config
    (``model.d_model=32``, ``~callbacks.sample``, ``pe={...}``). Hydra must be initialised (``initialize_config_dir``).
    Checked at hydra-core 1.3.2 and 1.3.8 (the split of ``hydra._internal.defaults_list.Overrides.__init__``, on
    ``ConfigLoaderImpl.repository``)."""
    from hydra.core.global_hydra import GlobalHydra

    repository = GlobalHydra.instance().config_loader().repository  # type: ignore[attr-defined]
    return repository.group_exists(override.key_or_group) and not isinstance(override.value(), dict)


def apply_overrides(overrides: Sequence[Any], cfg: DictConfig) -> None:
    """Apply parsed overrides that are not group choices to a composed ``cfg``, in order, as Hydra's compose does after
    it has built the config from the defaults list (``key=value``, ``+key=value``, ``++key=value``, ``~key``). Checked at
    hydra-core 1.3.2 and 1.3.8 (``ConfigLoaderImpl._apply_overrides_to_config``)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    ConfigLoaderImpl._apply_overrides_to_config(list(overrides), cfg)


def override_dirname(overrides: Sequence[Any], job_config: DictConfig) -> str:
    """``hydra.job.override_dirname`` for parsed overrides, as Hydra writes it when it composes (``job_config``: the
    composed ``hydra.job.config``). Checked at hydra-core 1.3.2 and 1.3.8
    (``hydra._internal.config_loader_impl.get_overrides_dirname``)."""
    from hydra._internal.config_loader_impl import get_overrides_dirname

    settings = job_config.override_dirname
    return get_overrides_dirname(overrides=list(overrides), kv_sep=settings.kv_sep, item_sep=settings.item_sep,
                                 exclude_keys=settings.exclude_keys)


@contextmanager
def calling_when_composing(hook: Callable[[], None]) -> Iterator[None]:
    """While it lasts, ``hook()`` runs each time Hydra starts composing a config (``@hydra.main`` before it makes the
    run folder, ``compose``). Checked at hydra-core 1.3.2 and 1.3.8 (``ConfigLoaderImpl.load_configuration``)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    real = ConfigLoaderImpl.load_configuration

    def load_configuration(self, *args, **kwargs):
        hook()
        return real(self, *args, **kwargs)

    ConfigLoaderImpl.load_configuration = load_configuration
    try:
        yield
    finally:
        ConfigLoaderImpl.load_configuration = real


# -- the launcher plugins -------------------------------------------------------------------------------------------
def execute_joblib_job(idx: int, overrides: Sequence[str], hydra_context: Any, config: DictConfig,
                       task_function: Callable, singleton_state: dict) -> JobReturn:
    """Run one sweep job as the joblib launcher runs it in its worker: the job's config composed, its folder made,
    ``task_function`` called. Checked at hydra-joblib-launcher 1.2.0 (``hydra_plugins.hydra_joblib_launcher._core
    .execute_job``)."""
    from hydra_plugins.hydra_joblib_launcher._core import execute_job

    return execute_job(idx, overrides, hydra_context, config, task_function, singleton_state)


def joblib_thread_variables() -> tuple[str, ...]:
    """The environment variables joblib sets in its loky workers to size their thread pools (``OMP_NUM_THREADS``,
    ``MKL_NUM_THREADS``, ...). Checked at joblib 1.2.0 and 1.6.0 (``joblib._parallel_backends.ParallelBackendBase
    .MAX_NUM_THREADS_VARS``)."""
    from joblib._parallel_backends import ParallelBackendBase

    return tuple(ParallelBackendBase.MAX_NUM_THREADS_VARS)


def submitit_job(job: Any) -> tuple[int, list[str]]:
    """(the sweep job's number, its overrides) of a submitit job the submitit plugin submitted: the plugin maps its
    launcher over (overrides, job folder key, number, job id, Hydra's state). Checked at hydra-submitit-launcher 1.2.0
    (``BaseSubmititLauncher.launch``'s ``job_params``)."""
    overrides, _, num, *_ = job.submission().args
    return num, list(overrides)


@contextmanager
def submitit_results_read_by(read: Callable[[Callable, Any], list[JobReturn]]) -> Iterator[None]:
    """While it lasts, the submitit plugin reads each job's result as ``read(results, job)`` (``results``: submitit's
    own ``Job.results``). The plugin waits for its jobs inside its own ``launch``, in order, by ``Job.results()`` of
    each: the one place where a job that died (and so has no result) can be caught. Checked at hydra-submitit-launcher
    1.2.0 (``BaseSubmititLauncher.launch``) with submitit 1.5.4."""
    from unittest import mock

    from submitit.core.core import Job

    results = Job.results

    def read_results(job: Any) -> list[JobReturn]:
        return read(results, job)

    with mock.patch.object(Job, "results", read_results):
        yield
