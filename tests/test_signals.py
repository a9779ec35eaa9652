"""Stop signals at awkward moments: Ctrl-C and SIGTERM during a validation that falls between the micro-batches
of a gradient-accumulation step or off the checkpoint grid, and after the run has finished; a scheduler's
time-limit warning (SIGUSR1, SIGUSR2) mid-step, also under SLURM, where Lightning would take SIGUSR1 for itself.

The signals are real (``os.kill`` to this very process) but sent from inside a validation step, so
they land at a known point of the loop without racing a subprocess. See docs/RELIABILITY.md.
"""

from __future__ import annotations

import os
import signal
import sys
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from pe_geometry.analysis.readers.runs import read_run_rows
from pe_geometry.cli.train import report_stop
from pe_geometry.training.interrupt import GracefulStop
from pe_geometry.training.pipeline import train
from pe_geometry.training.task import LanguageModelTask
from tests import forkserver
from tests.conftest import ROOT, TINY, tiny_train_config
from tests.test_reliability import HAS_GEOMETRY, assert_same_series, corpus_args, finish, load_ckpt, logged_steps, start

# Geometry measures at the resume step, an extra row after an off-grid resume (see docs/RELIABILITY.md).
NO_GEOMETRY = ["~callbacks.geometry"] if HAS_GEOMETRY else []


def signal_during_validation(monkeypatch, sig: int, at_step: int) -> None:
    """Send ``sig`` to this process from the first validation batch run at ``global_step == at_step``."""
    real_step = LanguageModelTask.validation_step
    sent = []

    def validation_step(self, block, batch_idx):
        if self.global_step == at_step and not sent and not self.trainer.sanity_checking:
            sent.append(sig)
            os.kill(os.getpid(), sig)
        return real_step(self, block, batch_idx)

    monkeypatch.setattr(LanguageModelTask, "validation_step", validation_step)


def stop_and_resume(tmp_path, tiny_corpus, cache_dir, monkeypatch, sig: int, at_step: int, args: list[str]) -> dict:
    """An uninterrupted run (``straight``) and one stopped by ``sig`` during a validation, then resumed (``stopped``).

    Returns the stopped run's checkpoint as saved by the interrupt."""
    train(tiny_train_config(tmp_path / "straight", tiny_corpus, cache_dir, args))
    signal_during_validation(monkeypatch, sig, at_step)
    with pytest.raises(SIGTERMException):  # Lightning's stop, raised between steps (train.py maps it to 128 + sig)
        train(tiny_train_config(tmp_path / "stopped", tiny_corpus, cache_dir, args))
    monkeypatch.undo()
    last = tmp_path / "stopped" / "run" / "checkpoints" / "last.ckpt"
    saved = load_ckpt(last)
    train(tiny_train_config(tmp_path / "stopped", tiny_corpus, cache_dir, [*args, f"ckpt_path={last}"]))
    return saved


def assert_resumed_as_straight(tmp_path) -> None:
    runs = {name: tmp_path / name / "run" for name in ("straight", "stopped")}
    assert logged_steps(runs["stopped"]) == logged_steps(runs["straight"])
    assert_same_series(read_run_rows(runs["stopped"]), read_run_rows(runs["straight"]))
    a, b = (load_ckpt(run / "checkpoints" / "last.ckpt") for run in runs.values())
    assert a["global_step"] == b["global_step"]
    for name, tensor in b["state_dict"].items():
        assert torch.equal(a["state_dict"][name], tensor), f"{name} differs after the resume"


# -- 1. a signal during a validation between the micro-batches of one optimiser step ---------------
def test_a_signal_during_a_validation_mid_accumulation_stops_at_the_next_optimiser_step(tmp_path, tiny_corpus, cache_dir, monkeypatch):
    """val_check_interval counts batches: with 2 micro-batches per step, validation after batch 15 falls inside
    step 8. The stop used to come right there: step 7 saved with 15 batches consumed, and the resume skipped one."""
    args = ["model=encoder", "trainer.accumulate_grad_batches=2", "trainer.val_check_interval=15", "trainer.max_steps=12",
            "callbacks.checkpoint.every_n_train_steps=5", *NO_GEOMETRY]
    saved = stop_and_resume(tmp_path, tiny_corpus, cache_dir, monkeypatch, signal.SIGTERM, at_step=7, args=args)
    assert saved["global_step"] == 8  # the step the validation fell inside, completed
    assert saved["TextDataModule"] == {"epoch": 0, "batches": 16}  # 2 micro-batches per step: the data position agrees
    assert_resumed_as_straight(tmp_path)


# -- 2. a signal during a validation off the checkpoint grid -----------------------------------------
@pytest.mark.sends_sigint  # (a Ctrl-C of its own: the graceful stop, not the end of pytest; see tests/conftest.py)
def test_a_signal_during_a_validation_off_the_checkpoint_grid_resumes_every_row_at_its_step(tmp_path, tiny_corpus, cache_dir, monkeypatch):
    """Checkpoint every 4 steps, validate every 3: the stop after step 9's validation saves an off-grid checkpoint.
    Its resume used to log every train/loss and lr row one step late (step 9 missing, an extra step 12).
    (Ctrl-C here, SIGTERM in the test above: both take the same path.)"""
    args = ["trainer.max_steps=12", "trainer.val_check_interval=3", "callbacks.checkpoint.every_n_train_steps=4", *NO_GEOMETRY]
    saved = stop_and_resume(tmp_path, tiny_corpus, cache_dir, monkeypatch, signal.SIGINT, at_step=9, args=args)
    assert saved["global_step"] == 9
    assert_resumed_as_straight(tmp_path)


# -- 3. a signal after the run has finished ------------------------------------------------------------
# train.py with one hook added: the signal goes to the process after the run summary, as W&B finishes
# its run, or from the last callback Python runs at exit.
DRIVER = """
import atexit, os, runpy, signal, sys
import pe_geometry.training.wandb_run as wandb_run
sig, when, train_py = signal.Signals[sys.argv.pop(1)], sys.argv.pop(1), sys.argv[1]
if when == "wandb_teardown":
    real_finish = wandb_run.finish
    def finish(loggers, exit_code):
        if exit_code == 0:  # the run ended well; its summary is out
            os.kill(os.getpid(), sig)
        real_finish(loggers, exit_code)
    wandb_run.finish = finish
else:
    atexit.register(os.kill, os.getpid(), sig)  # registered first: runs last
sys.argv = sys.argv[1:]
runpy.run_path(train_py, run_name="__main__")
"""


@pytest.mark.slow  # runs train.py in a subprocess
@pytest.mark.parametrize("sig,when", [(signal.SIGTERM, "wandb_teardown"), (signal.SIGINT, "wandb_teardown"),
                                      (signal.SIGTERM, "python_exit")], ids=lambda v: getattr(v, "name", v))
def test_a_signal_after_the_run_has_finished_still_exits_0(sig, when, tmp_path, tiny_corpus, cache_dir):
    run = tmp_path / "run"
    (tmp_path / "driver.py").write_text(DRIVER)
    args = [*corpus_args(tiny_corpus), *TINY, "logger=csv", *NO_GEOMETRY, f"hydra.run.dir={run}"]
    env = {**os.environ, "PE_CACHE_DIR": str(cache_dir), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = forkserver.run([sys.executable, str(tmp_path / "driver.py"), sig.name, when, str(ROOT / "train.py"), *args],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]  # was -15 (SIGTERM), or 130 and "Ctrl-C twice" (SIGINT)
    assert "Traceback" not in result.stderr and not [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert load_ckpt(run / "checkpoints" / "last.ckpt")["global_step"] == 3
    if when == "wandb_teardown":  # (at exit, the log files are already closed)
        assert f"received {sig.name} after the run had finished: ignored" in (run / "train.log").read_text()


# -- 4. a scheduler's warning before the time limit: SIGUSR1 (sbatch --signal), SIGUSR2 (submitit) -------------
def signal_during_training(monkeypatch, sig: int, at_step: int) -> None:
    """Send ``sig`` to this process from the first training batch run at ``global_step == at_step``."""
    real_step = LanguageModelTask.training_step
    sent = []

    def training_step(self, block, batch_idx):
        if self.global_step == at_step and not sent:
            sent.append(sig)
            os.kill(os.getpid(), sig)
        return real_step(self, block, batch_idx)

    monkeypatch.setattr(LanguageModelTask, "training_step", training_step)


@pytest.fixture
def handler_before_training():
    """Stands in for the handler a signal has before training (Python's default would end the test session)."""
    def unhandled(signum, frame):
        raise AssertionError(f"{signal.Signals(signum).name} reached the handler it had before training")

    previous = {sig: signal.signal(sig, unhandled) for sig in (signal.SIGUSR1, signal.SIGUSR2)}
    yield
    for sig, handler in previous.items():
        signal.signal(sig, handler)


ACCUMULATING = ["trainer.max_steps=12", "trainer.accumulate_grad_batches=2", "callbacks.checkpoint.every_n_train_steps=5",
                *NO_GEOMETRY]


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGUSR2], ids=lambda sig: sig.name)
def test_a_time_limit_warning_stops_after_the_step_with_a_checkpoint_and_the_resume_command(
        sig, tmp_path, tiny_corpus, cache_dir, monkeypatch, capsys, handler_before_training):
    """Before: nothing handled it (configs/hydra/launcher/slurm.yaml asks for it 120 s before the limit), so the job
    died by it or at the limit with only the last periodic checkpoint. Sent in the first micro-batch of step 4."""
    signal_during_training(monkeypatch, sig, at_step=3)
    cfg = tiny_train_config(tmp_path, tiny_corpus, cache_dir, ACCUMULATING)
    with pytest.raises(SIGTERMException):
        train(cfg)
    run = tmp_path / "run"
    saved = load_ckpt(run / "checkpoints" / "last.ckpt")
    assert saved["global_step"] == 4 and saved["TextDataModule"] == {"epoch": 0, "batches": 8}  # the whole step, no more
    assert report_stop(cfg) == 128 + sig  # train.py's exit code
    assert capsys.readouterr().err.splitlines()[-1] == f"error: stopped by {sig.name}; resume with ckpt_path={run}/checkpoints/last.ckpt"


SLURM_JOB = {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "4242", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
             "SLURM_NODEID": "0", "SLURM_NODELIST": "localhost"}


def test_under_slurm_sigusr1_stops_the_run_instead_of_lightnings_auto_requeue(tmp_path, tiny_corpus, cache_dir, monkeypatch):
    """Lightning's SLURM auto-requeue takes SIGUSR1 when fit starts: it saves hpc_ckpt_1.ckpt inside the signal handler,
    mid-step (a resume from it is a batch off), and runs ``scontrol requeue``, which reruns the original command: a new
    run from step 0. Here SIGUSR1 stops the run as anywhere else, and Lightning never installs its handler."""
    from lightning.pytorch.trainer.connectors import signal_connector

    for key, value in SLURM_JOB.items():
        monkeypatch.setenv(key, value)
    requeued = []
    monkeypatch.setattr(signal_connector, "call", lambda cmd, **kwargs: requeued.append(cmd) or 0)
    before, installed = signal.getsignal(signal.SIGUSR1), []
    real_start = GracefulStop.on_train_start

    def on_train_start(self, trainer, pl_module):
        installed.append(signal.getsignal(signal.SIGUSR1))  # what Lightning's signal setup left
        real_start(self, trainer, pl_module)

    monkeypatch.setattr(GracefulStop, "on_train_start", on_train_start)
    signal_during_training(monkeypatch, signal.SIGUSR1, at_step=3)
    with pytest.raises(SIGTERMException):
        train(tiny_train_config(tmp_path, tiny_corpus, cache_dir, ACCUMULATING))
    run = tmp_path / "run"
    assert installed == [before]
    assert not requeued and not list(run.rglob("hpc_ckpt_*.ckpt"))
    assert load_ckpt(run / "checkpoints" / "last.ckpt")["global_step"] == 4


# -- 5. every rank's and every device's random states travel with the checkpoint -------------------------
def fake_cuda(monkeypatch, states: list[torch.Tensor]) -> list:
    """Two "GPUs" whose generator states are ``states``; returns the list that set_rng_state_all calls fill."""
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(states))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in states])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    return restored


def on_rank(task: LanguageModelTask, rank: int, world_size: int = 2) -> LanguageModelTask:
    task._trainer = SimpleNamespace(global_rank=rank, world_size=world_size)  # what global_rank reads
    return task


@pytest.fixture
def own_rng():
    """These tests set the global generator: give the rest of the session back its own."""
    with torch.random.fork_rng(devices=[]):
        yield


def test_the_checkpoint_holds_every_ranks_random_states_and_each_rank_restores_its_own(monkeypatch, own_rng):
    from pe_geometry.training import task as training_task

    task = LanguageModelTask(torch.nn.Linear(2, 2))
    gpu_states = {rank: [torch.full((16,), 10 * rank + gpu, dtype=torch.uint8) for gpu in range(2)] for rank in range(2)}
    saved = {}
    for rank in range(2):  # what each rank of a DDP run puts in the checkpoint: its own CPU and GPU states
        torch.manual_seed(100 + rank)
        fake_cuda(monkeypatch, gpu_states[rank])
        saved[rank] = {}
        on_rank(task, rank).on_save_checkpoint(saved[rank])
        monkeypatch.undo()
    # rank 0 writes the file; a collective hands it every rank's states, indexed by global rank
    monkeypatch.setattr(training_task, "gather_from_ranks", lambda states: [saved[0]["rng_states"], saved[1]["rng_states"]])
    checkpoint = {}
    on_rank(task, 0).on_save_checkpoint(checkpoint)
    per_rank = checkpoint["rng_states_per_rank"]
    assert checkpoint["rng_states"] is per_rank[0]  # the single-process key, as older code reads it
    assert not torch.equal(per_rank[0]["torch"], per_rank[1]["torch"])
    for rank in range(2):
        restored = fake_cuda(monkeypatch, [torch.zeros(16, dtype=torch.uint8)] * 2)
        torch.manual_seed(0)
        on_rank(task, rank).on_load_checkpoint(checkpoint)
        assert torch.equal(torch.get_rng_state(), saved[rank]["rng_states"]["torch"])  # this rank's CPU stream
        assert len(restored) == 1 and all(torch.equal(a, b) for a, b in zip(restored[0], gpu_states[rank]))  # and its GPUs'
    # an older checkpoint (one CPU state, no per-rank list) still resumes, on every rank
    old = {"rng_states": {k: saved[1]["rng_states"][k] for k in ("torch", "numpy", "python")}}
    torch.manual_seed(0)
    on_rank(task, 0, world_size=1).on_load_checkpoint(old)
    assert torch.equal(torch.get_rng_state(), old["rng_states"]["torch"])


def test_each_rank_draws_its_own_masks_and_rank_0_draws_as_a_single_process(monkeypatch, own_rng):
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    draws = []
    for rank in range(3):
        task = on_rank(LanguageModelTask(torch.nn.Linear(2, 2)), rank, world_size=3)
        torch.manual_seed(7)  # seed_everything, the same on every rank
        task.setup("fit")
        draws.append(torch.rand(4))
    torch.manual_seed(7)
    assert torch.equal(draws[0], torch.rand(4))  # rank 0: unchanged, as a single process
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])


@pytest.mark.slow  # runs train.py in a subprocess (two DDP processes)
def test_ddp_ranks_draw_their_own_masks_and_a_resume_restores_each_ranks_stream(tmp_path, tiny_corpus, cache_dir):
    """Encoder (random MLM masks) on 2 gloo processes: the ranks' random states differ, and a resume from step 3
    matches the uninterrupted run (rank 1 restoring rank 0's state instead would change the gradients)."""
    run = tmp_path / "run"
    args = [*corpus_args(tiny_corpus), *TINY, "logger=csv", "trainer=ddp", "model=encoder", "trainer.max_steps=6",
            "callbacks.checkpoint.every_n_train_steps=3", *NO_GEOMETRY]
    result = finish(start(run, args, cache_dir), timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    straight_rows, straight = read_run_rows(run), load_ckpt(run / "checkpoints" / "last.ckpt")
    per_rank = load_ckpt(run / "checkpoints" / "step000003.ckpt")["rng_states_per_rank"]
    assert len(per_rank) == 2 and not torch.equal(per_rank[0]["torch"], per_rank[1]["torch"])

    resumed = finish(start(tmp_path / "resume", [*args, f"ckpt_path={run / 'checkpoints' / 'step000003.ckpt'}"], cache_dir),
                     timeout=150)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_series(read_run_rows(run), straight_rows)
    last = load_ckpt(run / "checkpoints" / "last.ckpt")
    assert last["global_step"] == straight["global_step"] == 6
    for name, tensor in straight["state_dict"].items():
        assert torch.equal(last["state_dict"][name], tensor), f"{name} differs after the resume"
