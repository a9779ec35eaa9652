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


def _f64(x: Tensor) -> Tensor:
    return x.detach().to(torch.float64)


def split_layernorm(
    e: Tensor, p: Tensor, ln_weight: Tensor, ln_bias: Tensor | None = None, eps: float = 1e-5
) -> tuple[Tensor, Tensor, Tensor]:
    """Split LN(e + p) into a word part e', a position part p' and a constant b'.

    LN(x) = g * (x - mu(x)) / sigma(x) + b is not linear in x, but with sigma taken from
    the sum x = e + p it splits exactly, because the mean is linear:
        (x - mu(x)) / sigma = (e - mu(e)) / sigma + (p - mu(p)) / sigma.
    So e' = g (e - mu(e)) / sigma, p' = g (p - mu(p)) / sigma, b' = b, and
    e' + p' + b' == LN(e + p). Each part is centred and shares the sum's 1/sigma,
    the standard convention for attributing through LayerNorm. e, p (..., D).
    """
    e, p = _f64(e), _f64(p)
    x = e + p
    sigma = (x.var(dim=-1, correction=0, keepdim=True) + eps).sqrt()
    g = _f64(ln_weight)
    e_part = g * (e - e.mean(dim=-1, keepdim=True)) / sigma
    p_part = g * (p - p.mean(dim=-1, keepdim=True)) / sigma
    b_part = (_f64(ln_bias) if ln_bias is not None else torch.zeros_like(g)).expand_as(x)
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


def first_layer_terms(model, idx: Tensor) -> tuple[dict[str, Tensor], Tensor | None]:
    """sequence_terms of block 0's self-attention on token blocks idx (B, T): (B, n_heads, T, T) per term.

    model: a LanguageModel with an additive PE (``input_stack``, ``blocks`` as in
    model/transformer.py). x = s * e + p enters block 0 (s the embedding scale); with
    pre-LN the attention reads LN(x); with post-LN it reads x. Also returns the (T, T)
    mask of keys a query may see (None when not causal).
    """
    stack, block = model.input_stack, model.blocks[0]
    attn = block.attn

    def packed(W: Tensor) -> Tensor:  # per-head (n_heads, D, d_head) -> (D, n_heads * d_head), as x @ W uses it
        return W.transpose(0, 1).reshape(W.shape[1], -1)

    T = idx.shape[1]
    norm = (block.ln_attn.weight, block.ln_attn.bias, block.ln_attn.eps) if block.norm == "pre" else None
    terms = sequence_terms(stack.embedding(idx), stack.pe.input_term(T), packed(attn.W_Q), packed(attn.W_K),
                           attn.b_Q.reshape(-1), attn.b_K.reshape(-1), n_heads=attn.n_heads, norm=norm)
    mask = torch.ones(T, T, dtype=torch.bool).tril() if stack.causal else None
    return terms, mask


def first_layer_attention_split(model, idx: Tensor) -> dict[str, Tensor]:
    """Per-head term_shares of block 0's scores on token blocks idx (B, T), pooled over sequences.

    (n_heads,) tensors for each of TERMS and ``positional``; see first_layer_terms.
    Pooled = variance-weighted over the B sequences, not a mean of per-sequence ratios.
    """
    return term_shares(*first_layer_terms(model, idx))
