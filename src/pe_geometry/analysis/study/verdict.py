"""Verdicts: each headline figure of an arm against its null, per seed and over seeds.

The training log records every input-level figure with a 100-draw null (enough for a
z-score, too coarse for a p-value: p cannot go below 2/101). A verdict re-measures the
*final* weights of each run with ``REPORT_DRAWS`` (2000) Haar rotations of P, so a
p-value can reach 1/1000, and writes the result to ``verdict.json`` in the run folder
(reused while the checkpoint is unchanged). ``at="best"`` measures ``checkpoints/best.ckpt``
instead (the lowest validation loss: a run that overfits is read where it generalised best),
cached in ``verdict_best.json``, and reads the logged hidden and attention figures at that
step. Then each arm (a report group: a PE type and its control switches) gets, per figure:

- the observed value and the null's mean, mean ± std over seeds;
- the effect = observed - null mean, mean ± std over seeds (the seed spread);
- each seed's two-sided p and z, and how many seeds fall on the side of the mean effect
  with p < 0.05;
- Fisher's combination of the seeds' p-values (scipy.stats.combine_pvalues).

Fisher's test asks "is any seed off its null", not "do all seeds agree". So an arm x figure is
read as off its null (``reading``) only when (1) its Fisher p survives a Holm correction over
every test of its report (``correct_report``: each arm's input figures and its position probe;
a report reads many arms x figures, and the smallest of many p's is small by chance) and (2)
every seed lies on the same side of its null. Hidden-state and attention figures take what
the log recorded (the position probe's null = cyclic shifts of each block's positions;
the positional-head count against its own value at step 0, since at initialisation most
of the score variance already involves position).

What the input null answers: it keeps both spectra and draws the orientation of P relative
to E at random, so below or above it says the orientation is non-random given the spectra.
It cannot say the separation was *learned*: a table can be placed non-randomly at
initialisation or by construction (a fixed sinusoidal table); that takes the step-0 value and
the control arms.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np

from pe_geometry.extras import needs_extra

with needs_extra("report", "the verdict"):
    from scipy import stats as scipy_stats

from pe_geometry.analysis import metric_names as names
from pe_geometry.analysis.measures.nulls import REPORT_DRAWS, holm
from pe_geometry.analysis.readers.runs import Group, Run, n_layers_of, stats
from pe_geometry.files import atomic_write_text

log = logging.getLogger(__name__)
_DATAMODULES: dict[str, object] = {}  # one datamodule per data config (a sweep's runs share one)
VERDICT_FILE = "verdict.json"
CHECKPOINTS = {"last": "last.ckpt", "best": "best.ckpt"}  # which weights a verdict measures: pe-report --at
SIGNIFICANCE = 0.05  # the family-wise error rate of a report's Holm correction
TESTED = ("input", "hidden")  # the verdict sections whose figures are tests (the attention count has no p)
# (figure, what it says, which side means "word and position rows separated")
INPUT_FIGURES = [
    ("overlap_k8", "top-8 subspace overlap, word vs position rows", "less"),
    ("var_share_P_in_E_k8", "share of P's variance inside E's top-8 subspace", "less"),
    ("abs_cos_mean", "mean |cos| over word x position pairs", "less"),
    ("angle_mean_k8_deg", "mean principal angle, top-8 subspaces (deg)", "greater"),
]
# The same subspace figures with k proportional to the width, k = d_model / 8 (8 at d 64): a fixed k = 8 is a smaller
# share of a wider model's directions, so a size curve reports both. Kept in their own section ("input_kd8"), outside
# a report's Holm family: at d 64 they are the k = 8 figures again, and a report reads one width.
SCALED_K_DIVISOR = 8
SCALED_K_FIGURES = [
    ("overlap_kd8", "top-(d/8) subspace overlap, word vs position rows", "less"),
    ("var_share_P_in_E_kd8", "share of P's variance inside E's top-(d/8) subspace", "less"),
]


# ----------------------------------------------------------------------------- one run


def verdict_file(at: str = "last") -> str:
    return VERDICT_FILE if at == "last" else f"verdict_{at}.json"


def checkpoint_at(run_dir: Path, at: str = "last") -> Path:
    if at not in CHECKPOINTS:
        raise ValueError(f"at={at!r}: expected one of {sorted(CHECKPOINTS)}")
    return run_dir / "checkpoints" / CHECKPOINTS[at]


def final_input_rows(run_dir: Path, checkpoint: Path | None = None, words_without_table: bool = False):
    """(E, P, step) of a run's checkpoint (default: its last): the word rows and position rows the callback measured.
    A run without an input table: (None, None, step), or with ``words_without_table`` (E, None, step) (a NoPE run's
    word rows, read against another run's table)."""
    import torch

    from pe_geometry.training.run_loader import load_trained_run  # torch + the model code: only when needed

    run = load_trained_run(checkpoint or run_dir, datamodules=_DATAMODULES)  # a sweep's runs share one datamodule
    cfg, datamodule, model, step = run.config, run.datamodule, run.model, run.step
    if model.W_pos is None and not words_without_table:
        return None, None, step
    rule_path = run_dir / "geometry_tokens.json"
    if rule_path.is_file():  # the exact rows the callback used
        tokens = json.loads(rule_path.read_text())["tokens"]
        ids = [datamodule.tokenizer.token_to_id(t) for t in tokens]
        if any(i is None for i in ids):
            raise ValueError(f"{rule_path}: a token is not in the rebuilt tokenizer's vocabulary")
    else:  # an older run: the callback's rule, recomputed
        from pe_geometry.analysis.measures.probes import frequent_token_ids

        specials = [datamodule.tokenizer.token_to_id(t) for t in ("<unk>", "<mask>", "<eos>")]
        ids, _ = frequent_token_ids(datamodule.streams["train"], datamodule.vocab_size, 1000, specials)
        ids = ids.tolist()
    with torch.no_grad():
        E = model.W_E[torch.tensor(ids)].float()
        P = None if model.W_pos is None else model.W_pos[: int(cfg.data.seq_len)].float()
    return E, P, step


def scaled_k_figures(E, P, n_draws: int) -> dict[str, float]:
    """rotation_null's top-k figures at k = d_model / SCALED_K_DIVISOR, named ``..._kd8`` (SCALED_K_FIGURES)."""
    from pe_geometry.analysis.measures.nulls import rotation_null

    k = max(1, E.shape[1] // SCALED_K_DIVISOR)
    figures = rotation_null(E, P, n_draws=n_draws, seed=0, fixed_k=k)
    return {key.replace(f"_k{k}", f"_kd{SCALED_K_DIVISOR}", 1): value for key, value in figures.items()
            if key.startswith(tuple(f"{name.split('_kd')[0]}_k{k}" for name, _, _ in SCALED_K_FIGURES))}


def run_null(run: Run, n_draws: int = REPORT_DRAWS, compute: bool = True, at: str = "last") -> dict | None:
    """The input figures of a run's final (``at="best"``: best-validation) weights with an n_draws null, at k = 8
    ("figures") and k = d_model / 8 ("figures_kd8"); cached in <run>/verdict.json (verdict_best.json)."""
    from pe_geometry.analysis.measures.nulls import rotation_null

    path, ckpt = run.path / verdict_file(at), checkpoint_at(run.path, at)
    if path.is_file():
        cached = json.loads(path.read_text())
        fresh = cached.get("n_draws") == n_draws and (not ckpt.is_file() or path.stat().st_mtime >= ckpt.stat().st_mtime)
        fresh = fresh and (cached.get("figures") is None or "figures_kd8" in cached)  # one cached before k = d/8 existed
        if fresh or not compute:
            return cached
    if not compute or not ckpt.is_file():
        return None
    E, P, step = final_input_rows(run.path, ckpt)
    if E is None:
        result = {"step": step, "n_draws": n_draws, "figures": None}
    else:
        result = {"step": step, "n_draws": n_draws, "seed": 0,
                  "figures": rotation_null(E, P, n_draws=n_draws, seed=0, fixed_k=8),
                  "figures_kd8": scaled_k_figures(E, P, n_draws)}
    atomic_write_text(path, json.dumps(result, indent=1))
    return result


# ----------------------------------------------------------------------------- one arm


def combine_seeds(observed: list[float], null_mean: list[float], p: list[float], z: list[float], side: str) -> dict:
    """One figure over an arm's seeds: observed, null, effect (mean ± std), per-seed p/z, Fisher's p."""
    effect = [o - m for o, m in zip(observed, null_mean)]
    mean_effect = float(np.mean(effect)) if effect else math.nan
    direction = "less" if mean_effect < 0 else "greater"
    agree = sum(1 for e, q in zip(effect, p) if q < SIGNIFICANCE and (e < 0) == (mean_effect < 0))
    fisher = float(scipy_stats.combine_pvalues(p, method="fisher").pvalue) if len(p) > 1 else (p[0] if p else math.nan)
    return {"observed": stats(observed), "null_mean": stats(null_mean), "effect": stats(effect), "p": p, "z": z,
            "fisher_p": fisher, "direction": direction, "n_significant_same_side": agree, "n_seeds": len(p),
            "separation_side": side}


def _upto(run: Run, key: str, step: int | None) -> tuple[np.ndarray, np.ndarray]:
    """A logged series up to and including ``step`` (all of it when None)."""
    steps, values = run.series[key]
    return (steps, values) if step is None else (steps[steps <= step], values[steps <= step])


def _logged(run: Run, key: str, step: int | None = None) -> float | None:
    """The last value logged (at or before ``step``); None if the run never logged key there."""
    if key not in run.series or not len(_upto(run, key, step)[1]):
        return None
    return float(_upto(run, key, step)[1][-1])


def _logged_init(run: Run, key: str) -> float | None:
    """The value at step 0 (None if the run did not log step 0)."""
    if key not in run.series:
        return None
    steps, values = run.series[key]
    return float(values[np.where(steps == 0)[0][0]]) if 0 in steps else None


def group_verdict(group: Group, n_draws: int = REPORT_DRAWS, compute: bool = True, at: str = "last") -> dict:
    """Every verdict figure of one arm (see the module docstring), of each run's ``at`` checkpoint."""
    out: dict = {"label": group.label, "seeds": group.seeds, "n_draws": n_draws, "at": at, "input": {}, "input_kd8": {},
                 "hidden": {}, "attn": {}}
    nulls, at_step = [], {}
    for run in group.runs:
        try:
            result = run_null(run, n_draws, compute, at)
        except Exception as err:  # one broken run must not stop the report
            log.warning("%s: no verdict (%s: %s)", run.path, type(err).__name__, err)
            result = None
        if result and result.get("figures"):
            nulls.append((run, result))
        if result and at != "last":
            at_step[run.path] = int(result["step"])
    # at="best": each run's logged figures are read at its best checkpoint's step, and a run without one is left out
    runs = [r for r in group.runs if at == "last" or r.path in at_step]
    upto = at_step.get
    for section, figures, key in (("input", INPUT_FIGURES, "figures"), ("input_kd8", SCALED_K_FIGURES, "figures_kd8")):
        for figure, _, side in figures:
            rows = [(r, res) for r, res in nulls if figure in (res.get(key) or {})]
            if not rows:
                continue
            f = [res[key] for _, res in rows]
            verdict = combine_seeds([x[figure] for x in f], [x[f"{figure}_null_mean"] for x in f],
                                    [x[f"{figure}_p"] for x in f], [x[f"{figure}_z"] for x in f], side)
            # the step-0 value, seed by seed (None where a run did not log it, so the lists stay paired); k = d/8
            # figures were not logged during training: their start is not known
            init = [_logged_init(r, names.input_metric(figure)) if section == "input" else None for r, _ in rows]
            verdict["init"] = stats([v for v in init if v is not None])
            verdict["init_per_seed"] = init
            verdict["step"] = max(res["step"] for _, res in nulls)
            verdict["seed_steps"] = [int(res["step"]) for _, res in rows]  # at="best": one per seed
            verdict["run_seeds"] = [r.seed for r, _ in rows]  # which seed each value is (arms are paired by it)
            out[section][figure] = verdict

    n_layers = n_layers_of(group)
    if n_layers:
        layer = names.last_block_input(n_layers)
        key = names.hidden_metric(layer, "position_r2")
        per_seed = [(r, *(_logged(r, key + suffix, upto(r.path)) for suffix in ("", "_null_mean", "_p", "_z"))) for r in runs]
        per_seed = [row for row in per_seed if None not in row[1:]]
        if per_seed:
            verdict = combine_seeds([o for _, o, _, _, _ in per_seed], [m for _, _, m, _, _ in per_seed],
                                    [p for *_, p, _ in per_seed], [z for *_, z in per_seed], "greater")
            verdict["layer"] = layer
            verdict["step"] = min(int(_upto(r, key, upto(r.path))[0][-1]) for r, *_ in per_seed)  # the last probe record
            verdict["init"] = stats([v for r, *_ in per_seed if (v := _logged_init(r, key)) is not None])
            out["hidden"]["position_r2"] = verdict

    heads = [(r, _logged_init(r, names.N_POSITIONAL_HEADS_ALL_TERMS), _logged(r, names.N_POSITIONAL_HEADS_ALL_TERMS, upto(r.path)))
             for r in runs]
    heads = [h for h in heads if h[1] is not None and h[2] is not None]
    if heads:
        n_heads = int((group.runs[0].config.get("model") or {}).get("n_heads", 0))
        # the count saturates easily (every head above one half), so the share itself is shown beside it
        shares = [[(_logged_init(r, k), _logged(r, k, upto(r.path))) for h in range(n_heads)
                   if (k := names.attention_share_metric(h, "positional")) in r.series] for r, *_ in heads]
        out["attn"]["n_positional_heads_all_terms"] = {
            "init": stats([h[1] for h in heads]), "end": stats([h[2] for h in heads]), "n_heads": n_heads, "n_seeds": len(heads),
            "positional_share_init": stats([float(np.mean([a for a, _ in s])) for s in shares if s]),
            "positional_share_end": stats([float(np.mean([b for _, b in s])) for s in shares if s]),
        }
    return out


def correct_report(verdicts: list[dict]) -> list[dict]:
    """One report's group_verdict results with each test's ``holm_p`` and ``n_tests`` (the report's family: every
    arm's input figures and hidden-state probe). Copies; always recomputed from ``fisher_p``, so a summary.json written
    before these fields existed reads the same."""
    tests = [(i, section, name) for i, v in enumerate(verdicts) for section in TESTED for name in v.get(section, {})]
    adjusted = holm([verdicts[i][section][name]["fisher_p"] for i, section, name in tests])
    out = [{**v, **{section: dict(v.get(section, {})) for section in TESTED}} for v in verdicts]
    for (i, section, name), q in zip(tests, adjusted):
        out[i][section][name] = {**out[i][section][name], "holm_p": q, "n_tests": len(tests)}
    return out


def seeds_side(v: dict) -> int:
    """-1 if every seed's effect (observed - null mean) is negative, +1 if every one is positive, 0 otherwise
    (seeds on both sides, or one exactly at its null mean)."""
    signs = {int(np.sign(e)) for e in v["effect"]["values"]}
    return signs.pop() if len(signs) == 1 and 0 not in signs else 0


def reading(v: dict, toward: str = "separated", away: str = "more aligned than the null") -> str:
    """Plain words for one verdict of ``correct_report``: off the null only if its Holm p is below SIGNIFICANCE and every
    seed is on the same side; otherwise why not."""
    from pe_geometry.analysis.report.tables import fmt  # not at the top: the report package imports this module

    n, holm_p, side = v["n_seeds"], fmt(v["holm_p"], 2), seeds_side(v)
    if v["holm_p"] < SIGNIFICANCE and side:
        meaning = toward if (side < 0) == (v["separation_side"] == "less") else away
        seeds = "the only seed" if n == 1 else f"all {n} seeds"
        return f"{'below' if side < 0 else 'above'} the null in {seeds} (Holm p {holm_p}): {meaning}"
    if v["holm_p"] < SIGNIFICANCE:
        return f"seeds on both sides of the null: no verdict (Holm p {holm_p})"
    k = sum(1 for q in v["p"] if q < SIGNIFICANCE)
    z = [abs(x) for x in v.get("z") or [] if x == x]
    at_floor = (n > 1 and len(set(v["p"])) == 1) or (len(z) == n and min(z) >= 5)
    if side and k == n and at_floor:
        # every seed at the same smallest p its null allows (the probe's 20 cyclic shifts: 1/21), or one seed whose z
        # says the null's resolution, not the effect, holds the p up: the Holm p is that floor's, not a measure of the
        # effect: say so, and point at z, rather than call it "not distinguishable" (a sweep of one seed at z 256 was)
        where = "below" if side < 0 else "above"
        seeds = "the only seed, at" if n == 1 else f"all {n} seeds, each at"
        return (f"{where} the null in {seeds} its null's p floor ({fmt(v['p'][0], 2)}; z {fmt(min(z), 3) if z else 'n/a'}): "
                f"too few null draws to pass Holm (p {holm_p}); read z")
    if n == 1:  # one seed is "the only seed", not "0/1 seeds"
        seeds = f"the only seed p {'<' if k else '≥'} {SIGNIFICANCE}"
    else:
        seeds = f"{k}/{n} seeds p < {SIGNIFICANCE}" + ("" if side else ", seeds on both sides")
    return f"not distinguishable from the null (Holm p {holm_p}; {seeds})"
