"""Positional encodings behind one small interface.

Positional schemes differ in *where* they act, so every encoding implements
three hooks and the model calls all three without knowing which one it has:

- ``input_term(seq_len)``: a (T, D) tensor added to the token embeddings, or None
  (sinusoidal, learned);
- ``rotate_qk(q, k)``: a transform of queries and keys inside attention (RoPE);
- ``score_bias(q_len, k_len)``: an (H, Tq, Tk) tensor added to attention scores,
  or None (ALiBi).

``position_table`` exposes the absolute table when there is one (for analysis).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class PositionalEncoding(nn.Module):
    """Base class: a no-op in every hook. Subclasses override what they use."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.d_model = d_model
        self.n_heads = n_heads

    @classmethod
    def check_settings(cls, d_model: int, n_heads: int, seq_len: int, **settings) -> None:
        """Raise ValueError (one line naming the config keys) if this encoding cannot work with these sizes.

        ``settings`` are the encoding's own config keys (``max_len``, ``base``, ...); the base accepts anything.
        """

    def input_term(self, seq_len: int) -> Tensor | None:
        return None

    def rotate_qk(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        return q, k

    def score_bias(self, q_len: int, k_len: int) -> Tensor | None:
        return None

    @property
    def position_table(self) -> Tensor | None:
        """The (max_len, D) table added to the input, if this encoding has one."""
        return None


class NoPE(PositionalEncoding):
    """No positional information at all (Kazemnejad et al. 2023)."""


def sinusoidal_table(n_positions: int, d_model: int) -> Tensor:
    """PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(pos / 10000^(2i/d))."""
    if d_model % 2:
        raise ValueError(f"sinusoidal PE needs an even d_model, got d_model={d_model}")
    pos = torch.arange(n_positions, dtype=torch.float64)[:, None]  # (T, 1)
    inv_freq = 10000.0 ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)  # (D/2,)
    angles = pos * inv_freq  # (T, D/2)
    table = torch.empty(n_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles)
    return table.float()


class SinusoidalPE(PositionalEncoding):
    """Fixed sin/cos table of Vaswani et al. (2017), added to the input.

    The table is a non-persistent buffer (it is a formula, not a weight) that
    grows when a longer sequence arrives, so evaluation past ``max_len`` works.
    """

    def __init__(self, d_model: int, n_heads: int, max_len: int = 512) -> None:
        super().__init__(d_model, n_heads)
        self.register_buffer("table", sinusoidal_table(max_len, d_model), persistent=False)

    @classmethod
    def check_settings(cls, d_model: int, n_heads: int, seq_len: int, **settings) -> None:
        if d_model % 2:
            raise ValueError(f"sinusoidal PE needs an even model.d_model (sin/cos pairs), got {d_model}")

    def input_term(self, seq_len: int) -> Tensor:
        if seq_len > self.table.shape[0]:
            self.table = sinusoidal_table(seq_len, self.d_model).to(self.table.device)
        return self.table[:seq_len]

    @property
    def position_table(self) -> Tensor:
        return self.table


class LearnedPE(PositionalEncoding):
    """A trained table of ``max_len`` absolute position vectors (BERT, GPT-2)."""

    def __init__(self, d_model: int, n_heads: int, max_len: int = 512) -> None:
        super().__init__(d_model, n_heads)
        self.max_len = max_len
        self.weight = nn.Parameter(torch.randn(max_len, d_model) * 0.02)

    @classmethod
    def check_settings(cls, d_model: int, n_heads: int, seq_len: int, max_len: int = 512, **settings) -> None:
        if seq_len > max_len:
            raise ValueError(
                f"data.seq_len={seq_len} is longer than the learned position table (pe.max_len={max_len}); "
                "raise pe.max_len or shorten data.seq_len"
            )

    def input_term(self, seq_len: int) -> Tensor:
        if seq_len > self.max_len:
            raise ValueError(
                f"sequence of {seq_len} tokens is longer than the learned position table "
                f"(pe.max_len={self.max_len}); learned PE cannot extrapolate"
            )
        return self.weight[:seq_len]

    @property
    def position_table(self) -> Tensor:
        return self.weight


class RotaryPE(PositionalEncoding):
    """RoPE (Su et al. 2021): rotate each (even, odd) pair of q and k by pos * theta_i.

    Then q_m . k_n depends on positions only through m - n.
    """

    def __init__(self, d_model: int, n_heads: int, base: float = 10000.0) -> None:
        super().__init__(d_model, n_heads)
        self.check_settings(d_model, n_heads, seq_len=0)
        d_head = d_model // n_heads
        inv_freq = base ** (-torch.arange(0, d_head, 2, dtype=torch.float64) / d_head)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self._cache: tuple[int, Tensor, Tensor] | None = None

    @classmethod
    def check_settings(cls, d_model: int, n_heads: int, seq_len: int, **settings) -> None:
        if (d_model // n_heads) % 2:
            raise ValueError(
                f"RoPE needs an even head dimension, got model.d_model/model.n_heads = {d_model}/{n_heads} = {d_model // n_heads}"
            )

    def _cos_sin(self, seq_len: int, device: torch.device) -> tuple[Tensor, Tensor]:
        if self._cache is None or self._cache[0] < seq_len or self._cache[1].device != device:
            pos = torch.arange(seq_len, device=device, dtype=torch.float32)
            angles = torch.outer(pos, self.inv_freq.to(device))  # (T, dh/2)
            self._cache = (seq_len, angles.cos(), angles.sin())
        _, cos, sin = self._cache
        return cos[:seq_len], sin[:seq_len]

    def rotate(self, x: Tensor) -> Tensor:
        """Rotate x (..., T, dh) pairwise by its position."""
        cos, sin = self._cos_sin(x.shape[-2], x.device)
        x_even, x_odd = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
        return rotated.flatten(-2)

    def rotate_qk(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        return self.rotate(q), self.rotate(k)


def alibi_slopes(n_heads: int) -> Tensor:
    """Head slopes of Press et al. (2022): a geometric series 2^(-8/n), 2^(-16/n), ...

    For a head count that is not a power of two, take the slopes of the closest
    lower power of two and fill up with every other slope of the next one (as in
    the paper's reference code).
    """

    def power_of_two_slopes(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = power_of_two_slopes(closest)
    if closest < n_heads:
        slopes += power_of_two_slopes(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes)


class ALiBiPE(PositionalEncoding):
    """ALiBi: add -slope_h * |i - j| to the attention score of query i and key j.

    In a causal model only j <= i survives the mask, which is the paper's form;
    the absolute distance makes the same module usable bidirectionally.
    """

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__(d_model, n_heads)
        self.register_buffer("slopes", alibi_slopes(n_heads), persistent=False)

    def score_bias(self, q_len: int, k_len: int) -> Tensor:
        q_pos = torch.arange(q_len, device=self.slopes.device)[:, None]
        k_pos = torch.arange(k_len, device=self.slopes.device)[None, :]
        distance = (q_pos - k_pos).abs().float()  # (Tq, Tk)
        return -self.slopes[:, None, None] * distance  # (H, Tq, Tk)
