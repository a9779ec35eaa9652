"""Token embeddings: plain lookup, or scaled by sqrt(d_model) as in Vaswani et al."""

from __future__ import annotations

import math

from torch import Tensor, nn

INIT_STD = 0.02  # std of every weight matrix's normal init (GPT-2); LanguageModel applies it to E


class TokenEmbedding(nn.Module):
    """nn.Embedding, optionally multiplied by sqrt(d_model) before position is added.

    ``tie_weights`` asks the model to reuse this matrix as its output head.
    ``scale`` is the factor actually applied, so analysis can measure what is added.
    """

    def __init__(self, vocab_size: int, d_model: int, scaled: bool = False, tie_weights: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.scale = math.sqrt(d_model) if scaled else 1.0
        self.tie_weights = tie_weights

    @property
    def weight(self) -> Tensor:
        return self.embed.weight

    def forward(self, idx: Tensor) -> Tensor:
        return self.embed(idx) * self.scale if self.scale != 1.0 else self.embed(idx)
