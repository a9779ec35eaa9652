"""What a run prints while it trains: the plain progress lines of a log file and the parameter summary."""

from __future__ import annotations

import logging
import re

import lightning as L
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

from pe_geometry.training.progress import ParameterSummary, StepProgress


def fit_boring_model(callbacks: list, **trainer_kwargs) -> None:
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=callbacks, **trainer_kwargs)
    trainer.fit(BoringModel())


@pytest.mark.parametrize("accumulate", [1, 2])
def test_plain_progress_lines_come_once_per_optimiser_step(accumulate, caplog):
    """Before: with gradient accumulation each line came once per micro-batch, and a "step 0" line before any step."""
    with caplog.at_level(logging.INFO, logger="train"):
        fit_boring_model([StepProgress(log_every_n_steps=2, force_lines=True)], max_steps=6, accumulate_grad_batches=accumulate)
    steps = [int(m.group(1)) for r in caplog.records if (m := re.match(r"step (\d+)/6 \| ", r.getMessage()))]
    assert steps == [2, 4, 6]


def test_the_parameter_summary_is_lightnings_table_without_the_flops_it_cannot_count(caplog):
    with caplog.at_level(logging.INFO, logger="train"):
        fit_boring_model([ParameterSummary()], max_steps=1)
    table = "\n".join(r.getMessage() for r in caplog.records if r.name == "train")
    header = next(line for line in table.splitlines() if "Name" in line)
    assert [column.strip() for column in header.split("|")][1:] == ["Name", "Type", "Params", "Mode"]
    assert re.search(r"^\s*0\s*\|\s*layer\s*\|\s*Linear\s*\|\s*66\s*\|\s*train", table, re.M)  # BoringModel's 32 -> 2 layer
    assert re.search(r"^66\s+Total params$", table, re.M)
    assert "FLOPs" not in table and "Flops" not in table


class ValidatedBoringModel(BoringModel):
    """Logs its global step as val/loss, so a line shows which validation its val/loss came from."""

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", float(self.trainer.global_step))
        return super().validation_step(batch, batch_idx)


def test_the_last_line_waits_for_the_validation_after_the_last_step_and_a_sweep_job_names_itself(caplog, monkeypatch):
    """Before: the last line (step 6) showed step 4's val/loss, while the run summary had step 6's; parallel sweep jobs'
    lines could not be told apart."""
    from pe_geometry.training import progress
    from pe_geometry.training.progress import ValidateAtEnd

    monkeypatch.setattr(progress, "sweep_job_name", lambda: "3_decoder-learned-s1")
    with caplog.at_level(logging.INFO, logger="train"):
        trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_model_summary=False,
                            max_steps=6, val_check_interval=4, limit_val_batches=1, num_sanity_val_steps=0,
                            callbacks=[StepProgress(log_every_n_steps=2, force_lines=True), ValidateAtEnd()])
        trainer.fit(ValidatedBoringModel())
    lines = [r.getMessage() for r in caplog.records if r.name == "train" and "step " in r.getMessage()]
    assert [line.split(" | ")[0] for line in lines] == ["[3_decoder-learned-s1] step 2/6", "[3_decoder-learned-s1] step 4/6",
                                                       "[3_decoder-learned-s1] step 6/6"]
    assert "val/loss -" in lines[0] and "val/loss -" in lines[1]  # step 4's line comes before step 4's validation
    assert "val/loss 6.0000" in lines[2] and lines[2].endswith("ETA 0s")  # step 6's validation, not step 4's
