"""Multi-head attention with two interchangeable kernels, and the variants modern models use.

``ExplicitAttention`` writes softmax(QK^T / sqrt(d_head) + bias) V out by hand and
can keep the attention weights for analysis; ``SDPAttention`` hands the same
tensors to ``torch.nn.functional.scaled_dot_product_attention``. Both share the
projections, so with the same weights they give the same outputs.

Four keys of the ``attention`` config group change the design, not the kernel (each off by default, and off
means the numbers of plain multi-head attention):

- ``n_kv_heads`` (grouped-query attention; 1 = multi-query, Shazeer 2019; Ainslie et al. 2023): the key/value
  projection makes ``n_kv_heads`` heads, query head h reads key/value head h // (n_heads / n_kv_heads). The
  cache keeps only the shared heads;
- ``qk_norm`` (Henry et al. 2020, x-transformers' ``qk_norm``): q and k of each head are l2-normalised and the
  logit is a learned per-head temperature times their cosine, tau_h cos(q, k), tau starting at ``qk_norm_scale``.
  The norm comes first and the positional hooks after it (norm, then rotate): a rotation keeps the norm, so
  RoPE's q.k still depends on positions only through their difference, and the magnitudes an encoding puts on
  q and k on purpose (xPos's decay, YaRN's attention factor) reach the logits instead of being normalised away;
- ``window`` (sliding-window attention, Beltagy et al. 2020; Mistral): a causal query at position i sees the keys
  in (i - window, i]; a bidirectional one those with |i - j| < window. Both kernels mask; the cache keeps only
  the last window - 1 keys between calls (with the new token's own key, the window of keys a query sees);
- ``logn_scaling`` (log-length scaling, Chiang and Cholak 2022; Qwen's logn-attn): the logits of a query that sees
  n positions (causal: n = its position + 1; bidirectional: the sequence length) are multiplied by
  max(1, log n / log ``training_length``), so past the training length the softmax keeps the entropy it had.

``window`` and ``logn_scaling`` act on self-attention only: a cross-attention's queries and keys come from two
sequences whose positions are unrelated. ``n_kv_heads`` and ``qk_norm`` apply to both.

``KVCache`` holds the keys and values already computed during incremental decoding,
so each new token costs one query against the cache instead of a full forward pass.

A data-dependent score bias (the Forgetting Transformer, model/forgetting.py) reads the layer's own input, so it has
three more hooks besides ``positional.py``'s four (no-ops on its base class, which FoX overrides): ``layer_module()`` once per
self-attention (the layer keeps what it returns as ``pe_layer``: its own gate weights), ``input_gates(x, pe_layer)``
(B, H, T) per-token values of the layer input x (kept beside the keys in a ``KVCache``), and
``gate_bias(gates, T, causal)`` the (B, H, T, S) term they give the T queries over the S keys they see, added to the
score bias.

Hook points (as TransformerLens names them): while a self-attention's ``recording`` is a dict (set by
``model.transformer.record_attention``), each forward call stores there, detached, what it computed (the last call's):
``q_pre`` / ``k_pre`` the projections before the encoding's hooks (under ``qk_norm``, normalised and scaled),
``q`` / ``k`` after them (RoPE's, xPos's rotation; ``k`` with the cached keys: every key the queries read, of the
shared heads under grouped-query attention), ``score_bias`` what the encoding adds to the scores (ALiBi, T5, FIRE,
Kerple, CoPE's contextual one, FoX's gate bias; None without), ``query_scale`` ``logn_scaling``'s factor per query (T, 1) (None when
all are 1) and ``logits`` the pre-softmax scores after the mask (-inf where a key is hidden):
(q . k / sqrt(d_head) + score_bias) x query_scale. Only the points among ``recording``'s keys are stored. The fused
kernel never forms the logits: recording them computes them explicitly, only then. Off (None, the default) it costs
one attribute test per call.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pe_geometry.model.positional import PositionalEncoding
from pe_geometry.settings import Sizes
from pe_geometry.settings.attention import AttentionSettings


class KVCache:
    """Keys and values of the tokens a decoder has already read, for incremental decoding.

    One cache belongs to one generation: pass the same object to every forward call.
    Self-attention layers append the new tokens' keys (already rotated, for RoPE) and
    values, of the shared key/value heads only under grouped-query attention (B, n_kv_heads, S, d_head);
    with a ``window`` they keep only the last window - 1. Cross-attention layers compute their context's
    keys and values on the first call and reuse them. ``length`` is the number of tokens read so far,
    which is also the absolute position of the next one (whatever a window dropped); the model
    advances it after each call.

    Each self-attention layer writes into a preallocated buffer (``capacity`` tokens, e.g. prompt + new tokens
    when a generation knows its length; doubled when a call outgrows it), so a step copies only its new keys
    instead of the whole cache, as ``torch.cat`` would. A window's keys move to the front of a new buffer when the
    buffer's end is reached (a new one, so views handed out earlier stay valid). ``get`` returns views of the live
    keys and values. A data-dependent encoding's per-token values (FoX's log forget gates) are kept the same way
    beside the keys (``append_gates``), so a cached step's bias is the full pass's.
    """

    def __init__(self, capacity: int | None = None) -> None:
        self.length = 0
        self.capacity = capacity
        self.context: Tensor | None = None  # the encoder output, for an encoder-decoder
        self._layers: dict[nn.Module, tuple[Tensor, Tensor]] = {}  # cross-attention: the context's k, v
        # self-attention: [k buffer, v buffer, first live, end]; under (layer, "gates"): [gates buffer, first live, end]
        self._buffers: dict[object, list] = {}

    def get(self, layer: nn.Module) -> tuple[Tensor, Tensor] | None:
        """The layer's cached (k, v): views (B, n_kv_heads, held, d_head), or None before its first call."""
        if layer in self._buffers:
            k, v, first, end = self._buffers[layer]
            return k[:, :, first:end], v[:, :, first:end]
        return self._layers.get(layer)

    def put(self, layer: nn.Module, k: Tensor, v: Tensor) -> None:
        """Keep (k, v) as they are (a cross-attention's context keys)."""
        self._layers[layer] = (k, v)

    def append(self, layer: nn.Module, k: Tensor, v: Tensor, keep: int | None = None) -> tuple[Tensor, Tensor]:
        """Add the new tokens' (k, v) (B, n_kv_heads, T, d_head) after the layer's cached ones; returns views of
        all of them (what this call's queries attend to), then keeps only the last ``keep`` for the next call."""
        k, v = self._append(layer, (k, v), keep)
        return k, v

    def append_gates(self, layer: nn.Module, gates: Tensor, keep: int | None = None) -> Tensor:
        """The same for a data-dependent encoding's per-token values (B, H, T) (its ``input_gates``: FoX's log forget
        gates), kept beside the layer's keys with the same ``keep``: returns those of every key the queries see."""
        (gates,) = self._append((layer, "gates"), (gates,), keep)
        return gates

    def _append(self, owner: object, new: tuple[Tensor, ...], keep: int | None) -> tuple[Tensor, ...]:
        """Write ``new`` (tensors (B, heads, T, ...) of the same T) after ``owner``'s live entries, each in its own
        buffer along dim 2; returns views of all of them, then keeps only the last ``keep`` live."""
        T = new[0].shape[2]
        if owner not in self._buffers:
            self._buffers[owner] = [*(_empty_like(t, max(T, self.capacity or 0)) for t in new), 0, 0]
        entry = self._buffers[owner]
        *buffers, first, end = entry
        held = end - first
        if end + T > buffers[0].shape[2]:  # no room after the live keys: move them to the front of a new buffer, with
            size = max(buffers[0].shape[2], 2 * (held + T))  # room for as many again (a window moves once per window)
            moved = [_empty_like(b, size) for b in buffers]
            for to, old in zip(moved, buffers):
                to[:, :, :held] = old[:, :, first:end]
            buffers, first, end = moved, 0, held
        for buffer, t in zip(buffers, new):
            buffer[:, :, end : end + T] = t
        end += T
        seen = tuple(b[:, :, first:end] for b in buffers)
        first = end - min(end - first, keep if keep is not None else end)
        entry[:] = [*buffers, first, end]
        return seen


def _empty_like(t: Tensor, size: int) -> Tensor:
    """An uninitialised buffer of t's dtype and device, (B, heads, size, ...) for t (B, heads, T, ...)."""
    return t.new_empty(*t.shape[:2], size, *t.shape[3:])


def causal_mask(q_len: int, k_len: int, device: torch.device) -> Tensor:
    """Boolean (Tq, Tk) mask, True where query i may attend to key j.

    The queries are the last ``q_len`` of the ``k_len`` positions (a cache holds the
    earlier ones), so query i sits at position ``k_len - q_len + i`` and sees j up to it.
    """
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len)


def attention_mask(
    q_len: int, k_len: int, causal: bool, window: int | None = None, device: torch.device | None = None
) -> Tensor | None:
    """Boolean (Tq, Tk) mask, True where query i may attend to key j; None when every query sees every key.

    Causal: the queries are the last ``q_len`` of the ``k_len`` keys (as in ``causal_mask``), and with a ``window``
    query i sees the keys j with 0 <= i - j < window. Bidirectional (q_len == k_len): |i - j| < window.
    """
    if causal:
        if q_len == 1 and (window is None or window >= k_len):  # the newest position sees every key
            return None
        if window is None:
            return causal_mask(q_len, k_len, device)
    elif window is None or window >= max(q_len, k_len):
        return None
    i = torch.arange(k_len - q_len if causal else 0, k_len if causal else q_len, device=device)[:, None]
    distance = i - torch.arange(k_len, device=device)[None, :]  # (Tq, Tk): query position - key position
    inside = distance.abs() < window
    return inside & (distance >= 0) if causal else inside


class MultiHeadAttention(nn.Module):
    """Projections and head reshaping; subclasses implement ``attend``.

    Self-attention applies the positional hooks (``rotate_qk``, ``score_bias``, ``qk_bias``, and a data-dependent
    encoding's ``input_gates`` / ``gate_bias`` with its own ``pe_layer``);
    cross-attention (``context`` given) does not: the two sequences' positions
    are unrelated, as in the original encoder-decoder. The variants (``n_kv_heads``, ``qk_norm``,
    ``window``, ``logn_scaling``) are described in the module docstring.
    """

    recording: dict[str, Tensor | None] | None = None  # the hook points' values while recorded (module docstring)

    Settings = AttentionSettings

    def __init__(self, d_model: int, n_heads: int, pe: PositionalEncoding | None = None, dropout: float = 0.0,
                 **settings: Any) -> None:
        """``pe`` and ``dropout`` are the model's (passed by its blocks); ``settings``: ``AttentionSettings``'s keys."""
        super().__init__()
        s = self.settings = self.Settings(**settings)  # each value's type and range, one line per bad one
        s.check(Sizes(d_model, n_heads))
        self.n_heads, self.d_head = n_heads, d_model // n_heads
        self.n_kv_heads = n_heads if s.n_kv_heads is None else s.n_kv_heads
        self.q = nn.Linear(d_model, d_model)
        self.kv = nn.Linear(d_model, 2 * self.n_kv_heads * self.d_head)
        self.o = nn.Linear(d_model, d_model)
        self.pe = pe if pe is not None else PositionalEncoding(d_model, n_heads)
        self.dropout = dropout
        self.qk_norm = s.qk_norm
        # tau_h: the logit of a query and a key pointing the same way (a 1-d parameter: no weight decay)
        self.qk_temperature = nn.Parameter(torch.full((n_heads,), float(s.qk_norm_scale))) if s.qk_norm else None
        self.window, self.logn_scaling, self.training_length = s.window, s.logn_scaling, s.training_length
        # a data-dependent encoding's weights for this layer (FoX's forget gate: module docstring), owned here so that
        # every layer has its own; None for every other encoding and for a cross-attention
        self.pe_layer = self.pe.layer_module()

    @classmethod
    def check_settings(cls, d_model: int, n_heads: int, seq_len: int, **settings: Any) -> None:
        """``SettingsError`` (one line naming the config key) for settings that cannot work with these sizes."""
        cls.Settings(**settings).check(Sizes(d_model, n_heads, seq_len))

    @classmethod
    def settings_warnings(cls, d_model: int, n_heads: int, seq_len: int, precision: str = "32-true",
                          **settings: Any) -> list[str]:
        """Lines to warn with (one each) when a setting works but does not fit this run."""
        return cls.Settings(**settings).warnings(Sizes(d_model, n_heads, seq_len), precision)

    # Per-head weights by plain names, in TransformerLens shapes (views of the packed nn.Linear weights, which
    # compute x @ weight.T): head h's query is x @ W_Q[h] + b_Q[h], and its output adds z_h @ W_O[h] (+ b_O once).
    # W_K, W_V, b_K, b_V are per *query* head, as TransformerLens gives grouped-query attention: head h's key is
    # x @ W_K[h] + b_K[h], the shared key/value head h // (n_heads / n_kv_heads) repeated for each query head of its
    # group (then a copy, not a view; the shared weights themselves are the rows of ``kv``).
    def _heads_in(self, weight: Tensor, n_heads: int) -> Tensor:  # (n * d_head, d_model) -> (n, d_model, d_head)
        return weight.view(n_heads, self.d_head, -1).transpose(1, 2)

    @property
    def n_groups(self) -> int:
        """Query heads per key/value head: 1 for plain multi-head attention, n_heads for multi-query."""
        return self.n_heads // self.n_kv_heads

    def _per_query_head(self, t: Tensor, dim: int = 0) -> Tensor:
        """A tensor over the key/value heads (along ``dim``) -> over the query heads: each shared head repeated for
        the query heads of its group (itself, not a copy, without grouping)."""
        return t if self.n_groups == 1 else t.repeat_interleave(self.n_groups, dim=dim)

    @property
    def W_Q(self) -> Tensor:
        """(n_heads, d_model, d_head)"""
        return self._heads_in(self.q.weight, self.n_heads)

    @property
    def W_K(self) -> Tensor:
        """(n_heads, d_model, d_head): per query head (see above)"""
        return self._per_query_head(self._heads_in(self.kv.weight[: self.n_kv_heads * self.d_head], self.n_kv_heads))

    @property
    def W_V(self) -> Tensor:
        """(n_heads, d_model, d_head): per query head (see above)"""
        return self._per_query_head(self._heads_in(self.kv.weight[self.n_kv_heads * self.d_head :], self.n_kv_heads))

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
        """(n_heads, d_head): per query head (see above)"""
        return self._per_query_head(self.kv.bias[: self.n_kv_heads * self.d_head].view(self.n_kv_heads, self.d_head))

    @property
    def b_V(self) -> Tensor:
        """(n_heads, d_head): per query head (see above)"""
        return self._per_query_head(self.kv.bias[self.n_kv_heads * self.d_head :].view(self.n_kv_heads, self.d_head))

    @property
    def b_O(self) -> Tensor:
        """(d_model,)"""
        return self.o.bias

    def _queries(self, x: Tensor) -> Tensor:
        """x (B, T, D) -> q (B, H, T, dh). Under ``qk_norm``: unit length times tau_h sqrt(d_head), so that the
        kernels' q.k / sqrt(d_head) is tau_h cos(q, k) and every hook (CoPE's gates too) reads the real logits."""
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.n_heads, self.d_head).transpose(1, 2)
        if self.qk_norm:
            scale = self.qk_temperature * math.sqrt(self.d_head)  # (H,)
            q = F.normalize(q, dim=-1) * scale.to(q.dtype)[:, None, None]
        return q

    def _keys_values(self, source: Tensor) -> tuple[Tensor, Tensor]:
        """source (B, S, D) -> k, v (B, n_kv_heads, S, dh) each; k of unit length under ``qk_norm``."""
        B, S, _ = source.shape
        k, v = self.kv(source).view(B, S, 2, self.n_kv_heads, self.d_head).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        return (F.normalize(k, dim=-1) if self.qk_norm else k), v

    def _logn_factor(self, q_len: int, start: int, causal: bool, device: torch.device) -> Tensor | None:
        """(Tq, 1) float32: what ``logn_scaling`` multiplies each query's logits by, or None where all are 1.

        A query sees n positions: its own position + 1 when causal (the queries are ``start ..``), the whole
        sequence when not; factor = max(1, log n / log training_length)."""
        if not self.logn_scaling:
            return None
        longest = start + q_len
        if longest <= self.training_length:
            return None
        if causal:
            n = torch.arange(start + 1, longest + 1, device=device, dtype=torch.float32)
        else:
            n = torch.full((q_len,), float(longest), device=device)
        return (n.log() / math.log(self.training_length)).clamp(min=1.0)[:, None]

    def _contextual_bias(self, q: Tensor, k: Tensor, start: int, causal: bool) -> Tensor | None:
        """The encoding's ``qk_bias`` (CoPE), given keys per query head; skipped without one (so a grouped
        attention does not copy its keys for nothing)."""
        if self.n_groups > 1 and type(self.pe).qk_bias is PositionalEncoding.qk_bias:
            return None
        return self.pe.qk_bias(q, self._per_query_head(k, dim=1), start, causal)

    def _input_gates(self, x: Tensor) -> Tensor | None:
        """The encoding's per-token values (B, H, T) read from this layer's input x (B, T, D) with its ``pe_layer``
        (FoX's log forget gates), or None (every other encoding: the base class's no-op)."""
        return self.pe.input_gates(x, self.pe_layer)

    def _hook(self, **points: Tensor | None) -> None:
        """Store the named hook points (detached) in ``recording``: those among its keys (the points asked for)."""
        for name, t in points.items():
            if name in self.recording:
                self.recording[name] = None if t is None else t.detach()

    def logits(
        self, q: Tensor, k: Tensor, bias: Tensor | None, causal: bool, window: int | None = None
    ) -> Tensor:
        """The scores ``attend`` softmaxes, (B, H, T, S): q . k / sqrt(d_head) + bias, -inf where the mask hides a key
        (arguments as ``attend``'s; keys per key/value head)."""
        scores = q @ self._per_query_head(k, dim=1).transpose(-2, -1) / math.sqrt(self.d_head)  # (B, H, T, S)
        if bias is not None:
            scores = scores + bias.to(scores.dtype)  # a float32 bias would promote bf16 scores (and then fail on v)
        mask = attention_mask(*scores.shape[-2:], causal, window, scores.device)
        return scores if mask is None else scores.masked_fill(~mask, float("-inf"))

    def forward(
        self, x: Tensor, context: Tensor | None = None, causal: bool = False, cache: KVCache | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        """x (B, T, D) -> (B, T, D). With ``cache``, x holds only the tokens after ``cache.length``. ``positions``
        (B, T): where each sequence's tokens sit (randomised positions, a full pass), handed to the encoding's hooks."""
        if positions is not None and (cache is not None or context is not None):
            raise ValueError("drawn positions are for a full self-attention pass, not a cached or cross-attention one")
        at = {} if positions is None else {"positions": positions}  # only encodings that take them are handed them
        B, T, C = x.shape
        q = self._queries(x)  # (B, H, T, dh)
        bias, window = None, None
        if context is not None:  # cross-attention: the context's keys and values never change
            past = cache.get(self) if cache is not None else None
            k, v = past if past is not None else self._keys_values(context)
            if cache is not None:
                cache.put(self, k, v)
        else:
            start = cache.length if cache is not None else 0
            k, v = self._keys_values(x)  # (B, Hkv, T, dh)
            q_pre, k_pre = q, k
            q, k = self.pe.rotate_qk(q, k, start, **at)
            gates = self._input_gates(x)  # (B, H, T) float32 or None: FoX's log forget gates
            window = self.window
            if cache is not None:  # the cached keys and these, (B, Hkv, S, dh); the next query sees its own and window - 1
                keep = None if window is None else window - 1
                k, v = cache.append(self, k, v, keep=keep)
                if gates is not None:  # those of every key the queries see, (B, H, S)
                    gates = cache.append_gates(self, gates, keep=keep)
            S = k.shape[2]
            first = start + T - S  # the first key's position: > 0 once a window has dropped the oldest keys
            bias = self.pe.score_bias(T, start + T, start, **at)  # (H, T, start + T), (B, H, T, T) or None
            if bias is not None and first:
                bias = bias[..., first:]
            contextual = self._contextual_bias(q, k, start, causal)  # (B, H, T, S) or None: CoPE
            if gates is not None:  # FoX: the decay the gates of the keys up to each query sum to, (B, H, T, S)
                gated = self.pe.gate_bias(gates, T, causal)
                contextual = gated if contextual is None else contextual + gated
            if contextual is not None:
                bias = contextual if bias is None else bias + contextual
            factor = self._logn_factor(T, start, causal, x.device)
            if self.recording is not None:
                self._hook(q_pre=q_pre, k_pre=k_pre, q=q, k=k, score_bias=bias, query_scale=factor)
            if factor is not None:  # the whole logit, q.k / sqrt(d_head) + bias, times the query's factor
                q = q * factor.to(q.dtype)
                bias = None if bias is None else bias * factor.to(bias.dtype)
        y = self.attend(q, k, v, bias, causal, window)  # (B, H, T, dh)
        return self.o(y.transpose(1, 2).reshape(B, T, C))

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, causal: bool, window: int | None = None
    ) -> Tensor:
        """q (B, H, T, dh), k and v (B, n_kv_heads, S, dh), bias (H or B x H, T, S) or None -> (B, H, T, dh).

        The queries are the last T of the S key positions; ``attention_mask`` says which keys each may see."""
        raise NotImplementedError("use ExplicitAttention or SDPAttention")

    def visible_keys_mask(self, seq_len: int, causal: bool, device: torch.device | None = None) -> Tensor:
        """For analysis: (T, T) bool, True where this self-attention lets query i see key j in a full pass over
        ``seq_len`` tokens (the causal mask, the window's band, both, or all True)."""
        mask = attention_mask(seq_len, seq_len, causal, self.window, device)
        return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device) if mask is None else mask


class ExplicitAttention(MultiHeadAttention):
    """The readable path. Set ``keep_weights = True`` to store ``attn_weights`` (B, H, T, S)."""

    keep_weights: bool = False
    attn_weights: Tensor | None = None

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, causal: bool, window: int | None = None
    ) -> Tensor:
        scores = self.logits(q, k, bias, causal, window)  # (B, H, T, S), keys per query head (grouped: copies)
        if self.recording is not None:
            self._hook(logits=scores)
        weights = scores.softmax(dim=-1)
        if self.keep_weights:
            self.attn_weights = weights.detach()
        weights = F.dropout(weights, self.dropout, self.training)
        return weights @ self._per_query_head(v, dim=1)


class SDPAttention(MultiHeadAttention):
    """The fast path: torch's fused ``scaled_dot_product_attention``.

    Grouped keys and values are never copied per query head where no mask is needed (a decoding step's single
    query, or a bidirectional pass without a window): each key/value head's group of query heads is folded into
    its query axis, (B, H, T, dh) -> (B, n_kv_heads, groups x T, dh), which is plain attention over the shared
    keys (a bias folds the same way). The causal full pass hands the shared heads to flash as they are
    (``enable_gqa``). With a mask they are repeated per query head first, because with ``enable_gqa`` and a mask
    SDPA falls back to its math kernel (the (B, H, T, S) scores in float32) instead of the memory-efficient one.
    """

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, causal: bool, window: int | None = None
    ) -> Tensor:
        if self.recording is not None and "logits" in self.recording:  # the fused kernel never forms them: written
            self._hook(logits=self.logits(q, k, bias, causal, window))
        dropout = self.dropout if self.training else 0.0
        T, S = q.shape[-2], k.shape[-2]
        grouped = self.n_groups > 1
        if bias is None and causal and T == S > 1 and (window is None or window >= T):
            # is_causal aligns the mask top-left, which is bottom-right only when T == S (no cache)
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, enable_gqa=grouped)
        mask = attention_mask(T, S, causal, window, q.device)
        if mask is None:  # every query sees every key: a decoding step, or bidirectional without a window
            if grouped:
                return self._folded(q, k, v, bias, dropout)
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=None if bias is None else bias.to(q.dtype), dropout_p=dropout)
        k, v = self._per_query_head(k, dim=1), self._per_query_head(v, dim=1)
        if bias is None:  # a cached chunk (the mask aligned bottom-right) or a window
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        # SDPA takes one mask: fold the causal/window mask into the additive bias
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias.masked_fill(~mask, float("-inf")).to(q.dtype), dropout_p=dropout)

    def _folded(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, dropout: float) -> Tensor:
        """Unmasked grouped attention without copying k and v: query head h = kv head * groups + g, so the heads of
        one group are consecutive and fold into the query axis; q (B, H, T, dh) -> (B, n_kv_heads, groups x T, dh)."""
        B, H, T, dh = q.shape
        folded = q.reshape(B, self.n_kv_heads, self.n_groups * T, dh)
        if bias is not None:  # (H or B x H, T, S) -> (n_kv_heads or B x n_kv_heads, groups x T, S)
            bias = bias.reshape(*bias.shape[:-3], self.n_kv_heads, self.n_groups * T, bias.shape[-1]).to(q.dtype)
        y = F.scaled_dot_product_attention(folded, k, v, attn_mask=bias, dropout_p=dropout)
        return y.view(B, H, T, dh)
