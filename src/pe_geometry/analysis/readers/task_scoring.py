"""A task's answers scored as a user would get them: generated, not teacher-forced.

Teacher-forced token accuracy (``data.tasks.answer_accuracy``) feeds the true answer and asks for each next token:
once the first digit of a passkey is given, the rest can be copied from after the only digit string in the filler,
so it rewards a model that never retrieved. ``greedy_answers`` instead gives the model everything before the answer
and lets it write the answer itself, one greedy token at a time through its KV cache (``model.sampling.generate``,
temperature 0, the whole text in view), as the passkey literature scores it. Per example it returns exact match (the
headline), the first answer token (for a passkey: the retrieval itself), the answer tokens right, and the tokens
written, so any other reading can be recomputed from the records.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from pe_geometry.model.sampling import generate

TOKENS_PER_FORWARD = 16384  # prompts decoded together: their tokens at most this many


def answer_span(answer_mask: Tensor) -> tuple[int, int]:
    """(start, length) of one example's answer, which must be one contiguous run at the end of what it says."""
    where = answer_mask.nonzero().flatten()
    if len(where) == 0:
        raise ValueError("an example without answer tokens")
    start, length = int(where[0]), len(where)
    if not torch.equal(where, torch.arange(start, start + length, device=where.device)):
        raise ValueError(f"the answer tokens are not contiguous ({where.tolist()}): greedy decoding writes one run")
    return start, length


@torch.no_grad()
def greedy_answers(model, blocks: Tensor, answer_mask: Tensor) -> dict[str, np.ndarray | list]:
    """Each example's answer written by the model (``blocks`` (B, T), ``answer_mask`` (B, T) as a ``TaskBatch`` holds
    them). Returns per example ``exact_match`` (0/1), ``first_token`` (0/1), ``correct`` and ``n_answer`` (answer
    tokens right / in all), and ``written`` (the ids the model wrote, one list per example)."""
    model.eval()
    device = next(model.parameters()).device
    spans = [answer_span(m) for m in answer_mask]
    n = len(spans)
    exact, first, correct = np.zeros(n), np.zeros(n), np.zeros(n)
    n_answer = np.array([length for _, length in spans], dtype=float)
    written: list[list[int]] = [[] for _ in range(n)]
    groups: dict[tuple[int, int], list[int]] = {}
    for i, span in enumerate(spans):
        groups.setdefault(span, []).append(i)
    for (start, length), members in groups.items():
        per_forward = max(1, TOKENS_PER_FORWARD // max(1, start + length))
        for at in range(0, len(members), per_forward):
            rows = torch.tensor(members[at : at + per_forward])
            prompt = blocks[rows, :start].to(device)
            truth = blocks[rows, start : start + length].to(device)
            out = generate(model, prompt, length, temperature=0.0)[:, start:]
            right = out == truth
            exact[rows.numpy()] = right.all(1).double().cpu().numpy()
            first[rows.numpy()] = right[:, 0].double().cpu().numpy()
            correct[rows.numpy()] = right.sum(1).double().cpu().numpy()
            for row, ids in zip(rows.tolist(), out.cpu().tolist(), strict=True):
                written[row] = ids
    return {"exact_match": exact, "first_token": first, "correct": correct, "n_answer": n_answer, "written": written}
