"""The Hydra config groups, shipped as package data: Hydra reaches them as ``pkg://pe_geometry.configs``."""

from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).resolve().parent

# Before the package was namespaced, every ``_target_`` began with one of these top-level names
# (``model.RotaryPE``, ``training.callbacks.StepCheckpoint``): runs and checkpoints written then still read.
_OLD_TOP_LEVEL = ("model", "data", "training", "analysis")


def current_target(target: str) -> str:
    """A ``_target_`` as this version spells it: ``model.RotaryPE`` -> ``pe_geometry.model.RotaryPE``."""
    return f"pe_geometry.{target}" if isinstance(target, str) and target.split(".", 1)[0] in _OLD_TOP_LEVEL else target


def with_current_targets(node: Any) -> Any:
    """A config container (dicts and lists) with every ``_target_`` as this version spells it."""
    if isinstance(node, dict):
        return {k: current_target(v) if k == "_target_" else with_current_targets(v) for k, v in node.items()}
    if isinstance(node, list):
        return [with_current_targets(v) for v in node]
    return node
