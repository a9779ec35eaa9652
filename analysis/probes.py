"""What the measures are taken on, one rule each for the trained models and the pretrained checkpoint.

- ``frequent_token_ids``: the word rows, i.e. the most frequent tokens of a token stream;
- ``first_layer_attention_split``: block 0 attention scores split into word/position terms,
  per-head variance shares (``analysis.geometry.attention_terms`` / ``attention_term_shares``);
- ``model_first_layer_attention_split``: the same for a model of this framework, read through
  its plain weight names.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from analysis import geometry as geo
from model.transformer import LanguageModel


def frequent_token_ids(stream: np.ndarray | Sequence[int], vocab_size: int, n: int, exclude: Sequence[int]) -> tuple[Tensor, Tensor]:
    """The ``n`` most frequent token ids of a stream and their counts, most frequent first.

    Ids in ``exclude`` (special tokens) and ids that never occur are left out; ties go to the lower id.
    """
    counts = np.bincount(np.asarray(stream, dtype=np.int64), minlength=vocab_size)[:vocab_size].astype(np.int64)
    counts[list(exclude)] = 0
    order = np.argsort(-counts, kind="stable")[:n]
    order = order[counts[order] > 0]
    return torch.from_numpy(order), torch.from_numpy(counts[order])


def _packed(W: Tensor) -> Tensor:
    """(n_heads, d_model, d_head) per-head weights -> (d_model, n_heads * d_head), as x @ W uses them."""
    return W.transpose(0, 1).reshape(W.shape[1], -1)


def first_layer_attention_split(
    word: Tensor,
    position: Tensor,
    W_q: Tensor,
    W_k: Tensor,
    b_q: Tensor,
    b_k: Tensor,
    *,
    n_heads: int,
    norm: tuple[Tensor, Tensor, float] | None = None,
    causal: bool = False,
    real_scores: Tensor | None = None,
) -> tuple[dict[str, Tensor], float]:
    """Per-head share of block 0 score variance from word_word / pos_pos / word_pos / pos_word / bias.

    word (B, T, D): the word part of block 0's input, per sequence; position (T, D): the position part.
    W_q, W_k (D, n_heads * d_head) as ``x @ W`` uses them; b_q, b_k (n_heads * d_head,).
    norm = (weight, bias, eps) of the LayerNorm the attention reads its input through (pre-LN blocks,
    or BERT's embedding LayerNorm), None when it reads x directly. The norm is split exactly into word,
    position and constant parts (``geometry.split_layernorm``); the constant is folded into the q/k
    biases. Causal models count only the keys a query may see.

    Returns the shares (n_heads,) averaged over the B sequences, each in [0, 1] unless terms cancel
    (they sum to 1 per head), and the largest |sum of terms - real score| when ``real_scores``
    (B, n_heads, T, T) is given (else 0.0).
    """
    T = position.shape[0]
    mask = torch.ones(T, T, dtype=torch.bool).tril() if causal else None
    W_q, W_k, b_q, b_k = W_q.double(), W_k.double(), b_q.double(), b_k.double()
    totals: dict[str, Tensor] = {}
    max_err = 0.0
    for i, e in enumerate(word):
        if norm is not None:
            e_part, p_part, b_ln = geo.split_layernorm(e, position, *norm)
            bq, bk = b_q + b_ln[0] @ W_q, b_k + b_ln[0] @ W_k
        else:
            e_part, p_part, bq, bk = e.double(), position.double(), b_q, b_k
        terms = geo.attention_terms(e_part, p_part, W_q, W_k, bq, bk, n_heads=n_heads)
        if real_scores is not None:
            max_err = max(max_err, (sum(terms.values()) - real_scores[i]).abs().max().item())
        for name, value in geo.attention_term_shares(terms, mask).items():
            totals[name] = totals.get(name, 0) + value / len(word)
    return totals, max_err


def model_first_layer_attention_split(model: LanguageModel, idx: Tensor) -> dict[str, Tensor]:
    """``first_layer_attention_split`` of a model with an additive position table, on token ids idx (B, T).

    Block 0 reads x = s * e + p. With pre-LN its attention reads LN(x); with post-LN it reads x.
    """
    stack, block = model.input_stack, model.blocks[0]
    attn = block.attn
    position = stack.pe.input_term(idx.shape[1])
    norm = (block.ln_attn.weight, block.ln_attn.bias, block.ln_attn.eps) if block.norm == "pre" else None
    shares, _ = first_layer_attention_split(
        stack.embedding(idx), position, _packed(attn.W_Q), _packed(attn.W_K), attn.b_Q.reshape(-1), attn.b_K.reshape(-1),
        n_heads=attn.n_heads, norm=norm, causal=stack.causal,
    )
    return shares
