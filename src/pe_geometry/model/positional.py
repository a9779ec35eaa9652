"""Positional encodings behind one small interface.

Positional schemes differ in *where* they act, so every encoding implements
three hooks and the model calls all three without knowing which one it has:

- ``input_term(seq_len)``: a (T, D) tensor added to the token embeddings, or None
  (sinusoidal, learned);
- ``rotate_qk(q, k)``: a transform of queries and keys inside attention (RoPE);
- ``score_bias(q_len, k_len)``: an (H, Tq, Tk) tensor added to attention scores,
  or None (ALiBi).

Each hook takes ``start_pos``, the absolute position of the first token it is
given (0 in a full forward pass). Incremental decoding with a key/value cache
feeds only the new tokens, so they must be placed at their own positions: the
input term of position ``start_pos``, RoPE rotation by ``start_pos + i``, ALiBi
distances from the new queries to all cached keys (which start at position 0).

``position_table`` exposes the absolute table when there is one (for analysis);
``max_positions`` is the longest sequence the encoding can place (None = no limit).
``finish_init(embedding)`` is called once by the model after its own weight init,
with the final word embedding: an encoding whose table depends on the embedding
(a table inside its principal subspace, a table at the word norm) sets it there.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from pe_geometry.model.embedding import INIT_STD, TokenEmbedding

SINUSOIDAL_SCALES = ("none", "word_norm")
LEARNED_INITS = ("normal", "mixed")


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

    def finish_init(self, embedding: TokenEmbedding) -> None:
        """Called once after the model's weight init (E is final, tied or not); the default does nothing."""

    def input_term(self, seq_len: int, start_pos: int = 0) -> Tensor | None:
        return None

    def rotate_qk(self, q: Tensor, k: Tensor, start_pos: int = 0) -> tuple[Tensor, Tensor]:
        return q, k

    def score_bias(self, q_len: int, k_len: int, start_pos: int = 0) -> Tensor | None:
        return None

    @property
    def max_positions(self) -> int | None:
        """The longest sequence this encoding can place, or None when it has no limit."""
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

    Two controls change the table (the defaults leave the formula as it is):
    ``center=True`` subtracts the mean row of the first ``max_len`` rows (a shared
    offset every position adds, which word vectors could also carry);
    ``scale="word_norm"`` multiplies the (centred) table so the mean norm of those rows
    equals the word embedding's expected row norm at init, ``INIT_STD * sqrt(d_model)
    * embedding scale`` (raw rows have norm sqrt(d_model / 2), ~35x a plain embedding row
    at d_model 64). Both are fixed once at init, so rows added later get the same shift and factor.
    """

    def __init__(self, d_model: int, n_heads: int, max_len: int = 512, scale: str = "none", center: bool = False) -> None:
        super().__init__(d_model, n_heads)
        if scale not in SINUSOIDAL_SCALES:
            raise ValueError(f"pe.scale={scale!r}; valid: {list(SINUSOIDAL_SCALES)}")
        self.scale, self.center = scale, center
        raw = sinusoidal_table(max_len, d_model)
        self.register_buffer("offset", raw.mean(0) if center else torch.zeros(d_model), persistent=False)  # (D,)
        self.factor = 1.0  # set by finish_init when scale="word_norm" (it needs the embedding's scale)
        self.register_buffer("table", raw - self.offset, persistent=False)

    @classmethod
    def check_settings(cls, d_model: int, n_heads: int, seq_len: int, scale: str = "none", **settings) -> None:
        if d_model % 2:
            raise ValueError(f"sinusoidal PE needs an even model.d_model (sin/cos pairs), got {d_model}")
        if scale not in SINUSOIDAL_SCALES:
            raise ValueError(f"pe.scale={scale!r}; valid: {list(SINUSOIDAL_SCALES)}")

    def finish_init(self, embedding: TokenEmbedding) -> None:
        if self.scale == "word_norm":
            target = INIT_STD * math.sqrt(self.d_model) * embedding.scale
            self.factor = target / self._make_table(self.table.shape[0], factor=1.0).norm(dim=-1).mean().item()
            self.table = self._make_table(self.table.shape[0])

    def _make_table(self, n_positions: int, factor: float | None = None) -> Tensor:
        """(n_positions, D): the formula, minus the fixed offset, times the fixed factor (both no-ops by default)."""
        table = sinusoidal_table(n_positions, self.d_model).to(self.offset.device) - self.offset
        return table * (self.factor if factor is None else factor)

    def input_term(self, seq_len: int, start_pos: int = 0) -> Tensor:
        end = start_pos + seq_len
        if end > self.table.shape[0]:
            self.table = self._make_table(end)
        return self.table[start_pos:end]

    @property
    def position_table(self) -> Tensor:
        return self.table


class LearnedPE(PositionalEncoding):
    """A trained table of ``max_len`` absolute position vectors (BERT, GPT-2).

    ``init="normal"``: N(0, INIT_STD^2) entries. ``init="mixed"``: the table starts inside the
    word embedding's top-``init_k`` principal subspace, P = C @ V_k * INIT_STD * sqrt(d_model / init_k)
    with C (max_len, k) standard normal and V_k (k, D) the top-k right singular vectors of the
    centred rows of E. Each row then has the normal init's expected squared norm INIT_STD^2 * d_model,
    but no component outside E's top-k directions: a control for whether training separates P from E.
    """

    def __init__(self, d_model: int, n_heads: int, max_len: int = 512, init: str = "normal", init_k: int = 8) -> None:
        super().__init__(d_model, n_heads)
        self.check_settings(d_model, n_heads, seq_len=0, max_len=max_len, init=init, init_k=init_k)
        self.max_len, self.init, self.init_k = max_len, init, init_k
        self.weight = nn.Parameter(torch.randn(max_len, d_model) * INIT_STD)

    @torch.no_grad()
    def finish_init(self, embedding: TokenEmbedding) -> None:
        if self.init != "mixed":
            return
        E = embedding.weight.detach().double()
        _, _, Vh = torch.linalg.svd(E - E.mean(0), full_matrices=False)
        coefficients = torch.randn(self.max_len, self.init_k, dtype=torch.float64, device=E.device)
        mixed = coefficients @ Vh[: self.init_k] * (INIT_STD * math.sqrt(self.d_model / self.init_k))
        self.weight.copy_(mixed.to(self.weight.dtype))

    @classmethod
    def check_settings(
        cls, d_model: int, n_heads: int, seq_len: int, max_len: int = 512, init: str = "normal", init_k: int = 8, **settings
    ) -> None:
        if init not in LEARNED_INITS:
            raise ValueError(f"pe.init={init!r}; valid: {list(LEARNED_INITS)}")
        if not 1 <= init_k <= d_model:
            raise ValueError(f"pe.init_k={init_k} must be between 1 and model.d_model={d_model}")
        if seq_len > max_len:
            raise ValueError(
                f"data.seq_len={seq_len} is longer than the learned position table (pe.max_len={max_len}); "
                "raise pe.max_len or shorten data.seq_len"
            )

    def input_term(self, seq_len: int, start_pos: int = 0) -> Tensor:
        end = start_pos + seq_len
        if end > self.max_len:
            raise ValueError(
                f"sequence of {end} tokens is longer than the learned position table "
                f"(pe.max_len={self.max_len}); learned PE cannot extrapolate"
            )
        return self.weight[start_pos:end]

    @property
    def max_positions(self) -> int:
        return self.max_len

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
        self.base, self.d_head = base, d_head
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
            # Angles in float32 from the base itself: a bf16 model (precision=bf16-true) also casts the
            # inv_freq buffer to bf16, whose 8-bit mantissa would put far positions at the wrong angle.
            inv_freq = self.base ** (-torch.arange(0, self.d_head, 2, device=device, dtype=torch.float64) / self.d_head)
            pos = torch.arange(seq_len, device=device, dtype=torch.float32)
            angles = torch.outer(pos, inv_freq.float())  # (T, dh/2)
            self._cache = (seq_len, angles.cos(), angles.sin())
        _, cos, sin = self._cache
        return cos[:seq_len], sin[:seq_len]

    def rotate(self, x: Tensor, start_pos: int = 0) -> Tensor:
        """Rotate x (..., T, dh) pairwise by its position ``start_pos + t``."""
        cos, sin = (t.to(x.dtype) for t in self._cos_sin(start_pos + x.shape[-2], x.device))  # q, k, v keep one dtype
        cos, sin = cos[start_pos:], sin[start_pos:]
        x_even, x_odd = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
        return rotated.flatten(-2)

    def rotate_qk(self, q: Tensor, k: Tensor, start_pos: int = 0) -> tuple[Tensor, Tensor]:
        return self.rotate(q, start_pos), self.rotate(k, start_pos)


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

    def score_bias(self, q_len: int, k_len: int, start_pos: int = 0) -> Tensor:
        q_pos = torch.arange(start_pos, start_pos + q_len, device=self.slopes.device)[:, None]
        k_pos = torch.arange(k_len, device=self.slopes.device)[None, :]
        distance = (q_pos - k_pos).abs().float()  # (Tq, Tk)
        return -self.slopes.float()[:, None, None] * distance  # (H, Tq, Tk), float32: attention casts it to its scores' dtype
