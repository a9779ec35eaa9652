"""Glue between the plain-torch model and Lightning/Hydra: task, config checks, run pipeline."""
