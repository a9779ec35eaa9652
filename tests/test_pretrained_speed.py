"""Issue 54 item 1: the fast paths of pe-pretrained's reading equal the straightforward computations they replace.

Each reference is kept beside its fast path (``*_reference``, or a plain loop here) and compared in float64 on a
small random case or a tiny model, to 1e-10.
"""

from __future__ import annotations

import pytest
import torch

from pe_geometry.analysis.measures import position_attention as pa

transformers = pytest.importorskip("transformers")

from pe_geometry.analysis.readers import checkpoints as ck  # noqa: E402

TINY = {  # 4 query heads of 8 dims (llama: 2 key/value heads, gemma3: 1, a sliding layer; neox: a partial rotation)
    "llama": ("LlamaConfig", dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=64)),
    "gpt_neox": ("GPTNeoXConfig", dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=64, rotary_pct=0.25)),
    "gemma3_text": ("Gemma3TextConfig", dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=1, head_dim=8, intermediate_size=64, sliding_window=4,
                                             layer_types=["sliding_attention", "full_attention"])),
}


def tiny_reader(family: str) -> ck.Reader:
    torch.manual_seed(0)
    name, kwargs = TINY[family]
    model = transformers.AutoModel.from_config(getattr(transformers, name)(**kwargs)).eval().double()
    return ck.Reader(model, family)


def ids(batch: int = 3, length: int = 12) -> torch.Tensor:
    return torch.randint(5, 100, (batch, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", sorted(TINY))
@pytest.mark.parametrize("n_draws", [1, 7, 23])
def test_rotation_null_fast_path_equals_the_draw_by_draw_reference(family, n_draws):
    """The same draws (one generator, in order) with the content score computed once and the draws stacked along the
    head axis: every share equal to the draw-by-draw ``mixed_rotation`` + ``recorded_score_parts`` reference."""
    reader = tiny_reader(family)
    for layer, recorded in reader.attention(ids()).items():
        assert recorded["q"].dtype == torch.float64
        args = (recorded, recorded["visible"], recorded["rotate"], n_draws, 5 + layer)
        fast, reference = pa.rotation_null_shares(*args), pa.rotation_null_shares_reference(*args)
        assert fast.shape == reference.shape == (n_draws, 4)
        assert torch.allclose(fast, reference, rtol=0, atol=1e-10), (fast - reference).abs().max()


def test_rotation_null_fast_path_with_a_score_bias_and_a_query_scale():
    """A synthetic layer with every optional point: a (B, H, T, S) score bias, an (H, T, S) one, a (T, 1) query
    scale, grouped keys, keys longer than the queries."""
    g = torch.Generator().manual_seed(3)
    B, H, H_kv, T, S, d = 2, 4, 2, 5, 7, 6
    cos_sin = torch.rand(B, S, d // 2, generator=g, dtype=torch.float64) * 6
    cos, sin = torch.cos(cos_sin).repeat(1, 1, 2), torch.sin(cos_sin).repeat(1, 1, 2)

    def rotate(q, k):  # queries at the last T of the S positions
        return ck.rotate(q, cos[:, S - T:], sin[:, S - T:]), ck.rotate(k, cos, sin)

    q_pre = torch.randn(B, H, T, d, generator=g, dtype=torch.float64)
    k_pre = torch.randn(B, H_kv, S, d, generator=g, dtype=torch.float64)
    q, k = rotate(q_pre, k_pre)
    visible = torch.ones(T, S, dtype=torch.bool).tril(S - T)
    for bias in (torch.randn(B, H, T, S, generator=g, dtype=torch.float64), torch.randn(H, T, S, generator=g, dtype=torch.float64)):
        recorded = {"q": q, "k": k, "q_pre": q_pre, "k_pre": k_pre, "scaling": 0.3, "score_bias": bias,
                    "query_scale": torch.rand(T, 1, generator=g, dtype=torch.float64) + 0.5}
        fast = pa.rotation_null_shares(recorded, visible, rotate, 9, 0)
        reference = pa.rotation_null_shares_reference(recorded, visible, rotate, 9, 0)
        assert torch.allclose(fast, reference, rtol=0, atol=1e-10), (fast - reference).abs().max()


def test_numpy_blas_runs_on_torchs_threads_inside_analyse():
    """analyse's numpy BLAS (the probe's eigh) gets torch's thread count, and its own back afterwards."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    from pe_geometry.analysis.readers import pretrained as pt

    def blas_threads():
        return [i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]

    before, threads = blas_threads(), torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with pt.blas_threads_as_torch():
            assert all(n == 1 for n in blas_threads())
    finally:
        torch.set_num_threads(threads)
    assert blas_threads() == before
