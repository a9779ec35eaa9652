"""Every function of ``training.hydra_compat`` (our only uses of Hydra's private API, and of its launcher plugins')
against the real Hydra, on a two-file app of its own: CI runs this at the newest and at the lowest allowed Hydra and
plugins (``.ci/run``), so a release that moves one of them fails here, by name, rather than somewhere inside a sweep
or a test's composition."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.singleton import Singleton
from hydra.core.utils import JobStatus, run_job
from hydra.types import HydraContext
from omegaconf import DictConfig, OmegaConf, open_dict

from pe_geometry.training import hydra_compat as compat

QUIET = ["hydra/job_logging=none", "hydra/hydra_logging=none"]  # (a job leaves the tests' logging as it was)


@pytest.fixture
def app(tmp_path):
    """A Hydra app of two files (``x``, and a group ``g`` with options a and b), initialised; its sweep folder in
    tmp_path."""
    root = tmp_path / "conf"
    (root / "g").mkdir(parents=True)
    (root / "config.yaml").write_text("defaults:\n  - g: a\n  - _self_\nx: 1\n")
    (root / "g" / "a.yaml").write_text("v: 1\n")
    (root / "g" / "b.yaml").write_text("v: 2\nw: 3\n")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(root), version_base="1.3"):
        yield tmp_path
    GlobalHydra.instance().clear()


def composed(tmp_path: Path, overrides: list[str]) -> DictConfig:
    return compose(config_name="config", overrides=[*overrides, *QUIET, f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                   return_hydra_config=True)


class NoCallbacks:
    """Hydra's callbacks, none (what a HydraContext carries: run_job calls these two)."""

    def on_job_start(self, **kwargs) -> None:
        pass

    def on_job_end(self, **kwargs) -> None:
        pass


def context() -> HydraContext:
    return HydraContext(config_loader=GlobalHydra.instance().config_loader(), callbacks=NoCallbacks())


def task(cfg: DictConfig) -> int:
    if cfg.x < 0:
        raise ValueError(f"x={cfg.x}")
    return cfg.x


# -- a job's result -------------------------------------------------------------------------------------------------
def test_a_failed_jobs_error_is_read_without_raising_it(app, capsys):
    cfg = composed(app, ["x=-1", "hydra.job.num=0"])
    ret = run_job(hydra_context=context(), task_function=task, config=cfg, job_dir_key="hydra.sweep.dir",
                  job_subdir_key="hydra.sweep.subdir")
    assert ret.status == JobStatus.FAILED
    error = compat.job_error(ret)
    assert isinstance(error, ValueError) and str(error) == "x=-1" and capsys.readouterr().err == ""
    with pytest.raises(ValueError):
        ret.return_value  # noqa: B018 - what the public property does instead


# -- composing ------------------------------------------------------------------------------------------------------
def test_a_config_composed_from_its_group_choices_then_the_other_overrides_is_hydras_own(app):
    overrides = ["g=b", "x=5", "+y.z=1", "~g.w", "g.v=7"]
    parsed = OverridesParser.create().parse_overrides(overrides)
    assert [compat.is_group_choice(o) for o in parsed] == [True, False, False, False, False]
    assert not compat.is_group_choice(OverridesParser.create().parse_overrides(["g={v: 9}"])[0])  # a value, not a choice

    whole = composed(app, overrides)
    cfg = composed(app, ["g=b"])
    compat.apply_overrides([o for o in parsed if not compat.is_group_choice(o)], cfg)
    without_hydra = {k: v for k, v in OmegaConf.to_container(cfg).items() if k != "hydra"}
    assert without_hydra == {k: v for k, v in OmegaConf.to_container(whole).items() if k != "hydra"} == {
        "g": {"v": 7}, "x": 5, "y": {"z": 1}}
    assert compat.override_dirname(parsed, whole.hydra.job.config) == whole.hydra.job.override_dirname == (
        "+y.z=1,g.v=7,g=b,x=5,~g.w")


def test_a_hook_runs_while_hydra_composes_and_only_then(app):
    calls = []
    with compat.calling_when_composing(lambda: calls.append(1)):
        assert not calls
        composed(app, [])
        assert calls
    seen = len(calls)
    composed(app, [])
    assert len(calls) == seen


# -- the launcher plugins -------------------------------------------------------------------------------------------
def test_a_joblib_job_runs_as_the_plugin_runs_it(app):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    cfg = composed(app, [])
    with open_dict(cfg):
        cfg.hydra.job.name = "app"
    ret = compat.execute_joblib_job(3, ["x=2"], context(), cfg, task, Singleton.get_state())
    assert ret.status == JobStatus.COMPLETED and ret.return_value == 2
    assert ret.hydra_cfg.hydra.job.num == 3 and ret.hydra_cfg.hydra.job.id == "app_3"
    output = Path(ret.hydra_cfg.hydra.runtime.output_dir)
    assert (output / ".hydra" / "overrides.yaml").is_file() and output.parent == app / "sweep"


def test_the_thread_variables_are_joblibs():
    pytest.importorskip("joblib")
    names = compat.joblib_thread_variables()
    assert "OMP_NUM_THREADS" in names and "MKL_NUM_THREADS" in names and all(isinstance(n, str) for n in names)


@pytest.mark.slow  # two submitit jobs in subprocesses of their own
def test_the_submitit_plugin_reads_each_result_through_us(app):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    import cloudpickle
    from hydra.core.plugins import Plugins

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the jobs need not import the tests' package
    cfg = composed(app, ["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5"])
    launcher = Plugins.instance().instantiate_launcher(hydra_context=context(), task_function=task, config=cfg)
    read = []

    def reader(results, job):
        read.append(compat.submitit_job(job))
        return results(job)

    with compat.submitit_results_read_by(reader):
        returns = launcher.launch([["x=1"], ["x=2"]], initial_job_idx=4)
    assert read == [(4, ["x=1"]), (5, ["x=2"])]
    assert [r.return_value for r in returns] == [1, 2]
