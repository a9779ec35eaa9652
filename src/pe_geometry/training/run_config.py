"""The run's resolved config travels inside every checkpoint, and a resume is checked against it.

A resume trains with the checkpoint's ``run_config``, every key of it, except what the command line sets
explicitly: ``python train.py ckpt_path=<run>/checkpoints/last.ckpt`` continues the run as it was configured
(its model and PE, but also its ``trainer.max_steps``, cadences and loggers), whatever the defaults say.
An override that contradicts the checkpoint on a setting that defines what is trained (``FIXED_ON_RESUME``)
is one error naming every differing key, raised before anything in the run directory is written. Other
overrides (``trainer.max_steps=2000``, a logger, a cadence, devices) apply; the changes are recorded in
``config-resume-step<N>.yaml``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lightning as L
from omegaconf import DictConfig, OmegaConf, open_dict

from pe_geometry.configs import CONFIG_DIR as CONFIG_GROUPS_DIR
from pe_geometry.configs import with_current_targets
from pe_geometry.training.validate import ConfigError

# Settings that define what is being trained: a resume takes them from the checkpoint.
FIXED_ON_RESUME = (
    "model", "pe", "embedding", "attention", "data", "optimizer", "seed", "run_name",
    "trainer.precision", "trainer.accumulate_grad_batches", "trainer.gradient_clip_val",
)
_ABSENT = object()  # a key a config does not have
# ...except these, which say where or how fast, not what.
FREE_WITHIN_FIXED = ("data.num_workers", "data.cache_dir")


def is_fixed_on_resume(key: str) -> bool:
    """``model.d_model`` -> True, ``trainer.max_steps`` -> False (dotted config keys)."""
    def under(prefixes: Iterable[str]) -> bool:
        return any(key == p or key.startswith(p + ".") for p in prefixes)

    return under(FIXED_ON_RESUME) and not under(FREE_WITHIN_FIXED)


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> ``{"model.d_model": 64, ...}``; lists stay values."""
    if isinstance(node, dict) and node:
        out: dict[str, Any] = {}
        for key, value in node.items():
            out |= flatten(value, f"{prefix}{key}.")
        return out
    return {prefix[:-1]: node}


def _global_group_keys(group: str, option: str, seen: frozenset[str] = frozenset()) -> set[str]:
    """Every dotted key a ``@package _global_`` option (``experiment=quick``, ``control=untied_head``) sets:
    its own keys, the groups its ``defaults`` override (``override /pe: learned`` sets ``pe``), and
    the keys of the options of its own group that it extends (``controls_learned`` extends ``orthogonality``)."""
    path = CONFIG_GROUPS_DIR / group / f"{option}.yaml"
    if not path.is_file() or f"{group}/{option}" in seen:
        return set()
    node = OmegaConf.to_container(OmegaConf.load(path))
    keys: set[str] = set()
    for entry in node.pop("defaults", None) or []:
        if isinstance(entry, str) and entry != "_self_":
            keys |= _global_group_keys(group, entry, seen | {f"{group}/{option}"})
        elif isinstance(entry, dict):
            for target in entry:
                name = str(target).removeprefix("override").strip().lstrip("/")
                if name and not name.startswith("hydra"):
                    keys.add(name.replace("/", "."))
    node.pop("hydra", None)
    return keys | set(flatten(node))


GLOBAL_GROUPS = ("experiment", "control")  # groups whose options write anywhere in the config (@package _global_)


def _composed(overrides: list[str]) -> dict:
    """configs/train.yaml composed with ``overrides``, unresolved (Hydra's compose API: inside ``train.py`` it uses
    the running app's search path; elsewhere, a test or a notebook, configs/ itself)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return OmegaConf.to_container(compose(config_name="train", overrides=overrides), resolve=False)
    with initialize_config_dir(config_dir=str(CONFIG_GROUPS_DIR), version_base="1.3"):
        return OmegaConf.to_container(compose(config_name="train", overrides=overrides), resolve=False)


def _differing(a: Any, b: Any, prefix: str = "") -> set[str]:
    """Dotted keys where two composed configs differ; a node present in one only is one key (``logger.wandb``)."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys: set[str] = set()
        for key in set(a) | set(b):
            if key not in a or key not in b:
                keys.add(f"{prefix}{key}")
            else:
                keys |= _differing(a[key], b[key], f"{prefix}{key}.")
        return keys
    return set() if a == b else {prefix[:-1]}


def group_option_keys(group: str, option: str) -> set[str]:
    """What ``<group>=<option>`` sets: the keys where that option differs from the group's default (``trainer=ddp``
    sets strategy and devices, not max_steps; ``logger=csv`` removes ``logger.wandb``; ``callbacks=no_geometry``
    removes ``callbacks.geometry`` only), and always its ``_target_`` (``pe=sinusoidal`` given on a RoPE run is
    a contradiction even though sinusoidal is the default). Falls back to the whole group if it cannot compose."""
    try:
        default, chosen = _composed([]), _composed([f"{group}={option}"])
    except Exception:  # noqa: BLE001 - an option Hydra cannot compose here: the conservative answer
        return {group}
    keys = {k for k in _differing(default, chosen) if not k.startswith("hydra")}
    if isinstance(chosen.get(group), dict) and "_target_" in chosen[group]:
        keys.add(f"{group}._target_")
    return keys


def overridden_keys(overrides: Iterable[str]) -> set[str]:
    """The dotted keys a list of Hydra command-line overrides sets.

    ``model.d_model=64`` sets ``model.d_model``; a group choice sets what that option changes
    (``group_option_keys``); ``experiment=quick`` and ``control=untied_head`` also set every key of their
    file (and the groups its defaults override), even where it equals the default. ``hydra.*`` is ignored.
    """
    keys: set[str] = set()
    for override in overrides:
        key, _, value = override.partition("=")
        key = key.lstrip("~+")
        if key.startswith("hydra") or "/" in key:
            continue
        if (CONFIG_GROUPS_DIR / key).is_dir() and not override.startswith("~"):
            if value not in ("", "null"):
                keys |= group_option_keys(key, value)
                if key in GLOBAL_GROUPS:
                    keys |= _global_group_keys(key, value)
            continue
        keys.add(key)
    return keys


def _arm(choice: Any) -> str | None:
    """A control choice as the arm it trains: none, ``baseline`` and ``<pe>_baseline`` all change nothing."""
    choice = None if choice in (None, "null", "None", "") else str(choice)
    return None if choice is None or choice == "baseline" or choice.endswith("_baseline") else choice


def choice_contradictions(saved_choices: dict[str, Any] | None, overrides: Iterable[str]) -> dict[str, tuple[Any, Any]]:
    """``experiment=``/``control=`` on the command line that names another study or arm than the checkpoint's
    (``control=baseline`` on an ``untied_head`` run sets no key, so only the recorded choice can tell)."""
    if not saved_choices:
        return {}
    out = {}
    for override in overrides:
        key, _, value = override.partition("=")
        if key in GLOBAL_GROUPS and key in saved_choices:
            old, new = saved_choices[key], value
            same = _arm(old) == _arm(new) if key == "control" else str(old) == str(new) or {old, new} <= {None, "null", ""}
            if not same:
                out[key] = (old, new)
    return out


def contradictions(current: dict[str, Any], saved: dict[str, Any], overridden: set[str]) -> dict[str, tuple[Any, Any]]:
    """``{key: (saved, current)}`` for fixed-on-resume keys the user overrode to a different value."""
    flat_now, flat_saved = flatten(current), flatten(saved)
    out = {}
    for key in sorted(set(flat_now) | set(flat_saved)):
        now, before = flat_now.get(key, _ABSENT), flat_saved.get(key, _ABSENT)
        if not is_fixed_on_resume(key) or now == before or (_scalar(now) and _scalar(before) and str(now) == str(before)):
            continue  # ("16" in the checkpoint and 16 typed now: the same precision)
        if any(key == o or key.startswith(o + ".") for o in overridden):
            out[key] = (flat_saved.get(key, "<absent>"), flat_now.get(key, "<absent>"))
    return out


def _scalar(value: Any) -> bool:
    return isinstance(value, (str, int, float)) and not isinstance(value, bool)


def saved_run_config(checkpoint: dict, ckpt_path: Path) -> dict[str, Any] | None:
    """The checkpoint's ``run_config``, else its run directory's ``config.yaml`` (older checkpoints)."""
    if isinstance(checkpoint.get("run_config"), dict):
        return checkpoint["run_config"]
    legacy = ckpt_path.parent.parent / "config.yaml"
    if ckpt_path.parent.name == "checkpoints" and legacy.is_file():
        return OmegaConf.to_container(OmegaConf.load(legacy), resolve=True)
    return None


def _get(tree: dict, key: str, missing: Any = None) -> Any:
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return missing
        node = node[part]
    return node


def _set(tree: dict, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def _delete(tree: dict, key: str) -> None:
    *parents, leaf = key.split(".")
    node = _get(tree, ".".join(parents)) if parents else tree
    if isinstance(node, dict):
        node.pop(leaf, None)


COLLECTIONS = ("logger", "callbacks")  # groups whose members are the choice itself: a member the run had not is not added


def _relocate(node: Any, old: str, new: str) -> Any:
    """Paths inside the run folder follow the folder (a run moved or copied elsewhere resumes in place)."""
    if isinstance(node, dict):
        return {k: _relocate(v, old, new) for k, v in node.items()}
    if isinstance(node, list):
        return [_relocate(v, old, new) for v in node]
    if isinstance(node, str) and old and (node == old or node.startswith(old.rstrip("/") + "/")):
        return new + node[len(old):]
    return node


def _fill_new_settings(run: dict, now: dict, path: str = "") -> None:
    """Settings the code gained after the checkpoint was written (a new callback option, say) take their default;
    never inside a node built from another class, and never a logger or callback the run did not have."""
    if isinstance(run.get("_target_"), str) and run.get("_target_") != now.get("_target_"):
        return
    for key, value in now.items():
        if key not in run:
            if path not in COLLECTIONS:
                run[key] = value
        elif isinstance(run[key], dict) and isinstance(value, dict):
            _fill_new_settings(run[key], value, f"{path}.{key}" if path else key)


def _derived_keys(raw: dict, prefix: str = "") -> list[str]:
    """Keys whose composed value is an interpolation (``data.seed: ${seed}``, ``data.cache_dir: ${paths.cache_dir}/data``)."""
    keys = []
    for key, value in raw.items():
        full = f"{prefix}{key}"
        if isinstance(value, dict):
            keys += _derived_keys(value, full + ".")
        elif isinstance(value, str) and "${" in value:
            keys.append(full)
    return keys


def resumed_config(current_raw: dict, saved: dict, overridden: set[str], run_dir: Path) -> dict:
    """The config a resume trains with: the checkpoint's, with what the command line set explicitly.

    - every key the overrides set (``trainer.max_steps=400``, ``logger=csv``, ``~callbacks.sample``) comes from
      the command line; every other key from the checkpoint, so the printed resume command
      (``ckpt_path=...`` alone) continues the run exactly as it was configured;
    - paths inside the original run folder are moved to where the folder is now;
    - a key that was derived (``data.seed: ${seed}``) stays derived where it resolves to the checkpoint's
      value, so that overriding its source (``paths.cache_dir=...``) moves it too.
    """
    merged = _relocate(copy.deepcopy(saved), str(_get(saved, "paths.output_dir") or ""), str(run_dir))
    _set(merged, "paths.output_dir", str(run_dir))
    derived = _still_derived(merged, current_raw)  # judged on the run's own values, before any override
    for key in sorted(overridden, key=len):
        value = _get(current_raw, key, _ABSENT)
        if value is _ABSENT:
            _delete(merged, key)
        else:
            _set(merged, key, copy.deepcopy(value))
    for key in derived:
        if not any(key == o or key.startswith(o + ".") for o in overridden) and _get(merged, key, _ABSENT) is not _ABSENT:
            _set(merged, key, _get(current_raw, key))
    _fill_new_settings(merged, current_raw)
    merged["ckpt_path"] = current_raw.get("ckpt_path")
    return merged


def _still_derived(run: dict, current_raw: dict) -> list[str]:
    """The keys that are interpolations now (``data.cache_dir: ${paths.cache_dir}/data``) and that, resolved
    against the run's own config, give the run's value: they were derived in the run too, so they stay derived."""
    candidates = [k for k in _derived_keys(current_raw) if _get(run, k, _ABSENT) is not _ABSENT]
    trial = copy.deepcopy(run)
    for key in candidates:
        _set(trial, key, _get(current_raw, key))
    resolved = OmegaConf.create(trial)
    derived = []
    for key in candidates:
        try:
            if OmegaConf.select(resolved, key) == _get(run, key):
                derived.append(key)
        except Exception:  # noqa: BLE001, S112 - an interpolation that cannot resolve here keeps the checkpoint's value
            continue
    return derived




def apply_resume_config(cfg: DictConfig, saved: dict[str, Any], overrides: Iterable[str], ckpt_path: Path,
                        run_dir: Path | None = None, current_raw: dict | None = None,
                        saved_choices: dict[str, Any] | None = None) -> dict[str, tuple]:
    """Make ``cfg`` the checkpoint's config plus the command line's explicit overrides (``resumed_config``);
    returns what differs from the checkpoint ``{key: (old, new)}``.

    Raises ConfigError listing every fixed key the overrides contradict, before ``cfg`` is touched.
    """
    run_dir = Path(run_dir if run_dir is not None else cfg.paths.output_dir)
    saved = with_current_targets(saved)  # a checkpoint from before the namespaced package names model.RotaryPE
    overrides = list(overrides)
    overridden = overridden_keys(overrides)
    current = OmegaConf.to_container(cfg, resolve=True)
    bad = {**choice_contradictions(saved_choices, overrides), **contradictions(current, saved, overridden)}
    if bad:
        listed = "; ".join(f"{k}: checkpoint {old!r}, command line {new!r}" for k, (old, new) in bad.items())
        raise ConfigError(
            f"ckpt_path={ckpt_path} was trained with other settings ({listed}). A resume keeps "
            f"{', '.join(FIXED_ON_RESUME)} from the checkpoint (it may change {', '.join(FREE_WITHIN_FIXED)}, trainer.max_steps, "
            "logger, callbacks, paths and devices); drop those overrides, or start a new run without ckpt_path"
        )
    raw = current_raw if current_raw is not None else OmegaConf.to_container(cfg, resolve=False)
    merged = resumed_config(raw, saved, overridden, run_dir)
    with open_dict(cfg):
        for key in [k for k in cfg if k not in merged]:
            del cfg[key]
        for key, value in merged.items():
            cfg[key] = value
    flat_now, flat_saved = flatten(OmegaConf.to_container(cfg, resolve=True)), flatten(saved)
    return {
        k: (flat_saved.get(k, "<absent>"), flat_now.get(k, "<absent>"))
        for k in sorted(set(flat_now) | set(flat_saved))
        if flat_now.get(k, _ABSENT) != flat_saved.get(k, _ABSENT) and k not in ("ckpt_path", "paths.output_dir")
    }


class RunConfigInCheckpoint(L.Callback):
    """Puts the run's resolved config (``checkpoint["run_config"]``), its group choices (``pe=rope``, ``control=...``)
    and its W&B run id in every checkpoint."""

    def __init__(self, run_config: dict[str, Any], choices: dict[str, Any] | None = None) -> None:
        self.run_config, self.choices = run_config, dict(choices or {})

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        checkpoint["run_config"] = self.run_config
        checkpoint["group_choices"] = {k: v for k, v in self.choices.items() if not str(k).startswith("hydra")}
        from pe_geometry.training.wandb_run import wandb_loggers  # a light import; wandb itself is only touched if used

        for logger in wandb_loggers(trainer.loggers):
            checkpoint["wandb_run_id"] = logger.version
