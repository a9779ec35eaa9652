"""Resume, in one place: which checkpoint, and the config a resume trains with.

Every checkpoint carries the run's resolved config (``run_config``; reading and writing checkpoint files is
``checkpoint_io``'s). A resume trains with it, every key of it, except what the command line sets explicitly: ``python
train.py ckpt_path=<run>/checkpoints/last.ckpt`` continues the run as it was configured (its model and PE, but also its
``trainer.max_steps``, cadences and loggers), whatever the defaults say. An override that contradicts the checkpoint on
a setting that defines what is trained (``FIXED_ON_RESUME``) is one error naming every differing key, raised before
anything in the run directory is written. Other overrides (``trainer.max_steps=2000``, a logger, a cadence, devices)
apply; the changes are recorded in ``config-resume-step<N>.yaml``.

- ``read_checkpoint``: where a resume starts (``ckpt_path=last``, ``auto``, a file, a branch) and the checkpoint read;
- ``prepare_resume``: what ``pipeline.train`` calls: the checkpoint, the run folder it continues, and ``cfg`` made the
  resumed config (``apply_resume_config``: ``overridden_keys``, ``contradictions``, ``resumed_config``);
- ``resume_command``: the override that continues a run, as printed when it stops.

What a command line sets (``overridden_keys``). A key (``trainer.max_steps=400``) sets itself. A group option
(``trainer=ddp``) sets the keys where that option, composed, differs from the group's default, composed: removals
included (``logger=csv`` drops ``logger.wandb``), and what its defaults list inherits or overrides (``control=`` and
``experiment=`` options extend each other). That is Hydra's composition, so it is asked of Hydra rather than read
from the option's file. What was typed cannot tell it: the overrides Hydra records (``.hydra/overrides.yaml``,
``HydraConfig.overrides.task``) are the words ``trainer=ddp``, not the keys they set. What was typed decides the
rest: the run's own choices, recorded in its checkpoint (``group_choices``) and restated on the resume's command line
(``run_folder.with_run_choices``), set nothing (``restates_run_choice``), so a resume that names no other option
composes nothing. An option that does differ is composed once per process: the group's default is composed once
(``_default_config``) and each option's keys are kept (``group_option_keys``), per search path.

Where a resume logs (Hydra's staging folder, the run folder's lock) is ``run_folder``'s.
"""

from __future__ import annotations

import copy
import logging
import shlex
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from pe_geometry.configs import CONFIG_DIR as CONFIG_GROUPS_DIR
from pe_geometry.training.checkpoint_io import (
    LAST_CHECKPOINT,
    find_checkpoint,
    read_checkpoint_file,
    run_folder_of,
    saved_config,
    saved_group_choices,
    saved_wandb_id,
)
from pe_geometry.training.names import hydra_value
from pe_geometry.training.run_folder import check_not_in_use
from pe_geometry.training.validate import ConfigError

log = logging.getLogger(__name__)

# Settings that define what is being trained: a resume takes them from the checkpoint.
FIXED_ON_RESUME = (
    "model", "pe", "embedding", "attention", "data", "optimizer", "seed", "run_name",
    "trainer.precision", "trainer.accumulate_grad_batches", "trainer.gradient_clip_val",
)
# ...except these, which say where or how fast, not what.
FREE_WITHIN_FIXED = ("data.num_workers", "data.cache_dir")
# A branch (branch=true) may also set these: where a warmup-stable-decay run's decay starts (and so its length).
FREE_IN_A_BRANCH = ("optimizer.decay_start",)
GLOBAL_GROUPS = ("experiment", "control")  # groups whose options write anywhere in the config (@package _global_)
COLLECTIONS = ("logger", "callbacks")  # groups whose members are the choice itself: a member the run had not is not added
_ABSENT = object()  # a key a config does not have


# -- where a resume starts ---------------------------------------------------------------------------------------------
def read_checkpoint(ckpt_path: str | None, output_dir: Path, branch: bool = False) -> tuple[Path | None, Path, int | None, dict | None]:
    """Where to resume from, which run directory to continue, at which step, and the checkpoint read.

    ``ckpt_path=last`` means this run directory's ``checkpoints/last.ckpt``; ``ckpt_path=auto`` the same when it
    exists, else a new run (what continues a stopped sweep: every job resumes, or starts if it never had). A
    checkpoint inside ``<run>/checkpoints/`` continues that run's directory, so its CSV series and later checkpoints
    stay in one place. The file is read once here, so a truncated or foreign file is one clear error instead of a
    traceback mid-setup. A new run (``ckpt_path=null``) into a directory that already holds a run's ``last.ckpt`` is
    refused: it would overwrite that run's checkpoints and logs (a sweep started again with its ``hydra.sweep.dir``).

    ``branch``: the checkpoint starts a new run in ``output_dir`` (which must not hold one), whichever folder it is in.
    """
    last = output_dir / LAST_CHECKPOINT
    if branch:
        if str(ckpt_path) in ("None", "auto", "last"):
            raise ConfigError(f"branch=true needs ckpt_path=<a checkpoint file> to branch from, not ckpt_path={ckpt_path}")
        if last.is_file():
            raise ConfigError(f"{output_dir} already holds a run (checkpoints/last.ckpt): a branch starts a new run; give it "
                              "another folder, or continue that one with ckpt_path=last (without branch=true)")
        path = find_checkpoint(ckpt_path, output_dir)
        state = read_checkpoint_file(path, required=("global_step", "state_dict", "optimizer_states"))
        return path, output_dir, int(state["global_step"]), state
    if str(ckpt_path) == "auto":
        ckpt_path = "last" if last.is_file() else None
    if ckpt_path is None:
        if last.is_file():
            check_not_in_use(output_dir)  # a run still writing there: say so, rather than offer to continue it
            raise ConfigError(f"{output_dir} already holds a run (checkpoints/last.ckpt): a new run there would overwrite "
                              "it; continue it with ckpt_path=last (a sweep: ckpt_path=auto, which also starts the jobs "
                              "that never ran), or give the new run another folder")
        return None, output_dir, None, None
    path = find_checkpoint(ckpt_path, output_dir)
    state = read_checkpoint_file(path, required=("global_step", "state_dict", "optimizer_states"))  # what a resume restores
    return path, run_folder_of(path, output_dir), int(state["global_step"]), state


# -- what the command line sets, and what it may not change -----------------------------------------------------------
def is_fixed_on_resume(key: str, branch: bool = False) -> bool:
    """``model.d_model`` -> True, ``trainer.max_steps`` -> False (dotted config keys); ``optimizer.decay_start`` is
    free in a branch."""
    return _under(key, FIXED_ON_RESUME) and not _under(key, FREE_WITHIN_FIXED + (FREE_IN_A_BRANCH if branch else ()))


def _under(key: str, prefixes: Iterable[str]) -> bool:
    """``key`` is one of ``prefixes`` or inside one (``model.d_model`` is under ``model``)."""
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> ``{"model.d_model": 64, ...}``; lists stay values. (OmegaConf has no flattening.)"""
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


def _search_path() -> tuple | str:
    """Where Hydra finds the config groups: inside ``train.py`` the running app's search path; elsewhere (a test, a
    notebook) configs/ itself."""
    from hydra.core.global_hydra import GlobalHydra

    hydra = GlobalHydra.instance()
    if not hydra.is_initialized():
        return str(CONFIG_GROUPS_DIR)
    return tuple((e.provider, e.path) for e in hydra.config_loader().get_search_path().get_path())


def _compose(overrides: list[str]) -> dict:
    """configs/train.yaml composed with ``overrides``, unresolved (Hydra's compose API, on ``_search_path``)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    with nullcontext() if GlobalHydra.instance().is_initialized() else initialize_config_dir(str(CONFIG_GROUPS_DIR), version_base="1.3"):
        return OmegaConf.to_container(compose(config_name="train", overrides=overrides), resolve=False)


def _default_config(where: tuple | str) -> dict:
    """The config with every group's default option, composed once per search path (read only)."""
    if where not in _DEFAULT_CONFIG:
        _DEFAULT_CONFIG[where] = _compose([])
    return _DEFAULT_CONFIG[where]


_DEFAULT_CONFIG: dict[tuple | str, dict] = {}
_OPTION_KEYS: dict[tuple, frozenset[str]] = {}  # (group, option, search path) -> the keys the option sets


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
    a contradiction even though sinusoidal is the default). Falls back to the whole group if it cannot compose.
    Composed once per process for each option (the module docstring says why it is composed at all)."""
    where = _search_path()
    if (group, option, where) not in _OPTION_KEYS:
        _OPTION_KEYS[group, option, where] = frozenset(_option_keys(group, option, where))
    return set(_OPTION_KEYS[group, option, where])


def _option_keys(group: str, option: str, where: tuple | str) -> set[str]:
    try:
        default, chosen = _default_config(where), _compose([f"{group}={option}"])
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


def restates_run_choice(override: str, saved_choices: dict[str, Any] | None) -> bool:
    """``group=option`` where the run was trained with that same option (``callbacks=early_stop`` on an early-stopped
    run, or a choice ``run_folder.with_run_choices`` added): it sets none of the option's keys, so a resume keeps what
    the run was trained with (its monitor on val/answer_accuracy, say) unless a key is given explicitly."""
    key, sep, value = override.partition("=")
    return (bool(sep) and bool(saved_choices) and not override.startswith(("~", "+")) and key in saved_choices
            and (CONFIG_GROUPS_DIR / key).is_dir() and str(saved_choices[key]) == value.strip("'\""))


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


def contradictions(current: dict[str, Any], saved: dict[str, Any], overridden: set[str],
                   branch: bool = False) -> dict[str, tuple[Any, Any]]:
    """``{key: (saved, current)}`` for fixed-on-resume keys the user overrode to a different value."""
    flat_now, flat_saved = flatten(current), flatten(saved)
    out = {}
    for key in sorted(set(flat_now) | set(flat_saved)):
        now, before = flat_now.get(key, _ABSENT), flat_saved.get(key, _ABSENT)
        if not is_fixed_on_resume(key, branch) or now == before or (_scalar(now) and _scalar(before) and str(now) == str(before)):
            continue  # ("16" in the checkpoint and 16 typed now: the same precision)
        if _under(key, overridden):
            out[key] = (flat_saved.get(key, "<absent>"), flat_now.get(key, "<absent>"))
    return out


def _scalar(value: Any) -> bool:
    return isinstance(value, (str, int, float)) and not isinstance(value, bool)


# -- the resumed config ----------------------------------------------------------------------------------------------
def _as_written(cfg: DictConfig, key: str) -> Any:
    """The value at a dotted key as written (``${seed}`` stays ``${seed}``: ``OmegaConf.select`` would resolve it), or
    ``_ABSENT``."""
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent, throw_on_resolution_failure=False) if parent else cfg
    return OmegaConf.to_container(node, resolve=False).get(leaf, _ABSENT) if OmegaConf.is_dict(node) else _ABSENT


def _delete(cfg: DictConfig, key: str) -> None:
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent, throw_on_resolution_failure=False) if parent else cfg
    if OmegaConf.is_dict(node):
        node.pop(leaf, None)


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


def resumed_config(current_raw: dict, saved: dict, overridden: set[str], run_dir: Path) -> dict:
    """The config a resume trains with: the checkpoint's, with what the command line set explicitly.

    - every key the overrides set (``trainer.max_steps=400``, ``logger=csv``, ``~callbacks.sample``) comes from
      the command line; every other key from the checkpoint, so the printed resume command
      (``ckpt_path=...`` alone) continues the run exactly as it was configured;
    - paths inside the original run folder are moved to where the folder is now;
    - a key that was derived (``data.seed: ${seed}``) stays derived where it resolves to the checkpoint's
      value, so that overriding its source (``paths.cache_dir=...``) moves it too.
    """
    now = OmegaConf.create(current_raw)
    old_dir = str((saved.get("paths") or {}).get("output_dir") or "")
    merged = OmegaConf.create(_relocate(copy.deepcopy(saved), old_dir, str(run_dir)))
    OmegaConf.update(merged, "paths.output_dir", str(run_dir), merge=False)
    derived = _still_derived(merged, now)  # judged on the run's own values, before any override
    for key in sorted(overridden, key=len):
        value = _as_written(now, key)
        if value is _ABSENT:
            _delete(merged, key)
        else:
            OmegaConf.update(merged, key, value, merge=False)
    for key in derived:
        if not _under(key, overridden) and _as_written(merged, key) is not _ABSENT:
            OmegaConf.update(merged, key, _as_written(now, key), merge=False)
    out = OmegaConf.to_container(merged, resolve=False)
    _fill_new_settings(out, current_raw)
    out["ckpt_path"] = current_raw.get("ckpt_path")
    return out


def _still_derived(run: DictConfig, now: DictConfig) -> list[str]:
    """The keys that are interpolations now (``data.cache_dir: ${paths.cache_dir}/data``) and that, resolved
    against the run's own config, give the run's value: they were derived in the run too, so they stay derived."""
    written = flatten(OmegaConf.to_container(now, resolve=False))
    candidates = [k for k, v in written.items() if isinstance(v, str) and "${" in v and _as_written(run, k) is not _ABSENT]
    trial = copy.deepcopy(run)
    for key in candidates:
        OmegaConf.update(trial, key, written[key], merge=False)
    derived = []
    for key in candidates:
        try:
            if OmegaConf.select(trial, key) == _as_written(run, key):
                derived.append(key)
        except Exception:  # noqa: BLE001, S112 - an interpolation that cannot resolve here keeps the checkpoint's value
            continue
    return derived


def apply_resume_config(cfg: DictConfig, saved: dict[str, Any], overrides: Iterable[str], ckpt_path: Path,
                        run_dir: Path | None = None, current_raw: dict | None = None,
                        saved_choices: dict[str, Any] | None = None, branch: bool = False) -> dict[str, tuple]:
    """Make ``cfg`` the checkpoint's config plus the command line's explicit overrides (``resumed_config``);
    returns what differs from the checkpoint ``{key: (old, new)}``.

    Raises ConfigError listing every fixed key the overrides contradict, before ``cfg`` is touched.
    """
    run_dir = Path(run_dir if run_dir is not None else cfg.paths.output_dir)
    overrides = list(overrides)
    overridden = overridden_keys([o for o in overrides if not restates_run_choice(o, saved_choices)])
    current = OmegaConf.to_container(cfg, resolve=True)
    bad = {**choice_contradictions(saved_choices, overrides), **contradictions(current, saved, overridden, branch)}
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


# -- what pipeline.train calls ---------------------------------------------------------------------------------------
@dataclass
class Resume:
    """Where a run starts: ``checkpoint`` None for a new run."""

    checkpoint: Path | None
    run_dir: Path
    step: int | None = None
    changes: dict[str, tuple] = field(default_factory=dict)  # {key: (checkpoint's, now)}, for config-resume-step<N>.yaml
    choices: dict[str, Any] = field(default_factory=dict)  # the run's group choices (pe=rope, control=...)
    wandb_id: str | None = None


def prepare_resume(cfg: DictConfig, overrides: list[str], choices: dict[str, Any], as_given: dict) -> Resume:
    """Read ``cfg.ckpt_path`` and, for a resume, make ``cfg`` the checkpoint's config plus the command line's explicit
    ``overrides`` (``as_given``: ``cfg`` unresolved, as composed), writing in the run folder it continues. Nothing is
    written; every check that can refuse the resume runs here."""
    branch = bool(cfg.get("branch", False))
    ckpt_path, run_dir, step, state = read_checkpoint(cfg.ckpt_path, Path(cfg.paths.output_dir), branch)
    if ckpt_path is None:
        return Resume(None, run_dir, choices=choices)
    changes: dict[str, tuple] = {}
    saved = saved_config(state)
    if saved is None:
        log.warning("%s carries no run config: resuming with the config as given, unchecked", ckpt_path)
    else:
        run_choices = saved_group_choices(state)
        changes = apply_resume_config(cfg, saved, overrides, ckpt_path, run_dir, as_given, run_choices, branch)
        if branch:
            with open_dict(cfg):
                cfg.branch = True  # the trunk's own config says false; this run is a branch of it
        # the run's choices, with those the command line changed (a resumed rope run stays pe=rope)
        given = {o.partition("=")[0]: o.partition("=")[2] for o in overrides if "=" in o and not o.startswith(("~", "+", "hydra"))}
        choices = {**(run_choices or choices), **{k: v for k, v in given.items() if k in choices}}
    if branch:
        log.info("branching from %s at step %d: a new run in %s", ckpt_path, step, run_dir)
    else:
        log.info("resuming %s at step %d: continuing in %s", ckpt_path, step, run_dir)
    with open_dict(cfg):
        cfg.paths.output_dir = str(run_dir)  # checkpoints and logs continue in the original run
    return Resume(ckpt_path, run_dir, step, changes, choices, None if branch else saved_wandb_id(state))


def resume_command(cfg: DictConfig) -> str:
    """The override that continues this run from its last checkpoint, ``ckpt_path=<run>/checkpoints/last.ckpt``,
    quoted for Hydra and then for the shell, so that it runs as printed wherever the run folder is."""
    return shlex.quote(f"ckpt_path={hydra_value(str(Path(cfg.paths.output_dir) / LAST_CHECKPOINT))}")

