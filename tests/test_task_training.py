"""data=task trains a decoder in process: the loss on the answer tokens only, the answer accuracy logged at validation."""

from __future__ import annotations

import math

import pytest
import torch

from pe_geometry.analysis.readers.runs import read_run_rows
from pe_geometry.data.task_datamodule import TaskDataModule
from pe_geometry.model.transformer import DecoderLM
from pe_geometry.training.pipeline import train
from pe_geometry.training.task import LanguageModelTask
from tests.conftest import compose_train_config

TINY_TASK = [
    "data=task", "model.d_model=32", "model.n_heads=4", "model.n_layers=2",
    "data.seq_len=16", "data.batch_size=4", "data.val_examples=8",
    "trainer.max_steps=3", "trainer.val_check_interval=3", "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=1", "trainer.enable_model_summary=false",
    "callbacks.checkpoint.every_n_train_steps=2", "~callbacks.progress_bar",
    "optimizer.warmup_steps=1", "logger=csv",
]


@pytest.mark.parametrize("task", ["copy", "passkey"])
def test_a_tiny_run_on_a_task_logs_the_answer_accuracy(task, tmp_path):
    cfg = compose_train_config([*TINY_TASK, f"data.task={task}"], output_dir=tmp_path / "run")
    metrics = train(cfg)
    assert math.isfinite(metrics["train/loss"]) and math.isfinite(metrics["val/loss"])
    for key in ("val/answer_accuracy", "val/answer_exact_match"):
        assert 0.0 <= metrics[key] <= 1.0
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()


def test_a_resumed_task_run_continues_the_same_curve(tmp_path):
    """The generated batches resume where they stopped: the curve from the step-2 checkpoint is the straight run's."""
    def losses():
        return {int(r["step"]): float(r["train/loss"]) for r in read_run_rows(tmp_path / "run") if r["train/loss"]}

    straight = [*TINY_TASK, "data.task=associative_recall", "data.seq_len=24", "trainer.max_steps=5",
                "trainer.val_check_interval=5", "callbacks=no_geometry"]
    train(compose_train_config(straight, output_dir=tmp_path / "run"))
    a = losses()
    step2 = tmp_path / "run" / "checkpoints" / "step000002.ckpt"
    train(compose_train_config([*straight, f"ckpt_path={step2}"], output_dir=tmp_path / "run"))
    b = losses()
    assert (tmp_path / "run" / "csv" / "resume-step2" / "metrics.csv").is_file()  # b's rows from step 2 on are the resume's
    assert sorted(a) == sorted(b) == list(range(5))
    assert all(math.isclose(a[s], b[s], rel_tol=1e-6) for s in a), (a, b)


@pytest.mark.filterwarnings("ignore:You are trying to `self.log")  # training_step outside a Trainer
def test_the_task_loss_is_the_cross_entropy_of_the_answer_tokens():
    torch.manual_seed(0)
    dm = TaskDataModule(task="addition", seq_len=20, batch_size=4, val_examples=4)
    model = DecoderLM(dm.vocab_size, d_model=16, n_heads=2, n_layers=1)
    blocks, mask = next(iter(dm.train_dataloader()))
    loss = LanguageModelTask(model).training_step((blocks, mask), 0)
    logits = model(blocks[:, :-1])
    scored = mask[:, 1:]
    assert loss.item() == pytest.approx(torch.nn.functional.cross_entropy(logits[scored], blocks[:, 1:][scored]).item(), rel=1e-5)
    # a plain block (a text datamodule's) still trains on every next token
    assert LanguageModelTask(model).training_step(blocks, 0).item() == pytest.approx(model.loss(blocks).item())
