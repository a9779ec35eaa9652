"""Where every position encoding puts position in the attention: one axis for all ten families.

Two figures per head, defined the same way whatever the encoding:

- **positional share of block 0's score variance**: the share of the variance of the logits along the keys a
  query sees (what the softmax sees; pooled over queries and sequences) that comes from position-dependent
  terms. For an encoding added to the input (sinusoidal, learned) those are the four position terms of
  ``analysis.attention_split``. For every other family block 0 reads word embeddings only, so its content
  score q.k is position-free and the position term is what the encoding adds (``score_parts``, from the hook
  points the forward recorded: model/attention.py): the change its rotation made to q.k (RoPE, xPos), or the
  score bias (ALiBi, T5, FIRE, Kerple, CoPE). NoPE adds nothing: 0. With S = content + position and S_c its
  row-centred, masked copy, the share is Cov(position, S) / Var(S) = sum(position * S_c) / sum(S_c^2) (S_c's
  rows sum to 0, so the term needs no centring), the same estimator as ``attention_split.term_shares``.
- **mean attention distance**: sum_j w_ij |i - j| under the softmax weights, averaged over queries and
  sequences, per layer and head (how local each head is), under the softmax of the logits each block recorded;
  its chance is the same with uniform weights over the keys each query sees.

A rotation's share has a null: the same q and k multiplied by one random orthogonal matrix per head before the
rotation (Haar, sign-fixed QR) keep every content score q.k exactly and spread the head's energy over the
rotation pairs at random, so the null asks how much variance the rotation would add if the head had not chosen
which frequencies to use. A score bias is position by construction (no null; what it is measured against is
the content variance it competes with).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pe_geometry.analysis.attention_split import (
    _total_gap,
    check_total,
    first_layer_attention_split,
    recorded_attention,
)
from pe_geometry.model.attention import MultiHeadAttention
from pe_geometry.model.positional import RotaryPE
from pe_geometry.model.transformer import LanguageModel, record_attention


def _mask(model: LanguageModel, T: int, device: torch.device) -> Tensor:
    """(T, T) bool: the keys each query of block 0's self-attention sees (causal, a sliding window's band, or all)."""
    return model.blocks[0].attn.visible_keys_mask(T, model.input_stack.causal, device)


def _share_sums(content: Tensor, position: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(Cov(position, S), Var(S)) summed over queries and sequences, per head, float64: (H,) each."""
    S = (content + position).double().masked_fill(~mask, 0.0)
    n_keys = mask.sum(dim=-1, keepdim=True).clamp_min(1)
    S_c = (S - S.sum(dim=-1, keepdim=True) / n_keys).masked_fill(~mask, 0.0)
    return (position.double() * S_c).sum(dim=(0, 2, 3)), (S_c * S_c).sum(dim=(0, 2, 3))


def sequence_points(recorded: dict[str, Tensor | None], b: int) -> dict[str, Tensor | None]:
    """Sequence b of a block's recorded hook points (a (B, ...) point's row b kept as a batch of one; the points
    shared by every sequence, an (H, T, S) score bias or the (T, 1) query scale, as they are)."""
    return {name: t[b : b + 1] if t is not None and t.dim() == 4 else t for name, t in recorded.items()}


def score_parts(
    attn: MultiHeadAttention, recorded: dict[str, Tensor | None], mix: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """A self-attention's recorded scores split as content + position, (B, H, T, S) float32 each.

    content = q.k / sqrt(d_head) of the projections before the encoding's hooks (the recorded ``q_pre``,
    ``k_pre``; under ``qk_norm`` normalised: tau_h cos(q, k)); position = what the encoding adds to it: the change
    its rotation made to q.k (the recorded ``q``, ``k``: RoPE, xPos) plus the recorded ``score_bias`` (ALiBi, T5,
    FIRE, Kerple, CoPE's contextual one); both times the recorded ``query_scale`` (logn_scaling). content +
    position are the recorded ``logits`` on the keys each query sees (position is 0 for an encoding without
    hooks). Keys per query head (grouped-query attention repeats the shared ones). ``mix`` (H, d_head, d_head),
    orthogonal: q and k of head h multiplied by mix[h] before the encoding's rotation (``attn.pe.rotate_qk``,
    applied here to the mixed projections), which keeps every content score and moves the head's q/k energy to
    other rotation pairs (the rotation null; the score bias is the recorded one: a rotation has no contextual bias).
    """
    q, k = recorded["q_pre"], attn._per_query_head(recorded["k_pre"], dim=1)
    if mix is None:
        q_enc, k_enc = recorded["q"], attn._per_query_head(recorded["k"], dim=1)
    else:
        q, k = q @ mix.to(q.dtype), k @ mix.to(k.dtype)
        q_enc, k_enc = attn.pe.rotate_qk(q, k, 0)
    scale = 1.0 / math.sqrt(attn.d_head)
    content = (q @ k.transpose(-2, -1)).float() * scale
    position = (q_enc @ k_enc.transpose(-2, -1)).float() * scale - content
    if recorded["score_bias"] is not None:
        position = position + recorded["score_bias"].float()
    factor = recorded["query_scale"]
    if factor is not None:
        content, position = content * factor, position * factor
    return content, position


def _relative_position_shares(
    attn: MultiHeadAttention, recorded: dict[str, Tensor | None], mask: Tensor, mix: Tensor | None = None
) -> Tensor:
    """relative_position_shares from block 0's recorded points; without ``mix``, checks content + position against
    the recorded logits."""
    cov = var = 0.0
    gap = largest = 0.0
    for b in range(recorded["q"].shape[0]):  # one sequence at a time: (1, H, T, T) float64 per term
        one = sequence_points(recorded, b)
        content, position = score_parts(attn, one, mix)
        c, v = _share_sums(content, position, mask)
        cov, var = cov + c, var + v
        if mix is None:
            g, top = _total_gap((content + position).masked_fill(~mask, float("-inf")), one["logits"])
            gap, largest = max(gap, g), max(largest, top)
    if mix is None:
        check_total(gap, largest, recorded["logits"].dtype, "block 0's content + position")
    return cov / var


def relative_position_shares(model: LanguageModel, idx: Tensor, mix: Tensor | None = None) -> Tensor:
    """Block 0's positional share per head (H,) float64 for an encoding acting inside attention (see module doc),
    from block 0's hook points recorded on idx (B, T). ``mix`` (H, d_head, d_head) orthogonal: as ``score_parts``'
    (the rotation null's draws)."""
    mask = _mask(model, idx.shape[1], idx.device)
    return _relative_position_shares(model.blocks[0].attn, recorded_attention(model, idx)[0], mask, mix)


def haar_orthogonal(n: int, d: int, generator: torch.Generator) -> Tensor:
    """n independent Haar-random (d, d) orthogonal matrices: QR of Gaussians, columns' signs fixed by diag(R)."""
    q, r = torch.linalg.qr(torch.randn(n, d, d, generator=generator, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)


def rotation_share_draws(model: LanguageModel, idx: Tensor, n_draws: int = 20, seed: int = 0) -> Tensor:
    """The rotation null's positional share per head in each of ``n_draws`` draws: (n_draws, H) (see module doc);
    block 0 runs once, every draw mixes its recorded projections."""
    attn = model.blocks[0].attn
    recorded, mask = recorded_attention(model, idx)[0], _mask(model, idx.shape[1], idx.device)
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([
        _relative_position_shares(attn, recorded, mask, haar_orthogonal(attn.n_heads, attn.d_head, generator).to(idx.device))
        for _ in range(n_draws)])


def positional_share(model: LanguageModel, idx: Tensor) -> Tensor:
    """Block 0's positional share per head (H,) float64, for every family: the additive split for an input-table
    encoding, the encoding's own term otherwise (0 for NoPE)."""
    if model.W_pos is not None:
        return first_layer_attention_split(model, idx)["positional"]
    return relative_position_shares(model, idx)


def has_rotation(model: LanguageModel) -> bool:
    """Whether the encoding rotates queries and keys (RoPE, xPos): the families whose share has a null."""
    return isinstance(model.input_stack.pe, RotaryPE)


def mean_attention_distance(model: LanguageModel, idx: Tensor, n_blocks: int | None = None) -> tuple[Tensor, Tensor]:
    """(distance (n_blocks, H), chance (n_blocks, H)): mean |i - j| under each head's softmax weights, and under
    uniform weights over the keys each query sees (the same for every head), averaged over queries and sequences;
    in the first ``n_blocks`` blocks (None: all)."""
    T = idx.shape[1]
    mask = _mask(model, T, idx.device)
    positions = torch.arange(T, device=idx.device, dtype=torch.float64)
    distance = (positions[:, None] - positions[None, :]).abs()  # (T, T)
    uniform = mask.double() / mask.sum(dim=-1, keepdim=True)
    chance = float((uniform * distance).sum(dim=-1).mean())
    blocks = range(len(model.blocks))[:n_blocks]
    out = []
    with record_attention(model, blocks, points=("logits",)) as record:
        # the state after block i is yielded once block i has run: its recorded logits are read, then dropped
        for i, _ in zip(range(-1, len(blocks)), model.iter_hidden_states(idx)):
            if i < 0:
                continue
            total = 0.0
            for logits in record[i]["logits"].split(1):  # (1, H, T, T), -inf on the keys a query does not see
                weights = logits.double().softmax(dim=-1)
                total = total + (weights * distance).sum(dim=-1).mean(dim=-1).sum(dim=0)  # (H,)
            record[i]["logits"] = None
            out.append(total / idx.shape[0])
    result = torch.stack(out)
    return result, torch.full_like(result, chance)


def position_attention_report(model: LanguageModel, idx: Tensor, n_draws: int = 20, seed: int = 0) -> dict:
    """Both figures of a trained model on token blocks idx (B, T), as plain lists (JSON-ready):

    ``positional_share`` (H,) block 0; ``null_mean`` / ``null_std`` (H,) for a rotation (else absent);
    ``mean_distance`` (n_layers, H); ``distance_chance`` (n_layers,), uniform attention's.
    """
    with torch.no_grad():
        report = {"positional_share": positional_share(model, idx).tolist()}
        if has_rotation(model):
            draws = rotation_share_draws(model, idx, n_draws, seed)
            report |= {"null_mean": draws.mean(dim=0).tolist(), "null_std": draws.std(dim=0).tolist()}
        distance, chance = mean_attention_distance(model, idx)
    return report | {"mean_distance": distance.tolist(), "distance_chance": chance[:, 0].tolist()}
