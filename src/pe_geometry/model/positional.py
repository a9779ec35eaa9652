"""Positional encodings behind one small interface.

Positional schemes differ in *where* they act, so every encoding implements
four hooks and the model calls all of them without knowing which one it has:

- ``input_term(seq_len)``: a (T, D) tensor added to the token embeddings, or None
  (sinusoidal, learned);
- ``rotate_qk(q, k)``: a transform of queries and keys inside attention (RoPE, xPos);
- ``score_bias(q_len, k_len)``: an (H, Tq, Tk) tensor added to attention scores,
  or None (ALiBi, T5 bias, FIRE, Kerple);
- ``qk_bias(q, k, start_pos, causal)``: a (B, H, Tq, Tk) tensor added to attention scores that
  depends on the queries and keys themselves, or None (CoPE).

The attention scores these act on are the logits the softmax reads, q.k / sqrt(d_head) + bias.

Each hook takes ``start_pos``, the absolute position of the first token it is
given (0 in a full forward pass). Incremental decoding with a key/value cache
feeds only the new tokens, so they must be placed at their own positions: the
input term of position ``start_pos``, RoPE rotation by ``start_pos + i``, ALiBi
distances from the new queries to all cached keys (which start at position 0).

One encoding module belongs to one stack and is shared by all its blocks: a learned bias (T5's
table, FIRE's MLP, Kerple's r1/r2, CoPE's position vectors) is one set of weights per stack, not
one per layer. The stack sets ``causal`` on its encoding after building it (True in a decoder):
an encoding whose form differs by direction (T5's buckets) reads it.

``position_table`` exposes the absolute table when there is one (for analysis);
``max_positions`` is the longest sequence the encoding can place (None = no limit).
``finish_init(embedding)`` is called once by the model after its own weight init,
with the final word embedding: an encoding whose table depends on the embedding
(a table inside its principal subspace, a table at the word norm) sets it there.
Each encoding's settings are a torch-free dataclass (``pe_geometry.settings.positional``), its ``Settings``: the one
source of their defaults, types and ranges, and of the checks that need the model's sizes. The class takes them as
keywords (``RotaryPE(d_model, n_heads, base=500.0)``) and keeps them as ``self.settings``.
Three more hooks, with no-op defaults here, serve an encoding that computes per-token values inside each layer (FoX,
``forgetting.py``): ``layer_module()``, ``input_gates(x, layer)``, ``gate_bias(gates, q_len, causal)``.

Randomised positions (Ruoss et al. 2023), ``randomize_positions=N``: while training, each sequence of a batch reads
its T tokens at a sorted random subset of T distinct positions of [0, N) (``draw_positions``, from torch's global
generator, which a checkpoint saves), so a model trained at length T has seen position ids up to N; in eval mode
(and in cached decoding) the positions are the plain 0 .. T-1. The stack draws them once per forward and hands
them to every hook as ``positions`` (B, T): the input term of each drawn position (B, T, D), RoPE's angle
pos_t * theta_i, and for the score biases the differences of the drawn ids (B, H, T, T). Every family that reads
position ids takes it (its settings' ``takes_position_ids``); NoPE (none) and CoPE (counts of gated keys) refuse it.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pe_geometry.model.embedding import INIT_STD, TokenEmbedding
from pe_geometry.settings import Sizes
from pe_geometry.settings.positional import (  # noqa: F401  (the constants: re-exported for callers of this module)
    LEARNED_INITS,
    MAX_LEARNED_POSITIONS,
    MAX_RANDOMIZED_POSITIONS,
    PARTIAL_ROTARY_STYLES,
    ROPE_SCALINGS,
    SINUSOIDAL_SCALES,
    YARN_RAMPS,
    ALiBiSettings,
    CoPESettings,
    EncodingSettings,
    FireSettings,
    KerpleSettings,
    LearnedSettings,
    NoPESettings,
    RotarySettings,
    RotationSettings,
    SinusoidalSettings,
    T5BiasSettings,
    XPosSettings,
    randomizable_families,
    rotary_dims,
)

# The pe= options whose class reads position ids, so takes ``randomize_positions`` (from each family's settings).
RANDOMIZABLE_FAMILIES = tuple(randomizable_families())


def random_positions(batch_size: int, seq_len: int, n_positions: int, device: torch.device | None = None) -> Tensor:
    """(B, T) long: each row a sorted uniform random subset of T distinct positions of [0, ``n_positions``), drawn
    from torch's global generator (a uniform random permutation of [0, N) per row, its first T kept, sorted)."""
    if seq_len > n_positions:
        raise ValueError(f"a block of {seq_len} tokens cannot take {seq_len} distinct positions of [0, {n_positions}): "
                         f"pe.randomize_positions={n_positions} must be at least data.seq_len")
    order = torch.rand(batch_size, n_positions, device=device).argsort(dim=1)
    return order[:, :seq_len].sort(dim=1).values


class PositionalEncoding(nn.Module):
    """Base class: a no-op in every hook. Subclasses override what they use, and name their settings (``Settings``)."""

    Settings: ClassVar[type[EncodingSettings]] = EncodingSettings
    causal: bool = False  # set by the stack that owns the encoding (a decoder's: True)
    shuffle: bool = False  # True: each sequence reads the input term's rows in its own random order (a control)

    def __init__(self, d_model: int, n_heads: int, **settings: Any) -> None:
        super().__init__()
        self.d_model = d_model
        self.n_heads = n_heads
        self.settings = self.Settings(**settings)  # each value's type and range, one line per bad one
        self.settings.check(Sizes(d_model, n_heads))  # what needs the sizes (the training length is checked by the run)
        self.randomize_positions = self.settings.randomize_positions or None  # N, or None: plain positions

    @classmethod
    def check_settings(cls, d_model: int, n_heads: int, seq_len: int, **settings: Any) -> None:
        """``SettingsError`` (a ValueError, one line naming the config keys) if these settings cannot work with these
        sizes: the settings dataclass's own checks."""
        cls.Settings(**settings).check(Sizes(d_model, n_heads, seq_len))

    def draw_positions(self, batch_size: int, seq_len: int, device: torch.device | None = None) -> Tensor | None:
        """The position ids of a full pass: (B, T) drawn by ``random_positions`` while training with
        ``randomize_positions``, else None (the plain 0 .. T-1, which every hook computes by itself)."""
        if not (self.training and self.randomize_positions):
            return None
        return random_positions(batch_size, seq_len, self.randomize_positions, device)

    @classmethod
    def settings_warnings(cls, d_model: int, n_heads: int, seq_len: int, precision: str = "32-true",
                          **settings: Any) -> list[str]:
        """Lines to warn with (one each) when a setting works but does not fit this run."""
        return cls.Settings(**settings).warnings(Sizes(d_model, n_heads, seq_len), precision)

    def finish_init(self, embedding: TokenEmbedding) -> None:
        """Called once after the model's weight init (E is final, tied or not); the default does nothing."""

    # ``positions`` (B, T) long, given only with randomised positions (a full pass: queries and keys are the same T
    # tokens): where each sequence's tokens sit, instead of start_pos + 0 .. T-1; the term is then per sequence.
    def input_term(self, seq_len: int, start_pos: int = 0, positions: Tensor | None = None) -> Tensor | None:
        """(T, D), or (B, T, D) with ``positions``; None when nothing is added to the input."""
        return None

    def rotate_qk(self, q: Tensor, k: Tensor, start_pos: int = 0, positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return q, k

    def score_bias(self, q_len: int, k_len: int, start_pos: int = 0, positions: Tensor | None = None) -> Tensor | None:
        """(H, Tq, Tk), or (B, H, T, T) with ``positions``; None when no bias is added."""
        return None

    def qk_bias(self, q: Tensor, k: Tensor, start_pos: int = 0, causal: bool = False) -> Tensor | None:
        """A (B, H, Tq, Tk) score term computed from the queries and keys (B, H, T, dh), or None.

        ``causal``: whether the attention masks keys after each query (the queries are then the last Tq
        of the Tk positions, as with a cache)."""
        return None

    def cache_stays_exact(self, n_positions: int) -> bool:
        """Whether keys cached while fewer tokens were read are still what a full pass over ``n_positions``
        tokens computes (False: a decoder must re-encode, see model/sampling.py's ``Decoding``)."""
        return True

    @property
    def max_positions(self) -> int | None:
        """The longest sequence this encoding can place, or None when it has no limit."""
        return None

    @property
    def position_table(self) -> Tensor | None:
        """The (max_len, D) table added to the input, if this encoding has one."""
        return None

    # An encoding that computes per-token values inside each layer (FoX's forget gates, forgetting.py) overrides these.
    def layer_module(self) -> nn.Module | None:
        """A new self-attention layer's own weights (kept by the layer as ``pe_layer``), or None."""
        return None

    def input_gates(self, x: Tensor, layer: nn.Module | None) -> Tensor | None:
        """Per-token values (B, H, T) float32 read from a layer's input x (B, T, D) by its ``pe_layer``, or None."""
        return None

    def gate_bias(self, gates: Tensor, q_len: int, causal: bool) -> Tensor | None:
        """The score term (B, H, Tq, S) the values of ``input_gates`` give the last Tq of S tokens, or None."""
        return None


class NoPE(PositionalEncoding):
    """No positional information at all (Kazemnejad et al. 2023)."""

    Settings = NoPESettings


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

    Settings = SinusoidalSettings

    def __init__(self, d_model: int, n_heads: int, **settings: Any) -> None:
        super().__init__(d_model, n_heads, **settings)
        self.scale, self.center = self.settings.scale, self.settings.center
        raw = sinusoidal_table(self.settings.max_len, d_model)
        self.register_buffer("offset", raw.mean(0) if self.center else torch.zeros(d_model), persistent=False)  # (D,)
        self.factor = 1.0  # set by finish_init when scale="word_norm" (it needs the embedding's scale)
        self.register_buffer("table", raw - self.offset, persistent=False)

    def finish_init(self, embedding: TokenEmbedding) -> None:
        if self.scale == "word_norm":
            target = INIT_STD * math.sqrt(self.d_model) * embedding.scale
            self.factor = target / self._make_table(self.table.shape[0], factor=1.0).norm(dim=-1).mean().item()
            self.table = self._make_table(self.table.shape[0])

    def _make_table(self, n_positions: int, factor: float | None = None) -> Tensor:
        """(n_positions, D): the formula, minus the fixed offset, times the fixed factor (both no-ops by default)."""
        table = sinusoidal_table(n_positions, self.d_model).to(self.offset.device) - self.offset
        return table * (self.factor if factor is None else factor)

    def input_term(self, seq_len: int, start_pos: int = 0, positions: Tensor | None = None) -> Tensor:
        if positions is None:
            end = start_pos + seq_len
        else:  # the rows positions can reach (read from the option where set: a meta-device trace has no values)
            end = self.randomize_positions or int(positions.max()) + 1
        if end > self.table.shape[0]:
            self.table = self._make_table(end)
        return self.table[start_pos:end] if positions is None else self.table[positions]

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

    Two more controls for that question (the size-curve issue's C4 controls): ``freeze=True`` keeps the table
    at its initialisation (not trained: how far does the overlap move only because E changes?), and
    ``shuffle=True`` gives each sequence its own random order of the table's rows (see ``Stack.embed``), so the
    rows are trained but carry no information about where a token is. Every forward draws its orders, evaluation and
    generation included (with a KV cache a one-token step reads its own row), so such a model's text is not
    reproducible: it is a control arm, not a model to sample from.
    """

    Settings = LearnedSettings

    def __init__(self, d_model: int, n_heads: int, **settings: Any) -> None:
        super().__init__(d_model, n_heads, **settings)
        s = self.settings
        self.max_len, self.init, self.init_k, self.shuffle = s.max_len, s.init, s.init_k, s.shuffle
        self.weight = nn.Parameter(torch.randn(s.max_len, d_model) * INIT_STD, requires_grad=not s.freeze)

    @torch.no_grad()
    def finish_init(self, embedding: TokenEmbedding) -> None:
        if self.init != "mixed":
            return
        E = embedding.weight.detach().double()
        _, _, Vh = torch.linalg.svd(E - E.mean(0), full_matrices=False)
        coefficients = torch.randn(self.max_len, self.init_k, dtype=torch.float64, device=E.device)
        mixed = coefficients @ Vh[: self.init_k] * (INIT_STD * math.sqrt(self.d_model / self.init_k))
        self.weight.copy_(mixed.to(self.weight.dtype))

    def input_term(self, seq_len: int, start_pos: int = 0, positions: Tensor | None = None) -> Tensor:
        if positions is not None:  # drawn below pe.randomize_positions <= max_len (check_position_ids)
            return self.weight[positions]
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


# YaRN's defaults for Llama (Peng et al. 2023): alpha 1, beta 32 rotations within a 4096-token training length,
# RoPE base 10000. They are rescaled to a run's training length and base by ``yarn_thresholds``.
YARN_REFERENCE = {"training_length": 4096, "base": 10000.0, "alpha": 1.0, "beta": 32.0}


def yarn_thresholds(training_length: int, base: float) -> tuple[float, float]:
    """YaRN's (alpha, beta) for a model trained at ``training_length`` with RoPE ``base``: Llama's defaults moved to
    the same *fraction of the head's dimension pairs*.

    Pair i (of d/2) turns r_i = L * theta_i / (2 pi) times within the training length L, theta_i = base^(-2i/d).
    YaRN keeps the pairs with r > beta, interpolates those with r < alpha fully, and ramps linearly in between. With
    Llama's alpha 1 and beta 32 at L 4096 and base 10000, the pairs with 2i/d < 0.327 stay as trained and those with
    2i/d > 0.704 are fully interpolated, whatever d is. At our sizes (L 64, d_head 16) the same alpha and beta
    would scale every pair (r_0 = 10.2 < 32). The rule: alpha and beta are the r of the pairs at the fractions
    0.704 and 0.327, ``r(f) = L / (2 pi) * base^(-f)``; with base 10000 that is alpha = L / 4096, beta = 32 L / 4096
    (L 64: 1/64 and 1/2: 3 of 8 pairs at d_head 16 stay as trained, 2 are fully interpolated). d_head enters only
    through which pairs fall on either side of those fractions.
    """
    ref = YARN_REFERENCE

    def pair_fraction(r: float) -> float:  # the fraction 2i/d at which a pair turns r times in Llama's setting
        return math.log(ref["training_length"] / (2 * math.pi * r)) / math.log(ref["base"])

    def rotations(fraction: float) -> float:
        return training_length / (2 * math.pi) * base ** (-fraction)

    return rotations(pair_fraction(ref["alpha"])), rotations(pair_fraction(ref["beta"]))


class RotaryPE(PositionalEncoding):
    """RoPE (Su et al. 2021): rotate each (even, odd) pair of q and k by pos * theta_i, theta_i = base^(-2i/d_head).

    Then q_m . k_n depends on positions only through m - n.

    ``scaling`` stretches RoPE past the training length (``training_length``, the run's ``data.seq_len``) by
    ``scaling_factor`` s; it changes no weight, so a model trained with ``scaling="none"`` loads into any of them:

    - ``linear``: position interpolation (Chen et al. 2023): theta_i / s;
    - ``ntk``: NTK-aware base, base * s^(d/(d-2)) (bloc97; x-transformers' ``base_rescale_factor``);
    - ``dynamic_ntk``: the NTK base for the length L read so far, base * (s L / L_train - (s - 1))^(d/(d-2)) once
      L > L_train (unchanged below it). Every position of a text of length L gets that base, so a token's key
      changes as the text grows: ``cache_stays_exact`` is False past the training length and generation re-encodes;
    - ``yarn`` (Peng et al. 2023): per pair, theta_i' = (1 - g_i) theta_i / s + g_i theta_i with the ramp
      g_i = clamp((r_i - alpha) / (beta - alpha), 0, 1), r_i = L_train theta_i / (2 pi) the pair's turns within the
      training length; q and k are each multiplied by ``yarn_attention_factor`` (the paper's sqrt(1/t), default
      0.1 ln s + 1), so the logits by its square. ``yarn_alpha`` / ``yarn_beta`` default to Llama's (1, 32) rescaled
      to this training length and base (``yarn_thresholds``). ``yarn_ramp="turns"`` (default) is the paper's gamma(r),
      linear in r_i; ``"dims"`` is the official code's and transformers' (``find_correction_range``,
      ``linear_ramp_factor``): linear in the pair index i between the index where r = beta, rounded down, and the
      one where r = alpha, rounded up (the latter capped at D - 1, as there). r_i is exponential in i, so the two
      give the same kept and interpolated pairs but other values in between;
    - ``llama3`` (Llama 3.1): the same turns ramp with alpha = ``low_freq_factor``, beta = ``high_freq_factor``
      (transformers' ``_compute_llama3_parameters``: wavelengths past L_train / low are divided by s, those under
      L_train / high kept), no attention factor; L_train is ``training_length`` (original_max_position_embeddings).

    ``rotary_fraction`` f < 1 rotates only the first R = round(f d_head) dims of each head (the pairs i < R/2);
    the rest pass unchanged (frequency 0). ``partial_rotary`` says which frequencies the rotating pairs get:
    ``neox`` (GPT-NeoX / Pythia's rotary_pct, transformers' partial_rotary_factor, which truncates f d_head where we
    round) theta_i = base^(-2i/R); ``p_rope`` (Barbero et al. 2024) full RoPE's theta_i = base^(-2i/d_head), its
    lowest-frequency 1 - f of the pairs not rotated. Write theta_i = base^(-2i/D) (D = R or d_head): the scalings
    act on the rotating pairs, and the NTK exponent d/(d-2) is D/(R-2), the one that divides the lowest rotating
    frequency by s (R/(R-2) for neox, as transformers with partial_rotary_factor). With a partial rotation the YaRN
    factor still multiplies all of q and k (the paper's logit temperature), where transformers scales only the
    rotated dims.

    Angles are computed in float64 and applied in the activations' dtype (float32 tables cast once).
    """

    Settings = RotarySettings

    def __init__(self, d_model: int, n_heads: int, **settings: Any) -> None:
        super().__init__(d_model, n_heads, **settings)
        s = self.settings
        # xPos (a subclass) rotates as RoPE does, never scaled: its settings have no scaling keys
        scaled = s if isinstance(s, RotarySettings) else RotarySettings()
        d_head = d_model // n_heads
        self.base, self.d_head = s.base, d_head
        self.rotary_fraction, self.partial_rotary = float(s.rotary_fraction), s.partial_rotary
        self.rotary_dims = rotary_dims(d_head, s.rotary_fraction)
        self.scaling, self.scaling_factor = scaled.scaling, float(scaled.scaling_factor)
        self.training_length = scaled.training_length
        self.yarn_ramp = scaled.yarn_ramp
        self.low_freq_factor, self.high_freq_factor = float(scaled.low_freq_factor), float(scaled.high_freq_factor)
        if self.scaling == "yarn":
            default_alpha, default_beta = yarn_thresholds(self.training_length, self.base)
            self.yarn_alpha = default_alpha if scaled.yarn_alpha is None else float(scaled.yarn_alpha)
            self.yarn_beta = default_beta if scaled.yarn_beta is None else float(scaled.yarn_beta)
            default_factor = 0.1 * math.log(self.scaling_factor) + 1.0 if self.scaling_factor > 1 else 1.0
            factor = scaled.yarn_attention_factor
            self.attention_factor = default_factor if factor is None else float(factor)
        else:
            self.attention_factor = 1.0
        self.register_buffer("inv_freq", self.frequencies(0).float(), persistent=False)
        self._cache: tuple[int, Tensor, torch.device, Tensor, Tensor] | None = None

    @property
    def frequency_dims(self) -> int:
        """D in theta_i = base^(-2i/D): the rotating dims (``neox``) or the whole head (``p_rope``)."""
        return self.rotary_dims if self.partial_rotary == "neox" else self.d_head

    def frequencies(self, n_positions: int) -> Tensor:
        """theta_i (d_head/2,), float64 on the CPU: the angle per position of each pair for a text of ``n_positions``
        tokens (only ``dynamic_ntk`` depends on it); 0 for the pairs a partial rotation leaves alone."""
        rotating, d, s = self.rotary_dims // 2, self.frequency_dims, self.scaling_factor
        fractions = torch.arange(0, 2 * rotating, 2, dtype=torch.float64) / d
        base = self.base
        if self.scaling == "ntk":
            base = base * s ** (d / (self.rotary_dims - 2))
        elif self.scaling == "dynamic_ntk" and n_positions > self.training_length:
            base = base * (s * n_positions / self.training_length - (s - 1)) ** (d / (self.rotary_dims - 2))
        theta = base ** (-fractions)
        if self.scaling == "linear":
            theta = theta / s
        elif self.scaling in ("yarn", "llama3"):
            keep = self._kept_share(theta)
            theta = (1 - keep) * theta / s + keep * theta
        return F.pad(theta, (0, self.d_head // 2 - rotating))

    def _kept_share(self, theta: Tensor) -> Tensor:
        """g_i in [0, 1] per rotating pair (``yarn``, ``llama3``): 1 keeps theta_i as trained, 0 divides it by s."""
        L = self.training_length
        if self.scaling == "llama3":
            alpha, beta = self.low_freq_factor, self.high_freq_factor
        else:
            alpha, beta = self.yarn_alpha, self.yarn_beta
        if self.scaling == "llama3" or self.yarn_ramp == "turns":  # linear in the turns r_i (the paper's gamma(r))
            turns = L * theta / (2 * math.pi)
            return ((turns - alpha) / (beta - alpha)).clamp(0, 1)
        # linear in the pair index, between whole pairs (YaRN's find_correction_range with truncation)
        d = self.frequency_dims

        def index(r: float) -> float:  # the (fractional) pair index that turns r times within L
            return d * math.log(L / (2 * math.pi * r)) / (2 * math.log(self.base))

        low = max(math.floor(index(beta)), 0)
        high = min(math.ceil(index(alpha)), d - 1) if alpha > 0 else d - 1
        if low == high:
            high += 0.001  # as the official code: no division by zero
        i = torch.arange(len(theta), dtype=torch.float64)
        return 1 - ((i - low) / (high - low)).clamp(0, 1)

    def cache_stays_exact(self, n_positions: int) -> bool:
        return self.scaling != "dynamic_ntk" or n_positions <= self.training_length

    def _cos_sin(self, seq_len: int, device: torch.device) -> tuple[Tensor, Tensor]:
        theta = self.frequencies(seq_len)
        # Keyed on every frequency: dynamic_ntk takes another base past the training length (and a partial rotation's
        # last frequency is 0 whatever the base).
        cache = self._cache
        if cache is None or cache[0] < seq_len or cache[2] != device or not torch.equal(cache[1], theta):
            # Angles in float32 from float64 frequencies: a bf16 model (precision=bf16-true) also casts the
            # inv_freq buffer to bf16, whose 8-bit mantissa would put far positions at the wrong angle.
            pos = torch.arange(seq_len, device=device, dtype=torch.float32)
            angles = torch.outer(pos, theta.to(device).float())  # (T, dh/2)
            self._cache = (seq_len, theta, device, angles.cos(), angles.sin())
        _, _, _, cos, sin = self._cache
        return cos[:seq_len], sin[:seq_len]

    def _magnitude(self, start_pos: int, seq_len: int, device: torch.device, key: bool,
                   positions: Tensor | None = None) -> Tensor | float:
        """What each pair is multiplied by besides the rotation: (T, dh/2) float32 ((B, 1, T, dh/2) for ``positions``
        (B, 1, T)), or a number (1: nothing)."""
        return self.attention_factor

    def rotate(self, x: Tensor, start_pos: int = 0, key: bool = False, positions: Tensor | None = None) -> Tensor:
        """Rotate x (..., T, dh) pairwise by its position ``start_pos + t`` (``key``: x holds keys, not queries), or
        x (B, H, T, dh) by ``positions`` (B, T): token t of sequence b by the angle positions[b, t] * theta_i."""
        if positions is None:
            end = start_pos + x.shape[-2]
            cos, sin = (t[start_pos:] for t in self._cos_sin(end, x.device))
        else:  # the same float32 product as _cos_sin's table, per sequence
            positions = positions.to(device=x.device, dtype=torch.float32)[:, None, :]  # (B, 1, T)
            angles = positions[..., None] * self.frequencies(x.shape[-2]).to(x.device).float()  # (B, 1, T, dh/2)
            cos, sin = angles.cos(), angles.sin()
        magnitude = self._magnitude(start_pos, x.shape[-2], x.device, key, positions)
        if not (isinstance(magnitude, float) and magnitude == 1.0):
            cos, sin = cos * magnitude, sin * magnitude  # in float32, then cast: a 16-bit factor could overflow first
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # q, k, v keep one dtype
        x_even, x_odd = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
        return rotated.flatten(-2)

    def rotate_qk(self, q: Tensor, k: Tensor, start_pos: int = 0, positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return self.rotate(q, start_pos, positions=positions), self.rotate(k, start_pos, key=True, positions=positions)


class XPosPE(RotaryPE):
    """xPos (Sun et al. 2023): RoPE whose q.k decays with distance.

    The query at position n is rotated and scaled by zeta_i^((n - c)/B), the key at m by zeta_i^(-(m - c)/B), with
    zeta_i = (2i/d_head + gamma) / (1 + gamma) (in (0, 1)) and B = ``scale_base``; so pair i of q_n . k_m carries
    zeta_i^((n - m)/B), a decay in n - m that the centre c cancels. The centre keeps each factor near 1 in 16-bit
    precision (zeta_0^(-L/B) overflows float16 at L ~ 4500 for gamma 0.4, B 512). It is a constant,
    c = ``training_length`` // 2, not the middle of the current sequence (x-transformers takes max_pos // 2 of each
    call, so a cached key and a later query get different centres and its KV cache is wrong): the same token gets
    the same factor in a full pass and in every cached step.

    A partial rotation (``rotary_fraction``, ``partial_rotary`` as RoPE's) puts 2i/D for 2i/d_head in zeta_i
    (x-transformers' xPos over its rotary dims, for ``neox``), and the pairs it leaves alone do not decay (zeta 1).

    xPos is made for causal models: in a bidirectional encoder the same factor makes q.k *grow* with the distance to
    keys after the query (zeta^(n - m) > 1 for m > n); it is kept as the paper defines it, not symmetrised.
    """

    Settings = XPosSettings

    def __init__(self, d_model: int, n_heads: int, **settings: Any) -> None:
        super().__init__(d_model, n_heads, **settings)
        s = self.settings
        self.gamma, self.scale_base, self.center = s.gamma, float(s.scale_base), s.training_length // 2
        self.training_length = s.training_length
        rotating = self.rotary_dims // 2  # the pairs a partial rotation leaves alone do not decay (zeta 1)
        fractions = torch.arange(0, 2 * rotating, 2, dtype=torch.float64) / self.frequency_dims
        zeta = F.pad((fractions + s.gamma) / (1 + s.gamma), (0, self.d_head // 2 - rotating), value=1.0)
        self.register_buffer("zeta", zeta.float(), persistent=False)

    def _magnitude(self, start_pos: int, seq_len: int, device: torch.device, key: bool,
                   positions: Tensor | None = None) -> Tensor:
        if positions is None:
            positions = torch.arange(start_pos, start_pos + seq_len, device=device, dtype=torch.float32)
        power = (positions - self.center) / self.scale_base * (-1.0 if key else 1.0)  # (T,) or (B, 1, T)
        return self.zeta.float().to(device) ** power[..., None]  # (T, dh/2) or (B, 1, T, dh/2)


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

    Settings = ALiBiSettings

    def __init__(self, d_model: int, n_heads: int, **settings: Any) -> None:
        super().__init__(d_model, n_heads, **settings)
        self.register_buffer("slopes", alibi_slopes(n_heads), persistent=False)

    def score_bias(self, q_len: int, k_len: int, start_pos: int = 0, positions: Tensor | None = None) -> Tensor:
        q_pos, k_pos = _positions(start_pos, q_len, k_len, self.slopes.device, positions)
        distance = (q_pos - k_pos).abs().unsqueeze(-3)  # (1, Tq, Tk) or (B, 1, T, T)
        return -self.slopes.float()[:, None, None] * distance  # (H, Tq, Tk), float32: attention casts it to its scores' dtype


def _positions(start_pos: int, q_len: int, k_len: int, device: torch.device, positions: Tensor | None = None,
               dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Query positions (Tq, 1) and key positions (1, Tk): the queries are ``start_pos ..`` and the keys every position
    from 0 (a cache holds the earlier ones); with ``positions`` (B, T) (a full pass at drawn positions), (B, T, 1) and
    (B, 1, T), so a bias of their differences is per sequence."""
    if positions is not None:
        positions = positions.to(device=device, dtype=dtype)
        return positions[:, :, None], positions[:, None, :]
    q_pos = torch.arange(start_pos, start_pos + q_len, device=device, dtype=dtype)[:, None]
    k_pos = torch.arange(k_len, device=device, dtype=dtype)[None, :]
    return q_pos, k_pos


def t5_bucket(relative_position: Tensor, causal: bool, num_buckets: int = 32, max_distance: int = 128) -> Tensor:
    """T5's bucket (Raffel et al. 2020) of each relative position ``key - query`` (an integer tensor).

    Causal: the distance n = query - key >= 0 (later keys count as 0); buckets 0 .. num_buckets/2 - 1 hold one
    distance each, the rest are logarithmic up to ``max_distance``, beyond which every distance shares the last
    bucket. Bidirectional: half the buckets for keys at or before the query, half (offset by num_buckets/2) for keys
    after it, each half bucketed the same way.
    """
    n = -relative_position
    bucket = torch.zeros_like(n)
    if causal:
        n = n.clamp(min=0)
    else:
        num_buckets //= 2
        bucket = bucket + (n < 0).long() * num_buckets
        n = n.abs()
    max_exact = num_buckets // 2
    log_ratio = torch.log(n.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
    large = (max_exact + (log_ratio * (num_buckets - max_exact)).long()).clamp(max=num_buckets - 1)
    return bucket + torch.where(n < max_exact, n, large)


class T5BiasPE(PositionalEncoding):
    """T5's relative bias: a learned scalar per (bucket, head) added to the attention logits.

    The bucket of key j for query i is ``t5_bucket(j - i)``: causal buckets in a decoder's stack, bidirectional
    (half per side) in an encoder's (``causal`` is set by the stack). Scale as in T5 itself: the bias is added
    unscaled to the logits the softmax reads (here q.k / sqrt(d_head) + bias). x-transformers multiplies it by
    sqrt(d_head) (its ``RelativePositionBias(scale=dim_head ** 0.5)``), which is a different parametrisation of the same
    family, not followed here. As in T5, one table serves every layer of the stack; it starts as the model's
    other embeddings, N(0, 0.02^2).
    """

    Settings = T5BiasSettings

    def __init__(self, d_model: int, n_heads: int, **settings: Any) -> None:
        super().__init__(d_model, n_heads, **settings)
        self.num_buckets, self.max_distance = self.settings.num_buckets, self.settings.max_distance
        self.relative_attention_bias = nn.Embedding(self.num_buckets, n_heads)  # (buckets, H)

    @classmethod
    def settings_warnings(cls, d_model: int, n_heads: int, seq_len: int, precision: str = "32-true",
                          **settings: Any) -> list[str]:
        # here, not in T5BiasSettings.warnings: it counts the buckets with the model's own t5_bucket (torch)
        num_buckets, max_distance = (s := cls.Settings(**settings)).num_buckets, s.max_distance

        def buckets(n_positions: int, causal: bool) -> set[int]:
            distances = torch.arange(n_positions)
            return set(t5_bucket(torch.cat((-distances, distances)), causal, num_buckets, max_distance).tolist())

        longest = max(seq_len, 2 * max_distance)  # every bucket a text of any length can reach
        unreached = {name: len(buckets(longest, causal) - buckets(seq_len, causal))
                     for name, causal in (("decoder", True), ("encoder", False))}
        if not any(unreached.values()):
            return []
        return [f"pe.num_buckets={num_buckets}, pe.max_distance={max_distance}: at data.seq_len={seq_len} "
                f"{unreached['decoder']} causal (decoder) and {unreached['encoder']} bidirectional (encoder) buckets are "
                "never reached in training; they keep their initial values when a longer text reaches them"]

    def score_bias(self, q_len: int, k_len: int, start_pos: int = 0, positions: Tensor | None = None) -> Tensor:
        device = self.relative_attention_bias.weight.device
        q_pos, k_pos = _positions(start_pos, q_len, k_len, device, positions, dtype=torch.long)
        bucket = t5_bucket(k_pos - q_pos, self.causal, self.num_buckets, self.max_distance)  # (Tq, Tk) or (B, T, T)
        return self.relative_attention_bias(bucket).movedim(-1, -3)  # (H, Tq, Tk) or (B, H, T, T)


class FirePE(PositionalEncoding):
    """FIRE (Li et al. 2024): a learned MLP of the normalised distance, one output per head.

    bias[h, i, j] = f_h(psi(|i - j|) / (psi(max(L, i)) + eps)), psi(x) = log(|c x| + 1), f a 1 -> ``mlp_width`` -> H
    MLP with a ReLU, c learned (init ``init_c`` = 0.1) and L = |m * ``init_threshold``| a learned threshold (m init 1;
    ``init_threshold`` is the training length in configs/pe/fire.yaml, not the paper's fixed 512), as the paper's
    reference code. The query position i normalises the distance, so a longer text maps into the range the MLP was
    trained on. A causal stack masks j > i; a bidirectional one reads the same |i - j| on both sides (the paper
    defines only the causal form). One MLP, c and L per stack, shared by its layers; the MLP keeps torch's default
    Linear init (``finish_init`` undoes the model's N(0, 0.02^2), which would start every head near zero).
    """

    eps = 1e-6
    Settings = FireSettings

    def __init__(self, d_model: int, n_heads: int, **settings: Any) -> None:
        super().__init__(d_model, n_heads, **settings)
        s = self.settings
        self.mlp = nn.Sequential(nn.Linear(1, s.mlp_width), nn.ReLU(), nn.Linear(s.mlp_width, n_heads))
        self.c = nn.Parameter(torch.tensor(float(s.init_c)))
        self.threshold_multiplier = nn.Parameter(torch.tensor(1.0))
        self.register_buffer("init_threshold", torch.tensor(float(s.init_threshold)))

    @property
    def threshold(self) -> Tensor:
        """L, the learned threshold (a 0-d tensor)."""
        return (self.threshold_multiplier * self.init_threshold).abs()

    def score_bias(self, q_len: int, k_len: int, start_pos: int = 0, positions: Tensor | None = None) -> Tensor:
        q_pos, k_pos = _positions(start_pos, q_len, k_len, self.c.device, positions)
        c = self.c.float()

        def psi(x: Tensor) -> Tensor:
            return torch.log(torch.abs(c * x) + 1)

        normaliser = psi(torch.maximum(q_pos, self.threshold.float())) + self.eps  # (Tq, 1) or (B, T, 1)
        distance = psi((q_pos - k_pos).abs()) / normaliser  # (Tq, Tk), in [0, ~1] within the threshold
        weight = self.mlp[0].weight
        return self.mlp(distance[..., None].to(weight.dtype)).movedim(-1, -3)  # (H, Tq, Tk) or (B, H, T, T)


KERPLE_FLOOR = 0.01


class KerplePE(PositionalEncoding):
    """Kerple-log (Chi et al. 2022): bias[h, i, j] = -r1_h log(1 + r2_h |i - j|), r1 and r2 learned per head.

    r1, r2 are kept >= 0.01 by a softplus plus that floor (r = 0.01 + softplus(raw)), differentiable everywhere (the
    paper's code clamps the values instead, which stops the gradient at the floor). They start as the paper's code
    draws them, r1 ~ U(0, 2) and r2 ~ U(0, 1) (at least 0.011). Causal stacks mask j > i; bidirectional ones read
    |i - j| on both sides. One r1, r2 per head for the whole stack (the paper has one per layer).
    """

    Settings = KerpleSettings

    def __init__(self, d_model: int, n_heads: int, **settings: Any) -> None:
        super().__init__(d_model, n_heads, **settings)
        r1 = (torch.rand(n_heads) * 2).clamp(min=KERPLE_FLOOR + 1e-3)
        r2 = torch.rand(n_heads).clamp(min=KERPLE_FLOOR + 1e-3)
        self.r1_raw = nn.Parameter(self._inverse(r1))
        self.r2_raw = nn.Parameter(self._inverse(r2))

    @staticmethod
    def _inverse(r: Tensor) -> Tensor:
        return torch.log(torch.expm1(r - KERPLE_FLOOR))  # softplus^-1(r - floor)

    @property
    def r1(self) -> Tensor:
        return KERPLE_FLOOR + F.softplus(self.r1_raw.float())

    @property
    def r2(self) -> Tensor:
        return KERPLE_FLOOR + F.softplus(self.r2_raw.float())

    def score_bias(self, q_len: int, k_len: int, start_pos: int = 0, positions: Tensor | None = None) -> Tensor:
        q_pos, k_pos = _positions(start_pos, q_len, k_len, self.r1_raw.device, positions)
        distance = (q_pos - k_pos).abs().unsqueeze(-3)  # (1, Tq, Tk) or (B, 1, T, T)
        return -self.r1[:, None, None] * torch.log1p(self.r2[:, None, None] * distance)  # (H, Tq, Tk), float32


class CoPE(PositionalEncoding):
    """Contextual position encoding (Golovneva et al. 2024), as x-transformers' ``CoPE``.

    Query i counts the keys it finds relevant: gates g_ij = sigmoid(q_i . k_j / sqrt(d_head)) (the attention's own
    logits), position p_ij = sum of g_ik for k from j to i, capped at ``p_max`` - 1. The logit of key j gains
    q_i . e[p_ij], e a learned (p_max, d_head) table (zeros at init, as x-transformers) read by linear interpolation
    between the rows floor(p) and ceil(p). A cached step computes the gates of its new queries against every cached
    key, which is what the full pass computes for them: cached = uncached.

    Causal (a decoder's stack, the paper's form): keys after the query are masked and carry no gate. Bidirectional (an
    encoder's stack; our extension): keys at or before the query count the gates from j up to i and read ``e``; keys
    after it count the gates from i up to j and read a second table ``e_after``, so the two directions have their own
    position vectors. One table (two in an encoder) per stack, shared by its layers (the paper has one per layer).
    """

    Settings = CoPESettings

    def __init__(self, d_model: int, n_heads: int, **settings: Any) -> None:
        super().__init__(d_model, n_heads, **settings)
        self.p_max, self.d_head = self.settings.p_max, d_model // n_heads
        self.pos_emb = nn.Parameter(torch.zeros(self.p_max, self.d_head))
        self.pos_emb_after: nn.Parameter | None = None  # created when a stack says the encoding is bidirectional
        self._causal = True

    @property
    def causal(self) -> bool:  # type: ignore[override]
        return self._causal

    @causal.setter
    def causal(self, causal: bool) -> None:
        # The table of keys after the query exists only where it is used (DDP refuses parameters without a gradient).
        self._causal = causal
        if not causal and self.pos_emb_after is None:
            self.pos_emb_after = nn.Parameter(torch.zeros_like(self.pos_emb))
        elif causal:
            self.pos_emb_after = None

    def _interpolated(self, q: Tensor, position: Tensor, table: Tensor) -> Tensor:
        """q_i . e[p] for fractional positions (B, H, Tq, Tk), by linear interpolation of the integer rows."""
        position = position.clamp(max=self.p_max - 1)
        per_row = (q @ table.to(q.dtype).T).float()  # (B, H, Tq, p_max)
        floor = position.floor()
        weight = position - floor
        low = per_row.gather(-1, floor.long())
        high = per_row.gather(-1, position.ceil().long())
        return high * weight + low * (1 - weight)

    def qk_bias(self, q: Tensor, k: Tensor, start_pos: int = 0, causal: bool = False) -> Tensor:
        Tq, Tk = q.shape[-2], k.shape[-2]
        gates = torch.sigmoid((q @ k.transpose(-2, -1)).float() / math.sqrt(q.shape[-1]))  # (B, H, Tq, Tk)
        q_pos, k_pos = _positions(Tk - Tq if causal else start_pos, Tq, Tk, q.device)
        at_or_before = k_pos <= q_pos  # (Tq, Tk)
        before = (gates * at_or_before).flip(-1).cumsum(-1).flip(-1)  # sum of g_ik for j <= k <= i
        term = self._interpolated(q, before, self.pos_emb)
        if causal or self.pos_emb_after is None:
            return term  # the attention masks the keys after each query
        after = (gates * (k_pos >= q_pos)).cumsum(-1)  # sum of g_ik for i <= k <= j
        return torch.where(at_or_before, term, self._interpolated(q, after, self.pos_emb_after))
