"""The peer: a decoder built from x-transformers' own modules, to check a PE family's result on an independent
implementation (issue 50 item 7).

``model=xtransformers model.peer_pe=<family>`` trains ``x_transformers.TransformerWrapper(attn_layers=Decoder(...))``
through our pipeline, and ``training.run_loader.load_trained_run`` rebuilds it as it does our models, so the
length-extrapolation protocol scores it on the same tokens. ``peer_pe`` picks x-transformers' own switch
(``PEER_FLAGS``): rope ``rotary_pos_emb`` (every dimension of a head rotated, as our RoPE), xpos ``rotary_xpos``,
alibi ``alibi_pos_bias``, t5_bias ``rel_pos_bias``, cope ``attn_use_cope``, dynamic_bias ``dynamic_pos_bias`` (an MLP
of the signed distance, width d_model / 4, depth 2; no arm of ours), none: no switch. Each family's own settings are
x-transformers' defaults, which are ours: rotary base 1e4, xPos gamma 0.4 and scale base 512, T5 32 buckets to
distance 128, CoPE 16 positions, ALiBi the paper's slopes. Our ``pe`` group is not used: model=xtransformers sets
``pe=none`` and refuses any other (``check_parts``), and x-transformers' absolute position table is off for every family
(``use_abs_pos_emb=False``; x-transformers would add one beside ALiBi, CoPE and the dynamic bias otherwise).

Matched to our DecoderLM by x-transformers' flags: width, depth, heads and head width (``attn_dim_head`` = d_model /
n_heads), pre-norm LayerNorm (``model.norm=post`` for post-norm) with a final norm, a GELU MLP of ``d_ff`` (4 x d_model)
with biases, the output head tied to the token embedding (``embedding.tie_weights``) without a scale: x-transformers'
own bias-free head sharing the embedding's parameter, logits = h E^T as ours (x-transformers' own tie is a closure,
which a deepcopy shares and pickle refuses, and from 2.2x scales by 1/sqrt(d_model) unless ``tie_embedding_scale=1``),
no dropout (``model.dropout`` sets x-transformers' embedding, attention-weight and both sublayer-output dropouts).
What still differs, by design or for want of a flag:

- initialisation: x-transformers' own (token embedding kaiming-normal, std sqrt(2 / d_model), 0.18 at d 64; every
  Linear PyTorch's default uniform; CoPE's table zeros, as ours), not our normal(0.02) with the residual projections
  shrunk by 1/sqrt(2 n_layers). With the unscaled tied head the step-0 logits have std ~1.4 (ours ~0.16), so the
  step-0 loss is about ln V + 1 (8.7 vs our 7.6 at vocab 2048, d 64);
- no biases on the attention's q, k, v and output projections (x-transformers has none; ours have them); its
  LayerNorm has a gain and no bias (``norm_add_unit_offset=False`` keeps the gain a plain gain, as ours): 832 fewer
  parameters at the benchmark's shape (230,336 vs 231,168);
- the attention is x-transformers' explicit softmax (``attn_flash=False``; T5, CoPE and the dynamic bias need it), not
  our fused SDPA kernel: the same function, other float rounding;
- T5's bias table is multiplied by sqrt(d_head) before it is added to the logits (ours is added as it is): the same
  function family, its table learning sqrt(d_head) times faster under Adam; xPos centres its scale on the middle of the
  current sequence (ours on the training length's), which changes no score; CoPE's positions come from the logits
  after the causal mask (sigmoid of the masked ones is 0), as ours;
- with ``model.dropout`` > 0, our MLP drops its output twice (its own dropout and the block's); x-transformers once.

Our analysis needs our modules' hook points (the geometry recorder, the attention split, generation through our KV
cache): a peer run refuses the geometry callback (``callbacks=no_geometry``, which model=xtransformers sets), skips the
end-of-training text sample, and ``analysis.position_attention`` refuses it in one line.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import Tensor, nn

from pe_geometry.extras import needs_extra
from pe_geometry.model.transformer import LanguageModel
from pe_geometry.settings.base import defaults
from pe_geometry.settings.model import PEER_FAMILIES, PeerSettings

with needs_extra("peer", "model=xtransformers"):
    from x_transformers import Decoder, TransformerWrapper

PeerFamily = Literal[PEER_FAMILIES]  # model.peer_pe's options

# model.peer_pe -> x-transformers' Decoder keywords that switch the family on ({d_head}: the head width)
PEER_FLAGS: dict[str, dict[str, Any]] = {
    "rope": {"rotary_pos_emb": True, "rotary_emb_dim": "{d_head}"},
    "xpos": {"rotary_xpos": True, "rotary_emb_dim": "{d_head}"},
    "alibi": {"alibi_pos_bias": True},
    "t5_bias": {"rel_pos_bias": True},
    "cope": {"attn_use_cope": True},
    "none": {},
    "dynamic_bias": {"dynamic_pos_bias": True},
}

PEER = "x-transformers"  # whose modules the model is built from (run labels: 'peer x-transformers: rope')


class XTransformersLM(nn.Module):
    """x-transformers' ``TransformerWrapper`` + causal ``Decoder`` behind our decoder's interface: ``forward(idx)`` ->
    logits, ``loss(block)`` and ``logits_and_targets(block)`` (the code of our LanguageModel), ``objective``,
    ``vocab_size``, ``d_model``, ``n_layers``. The network is ``self.net``, as x-transformers builds it."""

    objective = "next-token"
    peer = PEER

    Settings = PeerSettings

    def __init__(self, vocab_size: int, *, pe: Any = None, embedding: Any = None, attention: Any = None,
                 **settings: Any) -> None:
        """``pe``, ``embedding``, ``attention``: the factories our pipeline builds from those groups (None: as if
        pe=none, embedding=plain, attention=sdpa); ``check_parts`` refuses any that x-transformers would not honour.
        ``settings``: ``PeerSettings``'s keys."""
        super().__init__()
        s = self.settings = self.Settings(**settings)
        peer_pe, d_model, n_heads, n_layers = s.peer_pe, s.d_model, s.n_heads, s.n_layers
        tie = self.check_parts(*_parts(pe, embedding, attention))
        self.vocab_size, self.d_model, self.n_heads, self.n_layers = vocab_size, d_model, n_heads, n_layers
        self.peer_pe, self.d_head = peer_pe, d_model // n_heads
        self.tie_weights = tie
        kwargs = self.wrapper_kwargs(vocab_size, peer_pe, d_model, n_heads, n_layers, s.mlp_width, s.dropout, s.norm, tie)
        # x-transformers ties the head with a closure over the wrapper (logits = h @ E^T * tie_embedding_scale), which a
        # deepcopy (the FLOPs count's meta copy) would share with the original and pickle cannot take: its own
        # bias-free head with E's parameter is the same function
        self.net = TransformerWrapper(**{**kwargs, "tie_embedding": False})
        if tie:
            self.net.to_logits.weight = self.net.token_emb.emb.weight
        if type(self.net.pos_emb).__name__ != "always":  # x-transformers' no-table stand-in: adds 0
            raise AssertionError(f"the peer built an absolute position table ({type(self.net.pos_emb).__name__})")

    @staticmethod
    def wrapper_kwargs(vocab_size: int, peer_pe: str, d_model: int, n_heads: int, n_layers: int, d_ff: int,
                       dropout: float, norm: str, tie_weights: bool) -> dict[str, Any]:
        """The keywords of ``TransformerWrapper`` (its ``attn_layers`` a built ``Decoder``) for this peer, its head tied
        as x-transformers ties it: what the tests build x-transformers from directly."""
        d_head = d_model // n_heads
        flags = {k: (d_head if v == "{d_head}" else v) for k, v in PEER_FLAGS[peer_pe].items()}
        decoder = Decoder(
            dim=d_model, depth=n_layers, heads=n_heads, attn_dim_head=d_head, ff_mult=d_ff / d_model,
            pre_norm=norm == "pre", norm_add_unit_offset=False, attn_flash=False, attn_dropout=dropout,
            attn_sublayer_dropout=dropout, ff_sublayer_dropout=dropout, verbose=False, **flags,
        )
        # max_seq_len: x-transformers reads it for its absolute position table only, which is off
        kwargs = {"num_tokens": vocab_size, "max_seq_len": 0, "attn_layers": decoder, "use_abs_pos_emb": False,
                  "emb_dropout": dropout, "tie_embedding": tie_weights}
        if tie_weights and "tie_embedding_scale" in inspect.signature(TransformerWrapper).parameters:
            kwargs["tie_embedding_scale"] = 1.0  # newer versions scale a tied head by 1/sqrt(d_model) unless told
        return kwargs

    @staticmethod
    def check_parts(pe: type | None, embedding: tuple[type, Mapping[str, Any]] | None,
                    attention: tuple[type, Mapping[str, Any]] | None, pe_option: str | None = None) -> bool:
        """The other groups a peer run is composed with (classes, and the settings bound): ``pe`` must be NoPE (the
        family is ``model.peer_pe``), the embedding plain (its ``tie_weights`` is honoured), the attention without a
        variant (x-transformers' own is built). Raises ValueError, one line naming what to change (``pe_option``: the
        pe= option's name for it); returns whether the head is tied."""
        from pe_geometry.model.embedding import TokenEmbedding
        from pe_geometry.model.positional import NoPE

        if pe is not None and pe is not NoPE:
            raise ValueError(f"model=xtransformers builds its position encoding from model.peer_pe (x-transformers' "
                             f"own); pe={pe_option or pe.__name__} would add ours beside it: leave pe out "
                             "(model=xtransformers sets pe=none)")
        tie = True
        if embedding is not None:
            cls, settings = embedding
            if cls is not TokenEmbedding or settings.get("scaled", False):
                raise ValueError("model=xtransformers reads its tokens with x-transformers' plain embedding: use "
                                 "embedding=plain (embedding.tie_weights is honoured)")
            tie = bool(settings.get("tie_weights", True))
        if attention is not None:
            cls, settings = attention
            default = defaults(cls.Settings) if hasattr(cls, "Settings") else {}
            changed = sorted(k for k, v in settings.items() if k in default and k != "training_length" and v != default[k])
            if changed:
                raise ValueError(f"model=xtransformers builds x-transformers' own attention: "
                                 f"{', '.join(f'attention.{k}' for k in changed)} would be ignored; leave "
                                 f"{'it' if len(changed) == 1 else 'them'} at the default")
        return tie

    def embedding_parameters(self) -> list[nn.Parameter]:
        """What our optimiser treats as our TokenEmbedding's and PositionalEncoding's parameters
        (``optimizer.no_decay_embeddings``, ``optimizer.lr_base_width``): the token embedding (the tied head with it) and
        the family's own parameters (T5's table, the dynamic bias's MLP, CoPE's tables; rotations and ALiBi have none)."""
        layers = self.net.attn_layers
        position = [m for m in self.net.modules() if type(m).__name__ == "CoPE"]
        position += [m for m in (layers.rel_pos, layers.rotary_pos_emb) if m is not None]
        return [*self.net.token_emb.parameters(), *(p for m in position for p in m.parameters())]

    def forward(self, idx: Tensor) -> Tensor:
        """idx (B, T) -> logits (B, T, vocab) for the next token at every position (any T: no position table)."""
        return self.net(idx)

    def logits_and_targets(self, block: Tensor, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        inputs, targets = block[:, :-1], block[:, 1:]
        return self(inputs), targets

    # the objective's code is our models' own, so a peer's loss is computed exactly as theirs
    cross_entropy = LanguageModel.cross_entropy
    loss = LanguageModel.loss


def _parts(pe: Any, embedding: Any, attention: Any) -> tuple[Any, Any, Any]:
    """The pipeline's factories (functools.partial of a class, settings bound) as ``check_parts`` reads them."""

    def split(factory: Any) -> tuple[type, dict[str, Any]] | None:
        if factory is None:
            return None
        func = getattr(factory, "func", factory)
        return func, dict(getattr(factory, "keywords", {}) or {})

    return (None if pe is None else getattr(pe, "func", pe)), split(embedding), split(attention)

