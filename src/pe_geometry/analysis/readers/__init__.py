"""Readers of runs (logs, checkpoints) and of pretrained checkpoints, and the scoring a benchmark reads them with."""
