"""The settings of the attention variants (``attention=sdpa|explicit``): grouped keys, QK-norm, a window, log-n
scaling. Both kernels take the same settings; ``pe_geometry.model.attention`` builds them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar

from annotated_types import Ge, Gt

from pe_geometry.settings.base import Settings, SettingsError, Sizes, component


@component("pe_geometry.model.SDPAttention", "pe_geometry.model.attention.SDPAttention", "pe_geometry.model.ExplicitAttention",
           "pe_geometry.model.attention.ExplicitAttention", "pe_geometry.model.attention.MultiHeadAttention")
@dataclass(frozen=True)
class AttentionSettings(Settings):
    """Multi-head attention's variants (model/attention.py's docstring says what each does)."""

    group: ClassVar[str] = "attention"

    n_kv_heads: Annotated[int | None, Ge(1), "dividing model.n_heads; 1: multi-query", "null for model.n_heads"] = None
    qk_norm: bool = False  # normalise q and k per head; a learned temperature sets the logits' scale
    qk_norm_scale: Annotated[float, Gt(0), "the learned temperature's start"] = 10.0
    window: Annotated[int | None, Ge(1), "positions a query sees", "null for all"] = None
    logn_scaling: bool = False  # queries past the training length scaled by log n / log training_length
    training_length: Annotated[int | None, Ge(2), "the length trained at"] = None  # what logn_scaling scales from

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.logn_scaling and self.training_length is None:
            raise SettingsError("attention.logn_scaling=true needs attention.training_length >= 2 (the length the model "
                                "was trained at; log n / log training_length), got null")

    def check(self, sizes: Sizes) -> None:
        n_kv, n_heads = self.n_kv_heads, sizes.n_heads
        if n_kv is not None and n_heads % n_kv:
            divisors = [h for h in range(1, n_heads + 1) if n_heads % h == 0]
            raise SettingsError(f"attention.n_kv_heads={n_kv} must divide model.n_heads={n_heads} (each key/value head "
                                f"serves n_heads/n_kv_heads query heads); valid: {divisors} or null")

    def warnings(self, sizes: Sizes, precision: str = "32-true") -> list[str]:
        if self.window is not None and self.window >= sizes.seq_len:
            return [f"attention.window={self.window} is at least data.seq_len={sizes.seq_len}: in training every query "
                    "sees all its keys; the window acts only on longer texts"]
        return []
