"""The names of the geometry metrics: built here, parsed here, described here.

The geometry callback builds every name it logs with the functions below; the report
parses logged names with ``parse`` and titles them with ``describe``. Nothing else
writes or decodes these strings, so adding a measure means: its function (in
``analysis.geometry``), one entry in ``MEASURES`` below, and its test.

Layout of a name (stable: committed results and W&B panels use them)::

    geometry/<measure>                         input level: word rows vs position rows
    geometry/hidden/layer<i>/<measure>         hidden states; i = input of block i (0 = embedding + PE),
                                               i = n_layers = the stack's output after the final norm
    geometry/attn/head<h>/<term>_share         block 0 attention, one value per head h (from 0)
    geometry/attn/head<h>/mean_distance
    geometry/attn/n_positional_heads_all_terms
    <any of the above><companion>              a baseline beside the measure: _chance, _random, _shuffled,
                                               _null_mean (spectra-keeping or permutation null)
    <any of the above><statistic>              the measure against its null: _null_std, _z, _p (not plotted as lines)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PREFIX = "geometry"
SECTIONS = ("input", "hidden", "attn")
TRAIN_LOSS, VAL_LOSS = "train/loss", "val/loss"
N_POSITIONAL_HEADS_ALL_TERMS = f"{PREFIX}/attn/n_positional_heads_all_terms"  # every position-dependent term counted

# Baselines logged next to a measure X as X<suffix>: (plot line style, legend text).
COMPANIONS = {
    "_chance": ("--", "chance"),
    "_random": (":", "Gaussian matrices, same shapes"),
    "_shuffled": ("-.", "positions shuffled across rows"),
    "_null_mean": ((0, (3, 1, 1, 1)), "null mean (rotations / relabelled positions)"),
}
# The measure against its null (analysis.nulls.null_summary): parsed like companions, never drawn as lines.
STATISTICS = ("_null_std", "_z", "_p")
# The terms of analysis.attention_split (and their positional sum) that the callback logs a share of, each as the
# noun phrase a title puts after "score variance from" (the sum is several terms, not "the ... term").
ATTENTION_TERMS = {"word_word": "the word–word term", "pos_pos": "the position–position term",
                   "word_pos": "the word–position term", "pos_word": "the position–word term",
                   "word_bias": "the word–bias term", "pos_bias": "the position–bias term",
                   "bias_bias": "the bias–bias term", "positional": "all position-dependent terms"}

# (pattern of the measure's last name component, title, y-axis label); {0} = the pattern's first group,
# {term} = that group spelled out. The order is the order of the measures in the report.
MEASURES = [
    (r"abs_cos_mean", "Mean |cos| between word and position vectors", "mean |cosine|  (0 = orthogonal)"),
    (r"cos_mean", "Mean cosine between word and position vectors", "mean cosine"),
    (r"cos_std", "Spread of the word–position cosines", "std of cosine"),
    (r"angle_mean_deg", "Mean angle between word and position vectors", "angle (degrees; 90 = orthogonal)"),
    (r"angle_std_deg", "Spread of the word–position angles", "std of angle (degrees)"),
    (r"angle_min_deg", "Smallest word–position angle", "angle (degrees)"),
    (r"angle_max_deg", "Largest word–position angle", "angle (degrees)"),
    (r"overlap_k(\d+)", "Subspace overlap of the top-{0} word and top-{0} position directions", "overlap (0 = orthogonal, 1 = nested)"),
    (r"angle_mean_k(\d+)_deg", "Mean principal angle, top-{0} word vs position subspaces", "angle (degrees; 90 = orthogonal)"),
    (r"angle_min_k(\d+)_deg", "Smallest principal angle, top-{0} word vs position subspaces", "angle (degrees)"),
    (r"overlap_var(\d+)", "Subspace overlap of word and position rows ({0}%-variance subspaces)", "overlap (0 = orthogonal, 1 = nested)"),
    (r"k_E_var(\d+)", "Word directions explaining {0}% of the variance", "principal directions"),
    (r"k_P_var(\d+)", "Position directions explaining {0}% of the variance", "principal directions"),
    (r"erank_E", "Effective rank of the word rows", "effective rank (dimensions)"),
    (r"erank_P", "Effective rank of the position rows", "effective rank (dimensions)"),
    (r"norm_e_mean", "Mean norm of the word vectors (as the model scales them)", "L2 norm"),
    (r"norm_p_mean", "Mean norm of the position vectors", "L2 norm"),
    (r"norm_ratio_p_over_e", "Norm ratio position / word vector", "‖p‖ / ‖e‖"),
    (r"var_share_P_in_E_k(\d+)", "Share of the position rows' variance inside the top-{0} word subspace",
     "variance share (0–1)"),
    (r"var_share_E_in_P_k(\d+)", "Share of the word rows' variance inside the top-{0} position subspace",
     "variance share (0–1)"),
    (r"position_probe_r2", "Position read off the hidden states (ridge probe)", "held-out R²  (1 = exact position)"),  # older runs
    (r"position_r2", "Position read off the hidden states (grouped-CV ridge probe, 128 blocks)", "CV R²  (1 = exact position)"),
    (r"log_position_r2", "log(1 + position) read off the hidden states (grouped-CV ridge probe)", "CV R²  (1 = exact)"),
    (r"position_var_share", "Share of hidden-state variance between positions", "variance share (0–1)"),
    (r"overlap_pos_tok_k(\d+)", "Overlap of per-position and per-token mean subspaces (top {0})", "overlap (0 = orthogonal, 1 = nested)"),
    (r"(pos_pos|word_word|word_pos|pos_word|word_bias|pos_bias|bias_bias|positional)_share",
     "Block 0 attention: score variance from {term}",
     "Cov(term, score) / Var(score)"),  # sums to 1 over the terms; one leaves [0, 1] when others cancel it
    (r"mean_distance", "Block 0 attention: mean distance attended", "tokens (mean |i − j| under the weights)"),
    (r"n_positional_heads", "Block 0 positional heads (position–position share > 0.5)", "heads"),  # older runs
    (r"n_positional_heads_all_terms", "Block 0 positional heads (share of every position-dependent term > 0.5)", "heads"),
]
# What each section's baselines mean, for the notes under the report's tables.
BASELINE_NOTES = {
    "input": "chance: expectation for isotropic random vectors / uniformly random subspaces in d_model dimensions "
             "(|cos| ≈ sqrt(2/(π d))); random: the same table on Gaussian matrices of the same shapes.",
    "hidden": "null mean: position_r2 — the same grouped-CV probe with each block's positions shifted cyclically; "
              "chance: position_var_share — its exact expectation (T−1)/(N−1) for exchangeable rows; overlap — uniformly "
              "random subspaces; position_probe_r2 (older runs' 8-block probe) — the same probe with positions shuffled "
              "across rows. shuffled: the overlap with positions shuffled across rows (keeps the hidden states' anisotropy).",
    "attn": "Input-table encodings: the seven term shares sum to 1 per head (a share can leave [0, 1] when terms "
            "cancel); positional is the sum of the four position-dependent ones. Other families: positional is the "
            "share of the encoding's own term (a rotation's change to q·k, or the score bias; NoPE 0); null mean for "
            "RoPE/xPos: the same q and k with each head's pairs mixed by a random orthogonal matrix. chance: "
            "mean_distance under uniform attention over the keys a query sees.",
}


# ----------------------------------------------------------------------------- build


def input_metric(measure: str) -> str:
    """``geometry/<measure>``: word rows vs position rows at the input."""
    return f"{PREFIX}/{measure}"


def hidden_metric(layer: int, measure: str) -> str:
    """``geometry/hidden/layer<layer>/<measure>``; layer i = input of block i, n_layers = the stack's output."""
    return f"{PREFIX}/hidden/layer{layer}/{measure}"


def attention_distance_metric(head: int) -> str:
    """``geometry/attn/head<head>/mean_distance``: block 0, head ``head``: mean |i - j| under its attention weights."""
    return f"{PREFIX}/attn/head{head}/mean_distance"


def attention_share_metric(head: int, term: str) -> str:
    """``geometry/attn/head<head>/<term>_share``: block 0, head ``head`` (from 0), term in ATTENTION_TERMS."""
    if term not in ATTENTION_TERMS:
        raise ValueError(f"unknown attention term {term!r}; valid: {list(ATTENTION_TERMS)}")
    return f"{PREFIX}/attn/head{head}/{term}_share"


# ----------------------------------------------------------------------------- parse


_PANEL = re.compile(rf"^{PREFIX}/(hidden|attn)/(layer|head)(\d+)/(.+)$")


@dataclass(frozen=True)
class MetricName:
    """A parsed geometry metric name."""

    key: str  # the full logged name
    section: str  # one of SECTIONS
    measure: str  # last name component without companion suffix, e.g. "position_probe_r2"
    panel: str | None  # "layer" or "head" for per-layer / per-head measures, else None
    index: int | None  # the layer or head index (from 0)
    companion: str | None  # "_chance", "_random", "_shuffled" or None

    @property
    def family(self) -> str:
        """The name with the layer/head index as ``*`` and no companion: one figure per family."""
        if self.panel is None:
            return self.base
        return f"{PREFIX}/{self.section}/{self.panel}*/{self.measure}"

    @property
    def base(self) -> str:
        """The measure's own name (the key without its companion suffix)."""
        return self.key[: len(self.key) - len(self.companion)] if self.companion else self.key


def parse(key: str) -> MetricName | None:
    """Parse a logged name; None for anything that is not a geometry metric (losses, learning rate, ...).

    A STATISTICS suffix is returned as the companion too (it belongs to the measure's figure).
    """
    if not key.startswith(f"{PREFIX}/"):
        return None
    companion = next((c for c in (*COMPANIONS, *STATISTICS) if key.endswith(c)), None)
    base = key[: len(key) - len(companion)] if companion else key
    m = _PANEL.match(base)
    if m is not None:
        return MetricName(key, m.group(1), m.group(4), m.group(2), int(m.group(3)), companion)
    rest = base[len(PREFIX) + 1 :]
    section = next((s for s in SECTIONS[1:] if rest.startswith(f"{s}/")), "input")
    return MetricName(key, section, rest.rsplit("/", 1)[-1], None, None, companion)


def companion(key: str, suffix: str) -> str:
    """The name of a measure's baseline or null statistic, e.g. companion("geometry/abs_cos_mean", "_p")."""
    if suffix not in (*COMPANIONS, *STATISTICS):
        raise ValueError(f"unknown companion {suffix!r}; valid: {[*COMPANIONS, *STATISTICS]}")
    return key + suffix


# ----------------------------------------------------------------------------- describe


def measure_order(measure: str) -> int:
    """Position of a measure in the report (unknown measures last)."""
    return next((i for i, (pattern, _, _) in enumerate(MEASURES) if re.fullmatch(pattern, measure)), len(MEASURES))


def describe(measure: str) -> tuple[str, str]:
    """(title, y-axis label) of a measure's last name component; a plain fallback for an unlisted one."""
    for pattern, title, ylabel in MEASURES:
        m = re.fullmatch(pattern, measure)
        if m:
            groups = m.groups()
            term = ATTENTION_TERMS.get(groups[0], groups[0]) if groups else ""
            return title.format(*groups, term=term), ylabel
    return measure.replace("_", " "), "value"


def layer_title(index: int, n_layers: int | None) -> str:
    """What hidden-state index ``index`` is: 'block 0 input (embedding + PE)', ..., 'output (after final norm)'."""
    if index == 0:
        return "block 0 input (embedding + PE)"
    if n_layers is not None and index == n_layers:
        return f"output of block {index - 1} (after final norm)"
    return f"block {index} input"


def panel_title(panel: str | None, index: int | None, n_layers: int | None) -> str:
    """Title of one panel of a per-layer or per-head figure ('' for a single-panel measure)."""
    if panel == "layer" and index is not None:
        return layer_title(index, n_layers)
    if panel == "head":
        return f"head {index}"
    return ""


def last_block_input(n_layers: int) -> int:
    """Hidden-state index of the last block's input: the deepest state that still has to carry position for attention."""
    return max(n_layers - 1, 0)
