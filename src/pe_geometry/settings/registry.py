"""Where a class's settings are found: ours (each module of this package registers its components on import) and
those of packages that register their own through the ``pe_geometry.settings`` entry point; and Hydra's view of
them (``store_in_hydra``)."""

from __future__ import annotations

import functools
from importlib.metadata import entry_points

# each module registers its components when imported
import pe_geometry.settings.attention  # noqa: F401
import pe_geometry.settings.data  # noqa: F401
import pe_geometry.settings.model  # noqa: F401
import pe_geometry.settings.positional  # noqa: F401
import pe_geometry.settings.training  # noqa: F401
from pe_geometry.settings.base import REGISTRY, Settings, defaults

PLUGIN_GROUP = "pe_geometry.settings"  # the entry-point group of packages that register components of their own


@functools.cache
def load_plugins() -> tuple[str, ...]:
    """Import the modules other packages name in their ``pe_geometry.settings`` entry points (their ``component``
    calls register them); the names loaded. A module that fails to import is a plain error: its components would
    otherwise be silently unchecked."""
    loaded = []
    for entry in entry_points(group=PLUGIN_GROUP):
        entry.load()
        loaded.append(entry.value)
    return tuple(loaded)


def settings_of(target: str) -> type[Settings] | None:
    """The settings registered for a ``_target_`` (ours, or a plugin's), else None."""
    if target not in REGISTRY:
        load_plugins()
    return REGISTRY.get(target)


def store_in_hydra() -> None:
    """Every registered dataclass's defaults in Hydra's ``ConfigStore`` as ``settings/<Dataclass>`` (a group's
    yaml extends it). Idempotent."""
    from hydra.core.config_store import ConfigStore

    load_plugins()
    store = ConfigStore.instance()
    for cls in set(REGISTRY.values()):  # the class first: what a reader of ``--cfg job`` looks for
        store.store(group="settings", name=cls.__name__, node={"_target_": cls.target, **defaults(cls)})
