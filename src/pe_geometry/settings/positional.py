"""The settings of each positional encoding (``pe=``), the classes of ``pe_geometry.model.positional`` built from them.

Each family's dataclass is the one source of its keys' defaults, types, ranges and docs, and its ``check`` holds what
needs the model's sizes (RoPE's even head dimension, a learned table at least as long as the training length). What
a family *is* is said here too, as class attributes the config checks read without importing torch: the option name
(``family``), whether it reads position ids (so takes ``randomize_positions``), whether it adds its term to the input
(so a layer pattern cannot vary it), whether it works in causal stacks only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

from annotated_types import Ge, Gt, Interval

from pe_geometry.settings.base import REGISTRY, Settings, SettingsError, Sizes, component

SINUSOIDAL_SCALES = ("none", "word_norm")
LEARNED_INITS = ("normal", "mixed")
# A learned table of more rows than this is a typo (pe.max_len=1e9 asked torch for 128 GB), not a plan.
MAX_LEARNED_POSITIONS = 1 << 20
# Each block draws its ids from a random permutation of [0, N) (B x N floats sorted): a bound keeps that in memory.
MAX_RANDOMIZED_POSITIONS = 1 << 20
ROPE_SCALINGS = ("none", "linear", "ntk", "dynamic_ntk", "yarn", "llama3")
# Which frequencies a partial rotation (rotary_fraction < 1) gives its rotating pairs: GPT-NeoX's (over the rotated
# dims) or p-RoPE's (full RoPE's over d_head, the lowest-frequency pairs dropped).
PARTIAL_ROTARY_STYLES = ("neox", "p_rope")
# YaRN's ramp between interpolated and kept pairs: linear in the turns r_i (the paper's gamma(r)), or linear in the
# pair index between whole pairs (the official code's and transformers' find_correction_range / linear_ramp_factor).
YARN_RAMPS = ("turns", "dims")
CAUSAL_ONLY = ("the Forgetting Transformer is causal only: its bias sums the log forget gates from a key up to its query, "
               "left to right, and a bidirectional stack (model=encoder, the encoder of model=encoder_decoder) has keys "
               "after the query; it works with model=decoder")

Positions = Annotated[int, Interval(ge=1, le=MAX_LEARNED_POSITIONS)]
Base = Annotated[float, Gt(1)]
RandomizedPositions = Annotated[int | None, Interval(ge=0, le=MAX_RANDOMIZED_POSITIONS),
                                "positions drawn from in training; 0: off", "null for off"]
RotaryFraction = Annotated[float, Interval(gt=0, le=1), "of each head's dims that rotate"]
PartialRotary = Literal[PARTIAL_ROTARY_STYLES]
TrainingLength = Annotated[int | None, Ge(1), "the length trained at"]


def rotary_dims(d_head: int, rotary_fraction: float) -> int:
    """How many of a head's ``d_head`` dims rotate: round(rotary_fraction * d_head) (even and >= 2 for RoPE)."""
    return int(round(rotary_fraction * d_head))


@dataclass(frozen=True)
class EncodingSettings(Settings):
    """What every encoding takes: randomised positions (Ruoss et al. 2023), refused by a family without ids."""

    group: ClassVar[str] = "pe"
    family: ClassVar[str] = ""  # its pe= option ("" for a user's encoding without one)
    takes_position_ids: ClassVar[bool] = False  # its hooks read position ids, so it takes ``randomize_positions``
    no_position_ids: ClassVar[str] = "it reads no position ids"  # why not, in the refusal's words
    adds_to_input: ClassVar[bool] = False  # its term is added to the input once (a layer pattern cannot vary it)
    causal_only: ClassVar[bool] = False  # refuses a bidirectional stack

    randomize_positions: RandomizedPositions = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.randomize_positions and not self.takes_position_ids:
            name = self.target.rsplit(".", 1)[-1] or type(self).__name__
            raise SettingsError(f"pe.randomize_positions={self.randomize_positions} draws position ids, and {name} has "
                                f"none ({self.no_position_ids}); the families that take it: "
                                f"pe={', '.join(randomizable_families())}")

    def check(self, sizes: Sizes) -> None:
        if self.randomize_positions and self.randomize_positions < sizes.seq_len:
            raise SettingsError(f"pe.randomize_positions={self.randomize_positions} must be at least data.seq_len="
                                f"{sizes.seq_len}: each block draws data.seq_len distinct positions of [0, "
                                "pe.randomize_positions)")

    def check_causal(self, causal: bool) -> None:
        """``SettingsError`` (one line) for a bidirectional stack where the family works in causal stacks only."""
        if self.causal_only and not causal:
            raise SettingsError(CAUSAL_ONLY)


def encoding_families() -> dict[str, type[EncodingSettings]]:
    """pe= option -> its settings, for every family of ours (a user's encoding has no option of ours)."""
    return {cls.family: cls for cls in REGISTRY.values() if issubclass(cls, EncodingSettings) and cls.family}


def randomizable_families() -> list[str]:
    return [name for name, cls in encoding_families().items() if cls.takes_position_ids]


def attention_families() -> list[str]:
    """The families that act inside attention (not on the input): the ones a layer pattern may vary."""
    return [name for name, cls in encoding_families().items() if not cls.adds_to_input]


@component("pe_geometry.model.NoPE", "pe_geometry.model.positional.NoPE")
@dataclass(frozen=True)
class NoPESettings(EncodingSettings):
    """No positional information at all (Kazemnejad et al. 2023)."""

    family: ClassVar[str] = "none"
    no_position_ids: ClassVar[str] = "no positional encoding"


@component("pe_geometry.model.SinusoidalPE", "pe_geometry.model.positional.SinusoidalPE")
@dataclass(frozen=True)
class SinusoidalSettings(EncodingSettings):
    """Vaswani et al.'s fixed sin/cos table; two controls change it (``center``, ``scale``)."""

    family: ClassVar[str] = "sinusoidal"
    takes_position_ids: ClassVar[bool] = True
    adds_to_input: ClassVar[bool] = True

    max_len: Positions = 512
    scale: Literal[SINUSOIDAL_SCALES] = "none"  # word_norm: rows at the word embedding's norm at init
    center: bool = False  # subtract the mean row (a shared offset words could carry)

    def check(self, sizes: Sizes) -> None:
        super().check(sizes)
        if sizes.d_model % 2:
            raise SettingsError(f"sinusoidal PE needs an even model.d_model (sin/cos pairs), got {sizes.d_model}")


@component("pe_geometry.model.LearnedPE", "pe_geometry.model.positional.LearnedPE")
@dataclass(frozen=True)
class LearnedSettings(EncodingSettings):
    """A trained table of ``max_len`` absolute position vectors (BERT, GPT-2), and the controls of the C4 question."""

    family: ClassVar[str] = "learned"
    takes_position_ids: ClassVar[bool] = True
    adds_to_input: ClassVar[bool] = True

    max_len: Annotated[Positions, "rows of the learned table"] = 512
    init: Literal[LEARNED_INITS] = "normal"  # mixed: start inside E's top-init_k principal subspace
    init_k: Annotated[int, Ge(1)] = 8
    freeze: bool = False  # the table is not trained (stays at its init; a control)
    shuffle: bool = False  # each sequence reads the rows in a random order (a control)

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.randomize_positions
        if n and n > self.max_len:
            raise SettingsError(f"pe.randomize_positions={n} is past the learned position table (pe.max_len="
                                f"{self.max_len}): positions are drawn from [0, pe.randomize_positions); raise "
                                "pe.max_len or lower pe.randomize_positions")
        if n and self.shuffle:
            raise SettingsError(f"pe.randomize_positions={n} with pe.shuffle=true: the shuffle control already reads "
                                "the rows in a random order; choose one")

    def check(self, sizes: Sizes) -> None:
        super().check(sizes)
        if self.init_k > sizes.d_model:
            raise SettingsError(f"pe.init_k={self.init_k} must be between 1 and model.d_model={sizes.d_model}")
        if sizes.seq_len > self.max_len:
            raise SettingsError(f"data.seq_len={sizes.seq_len} is longer than the learned position table (pe.max_len="
                                f"{self.max_len}); raise pe.max_len or shorten data.seq_len")


@dataclass(frozen=True)
class RotationSettings(EncodingSettings):
    """What every rotation of q and k takes (RoPE, xPos): the base and the share of each head that rotates."""

    takes_position_ids: ClassVar[bool] = True

    base: Base = 10000.0
    rotary_fraction: RotaryFraction = 1.0
    partial_rotary: PartialRotary = "neox"  # the rotating pairs' frequencies: GPT-NeoX's or p-RoPE's

    def check(self, sizes: Sizes) -> None:
        super().check(sizes)
        d_model, n_heads, d_head = sizes.d_model, sizes.n_heads, sizes.d_head
        if d_head % 2:
            raise SettingsError(f"RoPE needs an even head dimension, got model.d_model/model.n_heads = {d_model}/"
                                f"{n_heads} = {d_head}")
        rotating = rotary_dims(d_head, self.rotary_fraction)
        if rotating % 2 or rotating < 2:
            raise SettingsError(f"pe.rotary_fraction={self.rotary_fraction} rotates round({self.rotary_fraction} x "
                                f"{d_head}) = {rotating} of the {d_head} dims of a head (model.d_model/model.n_heads = "
                                f"{d_model}/{n_heads}); RoPE needs an even number >= 2")


@component("pe_geometry.model.RotaryPE", "pe_geometry.model.positional.RotaryPE")
@dataclass(frozen=True)
class RotarySettings(RotationSettings):
    """RoPE (Su et al. 2021), and the ways to stretch it past the training length at inference (``scaling``)."""

    family: ClassVar[str] = "rope"

    scaling: Literal[ROPE_SCALINGS] = "none"  # stretched at inference (no weight changes)
    scaling_factor: Annotated[float, Ge(1), "times the training length"] = 1.0
    training_length: TrainingLength = None  # what dynamic_ntk, yarn and llama3 scale from
    yarn_alpha: Annotated[float | None, Ge(0), "null for the rescaled default"] = None
    yarn_beta: Annotated[float | None, Gt(0), "null for the rescaled default"] = None
    yarn_attention_factor: Annotated[float | None, Gt(0), "null for 0.1 ln(s) + 1"] = None
    yarn_ramp: Literal[YARN_RAMPS] = "turns"  # linear in a pair's turns (the paper) or in its index (the code)
    low_freq_factor: Annotated[float, Gt(0), "llama3: turns below it interpolated"] = 1.0
    high_freq_factor: Annotated[float, Gt(0), "llama3: turns above it kept"] = 4.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.scaling in ("dynamic_ntk", "yarn", "llama3") and self.training_length is None:
            raise SettingsError(f"pe.scaling={self.scaling} needs pe.training_length >= 1 (the length the model was "
                                "trained at), got null")
        if self.yarn_alpha is not None and self.yarn_beta is not None and not self.yarn_alpha < self.yarn_beta:
            raise SettingsError(f"pe.yarn_alpha={self.yarn_alpha} and pe.yarn_beta={self.yarn_beta} must satisfy 0 <= "
                                "alpha < beta")
        if self.scaling == "llama3" and not self.low_freq_factor < self.high_freq_factor:
            raise SettingsError(f"pe.low_freq_factor={self.low_freq_factor} and pe.high_freq_factor="
                                f"{self.high_freq_factor} must satisfy 0 < low < high (turns within pe.training_length)")

    def warnings(self, sizes: Sizes, precision: str = "32-true") -> list[str]:
        if self.scaling in ("linear", "ntk", "yarn", "llama3") and self.scaling_factor == 1:
            # (not refused: the extrapolation benchmark reads a scaled run at 1x with factor 1, which is RoPE itself)
            return [f"pe.scaling={self.scaling} at pe.scaling_factor=1 changes no frequency: the run reads as "
                    "pe.scaling=none; set pe.scaling_factor > 1 (how many times the training length)"]
        return []

    def check(self, sizes: Sizes) -> None:
        super().check(sizes)
        rotating = rotary_dims(sizes.d_head, self.rotary_fraction)
        if self.scaling in ("ntk", "dynamic_ntk") and rotating < 4:
            raise SettingsError(f"pe.scaling={self.scaling} needs >= 4 rotating dims per head (base^(d/(d-2))), got "
                                f"{rotating} (model.d_model/model.n_heads = {sizes.d_model}/{sizes.n_heads}, "
                                f"pe.rotary_fraction={self.rotary_fraction})")


@component("pe_geometry.model.XPosPE", "pe_geometry.model.positional.XPosPE")
@dataclass(frozen=True)
class XPosSettings(RotationSettings):
    """xPos (Sun et al. 2023): RoPE whose q.k decays with distance, centred at ``training_length // 2``."""

    family: ClassVar[str] = "xpos"

    gamma: Annotated[float, Gt(0)] = 0.4  # zeta_0 = gamma / (1 + gamma)
    scale_base: Annotated[float, Gt(0), "tokens"] = 512.0
    training_length: Annotated[int, Ge(1), "the length trained at"] = 512  # positions are centred at half of it

    def warnings(self, sizes: Sizes, precision: str = "32-true") -> list[str]:
        if precision not in ("16", "16-mixed", "16-true"):  # float16's range; bfloat16 and wider reach 3e38
            return []
        center = (self.training_length or sizes.seq_len) // 2
        zeta_0 = self.gamma / (1 + self.gamma)
        reach = math.log(FLOAT16_MAX) / -math.log(zeta_0) * self.scale_base  # |n - c| at the overflow
        longest = 16 * sizes.seq_len  # the extrapolation benchmark reads 16x the training length
        if center + reach >= longest:
            return []
        return [f"pe.scale_base={self.scale_base:g} with trainer.precision={precision}: a key's xPos factor overflows "
                f"float16 past position {int(center + reach)}, shorter than 16x data.seq_len={sizes.seq_len}; raise "
                "pe.scale_base or use bf16"]


FLOAT16_MAX = 65504.0


@component("pe_geometry.model.ALiBiPE", "pe_geometry.model.positional.ALiBiPE")
@dataclass(frozen=True)
class ALiBiSettings(EncodingSettings):
    """ALiBi (Press et al. 2022): -slope_h |i - j| added to the logits; nothing to set."""

    family: ClassVar[str] = "alibi"
    takes_position_ids: ClassVar[bool] = True


@component("pe_geometry.model.T5BiasPE", "pe_geometry.model.positional.T5BiasPE")
@dataclass(frozen=True)
class T5BiasSettings(EncodingSettings):
    """T5's learned scalar per (distance bucket, head)."""

    family: ClassVar[str] = "t5_bias"
    takes_position_ids: ClassVar[bool] = True

    num_buckets: Annotated[int, Ge(4)] = 32  # an encoder has half per direction, each with an exact distance
    max_distance: Annotated[int, Ge(2), "tokens"] = 128

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_distance <= self.num_buckets // 2:
            raise SettingsError(f"pe.max_distance={self.max_distance} must be larger than pe.num_buckets/2="
                                f"{self.num_buckets // 2} (the distances bucketed one by one)")


@component("pe_geometry.model.FirePE", "pe_geometry.model.positional.FirePE")
@dataclass(frozen=True)
class FireSettings(EncodingSettings):
    """FIRE (Li et al. 2024): a learned MLP of the normalised distance, one output per head."""

    family: ClassVar[str] = "fire"
    takes_position_ids: ClassVar[bool] = True

    mlp_width: Annotated[int, Ge(1)] = 32
    init_c: Annotated[float, Gt(0)] = 0.1
    init_threshold: Annotated[float, Ge(1), "tokens"] = 512.0  # L, learned: distances are normalised by psi(max(L, i))

    def warnings(self, sizes: Sizes, precision: str = "32-true") -> list[str]:
        if self.init_threshold <= sizes.seq_len:
            return []
        return [f"pe.init_threshold={self.init_threshold:g} is above data.seq_len={sizes.seq_len}: no query in "
                "training reaches it, so every distance is normalised by the threshold, not by its query's position "
                "(set it to the training length)"]


@component("pe_geometry.model.KerplePE", "pe_geometry.model.positional.KerplePE")
@dataclass(frozen=True)
class KerpleSettings(EncodingSettings):
    """Kerple-log (Chi et al. 2022): -r1_h log(1 + r2_h |i - j|), r1 and r2 learned; nothing to set."""

    family: ClassVar[str] = "kerple"
    takes_position_ids: ClassVar[bool] = True


@component("pe_geometry.model.CoPE", "pe_geometry.model.positional.CoPE")
@dataclass(frozen=True)
class CoPESettings(EncodingSettings):
    """Contextual position encoding (Golovneva et al. 2024): positions are counts of the keys a query's gates open."""

    family: ClassVar[str] = "cope"
    no_position_ids: ClassVar[str] = "its positions are counts of the keys a query's gates open"

    p_max: Annotated[int, Ge(2)] = 16  # positions 0 .. p_max - 1 are interpolated

    def warnings(self, sizes: Sizes, precision: str = "32-true") -> list[str]:
        seq_len, p_max = sizes.seq_len, self.p_max
        if p_max > seq_len:
            return [f"pe.p_max={p_max} is above data.seq_len={seq_len}: positions past {seq_len} (rows {seq_len}..{p_max - 1}"
                    " of the table) are never reached in training and keep their initial zeros"]
        # Every gate starts at sigmoid(~0) = 0.5, so a training block's counts start at most ~seq_len / 2: the rows past
        # it get no gradient until gates open, and a longer window at inference reads them (a 64-token block with
        # p_max 64 trained rows 0-33 at the start; the paper and x-transformers use 16).
        reached = seq_len // 2 + 1
        if p_max - 1 > reached:
            return [f"pe.p_max={p_max} is above what data.seq_len={seq_len} fills at initialisation: gates start near 0.5, "
                    f"so counts reach ~{reached} and rows {reached + 1}..{p_max - 1} get no gradient until gates open "
                    f"(the paper uses 16; pe.p_max<={reached + 1} avoids it)"]
        return []


@component("pe_geometry.model.ForgettingPE", "pe_geometry.model.forgetting.ForgettingPE")
@dataclass(frozen=True)
class ForgettingSettings(EncodingSettings):
    """FoX (Lin et al. 2025): a forget gate per layer, head and token whose log sums are added to the logits."""

    family: ClassVar[str] = "forgetting"
    no_position_ids: ClassVar[str] = "its decay is counted in tokens by the forget gates, not read from position ids"
    causal_only: ClassVar[bool] = True

    rotary: bool = False  # also rotate q and k as RoPE (the paper's FoX with RoPE)
    base: Base = 10000.0
    gate_bias_init: Annotated[float, "f = sigmoid(b) at init; 5: f = 0.993, the paper's code 0: f = 0.5"] = 5.0

    def check(self, sizes: Sizes) -> None:
        super().check(sizes)
        if self.rotary:
            RotationSettings(base=self.base).check(sizes)
