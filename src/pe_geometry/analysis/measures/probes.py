"""What the measures are taken on: one rule for the word rows of the trained models and the pretrained
checkpoint alike (``frequent_token_ids``: the most frequent tokens of a token stream). The block 0
attention split, for both, is ``analysis.attention_split``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor


def frequent_token_ids(stream: np.ndarray | Sequence[int], vocab_size: int, n: int, exclude: Sequence[int]) -> tuple[Tensor, Tensor]:
    """The ``n`` most frequent token ids of a stream and their counts, most frequent first.

    Ids in ``exclude`` (special tokens) and ids that never occur are left out; ties go to the lower id.
    """
    counts = np.bincount(np.asarray(stream, dtype=np.int64), minlength=vocab_size)[:vocab_size].astype(np.int64)
    counts[list(exclude)] = 0
    order = np.argsort(-counts, kind="stable")[:n]
    order = order[counts[order] > 0]
    return torch.from_numpy(order), torch.from_numpy(counts[order])
