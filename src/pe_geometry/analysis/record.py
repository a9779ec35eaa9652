"""One geometry record: every measure of one model on one batch, as flat ``geometry/...`` metrics (no Lightning).

``record(model, batch, ...)`` is what ``GeometryCallback`` logs at each of its steps, and what a reader of a
checkpoint calls on a model it loaded: the callback only chooses when, on which rows, and where the figures go.
Three families, each optional (``measures``):

- ``input``: the pairwise table of the claims' source (docs/CLAIMS.md) and the subspace/norm measures between the
  word rows ``word_ids`` (scaled as the model scales them) and the position rows used (``0..T-1``), with each
  figure's spectra-keeping null (``analysis.nulls``, ``null_draws`` rotations of P): ``_null_mean``, ``_null_std``,
  ``_z``, ``_p``; plus the variance-weighted overlaps. Only for encodings that add a table to the input
  (sinusoidal, learned).
- ``hidden``: position vs token structure of the hidden states at the input of each block and at the output, on
  ``batch``; with ``position_blocks`` (at least 5 blocks) also the powered position probe (``analysis.position_probe``,
  a null of ``position_probe_permutations`` relabellings): ``position_r2``, ``log_position_r2``.
- ``attention``: block 0's scores on the first 4 blocks of ``batch``, every family on one axis
  (``analysis.position_attention``), read from the hook points the forward recorded: per head ``positional_share``
  (for an input-table encoding, split into every word/position/bias term by ``analysis.attention_split``; otherwise
  the encoding's own term, with a null of ``attention_null_draws`` random pair assignments for RoPE/xPos),
  ``mean_distance`` beside uniform attention's ``_chance``, and the count of positional heads by the share.

Metric names come from ``analysis.metric_names``. Call it under ``torch.no_grad`` on a model in eval mode (the
callback does, with the RNG state saved and restored).

Cost and memory (docs/BENCHMARKS.md, "Geometry record scaling"; experiments/benchmark_geometry_scaling.py): the
hidden states are computed on the model's device ``chunk_tokens`` tokens at a time, one layer alive at a time, and
summed there into the measures' sufficient statistics (``geometry.HiddenStateSums``,
``position_probe.PositionProbeSums``); the attention split never builds its (T, T) terms. So a record holds one
chunk's activations plus the sums, whatever the number of blocks. float64 only where a figure is a difference of
large sums (the probe's cross-products and SSE, the hidden measures' total variance); the forward passes, the
attention split and the input-level tables stay float32. On a CPU, small work runs on one thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from torch import Tensor

from pe_geometry.analysis import metric_names as names
from pe_geometry.analysis.measures import geometry as geo
from pe_geometry.analysis.measures import position_attention
from pe_geometry.analysis.measures.attention_split import first_layer_attention_split, positional_heads
from pe_geometry.analysis.measures.nulls import _PARALLEL_MACS, _threads, null_summary, rotation_null
from pe_geometry.analysis.measures.position_probe import PositionProbeSums
from pe_geometry.model.transformer import LanguageModel
from pe_geometry.settings.training import MEASURES  # what the recorder can measure (its callback's settings say it)

ATTENTION_BLOCKS = 4  # the first blocks of the batch the attention measures read


def _threads_for(macs: float) -> contextlib.AbstractContextManager:
    """The caller's torch threads for CPU work of >= _PARALLEL_MACS multiply-adds, one thread below (the null's rule).

    Factorisations, reductions and small products sync their threads so often that on a busy 2-core machine the
    second thread mostly waits: measured under load (load average ~8), the hidden measures of a d 128 model took
    4.8 s on 2 threads and 0.05 s on 1. Large products still gain from every core. No effect on a GPU.
    """
    return contextlib.nullcontext() if macs >= _PARALLEL_MACS else _threads(1)


def record(
    model: LanguageModel,
    batch: Tensor,
    *,
    word_ids: Tensor | None = None,
    position_blocks: Tensor | None = None,
    measures: Sequence[str] = MEASURES,
    fixed_k: int = 8,
    positional_head_threshold: float = 0.5,
    seed: int = 0,
    null_draws: int = 100,
    position_probe_permutations: int = 20,
    chunk_tokens: int = 8192,
    attention_null_draws: int = 20,
) -> dict[str, float]:
    """Every enabled measure of ``model`` on token blocks ``batch`` (B, T), as flat ``geometry/...`` metrics.

    ``word_ids``: the word rows of the ``input`` measures (needed for them when the encoding has an input table);
    ``position_blocks`` (N, T): the powered position probe's blocks (None, or fewer than 5: no probe); when they
    start with ``batch``, one pass feeds both. The other keywords are the callback's settings of the same names
    (configs/callbacks/default.yaml). See the module docstring.
    """
    unknown = sorted(set(measures) - set(MEASURES))
    if unknown:
        raise ValueError(f"unknown geometry measure(s) {unknown}; valid: {list(MEASURES)}")
    metrics: dict[str, float] = {}
    if "input" in measures and model.W_pos is not None:
        if word_ids is None:
            raise ValueError("the input measures need word_ids (the word rows to measure against the position rows)")
        metrics.update(input_measures(model, word_ids, batch.shape[1], fixed_k=fixed_k, seed=seed,
                                      null_draws=null_draws))
    if "hidden" in measures:
        probe = position_blocks if position_blocks is not None and len(position_blocks) >= 5 else None
        metrics.update(hidden_measures(model, batch, probe, fixed_k=fixed_k, seed=seed, chunk_tokens=chunk_tokens,
                                       position_probe_permutations=position_probe_permutations))
    if "attention" in measures:
        metrics.update(attention_measures(model, batch[:ATTENTION_BLOCKS], threshold=positional_head_threshold,
                                          null_draws=attention_null_draws))
    return metrics


def input_measures(
    model: LanguageModel, word_ids: Tensor, seq_len: int, fixed_k: int = 8, seed: int = 0, null_draws: int = 100
) -> dict[str, float]:
    """The input table's figures and their rotation nulls: word rows ``word_ids`` against position rows 0..seq_len-1."""
    device = model.W_E.device
    E = model.W_E[word_ids.to(device)].float().cpu()
    P = model.W_pos[:seq_len].float().cpu()
    with _threads_for(0):  # SVDs of (1000, d) and (seq_len, d): factorisations, one thread
        report = geo.geometry_report(E, P, embed_scale=model.embed_scale, seed=seed)
    report |= rotation_null(E, P, n_draws=null_draws, seed=0, fixed_k=fixed_k)  # the same observed values
    return {names.input_metric(k): v for k, v in report.items()}


def attention_measures(
    model: LanguageModel, idx: Tensor, threshold: float = 0.5, null_draws: int = 20
) -> dict[str, float]:
    """Block 0 on token blocks idx: per-head positional share of the score variance for every family (the seven
    split terms for an input-table encoding, the encoding's own term otherwise; with the rotation null for
    RoPE/xPos), each head's mean attention distance beside uniform attention's, and the positional-head count."""
    idx = idx.to(model.W_E.device)
    metrics: dict[str, float] = {}
    with _threads_for(ATTENTION_BLOCKS * idx.shape[1] ** 2 * model.d_model * 3):  # S, then S_c [K_e | K_p] (all heads)
        if model.W_pos is not None:
            shares = first_layer_attention_split(model, idx)
        else:
            shares = {"positional": position_attention.relative_position_shares(model, idx)}
            if position_attention.has_rotation(model):
                draws = position_attention.rotation_share_draws(model, idx, null_draws).cpu().numpy()
                for h, value in enumerate(shares["positional"].tolist()):
                    metrics |= null_summary(names.attention_share_metric(h, "positional"), value, draws[:, h])
        distance, chance = position_attention.mean_attention_distance(model, idx, n_blocks=1)
    for name, per_head in shares.items():
        for h, value in enumerate(per_head.tolist()):
            metrics[names.attention_share_metric(h, name)] = value
    for h, (value, uniform) in enumerate(zip(distance[0].tolist(), chance[0].tolist())):
        metrics[names.attention_distance_metric(h)] = value
        metrics[names.companion(names.attention_distance_metric(h), "_chance")] = uniform
    metrics[names.N_POSITIONAL_HEADS_ALL_TERMS] = float(len(positional_heads(shares, threshold)))
    return metrics


def hidden_measures(
    model: LanguageModel,
    batch: Tensor,
    position_blocks: Tensor | None = None,
    fixed_k: int = 8,
    seed: int = 0,
    chunk_tokens: int = 8192,
    position_probe_permutations: int = 20,
) -> dict[str, float]:
    """hidden_state_report of every layer on ``batch`` (B, T), and position_probe's figures on ``position_blocks``.

    The hidden states are computed on the model's device ``chunk_tokens`` tokens at a time (whole blocks, at
    least one), one layer alive at a time (``iter_hidden_states``), and summed into HiddenStateSums /
    PositionProbeSums there: what a record holds is one chunk's activations plus the sums (float64: (2 T + n_tok) D
    per layer for the hidden measures, 5 D^2 + 210 D for the probe with 20 relabellings), never the (blocks, T, D)
    states of every layer. When ``position_blocks`` start with ``batch`` (the callback's: both are the first
    validation blocks), one pass feeds both.
    """
    device = model.W_E.device
    n_states = len(model.blocks) + 1
    hidden = [geo.HiddenStateSums(batch, seed=seed) for _ in range(n_states)]
    probe_sums = None
    passes = [(batch, True, False)]  # (blocks, feeds the hidden measures, feeds the probe)
    if position_blocks is not None:
        probe_sums = PositionProbeSums(len(position_blocks), position_blocks.shape[1], n_layers=n_states,
                                       n_permutations=position_probe_permutations, seed=0)
        shared = position_blocks[: len(batch)].equal(batch)
        passes = [(position_blocks, True, True)] if shared else [*passes, (position_blocks, False, True)]
    step = max(1, chunk_tokens // batch.shape[1])  # blocks per chunk
    D = model.d_model
    for blocks, to_hidden, to_probe in passes:
        for first in range(0, len(blocks), step):
            chunk = blocks[first : first + step].to(device)
            # the forward runs inside the generator, under the outer setting; the sums under the inner one
            with _threads_for(chunk.numel() * 12 * D * D):  # a block's products: ~12 d^2 multiply-adds a token
                for i, H in enumerate(model.iter_hidden_states(chunk)):
                    with _threads_for(chunk.numel() * D * D):  # the probe's x^T x
                        if to_hidden and first < len(batch):
                            hidden[i].add(H[: len(batch) - first], first)
                        if to_probe:
                            probe_sums.add(H, first, layer=i)
    metrics = {}
    with _threads_for(0):  # (d, d) eighs and products of d x d by d x 9 C: one thread
        for i, sums in enumerate(hidden):
            metrics.update({names.hidden_metric(i, k): v for k, v in sums.report(fixed_k).items()})
        if probe_sums is not None:
            for i in range(n_states):
                metrics.update({names.hidden_metric(i, k): v for k, v in probe_sums.report(i).items()})
    return metrics
