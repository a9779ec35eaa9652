"""Plain-torch Transformer parts: usable without Lightning or Hydra."""

from pe_geometry.model.attention import ExplicitAttention, KVCache, MultiHeadAttention, SDPAttention
from pe_geometry.model.embedding import TokenEmbedding
from pe_geometry.model.positional import ALiBiPE, LearnedPE, NoPE, PositionalEncoding, RotaryPE, SinusoidalPE
from pe_geometry.model.transformer import DecoderLM, EncoderDecoder, EncoderMLM, LanguageModel, ModelConfig, mask_tokens

__all__ = [
    "ALiBiPE", "DecoderLM", "EncoderDecoder", "EncoderMLM", "ExplicitAttention", "KVCache", "LanguageModel",
    "LearnedPE", "ModelConfig", "MultiHeadAttention", "NoPE", "PositionalEncoding", "RotaryPE", "SDPAttention",
    "SinusoidalPE", "TokenEmbedding", "mask_tokens",
]
