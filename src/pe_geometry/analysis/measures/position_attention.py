"""Where every position encoding puts position in the attention: one axis for every family.

Two figures per head, defined the same way whatever the encoding:

- **positional share of block 0's score variance**: the share of the variance of the logits along the keys a
  query sees (what the softmax sees; pooled over queries and sequences) that comes from position-dependent
  terms. For an encoding added to the input (sinusoidal, learned) those are the four position terms of
  ``analysis.attention_split``. For every other family block 0 reads word embeddings only, so its content
  score q.k is position-free and the position term is what the encoding adds (``score_parts``, from the hook
  points the forward recorded: model/attention.py): the change its rotation made to q.k (RoPE, xPos), or the
  score bias (ALiBi, T5, FIRE, Kerple, CoPE, and the Forgetting Transformer's gate bias: see below). NoPE adds
  nothing: 0. With S = content + position and S_c its
  row-centred, masked copy, the share is Cov(position, S) / Var(S) = sum(position * S_c) / sum(S_c^2) (S_c's
  rows sum to 0, so the term needs no centring), the same estimator as ``attention_split.term_shares``.
- **every block's positional share** (``layer_positional_shares``): the same, block by block, for an encoding
  acting inside attention (each block's scores over the keys its own queries see; a layer pattern's NoPE layer: 0).
  An input-table encoding has the additive split in block 0 only.
- **mean attention distance**: sum_j w_ij |i - j| under the softmax weights, averaged over queries and
  sequences, per layer and head (how local each head is), under the softmax of the logits each block recorded;
  its chance is the same with uniform weights over the keys each query sees.

The Forgetting Transformer (pe=forgetting) is measured the same way, with a caveat: its score bias D_ij (the log
forget gates summed from key j to query i) is read from the tokens, so its "position" term is the decay the gates
put on the scores, which depends on what the tokens are as well as on how far apart they are (a gate at 1 gives 0,
as NoPE; a gate fixed at f gives ALiBi with slope -log f). With ``pe.rotary=true`` the rotation's change is added to
it, and the rotation null below applies (the recorded gate bias kept as it is).

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

from pe_geometry.analysis.measures.attention_split import (
    _total_gap,
    analysis_rng,
    check_total,
    first_layer_attention_split,
    recorded_attention,
)
from pe_geometry.model.attention import MultiHeadAttention
from pe_geometry.model.positional import RotaryPE
from pe_geometry.model.transformer import LanguageModel, record_attention


def _mask(model: LanguageModel, T: int, device: torch.device, block: int = 0) -> Tensor:
    """(T, T) bool: the keys each query of a block's self-attention sees (causal, a sliding window's band, or all;
    a layer pattern gives each layer its own window)."""
    return model.blocks[block].attn.visible_keys_mask(T, model.input_stack.causal, device)


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


def recorded_score_parts(recorded: dict[str, Tensor | None]) -> tuple[Tensor, Tensor]:
    """One self-attention's recorded scores split as content + position, (B, H, T, S) float32 each, from its hook
    points alone: what this framework's models record (model/attention.py) and what ``analysis.checkpoints`` records
    of a transformers model, so both are read by the same estimator.

    content = q_pre.k_pre x ``scaling`` (the projections before the encoding; under qk_norm already normalised);
    position = what the encoding adds: q.k x scaling - content (a rotation's change: RoPE, xPos) plus ``score_bias``
    (ALiBi, T5, FIRE, Kerple, CoPE, FoX's gate bias); both times ``query_scale`` (logn_scaling) where recorded. Keys of shared heads
    (grouped-query attention) are repeated for the query heads of their group.
    """
    groups = recorded["q"].shape[1] // recorded["k"].shape[1]
    k, k_pre = (recorded[n].repeat_interleave(groups, dim=1) if groups > 1 else recorded[n] for n in ("k", "k_pre"))
    scale = recorded["scaling"]
    content = (recorded["q_pre"] @ k_pre.transpose(-2, -1)).float() * scale
    position = (recorded["q"] @ k.transpose(-2, -1)).float() * scale - content
    if recorded.get("score_bias") is not None:
        position = position + recorded["score_bias"].float()
    factor = recorded.get("query_scale")
    if factor is not None:
        content, position = content * factor, position * factor
    return content, position


def mixed_rotation(recorded: dict[str, Tensor | None], mix: Tensor, rotate) -> dict[str, Tensor | None]:
    """The rotation null's copy of a layer's points: q and k before the encoding (keys per query head) multiplied by
    mix[h] (H, d_head, d_head), orthogonal, then rotated by the encoding's own ``rotate(q, k) -> (q, k)``: every
    content score is kept, the head's energy moves to other rotation pairs (the score bias is the recorded one)."""
    groups = recorded["q"].shape[1] // recorded["k"].shape[1]
    k_pre = recorded["k_pre"].repeat_interleave(groups, dim=1) if groups > 1 else recorded["k_pre"]
    q, k = recorded["q_pre"] @ mix.to(recorded["q_pre"].dtype), k_pre @ mix.to(k_pre.dtype)
    q_enc, k_enc = rotate(q, k)
    return recorded | {"q_pre": q, "k_pre": k, "q": q_enc, "k": k_enc}


def score_parts(
    attn: MultiHeadAttention, recorded: dict[str, Tensor | None], mix: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``recorded_score_parts`` of one of this framework's self-attentions (``attn``: its d_head and encoding).
    ``mix`` (H, d_head, d_head), orthogonal: the rotation null's draw (``mixed_rotation`` with ``attn.pe.rotate_qk``)."""
    points = recorded | {"scaling": 1.0 / math.sqrt(attn.d_head)}
    if mix is not None:
        points = mixed_rotation(points, mix, lambda q, k: attn.pe.rotate_qk(q, k, 0))
    return recorded_score_parts(points)


def recorded_shares(recorded: dict[str, Tensor | None], visible: Tensor) -> Tensor:
    """The positional share per head (H,) float64 of one layer's recorded points (``recorded_score_parts``) over the
    keys each query sees (``visible`` (T, S) bool); checks content + position against the recorded logits."""
    content, position = recorded_score_parts(recorded)
    check_total(*_total_gap((content + position).masked_fill(~visible, float("-inf")), recorded["logits"]),
                recorded["logits"].dtype, "the content + position of the scores")
    cov, var = _share_sums(content, position, visible)
    return cov / var


def rotation_null_shares(recorded: dict[str, Tensor | None], visible: Tensor, rotate, n_draws: int = 20,
                         seed: int = 0) -> Tensor:
    """(n_draws, H): the positional share of each head when its q and k are mixed by a Haar-random orthogonal matrix
    before the encoding's ``rotate`` (``mixed_rotation``): the rotation null of the module docstring.

    What does not change between draws is computed once: the content score q_pre.k_pre (an orthogonal mix keeps it;
    ``recorded_score_parts`` of each mixed copy recomputed it, equal to rounding) and the keys repeated per query
    head; q and k are mixed by one matmul a draw, a (B (T + S), d) block per head (faster than B small ones). The
    draws are ``rotation_null_shares_reference``'s (the same generator, one draw after another), each share equal to
    its to rounding (tests/test_pretrained_speed.py)."""
    generator = torch.Generator().manual_seed(seed)
    q_pre = recorded["q_pre"]
    H, T, d = q_pre.shape[1:]
    groups = H // recorded["k"].shape[1]
    k_pre = recorded["k_pre"].repeat_interleave(groups, dim=1) if groups > 1 else recorded["k_pre"]
    scale, bias, factor = recorded["scaling"], recorded.get("score_bias"), recorded.get("query_scale")
    content = (q_pre @ k_pre.transpose(-2, -1)).float() * scale  # every draw's, before query_scale
    S = k_pre.shape[-2]
    # (H, B (T + S), d): one matmul a draw mixes q and k, one (B (T + S), d) x (d, d) product per head
    both = torch.cat([q_pre, k_pre.to(q_pre.dtype)], dim=2).transpose(0, 1).reshape(H, -1, d)
    bias = None if bias is None else bias.float()
    content_scaled = content if factor is None else content * factor
    draws = []
    for _ in range(n_draws):
        mix = haar_orthogonal(H, d, generator).to(device=q_pre.device, dtype=q_pre.dtype)
        mixed = (both @ mix).reshape(H, -1, T + S, d).transpose(0, 1)  # (B, H, T + S, d)
        q_enc, k_enc = rotate(mixed[:, :, :T], mixed[:, :, T:])
        position = (q_enc @ k_enc.transpose(-2, -1)).float() * scale - content
        if bias is not None:
            position = position + bias
        if factor is not None:
            position = position * factor
        cov, var = _share_sums(content_scaled, position, visible)
        draws.append(cov / var)
    return torch.stack(draws)


def rotation_null_shares_reference(recorded: dict[str, Tensor | None], visible: Tensor, rotate, n_draws: int = 20,
                                   seed: int = 0) -> Tensor:
    """``rotation_null_shares`` computed the straightforward way, one mixed copy of the points (``mixed_rotation``)
    and its ``recorded_score_parts`` a draw: the reference its fast path is tested against."""
    generator = torch.Generator().manual_seed(seed)
    H, d = recorded["q"].shape[1], recorded["q"].shape[-1]
    draws = []
    for _ in range(n_draws):
        mix = haar_orthogonal(H, d, generator).to(recorded["q"].device)
        cov, var = _share_sums(*recorded_score_parts(mixed_rotation(recorded, mix, rotate)), visible)
        draws.append(cov / var)
    return torch.stack(draws)


def recorded_distance(logits: Tensor, visible: Tensor) -> tuple[Tensor, float]:
    """Each head's mean |i - j| (H,) float64 under the softmax of one layer's recorded ``logits`` (B, H, T, S), -inf
    where hidden, averaged over queries and sequences (the queries are the last T of the S positions); and uniform
    attention's over the keys each query sees (``visible`` (T, S))."""
    T, S = visible.shape
    distance = (torch.arange(S - T, S, dtype=torch.float64, device=logits.device)[:, None]
                - torch.arange(S, dtype=torch.float64, device=logits.device)[None, :]).abs()
    total = 0.0
    for one in logits.split(1):  # (1, H, T, S) float64 at a time
        total = total + (one.double().softmax(dim=-1) * distance).sum(dim=-1).mean(dim=-1).sum(dim=0)
    uniform = visible.double() / visible.sum(dim=-1, keepdim=True)
    return total / logits.shape[0], float((uniform * distance).sum(dim=-1).mean())


def _relative_position_shares(
    attn: MultiHeadAttention, recorded: dict[str, Tensor | None], mask: Tensor, mix: Tensor | None = None,
    block: int = 0,
) -> Tensor:
    """relative_position_shares from a block's recorded points (``block``: which, for the check's message); without
    ``mix``, checks content + position against the recorded logits."""
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
        check_total(gap, largest, recorded["logits"].dtype, f"block {block}'s content + position")
    return cov / var


def relative_position_shares(model: LanguageModel, idx: Tensor, mix: Tensor | None = None) -> Tensor:
    """Block 0's positional share per head (H,) float64 for an encoding acting inside attention (see module doc),
    from block 0's hook points recorded on idx (B, T). ``mix`` (H, d_head, d_head) orthogonal: as ``score_parts``'
    (the rotation null's draws)."""
    mask = _mask(model, idx.shape[1], idx.device)
    return _relative_position_shares(model.blocks[0].attn, recorded_attention(model, idx)[0], mask, mix)


def layer_positional_shares(model: LanguageModel, idx: Tensor) -> Tensor:
    """Every block's positional share per head, (n_layers, H) float64, on token blocks idx (B, T).

    For an encoding acting inside attention, each block's is defined as block 0's (``relative_position_shares``):
    what the encoding adds to that block's scores (``score_parts`` of its recorded points) against their variance
    over the keys its queries see (``_mask`` of that block: its own window under a layer pattern); a layer without an
    encoding of its own (``layer_pattern`` pe: none) adds nothing: 0. Row 0 is ``positional_share``. An input-table
    encoding (``model.W_pos``) has the additive split in block 0 only (later blocks read a hidden state in which
    word and position are mixed): row 0 is block 0's split, the later rows NaN. One forward; each block's points are
    read once the block has run, then dropped (one block's points in memory at a time, as ``mean_attention_distance``).
    """
    n_layers = len(model.blocks)
    if model.W_pos is not None:
        share = first_layer_attention_split(model, idx)["positional"]
        later = torch.full((n_layers - 1, share.shape[0]), float("nan"), dtype=share.dtype, device=share.device)
        return torch.cat([share[None], later])
    T, rows = idx.shape[1], []
    with analysis_rng(idx.device), record_attention(model) as record:
        # the state after block i is yielded once block i has run: its recorded points are read, then dropped
        for i, _ in zip(range(-1, n_layers), model.iter_hidden_states(idx)):
            if i < 0:
                continue
            mask = _mask(model, T, idx.device, i)
            rows.append(_relative_position_shares(model.blocks[i].attn, record[i], mask, block=i))
            for name in record[i]:
                record[i][name] = None
    return torch.stack(rows)


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
    """Whether the encoding rotates queries and keys (RoPE, xPos, or RoPE inside another encoding as its ``rope``:
    pe=forgetting pe.rotary=true): the families whose share has a null."""
    pe = model.blocks[0].attn.pe  # block 0's (a layer pattern may give it another than the stack's)
    return isinstance(pe, RotaryPE) or isinstance(getattr(pe, "rope", None), RotaryPE)


def mean_attention_distance(model: LanguageModel, idx: Tensor, n_blocks: int | None = None) -> tuple[Tensor, Tensor]:
    """(distance (n_blocks, H), chance (n_blocks, H)): mean |i - j| under each head's softmax weights, and under
    uniform weights over the keys each query sees (the same for every head), averaged over queries and sequences;
    in the first ``n_blocks`` blocks (None: all)."""
    blocks = range(len(model.blocks))[:n_blocks]
    out, chances = [], []
    with record_attention(model, blocks, points=("logits",)) as record:
        # the state after block i is yielded once block i has run: its recorded logits are read, then dropped
        for i, _ in zip(range(-1, len(blocks)), model.iter_hidden_states(idx)):
            if i < 0:
                continue
            distance, chance = recorded_distance(record[i]["logits"], _mask(model, idx.shape[1], idx.device, i))
            record[i]["logits"] = None
            out.append(distance)
            chances.append(torch.full_like(distance, chance))
    return torch.stack(out), torch.stack(chances)


class NoHookPoints(TypeError):
    """A model without our attention hook points (a peer, model=xtransformers: x-transformers' own modules): these
    figures cannot be read off it."""


def position_attention_report(model: LanguageModel, idx: Tensor, n_draws: int = 20, seed: int = 0) -> dict:
    """Both figures of a trained model on token blocks idx (B, T), as plain lists (JSON-ready):

    ``positional_share`` (H,) block 0; ``null_mean`` / ``null_std`` (H,) for a rotation (else absent);
    ``positional_share_layers`` (n_layers, H): every block's (``layer_positional_shares``; row 0 is
    ``positional_share``; for an input-table encoding the rows past block 0 are None);
    ``mean_distance`` (n_layers, H); ``distance_chance`` (n_layers,), uniform attention's; with a layer pattern,
    ``layer_schemes`` (n_layers,): each layer's position scheme in words. A model that is not one of ours (a peer)
    raises ``NoHookPoints``, one line.
    """
    if not isinstance(model, LanguageModel):
        raise NoHookPoints(f"{type(model).__name__} (built from {getattr(model, 'peer', 'modules not ours')}) has none "
                           "of our attention hook points: no positional share or attention distance for it")
    with torch.no_grad():
        report = {"positional_share": positional_share(model, idx).tolist()}
        if has_rotation(model):
            draws = rotation_share_draws(model, idx, n_draws, seed)
            report |= {"null_mean": draws.mean(dim=0).tolist(), "null_std": draws.std(dim=0).tolist()}
        layers = layer_positional_shares(model, idx)
        distance, chance = mean_attention_distance(model, idx)
    report["positional_share_layers"] = [row.tolist() if i == 0 or model.W_pos is None else None
                                         for i, row in enumerate(layers)]
    report |= {"mean_distance": distance.tolist(), "distance_chance": chance[:, 0].tolist()}
    if any(block.scheme is not None for block in model.blocks):
        report["layer_schemes"] = model.input_stack.layer_labels(_family(model.input_stack.pe))
    return report


def _family(pe) -> str:
    """An encoding's family in the config's words (RotaryPE -> rope: the option whose _target_ names its class)."""
    from pe_geometry.analysis.readers.runs import _option_targets

    names = {target.rsplit(".", 1)[-1]: option for target, option in _option_targets("pe").items()}
    return names.get(type(pe).__name__, type(pe).__name__)
