"""Metric names are built and parsed in one module: what the callback logs, the report reads back."""

from __future__ import annotations

import pytest

from pe_geometry.analysis import metric_names as names


@pytest.mark.parametrize(
    "key,section,measure,panel,index,companion",
    [
        (names.input_metric("abs_cos_mean"), "input", "abs_cos_mean", None, None, None),
        (names.input_metric("abs_cos_mean") + "_chance", "input", "abs_cos_mean", None, None, "_chance"),
        (names.hidden_metric(2, "overlap_pos_tok_k8") + "_shuffled", "hidden", "overlap_pos_tok_k8", "layer", 2, "_shuffled"),
        (names.attention_share_metric(3, "pos_pos"), "attn", "pos_pos_share", "head", 3, None),
        (names.N_POSITIONAL_HEADS_ALL_TERMS, "attn", "n_positional_heads_all_terms", None, None, None),
    ],
)
def test_built_names_parse_back(key, section, measure, panel, index, companion):
    name = names.parse(key)
    assert (name.section, name.measure, name.panel, name.index, name.companion) == (section, measure, panel, index, companion)
    assert name.base == key.removesuffix(companion or "")


def test_the_committed_names_stay_stable():
    """Committed results and W&B panels use these exact strings."""
    assert names.input_metric("overlap_k8") == "geometry/overlap_k8"
    assert names.hidden_metric(0, "position_probe_r2") == "geometry/hidden/layer0/position_probe_r2"
    assert names.attention_share_metric(1, "word_pos") == "geometry/attn/head1/word_pos_share"
    assert names.parse(names.hidden_metric(1, "position_probe_r2")).family == "geometry/hidden/layer*/position_probe_r2"
    assert names.parse("val/loss") is None


def test_every_measure_of_the_geometry_module_is_described():
    """A measure without a MEASURES entry would get a bare fallback title in the report."""
    import torch

    from pe_geometry.analysis.measures import geometry as geo

    g = torch.Generator().manual_seed(0)
    E, P = torch.randn(60, 16, generator=g), torch.randn(20, 16, generator=g)
    H, tokens = torch.randn(4, 10, 16, generator=g), torch.randint(8, (4, 10), generator=g)
    logged = [*geo.geometry_report(E, P), *geo.hidden_state_report(H, tokens, fixed_k=4), "pos_pos_share", "n_positional_heads"]
    for measure in logged:
        if not measure.endswith(tuple(names.COMPANIONS)):
            assert names.measure_order(measure) < len(names.MEASURES), measure
    assert names.describe("overlap_k8")[0] == "Subspace overlap of the top-8 word and top-8 position directions"
    assert names.describe("word_pos_share")[0] == "Block 0 attention: score variance from the word–position term"
    assert names.layer_title(0, 2) == "block 0 input (embedding + PE)" and names.layer_title(2, 2).startswith("output")


def test_unknown_attention_term_is_rejected():
    with pytest.raises(ValueError, match=r"unknown attention term 'pos'; valid: \['word_word'"):
        names.attention_share_metric(0, "pos")


def test_measures_older_runs_logged_are_still_described_but_no_longer_built():
    """The report of an older run titles its pos_pos-only head count and 8-block probe; new runs cannot log the lumped
    bias share (the first days' name, no longer described either: a plain fallback title)."""
    assert names.describe("bias_share") == ("bias share", "value")
    assert names.describe("n_positional_heads")[0].startswith("Block 0 positional heads (position–position")
    assert names.describe("position_probe_r2")[0] == "Position read off the hidden states (ridge probe)"
    with pytest.raises(ValueError, match="unknown attention term 'bias'"):
        names.attention_share_metric(0, "bias")
