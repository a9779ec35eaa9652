"""The Hydra config groups, shipped as package data: Hydra reaches them as ``pkg://pe_geometry.configs``."""

from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent

# Before the package was namespaced, every ``_target_`` began with one of these top-level names
# (``model.RotaryPE``, ``training.callbacks.StepCheckpoint``): runs and checkpoints written then still read.
_OLD_TOP_LEVEL = ("model", "data", "training", "analysis")


def current_target(target: str) -> str:
    """A ``_target_`` as this version spells it: ``model.RotaryPE`` -> ``pe_geometry.model.RotaryPE``."""
    return f"pe_geometry.{target}" if isinstance(target, str) and target.split(".", 1)[0] in _OLD_TOP_LEVEL else target


# Constructor arguments the pipeline passes itself (the data's vocabulary, the model's width given to its encoding, ...):
# not config keys. The schema refuses them in a group's node; the constructor defaults Hydra composes leave them out.
SUPPLIED: dict[str, set[str]] = {
    "model": {"vocab_size", "mask_token_id", "pe", "embedding", "attention"},
    "pe": {"d_model", "n_heads"},
    "embedding": {"vocab_size", "d_model"},
    "attention": {"d_model", "n_heads", "pe", "dropout"},  # dropout: model.dropout
    "trainer": {"callbacks", "logger", "plugins"},
    "logger": {"resume_step", "config", "group", "job_type", "id", "resume"},
    "optimizer": {"model", "max_steps"},  # LanguageModelTask calls the bound factory with them
}
