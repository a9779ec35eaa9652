"""A bare override of a key the chosen option does not have, answered in one line before Hydra composes.

``pe=alibi pe.rotary_fraction=0.5`` names a setting of RoPE on an ALiBi run. Hydra's answer is six lines ("Could
not override 'pe.rotary_fraction' ... Key 'rotary_fraction' is not in struct", exit 1); the user needs one: which
option was chosen, what it does take, and which options take the key. The option's keys are read from its yaml and
from the settings dataclass its defaults list extends (``/settings/<Dataclass>@_here_``), torch-free. Where the
composition is not plain (an option that sets other groups, a key an experiment or control adds, a sweep over the
group) nothing is said and Hydra's own check applies.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SETS_OTHER_GROUPS = ("experiment", "control", "model")  # options that may choose another group's option
NOT_OPTION_GROUPS = ("hydra", "experiment", "control", "paths")
SETTINGS_PREFIX, HERE = "/settings/", "@_here_"


def _load(path: Path) -> dict | None:
    from omegaconf import OmegaConf

    if not path.is_file():
        return None
    node = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    return node if isinstance(node, dict) else None


def _settings_fields(name: str) -> set[str] | None:
    from pe_geometry.settings.base import REGISTRY
    from pe_geometry.settings.registry import load_plugins

    load_plugins()
    cls = next((c for c in REGISTRY.values() if c.__name__ == name), None)
    return None if cls is None else {f.name for f in dataclasses.fields(cls)}


def option_keys(group: str, option: str) -> set[str] | None:
    """The keys ``group=option`` has once composed, or None where its composition is not plain."""
    path = CONFIGS / group / f"{option}.yaml"
    if not path.is_file() or path.read_text().lstrip().startswith("# @package _global_"):
        return None
    node = _load(path)
    if node is None:
        return None
    keys = {k for k in node if k != "defaults"}
    for entry in node.get("defaults") or []:
        if entry == "_self_":
            continue
        if not (isinstance(entry, str) and entry.startswith(SETTINGS_PREFIX)):
            return None  # another file's keys join this node: leave it to Hydra
        name, _, package = entry[len(SETTINGS_PREFIX):].partition("@")
        if package and package != HERE[1:]:
            keys.add(package)  # /settings/ShakespeareCorpusSettings@corpus: a sub-node, checked by the schema
            continue
        fields = _settings_fields(name)
        if fields is None:
            return None
        keys |= fields
    return keys


def _overrides(argv: list[str]) -> list[tuple[str, str]]:
    """(key, value) of each plain ``key=value`` argument (not ``+``/``++``/``~``, not a flag)."""
    pairs = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key and key[0] not in "+~-":
            pairs.append((key, value))
    return pairs


def _chain(group: str, option: str, seen: set[str]) -> list[dict]:
    """The yaml of ``group=option`` and of the options of its own group it builds on (an experiment's
    ``defaults: [length_tasks]``), base first."""
    if (group, option) in seen:
        return []
    seen.add((group, option))
    node = _load(CONFIGS / group / f"{option}.yaml")
    if node is None:
        return []
    nodes = []
    for entry in node.get("defaults") or []:
        if isinstance(entry, str) and entry != "_self_" and not entry.startswith("/"):
            nodes += _chain(group, entry, seen)
    return [*nodes, node]


def _chosen(group: str, given: dict[str, str], sweep: bool) -> str | None:
    """The option of ``group`` the command composes, or None where it cannot be read plainly."""
    if group in given:
        value = given[group]
        return None if "," in value or "(" in value else value  # a sweep over options: each job says its own
    chosen = None
    for entry in (_load(CONFIGS / "train.yaml") or {}).get("defaults") or []:
        if isinstance(entry, dict) and group in entry:
            chosen = entry[group]
    for setter in SETS_OTHER_GROUPS:
        if setter not in given:
            continue
        for node in _chain(setter, given[setter], set()):
            for entry in node.get("defaults") or []:
                if isinstance(entry, dict) and f"override /{group}" in entry:
                    chosen = entry[f"override /{group}"]
            if sweep and group in ((node.get("hydra") or {}).get("sweeper") or {}).get("params", {}):
                return None
    return None if chosen in (None, "null") else str(chosen)


def _set_elsewhere(group: str, key: str, given: dict[str, str]) -> bool:
    """An experiment or control arm sets ``group.key`` itself (then the key exists once composed)."""
    for setter in ("experiment", "control"):
        if setter in given:
            for node in _chain(setter, given[setter], set()):
                section: Any = node.get(group)
                if isinstance(section, dict) and key in section:
                    return True
    return False


def key_of_another_option(argv: list[str]) -> str | None:
    """One line for the first plain ``group.key=value`` whose chosen option has no such key, else None."""
    pairs = _overrides(argv)
    given = {k: v for k, v in pairs if "." not in k}
    sweep = "-m" in argv or "--multirun" in argv
    groups = {p.name for p in CONFIGS.iterdir() if p.is_dir() and p.name not in NOT_OPTION_GROUPS}
    for dotted, _ in pairs:
        group, _, rest = dotted.partition(".")
        if group not in groups or not rest:
            continue
        key = rest.split(".", 1)[0]
        option = _chosen(group, given, sweep)
        keys = option_keys(group, option) if option else None
        if keys is None or key in keys or _set_elsewhere(group, key, given):
            continue
        takers = sorted(p.stem for p in (CONFIGS / group).glob("*.yaml") if key in (option_keys(group, p.stem) or ()))
        where = (f"it is a setting of {', '.join(f'{group}={t}' for t in takers)}" if takers
                 else f"no {group} option has it")
        return (f"{dotted} is not a setting of {group}={option} (its settings: {', '.join(sorted(keys - {'_target_', '_partial_'}))}); "
                f"{where}")
    return None
