"""First-layer attention scores split into word, position and bias terms, every one counted.

With x = e + p entering the attention of block 0 (after the layer norm's exact split,
``split_layernorm``: e' + p' + b' = LN(e + p), the constant b' folded into the biases),
q = x W_Q + b_Q and k = x W_K + b_K, the score of query i on key j is

    q_i . k_j = e_i W_Q . e_j W_K            word_word
              + p_i W_Q . p_j W_K            pos_pos
              + e_i W_Q . p_j W_K            word_pos
              + p_i W_Q . e_j W_K            pos_word
              + e_i W_Q . b_K + b_Q . e_j W_K    word_bias
              + p_i W_Q . b_K + b_Q . p_j W_K    pos_bias   (depends on position only)
              + b_Q . b_K                    bias_bias

(each divided by sqrt(d_head)). Position enters through pos_pos, word_pos, pos_word
and pos_bias: a head's positional share is the sum of those four shares. b_Q . p_j W_K
is the one to watch: it varies with the key's position alone and is invisible to a
count that looks at pos_pos only. (A second, uncounted route: the layer norm's 1/sigma
is taken from e + p, so the "word" parts carry a position-dependent scale.)

Shares are of score variance along the keys a query may see (what the softmax sees:
terms constant along a query's row, like e_i W_Q . b_K, cancel), pooled over queries.

The attention variants (model/attention.py) keep the split exact, i.e. the terms still sum to the logits:

- ``qk_norm``: q and k are l2-normalised per head after the projection (bias included) and the logit is
  tau_h cos(q_i, k_j) = (s_i q_i) . (t_j k_j) / sqrt(d_head), s_i = tau_h sqrt(d_head) / |q_i|, t_j = 1 / |k_j|
  (norms of the whole projected vectors). Every q-side part of query i (e_i W_Q, p_i W_Q, b_Q) is scaled by
  s_i and every k-side part of key j by t_j, as the layer norm's parts share 1/sigma, so the seven terms
  keep their names and stay linear. But the key bias is now t_j b_K, which varies along a query's row:
  e_i W_Q . b_K t_j, p_i W_Q . b_K t_j and b_Q . b_K t_j move the softmax and count (word_bias, pos_bias,
  bias_bias); without qk_norm they are constant along the row and their shares are 0. (The norms are a
  second uncounted route, like 1/sigma: |q_i| and |k_j| are taken from word + position + bias together.)
- ``logn_scaling``: query i's logits are multiplied by f_i = max(1, log n / log training_length); its q-side
  parts are scaled by f_i (a per-row scale keeps row-constant terms row-constant).
- ``window``: the keys a query may see are the layer's band (``visible_keys_mask``), not the causal mask.
- ``n_kv_heads``: W_K and b_K are read per query head (each shared key head repeated), so nothing changes.

The split is this module's own (the forward has no word and position parts), but what it reads of the forward and
its total come from the forward itself: block 0 runs once with its hook points recorded (``recorded_attention``,
``model.transformer.record_attention``), logn_scaling's factors are the recorded ``query_scale``, and the terms'
sum is checked against the recorded ``logits`` on the keys each query sees (``check_total``: a split that drifted
from the attention raises instead of logging shares of scores the model never computed).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pe_geometry.model.transformer import record_attention

TERMS = ("word_word", "pos_pos", "word_pos", "pos_word", "word_bias", "pos_bias", "bias_bias")
POSITIONAL_TERMS = ("pos_pos", "word_pos", "pos_word", "pos_bias")
_CHUNK_ELEMENTS = 1 << 24  # score entries (heads x T x T) split_shares holds at once: 64 MB in float32
_NORM_EPS = 1e-12  # F.normalize's floor on |q| and |k|, as the attention's qk_norm uses it
_TOTAL_RTOL = 1e-3  # check_total's tolerance, relative to the largest visible logit (float32 rounding: ~1e-6)


def _f64(x: Tensor) -> Tensor:
    return x.detach().to(torch.float64)


def split_layernorm(
    e: Tensor, p: Tensor, ln_weight: Tensor, ln_bias: Tensor | None = None, eps: float = 1e-5, dtype: torch.dtype = torch.float64
) -> tuple[Tensor, Tensor, Tensor]:
    """Split LN(e + p) into a word part e', a position part p' and a constant b'.

    LN(x) = g * (x - mu(x)) / sigma(x) + b is not linear in x, but with sigma taken from
    the sum x = e + p it splits exactly, because the mean is linear:
        (x - mu(x)) / sigma = (e - mu(e)) / sigma + (p - mu(p)) / sigma.
    So e' = g (e - mu(e)) / sigma, p' = g (p - mu(p)) / sigma, b' = b, and
    e' + p' + b' == LN(e + p). Each part is centred and shares the sum's 1/sigma,
    the standard convention for attributing through LayerNorm. e, p (..., D); computed in ``dtype``.
    """
    e, p = e.detach().to(dtype), p.detach().to(dtype)
    x = e + p
    sigma = (x.var(dim=-1, correction=0, keepdim=True) + eps).sqrt()
    g = ln_weight.detach().to(dtype)
    e_part = g * (e - e.mean(dim=-1, keepdim=True)) / sigma
    p_part = g * (p - p.mean(dim=-1, keepdim=True)) / sigma
    b_part = (ln_bias.detach().to(dtype) if ln_bias is not None else torch.zeros_like(g)).expand_as(x)
    return e_part, p_part, b_part


def _rescale(
    q_parts: tuple[Tensor, Tensor, Tensor],
    k_parts: tuple[Tensor, Tensor, Tensor],
    qk_temperature: Tensor | None,
    query_scale: Tensor | None,
) -> tuple[tuple[Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]:
    """The variants' scales applied to the projected parts, so that their q . k / sqrt(d_head) is the real logit.

    q_parts (word, position, bias) of the queries, k_parts of the keys, each (n_heads, T or 1, d_head) in one
    dtype. qk_temperature (n_heads,): qk_norm's tau_h; query i's parts times s_i = tau_h sqrt(d_head) / |q_i|,
    key j's times t_j = 1 / |k_j| (|.| of the sum of the parts, floored as F.normalize floors it); the biases
    become (n_heads, T, d_head). query_scale (T,) or (T, 1): logn_scaling's factor, times the q-side parts.
    """
    if qk_temperature is not None:
        d_head = q_parts[0].shape[-1]
        q_norm = sum(q_parts).norm(dim=-1, keepdim=True).clamp_min(_NORM_EPS)  # (n_heads, T, 1)
        k_norm = sum(k_parts).norm(dim=-1, keepdim=True).clamp_min(_NORM_EPS)
        tau = qk_temperature.detach().to(device=q_norm.device, dtype=q_norm.dtype)[:, None, None]
        s = tau * math.sqrt(d_head) / q_norm
        q_parts, k_parts = tuple(t * s for t in q_parts), tuple(t / k_norm for t in k_parts)
    if query_scale is not None:
        f = query_scale.detach().to(device=q_parts[0].device, dtype=q_parts[0].dtype).reshape(-1, 1)  # (T, 1)
        q_parts = tuple(t * f for t in q_parts)
    return q_parts, k_parts


def attention_split(
    e: Tensor,
    p: Tensor,
    W_q: Tensor,
    W_k: Tensor,
    b_q: Tensor | None = None,
    b_k: Tensor | None = None,
    *,
    n_heads: int,
    qk_temperature: Tensor | None = None,
    query_scale: Tensor | None = None,
) -> dict[str, Tensor]:
    """The seven score terms of TERMS, each (n_heads, T, T) float64, summing to the real scores.

    e, p (T, D): word and position parts of what the attention reads (after a layer norm,
    pass its split parts and fold its constant into the biases: b_q + b' W_q, b_k + b' W_k).
    W_q, W_k (D, n_heads * d_head) as used by x @ W (for an nn.Linear, weight.T);
    b_q, b_k (n_heads * d_head,) or None (zeros). Sum over terms ==
    (x W_q + b_q)(x W_k + b_k)^T / sqrt(d_head) per head, with x = e + p.
    qk_temperature (n_heads,): the attention normalises q and k per head (qk_norm) and the sum is
    tau_h cos(q_i, k_j) instead; query_scale (T,): query i's logits times query_scale[i] (logn_scaling).
    See the module docstring; None = off for both.
    """
    d_head = W_q.shape[1] // n_heads
    W_q, W_k = _f64(W_q), _f64(W_k)
    zero = torch.zeros(W_q.shape[1], dtype=torch.float64)

    def heads(y: Tensor) -> Tensor:  # (T, n_heads * d_head) -> (n_heads, T, d_head)
        return y.reshape(-1, n_heads, d_head).transpose(0, 1)

    q_e, q_p, k_e, k_p = heads(_f64(e) @ W_q), heads(_f64(p) @ W_q), heads(_f64(e) @ W_k), heads(_f64(p) @ W_k)
    bq = heads(_f64(b_q) if b_q is not None else zero)  # (n_heads, 1, d_head)
    bk = heads(_f64(b_k) if b_k is not None else zero)
    if qk_temperature is not None or query_scale is not None:
        (q_e, q_p, bq), (k_e, k_p, bk) = _rescale((q_e, q_p, bq), (k_e, k_p, bk), qk_temperature, query_scale)
    scale = 1.0 / math.sqrt(d_head)
    T = e.shape[0]

    def dot(a: Tensor, b: Tensor) -> Tensor:
        return (a @ b.transpose(-2, -1) * scale).expand(n_heads, T, T)

    return {
        "word_word": dot(q_e, k_e),
        "pos_pos": dot(q_p, k_p),
        "word_pos": dot(q_e, k_p),
        "pos_word": dot(q_p, k_e),
        "word_bias": dot(q_e, bk) + dot(bq, k_e),
        "pos_bias": dot(q_p, bk) + dot(bq, k_p),
        "bias_bias": dot(bq, bk),
    }


def term_shares(terms: dict[str, Tensor], mask: Tensor | None = None) -> dict[str, Tensor]:
    """Per-head share of score variance due to each term, (n_heads,) each, plus ``positional``.

    terms: name -> (n_heads, T, T) (or (..., n_heads, T, T): leading dims are pooled).
    Variance is along keys within each query row (per-row constants cancel), over the keys
    a query may see (mask (T, T) bool, True = allowed, e.g. causal), pooled over rows.
    share_t = Cov(term_t, S) / Var(S), S the summed score: the shares sum to 1 exactly; a
    share can leave [0, 1] when terms cancel each other. positional = the sum of the
    POSITIONAL_TERMS shares. A head whose scores do not vary at all gets NaN shares.
    """
    S = sum(terms.values())
    w = torch.ones(S.shape[-2:], dtype=torch.float64) if mask is None else mask.to(torch.float64)
    n_keys = w.sum(dim=-1, keepdim=True).clamp_min(1.0)
    pooled = tuple(range(S.dim() - 3)) + (-2, -1)  # every dim but the head

    def centred(t: Tensor) -> Tensor:
        return (t - (t * w).sum(dim=-1, keepdim=True) / n_keys) * w

    S_c = centred(S)
    var = (S_c * S_c).sum(dim=pooled)
    shares = {name: (centred(t) * S_c).sum(dim=pooled) / var for name, t in terms.items()}
    shares["positional"] = sum(shares[name] for name in POSITIONAL_TERMS if name in shares)
    return shares


def positional_heads(shares: dict[str, Tensor], threshold: float = 0.5) -> list[int]:
    """Heads whose score variance is mostly position-dependent: positional share > threshold."""
    return [h for h, share in enumerate(shares["positional"].tolist()) if share > threshold]


def sequence_terms(
    word: Tensor,
    position: Tensor,
    W_q: Tensor,
    W_k: Tensor,
    b_q: Tensor,
    b_k: Tensor,
    *,
    n_heads: int,
    norm: tuple[Tensor, Tensor, float] | None = None,
    qk_temperature: Tensor | None = None,
    query_scale: Tensor | None = None,
) -> dict[str, Tensor]:
    """attention_split of every sequence of word (B, T, D) with the shared position part (T, D): (B, n_heads, T, T) per term.

    W_q, W_k (D, n_heads * d_head) as ``x @ W`` uses them; b_q, b_k (n_heads * d_head,).
    norm = (weight, bias, eps) of the LayerNorm the attention reads its input through (a pre-LN
    block's, or BERT's embedding LayerNorm), None when it reads x directly: the norm is split
    exactly (split_layernorm: shared 1/sigma, linear centring) and its constant folded into the
    q/k biases. qk_temperature, query_scale: the attention variants, as attention_split.
    Works on any checkpoint's weights (this framework's models, BERT).
    """
    W_q, W_k, b_q, b_k, position = _f64(W_q), _f64(W_k), _f64(b_q), _f64(b_k), _f64(position)
    per_sequence = []
    for e in word:
        if norm is not None:
            e_part, p_part, b_ln = split_layernorm(e, position, *norm)
            bq, bk = b_q + b_ln[0] @ W_q, b_k + b_ln[0] @ W_k
        else:
            e_part, p_part, bq, bk = _f64(e), position, b_q, b_k
        per_sequence.append(attention_split(e_part, p_part, W_q, W_k, bq, bk, n_heads=n_heads,
                                            qk_temperature=qk_temperature, query_scale=query_scale))
    return {name: torch.stack([t[name] for t in per_sequence]) for name in TERMS}


def split_shares(
    word: Tensor,
    position: Tensor,
    W_q: Tensor,
    W_k: Tensor,
    b_q: Tensor,
    b_k: Tensor,
    *,
    n_heads: int,
    norm: tuple[Tensor, Tensor, float] | None = None,
    mask: Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    qk_temperature: Tensor | None = None,
    query_scale: Tensor | None = None,
    logits: Tensor | None = None,
) -> dict[str, Tensor]:
    """term_shares(sequence_terms(...), mask) without materialising the terms: (n_heads,) float64 per term and ``positional``.

    Arguments as sequence_terms; mask (T, T) bool as term_shares. Computed on word's device, one
    sequence and a group of heads at a time (at most _CHUNK_ELEMENTS score entries, 64 MB in float32,
    held at once, a few copies of them at the peak), from two facts that make the seven (T, T) terms
    unnecessary: (1) a term's covariance with the row-centred, masked score S_c is sum_ij t_ij S_c_ij
    (S_c's rows sum to 0 over the keys a query sees, so the term needs no centring, and a term
    constant along a row, as e_i W_Q . b_K, b_Q . b_K, contributes exactly 0: without qk_norm b_K
    never matters); (2) every term is a product a_i . c_j, so sum_ij (a_i . c_j) S_c_ij =
    sum_i a_i . (S_c C)_i: one (T, T) x (T, 2 d_head) product S_c [K_e | K_p] gives all of them, and
    Var(S) is their sum (so the shares sum to 1 as term_shares' do, whatever the dtype). The key bias
    is also left out of S before centring (constant along a row), so the centring does not subtract
    large constants. float32 is enough then (shares agree with the float64 split to ~1e-6, see the
    tests): every figure is a ratio of sums of products of centred scores, with no difference of large
    numbers left; the per-chunk sums are added up in float64. Under qk_norm (qk_temperature given) the
    key bias is t_j b_K, which varies along a row: it stays in S and a third product S_c (t b_K) adds
    its share to word_bias, pos_bias and bias_bias. A large b_K makes the unit keys nearly parallel, so
    the logits (up to tau_h) vary little along a row: each key part is first centred over the keys
    (exact, since S_c's rows sum to 0), which keeps float32 near the float64 split. logn_scaling's
    query_scale multiplies the q-side parts. ``logits`` (B, n_heads, T, T), the scores the forward recorded
    (-inf where hidden): each chunk's S_c is checked against their row-centred copy (``check_total``; the row
    constants S leaves out cancel there).
    """
    device = word.device
    W_q, W_k, b_q, b_k, position = (t.detach().to(device=device, dtype=dtype) for t in (W_q, W_k, b_q, b_k, position))
    key_bias = qk_temperature is not None  # the key bias t_j b_K varies along a row: it counts
    T, d_head = position.shape[0], W_q.shape[1] // n_heads
    scale = 1.0 / math.sqrt(d_head)
    group = max(1, min(n_heads, _CHUNK_ELEMENTS // (T * T)))  # heads per chunk
    if mask is not None:
        mask = mask.to(device)
        n_keys = mask.sum(dim=-1, keepdim=True).clamp_min(1).to(dtype)
    else:
        n_keys = torch.full((T, 1), float(T), dtype=dtype, device=device)
    cov = {name: torch.zeros(n_heads, dtype=torch.float64, device=device) for name in TERMS}
    gap = largest = 0.0  # the check against the recorded logits

    def heads(y: Tensor) -> Tensor:  # (T, n_heads * d_head) -> (n_heads, T, d_head)
        return y.reshape(-1, n_heads, d_head).transpose(0, 1)

    def total(t: Tensor) -> Tensor:  # (h, T, d) -> (h,) float64
        return t.sum(dim=(-2, -1)).to(torch.float64)

    for b, e in enumerate(word):  # (T, D)
        if norm is not None:
            e_part, p_part, b_ln = split_layernorm(e, position, *norm, dtype=dtype)
            bq, bk = b_q + b_ln[0] @ W_q, b_k + b_ln[0] @ W_k
        else:
            e_part, p_part, bq, bk = e.detach().to(dtype), position, b_q, b_k
        q_e, q_p, k_e, k_p = heads(e_part @ W_q), heads(p_part @ W_q), heads(e_part @ W_k), heads(p_part @ W_k)
        bq, bk = heads(bq), heads(bk)  # (n_heads, 1, d_head); (n_heads, T, d_head) once rescaled
        if qk_temperature is not None or query_scale is not None:
            (q_e, q_p, bq), (k_e, k_p, bk) = _rescale((q_e, q_p, bq), (k_e, k_p, bk), qk_temperature, query_scale)
        if key_bias:  # less each part's mean over the keys: a vector common to all keys adds nothing to S_c or S_c C
            k_e, k_p, bk = (t - t.mean(dim=-2, keepdim=True) for t in (k_e, k_p, bk))
        for h in range(0, n_heads, group):
            hs = slice(h, h + group)
            keys = k_e[hs] + k_p[hs] + bk[hs] if key_bias else k_e[hs] + k_p[hs]  # without qk_norm, no key bias
            S = (q_e[hs] + q_p[hs] + bq[hs]) @ keys.transpose(-2, -1) * scale  # (h, T, T)
            del keys
            if mask is not None:
                S.masked_fill_(~mask, 0.0)
            S -= S.sum(dim=-1, keepdim=True) / n_keys
            if mask is not None:
                S.masked_fill_(~mask, 0.0)  # S_c: row-centred over the keys each query sees, 0 elsewhere
            if logits is not None:
                real = logits[b, hs].to(device=device, dtype=dtype)
                largest = max(largest, float(real[real.isfinite()].abs().max()))
                real = real if mask is None else real.masked_fill(~mask, 0.0)
                real = real - real.sum(dim=-1, keepdim=True) / n_keys
                gap = max(gap, float((S - (real if mask is None else real.masked_fill(~mask, 0.0))).abs().max()))
                del real
            M_e, M_p = S @ k_e[hs] * scale, S @ k_p[hs] * scale  # (h, T, d_head)
            M_b = S @ bk[hs] * scale if key_bias else None
            del S
            cov["word_word"][hs] += total(q_e[hs] * M_e)
            cov["pos_pos"][hs] += total(q_p[hs] * M_p)
            cov["word_pos"][hs] += total(q_e[hs] * M_p)
            cov["pos_word"][hs] += total(q_p[hs] * M_e)
            cov["word_bias"][hs] += total(bq[hs] * M_e)
            cov["pos_bias"][hs] += total(bq[hs] * M_p)
            if M_b is not None:  # the key bias's side of each bias term
                cov["word_bias"][hs] += total(q_e[hs] * M_b)
                cov["pos_bias"][hs] += total(q_p[hs] * M_b)
                cov["bias_bias"][hs] += total(bq[hs] * M_b)
    if logits is not None:
        check_total(gap, largest, logits.dtype, "block 0's split terms (row-centred)")
    var = sum(cov.values())  # Var(S) = sum_t Cov(term_t, S): the shares sum to 1 (to float64 rounding) as term_shares'
    shares = {name: c / var for name, c in cov.items()}  # bias_bias: 0 without qk_norm (constant along every row)
    shares["positional"] = sum(shares[name] for name in POSITIONAL_TERMS)
    return shares


def recorded_attention(model, idx: Tensor, n_blocks: int = 1) -> dict[int, dict[str, Tensor | None]]:
    """The hook points of the first ``n_blocks`` self-attentions of ``model``'s input stack on token blocks idx
    (B, T) (``record_attention``): one forward that stops after block n_blocks - 1. The RNG is left as found (a
    ``pe.shuffle`` forward draws its row orders), so a measure's figures do not depend on which ran before it."""
    with analysis_rng(idx.device), record_attention(model, range(n_blocks)) as record:
        for _ in zip(range(n_blocks + 1), model.iter_hidden_states(idx)):  # the state after block n_blocks - 1
            pass
    return record


def analysis_rng(device: torch.device):
    """fork_rng of the CPU and ``device``'s generator: what runs inside leaves the RNG as it found it."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


def _total_gap(total: Tensor, logits: Tensor) -> tuple[float, float]:
    """(max |total - logits|, max |logits|) over the keys a query sees (the finite logits), in float64."""
    visible = logits.isfinite()
    return float((total.double() - logits.double())[visible].abs().max()), float(logits[visible].abs().max())


def check_total(gap: float, largest: float, dtype: torch.dtype, what: str) -> None:
    """Raise ValueError when a split's total is ``gap`` away from the recorded logits (largest |logit| ``largest``,
    of ``dtype``) by more than rounding: _TOTAL_RTOL (or 64 eps of a low-precision dtype) times 1 + largest."""
    tolerance = max(_TOTAL_RTOL, 64 * torch.finfo(dtype).eps) * (1.0 + largest)
    if gap > tolerance:
        raise ValueError(f"{what} do not add up to the logits the forward computed: off by {gap:.3g} "
                         f"(largest logit {largest:.3g}); the split has drifted from model/attention.py")


def _first_layer_inputs(model, idx: Tensor, recorded: dict[str, Tensor | None]) -> tuple[tuple, dict]:
    """The arguments of sequence_terms / split_shares for block 0 of ``model`` on token blocks idx (B, T), the
    attention's variants included (qk_norm's temperatures, logn_scaling's per-query factor, read from ``recorded``:
    block 0's hook points on idx)."""
    stack, block = model.input_stack, model.blocks[0]
    attn = block.attn

    def packed(W: Tensor) -> Tensor:  # per-head (n_heads, D, d_head) -> (D, n_heads * d_head), as x @ W uses it
        return W.transpose(0, 1).reshape(W.shape[1], -1)

    norm = (block.ln_attn.weight, block.ln_attn.bias, block.ln_attn.eps) if block.norm == "pre" else None
    args = (stack.embedding(idx), stack.pe.input_term(idx.shape[1]), packed(attn.W_Q), packed(attn.W_K),
            attn.b_Q.reshape(-1), attn.b_K.reshape(-1))
    return args, {"n_heads": attn.n_heads, "norm": norm, "qk_temperature": attn.qk_temperature,
                  "query_scale": recorded["query_scale"]}  # (T, 1) or None


def _logits_to_check(model, recorded: dict[str, Tensor | None]) -> Tensor | None:
    """The recorded logits the split's total must equal; None under ``pe.shuffle``, whose forward read the table's
    rows in a random order while the split reads them in order (the control's figures are of the table itself)."""
    return None if model.input_stack.pe.shuffle else recorded["logits"]


def _visible_keys(model, T: int, device: torch.device | None = None) -> Tensor | None:
    """(T, T) bool: the keys each query of block 0 sees (causal, a sliding window's band, or both); None for all."""
    mask = model.blocks[0].attn.visible_keys_mask(T, model.input_stack.causal, device)
    return None if bool(mask.all()) else mask


def first_layer_terms(model, idx: Tensor) -> tuple[dict[str, Tensor], Tensor | None]:
    """sequence_terms of block 0's self-attention on token blocks idx (B, T): (B, n_heads, T, T) per term.

    model: a LanguageModel with an additive PE (``input_stack``, ``blocks`` as in
    model/transformer.py). x = s * e + p enters block 0 (s the embedding scale); with
    pre-LN the attention reads LN(x); with post-LN it reads x. The attention's variants
    (qk_norm, logn_scaling) are split as the module docstring says: the terms sum to its
    logits, which is checked: their sum is the logits the forward recorded (``check_total``). Also returns the
    (T, T) mask of keys a query may see (causal, a window's band; None when every query sees every key).
    Memory: 7 B n_heads T^2 float64 (4 blocks at T 1024, 12 heads: 2.8 GB); first_layer_attention_split needs
    none of it.
    """
    recorded = recorded_attention(model, idx)[0]
    args, kwargs = _first_layer_inputs(model, idx, recorded)
    terms = sequence_terms(*args, **kwargs)
    logits = _logits_to_check(model, recorded)
    if logits is not None:
        check_total(*_total_gap(sum(terms.values()), logits), logits.dtype, "block 0's split terms")
    return terms, _visible_keys(model, idx.shape[1])


def first_layer_attention_split(model, idx: Tensor, dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """Per-head term_shares of block 0's scores on token blocks idx (B, T), pooled over sequences.

    (n_heads,) float64 tensors for each of TERMS and ``positional``; see first_layer_terms.
    Pooled = variance-weighted over the B sequences, not a mean of per-sequence ratios.
    Computed by split_shares on the model's device, in ``dtype``, a sequence and a few heads
    at a time: equal to term_shares(*first_layer_terms(model, idx)) to ~1e-6 in float32 and to
    rounding in float64. The scores it splits are checked against the recorded logits (split_shares' ``logits``).
    """
    recorded = recorded_attention(model, idx)[0]
    args, kwargs = _first_layer_inputs(model, idx, recorded)
    return split_shares(*args, **kwargs, mask=_visible_keys(model, idx.shape[1], idx.device), dtype=dtype,
                        logits=_logits_to_check(model, recorded))
