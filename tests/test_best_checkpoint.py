"""The best-validation checkpoint: kept by a run's own callbacks (experiment=dose_response_d256), or chosen after
training from its step checkpoints (analysis.best_checkpoint), and the verdict measured there (pe-report --at best)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pe_geometry.analysis.readers.best_checkpoint import BEST_FILE, choose_best, early_stopping_choice, main
from pe_geometry.analysis.readers.runs import Run
from pe_geometry.training.pipeline import train
from pe_geometry.training.run_loader import RunLoadError
from tests.conftest import compose_train_config, fast_loop_keeps, tiny_train_config

# experiment=dose_response_d256's callbacks on the tiny model: validation at every checkpoint, a learning rate that
# overfits 12k characters of Hamlet within a few dozen steps, so the early stop ends the run before max_steps
EARLY_STOPPED = ["experiment=dose_response_d256", "trainer.max_steps=120", "trainer.val_check_interval=4",
                 "callbacks.checkpoint.every_n_train_steps=4", "callbacks.early_stopping.patience=2", "optimizer.lr=3e-2",
                 "~callbacks.geometry"]


def test_early_stopping_choice_follows_lightnings_rule():
    """Strictly lower improves (a tie does not), `patience` validations in a row without one stop the run; the choice
    is the lowest loss before the stop, not the lowest overall."""
    losses = [(4, 3.0), (8, 2.5), (12, 2.5), (16, 2.6), (20, 2.0)]
    assert early_stopping_choice(losses, patience=2) == (8, 16)  # 12 ties, 16 is worse: stop; 20 is never seen
    assert early_stopping_choice(losses, patience=3) == (20, None)  # the run would have gone on
    assert early_stopping_choice([(4, 1.0), (8, 2.0)], patience=1) == (4, 8)
    with pytest.raises(ValueError, match="patience=0"):
        early_stopping_choice(losses, patience=0)


@pytest.fixture(scope="module")
def early_stopped_run(tmp_path_factory, tiny_corpus, cache_dir) -> Path:
    tmp = tmp_path_factory.mktemp("early")
    cfg = tiny_train_config(tmp, tiny_corpus, cache_dir, EARLY_STOPPED)
    train(cfg)
    return Path(cfg.paths.output_dir)


def _state(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def test_the_run_stops_early_and_keeps_its_best_checkpoint(early_stopped_run):
    best = _state(early_stopped_run / "checkpoints" / "best.ckpt")
    last = _state(early_stopped_run / "checkpoints" / "last.ckpt")
    assert last["global_step"] < 120, "the early stop never fired: the test no longer tests it"
    assert best["global_step"] == last["global_step"] - 2 * 4  # patience 2 validations of 4 steps after the best
    assert not list((early_stopped_run / "checkpoints").glob("best-v*.ckpt"))  # overwritten in place
    # every grid step has its file, each saved after its step's validation (the deferred save never went missing)
    steps = range(4, last["global_step"] + 1, 4)
    assert sorted(p.name for p in (early_stopped_run / "checkpoints").glob("step*.ckpt")) == [f"step{s:06d}.ckpt" for s in steps]
    [stop_state] = [v for k, v in last["callbacks"].items() if k.startswith("EarlyStop{")]
    assert stop_state["wait_count"] == 2  # the stopping validation is in the last checkpoint
    val = {int(r["step"]) + 1: float(r["val/loss"]) for r in _rows(early_stopped_run) if r.get("val/loss")}
    for step in steps:
        [best_state] = [v for k, v in _state(early_stopped_run / "checkpoints" / f"step{step:06d}.ckpt")["callbacks"].items()
                        if k.startswith("BestCheckpoint{'monitor': 'val/loss'")]
        assert float(best_state["best_model_score"]) == pytest.approx(min(v for s, v in val.items() if s <= step)), step


def _rows(run: Path) -> list[dict]:
    from tests.test_reliability import read_run_rows

    return read_run_rows(run)


def test_choice_after_training_equals_the_live_callbacks(early_stopped_run, tmp_path):
    """Validating the step checkpoints afterwards gives exactly the val/loss training logged, and the same
    checkpoint and stopping step as Lightning's ModelCheckpoint(monitor=val/loss) and EarlyStopping."""
    copy = tmp_path / "run"
    shutil.copytree(early_stopped_run, copy)
    live = _state(copy / "checkpoints" / "best.ckpt")
    (copy / "checkpoints" / "best.ckpt").unlink()
    result = choose_best(copy, patience=2)
    assert result["best_step"] == live["global_step"]
    assert result["stopped_at"] == _state(copy / "checkpoints" / "last.ckpt")["global_step"]
    check = result["compared_with_logged"]
    assert check["n_steps"] == len(result["val_loss"]) and check["max_abs_diff"] < 1e-6  # the same numbers as training
    chosen = _state(copy / "checkpoints" / "best.ckpt")
    assert chosen["global_step"] == live["global_step"]
    for key, value in live["state_dict"].items():
        assert torch.equal(chosen["state_dict"][key], value), key
    assert json.loads((copy / BEST_FILE).read_text())["best_step"] == result["best_step"]


def test_choosing_again_and_runs_without_step_checkpoints_are_refused(early_stopped_run, tmp_path, capsys):
    with pytest.raises(RunLoadError, match="best.ckpt exists.*--force"):
        choose_best(early_stopped_run)
    empty = tmp_path / "empty"
    (empty / "checkpoints").mkdir(parents=True)
    with pytest.raises(SystemExit, match="no checkpoints/step<N>.ckpt"):
        main([str(empty)])


def test_report_at_best_measures_the_best_checkpoint(early_stopped_run, tmp_path):
    """pe-report --at best: the verdict's weights are best.ckpt's (its step, its own cache file), the command line
    says --at best, and a folder with a run lacking best.ckpt is refused by name instead of losing that seed."""
    from pe_geometry.analysis.report import build_report
    from pe_geometry.analysis.study.verdict import VERDICT_FILE, verdict_file

    runs = tmp_path / "runs"
    shutil.copytree(early_stopped_run, runs / "a")
    best_step = _state(runs / "a" / "checkpoints" / "best.ckpt")["global_step"]
    summary = build_report(runs, pretrained=False, extrapolation=False, null_draws=50, at="best")
    [verdict] = summary["verdict"]
    overlap = verdict["input"]["overlap_k8"]
    assert verdict["at"] == "best" and summary["at"] == "best" and overlap["seed_steps"] == [best_step]
    assert (runs / "a" / verdict_file("best")).is_file() and not (runs / "a" / VERDICT_FILE).is_file()
    assert summary["regenerate"][-1].endswith("--at best")
    report = (runs / "report" / "report.md").read_text()
    assert "best-validation weights" in report and f"(step {best_step})" in report
    at_end = build_report(runs, out=tmp_path / "end", pretrained=False, extrapolation=False, null_draws=50)
    assert at_end["verdict"][0]["input"]["overlap_k8"]["seed_steps"] == [_state(runs / "a" / "checkpoints" / "last.ckpt")["global_step"]]
    assert at_end["verdict"][0]["input"]["overlap_k8"]["observed"] != overlap["observed"]  # other weights, other figure

    shutil.copytree(early_stopped_run, runs / "b")
    (runs / "b" / "checkpoints" / "best.ckpt").unlink()
    with pytest.raises(SystemExit, match=r"--at best: no checkpoints/best.ckpt in .*runs/b.*best_checkpoint RUN"):
        build_report(runs, pretrained=False, extrapolation=False, null_draws=50, at="best")


def test_logged_figures_are_read_at_the_measured_step():
    """At the best checkpoint, a hidden-state figure is the last record at or before its step, not the run's end."""
    from pe_geometry.analysis.study.verdict import _logged

    run = Run(Path("r"), "decoder", "learned", 0, {}, {"m": (np.array([0, 200, 400, 600]), np.array([1.0, 2.0, 3.0, 4.0]))})
    assert _logged(run, "m") == 4.0
    assert _logged(run, "m", 400) == 3.0 and _logged(run, "m", 599) == 3.0
    assert _logged(run, "m", -1) is None and _logged(run, "other", 400) is None


def test_run_summary_says_the_run_stopped_early_and_where_its_best_checkpoint_is(tmp_path):
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    from pe_geometry.training.summary import callback_lines

    stop, best, steps = EarlyStopping(monitor="val/loss", patience=3), ModelCheckpoint(monitor="val/loss"), ModelCheckpoint()
    stop.best_score, best.best_model_score, best.best_model_path = torch.tensor(3.79), torch.tensor(3.79), "ckpts/best.ckpt"
    assert callback_lines([stop, best, steps]) == ["best val/loss 3.7900: ckpts/best.ckpt"]  # still improving: no stop line
    stop.wait_count = 3
    assert callback_lines([stop]) == ["stopped early: val/loss had not improved for 3 validations (best 3.7900)"]


@pytest.mark.parametrize("override, message", [
    ("callbacks.early_stopping.monitor=val/los",
     "callbacks.early_stopping.monitor=val/los must be one of ['val/loss', 'val/ppl', 'train/loss', "
     "'val/answer_accuracy', 'val/answer_exact_match']"),
    ("callbacks.early_stopping.monitor=val/answer_accuracy",
     "callbacks.early_stopping.monitor=val/answer_accuracy is logged by data=task only"),
    ("callbacks.best_checkpoint.mode=max",
     "callbacks.best_checkpoint.mode=max with monitor=val/loss: set callbacks.best_checkpoint.mode=min"),
    ("callbacks.early_stopping.patience=-1", "callbacks.early_stopping.patience=-1 must be an integer >= 0"),
    ("callbacks.best_checkpoint.mode=minimum", "callbacks.best_checkpoint.mode=minimum must be one of ['min', 'max']"),
    ("+callbacks.early_stopping.patiense=3", "callbacks.early_stopping.patiense is not a setting of callbacks=early_stop"),
])
def test_bad_early_stop_settings_are_one_line_before_training(override, message):
    """A monitored metric the task never logs would fail at the first validation, minutes into the run: refused first."""
    from pe_geometry.training.schema import SchemaError, check_schema

    cfg = compose_train_config(["callbacks=early_stop", override])
    with pytest.raises(SchemaError, match=re.escape(message)):
        check_schema(cfg, {"callbacks": "early_stop"})



def test_a_task_run_may_stop_on_its_answers_in_their_direction(tmp_path):
    """data=task logs val/answer_accuracy and val/answer_exact_match: watched with mode=max they pass; mode=min (which
    would keep the worst checkpoint and stop at the best) is one line naming the fix."""
    from pe_geometry.training.schema import SchemaError, check_schema

    on_answers = ["callbacks=early_stop", "data=task", "callbacks.early_stopping.monitor=val/answer_exact_match",
                  "callbacks.early_stopping.mode=max", "callbacks.best_checkpoint.monitor=val/answer_accuracy",
                  "callbacks.best_checkpoint.mode=max"]
    check_schema(compose_train_config(on_answers, tmp_path), {"callbacks": "early_stop", "data": "task"})
    wrong_way = compose_train_config([*on_answers, "callbacks.early_stopping.mode=min"], tmp_path)
    with pytest.raises(SchemaError, match=re.escape("callbacks.early_stopping.mode=min with monitor=val/answer_exact_match: "
                                                    "set callbacks.early_stopping.mode=max")):
        check_schema(wrong_way, {"callbacks": "early_stop", "data": "task"})


@pytest.mark.parametrize("offset", fast_loop_keeps([-4, 0, 4], keep=[0]), ids=["before_the_best", "at_the_best", "after_the_best"])
def test_a_resumed_run_in_a_moved_folder_stops_at_the_same_step_with_the_same_best(offset, early_stopped_run, tmp_path,
                                                                                  tiny_corpus, cache_dir):
    """ckpt_path=auto continues a stopped dose_response_d256 job: EarlyStopping's count and the best score come back
    with the checkpoint, so the resumed run stops where the straight one did and keeps the same best.ckpt, also in a
    moved run folder (Lightning's ModelCheckpoint forgets its best score there: resumed after the best, the next,
    worse validation would have overwritten best.ckpt). The step checkpoints fall on validation steps (the grid the
    sweep uses): saved before that validation, the resume skipped it and the early stop lost a count; saved before the
    best checkpoint took in that validation, the resume at the best forgot that it was one."""
    from tests.test_reliability import assert_same_series, read_run_rows

    straight = _state(early_stopped_run / "checkpoints" / "best.ckpt")
    stop_step = _state(early_stopped_run / "checkpoints" / "last.ckpt")["global_step"]
    resume_at = straight["global_step"] + offset
    assert 4 <= resume_at < stop_step
    cfg = tiny_train_config(tmp_path, tiny_corpus, cache_dir, EARLY_STOPPED)
    run = Path(cfg.paths.output_dir)
    shutil.copytree(early_stopped_run, run)  # another folder: the run has moved
    ckpts = run / "checkpoints"
    for path in ckpts.iterdir():  # the folder as a kill right after step `resume_at` leaves it
        step = int(m.group(1)) if (m := re.fullmatch(r"step0*(\d+)\.ckpt", path.name)) else None
        if (step is None and not (path.name == "best.ckpt" and offset >= 0)) or (step is not None and step > resume_at):
            path.unlink()
    shutil.copy(ckpts / f"step{resume_at:06d}.ckpt", ckpts / "last.ckpt")
    train(tiny_train_config(tmp_path, tiny_corpus, cache_dir, [*EARLY_STOPPED, f"ckpt_path={ckpts / 'last.ckpt'}"]))
    assert _state(ckpts / "last.ckpt")["global_step"] == stop_step
    resumed = _state(ckpts / "best.ckpt")
    assert resumed["global_step"] == straight["global_step"]
    for key, value in straight["state_dict"].items():
        assert torch.equal(resumed["state_dict"][key], value), key
    assert_same_series(read_run_rows(run), read_run_rows(early_stopped_run))


def test_rebased_checkpoint_state_moves_only_paths_inside_the_old_folder():
    from pe_geometry.training.callbacks import rebase_paths

    state = {"dirpath": "/old/run/checkpoints", "best_model_path": "/old/run/checkpoints/best.ckpt", "best_model_score": 3.79,
             "kth_best_model_path": "", "last_model_path": "/elsewhere/last.ckpt",
             "best_k_models": {"/old/run/checkpoints/best.ckpt": 3.79}}
    moved = rebase_paths(state, Path("/old/run/checkpoints"), Path("/new/place/checkpoints"))
    assert moved == {**state, "dirpath": "/new/place/checkpoints", "best_model_path": "/new/place/checkpoints/best.ckpt",
                     "best_k_models": {"/new/place/checkpoints/best.ckpt": 3.79}}


def test_resuming_a_run_that_stopped_early_trains_no_further(early_stopped_run, tmp_path, tiny_corpus, cache_dir):
    """ckpt_path=auto on a sweep resumes its finished jobs too: one that stopped early ends again at once (Lightning's
    EarlyStopping would have trained on to the next validation, past the step it stopped at)."""
    from tests.test_reliability import read_run_rows

    stopped = _state(early_stopped_run / "checkpoints" / "last.ckpt")
    assert stopped["global_step"] < 120
    cfg = tiny_train_config(tmp_path, tiny_corpus, cache_dir, EARLY_STOPPED)
    run = Path(cfg.paths.output_dir)
    shutil.copytree(early_stopped_run, run)
    train(tiny_train_config(tmp_path, tiny_corpus, cache_dir, [*EARLY_STOPPED, "ckpt_path=auto"]))
    assert _state(run / "checkpoints" / "last.ckpt")["global_step"] == stopped["global_step"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == sorted(p.name for p in (early_stopped_run / "checkpoints").iterdir())
    assert max(int(r["step"]) for r in read_run_rows(run)) == max(int(r["step"]) for r in read_run_rows(early_stopped_run))


def test_early_stop_on_resume_ends_a_stopped_run_unless_given_more_patience():
    """The count (or, where Lightning records it, a threshold/non-finite stop) says the run had stopped; the configured
    patience wins over the checkpoint's, so `callbacks.early_stopping.patience=5` on a resume continues the run."""
    from types import SimpleNamespace

    from pe_geometry.training.callbacks import EarlyStop

    saved = EarlyStop(monitor="val/loss", patience=3)
    saved.wait_count, saved.best_score = 3, torch.tensor(3.79)
    state = saved.state_dict()

    def resumed(patience: int) -> bool:
        stop = EarlyStop(monitor="val/loss", patience=patience)
        stop.load_state_dict(state)
        trainer = SimpleNamespace(should_stop=False, global_step=4200)
        stop.on_train_start(trainer, None)
        return trainer.should_stop

    assert resumed(3) and not resumed(5)
    state["wait_count"] = 1
    assert not resumed(3)
    if "stopping_reason" in state:  # Lightning >= 2.6.x records why it stopped
        from lightning.pytorch.callbacks.early_stopping import EarlyStoppingReason

        state["stopping_reason"] = EarlyStoppingReason.NON_FINITE_METRIC.value
        assert resumed(3)


def test_a_resume_at_a_grid_step_with_gradient_accumulation_does_not_save_that_step_again(tmp_path, tiny_corpus, cache_dir):
    """Lightning forgets which step it saved last: the first micro-batch after a resume at step N still has
    global_step N and saved step N again, mid-step (a resume from that file would have skipped half a step)."""
    args = ["trainer.max_steps=6", "trainer.accumulate_grad_batches=2", "trainer.val_check_interval=6",
            "callbacks.checkpoint.every_n_train_steps=2", "~callbacks.geometry"]
    cfg = tiny_train_config(tmp_path, tiny_corpus, cache_dir, args)
    train(cfg)
    ckpts = Path(cfg.paths.output_dir) / "checkpoints"
    straight = _state(ckpts / "last.ckpt")
    saved = (ckpts / "step000002.ckpt").read_bytes()
    train(tiny_train_config(tmp_path, tiny_corpus, cache_dir, [*args, f"ckpt_path={ckpts / 'step000002.ckpt'}"]))
    assert (ckpts / "step000002.ckpt").read_bytes() == saved
    resumed = _state(ckpts / "last.ckpt")
    assert resumed["global_step"] == 6
    for key, value in straight["state_dict"].items():
        assert torch.equal(resumed["state_dict"][key], value), key
