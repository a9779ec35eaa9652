"""Real text for the models: corpus, tokenizer, disk cache and LightningDataModule."""

# Offline unless the user exports otherwise (HF_DATASETS_OFFLINE=0 HF_HUB_OFFLINE=0 to load a hub dataset):
# set before any data module imports `datasets`, which reads these once.
import pe_geometry.offline  # noqa: F401
