"""A run that starts beside a CPU-bound process which ends halfway: threads chosen once, followed, or fixed.

    python experiments/benchmark_threads.py                 # 2 rounds of the three rules, 300 steps each
    python experiments/benchmark_threads.py --steps 60 --rounds 1   # a smoke run

Each trial starts a busy process (one core, a pure-Python loop) and, a second later, ``pe-train experiment=quick``
with the geometry recorder off (so the loop is the training step) under one of three rules:

- ``once``: ``callbacks.threads=null``: the run counts the idle cores at start (one, beside the busy process) and
  keeps that count (the rule before issue 54);
- ``follow``: the default thread follower (``callbacks.threads``): it looks every ``--every`` seconds and moves to
  the cores the other processes leave (two once the busy process has ended);
- ``fixed 2``: ``OMP_NUM_THREADS=2``, as many threads as cores whatever the machine does.

The busy process runs for ``--busy`` seconds (default: half of the ``once`` trial's time in the first round, measured
first). Printed: each trial's training time (the run's own first to last step, from its train.log), its ratio to the
``once`` trial of the same round, and the load average at the start of each trial. The rules alternate within a round,
so a slow drift of the machine's load reaches all three alike.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RULES = {"once": ({}, ["callbacks.threads=null"]), "follow": ({}, []), "fixed 2": ({"OMP_NUM_THREADS": "2"}, [])}
STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\].* step (\d+)/(\d+)")


def busy(seconds: float) -> subprocess.Popen:
    code = f"import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass"
    return subprocess.Popen([sys.executable, "-c", code])


def training_seconds(log: Path) -> float:
    """First to last progress line of the run's train.log: the steps alone (no imports, data or checkpoint reads)."""
    times = [datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f") for line in log.read_text().splitlines()
             if (m := STAMP.match(line))]
    if len(times) < 2:
        raise SystemExit(f"error: {log} has fewer than two progress lines")
    return (times[-1] - times[0]).total_seconds()


def trial(rule: str, busy_s: float, steps: int, every: float, folder: Path, stop_busy: bool = False) -> float:
    env_extra, overrides = RULES[rule]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")} | env_extra
    env |= {"WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    cmd = [sys.executable, str(ROOT / "train.py"), "experiment=quick", f"trainer.max_steps={steps}",
           f"trainer.val_check_interval={steps}", "trainer.limit_val_batches=1", "callbacks=no_geometry",
           "logger=csv", f"hydra.run.dir={folder}", f"callbacks.checkpoint.every_n_train_steps={steps}",
           "callbacks.progress_bar.log_every_n_steps=10", *overrides]
    if rule == "follow":
        cmd.append(f"callbacks.threads.every_seconds={every}")
    hog = busy(busy_s)
    time.sleep(1.0)  # the busy process holds its core when the run counts the idle ones
    subprocess.run(cmd, env=env, cwd=ROOT, check=True, capture_output=True)
    if stop_busy:
        hog.terminate()
    hog.wait()
    return training_seconds(folder / "train.log")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--busy", type=float, default=None, help="seconds the busy process runs (default: measured)")
    parser.add_argument("--every", type=float, default=5.0, help="the follower's look interval (seconds)")
    args = parser.parse_args()
    print(f"# {os.cpu_count()} cores; {args.steps} steps of experiment=quick, geometry off; "
          f"{args.rounds} round(s); the follower looks every {args.every:g} s")
    with tempfile.TemporaryDirectory(prefix="bench_threads_") as tmp:
        busy_s = args.busy
        if busy_s is None:  # half of what the run takes under the old rule, with the busy process all along
            busy_s = trial("once", 10_000, args.steps, args.every, Path(tmp) / "calibrate", stop_busy=True) / 2
            print(f"# busy process: {busy_s:.0f} s (half of a calibration run under 'once')")
        for r in range(args.rounds):
            seconds = {}
            for rule in RULES:
                load = os.getloadavg()[0]
                seconds[rule] = trial(rule, busy_s, args.steps, args.every, Path(tmp) / f"{r}_{rule.replace(' ', '')}")
                print(f"round {r}: {rule:<8} {seconds[rule]:6.1f} s  ({seconds['once'] / seconds[rule]:.2f}x 'once')"
                      f"  load {load:.1f} at start", flush=True)


if __name__ == "__main__":
    main()
