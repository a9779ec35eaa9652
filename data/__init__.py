"""Real text for the models: corpus, tokenizer, disk cache and LightningDataModule."""

import os

# Offline unless the user says otherwise (HF_DATASETS_OFFLINE=0 HF_HUB_OFFLINE=0 to load a hub dataset):
# set before anything imports `datasets`, which reads these once.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
