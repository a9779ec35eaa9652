"""Multi-head attention with two interchangeable kernels.

``ExplicitAttention`` writes softmax(QK^T / sqrt(d_head) + bias) V out by hand and
can keep the attention weights for analysis; ``SDPAttention`` hands the same
tensors to ``torch.nn.functional.scaled_dot_product_attention``. Both share the
projections, so with the same weights they give the same outputs.

``KVCache`` holds the keys and values already computed during incremental decoding,
so each new token costs one query against the cache instead of a full forward pass.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pe_geometry.model.positional import PositionalEncoding


class KVCache:
    """Keys and values of the tokens a decoder has already read, for incremental decoding.

    One cache belongs to one generation: pass the same object to every forward call.
    Self-attention layers append the new tokens' keys (already rotated, for RoPE) and
    values; cross-attention layers compute their context's keys and values on the first
    call and reuse them. ``length`` is the number of tokens read so far, which is also
    the absolute position of the next one; the model advances it after each call.
    """

    def __init__(self) -> None:
        self.length = 0
        self.context: Tensor | None = None  # the encoder output, for an encoder-decoder
        self._layers: dict[nn.Module, tuple[Tensor, Tensor]] = {}

    def get(self, layer: nn.Module) -> tuple[Tensor, Tensor] | None:
        return self._layers.get(layer)

    def put(self, layer: nn.Module, k: Tensor, v: Tensor) -> None:
        self._layers[layer] = (k, v)


class MultiHeadAttention(nn.Module):
    """Projections and head reshaping; subclasses implement ``attend``.

    Self-attention applies the positional hooks (``rotate_qk``, ``score_bias``, ``qk_bias``);
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

    def _keys_values(self, source: Tensor) -> tuple[Tensor, Tensor]:
        B, S, _ = source.shape
        k, v = self.kv(source).view(B, S, 2, self.n_heads, self.d_head).unbind(2)
        return k.transpose(1, 2), v.transpose(1, 2)  # (B, H, S, dh) each

    def forward(
        self, x: Tensor, context: Tensor | None = None, causal: bool = False, cache: KVCache | None = None
    ) -> Tensor:
        """x (B, T, D) -> (B, T, D). With ``cache``, x holds only the tokens after ``cache.length``."""
        B, T, C = x.shape
        q = self.q(x).view(B, T, self.n_heads, self.d_head).transpose(1, 2)  # (B, H, T, dh)
        past = cache.get(self) if cache is not None else None
        bias = None
        if context is not None:  # cross-attention: the context's keys and values never change
            k, v = past if past is not None else self._keys_values(context)
        else:
            start = cache.length if cache is not None else 0
            k, v = self._keys_values(x)
            q, k = self.pe.rotate_qk(q, k, start)
            if past is not None:
                k, v = torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2)  # (B, H, start + T, dh)
            bias = self.pe.score_bias(T, k.shape[2], start)  # (H, T, S) or None
            contextual = self.pe.qk_bias(q, k, start, causal)  # (B, H, T, S) or None: CoPE
            if contextual is not None:
                bias = contextual if bias is None else bias + contextual
        if cache is not None:
            cache.put(self, k, v)
        causal = causal and T > 1  # a single query is the newest position: it may see every key
        y = self.attend(q, k, v, bias, causal)  # (B, H, T, dh)
        return self.o(y.transpose(1, 2).reshape(B, T, C))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, causal: bool) -> Tensor:
        raise NotImplementedError("use ExplicitAttention or SDPAttention")

    def score_parts(self, x: Tensor, causal: bool = False, mix: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """For analysis: this self-attention's scores on x (B, T, D), split as content + position.

        content = q.k / sqrt(d_head) of the projections before any positional hook; position = what the
        encoding adds to it: the change a rotation makes to q.k (RoPE, xPos) plus any score bias (ALiBi, T5,
        FIRE, Kerple, CoPE's contextual one). content + position are the logits ``attend`` reads, before the
        causal mask (both (B, H, T, T) float32; position is 0 for an encoding without hooks). ``mix``
        (H, d_head, d_head), orthogonal: q and k of head h are multiplied by mix[h] before the hooks, which
        keeps every content score and moves the head's q/k energy to other rotation pairs (the rotation null).
        """
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.n_heads, self.d_head).transpose(1, 2)  # (B, H, T, dh)
        k, _ = self._keys_values(x)
        if mix is not None:
            q, k = q @ mix.to(q.dtype), k @ mix.to(k.dtype)
        scale = 1.0 / math.sqrt(self.d_head)
        content = (q @ k.transpose(-2, -1)).float() * scale
        q, k = self.pe.rotate_qk(q, k, 0)
        position = (q @ k.transpose(-2, -1)).float() * scale - content
        for bias in (self.pe.score_bias(T, T, 0), self.pe.qk_bias(q, k, 0, causal)):
            if bias is not None:
                position = position + bias.float()
        return content, position


def causal_mask(q_len: int, k_len: int, device: torch.device) -> Tensor:
    """Boolean (Tq, Tk) mask, True where query i may attend to key j.

    The queries are the last ``q_len`` of the ``k_len`` positions (a cache holds the
    earlier ones), so query i sits at position ``k_len - q_len + i`` and sees j up to it.
    """
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len)


class ExplicitAttention(MultiHeadAttention):
    """The readable path. Set ``keep_weights = True`` to store ``attn_weights`` (B, H, T, S)."""

    keep_weights: bool = False
    attn_weights: Tensor | None = None

    def attend(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, causal: bool) -> Tensor:
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_head)  # (B, H, T, S)
        if bias is not None:
            scores = scores + bias.to(scores.dtype)  # a float32 bias would promote bf16 scores (and then fail on v)
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
        T, S = q.shape[-2], k.shape[-2]
        if bias is None and (T == S or not causal):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=causal)
        if bias is None:  # is_causal aligns the mask top-left; cached queries need it bottom-right
            return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(T, S, q.device), dropout_p=dropout)
        if causal:  # SDPA takes one mask: fold the causal mask into the additive bias
            bias = bias.masked_fill(~causal_mask(T, S, bias.device), float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), dropout_p=dropout)
