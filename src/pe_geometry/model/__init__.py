"""Plain-torch Transformer parts: usable without Lightning or Hydra."""

from pe_geometry.model.attention import ExplicitAttention, KVCache, MultiHeadAttention, SDPAttention
from pe_geometry.model.embedding import TokenEmbedding
from pe_geometry.model.forgetting import ForgettingPE
from pe_geometry.model.positional import (
    ALiBiPE,
    CoPE,
    FirePE,
    KerplePE,
    LearnedPE,
    NoPE,
    PositionalEncoding,
    RotaryPE,
    SinusoidalPE,
    T5BiasPE,
    XPosPE,
)
from pe_geometry.model.transformer import DecoderLM, EncoderDecoder, EncoderMLM, LanguageModel, ModelConfig, mask_tokens

__all__ = [
    "ALiBiPE", "CoPE", "DecoderLM", "EncoderDecoder", "EncoderMLM", "ExplicitAttention", "FirePE", "ForgettingPE", "KVCache",
    "KerplePE", "LanguageModel", "LearnedPE", "ModelConfig", "MultiHeadAttention", "NoPE", "PositionalEncoding", "RotaryPE", "SDPAttention",
    "SinusoidalPE", "T5BiasPE", "TokenEmbedding", "XPosPE", "mask_tokens",
]
