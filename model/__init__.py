"""Plain-torch Transformer parts: usable without Lightning or Hydra."""

from model.attention import ExplicitAttention, KVCache, MultiHeadAttention, SDPAttention
from model.embedding import TokenEmbedding
from model.positional import ALiBiPE, LearnedPE, NoPE, PositionalEncoding, RotaryPE, SinusoidalPE
from model.transformer import DecoderLM, EncoderDecoder, EncoderMLM, LanguageModel, mask_tokens

__all__ = [
    "ALiBiPE", "DecoderLM", "EncoderDecoder", "EncoderMLM", "ExplicitAttention", "KVCache", "LanguageModel",
    "LearnedPE", "MultiHeadAttention", "NoPE", "PositionalEncoding", "RotaryPE", "SDPAttention",
    "SinusoidalPE", "TokenEmbedding", "mask_tokens",
]
