"""The config groups' yaml files say ``_target_`` and what differs from the class; the rest is the class's constructor's.

A class's ``__init__`` signature is the one source of each setting's default (``pe_geometry.signatures``):
``configs/pe/rope.yaml`` holds its ``_target_`` and the interpolation ``training_length: ${data.seq_len}``, and Hydra
composes ``pe.base: 10000.0`` and the other defaults from ``RotaryPE.__init__``, so that ``pe.base=500`` on the
command line overrides a key that is there, ``--cfg job`` prints every setting, and a checkpoint's run config holds
them all, as before.

How: a search-path plugin puts this project's config folder (``pkg://pe_geometry.configs``, or that folder as a
``file://`` path, as tests compose it) behind a config source that fills, in every node of a loaded file that names a
``_target_``, the keyword arguments the yaml leaves out that have a default, read from the source (no import: composing
stays as fast as ``--help``). Arguments the pipeline passes itself (``pe_geometry.configs.SUPPLIED``: the model's
width given to its encoding, ...) and classes of other libraries (Lightning's Trainer takes 40 arguments; its yaml
lists the ones we set) are left as the yaml says. A user's own config folder (``--config-dir``) is read as Hydra reads
it: its yaml says its settings itself, or ``+key=value`` adds one.
"""

from __future__ import annotations

import copy
import os
from typing import Any

from hydra._internal.core_plugins.file_config_source import FileConfigSource
from hydra._internal.core_plugins.importlib_resources_config_source import ImportlibResourcesConfigSource
from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.config_source import ConfigResult
from hydra.plugins.search_path_plugin import SearchPathPlugin
from omegaconf import DictConfig, OmegaConf

PACKAGE = "pe_geometry.configs"
OTHER_LIBRARIES = ("lightning.", "torch.", "wandb.")  # their classes' yaml lists what we set; the rest is theirs


def fill_constructor_defaults(config: Any, group: str | None) -> None:
    """Add to each ``_target_`` node of a loaded config file the constructor defaults its keys leave out."""
    from pe_geometry.configs import SUPPLIED
    from pe_geometry.signatures import EMPTY, Unreadable, constructor_params

    def visit(node: Any, path: tuple[str, ...]) -> None:
        if not isinstance(node, dict):
            return
        for key, value in node.items():
            visit(value, (*path, str(key)))
        name = node.get("_target_")
        if not isinstance(name, str) or "${" in name or name.startswith(OTHER_LIBRARIES):
            return
        try:
            params = constructor_params(name, import_if_needed=False)
        except (Unreadable, ImportError):
            return  # left as the yaml says; the schema reads it when the run starts
        supplied = SUPPLIED.get(group or (path[0] if path else ""), set())
        home = name.split(".", 1)[0]
        for param in (params or {}).values():
            inherited = param.owner.split(".", 1)[0] != home  # (a subclass of Lightning's ModelCheckpoint)
            if param.name not in node and param.name not in supplied and param.default is not EMPTY and not inherited:
                value = list(param.default) if isinstance(param.default, tuple) else param.default
                OmegaConf.update(config, ".".join((*path, param.name)), value, force_add=True)

    if isinstance(config, DictConfig):
        visit(OmegaConf.to_container(config, resolve=False), ())


def _group(config_path: str, header: dict) -> str | None:
    """The group a file's root node is placed at (``pe/rope`` -> ``pe``); None for ``@package _global_`` files and the
    primary config, whose nodes are placed by their own keys."""
    package = header.get("package")
    if package == "_global_" or "/" not in config_path:
        return None
    return package or config_path.split("/", 1)[0]


class _Filling:
    # Each file loaded and filled once per process, again when it changes on disk: Hydra reads every file of the
    # defaults list again for each composition (a multirun composes once per job; the tests ~700 times), and parsing
    # the yaml and filling the defaults was a third of a composition's time. Hydra may change what it is given, so
    # each caller gets its own copy.
    _loaded: dict[tuple, tuple[tuple[int, int], ConfigResult]] = {}  # (source, file) -> (its stamp, the filled file)

    def load_config(self, config_path: str) -> ConfigResult:
        stamp = _stamp(self.path, config_path)  # type: ignore[attr-defined]
        key = (self.scheme(), self.path, config_path)  # type: ignore[attr-defined]
        if stamp is None or self._loaded.get(key, (None,))[0] != stamp:
            result = super().load_config(config_path)  # type: ignore[misc]
            fill_constructor_defaults(result.config, _group(config_path, result.header))
            if stamp is None:
                return result
            self._loaded[key] = (stamp, result)
        return copy.deepcopy(self._loaded[key][1])


def _stamp(root: str, config_path: str) -> tuple[int, int] | None:
    """The file's modification time and size, or None where it is not a plain file on disk (then it is not kept)."""
    if not os.path.isdir(root):  # the package source's path is the module's name: its folder (files there too)
        from pe_geometry.configs import CONFIG_DIR

        root = str(CONFIG_DIR)
    name = config_path if config_path.endswith((".yaml", ".yml")) else f"{config_path}.yaml"
    try:
        stat = os.stat(os.path.join(root, name))
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size


class ConstructorDefaultsPackageSource(_Filling, ImportlibResourcesConfigSource):
    @staticmethod
    def scheme() -> str:
        return "pe-geometry-pkg"


class ConstructorDefaultsFileSource(_Filling, FileConfigSource):
    @staticmethod
    def scheme() -> str:
        return "pe-geometry-file"


class ConstructorDefaultsSearchPath(SearchPathPlugin):
    """Reads this project's config folder through the sources above, wherever Hydra found it."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        from pe_geometry.configs import CONFIG_DIR

        for element in search_path.get_path():
            if element.path == f"pkg://{PACKAGE}":
                element.path = f"pe-geometry-pkg://{PACKAGE}"
            elif element.path in (f"file://{CONFIG_DIR}", str(CONFIG_DIR)):
                element.path = f"pe-geometry-file://{CONFIG_DIR}"
