"""Two readers of one trained run: its own geometry record, and ``pe-pretrained``'s reading of its transformers export.

The framework measures a model in two ways that share no model code: the geometry callback records a run while it
trains (``analysis.record`` on our ``LanguageModel``), and ``pe-pretrained`` reads any transformers checkpoint
(``analysis.readers.pretrained`` on transformers' model, through its attention hooks). A run exported by ``pe-export``
(``model.export``: exact, logits equal ours) is one model both can read, so where they measure the same figure they
must give the same number:

- **same inputs** (``same_inputs``): pe-pretrained's functions fed the callback's own word rows, probe blocks and
  attention blocks. Each figure must equal the run's logged record to float32 rounding (``SAME_INPUT_TOLERANCE``);
  a larger difference is a bug in one reader, and ``ours_now`` (our model measured again on the same inputs) says
  which: the record it matches is right.
- **pe-pretrained's defaults** (``defaults``): what a user who runs ``pe-pretrained DIR`` on the export sees (the 1000
  most frequent tokens of the plays under the exported tokenizer, 32 evenly spaced windows, a decoder's <bos> first).
  Its framing moves the figures away from the record for two stated reasons, a probe's R^2 grows with its blocks (32
  windows, not the record's 128) and a fixed first token lets a model place the others (RoPE's output probe: 0.11
  with the <bos>, 0.04 without, on one quick run). So it is read against the validation text framed the same way
  (``same_size``: the mean over ``SPREAD_SETS`` disjoint sets of windows), in units of the sd over those sets: only
  the text then differs (the input rows read no text: against the record, in units of the figure's rotation-null sd).

The figures compared (where the family has them): the input level's mean |cos|, top-8 overlap and their nulls (input
tables), the position probe's R^2 at every block input and the output, block 0's positional share and mean attention
distance (means over heads).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from pe_geometry.analysis import metric_names as names
from pe_geometry.analysis.geometry_callback import GeometryCallback
from pe_geometry.analysis.measures.nulls import holm
from pe_geometry.analysis.measures.position_probe import position_probe
from pe_geometry.analysis.readers import pretrained
from pe_geometry.analysis.readers.checkpoints import Reader, load
from pe_geometry.analysis.readers.runs import read_metrics
from pe_geometry.analysis.record import ATTENTION_BLOCKS, record
from pe_geometry.extras import needs_extra
from pe_geometry.training.run_loader import TrainedRun

SAME_INPUT_TOLERANCE = 1e-4  # |difference| / max(|record|, 0.01): float32 forwards of two implementations agree to ~1e-6
SPREAD_SETS = 16  # disjoint samples of the validation text the defaults are read against, spread over each stride
DEFAULT_WINDOWS = 32  # pe-pretrained's windows (analyse's n_windows): each set holds as many blocks
INPUT_FIGURES = ("abs_cos_mean", "abs_cos_mean_null_mean", "overlap_k8", "overlap_k8_null_mean")


@dataclass
class Row:
    figure: str
    record: float  # the run's own geometry record at its last step (metrics.csv)
    same_inputs: float | None = None  # pe-pretrained's functions on the callback's inputs
    ours_now: float | None = None  # our model measured again on those inputs (which reader is right, if they differ)
    defaults: float | None = None  # pe-pretrained as a user runs it
    same_size: float | None = None  # the validation text read as pe-pretrained reads the plays (mean over disjoint sets)
    spread: float | None = None  # the sd of that figure over the sets (input rows: their rotation null's sd)
    sets: list[float] | None = None  # the figure on each set

    @property
    def same_inputs_difference(self) -> float | None:
        if self.same_inputs is None:
            return None
        return abs(self.same_inputs - self.record) / max(abs(self.record), 0.01)

    @property
    def agrees(self) -> bool | None:
        difference = self.same_inputs_difference
        return None if difference is None else difference <= SAME_INPUT_TOLERANCE

    @property
    def defaults_t(self) -> float | None:
        """(defaults - same_size) / (sd sqrt(1 + 1/n)): one new sample against the n sets' mean (a prediction
        interval's t, n - 1 df). None for the input rows, which read no text."""
        if self.defaults is None or not self.sets or len(self.sets) < 2 or not self.spread:
            return None
        return (self.defaults - self.same_size) / (self.spread * (1 + 1 / len(self.sets)) ** 0.5)

    @property
    def defaults_p(self) -> float | None:
        """Two-sided p of ``defaults_t`` (Student's t, n - 1 df)."""
        if self.defaults_t is None:
            return None
        with needs_extra("report", "pe-bench readers' p-values"):
            from scipy import stats

        return float(2 * stats.t.sf(abs(self.defaults_t), len(self.sets) - 1))


def callback_inputs(run: TrainedRun) -> GeometryCallback:
    """The run's geometry callback, with the rows it measured on chosen from the run's own streams (as its setup does)."""
    settings = OmegaConf.to_container(run.config.callbacks.geometry, resolve=True)
    settings.pop("_target_", None)
    callback = GeometryCallback(**settings)
    callback.choose_rows_of(run.datamodule)
    return callback


def final_record(run_dir: Path) -> tuple[int, dict[str, float]]:
    """The last step at which the run logged its position probe (its final record), and every geometry figure there."""
    metrics = read_metrics(run_dir)
    probe = names.hidden_metric(0, "position_r2")
    if probe not in metrics:
        raise ValueError(f"{run_dir}: no position probe in its metrics (was the geometry callback on?)")
    step = int(metrics[probe][0][-1])
    return step, {k: float(values[list(steps).index(step)]) for k, (steps, values) in metrics.items()
                  if k.startswith("geometry/") and step in steps}


def _head_mean(metrics: dict[str, float], name) -> float | None:
    """The mean over heads 0, 1, ... of the per-head metric ``name(h)``, as far as the record has them."""
    values = []
    while name(len(values)) in metrics:
        values.append(metrics[name(len(values))])
    return statistics.fmean(values) if values else None


def record_figures(metrics: dict[str, float], n_states: int) -> dict[str, float]:
    """The compared figures from one record's flat ``geometry/...`` metrics (``analysis.record``)."""
    out = {f"input/{k}": metrics[names.input_metric(k)] for k in INPUT_FIGURES if names.input_metric(k) in metrics}
    out |= {f"probe/block{i}_position_r2": metrics[names.hidden_metric(i, "position_r2")] for i in range(n_states)
            if names.hidden_metric(i, "position_r2") in metrics}
    share = _head_mean(metrics, lambda h: names.attention_share_metric(h, "positional"))
    if share is not None:
        out["block0/positional_share"] = share
    out["block0/mean_distance"] = _head_mean(metrics, names.attention_distance_metric)
    return out


def reader_figures(reader: Reader, word_ids: list[int] | None, blocks: torch.Tensor, probe_blocks: torch.Tensor,
                   null_draws: int, probe_permutations: int, attention_null_draws: int) -> dict[str, float]:
    """pe-pretrained's functions on given inputs: the same figures as ``record_figures``."""
    out: dict[str, float] = {}
    T = blocks.shape[1]
    if reader.W_pos is not None and word_ids is not None:
        report = pretrained.input_report(reader, word_ids, T, null_draws=null_draws)
        out |= {f"input/{k}": report[k] for k in INPUT_FIGURES}
    for i, H in enumerate(reader.hidden_states(probe_blocks)):
        out[f"probe/block{i}_position_r2"] = position_probe(H, n_permutations=probe_permutations)["position_r2"]
    attention = blocks[:ATTENTION_BLOCKS]
    if reader.W_pos is not None:
        out["block0/positional_share"] = statistics.fmean(
            pretrained.first_layer_attention(reader, attention)["shares"]["positional"])
    layer0 = pretrained.attention_layers(reader, attention, attention_null_draws)[0]
    if layer0["positional_share"] is not None:
        out["block0/positional_share"] = statistics.fmean(layer0["positional_share"])
    out["block0/mean_distance"] = statistics.fmean(layer0["mean_distance"])
    return out


def default_figures(r: dict) -> dict[str, float]:
    """The compared figures from ``pretrained.analyse``'s record (pe-pretrained's defaults)."""
    out: dict[str, float] = {}
    if "frequent_rows" in r:
        g = r["frequent_rows"]["geometry"]
        out |= {f"input/{k}": g[k] for k in INPUT_FIGURES}
    if "attention_layer0" in r:
        out["block0/positional_share"] = statistics.fmean(r["attention_layer0"]["shares"]["positional"])
    for i, h in enumerate(r["hidden_states"]):
        out[f"probe/block{i}_position_r2"] = h["position_r2"]
    layer0 = r["attention_layers"][0]
    if layer0["positional_share"] is not None:
        out["block0/positional_share"] = statistics.fmean(layer0["positional_share"])
    out["block0/mean_distance"] = statistics.fmean(layer0["mean_distance"])
    return out


def sampling_spread(run: TrainedRun, callback: GeometryCallback, reader: Reader, tokenizer,
                    n_windows: int = DEFAULT_WINDOWS) -> tuple[dict[str, float], dict[str, float], dict[str, list]]:
    """(mean, sd, values) of each text-read figure over ``SPREAD_SETS`` disjoint samples of the run's validation text
    (their offsets spread over each window's stride, so the samples come from across the text), each read as
    pe-pretrained reads the plays: ``n_windows`` evenly spaced windows framed as the export's tokenizer frames
    a text (a GPT-NeoX export puts its <bos>, the run's <eos>, first), the probe on the text's own positions, the
    attention on the first 8 windows. Only the text then differs from pe-pretrained's defaults (the plays, which hold
    the training text, against 4 held-out plays). The input figures read rows, not text: no mean; their sd is their
    rotation null's (from our record)."""
    T = callback.seq_len
    stream = [int(i) for i in run.datamodule.streams["validation"]]
    stride = (len(stream) - T) // n_windows
    n_sets = min(SPREAD_SETS, stride // T)
    step = stride // max(n_sets, 1)  # >= T: the sets' windows never overlap
    if n_sets < 2:
        raise ValueError(f"the validation stream holds {len(stream)} tokens: fewer than 2 disjoint sets of {n_windows} "
                         f"evenly spaced windows of {T} tokens to measure the sampling spread on")
    per_set = []
    for s in range(n_sets):
        ids, text = pretrained.windows(reader, tokenizer, stream, n_windows, T, offset=s * step)
        r = {"hidden_states": pretrained.hidden_state_layers(reader, ids, text, n_permutations=2),
             "attention_layers": pretrained.attention_layers(reader, ids[:8], null_draws=2)}
        if reader.W_pos is not None:
            r["attention_layer0"] = pretrained.first_layer_attention(reader, ids[:8])
        per_set.append(default_figures(r))
    values = {k: [f[k] for f in per_set] for k in per_set[0]}
    mean = {k: statistics.fmean(v) for k, v in values.items()}
    spread = {k: statistics.stdev(v) for k, v in values.items()}
    metrics = record(run.model, callback.probe, word_ids=callback.token_ids, measures=("input",),
                     null_draws=callback.null_draws)
    for k in INPUT_FIGURES:
        key = names.input_metric(k.removesuffix("_null_mean") + "_null_std")
        if key in metrics:
            spread[f"input/{k}"] = metrics[key]
    return mean, spread, values


def compare(run: TrainedRun, run_dir: str | Path, folder: str | Path, defaults: bool = True) -> dict:
    """Both readers on one run (``run``: ``load_trained_run(run_dir)``) and its export ``folder``: one ``Row`` per
    figure, with the step the record was taken at. ``defaults=False`` skips pe-pretrained's own inputs."""
    step, logged = final_record(Path(run_dir))
    if step != run.step:
        raise ValueError(f"{run_dir}: the last record is at step {step}, the checkpoint at step {run.step}")
    n_states = len(run.model.blocks) + 1
    recorded = record_figures(logged, n_states)
    callback = callback_inputs(run)
    settings = {"null_draws": callback.null_draws, "probe_permutations": callback.probe_permutations,
                "attention_null_draws": callback.attention_null_draws}
    loaded = load(folder)
    reader = Reader(loaded.model, loaded.model_type)
    word_ids = callback.token_ids.tolist() if run.model.W_pos is not None else None
    with torch.no_grad():
        same = reader_figures(reader, word_ids, callback.probe, callback.position_blocks, **settings)
        ours = record_figures(callback.measure(run.model, position_probe_now=True), n_states)
        theirs = default_figures(pretrained.analyse(loaded=loaded)) if defaults else {}
        same_size, spread, sets = sampling_spread(run, callback, reader, loaded.tokenizer) if defaults else ({}, {}, {})
    rows = [Row(figure, value, same.get(figure), ours.get(figure), theirs.get(figure), same_size.get(figure),
                spread.get(figure), sets.get(figure)) for figure, value in recorded.items()]
    return {"step": step, "model_type": loaded.model_type, "rows": rows}


def table(results: dict[str, dict]) -> str:
    """A markdown table: one line per (run, figure)."""
    lines = [f"| run | figure | record | same inputs | rel. diff | validation, {DEFAULT_WINDOWS} windows: mean (range) "
             "| sd | pe-pretrained defaults | t | p | Holm |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    tested = [row for result in results.values() for row in result["rows"] if row.defaults_p is not None]
    adjusted = dict(zip(map(id, tested), holm([row.defaults_p for row in tested])))

    def cell(v, fmt=".4f"):
        return "" if v is None else format(v, fmt)

    for run, result in results.items():
        for row in result["rows"]:
            spread = f" ({min(row.sets):.4f} to {max(row.sets):.4f})" if row.sets else ""
            lines.append(f"| {run} | {row.figure} | {cell(row.record)} | {cell(row.same_inputs)} | "
                         f"{cell(row.same_inputs_difference, '.1e')} | {cell(row.same_size)}{spread} | "
                         f"{cell(row.spread)} | {cell(row.defaults)} | {cell(row.defaults_t, '.1f')} | "
                         f"{cell(row.defaults_p, '.2g')} | {cell(adjusted.get(id(row)), '.2g')} |")
    return "\n".join(lines)
