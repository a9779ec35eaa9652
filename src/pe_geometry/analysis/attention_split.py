"""First-layer attention scores split into word, position and bias terms, every one counted.

With x = e + p entering the attention of block 0 (after the layer norm's exact split,
``split_layernorm``: e' + p' + b' = LN(e + p), the constant b' folded into the biases),
q = x W_Q + b_Q and k = x W_K + b_K, the score of query i on key j is

    q_i . k_j = e_i W_Q . e_j W_K            word_word
              + p_i W_Q . p_j W_K            pos_pos
              + e_i W_Q . p_j W_K            word_pos
              + p_i W_Q . e_j W_K            pos_word
              + e_i W_Q . b_K + b_Q . e_j W_K    word_bias
              + p_i W_Q . b_K + b_Q . p_j W_K    pos_bias   (depends on position only)
              + b_Q . b_K                    bias_bias

(each divided by sqrt(d_head)). Position enters through pos_pos, word_pos, pos_word
and pos_bias: a head's positional share is the sum of those four shares. b_Q . p_j W_K
is the one to watch: it varies with the key's position alone and is invisible to a
count that looks at pos_pos only. (A second, uncounted route: the layer norm's 1/sigma
is taken from e + p, so the "word" parts carry a position-dependent scale.)

Shares are of score variance along the keys a query may see (what the softmax sees:
terms constant along a query's row, like e_i W_Q . b_K, cancel), pooled over queries.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

TERMS = ("word_word", "pos_pos", "word_pos", "pos_word", "word_bias", "pos_bias", "bias_bias")
POSITIONAL_TERMS = ("pos_pos", "word_pos", "pos_word", "pos_bias")
_CHUNK_ELEMENTS = 1 << 24  # score entries (heads x T x T) split_shares holds at once: 64 MB in float32


def _f64(x: Tensor) -> Tensor:
    return x.detach().to(torch.float64)


def split_layernorm(
    e: Tensor, p: Tensor, ln_weight: Tensor, ln_bias: Tensor | None = None, eps: float = 1e-5, dtype: torch.dtype = torch.float64
) -> tuple[Tensor, Tensor, Tensor]:
    """Split LN(e + p) into a word part e', a position part p' and a constant b'.

    LN(x) = g * (x - mu(x)) / sigma(x) + b is not linear in x, but with sigma taken from
    the sum x = e + p it splits exactly, because the mean is linear:
        (x - mu(x)) / sigma = (e - mu(e)) / sigma + (p - mu(p)) / sigma.
    So e' = g (e - mu(e)) / sigma, p' = g (p - mu(p)) / sigma, b' = b, and
    e' + p' + b' == LN(e + p). Each part is centred and shares the sum's 1/sigma,
    the standard convention for attributing through LayerNorm. e, p (..., D); computed in ``dtype``.
    """
    e, p = e.detach().to(dtype), p.detach().to(dtype)
    x = e + p
    sigma = (x.var(dim=-1, correction=0, keepdim=True) + eps).sqrt()
    g = ln_weight.detach().to(dtype)
    e_part = g * (e - e.mean(dim=-1, keepdim=True)) / sigma
    p_part = g * (p - p.mean(dim=-1, keepdim=True)) / sigma
    b_part = (ln_bias.detach().to(dtype) if ln_bias is not None else torch.zeros_like(g)).expand_as(x)
    return e_part, p_part, b_part


def attention_split(
    e: Tensor,
    p: Tensor,
    W_q: Tensor,
    W_k: Tensor,
    b_q: Tensor | None = None,
    b_k: Tensor | None = None,
    *,
    n_heads: int,
) -> dict[str, Tensor]:
    """The seven score terms of TERMS, each (n_heads, T, T) float64, summing to the real scores.

    e, p (T, D): word and position parts of what the attention reads (after a layer norm,
    pass its split parts and fold its constant into the biases: b_q + b' W_q, b_k + b' W_k).
    W_q, W_k (D, n_heads * d_head) as used by x @ W (for an nn.Linear, weight.T);
    b_q, b_k (n_heads * d_head,) or None (zeros). Sum over terms ==
    (x W_q + b_q)(x W_k + b_k)^T / sqrt(d_head) per head, with x = e + p.
    """
    d_head = W_q.shape[1] // n_heads
    W_q, W_k = _f64(W_q), _f64(W_k)
    zero = torch.zeros(W_q.shape[1], dtype=torch.float64)

    def heads(y: Tensor) -> Tensor:  # (T, n_heads * d_head) -> (n_heads, T, d_head)
        return y.reshape(-1, n_heads, d_head).transpose(0, 1)

    q_e, q_p, k_e, k_p = heads(_f64(e) @ W_q), heads(_f64(p) @ W_q), heads(_f64(e) @ W_k), heads(_f64(p) @ W_k)
    bq = heads(_f64(b_q) if b_q is not None else zero)  # (n_heads, 1, d_head)
    bk = heads(_f64(b_k) if b_k is not None else zero)
    scale = 1.0 / math.sqrt(d_head)
    T = e.shape[0]

    def dot(a: Tensor, b: Tensor) -> Tensor:
        return (a @ b.transpose(-2, -1) * scale).expand(n_heads, T, T)

    return {
        "word_word": dot(q_e, k_e),
        "pos_pos": dot(q_p, k_p),
        "word_pos": dot(q_e, k_p),
        "pos_word": dot(q_p, k_e),
        "word_bias": dot(q_e, bk) + dot(bq, k_e),
        "pos_bias": dot(q_p, bk) + dot(bq, k_p),
        "bias_bias": dot(bq, bk),
    }


def term_shares(terms: dict[str, Tensor], mask: Tensor | None = None) -> dict[str, Tensor]:
    """Per-head share of score variance due to each term, (n_heads,) each, plus ``positional``.

    terms: name -> (n_heads, T, T) (or (..., n_heads, T, T): leading dims are pooled).
    Variance is along keys within each query row (per-row constants cancel), over the keys
    a query may see (mask (T, T) bool, True = allowed, e.g. causal), pooled over rows.
    share_t = Cov(term_t, S) / Var(S), S the summed score: the shares sum to 1 exactly; a
    share can leave [0, 1] when terms cancel each other. positional = the sum of the
    POSITIONAL_TERMS shares. A head whose scores do not vary at all gets NaN shares.
    """
    S = sum(terms.values())
    w = torch.ones(S.shape[-2:], dtype=torch.float64) if mask is None else mask.to(torch.float64)
    n_keys = w.sum(dim=-1, keepdim=True).clamp_min(1.0)
    pooled = tuple(range(S.dim() - 3)) + (-2, -1)  # every dim but the head

    def centred(t: Tensor) -> Tensor:
        return (t - (t * w).sum(dim=-1, keepdim=True) / n_keys) * w

    S_c = centred(S)
    var = (S_c * S_c).sum(dim=pooled)
    shares = {name: (centred(t) * S_c).sum(dim=pooled) / var for name, t in terms.items()}
    shares["positional"] = sum(shares[name] for name in POSITIONAL_TERMS if name in shares)
    return shares


def positional_heads(shares: dict[str, Tensor], threshold: float = 0.5) -> list[int]:
    """Heads whose score variance is mostly position-dependent: positional share > threshold."""
    return [h for h, share in enumerate(shares["positional"].tolist()) if share > threshold]


def sequence_terms(
    word: Tensor,
    position: Tensor,
    W_q: Tensor,
    W_k: Tensor,
    b_q: Tensor,
    b_k: Tensor,
    *,
    n_heads: int,
    norm: tuple[Tensor, Tensor, float] | None = None,
) -> dict[str, Tensor]:
    """attention_split of every sequence of word (B, T, D) with the shared position part (T, D): (B, n_heads, T, T) per term.

    W_q, W_k (D, n_heads * d_head) as ``x @ W`` uses them; b_q, b_k (n_heads * d_head,).
    norm = (weight, bias, eps) of the LayerNorm the attention reads its input through (a pre-LN
    block's, or BERT's embedding LayerNorm), None when it reads x directly: the norm is split
    exactly (split_layernorm: shared 1/sigma, linear centring) and its constant folded into the
    q/k biases. Works on any checkpoint's weights (this framework's models, BERT).
    """
    W_q, W_k, b_q, b_k, position = _f64(W_q), _f64(W_k), _f64(b_q), _f64(b_k), _f64(position)
    per_sequence = []
    for e in word:
        if norm is not None:
            e_part, p_part, b_ln = split_layernorm(e, position, *norm)
            bq, bk = b_q + b_ln[0] @ W_q, b_k + b_ln[0] @ W_k
        else:
            e_part, p_part, bq, bk = _f64(e), position, b_q, b_k
        per_sequence.append(attention_split(e_part, p_part, W_q, W_k, bq, bk, n_heads=n_heads))
    return {name: torch.stack([t[name] for t in per_sequence]) for name in TERMS}


def split_shares(
    word: Tensor,
    position: Tensor,
    W_q: Tensor,
    W_k: Tensor,
    b_q: Tensor,
    b_k: Tensor,
    *,
    n_heads: int,
    norm: tuple[Tensor, Tensor, float] | None = None,
    mask: Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Tensor]:
    """term_shares(sequence_terms(...), mask) without materialising the terms: (n_heads,) float64 per term and ``positional``.

    Arguments as sequence_terms; mask (T, T) bool as term_shares. Computed on word's device, one
    sequence and a group of heads at a time (at most _CHUNK_ELEMENTS score entries, 64 MB in float32,
    held at once, a few copies of them at the peak), from two facts that make the seven (T, T) terms
    unnecessary: (1) a term's covariance with the row-centred, masked score S_c is sum_ij t_ij S_c_ij
    (S_c's rows sum to 0 over the keys a query sees, so the term needs no centring, and a term
    constant along a row, as e_i W_Q . b_K, b_Q . b_K, contributes exactly 0: b_K never matters);
    (2) every term is a product a_i . c_j, so sum_ij (a_i . c_j) S_c_ij = sum_i a_i . (S_c C)_i:
    one (T, T) x (T, 2 d_head) product S_c [K_e | K_p] gives all of them, and Var(S) is their sum (so
    the shares sum to 1 as term_shares' do, whatever the dtype). The key bias is also left
    out of S before centring (constant along a row), so the centring does not subtract large
    constants. float32 is enough then (shares agree with the float64 split to ~1e-6, see the tests):
    every figure is a ratio of sums of products of centred scores, with no difference of large
    numbers left; the per-chunk sums are added up in float64.
    """
    device = word.device
    W_q, W_k, b_q, position = (t.detach().to(device=device, dtype=dtype) for t in (W_q, W_k, b_q, position))
    T, d_head = position.shape[0], W_q.shape[1] // n_heads
    scale = 1.0 / math.sqrt(d_head)
    group = max(1, min(n_heads, _CHUNK_ELEMENTS // (T * T)))  # heads per chunk
    if mask is not None:
        mask = mask.to(device)
        n_keys = mask.sum(dim=-1, keepdim=True).clamp_min(1).to(dtype)
    else:
        n_keys = torch.full((T, 1), float(T), dtype=dtype, device=device)
    cov = {name: torch.zeros(n_heads, dtype=torch.float64, device=device) for name in TERMS}

    def heads(y: Tensor) -> Tensor:  # (T, n_heads * d_head) -> (n_heads, T, d_head)
        return y.reshape(-1, n_heads, d_head).transpose(0, 1)

    def total(t: Tensor) -> Tensor:  # (h, T, d) -> (h,) float64
        return t.sum(dim=(-2, -1)).to(torch.float64)

    for e in word:  # (T, D)
        if norm is not None:
            e_part, p_part, b_ln = split_layernorm(e, position, *norm, dtype=dtype)
            bq = b_q + b_ln[0] @ W_q
        else:
            e_part, p_part, bq = e.detach().to(dtype), position, b_q
        q_e, q_p, k_e, k_p = heads(e_part @ W_q), heads(p_part @ W_q), heads(e_part @ W_k), heads(p_part @ W_k)
        bq = heads(bq)  # (n_heads, 1, d_head)
        for h in range(0, n_heads, group):
            hs = slice(h, h + group)
            S = (q_e[hs] + q_p[hs] + bq[hs]) @ (k_e[hs] + k_p[hs]).transpose(-2, -1) * scale  # (h, T, T), no key bias
            if mask is not None:
                S.masked_fill_(~mask, 0.0)
            S -= S.sum(dim=-1, keepdim=True) / n_keys
            if mask is not None:
                S.masked_fill_(~mask, 0.0)  # S_c: row-centred over the keys each query sees, 0 elsewhere
            M_e, M_p = S @ k_e[hs] * scale, S @ k_p[hs] * scale  # (h, T, d_head)
            del S
            cov["word_word"][hs] += total(q_e[hs] * M_e)
            cov["pos_pos"][hs] += total(q_p[hs] * M_p)
            cov["word_pos"][hs] += total(q_e[hs] * M_p)
            cov["pos_word"][hs] += total(q_p[hs] * M_e)
            cov["word_bias"][hs] += total(bq[hs] * M_e)
            cov["pos_bias"][hs] += total(bq[hs] * M_p)
    var = sum(cov.values())  # Var(S) = sum_t Cov(term_t, S): the shares sum to 1 (to float64 rounding) as term_shares'
    shares = {name: c / var for name, c in cov.items()}  # bias_bias: 0 (constant along every row)
    shares["positional"] = sum(shares[name] for name in POSITIONAL_TERMS)
    return shares


def _first_layer_inputs(model, idx: Tensor) -> tuple[tuple, dict]:
    """The arguments of sequence_terms / split_shares for block 0 of ``model`` on token blocks idx (B, T)."""
    stack, block = model.input_stack, model.blocks[0]
    attn = block.attn

    def packed(W: Tensor) -> Tensor:  # per-head (n_heads, D, d_head) -> (D, n_heads * d_head), as x @ W uses it
        return W.transpose(0, 1).reshape(W.shape[1], -1)

    norm = (block.ln_attn.weight, block.ln_attn.bias, block.ln_attn.eps) if block.norm == "pre" else None
    args = (stack.embedding(idx), stack.pe.input_term(idx.shape[1]), packed(attn.W_Q), packed(attn.W_K),
            attn.b_Q.reshape(-1), attn.b_K.reshape(-1))
    return args, {"n_heads": attn.n_heads, "norm": norm}


def _causal_mask(model, T: int, device: torch.device | None = None) -> Tensor | None:
    return torch.ones(T, T, dtype=torch.bool, device=device).tril() if model.input_stack.causal else None


def first_layer_terms(model, idx: Tensor) -> tuple[dict[str, Tensor], Tensor | None]:
    """sequence_terms of block 0's self-attention on token blocks idx (B, T): (B, n_heads, T, T) per term.

    model: a LanguageModel with an additive PE (``input_stack``, ``blocks`` as in
    model/transformer.py). x = s * e + p enters block 0 (s the embedding scale); with
    pre-LN the attention reads LN(x); with post-LN it reads x. Also returns the (T, T)
    mask of keys a query may see (None when not causal). Memory: 7 B n_heads T^2 float64
    (4 blocks at T 1024, 12 heads: 2.8 GB); first_layer_attention_split needs none of it.
    """
    args, kwargs = _first_layer_inputs(model, idx)
    return sequence_terms(*args, **kwargs), _causal_mask(model, idx.shape[1])


def first_layer_attention_split(model, idx: Tensor, dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """Per-head term_shares of block 0's scores on token blocks idx (B, T), pooled over sequences.

    (n_heads,) float64 tensors for each of TERMS and ``positional``; see first_layer_terms.
    Pooled = variance-weighted over the B sequences, not a mean of per-sequence ratios.
    Computed by split_shares on the model's device, in ``dtype``, a sequence and a few heads
    at a time: equal to term_shares(*first_layer_terms(model, idx)) to ~1e-6 in float32 and to
    rounding in float64.
    """
    args, kwargs = _first_layer_inputs(model, idx)
    return split_shares(*args, **kwargs, mask=_causal_mask(model, idx.shape[1], idx.device), dtype=dtype)
