"""Offline by default: import this first (before datasets, huggingface_hub or wandb) so nothing downloads at run time.

``setdefault`` keeps what the caller exported, so a user who really wants the hub or an online
W&B run can still say so in the environment.
"""

import os

OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",  # tokenizers / checkpoints: local files only
    "HF_DATASETS_OFFLINE": "1",  # datasets: local text only, never ask a hub
    "WANDB_MODE": "offline",  # a logger.wandb.offline=false run still stays offline unless the user exports WANDB_MODE
    "WANDB_SILENT": "true",
}
for _name, _value in OFFLINE_ENV.items():
    os.environ.setdefault(_name, _value)
