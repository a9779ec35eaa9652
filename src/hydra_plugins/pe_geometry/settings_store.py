"""Hands every registered settings dataclass (``pe_geometry.settings``: ours, and those of packages that register
their own through the ``pe_geometry.settings`` entry point) to Hydra's ``ConfigStore`` before a config is composed,
as ``settings/<Dataclass>``: a group's yaml extends its class's node (``defaults: [/settings/RotarySettings@_here_,
_self_]``), so every default is in the composed config (bare overrides, ``--cfg job``, the checkpoint's run config).

Hydra imports the plugins of the ``hydra_plugins`` namespace when it starts and asks each search-path plugin for its
paths before it loads a config: that call is where the store is filled (it adds no path)."""

from __future__ import annotations

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class SettingsStore(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        from pe_geometry.settings import store_in_hydra

        store_in_hydra()
