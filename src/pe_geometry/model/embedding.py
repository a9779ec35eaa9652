"""Token embeddings: plain lookup, or scaled by sqrt(d_model) as in Vaswani et al."""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor, nn

from pe_geometry.settings.model import EmbeddingSettings

INIT_STD = 0.02  # std of every weight matrix's normal init (GPT-2); LanguageModel applies it to E


class TokenEmbedding(nn.Module):
    """nn.Embedding, optionally multiplied by sqrt(d_model) before position is added.

    ``tie_weights`` asks the model to reuse this matrix as its output head.
    ``scale`` is the factor actually applied, so analysis can measure what is added.
    """

    Settings = EmbeddingSettings

    def __init__(self, vocab_size: int, d_model: int, **settings: Any) -> None:
        super().__init__()
        self.settings = self.Settings(**settings)
        self.embed = nn.Embedding(vocab_size, d_model)
        self.scale = math.sqrt(d_model) if self.settings.scaled else 1.0
        self.tie_weights = self.settings.tie_weights

    @property
    def weight(self) -> Tensor:
        return self.embed.weight

    def forward(self, idx: Tensor) -> Tensor:
        return self.embed(idx) * self.scale if self.scale != 1.0 else self.embed(idx)
