"""Encoder, decoder and encoder-decoder Transformers assembled from swappable parts.

The three layouts share one ``ModelConfig``: their settings (``pe_geometry.settings.model``: sizes, normalisation,
layer pattern) and the *factories* for the parts (Hydra builds them as partials): ``embedding(vocab_size, d_model)``,
``pe(d_model, n_heads)`` and ``attention(d_model, n_heads, pe)``. A layout takes its settings' fields and the parts as
keywords (``DecoderLM(vocab_size=50, d_model=32, pe=RotaryPE)``, which is what ``configs/model/*.yaml`` instantiate);
its settings add what only it has (``mask_prob``, ``src_fraction``). Each model also knows
its own objective (``loss(block)`` on a (B, seq_len + 1) block of token ids), so it can be trained
without Lightning.

The decoder and the encoder-decoder take ``cache=KVCache()`` for incremental
decoding (see model/sampling.py): each call then reads only the new tokens.

``record_attention(model)`` switches on the self-attentions' hook points (model/attention.py) for the
forward calls inside it: what the real forward computed (q and k after the encoding, the score bias,
the logits), for analysis to read instead of recomputing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pe_geometry.model.attention import KVCache, MultiHeadAttention, SDPAttention
from pe_geometry.model.embedding import INIT_STD, TokenEmbedding
from pe_geometry.model.loss import IGNORE_INDEX, head_cross_entropy
from pe_geometry.model.positional import NoPE, PositionalEncoding, SinusoidalPE
from pe_geometry.settings.model import (  # noqa: F401  (LAYER_KEYS, layer_schemes: re-exported)
    LAYER_KEYS,
    DecoderSettings,
    EncoderDecoderSettings,
    EncoderSettings,
    LayerScheme,
    ModelSettings,
    layer_schemes,
)

EmbeddingFactory = Callable[..., TokenEmbedding]
PEFactory = Callable[..., PositionalEncoding]
AttentionFactory = Callable[..., MultiHeadAttention]


class MLP(nn.Module):
    """Position-wise feed-forward: the same map at every position (it cannot see position by itself)."""

    def __init__(self, d_model: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, d_ff)
        self.down = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.down(F.gelu(self.up(x))))


@dataclass(frozen=True)
class ModelConfig:
    """A built model's config: its settings (``ModelSettings``: sizes, normalisation, layer pattern; torch-free), its
    vocabulary, and the factories of its parts. ``config.d_model`` etc. read the settings."""

    vocab_size: int
    settings: ModelSettings = ModelSettings()
    embedding: EmbeddingFactory = TokenEmbedding
    pe: PEFactory = SinusoidalPE
    attention: AttentionFactory = SDPAttention

    def __getattr__(self, name: str) -> Any:  # (called only for names the config itself lacks)
        if name == "settings":  # (not set yet: copy/pickle probing a bare instance)
            raise AttributeError(name)
        return getattr(self.settings, name)

    @classmethod
    def build(cls, vocab_size: int, settings_type: type[ModelSettings], settings: dict[str, Any]) -> ModelConfig:
        """A layout's keywords: the parts' factories (``embedding``, ``pe``, ``attention``) and its settings."""
        parts = {name: settings.pop(name) for name in ("embedding", "pe", "attention") if name in settings}
        return cls(vocab_size, settings_type(**settings), **parts)


class Block(nn.Module):
    """Self-attention, optional cross-attention, MLP; each a residual sublayer.

    ``norm="pre"`` (default, GPT-2 style) normalises each sublayer's input;
    ``norm="post"`` normalises after the residual sum, as in Vaswani et al.
    """

    def __init__(self, config: ModelConfig, pe: PositionalEncoding, cross_attention: bool = False,
                 scheme: LayerScheme | None = None) -> None:
        super().__init__()
        d_model, n_heads, dropout = config.d_model, config.n_heads, config.dropout
        self.norm = config.norm
        self.scheme = scheme  # this layer's entry of model.layer_pattern (None: no pattern)
        own = {} if scheme is None or scheme.window == "inherit" else {"window": scheme.window}
        self.attn = config.attention(d_model=d_model, n_heads=n_heads, pe=pe, dropout=dropout, **own)
        self.ln_attn = nn.LayerNorm(d_model)
        self.cross_attn = config.attention(d_model=d_model, n_heads=n_heads, dropout=dropout) if cross_attention else None
        self.ln_cross = nn.LayerNorm(d_model) if cross_attention else None
        self.mlp = MLP(d_model, config.mlp_width, dropout)
        self.ln_mlp = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def _sublayer(self, x: Tensor, ln: nn.LayerNorm, fn: Callable[[Tensor], Tensor]) -> Tensor:
        if self.norm == "pre":
            return x + self.dropout(fn(ln(x)))
        return ln(x + self.dropout(fn(x)))

    def forward(
        self, x: Tensor, causal: bool = False, context: Tensor | None = None, cache: KVCache | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        """``positions``: (B, T) drawn position ids for the self-attention's hooks (randomised positions), or None."""
        extra = {} if positions is None else {"positions": positions}  # a user's attention may not take the key
        x = self._sublayer(x, self.ln_attn, lambda h: self.attn(h, causal=causal, cache=cache, **extra))
        if self.cross_attn is not None:
            x = self._sublayer(x, self.ln_cross, lambda h: self.cross_attn(h, context=context, cache=cache))
        return self._sublayer(x, self.ln_mlp, self.mlp)


ATTENTION_POINTS = ("q_pre", "k_pre", "q", "k", "score_bias", "query_scale", "logits")  # model/attention.py


@contextmanager
def record_attention(
    model: nn.Module, blocks: Iterable[int] | None = None, points: Iterable[str] = ATTENTION_POINTS
) -> Iterator[dict[int, dict[str, Tensor | None]]]:
    """Record the self-attention hook points of ``model.blocks`` (a LanguageModel's input stack, or a Stack) while
    inside: ``with record_attention(model) as rec: model(idx)``, then ``rec[block]["logits"]`` (B, H, T, S) etc.

    The points (ATTENTION_POINTS, described in model/attention.py) are those of the last forward call each block
    made inside the ``with``, detached (None until a call, or where the point is absent); ``blocks``: the indices
    recorded (None: all); ``points``: which (fewer points, less memory; the fused kernel forms the logits only when
    they are asked for). Outside it nothing is kept and the forward costs what it did (one attribute test per
    call); an enclosing recording comes back after.
    """
    unknown = sorted(set(points) - set(ATTENTION_POINTS))
    if unknown:
        raise ValueError(f"unknown attention point(s) {unknown}; valid: {list(ATTENTION_POINTS)}")
    layers = {i: model.blocks[i].attn for i in (range(len(model.blocks)) if blocks is None else blocks)}
    before = {i: attn.recording for i, attn in layers.items()}
    record: dict[int, dict[str, Tensor | None]] = {i: dict.fromkeys(points) for i in layers}
    for i, attn in layers.items():
        attn.recording = record[i]
    try:
        yield record
    finally:
        for i, attn in layers.items():
            attn.recording = before[i]


def shuffled_rows(rows: Tensor, batch_size: int) -> Tensor:
    """(T, D) -> (B, T, D): each sequence gets the T rows in its own random order (torch's global generator, which
    a checkpoint saves, so a resumed run draws the same orders). Position then carries no information: the control
    arm of ``pe.shuffle``."""
    order = torch.rand(batch_size, rows.shape[0], device=rows.device).argsort(dim=1)
    return rows[order]


class Stack(nn.Module):
    """Token embedding + positional input term, ``config.n_layers`` blocks, final norm (pre-LN only)."""

    def __init__(self, config: ModelConfig, causal: bool, cross_attention: bool = False) -> None:
        super().__init__()
        self.causal = causal
        self.embedding = config.embedding(vocab_size=config.vocab_size, d_model=config.d_model)
        self.pe = config.pe(d_model=config.d_model, n_heads=config.n_heads)
        self.pe.causal = causal  # a relative encoding may differ by direction (T5's buckets, CoPE's tables)
        self.dropout = nn.Dropout(config.dropout)
        schemes = config.layer_schemes()
        # a layer pattern's own encodings, one per entry that sets one (the layers of an entry share it)
        self.layer_pes = nn.ModuleDict()
        encodings = [self._layer_encoding(config, scheme, causal) for scheme in schemes] if schemes else None
        self.blocks = nn.ModuleList(
            Block(config, encodings[i] if encodings else self.pe, cross_attention, schemes[i] if schemes else None)
            for i in range(config.n_layers)
        )
        self.ln_final = nn.LayerNorm(config.d_model) if config.norm == "pre" else nn.Identity()

    def _layer_encoding(self, config: ModelConfig, scheme: LayerScheme, causal: bool) -> PositionalEncoding:
        """The encoding a layer of the pattern uses: the stack's, NoPE, or the stack's family with other settings."""
        if scheme.pe is None:
            return self.pe
        if type(self.pe).input_term is not PositionalEncoding.input_term:
            raise ValueError(f"model.layer_pattern[{scheme.entry}].pe={scheme.pe!r}: pe={type(self.pe).__name__} adds its "
                             "term to the input, once for every layer; a layer pattern sets encodings that act inside "
                             "attention (rope, xpos, alibi, t5_bias, fire, kerple, cope, forgetting, none)")
        key = str(scheme.entry)
        if key not in self.layer_pes:
            if scheme.pe == "none":
                pe = NoPE(config.d_model, config.n_heads)
            else:
                pe = config.pe(d_model=config.d_model, n_heads=config.n_heads, **scheme.pe)
            pe.causal = causal
            self.layer_pes[key] = pe
        return self.layer_pes[key]

    def encodings(self) -> list[PositionalEncoding]:
        """Every encoding the stack uses: its own, then a layer pattern's."""
        return [self.pe, *self.layer_pes.values()]

    def cache_stays_exact(self, n_positions: int) -> bool:
        return all(pe.cache_stays_exact(n_positions) for pe in self.encodings())

    def layer_labels(self, family: str) -> list[str]:
        """Each layer's position scheme in words (``family``: the model's pe option), for the per-layer figures."""
        return [block.scheme.describe(family) if block.scheme is not None else family for block in self.blocks]

    def embed(self, idx: Tensor, start_pos: int = 0, positions: Tensor | None = None) -> Tensor:
        """What the first block reads: scaled token embedding plus the PE input term
        of positions ``start_pos .. start_pos + T - 1`` (or of each sequence's ``positions`` (B, T))."""
        x = self.embedding(idx)  # (B, T, D)
        if positions is None:
            position = self.pe.input_term(idx.shape[1], start_pos)
        else:  # only encodings that take randomised positions are handed them (a user's hook may not know the key)
            position = self.pe.input_term(idx.shape[1], start_pos, positions=positions)
        if position is not None and self.pe.shuffle:
            position = shuffled_rows(position, idx.shape[0])
        if position is not None:
            x = x + position
        return self.dropout(x)

    def forward(self, idx: Tensor, context: Tensor | None = None, cache: KVCache | None = None) -> Tensor:
        """idx (B, T) -> hidden states (B, T, D); with ``cache``, idx follows the cached tokens.

        Training with ``pe.randomize_positions``, a full pass (no cache) draws each sequence's positions once
        (``PositionalEncoding.draw_positions``) and every hook of every block reads them; otherwise the positions
        are the plain ``start .. start + T - 1`` (evaluation, cached decoding)."""
        positions = self.pe.draw_positions(*idx.shape, device=idx.device) if cache is None else None
        x = self.embed(idx, cache.length if cache is not None else 0, positions)
        for block in self.blocks:
            x = block(x, causal=self.causal, context=context, cache=cache, positions=positions)
        if cache is not None:
            cache.length += idx.shape[1]
        return self.ln_final(x)

    def hidden_states(self, idx: Tensor, context: Tensor | None = None) -> list[Tensor]:
        """For analysis: the input of block 0, 1, ..., n_layers - 1, then the output (after the final norm).

        n_layers + 1 tensors (B, T, D); the last one is what ``forward`` returns.
        """
        return list(self.iter_hidden_states(idx, context))

    def iter_hidden_states(self, idx: Tensor, context: Tensor | None = None) -> Iterator[Tensor]:
        """``hidden_states`` one at a time: only the state being read (and the next one) is alive."""
        x = self.embed(idx)
        for block in self.blocks:
            yield x
            x = block(x, causal=self.causal, context=context)
        yield self.ln_final(x)


class LanguageModel(nn.Module):
    """Shared parts of the three layouts: weight init, output head, named weights.

    A layout builds its stacks from ``self.config``, then calls ``_finish_init``.
    """

    Settings: ClassVar[type[ModelSettings]] = ModelSettings  # what a layout's keywords build besides its parts
    objective: ClassVar[str] = ""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.vocab_size, self.d_model = config.vocab_size, config.d_model
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.loss_chunk = config.loss_chunk  # None: logits, then F.cross_entropy; else the fused loss (model/loss.py)

    @property
    def n_layers(self) -> int:
        """Residual blocks in the whole model (both stacks of an encoder-decoder)."""
        return sum(len(m.blocks) for m in self.modules() if isinstance(m, Stack))

    def _finish_init(self) -> None:
        self.apply(self._init_weights)
        for name, param in self.named_parameters():  # GPT-2: shrink residual projections with depth
            if name.endswith(("o.weight", "down.weight")):
                nn.init.normal_(param, std=INIT_STD / math.sqrt(2 * self.n_layers))
        if self.input_stack.embedding.tie_weights:
            self.head.weight = self.W_E
        for stack in self.modules():  # last: an encoding may start from the final E (see PositionalEncoding.finish_init)
            if isinstance(stack, Stack):
                for pe in stack.encodings():
                    pe.finish_init(stack.embedding)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=INIT_STD)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @property
    def input_stack(self) -> Stack:
        raise NotImplementedError

    # Plain names for analysis (TransformerLens style).
    @property
    def W_E(self) -> nn.Parameter:
        """Word-embedding matrix (vocab, d_model), before any scale."""
        return self.input_stack.embedding.weight

    @property
    def embed_scale(self) -> float:
        return self.input_stack.embedding.scale

    @property
    def W_pos(self) -> Tensor | None:
        """Absolute position table (max_len, d_model) added to the input, or None."""
        return self.input_stack.pe.position_table

    @property
    def blocks(self) -> nn.ModuleList:
        return self.input_stack.blocks

    def cross_entropy(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """Mean cross-entropy over every target that is not IGNORE_INDEX: the training loss, from what ``loss`` has
        the model compute. ``outputs``: the logits (B, T', vocab), or with ``model.loss_chunk`` set the hidden states
        (B, T', D), the head then applied inside the fused loss, ``loss_chunk`` rows at a time (model/loss.py)."""
        chunk = getattr(self, "loss_chunk", None)  # (a peer borrowing this method has none: it computes logits)
        if chunk is not None:
            return head_cross_entropy(outputs, self.head.weight, targets, chunk)
        return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX)

    def hidden_states(self, idx: Tensor) -> list[Tensor]:
        """The input stack's block inputs then its output: n_layers + 1 tensors (B, T, D); see ``Stack.hidden_states``."""
        return self.input_stack.hidden_states(idx)

    def iter_hidden_states(self, idx: Tensor) -> Iterator[Tensor]:
        """``hidden_states`` one at a time (a generator), so a caller reading layer by layer holds one, not all."""
        return self.input_stack.iter_hidden_states(idx)

    def logits_and_targets(self, block: Tensor, generator: torch.Generator | None = None,
                           head: bool = True) -> tuple[Tensor, Tensor]:
        """The objective on a (B, seq_len + 1) block: logits (B, T', vocab) and targets (B, T') (IGNORE_INDEX: no target).
        ``head=False``: the hidden states (B, T', D) the head reads instead of the logits."""
        raise NotImplementedError

    def loss(self, block: Tensor, reduction: str = "mean", generator: torch.Generator | None = None) -> Tensor:
        """Cross-entropy of the objective on a (B, seq_len + 1) block of token ids.

        reduction="mean": a scalar over every target; "none": per target (B, T') in float32, NaN where a
        position has no target (an encoder's unmasked positions). ``generator`` draws an encoder's masks.
        """
        if reduction == "mean" and getattr(self, "loss_chunk", None) is not None:  # (a peer borrowing this has none)
            return self.cross_entropy(*self.logits_and_targets(block, generator, head=False))
        logits, targets = self.logits_and_targets(block, generator)
        if reduction == "mean":
            return self.cross_entropy(logits, targets)
        if reduction != "none":
            raise ValueError(f"reduction={reduction!r}; valid: ['mean', 'none']")
        losses = F.cross_entropy(logits.transpose(1, 2).float(), targets, ignore_index=IGNORE_INDEX, reduction="none")
        return losses.masked_fill(targets == IGNORE_INDEX, float("nan"))


class DecoderLM(LanguageModel):
    """Causal Transformer trained on next-token prediction (GPT)."""

    Settings = DecoderSettings
    objective = DecoderSettings.objective

    def __init__(self, vocab_size: int, **settings: Any) -> None:
        """``settings``: ``DecoderSettings``'s keys and the parts' factories (``embedding``, ``pe``, ``attention``)."""
        config = ModelConfig.build(vocab_size, self.Settings, settings)
        # the stack before the head: a learned position table draws its init when built, and this order keeps
        # a seeded model the one it always was
        stack = Stack(config, causal=True)
        super().__init__(config)
        self.decoder = stack
        self._finish_init()

    @property
    def input_stack(self) -> Stack:
        return self.decoder

    def forward(self, idx: Tensor, cache: KVCache | None = None, head: bool = True) -> Tensor:
        """idx (B, T) -> logits (B, T, vocab) for the next token at every position (``head=False``: the hidden
        states (B, T, D) the head reads; the fused loss applies the head itself, inside ``forward`` so that a
        compiled model compiles the stack).

        With ``cache`` (a ``KVCache``), idx holds only the tokens after those already cached.
        """
        hidden = self.decoder(idx, cache=cache)
        return self.head(hidden) if head else hidden

    def logits_and_targets(self, block: Tensor, generator: torch.Generator | None = None,
                           head: bool = True) -> tuple[Tensor, Tensor]:
        inputs, targets = block[:, :-1], block[:, 1:]
        return self(inputs, head=head), targets


def mask_tokens(
    tokens: Tensor, mask_token_id: int, vocab_size: int, mask_prob: float = 0.15, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """BERT masking: choose ``mask_prob`` of positions; of those 80 % -> [MASK], 10 % -> random, 10 % kept.

    Returns (inputs, targets) with targets = IGNORE_INDEX at unchosen positions.
    """
    draw = torch.rand(tokens.shape, generator=generator, device=tokens.device)
    chosen = draw < mask_prob
    # Reuse the same uniform draw to split the chosen positions 80/10/10.
    to_mask = draw < 0.8 * mask_prob
    to_random = chosen & ~to_mask & (draw < 0.9 * mask_prob)
    random_ids = torch.randint(vocab_size, tokens.shape, generator=generator, device=tokens.device)
    inputs = torch.where(to_mask, torch.full_like(tokens, mask_token_id), tokens)
    inputs = torch.where(to_random, random_ids, inputs)
    targets = torch.where(chosen, tokens, torch.full_like(tokens, IGNORE_INDEX))
    return inputs, targets


class EncoderMLM(LanguageModel):
    """Bidirectional Transformer trained as a masked language model (BERT)."""

    Settings = EncoderSettings
    objective = EncoderSettings.objective

    def __init__(self, vocab_size: int, mask_token_id: int, **settings: Any) -> None:
        """``settings``: ``EncoderSettings``'s keys and the parts' factories (``embedding``, ``pe``, ``attention``)."""
        config = ModelConfig.build(vocab_size, self.Settings, settings)
        stack = Stack(config, causal=False)
        super().__init__(config)
        self.encoder = stack
        self.mask_token_id, self.mask_prob = mask_token_id, config.settings.mask_prob
        self._finish_init()

    @property
    def input_stack(self) -> Stack:
        return self.encoder

    def forward(self, idx: Tensor, head: bool = True) -> Tensor:
        hidden = self.encoder(idx)
        return self.head(hidden) if head else hidden

    def logits_and_targets(self, block: Tensor, generator: torch.Generator | None = None,
                           head: bool = True) -> tuple[Tensor, Tensor]:
        tokens = block[:, :-1]  # the same seq_len tokens a decoder would read
        inputs, targets = mask_tokens(tokens, self.mask_token_id, self.vocab_size, self.mask_prob, generator=generator)
        return self(inputs, head=head), targets


class EncoderDecoder(LanguageModel):
    """The original layout: the encoder reads the first ``src_len`` tokens of a block,
    the decoder predicts the rest token by token, cross-attending to the encoder.

    The token embedding (and its PE) is shared between encoder and decoder; each
    side has its own positional encoding module, both counting from 0.
    """

    Settings = EncoderDecoderSettings
    objective = EncoderDecoderSettings.objective

    def __init__(self, vocab_size: int, **settings: Any) -> None:
        """``settings``: ``EncoderDecoderSettings``'s keys (``n_layers`` blocks on each side) and the parts' factories."""
        config = ModelConfig.build(vocab_size, self.Settings, settings)
        encoder = Stack(config, causal=False)
        super().__init__(config)
        self.encoder = encoder
        self.decoder = Stack(config, causal=True, cross_attention=True)
        self.decoder.embedding = self.encoder.embedding  # one vocabulary, one matrix
        self.src_fraction = config.settings.src_fraction
        self._finish_init()

    @property
    def input_stack(self) -> Stack:
        return self.encoder

    def forward(self, src: Tensor, tgt: Tensor, cache: KVCache | None = None, head: bool = True) -> Tensor:
        """src (B, S), tgt (B, T) -> logits (B, T, vocab) for the token after each tgt token (``head=False``: the
        decoder's hidden states (B, T, D)).

        With ``cache``, the encoder runs on the first call only (its output and the
        cross-attention keys/values are kept) and tgt holds only the new decoder tokens.
        """
        if cache is None:
            hidden = self.decoder(tgt, context=self.encoder(src))
        else:
            if cache.context is None:
                cache.context = self.encoder(src)
            hidden = self.decoder(tgt, context=cache.context, cache=cache)
        return self.head(hidden) if head else hidden

    def source_len(self, seq_len: int) -> int:
        """How many of a block's seq_len input tokens the encoder reads (at least 1); the decoder reads the rest."""
        return max(1, int(round(seq_len * self.src_fraction)))

    def split(self, block: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(B, L+1) block -> source, decoder input, decoder targets."""
        src_len = self.source_len(block.shape[1] - 1)
        return block[:, :src_len], block[:, src_len:-1], block[:, src_len + 1 :]

    def logits_and_targets(self, block: Tensor, generator: torch.Generator | None = None,
                           head: bool = True) -> tuple[Tensor, Tensor]:
        src, tgt_in, tgt_out = self.split(block)
        return self(src, tgt_in, head=head), tgt_out
