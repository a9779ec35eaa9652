"""Every command of the README's Quick start runs as written, so an example cannot go stale (issue 53 item 9).

The commands are read from README.md itself, run one after another in one folder as a user would paste them, with
three changes a test needs and nothing else:
- sizes are tiny (``TINY_TEXT`` on a text run, a few steps on a task run), and a sweep's lists keep their first two
  values;
- placeholders (``<date>/<time>_<run>``, ``<its folder>``, ...) become the folders the earlier commands made, found by
  the names the README gives them (a README that names a folder wrongly fails here);
- commands that cannot run here are replaced by a check of what they need: ``wandb leet`` (a terminal UI) by W&B's
  own reader of the same folder (``wandb leet inspect --summary``), ``wandb sync`` (network, account) by the offline
  run folders it names existing; ``pe-pretrained smollm2`` (a real 135M checkpoint, minutes) is left to tests/test_pretrained.py.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

TINY_TEXT = ["model.d_model=32", "model.n_heads=4", "model.n_layers=2", "data.seq_len=32", "data.batch_size=4",
             "data.corpus.max_train_plays=1", "trainer.max_steps=4", "trainer.val_check_interval=2",
             "trainer.limit_val_batches=1", "callbacks.checkpoint.every_n_train_steps=2", "callbacks.geometry.every_n_steps=2"]
TINY_TASK = ["trainer.max_steps=4", "trainer.val_check_interval=2", "callbacks.checkpoint.every_n_train_steps=2"]
NOT_RUN_HERE = ("pe-pretrained",)


def quick_start_commands() -> list[str]:
    """The command lines of the Quick start section's code blocks, comments removed."""
    text = README.read_text(encoding="utf-8")
    section = re.search(r"^## Quick start\n(.*?)(?=^## )", text, flags=re.S | re.M).group(1)
    lines = []
    for block in re.findall(r"^```bash\n(.*?)^```", section, flags=re.S | re.M):
        for line in block.splitlines():
            command = line.split("  #", 1)[0].strip()
            if command:
                lines.append(command)
    return lines


def one_folder(pattern: str, cwd: Path) -> str:
    found = sorted(glob.glob(pattern, root_dir=cwd))
    assert len(found) == 1, f"the README's folder {pattern!r} matches {found} in {cwd}"
    return found[0]


def shrink_lists(args: list[str]) -> list[str]:
    """A sweep's comma lists cut to their first two values."""
    return [f"{k}={','.join(v.split(',')[:2])}" if "," in v and "=" in a else a
            for a in args for k, _, v in [a.partition("=")]]


def test_the_quick_start_names_the_commands_this_test_runs():
    commands = quick_start_commands()
    assert commands[0] == "pe-train" and any(c.startswith("wandb leet") for c in commands)
    assert len(commands) >= 12  # every line of both blocks (a parse that lost lines would pass everything below)


@pytest.mark.slow
def test_every_quick_start_command_runs_as_written(tmp_path, cache_dir):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PE_CACHE_DIR": str(cache_dir), "WANDB_MODE": "offline",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_SILENT": "true"}
    bin_dir = Path(sys.executable).parent
    places: dict[str, str] = {}
    sweep_args: list[str] = []
    ran = []

    def run(argv: list[str]) -> None:
        result = subprocess.run([str(bin_dir / argv[0]) if (bin_dir / argv[0]).exists() else argv[0], *argv[1:]],
                                cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, f"{' '.join(argv)} exited {result.returncode}:\n{result.stderr[-3000:]}"
        ran.append(argv[0])

    for command in quick_start_commands():
        # placeholders with spaces in them made one word each before the line is split
        argv = shlex.split(command.replace("<the sweep's arguments>", "@sweep-arguments@").replace("<its folder>", "@its-folder@"))
        if argv[0] in NOT_RUN_HERE:
            continue
        # placeholders -> the folders the earlier commands made, found by the README's own names
        words = []
        for word in argv:
            if word == "@sweep-arguments@":
                words += sweep_args
                continue
            if "@its-folder@" in word:
                word = word.replace("@its-folder@", places["sweep"])
            for pattern in re.findall(r"(?:outputs|multirun)/<date>/<time>_[^/\s]*", word):
                glob_pattern = pattern.replace("<date>", "*").replace("<time>", "*").replace("<run>", "*default_decoder*")
                word = word.replace(pattern, one_folder(glob_pattern, tmp_path))
            if word.endswith("offline-run-*"):  # a W&B run folder per segment of the run (its resume made one too)
                assert glob.glob(word, root_dir=tmp_path), f"no W&B run folder {word}"
            assert "<" not in word, f"a placeholder this test does not know: {word}"
            words.append(word)
        if words[:2] == ["wandb", "leet"]:
            run(["wandb", "leet", "inspect", "--summary", *words[2:]])
            continue
        if words[:2] == ["wandb", "sync"]:
            continue  # (network and an account: the folders it names were checked above)
        if words[0] == "pe-train":
            sweep = "-m" in words
            task = any("length_tasks" in w for w in words)
            if sweep and not any(w.startswith(("ckpt_path=", "hydra.sweep.dir=")) for w in words):
                words = shrink_lists(words)
            resume = any(w.startswith("ckpt_path=") for w in words)
            if not resume:
                words += TINY_TASK if task else TINY_TEXT
            if sweep and not task and not resume:
                sweep_args = words[1:]
                before = set(glob.glob("multirun/*/*", root_dir=tmp_path))
                run(words)
                places["sweep"] = (set(glob.glob("multirun/*/*", root_dir=tmp_path)) - before).pop()
                continue
        if words[0] == "pe-generate":
            words += ["max_new_tokens=8", "num_samples=1"]
        run(words)
    assert {"pe-train", "pe-report", "pe-generate", "pe-bench", "wandb"} <= set(ran)
