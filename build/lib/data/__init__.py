"""Real text for the models: corpus, tokenizer, disk cache and LightningDataModule."""
