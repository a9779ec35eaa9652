"""The settings of the model layouts (``model=decoder|encoder|encoder_decoder|xtransformers``) and of the word
embedding (``embedding=``), and ``model.layer_pattern`` read into one scheme per layer.

``ModelSettings`` holds what every layout shares (sizes, normalisation, the layer pattern) and its one cross-key rule,
``d_model`` divisible by ``n_heads`` (checked here and nowhere else); each layout adds what only it has. The torch side
(``pe_geometry.model.transformer.ModelConfig``) adds the vocabulary and the factories of the parts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from annotated_types import Ge, Interval

from pe_geometry.settings.base import Settings, SettingsError, component

LAYER_KEYS = ("pe", "window")


@dataclass(frozen=True)
class LayerScheme:
    """One layer's position scheme in a ``layer_pattern``: ``pe`` None (the model's encoding), "none" (no encoding in
    this layer: NoPE) or settings for the model's encoding family (``{"base": 1e6}``); ``window`` the attention
    window (None: every earlier position), or ``inherit`` (the attention's own setting)."""

    entry: int  # which entry of the pattern (layers that share an entry share its encoding module)
    pe: Mapping[str, Any] | str | None = None
    window: int | None | str = "inherit"

    def describe(self, family: str) -> str:
        """A short label: 'rope (base 1e+06), window 16', 'none', 'rope'."""
        if self.pe == "none":
            label = "none"
        elif self.pe:
            label = f"{family} ({', '.join(f'{k} {v:g}' if isinstance(v, float) else f'{k} {v}' for k, v in self.pe.items())})"
        else:
            label = family
        return label if self.window == "inherit" else f"{label}, window {self.window or 'all'}"


def _plain(value: Any) -> Any:
    """A config's nested mappings and lists (Hydra's DictConfig/ListConfig too) as dicts and lists."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str):
        return [_plain(v) for v in value]
    return value


def layer_schemes(pattern: Sequence[Mapping[str, Any]] | None, n_layers: int) -> list[LayerScheme] | None:
    """``model.layer_pattern`` read: one LayerScheme per layer (the pattern cycled over ``n_layers``), or None
    without a pattern. A bad entry is one ValueError line naming it and the valid keys and values."""
    if pattern is None:
        return None
    pattern = _plain(pattern)
    if not isinstance(pattern, list) or not pattern:
        raise ValueError(f"model.layer_pattern={pattern!r} must be a non-empty list of layer entries "
                         f"(keys {list(LAYER_KEYS)}), cycled over the layers; null: every layer alike")
    if len(pattern) > n_layers:  # its tail would never be built, yet the run's label names it
        raise ValueError(f"model.layer_pattern has {len(pattern)} entries and model.n_layers={n_layers}: entries "
                         f"{n_layers}..{len(pattern) - 1} would build no layer; give at most {n_layers} entries "
                         "(a shorter pattern is cycled) or raise model.n_layers")
    schemes = []
    for j, entry in enumerate(pattern):
        where = f"model.layer_pattern[{j}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}={entry!r} must be a mapping with keys among {list(LAYER_KEYS)}")
        unknown = sorted(set(entry) - set(LAYER_KEYS))
        if unknown:
            raise ValueError(f"{where} has unknown key(s) {unknown}; valid: {list(LAYER_KEYS)}")
        pe = entry.get("pe")
        if not (pe is None or pe == "none" or isinstance(pe, dict)):
            raise ValueError(f"{where}.pe={pe!r} must be 'none' (no encoding in this layer) or settings of the model's "
                             "pe (e.g. {base: 1000000})")
        window = entry.get("window", "inherit")
        if window != "inherit" and window is not None and (isinstance(window, bool) or not isinstance(window, int)
                                                            or window < 1):
            raise ValueError(f"{where}.window={window!r} must be an integer >= 1 (positions a query sees) or null (all)")
        schemes.append(LayerScheme(j, pe or None, window))
    return [schemes[i % len(schemes)] for i in range(n_layers)]



@dataclass(frozen=True)
class ModelSettings(Settings):
    """What every layout shares: sizes, normalisation and the layer pattern.

    ``n_layers`` counts the blocks of one stack (an encoder-decoder has that many on each side). ``layer_pattern``
    gives the layers position schemes of their own, cycled over the layers (as models since 2024 mix them): each
    entry sets a layer's attention ``window`` and its encoding, ``pe: none`` (NoPE in that layer: SmolLM3 and
    Llama 4 put one NoPE layer after three RoPE layers) or settings of the model's encoding family (Gemma 3: five
    windowed layers with RoPE base 1e4, then one global layer with base 1e6). Encodings that act inside attention
    only: a family that adds a term to the input (sinusoidal, learned) is added once, before every layer.
    """

    group: ClassVar[str] = "model"
    objective: ClassVar[str] = ""  # what the layout is trained on: next-token, masked-lm, seq2seq

    d_model: Annotated[int, Ge(1)] = 128
    n_heads: Annotated[int, Ge(1)] = 4
    n_layers: Annotated[int, Ge(1)] = 4
    d_ff: Annotated[int | None, Ge(1), "null for 4 * d_model"] = None
    dropout: Annotated[float, Interval(ge=0, lt=1), "a probability"] = 0.0
    norm: Literal["pre", "post"] = "pre"  # "pre" (GPT-2) or "post" (Vaswani et al.)
    layer_pattern: Annotated[list[dict[str, Any]] | None, "entries {pe: none | {settings}, window: N | null}, cycled",
                             "null: every layer alike"] = None
    # the training loss: the head and its cross-entropy fused, this many rows at a time (model/loss.py), so the full
    # (tokens, vocab) logits are never held: the same loss and gradients to float rounding, 1.1x the steps/s and 0.6x
    # a step's memory on 2 CPU cores (experiments/benchmark.py --options). model=xtransformers computes its logits.
    loss_chunk: Annotated[int | None, Ge(1), "rows of logits at a time in the fused head + cross-entropy",
                          "null: the full logits, then F.cross_entropy"] = 1024

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.d_model % self.n_heads:
            divisors = [h for h in range(1, min(self.d_model, 64) + 1) if self.d_model % h == 0]
            raise SettingsError(f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}; valid "
                                f"n_heads: {divisors}")
        try:
            self.layer_schemes()  # a bad entry: one line, before anything is built
        except ValueError as err:
            raise SettingsError(str(err)) from None

    def layer_schemes(self) -> list[LayerScheme] | None:
        return layer_schemes(self.layer_pattern, self.n_layers)

    @property
    def mlp_width(self) -> int:
        """The MLP's hidden width: ``d_ff``, or 4 * d_model when it is None."""
        return self.d_ff or 4 * self.d_model


@component("pe_geometry.model.DecoderLM", "pe_geometry.model.transformer.DecoderLM")
@dataclass(frozen=True)
class DecoderSettings(ModelSettings):
    """A causal Transformer trained on next-token prediction (GPT)."""

    objective: ClassVar[str] = "next-token"


@component("pe_geometry.model.EncoderMLM", "pe_geometry.model.transformer.EncoderMLM")
@dataclass(frozen=True)
class EncoderSettings(ModelSettings):
    """A bidirectional Transformer trained as a masked language model (BERT)."""

    objective: ClassVar[str] = "masked-lm"

    mask_prob: Annotated[float, Interval(gt=0, lt=1)] = 0.15  # the share of positions chosen for the loss


@component("pe_geometry.model.EncoderDecoder", "pe_geometry.model.transformer.EncoderDecoder")
@dataclass(frozen=True)
class EncoderDecoderSettings(ModelSettings):
    """The original layout: the encoder reads the first ``src_fraction`` of a block, the decoder predicts the rest."""

    objective: ClassVar[str] = "seq2seq"

    n_layers: Annotated[int, Ge(1), "blocks on each side"] = 2
    src_fraction: Annotated[float, Interval(gt=0, lt=1)] = 0.5


PEER_FAMILIES = ("rope", "xpos", "alibi", "t5_bias", "cope", "none", "dynamic_bias")


@component("pe_geometry.model.peer.XTransformersLM")
@dataclass(frozen=True)
class PeerSettings(ModelSettings):
    """x-transformers' own decoder behind our interface (``model=xtransformers``), its encoding one of x-transformers'
    switches (``peer_pe``). No layer pattern: x-transformers has its own."""

    objective: ClassVar[str] = "next-token"

    peer_pe: Literal[PEER_FAMILIES] = "rope"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layer_pattern is not None:
            raise SettingsError("model.layer_pattern: model=xtransformers builds x-transformers' own layers; valid: null")
        if self.d_ff is not None and int(self.d_model * (self.d_ff / self.d_model)) != self.d_ff:
            raise SettingsError(f"model.d_ff={self.d_ff}: x-transformers sets the MLP width as int(d_model * ff_mult), "
                                f"which cannot reach {self.d_ff} at d_model={self.d_model}; choose a multiple of d_model")


@component("pe_geometry.model.TokenEmbedding", "pe_geometry.model.embedding.TokenEmbedding")
@dataclass(frozen=True)
class EmbeddingSettings(Settings):
    """The word embedding: scaled by sqrt(d_model) or not, and tied to the output head or not."""

    group: ClassVar[str] = "embedding"

    scaled: bool = False  # multiply by sqrt(d_model) before position is added (Vaswani et al.)
    tie_weights: bool = True  # the output head reuses this matrix
