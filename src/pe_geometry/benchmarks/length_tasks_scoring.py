"""Each data=task run's answers at 1x-16x its training length, on the same generated examples for every run, and the
summary over seeds: exact match and token accuracy (teacher-forced and greedy), bootstrap intervals over examples,
the chance lines, the passkey's depth x length grid. The command: benchmarks/length_tasks.py."""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from pe_geometry.analysis.measures.position_attention import position_attention_report
from pe_geometry.analysis.readers.task_scoring import greedy_answers
from pe_geometry.benchmarks.arms import arm_label
from pe_geometry.benchmarks.extrapolation_scoring import summarise_attention
from pe_geometry.benchmarks.runs import run_dirs
from pe_geometry.configs import CONFIG_DIR
from pe_geometry.data.tasks import TASKS, accuracy_by_depth, answer_accuracy, beyond_window, make_batch, play_filler, window_chance
from pe_geometry.training.run_loader import load_trained_run

EVAL_STREAM = 2  # the evaluation's seed stream (training batches use 0, validation 1: data/task_datamodule.py)
TOKENS_PER_FORWARD = 8192  # examples per forward = this // the block's length (bounds an explicit (B, H, T, T) score)
ATTENTION_EXAMPLES = 64  # examples at the training length that the attention figures read
# greedy_*: the answer written by greedy decoding (analysis/readers/task_scoring.py), the headline; exact_match and token_accuracy:
# teacher-forced (each answer token predicted with the true ones before it), kept beside them
METRICS = ("greedy_exact_match", "greedy_exact_match_beyond_L", "greedy_first_token", "exact_match", "token_accuracy")
METRIC_WORDS = {"greedy_exact_match": "exact match, greedy decoding (the headline)",
                "greedy_exact_match_beyond_L": "exact match, greedy decoding, of the examples whose answer depends on a "
                                               "token before the last L (retrieval past the training length; a model "
                                               "that sees only L scores 0; – at 1x: there are none)",
                "greedy_first_token": "first answer token, greedy decoding (a passkey's retrieval)",
                "exact_match": "exact match, teacher-forced", "token_accuracy": "token accuracy, teacher-forced"}
# The suite's depth per task (configs/experiment/length_tasks.yaml; associative recall at 4 layers, as its header
# says): a run of another depth is an arm of its own, 'rope (4 layers)', never pooled with the suite's 'rope'.
SUITE_LAYERS = int(OmegaConf.load(CONFIG_DIR / "experiment" / "length_tasks.yaml").model.n_layers)
TASK_LAYERS = {"associative_recall": 4}
DISAGREE = 0.25  # seeds whose 1x score spans more than this (either metric) disagree: the cue for 5 seeds


def eval_seed(seed: int, task: str, multiplier: int, seq_len: int) -> int:
    """The seed of the examples of ``task`` at ``multiplier`` x ``seq_len``: a hash of the four (and of the stream),
    so every run of a task at a training length reads the same examples, and no training or validation batch."""
    return int(np.random.SeedSequence([seed, EVAL_STREAM, TASKS.index(task), multiplier, seq_len]).generate_state(1)[0])


def task_settings(config) -> dict:
    """The run's task and the generator settings that shape its examples."""
    data = config.data
    if not str(data.get("_target_", "")).endswith("TaskDataModule"):
        raise SystemExit(f"error: {data.get('_target_')} is not data=task: pe-bench tasks reads task runs only")
    return {"task": str(data.task), "seq_len": int(data.seq_len), "passkey_digits": int(data.get("passkey_digits", 5)),
            "key_len": int(data.get("key_len", 2)), "passkey_decoys": int(data.get("passkey_decoys", 0) or 0)}


def examples(settings: dict, multiplier: int, n: int, seed: int):
    """The evaluation examples of a task at ``multiplier`` x its training length (``data.tasks.TaskBatch``)."""
    task, seq_len = settings["task"], settings["seq_len"]
    filler = play_filler("validation") if task == "passkey" else None
    return make_batch(task, n, multiplier * seq_len, eval_seed(seed, task, multiplier, seq_len), sizes="full",
                      passkey_digits=settings["passkey_digits"], key_len=settings["key_len"], filler=filler,
                      passkey_decoys=settings.get("passkey_decoys", 0) * multiplier)  # the training's density


@torch.no_grad()
def score_examples(model, batch) -> dict[str, np.ndarray]:
    """Per example: teacher-forced exact match (0/1), answer tokens right, answer tokens (one forward per block of
    examples); and the answer written by greedy decoding: its exact match, first token, tokens right, the ids."""
    model.eval()
    device = next(model.parameters()).device
    per_forward = max(1, TOKENS_PER_FORWARD // batch.blocks.shape[1])
    exact, correct, n_answer = [], [], []
    for start in range(0, len(batch.blocks), per_forward):
        blocks = batch.blocks[start : start + per_forward].to(device)
        mask = batch.answer_mask[start : start + per_forward].to(device)
        score = answer_accuracy(model(blocks[:, :-1]), blocks, mask)
        exact.append(score.exact_match.cpu())
        correct.append(score.correct.cpu())
        n_answer.append(score.n_answer.cpu())
    greedy = greedy_answers(model, batch.blocks, batch.answer_mask)
    return {"exact_match": torch.cat(exact).double().numpy(), "correct": torch.cat(correct).double().numpy(),
            "n_answer": torch.cat(n_answer).double().numpy(), "greedy_exact_match": greedy["exact_match"],
            "greedy_first_token": greedy["first_token"], "greedy_correct": greedy["correct"], "written": greedy["written"]}


def rates(scores: dict[str, np.ndarray], index: np.ndarray | None = None) -> dict[str, np.ndarray | float]:
    """Exact-match rate and token accuracy of the examples ``index`` picks (rows of ``index``: resamples)."""
    greedy = [m for m in ("greedy_exact_match", "greedy_first_token") if m in scores]  # absent in older results
    beyond = {}
    if "greedy_exact_match" in scores and "beyond" in scores:  # exact match of the examples past the window only
        right, past = scores["greedy_exact_match"], scores["beyond"].astype(float)
        if index is None:
            beyond = {"greedy_exact_match_beyond_L": float((right * past).sum() / past.sum()) if past.sum() else None}
        else:
            with np.errstate(invalid="ignore", divide="ignore"):
                beyond = {"greedy_exact_match_beyond_L": (right * past)[index].sum(axis=-1) / past[index].sum(axis=-1)}
    if index is None:
        return {"exact_match": float(scores["exact_match"].mean()),
                "token_accuracy": float(scores["correct"].sum() / max(scores["n_answer"].sum(), 1)),
                **{m: float(scores[m].mean()) for m in greedy}, **beyond}
    return {"exact_match": scores["exact_match"][index].mean(axis=-1),
            "token_accuracy": scores["correct"][index].sum(axis=-1) / np.maximum(scores["n_answer"][index].sum(axis=-1), 1),
            **{m: scores[m][index].mean(axis=-1) for m in greedy}, **beyond}


def resamples(n_examples: int, draws: int, seed: int) -> np.ndarray:
    """(draws, n_examples) example indices drawn with replacement: one bootstrap, shared by the runs it scores."""
    return np.random.default_rng(seed).integers(0, n_examples, size=(draws, n_examples))


def interval(values: np.ndarray) -> list[float]:
    """The 95 % percentile interval of bootstrap values (resamples without a value, NaN, left out; none: None)."""
    values = np.asarray(values, dtype=float)
    values = values[~np.isnan(values)]
    if not len(values):
        return [None, None]
    return [float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))]


def score_run(run_dir: Path, multipliers: list[int], n_examples: int, seed: int, draws: int, depth_bins: int,
              batches: dict) -> dict:
    """One run's scores at every multiplier (``batches``: the examples, generated once per task, length and L)."""
    start = time.perf_counter()
    run = load_trained_run(run_dir, datamodules={})  # a task's datamodule is generated, nothing to share
    settings = task_settings(run.config)
    pe = run.choices.get("pe") or str(run.config.pe.get("_target_", "")).rsplit(".", 1)[-1]
    limit = run.model.input_stack.pe.max_positions
    lengths, attention = {}, None
    for m in multipliers:
        batch = task_examples(batches, settings, m, n_examples, seed)
        if limit is not None and m * settings["seq_len"] > limit:
            lengths[str(m)] = {"na": f"{m * settings['seq_len']} tokens are past the learned table ({limit} rows)"}
            continue
        scores = score_examples(run.model, batch)
        if m == 1:  # where the model puts position, on the task's own examples at its training length
            attention = position_attention_report(run.model.eval(), batch.blocks[:ATTENTION_EXAMPLES, :-1])
        written = scores.pop("written")
        boot = rates(scores, resamples(n_examples, draws, seed))
        entry = {"seq_len": m * settings["seq_len"], "examples": n_examples, **rates(scores),
                 **{f"{metric}_ci": interval(boot[metric]) for metric in METRICS if metric in boot},  # beyond L: with_beyond
                 "per_example": {k: v.astype(int).tolist() for k, v in scores.items()}, "written": written}
        if batch.depth is not None:
            entry["by_depth"] = [{"depth": d, "exact_match": None if math.isnan(r) else r, "examples": k}
                                 for d, r, k in accuracy_by_depth(torch.from_numpy(scores["exact_match"]).bool(),
                                                                  batch.depth, depth_bins)]
        lengths[str(m)] = entry
    cells = [f"{m}x " + ("n/a" if "na" in c else f"{c['exact_match']:.3f}/{c['token_accuracy']:.3f}")
             for m, c in lengths.items()]
    family = task_arm(pe, run.config, settings["task"])
    print(f"{run_dir.name}: {settings['task']} {family} s{int(run.config.get('seed', 0))} (exact/token): " + "  ".join(cells),
          flush=True)
    return {"run": "/".join(run_dir.resolve().parts[-2:]), "family": family, **settings,
            "seed": int(run.config.get("seed", 0)), "step": run.step, "lengths": lengths, "attention": attention,
            "seconds": round(time.perf_counter() - start, 1)}


def task_arm(pe: str, config, task: str) -> str:
    """A run's arm in the suite: ``arm_label`` against the suite's depth for its task; a passkey trained with decoys
    says so ('rope [decoys 2]'), so it is never pooled with the arm trained without them."""
    label = arm_label(pe, config, layers=TASK_LAYERS.get(task, SUITE_LAYERS))
    decoys = int((config.get("data") or {}).get("passkey_decoys", 0) or 0) if task == "passkey" else 0
    return f"{label} [decoys {decoys}]" if decoys else label


def task_examples(batches: dict, settings: dict, multiplier: int, n_examples: int, seed: int):
    """The examples of a task at a length, generated once per (task, L, multiplier, sizes) and kept in ``batches``."""
    key = (settings["task"], settings["seq_len"], multiplier, settings["passkey_digits"], settings["key_len"],
           settings.get("passkey_decoys", 0))
    if key not in batches:
        batches[key] = examples(settings, multiplier, n_examples, seed)
    return batches[key]


def score_runs(folders: list[Path], args, batches: dict) -> list[dict]:
    """Every run's scores; with ``args.cache`` (a folder) a run's scores are kept there and reused while its checkpoint
    step and the protocol are the same, so a suite can be scored as its sweeps finish."""
    protocol = {"multipliers": args.multipliers, "examples": args.examples, "seed": args.seed,
                "bootstrap": args.bootstrap, "depth_bins": args.depth_bins, "attention_examples": ATTENTION_EXAMPLES}
    runs = []
    for run_dir in run_dirs(folders, args.include_unfinished):
        cached = args.cache / f"{run_dir.parent.name}--{run_dir.name}.json" if args.cache else None
        if cached is not None and cached.is_file():
            entry = json.loads(cached.read_text())
            step, pe, config = checkpoint_facts(run_dir)
            if entry.get("protocol") == protocol and entry["result"]["step"] == step:
                # the arm is named again from the run's config: labels may have learnt a distinction since
                result = entry["result"] | {"family": task_arm(pe, config, entry["result"]["task"])}
                for m in args.multipliers:  # the chance lines are computed on the examples themselves
                    task_examples(batches, result, m, args.examples, args.seed)
                runs.append(with_beyond(result, batches, args))
                continue
        result = score_run(run_dir, args.multipliers, args.examples, args.seed, args.bootstrap, args.depth_bins, batches)
        if cached is not None:
            cached.parent.mkdir(parents=True, exist_ok=True)
            cached.write_text(json.dumps({"protocol": protocol, "result": result}))
        runs.append(with_beyond(result, batches, args))
    return runs


def with_beyond(result: dict, batches: dict, args) -> dict:
    """A run's scores with, per length, which examples lie past its training length (``data.tasks.beyond_window``,
    kept per example as ``beyond``) and its greedy exact match on those alone, with the bootstrap interval: retrieval
    past L, which the window line (a mixture of examples a window model gets right and ones it cannot) does not
    separate from retrieval within the last L tokens."""
    for m in args.multipliers:
        entry = result["lengths"][str(m)]
        if "na" in entry or "greedy_exact_match" not in entry.get("per_example", {}):
            continue
        batch = task_examples(batches, result, m, args.examples, args.seed)
        entry["per_example"]["beyond"] = beyond_window(batch, result["seq_len"]).int().tolist()
        scores = {k: np.asarray(v, dtype=float) for k, v in entry["per_example"].items()}
        metric = "greedy_exact_match_beyond_L"
        entry[metric] = rates(scores)[metric]
        entry[f"{metric}_ci"] = interval(rates(scores, resamples(args.examples, args.bootstrap, args.seed))[metric])
        entry["examples_beyond_L"] = int(scores["beyond"].sum())
    return result


def checkpoint_facts(run_dir: Path) -> tuple[int, str, object]:
    """The global step of a run's last checkpoint (the cache's key), its ``pe=`` option and its config, read without
    building the run."""
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False, mmap=True)
    config = OmegaConf.create(checkpoint["run_config"])
    pe = (checkpoint.get("group_choices") or {}).get("pe") or str(config.pe.get("_target_", "")).rsplit(".", 1)[-1]
    return int(checkpoint["global_step"]), pe, config


def chance_lines(batches: dict) -> dict:
    """task -> L -> m -> window (L) and uniform chance, (token accuracy, exact match) of ``window_chance``."""
    out: dict = defaultdict(lambda: defaultdict(dict))
    for (task, seq_len, m, *_), batch in sorted(batches.items()):
        (wt, we), (ut, ue) = window_chance(batch, seq_len), window_chance(batch, 0)
        out[task][str(seq_len)][str(m)] = {"window": {"token_accuracy": wt, "exact_match": we},
                                           "uniform": {"token_accuracy": ut, "exact_match": ue}}
    return json.loads(json.dumps(out))


def summarise(runs: list[dict], multipliers: list[int], draws: int, seed: int) -> dict:
    """task -> family -> m: the seeds' mean of each metric, its paired bootstrap interval over the shared examples,
    the seeds' min and max; n/a where a family's table cannot place the length."""
    groups: dict = defaultdict(list)
    for r in runs:
        groups[(r["task"], r["seq_len"], r["family"])].append(r)
    summary: dict = defaultdict(dict)
    for (task, seq_len, family), members in sorted(groups.items()):
        cells = {}
        for m in multipliers:
            entries = [r["lengths"][str(m)] for r in members]
            if any("na" in e for e in entries):
                cells[str(m)] = {"na": entries[0].get("na", "n/a")}
                continue
            n = entries[0]["examples"]
            index = resamples(n, draws, seed + 1)
            cell = {"seeds": len(entries)}
            for metric in (m for m in METRICS if all(m in e for e in entries)):
                values = [e[metric] for e in entries]
                if any(v is None for v in values):  # beyond L at 1x: no example lies past L
                    cell |= {metric: None, f"{metric}_ci": [None, None], f"{metric}_min": None, f"{metric}_max": None}
                    continue
                boot = np.mean([rates({k: np.asarray(v, dtype=float) for k, v in e["per_example"].items()}, index)[metric]
                                for e in entries], axis=0)
                cell |= {metric: float(np.mean(values)), f"{metric}_ci": interval(boot),
                         f"{metric}_min": float(min(values)), f"{metric}_max": float(max(values))}
            cells[str(m)] = cell
        label = family if len({r["seq_len"] for r in runs if r["task"] == task}) == 1 else f"{family} (L {seq_len})"
        summary[task][label] = {"seq_len": seq_len, "seeds": sorted(r["seed"] for r in members), "lengths": cells,
                                "attention": summarise_attention([r["attention"] for r in members if r.get("attention")])}
    return dict(summary)


def depth_grid(runs: list[dict], multipliers: list[int]) -> dict:
    """Passkey: family -> m -> per depth bin, the seeds' mean exact match (None where a bin had no example)."""
    grid: dict = defaultdict(dict)
    by_family = defaultdict(list)
    for r in runs:
        if r["task"] == "passkey":
            by_family[r["family"]].append(r)
    for family, members in sorted(by_family.items()):
        for m in multipliers:
            cells = [r["lengths"][str(m)] for r in members if "by_depth" in r["lengths"][str(m)]]
            if not cells:
                continue
            bins = []
            for i, first in enumerate(cells[0]["by_depth"]):
                values = [c["by_depth"][i]["exact_match"] for c in cells if c["by_depth"][i]["exact_match"] is not None]
                bins.append({"depth": first["depth"], "exact_match": float(np.mean(values)) if values else None,
                             "examples": first["examples"]})
            grid[family][str(m)] = bins
    return dict(grid)



def disagreeing(summary: dict, multipliers: list[int]) -> dict[str, list[str]]:
    """task -> the families whose seeds disagree at 1x (a metric's seed range wider than ``DISAGREE``) while fewer
    than 5 seeds were run: where two more seeds are due."""
    out = {}
    for task, families in sorted(summary.items()):
        cell_of = {f: e["lengths"][str(multipliers[0])] for f, e in families.items()}
        due = [f for f, c in sorted(cell_of.items()) if "na" not in c and c["seeds"] < 5
               and any(c[f"{m}_max"] - c[f"{m}_min"] > DISAGREE for m in METRICS if c.get(f"{m}_max") is not None)]
        if due:
            out[task] = due
    return out
