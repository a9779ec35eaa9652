"""One torch-free settings dataclass per component: the single source of each setting's default, type, range and doc
(``base`` says how). Importing this package registers ours; ``settings_of(target)`` finds a class's settings."""

from pe_geometry.settings.base import (  # noqa: F401
    MAX_SEED,
    REGISTRY,
    Settings,
    SettingsError,
    Sizes,
    component,
    defaults,
    field_problems,
)
from pe_geometry.settings.registry import load_plugins, settings_of, store_in_hydra  # noqa: F401
