"""Issue 51's experiment: does the word/position separation grow with training and depth, and does the model need it?

The plan (arms, lengths, seeds, the tests and their alpha) is ``experiments/plans/training_length.yaml``, committed
before the runs; both steps read it:

    pe-bench training-length train  [--root multirun/training_length] [--jobs 2]
    pe-bench training-length score  [--root ...] [--out experiments/results/training_length]

``train``: one warmup-stable-decay trunk per depth x arm x seed (the plan's longest length), then a decay branch
(``branch=true``) off the trunk's checkpoint for each shorter length. Units go in the plan's ``run_order``; each is
resumable (a stopped trunk continues with ``ckpt_path=last``, a finished one is skipped), so the same command
continues an interrupted sweep. ``score`` reads what ran: the figures against their nulls at every length, the
phantom/swap/random-orientation reads, the rotation test, the planned tests with Holm (analysis.training_length).
The paths default to the repository's (run it from the repository's root), and pe-train runs in the current folder.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from pe_geometry.extras import needs_extra

PLAN = Path("experiments") / "plans" / "training_length.yaml"  # the committed plan, from the repository's root
RUNS = Path("multirun") / "training_length"
OUT = Path("experiments") / "results" / "training_length"
RECIPE = ["experiment=width_curve", "logger=csv"]
CHECKPOINT_EVERY = 200  # the width curve's cadence; a decay start off it would have no checkpoint to branch from


def read_plan(path: Path = PLAN) -> dict:
    if not path.is_file():
        raise SystemExit(f"error: --plan {path}: no such file (the committed plan is {PLAN} in the repository: run "
                         "from its root, or pass --plan)")
    return yaml.safe_load(path.read_text())


def units(plan: dict) -> list[tuple[int, str, int]]:
    """(depth, arm, seed) in the order they train: the plan's run_order, seeds innermost."""
    return [(block["depth"], arm, seed) for block in plan["run_order"] for arm in block["arms"] for seed in plan["seeds"]]


def unit_dir(root: Path, depth: int, arm: str, seed: int) -> Path:
    return root / f"L{depth}" / f"{arm}-s{seed}"


def decay_start(length: int, plan: dict) -> int:
    return round(length * (1 - plan["decay_fraction"]))


def checkpoint_every(plan: dict) -> int:
    """Every decay start is a checkpoint: the cadence divides each (200 for the committed plan)."""
    return math.gcd(CHECKPOINT_EVERY, *(decay_start(n, plan) for n in plan["lengths"]))


def finished_step(run: Path) -> int | None:
    """The step of a run folder's last.ckpt (None: no checkpoint), read without torch's whole load."""
    last = run / "checkpoints" / "last.ckpt"
    if not last.is_file():
        return None
    import torch

    return int(torch.load(last, map_location="cpu", weights_only=False)["global_step"])


def _run(args: list[str], log: Path) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as out:
        return subprocess.call([str(Path(sys.executable).parent / "pe-train"), *args], stdout=out, stderr=subprocess.STDOUT,
                               env=env)


def train_unit(root: Path, plan: dict, depth: int, arm: str, seed: int, extra: list[str] = ()) -> str:
    """The trunk then each shorter length's branch of one depth x arm x seed; ``extra``: overrides for every run."""
    where = unit_dir(root, depth, arm, seed)
    longest = max(plan["lengths"])
    base = [*RECIPE, f"callbacks.checkpoint.every_n_train_steps={checkpoint_every(plan)}", *plan["arms"][arm],
            f"model.n_layers={depth}", f"seed={seed}", *extra]
    trunk = where / "trunk"
    started = time.time()
    step = finished_step(trunk)
    if step != longest:
        resume = ["ckpt_path=last"] if step is not None else []
        code = _run([*base, f"trainer.max_steps={longest}", f"optimizer.decay_start={decay_start(longest, plan)}",
                     f"hydra.run.dir={trunk}", *resume], where / "trunk.log")
        if code != 0:
            return f"{where}: trunk failed (exit {code}, {where / 'trunk.log'})"
    for length in sorted(plan["lengths"]):
        if length == longest or finished_step(where / f"b{length}") == length:
            continue
        branch = where / f"b{length}"
        start = decay_start(length, plan)
        if finished_step(branch) is not None:  # a branch stopped midway: continue it
            args = ["ckpt_path=last", f"hydra.run.dir={branch}"]
        else:
            args = [*base, f"trainer.max_steps={length}", f"optimizer.decay_start={start}", "branch=true",
                    f"ckpt_path={trunk / 'checkpoints' / f'step{start:06d}.ckpt'}", f"hydra.run.dir={branch}"]
        code = _run(args, where / f"b{length}.log")
        if code != 0:
            return f"{where}: branch {length} failed (exit {code})"
    return f"{where}: done in {time.time() - started:.0f} s"


def train(args: argparse.Namespace) -> None:
    plan = read_plan(args.plan)
    todo = units(plan)
    with ThreadPoolExecutor(args.jobs) as pool:
        # absolute: every run's folder and checkpoint are named to pe-train, whatever folder a run works in
        for line in pool.map(lambda u: train_unit(args.root.resolve(), plan, *u, extra=args.set), todo):
            print(line, flush=True)


def score(args: argparse.Namespace) -> None:
    with needs_extra("report", "pe-bench training-length score"):  # its tests (scipy) and its figure (matplotlib)
        import matplotlib  # noqa: F401
        import scipy  # noqa: F401
    from pe_geometry.analysis.study.training_length import score_experiment

    score_experiment(args.root, read_plan(args.plan), args.out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("step", choices=["train", "score"])
    parser.add_argument("--root", type=Path, default=RUNS)
    parser.add_argument("--plan", type=Path, default=PLAN)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="pe-train overrides for every run (another corpus, a smaller model: a smoke test)")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """``pe-bench training-length train|score``."""
    train(args) if args.step == "train" else score(args)
