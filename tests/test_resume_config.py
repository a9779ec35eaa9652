"""A resume continues the run as it was configured: every setting from the checkpoint unless the
command line sets it; contradictions (control arms included) refused before anything is written."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from pe_geometry.analysis.readers.runs import read_run_rows
from pe_geometry.training.pipeline import train
from pe_geometry.training.resume import choice_contradictions, overridden_keys, resumed_config
from pe_geometry.training.run_folder import stage_resume
from pe_geometry.training.validate import ConfigError
from tests import forkserver
from tests.conftest import ROOT, compose_train_config, tiny_train_config
from tests.test_reliability import corpus_args

SIX_STEPS = ["trainer.max_steps=6", "trainer.val_check_interval=3", "callbacks.checkpoint.every_n_train_steps=2",
             "optimizer.warmup_steps=2", "~callbacks.geometry", "~callbacks.sample", "~callbacks.throughput"]


def series(run: Path, column: str) -> dict[int, float]:
    return {int(r["step"]): float(r[column]) for r in read_run_rows(run) if r.get(column)}


def test_the_printed_resume_command_alone_continues_the_run_as_configured(tmp_path, tiny_corpus, cache_dir):
    """``ckpt_path=...`` and nothing else: max_steps, the LR schedule, cadences, data and logger of the run, not the defaults
    (before: 1200 steps of the default schedule, lr off by 9e-4 and train/loss by 0.28)."""
    train(tiny_train_config(tmp_path / "straight", tiny_corpus, cache_dir, SIX_STEPS))
    train(tiny_train_config(tmp_path / "cut", tiny_corpus, cache_dir, [*SIX_STEPS, "trainer.max_steps=6"]))
    run = tmp_path / "cut" / "run"
    step2 = run / "checkpoints" / "step000002.ckpt"
    # exactly what an interrupted run prints: no group, no size, no cache, no max_steps on the command line
    resume = compose_train_config([f"ckpt_path={step2}"], output_dir=tmp_path / "hydra-dir-of-the-resume")
    train(resume)

    assert resume.trainer.max_steps == 6 and resume.data.corpus.train_files == [str(tiny_corpus["train"])]
    assert "wandb" not in resume.logger and "geometry" not in resume.callbacks  # the run's loggers and callbacks only
    final = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert final["global_step"] == 6
    straight = tmp_path / "straight" / "run"
    for column in ("train/loss", "lr-AdamW/pg1", "val/loss"):
        a, b = series(straight, column), series(run, column)
        assert sorted(a) == sorted(b) and a, column
        assert max(abs(a[s] - b[s]) for s in a) == 0, (column, a, b)
    assert not (tmp_path / "hydra-dir-of-the-resume" / "checkpoints").exists()


@pytest.fixture(scope="module")
def tied_run(tmp_path_factory, tiny_corpus, cache_dir) -> Path:
    root = tmp_path_factory.mktemp("tied")
    train(tiny_train_config(root, tiny_corpus, cache_dir, ["pe=learned", "callbacks=no_geometry", "~callbacks.sample"]))
    return root / "run"


@pytest.mark.parametrize("control,key", [("untied_head", "embedding.tie_weights"), ("no_decay", "optimizer.no_decay_embeddings"),
                                         ("mixed_init", "pe.init"), ("word_norm", "pe._target_")])
def test_a_control_arm_that_contradicts_the_checkpoint_is_refused(control, key, tied_run, tmp_path):
    before = {p: p.stat().st_mtime_ns for p in tied_run.rglob("*")}
    cfg = compose_train_config([f"control={control}", f"ckpt_path={tied_run}/checkpoints/last.ckpt"], tmp_path / "resume")
    with pytest.raises(ConfigError, match=rf"{key}: checkpoint .*, command line "):
        train(cfg)
    assert {p: p.stat().st_mtime_ns for p in tied_run.rglob("*")} == before


def test_control_files_name_every_key_they_set():
    assert {"embedding.tie_weights"} == overridden_keys(["control=untied_head"])
    assert {"pe", "pe.init", "pe.init_k"} <= overridden_keys(["control=mixed_init"])
    assert "pe" in overridden_keys(["experiment=controls_learned"])  # its defaults override /pe
    assert "model.d_model" in overridden_keys(["experiment=controls_learned"])  # ... and it extends orthogonality


def test_a_group_option_sets_only_what_it_changes():
    """Before: trainer=ddp on a resume reset the run's max_steps and cadence to the default trainer's."""
    assert overridden_keys(["trainer=ddp"]) == {"trainer._target_", "trainer.strategy", "trainer.devices"}
    assert overridden_keys(["callbacks=no_geometry"]) == {"callbacks.geometry"}
    assert overridden_keys(["logger=csv"]) == {"logger.wandb"}
    assert "pe._target_" in overridden_keys(["pe=sinusoidal"])  # the default, given explicitly: still a choice


def test_a_control_arm_other_than_the_checkpoints_is_refused_even_when_it_sets_no_key():
    assert choice_contradictions({"control": "untied_head"}, ["control=baseline"]) == {"control": ("untied_head", "baseline")}
    assert choice_contradictions({"control": None}, ["control=baseline"]) == {}  # baseline changes nothing
    assert choice_contradictions({"control": "learned_baseline"}, ["control=null"]) == {}
    assert choice_contradictions(None, ["control=untied_head"]) == {}  # an older checkpoint: the keys still decide


def test_stage_resume_leaves_a_checkpoint_outside_a_run_folder_alone():
    """Such a resume continues in a new folder Hydra makes; staging it would train into the staging folder, removed at exit."""
    assert stage_resume(["ckpt_path=/somewhere/model.ckpt"]) == ["ckpt_path=/somewhere/model.ckpt"]
    assert stage_resume(["-m", "ckpt_path=/r/checkpoints/last.ckpt"]) == ["-m", "ckpt_path=/r/checkpoints/last.ckpt"]


def test_overriding_the_cache_on_resume_moves_the_data_cache_too(tmp_path, tiny_corpus, cache_dir):
    train(tiny_train_config(tmp_path, tiny_corpus, cache_dir, ["~callbacks.geometry", "~callbacks.sample"]))
    step2 = tmp_path / "run" / "checkpoints" / "step000002.ckpt"
    resume = compose_train_config([f"ckpt_path={step2}", f"paths.cache_dir={tmp_path / 'new-cache'}"], tmp_path / "elsewhere")
    train(resume)
    assert resume.data.cache_dir == str(tmp_path / "new-cache" / "data") and any((tmp_path / "new-cache" / "data").iterdir())


SAVED = {
    "seed": 3, "ckpt_path": None, "run_name": "decoder-rope-s3",
    "paths": {"output_dir": "/old/place/run", "cache_dir": "/old/cache"},
    "data": {"seed": 3, "cache_dir": "/old/cache/data", "seq_len": 16},
    "pe": {"_target_": "pe_geometry.model.RotaryPE", "base": 10000.0},
    "trainer": {"max_steps": 60, "default_root_dir": "/old/place/run"},
    "logger": {"csv": {"_target_": "pe_geometry.training.callbacks.ResumableCSVLogger", "save_dir": "/old/place/run"}},
    "callbacks": {"checkpoint": {"every_n_train_steps": 20, "dirpath": "/old/place/run/checkpoints"}},
}
NOW = {  # as composed (unresolved) by `python train.py ckpt_path=...`: the defaults
    "seed": 0, "ckpt_path": "/new/place/run/checkpoints/last.ckpt", "run_name": "${arm:decoder,sinusoidal}-s${seed}",
    "paths": {"output_dir": "/tmp/hydra-stub", "cache_dir": "/new/cache"},
    "data": {"seed": "${seed}", "cache_dir": "${paths.cache_dir}/data", "seq_len": 128},
    "pe": {"_target_": "pe_geometry.model.SinusoidalPE", "max_len": 512},
    "trainer": {"max_steps": 1200, "default_root_dir": "${paths.output_dir}", "precision": "32-true"},
    "logger": {"csv": {"_target_": "pe_geometry.training.callbacks.ResumableCSVLogger", "save_dir": "${paths.output_dir}"},
               "wandb": {"_target_": "lightning.pytorch.loggers.WandbLogger"}},
    "callbacks": {"checkpoint": {"every_n_train_steps": 200, "dirpath": "${paths.output_dir}/checkpoints", "save_last": True},
                  "sample": {"_target_": "pe_geometry.training.sample.SampleTextCallback"}},
    "matmul_precision": "highest",
}


def test_the_resumed_config_is_the_checkpoint_plus_explicit_overrides():
    now = copy.deepcopy(NOW)
    now["callbacks"]["checkpoint"]["every_n_train_steps"] = 10  # as composed with the override below
    merged = resumed_config(now, SAVED, overridden_keys(["paths.cache_dir=/new/cache", "callbacks.checkpoint.every_n_train_steps=10"]),
                            Path("/new/place/run"))
    assert merged["trainer"]["max_steps"] == 60 and merged["pe"] == SAVED["pe"] and merged["seed"] == 3
    assert merged["callbacks"]["checkpoint"]["every_n_train_steps"] == 10  # the explicit override wins
    assert merged["callbacks"]["checkpoint"]["save_last"] is True  # a setting the checkpoint predates takes its default
    assert "wandb" not in merged["logger"] and "sample" not in merged["callbacks"]  # never a logger/callback the run did not have
    assert merged["matmul_precision"] == "highest" and merged["trainer"]["precision"] == "32-true"
    # paths inside the run folder follow the folder; a derived key follows its overridden source
    assert merged["trainer"]["default_root_dir"] == "${paths.output_dir}" and merged["paths"]["output_dir"] == "/new/place/run"
    assert merged["callbacks"]["checkpoint"]["dirpath"] == "${paths.output_dir}/checkpoints"
    assert merged["data"]["cache_dir"] == "${paths.cache_dir}/data" and merged["paths"]["cache_dir"] == "/new/cache"
    assert merged["data"]["seed"] == "${seed}" and merged["run_name"] == "decoder-rope-s3"  # derived from choices: kept as saved
    assert merged["ckpt_path"] == NOW["ckpt_path"]


def test_a_run_folder_moved_elsewhere_resumes_in_its_new_place():
    merged = OmegaConf.to_container(OmegaConf.create(resumed_config(NOW, SAVED, set(), Path("/new/place/run"))), resolve=True)
    assert merged["logger"]["csv"]["save_dir"] == "/new/place/run"  # moved with the folder
    assert merged["callbacks"]["checkpoint"]["dirpath"] == "/new/place/run/checkpoints"
    assert merged["data"]["cache_dir"] == "/old/cache/data"  # outside the run folder, not overridden: as it was


# -- through the command line ---------------------------------------------------------------------
def _train_py(args: list[str], cwd: Path, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PE_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1"}
    return forkserver.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow  # runs train.py in subprocesses
def test_a_resume_writes_nothing_until_its_checks_pass_then_logs_into_its_run(tmp_path, tiny_corpus, cache_dir):
    run = tmp_path / "run"
    args = [*corpus_args(tiny_corpus), "logger=csv", "callbacks=no_geometry", "~callbacks.sample", "model.d_model=32",
            "model.n_layers=1", "data.seq_len=16", "data.batch_size=4", "data.vocab_size=300", "trainer.max_steps=8",
            "trainer.val_check_interval=4", "trainer.limit_val_batches=1", "callbacks.checkpoint.every_n_train_steps=4"]
    assert _train_py([*args, f"hydra.run.dir={run}"], tmp_path, cache_dir).returncode == 0
    before = _files(run)
    # refused (a contradicting override) with Hydra pointed at the run itself: not one byte of the run changes
    refused = _train_py([f"ckpt_path={run}/checkpoints/step000004.ckpt", f"hydra.run.dir={run}", "model.d_model=64"], tmp_path, cache_dir)
    assert refused.returncode == 2 and "model.d_model: checkpoint 32, command line 64" in refused.stderr
    assert _files(run) == before
    # the printed resume command: no stub folder anywhere, the log continues in the run, the run ends where it was set to
    resumed = _train_py([f"ckpt_path={run}/checkpoints/step000004.ckpt"], tmp_path, cache_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no outputs/<time>_... beside it
    log = (run / "train.log").read_text()
    assert log.startswith(before["train.log"].decode()) and "---- resumed at step 4" in log and "run summary" in log.split("resumed at")[1]
    assert (run / ".hydra" / "resume-step4" / "overrides.yaml").is_file() and (run / ".hydra" / "config.yaml").read_bytes() == before[
        ".hydra/config.yaml"]
    assert torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["global_step"] == 8


@pytest.mark.slow  # runs train.py in subprocesses
@pytest.mark.parametrize("bad", [["model.d_model=33"], ["seed=-1"], ["ckpt_path=/nope/last.ckpt"], ["pe=sinusodial"]])
def test_a_rejected_command_leaves_nothing_behind_and_says_it_once(bad, tmp_path, cache_dir):
    """Hydra's default run folder (outputs/<day>/<time>_...) is not left as a stub with .hydra/ and train.log."""
    result = _train_py(bad, tmp_path, cache_dir)
    assert result.returncode in (1, 2) and "error" in result.stderr.lower(), result.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []
    assert "error" not in result.stdout.lower()  # the one line on stderr, not echoed by the console log as well


def test_a_resume_off_the_geometry_cadence_adds_no_geometry_row(tmp_path, tiny_corpus, cache_dir):
    """Before: a resume from a step off the cadence (a Ctrl-C checkpoint, say) measured there, a row the uninterrupted run has not."""
    args = ["trainer.max_steps=6", "callbacks.checkpoint.every_n_train_steps=3", "callbacks.geometry.every_n_steps=2",
            "callbacks.geometry.n_tokens=50", "callbacks.geometry.null_draws=2", "callbacks.geometry.position_probe_blocks=5",
            "callbacks.geometry.position_probe_permutations=2", "~callbacks.sample"]
    train(tiny_train_config(tmp_path / "straight", tiny_corpus, cache_dir, args))
    train(tiny_train_config(tmp_path / "cut", tiny_corpus, cache_dir, args))
    step3 = tmp_path / "cut" / "run" / "checkpoints" / "step000003.ckpt"
    train(tiny_train_config(tmp_path / "cut", tiny_corpus, cache_dir, [*args, f"ckpt_path={step3}"]))
    straight, resumed = (series(tmp_path / d / "run", "geometry/abs_cos_mean") for d in ("straight", "cut"))
    assert sorted(straight) == sorted(resumed) == [0, 2, 4, 6]
    assert all(straight[s] == resumed[s] for s in straight)


@pytest.mark.parametrize("folder", ["plain/run_1", "my runs/run 1", "it's,a=run", "back\\slash", "quote\\'d", "end \\"])
def test_the_printed_resume_override_parses_back_to_the_checkpoint_path(tmp_path, folder):
    """A run folder with a space made the printed command fail in Hydra's lexer: the override is quoted for Hydra, then
    for the shell, and reads back as the path (shell split, then Hydra's own override parser)."""
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from pe_geometry.training.resume import resume_command

    run = tmp_path / folder
    printed = resume_command(OmegaConf.create({"paths": {"output_dir": str(run)}}))
    (argument,) = shlex.split(printed)
    (override,) = OverridesParser.create().parse_overrides([argument])
    assert override.key_or_group == "ckpt_path" and override.value() == str(run / "checkpoints" / "last.ckpt")


def test_warmup_stable_decay_by_hand():
    """Linear warm-up, flat, then linear to min_ratio at max_steps; before decay_start it ignores max_steps."""
    from pe_geometry.training.optimizer import warmup_stable_decay

    assert [warmup_stable_decay(s, 2, 6, 10, 0.2) for s in (0, 1, 2, 5, 6, 8, 10, 12)] == pytest.approx(
        [0.5, 1.0, 1.0, 1.0, 1.0, 0.6, 0.2, 0.2])
    assert [warmup_stable_decay(s, 2, 6, 10, 0.2) for s in range(6)] == [warmup_stable_decay(s, 2, 6, 99, 0.2) for s in range(6)]


WSD = [*SIX_STEPS, "optimizer.min_lr_ratio=0.2"]


def test_a_decay_branch_is_the_run_trained_for_that_length_from_the_start(tmp_path, tiny_corpus, cache_dir):
    """A trunk with a flat rate to step 6, branched at step 2 with decay_start=2 and max_steps=4, ends with the weights,
    losses and learning rates of a run configured so from step 0; the trunk's folder is left as it was."""
    train(tiny_train_config(tmp_path / "trunk", tiny_corpus, cache_dir, [*WSD, "optimizer.decay_start=6"]))
    train(tiny_train_config(tmp_path / "whole", tiny_corpus, cache_dir,
                            [*WSD, "optimizer.decay_start=2", "trainer.max_steps=4"]))
    trunk = tmp_path / "trunk" / "run"
    before = {p: p.stat().st_mtime_ns for p in trunk.rglob("*")}
    branch = compose_train_config([f"ckpt_path={trunk}/checkpoints/step000002.ckpt", "branch=true",
                                   "optimizer.decay_start=2", "trainer.max_steps=4"], output_dir=tmp_path / "branch")
    train(branch)

    assert {p: p.stat().st_mtime_ns for p in trunk.rglob("*")} == before
    a = torch.load(tmp_path / "branch" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    b = torch.load(tmp_path / "whole" / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert a["global_step"] == b["global_step"] == 4
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in b["state_dict"])
    assert a["run_config"]["branch"] is True and a["run_config"]["optimizer"]["decay_start"] == 2
    lrs, whole_lrs = series(tmp_path / "branch", "lr-AdamW/pg1"), series(tmp_path / "whole" / "run", "lr-AdamW/pg1")
    assert lrs and all(lrs[s] == whole_lrs[s] for s in lrs)
    assert lrs[3] < lrs[2] * 0.8  # it decays (the trunk's rate is flat there)


def test_a_branch_may_move_only_the_decay_and_needs_a_fresh_folder(tmp_path, tiny_corpus, cache_dir):
    train(tiny_train_config(tmp_path / "trunk", tiny_corpus, cache_dir, [*WSD, "optimizer.decay_start=6"]))
    step2 = tmp_path / "trunk" / "run" / "checkpoints" / "step000002.ckpt"
    cfg = compose_train_config([f"ckpt_path={step2}", "branch=true", "optimizer.lr=0.5"], output_dir=tmp_path / "b1")
    with pytest.raises(ConfigError, match=r"optimizer.lr: checkpoint .*, command line 0.5"):
        train(cfg)
    cfg = compose_train_config(["ckpt_path=auto", "branch=true"], output_dir=tmp_path / "b2")
    with pytest.raises(ConfigError, match=r"branch=true needs ckpt_path=<a checkpoint file>"):
        train(cfg)
    cfg = compose_train_config([f"ckpt_path={step2}", "branch=true"], output_dir=tmp_path / "trunk" / "run")
    with pytest.raises(ConfigError, match=r"already holds a run .* a branch starts a new run"):
        train(cfg)
    assert stage_resume([f"ckpt_path={step2}", "branch=true"]) == [f"ckpt_path={step2}", "branch=true"]


def test_a_run_choice_restated_on_a_resume_sets_none_of_its_keys():
    """Before: `callbacks=early_stop callbacks.early_stopping.patience=6` on a run that watched val/answer_accuracy
    switched both monitors to the option's val/loss (and best.ckpt was replaced by one chosen on val/loss)."""
    from pe_geometry.training.resume import restates_run_choice

    choices = {"callbacks": "early_stop", "pe": "rope", "control": None}
    assert restates_run_choice("callbacks=early_stop", choices) and restates_run_choice("pe=rope", choices)
    assert not restates_run_choice("pe=alibi", choices)  # another option: its keys are set (and refused if fixed)
    assert not restates_run_choice("callbacks=early_stop", None)  # an older checkpoint: the keys decide, as before
    assert not restates_run_choice("callbacks.early_stopping.patience=6", choices)


@pytest.mark.slow  # runs train.py in subprocesses
def test_a_resume_keeps_the_runs_early_stop_monitor_in_both_documented_forms(tmp_path, cache_dir):
    """docs/RUNS.md: `callbacks.early_stopping.patience=6` on a resume (was Hydra's 6-line "not in struct", exit 1: the
    default callbacks have no early_stopping); with `callbacks=early_stop` restated, the monitors stay the run's."""
    run = tmp_path / "run"
    watch = ["callbacks.early_stopping.monitor=val/answer_accuracy", "callbacks.early_stopping.mode=max",
             "callbacks.best_checkpoint.monitor=val/answer_accuracy", "callbacks.best_checkpoint.mode=max"]
    args = ["data=task", "data.task=copy", "pe=rope", "data.seq_len=16", "data.batch_size=4", "data.val_examples=8", "logger=csv",
            "callbacks=early_stop", "~callbacks.geometry", "~callbacks.sample", "model.d_model=16", "model.n_layers=1",
            "model.n_heads=2", "trainer.max_steps=4", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
            "callbacks.checkpoint.every_n_train_steps=2", *watch]
    assert _train_py([*args, f"hydra.run.dir={run}"], tmp_path, cache_dir).returncode == 0
    for steps, form in ((6, ["callbacks.early_stopping.patience=6"]),
                        (8, ["callbacks=early_stop", "callbacks.early_stopping.patience=7"])):
        patience = form[-1].rpartition("=")[2]
        resumed = _train_py([f"ckpt_path={run}/checkpoints/last.ckpt", f"trainer.max_steps={steps}", *form], tmp_path,
                            cache_dir)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        state = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
        config = OmegaConf.create(state["run_config"])
        assert config.callbacks.early_stopping.monitor == config.callbacks.best_checkpoint.monitor == "val/answer_accuracy"
        assert config.callbacks.early_stopping.mode == "max" and str(config.callbacks.early_stopping.patience) == patience
    # a key of the run's own pe option (rope's) is the resume's one line, not Hydra's "Could not override"
    refused = _train_py([f"ckpt_path={run}/checkpoints/last.ckpt", "pe.base=500"], tmp_path, cache_dir)
    assert refused.returncode == 2 and "pe.base: checkpoint 10000.0, command line 500" in refused.stderr, refused.stderr
