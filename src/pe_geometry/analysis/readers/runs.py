"""Read training runs and sweeps: a run = a folder with ``config.yaml`` and ``csv/metrics.csv`` (a resumed
run adds a metrics file per resume, ``csv/resume-step<N>/metrics.csv``; ``read_run_rows`` joins them).

``find_runs`` reads every run below a folder, ``group_runs`` groups them by (model, PE type)
(runs with scaled embeddings, and each control arm of ``ARM_SWITCHES``, form their own group),
and ``measure_summary`` gives a measure's
value at initialisation and at the end, mean and spread over seeds, with its baselines.
``launches`` gives the ``pe-train`` command lines that made the runs (one per sweep, or per single run).
"""

from __future__ import annotations

import json
import logging
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from pe_geometry.analysis.metric_names import COMPANIONS, SECTIONS, MetricName, measure_order, parse
from pe_geometry.configs import CONFIG_DIR, current_target
from pe_geometry.training.metrics_csv import CSV_DIR, METRICS_FILE, read_complete_rows, segment_files

log = logging.getLogger(__name__)
EXTRAPOLATION_FILE = "length_extrapolation.json"
PE_ORDER = ["sinusoidal", "learned", "rope", "alibi", "none"]
PE_COLORS = {"sinusoidal": "#1f77b4", "learned": "#ff7f0e", "rope": "#2ca02c", "alibi": "#d62728", "none": "#6f6f6f"}
EXTRA_COLORS = ["#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]
MODEL_STYLES = ["-", "--", ":", "-."]
# Config switches that change the geometry under study: (config path, default, label). A run whose value
# differs from the default carries the label in its group name, so the report never pools two arms.
# Read from the resolved config (not Hydra's control=... choice), so a switch set by hand groups the same way.
ARM_SWITCHES = [
    (("embedding", "scaled"), False, "scaled emb"),
    (("embedding", "tie_weights"), True, "untied head"),
    (("optimizer", "no_decay_embeddings"), False, "no decay on E,P"),
    (("pe", "init"), "normal", "mixed init"),
    (("pe", "scale"), "none", "word-norm table"),
    (("pe", "center"), False, "centred table"),
    (("pe", "freeze"), False, "frozen table"),
    (("pe", "shuffle"), False, "rows shuffled per sequence"),
    (("pe", "rotary"), False, "with RoPE"),  # pe=forgetting pe.rotary=true: the gates and a rotation
    (("pe", "rotary_fraction"), 1.0, "rotary_fraction {value}"),  # partial RoPE (rope, xpos)
    (("pe", "partial_rotary"), "neox", "{value}"),
    (("model", "layer_pattern"), None, "{value}"),  # a scheme per layer
]


def pattern_label(pattern) -> str:
    """A layer pattern in a few words, one item per entry: 'layers [=, =, =, none]' (=: the model's encoding as
    configured; none: NoPE; a setting: 'base 1e+06'; a window: 'w16', 'w all')."""
    items = []
    for entry in pattern:
        pe, window = entry.get("pe"), entry.get("window", "inherit")
        item = "none" if pe == "none" else ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}"
                                                      for k, v in (pe or {}).items()) or "="
        if window != "inherit":
            item += f" w{window or ' all'}"
        items.append(item)
    return f"layers [{'; '.join(items)}]"


def arm_labels(config: dict) -> list[str]:
    """Labels of the ARM_SWITCHES a run's resolved config sets away from their defaults (absent = default)."""
    labels = []
    for (section, key), default, label in ARM_SWITCHES:
        value = (config.get(section) or {}).get(key, default)
        if value != default:
            shown = pattern_label(value) if key == "layer_pattern" else value
            labels.append(label.format(value=shown) + (f" k={config['pe'].get('init_k')}" if key == "init" else ""))
    return labels

@dataclass
class Run:
    path: Path
    model: str
    pe: str
    seed: int
    config: dict
    series: dict[str, tuple[np.ndarray, np.ndarray]]  # metric -> (steps, values), sorted by step
    extrapolation: dict | None = None

    @property
    def group(self) -> tuple[str, str]:
        return self.model, self.pe

    @property
    def name(self) -> str:
        """The run's name (configs/train.yaml's run_name, also its W&B name); the folder's name for runs without one."""
        return str(self.config.get("run_name") or self.path.name)


@dataclass
class Group:
    model: str
    pe: str
    label: str
    color: str
    style: str
    runs: list[Run] = field(default_factory=list)

    @property
    def seeds(self) -> list[int]:
        return [r.seed for r in self.runs]


def read_run_rows(run_dir: Path) -> list[dict[str, str]]:
    """The rows of a run's CSV metric log, its segments joined (``training.metrics_csv``): each resume segment
    replaces the rows from its resume step on, as that resume re-did those steps. Every row has every column
    ('' where it has no value); a last row cut short by a kill is left out."""
    rows: list[dict[str, str]] = []
    columns: set[str] = set()
    for first_step, path in segment_files(run_dir):
        header, segment = read_complete_rows(path)
        rows = [row for row in rows if _step(row) is None or _step(row) < first_step] + segment
        columns.update(header)
    order = sorted(columns)
    return [{key: row.get(key) or "" for key in order} for row in rows]


def _step(row: dict[str, str]) -> int | None:
    return int(float(row["step"])) if row.get("step") else None


def read_metrics(run_dir: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A run's metrics (``read_run_rows``) -> {column: (steps, values)}; empty cells skipped, a repeated step keeps its last value."""
    table: dict[str, dict[int, float]] = {}
    for row in read_run_rows(run_dir):
        step = _step(row)
        if step is None:
            continue
        for key, value in row.items():
            if key in ("step", "epoch") or value in ("", None):
                continue
            try:
                table.setdefault(key, {})[step] = float(value)
            except ValueError:
                continue
    return {k: (np.array(sorted(v)), np.array([v[s] for s in sorted(v)])) for k, v in table.items()}


def _option_targets(group: str) -> dict[str, str]:
    """_target_ -> option name for a config group (configs/<group>/*.yaml): only for runs whose choices were not recorded."""
    targets = {}
    for path in sorted((CONFIG_DIR / group).glob("*.yaml")):
        try:
            node = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError:
            continue
        if isinstance(node, dict) and "_target_" not in node and isinstance(node.get(group), dict):
            node = node[group]  # an option that overrides other groups too (@package _global_: model=xtransformers)
        if isinstance(node, dict) and "_target_" in node:
            targets.setdefault(node["_target_"], path.stem)
    return targets


def _choice(config: dict, choices: dict, group: str) -> str:
    """The option a run chose for a config group: Hydra's recorded choice, else the option whose _target_ the run used."""
    if choices.get(group):
        return str(choices[group])
    target = current_target((config.get(group) or {}).get("_target_", "?"))
    return _option_targets(group).get(target, str(target).rsplit(".", 1)[-1])


def load_run(run_dir: Path) -> Run:
    config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    choices = {}
    hydra_path = run_dir / ".hydra" / "hydra.yaml"
    if hydra_path.is_file():
        try:
            choices = yaml.safe_load(hydra_path.read_text())["hydra"]["runtime"]["choices"] or {}
        except (KeyError, TypeError, yaml.YAMLError):
            choices = {}
    pe = _choice(config, choices, "pe")
    pe = " + ".join([pe, *arm_labels(config)])  # e.g. "learned + untied head": never pooled with plain learned runs
    run = Run(run_dir, _choice(config, choices, "model"), pe, int(config.get("seed", 0)), config, read_metrics(run_dir))
    extrapolation = run_dir / EXTRAPOLATION_FILE
    if extrapolation.is_file():
        try:
            run.extrapolation = json.loads(extrapolation.read_text())
        except json.JSONDecodeError:
            run.extrapolation = None
    return run


def last_step(run: Run) -> int:
    """The last step the run logged anything at (0 for a run that logged nothing)."""
    return int(max((steps[-1] for steps, _ in run.series.values() if len(steps)), default=0))


def how_it_ended(run: Run) -> str:
    """"finished" (its checkpoint reached trainer.max_steps), "early-stopped" (callbacks=early_stop ended it: its saved
    EarlyStopping state has waited ``patience`` validations) or "unfinished" (killed or stopped before either: what a
    report calls its end is only where it got to, and ``ckpt_path=auto`` continues it)."""
    max_steps = (run.config.get("trainer") or {}).get("max_steps")
    ckpt = run.path / "checkpoints" / "last.ckpt"
    if not ckpt.is_file():
        return "finished" if max_steps is None or last_step(run) >= max_steps else "unfinished"
    return checkpoint_ending(ckpt, max_steps)


def checkpoint_ending(ckpt: Path, max_steps: int | None = None) -> str:
    """``how_it_ended`` from a checkpoint alone (a scoring script's run folder): ``max_steps`` defaults to the
    ``trainer.max_steps`` of the config the checkpoint carries."""
    import torch  # mmap: the weights are not read

    state = torch.load(ckpt, map_location="cpu", weights_only=False, mmap=True)
    if max_steps is None:
        max_steps = ((state.get("run_config") or {}).get("trainer") or {}).get("max_steps")
    if max_steps is None or int(state.get("global_step", 0)) >= max_steps:
        return "finished"
    stops = [v for k, v in (state.get("callbacks") or {}).items() if k.startswith(("EarlyStop", "EarlyStopping"))]
    # Lightning's rule (training/callbacks.py ran_out_of_patience), or a stop on a threshold it recorded a reason for
    if any(v.get("wait_count", 0) >= max(v.get("patience", 1), 1) or "THRESHOLD" in str(v.get("stopping_reason", ""))
           or "NON_FINITE" in str(v.get("stopping_reason", "")) for v in stops):
        return "early-stopped"
    return "unfinished"


def find_runs(root: Path) -> list[Run]:
    """Every run directory below root (or root itself): config.yaml + csv/metrics.csv."""
    runs = []
    for metrics in sorted(root.rglob(f"{CSV_DIR}/{METRICS_FILE}")):
        run_dir = metrics.parent.parent
        if not (run_dir / "config.yaml").is_file():
            log.warning("skipping %s: no config.yaml beside it", run_dir)
            continue
        try:
            runs.append(load_run(run_dir))
        except (OSError, ValueError, yaml.YAMLError) as err:
            log.warning("skipping %s: %s", run_dir, err)
    return runs


def group_runs(runs: list[Run]) -> list[Group]:
    """Groups by (model, PE type), PE types in the study's order, seeds ascending."""
    models = sorted({r.model for r in runs})
    def order(pe: str) -> tuple[int, str]:
        base = pe.split(" ")[0]
        return PE_ORDER.index(base) if base in PE_ORDER else len(PE_ORDER), pe

    pes = sorted({r.pe for r in runs}, key=order)
    extra = iter(EXTRA_COLORS * 4)
    colors = {pe: PE_COLORS.get(pe) or next(extra) for pe in pes}
    groups = []
    for model in models:
        for pe in pes:
            members = sorted((r for r in runs if r.group == (model, pe)), key=lambda r: (r.seed, str(r.path)))
            if members:
                label = pe if len(models) == 1 else f"{model} / {pe}"
                groups.append(Group(model, pe, label, colors[pe], MODEL_STYLES[models.index(model) % len(MODEL_STYLES)], members))
    return groups



def stats(values: list[float]) -> dict:
    """mean, std (ddof=1 over seeds), min, max, n, values; NaNs dropped."""
    v = np.array([x for x in values if x is not None and np.isfinite(x)], dtype=float)
    if len(v) == 0:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0, "values": []}
    return {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0, "min": float(v.min()),
            "max": float(v.max()), "n": int(len(v)), "values": [float(x) for x in v]}


def aggregate(series: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """(steps, mean, min, max) over seeds: on the steps every seed logged, else interpolated on their common range."""
    series = [(s, v) for s, v in series if len(s)]
    if not series:
        return None
    common = sorted(set.intersection(*(set(s.tolist()) for s, _ in series)))
    if len(common) >= 0.5 * min(len(s) for s, _ in series):
        steps = np.array(common)
        stack = np.stack([v[np.searchsorted(s, steps)] for s, v in series])
    else:  # seeds logged at different steps: interpolate on the union within the common range
        lo, hi = max(s[0] for s, _ in series), min(s[-1] for s, _ in series)
        steps = np.array(sorted({x for s, _ in series for x in s.tolist() if lo <= x <= hi}))
        if not len(steps):
            return None
        stack = np.stack([np.interp(steps, s, v) for s, v in series])
    return steps, np.nanmean(stack, axis=0), np.nanmin(stack, axis=0), np.nanmax(stack, axis=0)


def end_values(runs: list[Run], key: str) -> tuple[list[float], list[float], list[int], list[int]]:
    """Per seed: value at step 0 (first logged if no step 0), value at the last logged step, and those steps."""
    init, end, init_steps, end_steps = [], [], [], []
    for r in runs:
        if key not in r.series:
            continue
        steps, values = r.series[key]
        i0 = int(np.argmin(steps)) if 0 not in steps else int(np.where(steps == 0)[0][0])
        init.append(float(values[i0]))
        end.append(float(values[-1]))
        init_steps.append(int(steps[i0]))
        end_steps.append(int(steps[-1]))
    return init, end, init_steps, end_steps


def measure_summary(group: Group, key: str) -> dict | None:
    init, end, init_steps, end_steps = end_values(group.runs, key)
    if not init:
        return None
    out = {"init": stats(init), "end": stats(end), "init_step": min(init_steps), "end_step": max(end_steps),
           "n_seeds": len(init)}
    for suffix in COMPANIONS:
        c_init, c_end, _, _ = end_values(group.runs, key + suffix)
        if c_init:
            out[suffix.lstrip("_")] = {"init": stats(c_init), "end": stats(c_end)}
    return out


def n_layers_of(group: Group) -> int | None:
    try:
        return int(group.runs[0].config["model"]["n_layers"])
    except (KeyError, TypeError, ValueError):
        return None



def geometry_families(runs: list[Run]) -> dict[str, list[MetricName]]:
    """family -> its logged names (one per layer/head panel, by index), baselines left out, in report order."""
    families: dict[str, list[MetricName]] = {}
    for key in sorted({k for r in runs for k in r.series}):
        name = parse(key)
        if name is not None and name.companion is None:
            families.setdefault(name.family, []).append(name)
    for members in families.values():
        members.sort(key=lambda m: (m.index is None, m.index or 0))
    return dict(sorted(families.items(), key=lambda kv: (SECTIONS.index(kv[1][0].section), measure_order(kv[1][0].measure), kv[0])))


# ----------------------------------------------------------------------------- the commands that made the runs

MULTIRUN_FILE = "multirun.yaml"  # Hydra writes it into a sweep's folder as the sweep starts: its command line as typed
# Overrides left out of a command that regenerates runs: where the data cache lives is this machine's business (and
# an absolute path), -m stands for hydra.mode, and the output folder is set by the command itself.
LOCAL_OVERRIDES = ("paths.cache_dir", "data.cache_dir", "hydra.mode", "hydra.sweep.dir", "hydra.run.dir")


@dataclass
class Launch:
    """One ``pe-train`` command line: a sweep (``-m``, folder = the sweep's folder) or a single run (folder = the run)."""

    folder: Path
    overrides: list[str]
    multirun: bool

    def command(self, out_dir: str) -> str:
        """``pe-train [-m] <overrides> hydra.<sweep|run>.dir=<out_dir>``: shell-quoted, the output folder named."""
        kept = [o for o in self.overrides if o.lstrip("+~").split("=", 1)[0] not in LOCAL_OVERRIDES]
        folder_key = "hydra.sweep.dir" if self.multirun else "hydra.run.dir"
        words = ["pe-train", *(["-m"] if self.multirun else []), *kept, f"{folder_key}={out_dir}"]
        return " ".join(shlex.quote(w) for w in words)


def _yaml_overrides(path: Path) -> dict | None:
    """hydra.overrides ({hydra: [...], task: [...]}) of a multirun.yaml or .hydra/hydra.yaml; None if unreadable."""
    try:
        overrides = (yaml.safe_load(path.read_text()) or {})["hydra"]["overrides"]
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return None
    return overrides if isinstance(overrides, dict) else None


def launches(root: Path, runs: list[Run]) -> list[Launch]:
    """The commands that made ``runs`` (all below ``root``): one per sweep folder, whose multirun.yaml holds the sweep's
    own command line (the swept values as typed, the launcher); one per run outside any sweep, from its
    .hydra/hydra.yaml. A run with neither (copied without its Hydra files) has none. Sorted by folder."""
    found: dict[Path, Launch] = {}
    for run in sorted(runs, key=lambda r: str(r.path)):
        sweep = next((d for d in (run.path, *run.path.parents) if (d / MULTIRUN_FILE).is_file()
                      and (d == root or root in d.parents)), None)
        if sweep is not None and sweep not in found:
            overrides = _yaml_overrides(sweep / MULTIRUN_FILE)
            if overrides is not None:
                found[sweep] = Launch(sweep, [*(overrides.get("task") or []), *(overrides.get("hydra") or [])], True)
        elif sweep is None:
            overrides = _yaml_overrides(run.path / ".hydra" / "hydra.yaml")
            if overrides is not None:
                found[run.path] = Launch(run.path, [*(overrides.get("task") or []), *(overrides.get("hydra") or [])], False)
    return list(found.values())

