"""Plain-torch Transformer parts: usable without Lightning or Hydra."""

from model.attention import ExplicitAttention, MultiHeadAttention, SDPAttention
from model.embedding import TokenEmbedding
from model.positional import ALiBiPE, LearnedPE, NoPE, PositionalEncoding, RotaryPE, SinusoidalPE
from model.transformer import DecoderLM, EncoderDecoder, EncoderMLM, LanguageModel, mask_tokens

__all__ = [
    "ALiBiPE", "DecoderLM", "EncoderDecoder", "EncoderMLM", "ExplicitAttention", "LanguageModel",
    "LearnedPE", "MultiHeadAttention", "NoPE", "PositionalEncoding", "RotaryPE", "SDPAttention",
    "SinusoidalPE", "TokenEmbedding", "mask_tokens",
]
