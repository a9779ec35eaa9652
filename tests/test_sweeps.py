"""Sweeps (``python train.py -m``): failed and killed jobs are listed at the end under every launcher, and job
folders and W&B run names say which swept values set each job apart.

The failure list used to live in train.py's memory, so a job that failed in a ``local_parallel`` worker or a
SLURM task left the sweep exiting 0 with no list, and ``kill -9`` of a joblib worker ended the whole sweep.
Now each job records its outcome in ``<sweep dir>/job_status_<n>.json`` (training/sweep.py) and the launchers of
hydra_plugins/pe_geometry/launchers.py go on past a killed job. The basic launcher's failure test is
tests/test_reliability.py::test_a_failed_sweep_job_is_reported_and_the_sweep_goes_on.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus
from hydra.types import RunMode
from omegaconf import OmegaConf, open_dict

from hydra_plugins.pe_geometry.launchers import how_it_died
from pe_geometry.training import sweep
from pe_geometry.training.names import MAX_NAME_CHARS
from tests import forkserver
from tests.conftest import CONFIG_DIR, ROOT, TINY


# -- job names ----------------------------------------------------------------------------------------------
def sweep_job(tmp_path: Path, sweep_overrides: list[str], job_overrides: list[str], num: int = 0, mode: RunMode = RunMode.MULTIRUN):
    """A sweep job's config as a launcher composes it: the job's own values in ``hydra.overrides.task``, and the
    sweep itself (the command line's overrides, the sweeper's params) only in the sweep folder's multirun.yaml."""
    sweep_dir = tmp_path / "sweep"
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[*job_overrides, f"hydra.sweep.dir={sweep_dir}", f"hydra.job.num={num}"],
                      return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.mode = mode
    HydraConfig.instance().set_config(cfg)
    sweep_dir.mkdir(exist_ok=True)
    master = {"hydra": {"overrides": {"task": sweep_overrides}, "sweeper": {"params": cfg.hydra.sweeper.params}}}
    OmegaConf.save(OmegaConf.create(master), sweep_dir / "multirun.yaml")
    return cfg


def names(cfg) -> tuple[str, str]:
    return cfg.hydra.sweep.subdir, cfg.run_name


def test_a_sweep_job_is_named_after_the_values_the_sweep_varies(tmp_path):
    """``-m optimizer.lr=1e-3,2e-3`` gave 0_decoder-sinusoidal-s0 and 1_decoder-sinusoidal-s0: the difference
    was nowhere in the folder or the W&B run name."""
    cfg = sweep_job(tmp_path, ["optimizer.lr=1e-3,2e-3"], ["optimizer.lr=0.002"], num=1)
    assert names(cfg) == ("1_decoder-sinusoidal-s0_optimizer.lr-0.002", "decoder-sinusoidal-s0_optimizer.lr-0.002")

    # values every job shares, noise keys and what the name has already (model, pe, seed, control) are left out
    cfg = sweep_job(tmp_path, ["model.n_layers=1,2", "pe=rope,alibi", "seed=0,1", "trainer.max_steps=300",
                               "paths.cache_dir=/a,/b", "logger=csv,none"],
                    ["model.n_layers=2", "pe=alibi", "seed=1", "trainer.max_steps=300", "paths.cache_dir=/b", "logger=none"], num=3)
    assert names(cfg) == ("3_decoder-alibi-s1_model.n_layers-2", "decoder-alibi-s1_model.n_layers-2")
    # range() and a swept experiment (it is in a single run's folder name, not in a job's) count too
    cfg = sweep_job(tmp_path, ["experiment=quick,orthogonality", "+model.foo=range(2)"], ["experiment=quick", "+model.foo=1"])
    assert names(cfg)[0] == "0_decoder-sinusoidal-s0_+model.foo-1+experiment-quick"


@pytest.mark.parametrize("experiment,job,name", [
    ("orthogonality", ["pe=learned", "seed=1"], "decoder-learned-s1"),
    ("controls_learned", ["pe=learned", "control=untied_head", "seed=0"], "decoder-learned-untied_head-s0"),
    ("dose_response", ["control=word_norm", "seed=2"], "decoder-sinusoidal-word_norm-s2"),
])
def test_the_study_sweeps_keep_their_names(tmp_path, experiment, job, name):
    """They sweep the arm and the seed only (hydra.sweeper.params), which the name already has."""
    cfg = sweep_job(tmp_path, [f"experiment={experiment}"], [f"experiment={experiment}", *job], num=4)
    assert names(cfg) == (f"4_{name}", name)


def test_a_long_job_name_is_cut_with_a_hash_and_stays_a_shell_word(tmp_path):
    swept = ["model.d_model=32,64", "optimizer.lr=0.001,0.002", "+model.note=a,b"]
    note = "+model.note='a/b c" + "x" * 80 + "'"  # a value with characters a shell word cannot hold
    got = [names(sweep_job(tmp_path, swept, [f"model.d_model={d}", "optimizer.lr=0.001", note])) for d in (32, 64)]
    for subdir, run_name in got:
        assert re.fullmatch(r"0_[A-Za-z0-9_.+-]+", subdir) and len(subdir) <= len("0_") + MAX_NAME_CHARS
        assert run_name == subdir[2:] and re.search(r"_[0-9a-f]{8}$", run_name)
    assert got[0] != got[1]


def test_a_single_run_is_named_as_before(tmp_path):
    cfg = sweep_job(tmp_path, ["optimizer.lr=1e-3,2e-3"], ["optimizer.lr=0.002"], mode=RunMode.RUN)
    assert cfg.run_name == "decoder-sinusoidal-s0"


# -- the end-of-sweep list, from the records in the sweep folder ----------------------------------------------
def job_config(cwd: Path, num: int):
    """The hydra node a job (or the launching process) sees, with the sweep folder relative to where it started."""
    return OmegaConf.create({"hydra": {"mode": RunMode.MULTIRUN, "runtime": {"cwd": str(cwd)}, "sweep": {"dir": "sweep"},
                                       "job": {"num": num}, "overrides": {"task": [f"seed={num}"]}}})


def test_the_end_of_sweep_list_is_read_from_the_sweep_folder(tmp_path, capsys, monkeypatch):
    """The records as the jobs' processes leave them: job 0 succeeds, job 1 fails (train.py records it), job 2 is
    killed (its launcher records it), job 10's process dies unseen; listed by job number, with exit code 1."""
    folder = tmp_path / "sweep"
    folder.mkdir()
    monkeypatch.chdir(folder)  # as a job with hydra.job.chdir=true: the relative sweep folder is the one it started in
    report = sweep.SweepReport()
    for num in (0, 1, 2, 10):
        report.on_job_start(job_config(tmp_path, num))
    sweep.write_record(folder, 1, ["seed=1"], "failed", "ConfigError: model.d_model=32 is not divisible by model.n_heads=3")
    for num in (0, 1):  # train.py returns normally from a failure too
        report.on_job_end(job_config(tmp_path, num), JobReturn(status=JobStatus.COMPLETED))
    sweep.record_killed_job(folder, 2, ["seed=2"], "killed by signal 9 (SIGKILL)")
    sweep.record_killed_job(folder, 1, ["seed=1"], "killed by signal 9 (SIGKILL)")  # the failure it recorded stays
    assert sorted(p.name for p in folder.iterdir()) == ["job_status_1.json", "job_status_10.json", "job_status_2.json"]

    with pytest.raises(SystemExit) as stop:
        report.on_multirun_end(job_config(tmp_path, 0))
    assert stop.value.code == 1
    assert capsys.readouterr().err.splitlines() == [
        "error: 3 sweep job(s) failed:",
        "  job 1 (seed=1): ConfigError: model.d_model=32 is not divisible by model.n_heads=3",
        "  job 2 (seed=2): killed by signal 9 (SIGKILL)",
        f"  job 10 (seed=10): its process (pid {os.getpid()}) ended without reporting a result (killed?)",
    ]

    report.on_multirun_start(job_config(tmp_path, 0))  # a new sweep into the same folder starts with no records
    assert list(folder.iterdir()) == []
    report.on_multirun_end(job_config(tmp_path, 0))  # nothing to list: no exit


def test_a_failure_whose_record_cannot_be_written_is_not_counted_a_success(tmp_path, monkeypatch):
    """A full disk when train.py records the failure: the job's "running" record must stay, so the sweep still lists it."""
    folder = tmp_path / "sweep"
    folder.mkdir()
    monkeypatch.chdir(folder)
    report, config = sweep.SweepReport(), job_config(tmp_path, 4)
    report.on_job_start(config)
    real_write = sweep.write_record
    monkeypatch.setattr(sweep, "write_record", lambda *a, **k: None)  # the failed record never reaches the disk
    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: config.hydra))  # the job's own hydra node
    sweep.record_failed_job(RuntimeError("No space left on device"))
    monkeypatch.setattr(sweep, "write_record", real_write)
    report.on_job_end(config, JobReturn(status=JobStatus.COMPLETED))  # train.py returned normally after reporting
    assert len(sweep.failed_jobs(folder)) == 1


def test_a_single_run_writes_no_record(tmp_path):
    (tmp_path / "sweep").mkdir()
    config = job_config(tmp_path, 0)
    config.hydra.mode = RunMode.RUN
    sweep.SweepReport().on_job_start(config)
    assert list((tmp_path / "sweep").iterdir()) == []


def test_the_signal_that_killed_a_joblib_worker_is_named():
    loky = ("A worker process managed by the executor was unexpectedly terminated. ...\n"
            "The exit codes of the workers are {SIGKILL(-9)}\nDetailed tracebacks ...")
    assert how_it_died(RuntimeError(loky)) == "killed by signal 9 (SIGKILL)"
    assert how_it_died(RuntimeError("The exit codes of the workers are {EXIT(3)}")) == "its worker process exited with code 3"


# -- real sweeps -------------------------------------------------------------------------------------------
def sweep_command(tiny_corpus, cache_dir, sweep_dir: Path, *args: str) -> list[str]:
    return [
        sys.executable, str(ROOT / "train.py"), "-m", "data=text_files", f"data.corpus.train_files=[{tiny_corpus['train']}]",
        f"data.corpus.val_files=[{tiny_corpus['validation']}]", f"paths.cache_dir={cache_dir}", "logger=csv",
        "~callbacks.geometry", *TINY, f"hydra.sweep.dir={sweep_dir}", *args,
    ]


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def listed(stderr: str) -> list[str]:
    """The end-of-sweep list: the lines after ``error: <k> sweep job(s) failed:``."""
    head = re.search(r"^error: (\d+) sweep job\(s\) failed:$", stderr, re.M)
    assert head, stderr[-3000:]
    return [line.strip() for line in stderr[head.end():].strip("\n").splitlines()[: int(head.group(1))]]


def last_step(run: Path) -> int:
    return torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["global_step"]


def start_and_kill_job_0(cmd: list[str], sweep_dir: Path, cwd: Path) -> subprocess.CompletedProcess:
    """Start the sweep, ``kill -9`` job 0's process once it trains (its pid is in its record), wait for the end."""
    proc = forkserver.Popen(cmd, cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not list(sweep_dir.glob("0_*/csv/metrics.csv")):  # job 0 has started training
            assert proc.poll() is None and time.monotonic() < deadline, "job 0 did not start training"
            time.sleep(0.1)
        os.kill(json.loads((sweep_dir / "job_status_0.json").read_text())["pid"], signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.slow  # runs train.py -m in a subprocess (2 jobs side by side)
def test_a_failed_local_parallel_job_is_listed_and_the_sweep_exits_1(tmp_path, tiny_corpus, cache_dir):
    """It failed in a joblib worker, so train.py's own list in the launching process stayed empty: exit 0, no list."""
    cmd = sweep_command(tiny_corpus, cache_dir, tmp_path / "sweep", "hydra/launcher=local_parallel", "model.n_heads=3,4")
    result = forkserver.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    (line,) = listed(result.stderr)
    assert re.match(r"job 0 \(.*model.n_heads=3.*\): ConfigError: model.d_model=32 is not divisible by model.n_heads=3", line)
    assert last_step(tmp_path / "sweep" / "1_decoder-sinusoidal-s0_model.n_heads-4") == 3


@pytest.mark.slow  # runs train.py -m in a subprocess and kills one of its workers
def test_a_killed_local_parallel_worker_loses_its_job_only(tmp_path, tiny_corpus, cache_dir):
    """kill -9 of the worker running job 0 (long): jobs 1 and 2 run to the end, job 0 is listed as killed,
    the sweep exits 1. Before, joblib's TerminatedWorkerError ended the sweep: job 1 killed beside it, job 2 never run."""
    sweep_dir = tmp_path / "sweep"
    cmd = sweep_command(tiny_corpus, cache_dir, sweep_dir, "hydra/launcher=local_parallel", "trainer.max_steps=5000,3,4")
    result = start_and_kill_job_0(cmd, sweep_dir, tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    assert listed(result.stderr) == [f"job 0 ({' '.join(json.loads((sweep_dir / 'job_status_0.json').read_text())['overrides'])}): "
                                     "killed by signal 9 (SIGKILL)"]
    assert "Traceback" not in result.stderr
    for num, steps in ((1, 3), (2, 4)):  # each job's folder and W&B run name carry its swept value
        run = sweep_dir / f"{num}_decoder-sinusoidal-s0_trainer.max_steps-{steps}"
        assert last_step(run) == steps
        assert OmegaConf.load(run / "config.yaml").run_name == f"decoder-sinusoidal-s0_trainer.max_steps-{steps}"


@pytest.mark.slow  # runs train.py -m in a subprocess: submitit's local executor, the code path of hydra/launcher=slurm
def test_failed_and_killed_submitit_jobs_are_listed_and_the_sweep_exits_1(tmp_path, tiny_corpus, cache_dir):
    """Three jobs at once: 0 (long) is killed, 1 trains, 2 fails (max_steps=0). Before, the failure left the sweep
    exiting 0 with no list, and the killed job ended it with a traceback (the plugin waits for job 0 first)."""
    sweep_dir = tmp_path / "sweep"
    cmd = sweep_command(tiny_corpus, cache_dir, sweep_dir, "hydra/launcher=submitit_local",
                        "hydra.launcher._target_=hydra_plugins.pe_geometry.launchers.SubmititLocalLauncher",
                        "trainer.max_steps=5000,3,0")
    result = start_and_kill_job_0(cmd, sweep_dir, tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    lines = listed(result.stderr)
    assert len(lines) == 2, lines
    assert re.match(r"job 0 \(.*trainer.max_steps=5000.*\): submitit job \S+ ended without a result", lines[0])
    assert re.match(r"job 2 \(.*trainer.max_steps=0.*\): ConfigError: trainer.max_steps=0 ", lines[1])
    assert last_step(sweep_dir / "1_decoder-sinusoidal-s0_trainer.max_steps-3") == 3


# -- continuing a stopped sweep ------------------------------------------------------------------------------
def final_values(run: Path) -> dict[str, float]:
    """Each column's last value in the run's joined CSV log (segments of resumes included), throughput aside."""
    from pe_geometry.analysis.readers.runs import read_run_rows

    values: dict[str, float] = {}
    for row in read_run_rows(run):
        values.update({k: float(v) for k, v in row.items() if v not in ("", None) and k.startswith(("train/loss", "val/", "lr"))})
    return values


@pytest.mark.slow  # runs train.py -m three times in subprocesses
def test_a_stopped_sweep_continues_with_ckpt_path_auto_and_a_plain_rerun_overwrites_nothing(tmp_path, tiny_corpus, cache_dir):
    """A sweep stopped part-way: job 0 had reached step 2 of 4 (its last.ckpt), job 1 never started. Before, the same
    command with its ``hydra.sweep.dir`` started every job again from step 0 over the old checkpoints. Now the plain
    rerun is refused job by job (nothing of job 0 changes), and ``ckpt_path=auto`` resumes job 0 from step 2 and
    starts job 1: both end as the uninterrupted sweep did."""
    sweep_dir = tmp_path / "sweep"
    cmd = sweep_command(tiny_corpus, cache_dir, sweep_dir, "seed=0,1", "trainer.max_steps=4", "trainer.val_check_interval=2")
    done = forkserver.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    jobs = sorted(sweep_dir.glob("[01]_*"))
    assert len(jobs) == 2
    expected = [final_values(job) for job in jobs]
    job0, job1 = jobs

    # stop it part-way, as kill -9 after job 0's step-2 checkpoint would (the CSV rows after it are replaced by the
    # resume's): job 0's last.ckpt at step 2, job 1 never started
    (job0 / "checkpoints" / "step000004.ckpt").unlink()
    (job0 / "checkpoints" / "step000002.ckpt").replace(job0 / "checkpoints" / "last.ckpt")
    shutil.rmtree(job1)
    before = {p: p.read_bytes() for p in (job0 / "checkpoints" / "last.ckpt", job0 / "csv" / "metrics.csv")}

    refused = forkserver.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 1, refused.stderr[-3000:]
    (line,) = listed(refused.stderr)
    assert re.match(r"job 0 \(.*\): ConfigError: .*0_decoder-sinusoidal-s0 already holds a run .*ckpt_path=auto", line), line
    assert all(p.read_bytes() == data for p, data in before.items())  # the stopped job is untouched
    shutil.rmtree(job1)  # the refused rerun ran job 1 (it had no run to overwrite): take it away again

    continued = forkserver.run([*cmd, "ckpt_path=auto"], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert continued.returncode == 0, continued.stderr[-3000:]
    assert (job0 / "csv" / "resume-step2" / "metrics.csv").is_file()  # job 0 resumed from step 2, job 1 started anew
    assert not (job1 / "csv" / "resume-step0").exists()
    assert last_step(job0) == last_step(job1) == 4
    for job, values in zip(jobs, expected, strict=True):
        got = final_values(job)
        assert got.keys() == values.keys() and all(got[k] == pytest.approx(values[k], rel=1e-6) for k in values), (job, got, values)

    # once more on the finished sweep: nothing to train, and every job's rows and checkpoints stay as they are
    finished = {p: p.read_bytes() for job in jobs for p in (job / "checkpoints" / "last.ckpt", *job.glob("csv/**/metrics.csv"))}
    again = forkserver.run([*cmd, "ckpt_path=auto"], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert all(p.read_bytes() == data for p, data in finished.items())  # (it compared a list with itself, which always held)
    assert all(final_values(job) == pytest.approx(values, rel=1e-6) for job, values in zip(jobs, expected, strict=True))
    assert last_step(job0) == last_step(job1) == 4
