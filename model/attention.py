"""Multi-head attention with two interchangeable kernels.

``ExplicitAttention`` writes softmax(QK^T / sqrt(d_head) + bias) V out by hand and
can keep the attention weights for analysis; ``SDPAttention`` hands the same
tensors to ``torch.nn.functional.scaled_dot_product_attention``. Both share the
projections, so with the same weights they give the same outputs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.positional import PositionalEncoding


class MultiHeadAttention(nn.Module):
    """Projections and head reshaping; subclasses implement ``attend``.

    Self-attention applies the positional hooks (``rotate_qk``, ``score_bias``);
    cross-attention (``context`` given) does not: the two sequences' positions
    are unrelated, as in the original encoder-decoder.
    """

    def __init__(
        self, d_model: int, n_heads: int, pe: PositionalEncoding | None = None, dropout: float = 0.0
    ) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.n_heads, self.d_head = n_heads, d_model // n_heads
        self.q = nn.Linear(d_model, d_model)
        self.kv = nn.Linear(d_model, 2 * d_model)
        self.o = nn.Linear(d_model, d_model)
        self.pe = pe if pe is not None else PositionalEncoding(d_model, n_heads)
        self.dropout = dropout

    # Per-head weights by plain names, in TransformerLens shapes (views of the packed nn.Linear weights, which
    # compute x @ weight.T): head h's query is x @ W_Q[h] + b_Q[h], and its output adds z_h @ W_O[h] (+ b_O once).
    def _heads_in(self, weight: Tensor) -> Tensor:  # (n_heads * d_head, d_model) -> (n_heads, d_model, d_head)
        return weight.view(self.n_heads, self.d_head, -1).transpose(1, 2)

    @property
    def W_Q(self) -> Tensor:
        """(n_heads, d_model, d_head)"""
        return self._heads_in(self.q.weight)

    @property
    def W_K(self) -> Tensor:
        """(n_heads, d_model, d_head)"""
        return self._heads_in(self.kv.weight[: self.n_heads * self.d_head])

    @property
    def W_V(self) -> Tensor:
        """(n_heads, d_model, d_head)"""
        return self._heads_in(self.kv.weight[self.n_heads * self.d_head :])

    @property
    def W_O(self) -> Tensor:
        """(n_heads, d_head, d_model)"""
        return self.o.weight.T.view(self.n_heads, self.d_head, -1)

    @property
    def b_Q(self) -> Tensor:
        """(n_heads, d_head)"""
        return self.q.bias.view(self.n_heads, self.d_head)

    @property
    def b_K(self) -> Tensor:
        """(n_heads, d_head)"""
        return self.kv.bias[: self.n_heads * self.d_head].view(self.n_heads, self.d_head)

    @property
    def b_V(self) -> Tensor:
        """(n_heads, d_head)"""
        return self.kv.bias[self.n_heads * self.d_head :].view(self.n_heads, self.d_head)

    @property
    def b_O(self) -> Tensor:
        """(d_model,)"""
        return self.o.bias

    def forward(self, x: Tensor, context: Tensor | None = None, causal: bool = False) -> Tensor:
        B, T, C = x.shape
        source = x if context is None else context
        S = source.shape[1]
        q = self.q(x).view(B, T, self.n_heads, self.d_head).transpose(1, 2)  # (B, H, T, dh)
        k, v = self.kv(source).view(B, S, 2, self.n_heads, self.d_head).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, H, S, dh)
        bias = None
        if context is None:
            q, k = self.pe.rotate_qk(q, k)
            bias = self.pe.score_bias(T, S)  # (H, T, S) or None
        y = self.attend(q, k, v, bias, causal)  # (B, H, T, dh)
        return self.o(y.transpose(1, 2).reshape(B, T, C))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, causal: bool) -> Tensor:
        raise NotImplementedError("use ExplicitAttention or SDPAttention")


def causal_mask(q_len: int, k_len: int, device: torch.device) -> Tensor:
    """Boolean (Tq, Tk) mask, True where query i may attend to key j (j <= i)."""
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril()


class ExplicitAttention(MultiHeadAttention):
    """The readable path. Set ``keep_weights = True`` to store ``attn_weights`` (B, H, T, S)."""

    keep_weights: bool = False
    attn_weights: Tensor | None = None

    def attend(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, causal: bool) -> Tensor:
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_head)  # (B, H, T, S)
        if bias is not None:
            scores = scores + bias
        if causal:
            scores = scores.masked_fill(~causal_mask(*scores.shape[-2:], scores.device), float("-inf"))
        weights = scores.softmax(dim=-1)
        if self.keep_weights:
            self.attn_weights = weights.detach()
        weights = F.dropout(weights, self.dropout, self.training)
        return weights @ v


class SDPAttention(MultiHeadAttention):
    """The fast path: torch's fused ``scaled_dot_product_attention``."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, causal: bool) -> Tensor:
        dropout = self.dropout if self.training else 0.0
        if bias is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=causal)
        if causal:  # SDPA takes one mask: fold the causal mask into the additive bias
            bias = bias.masked_fill(~causal_mask(*bias.shape[-2:], bias.device), float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), dropout_p=dropout)
