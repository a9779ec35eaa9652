"""One torch-free settings dataclass per component: the single source of each setting's default, type, range and doc
(``base`` says how). Importing this package registers ours; ``settings_of(target)`` finds a class's settings."""

from pe_geometry.settings import attention, data, model, positional, training  # noqa: F401  (each registers its components)
from pe_geometry.settings.base import (  # noqa: F401
    MAX_SEED,
    REGISTRY,
    Settings,
    SettingsError,
    Sizes,
    component,
    defaults,
    field_problems,
    settings_of,
    store_in_hydra,
)
