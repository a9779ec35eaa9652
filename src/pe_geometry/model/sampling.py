"""Text generation from the three model layouts (torch only).

- ``generate``: autoregressive sampling for ``DecoderLM`` and ``EncoderDecoder``, through ``Decoding``:
  incremental with a ``KVCache`` by default (``use_cache=False`` re-reads the window each step; both give
  the same logits), and given ``context`` (the training length) each token sees at most that many
  tokens, the window sliding as the text grows.
- ``token_nll``: the model's own loss on a text, read through the same windows.
- ``fill_masks``: fill-in-the-blank for the masked-LM ``EncoderMLM``.
- ``next_token``: greedy (``temperature=0``) or sampled with temperature, top-k and top-p.
- ``prompt_ids``: what a model is given for a text prompt (generate.py and the end-of-training sample alike).

Every random draw goes through an explicit ``torch.Generator``, so a seed fixes the text.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from pe_geometry.model.attention import KVCache
from pe_geometry.model.transformer import DecoderLM, EncoderDecoder, EncoderMLM, LanguageModel, Stack


def top_k_filter(logits: Tensor, k: int | None) -> Tensor:
    """Keep the ``k`` largest logits of each row (ties with the k-th kept too), the rest -> -inf.

    ``k`` None or 0 keeps everything; k >= vocab keeps everything.
    """
    if not k or k >= logits.shape[-1]:
        return logits
    kth_largest = torch.topk(logits, k, dim=-1).values[..., -1:]  # (..., 1)
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def top_p_filter(logits: Tensor, p: float | None) -> Tensor:
    """Nucleus filter: keep the smallest set of most probable tokens whose total probability
    reaches ``p`` (in (0, 1]); the most probable token always stays. None or 1 keeps everything."""
    if p is None or p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the more likely tokens
    drop_sorted = mass_before >= p
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def next_token(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """logits (B, vocab) -> token ids (B,). ``temperature=0`` is greedy (argmax)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = top_p_filter(top_k_filter(logits.float() / temperature, top_k), top_p)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


def prompt_ids(model: LanguageModel, text_ids: Sequence[int], eos_id: int) -> list[int]:
    """The token ids a model reads for a prompt whose text encodes to ``text_ids``.

    A decoder or an encoder-decoder continues the text as the start of a new document: ``eos_id`` first,
    as every document follows an end-of-document token in training. That also gives the encoder-decoder
    the two tokens ``generate`` needs (a source and a first decoder token) for any prompt, the empty one
    and a one-token one included. A masked-LM encoder fills the blanks of the text as it is.
    """
    if isinstance(model, EncoderMLM):
        return list(text_ids)
    return [eos_id, *text_ids]


def check_length(stack: Stack, n_positions: int) -> None:
    """Raise ValueError when ``stack`` cannot place ``n_positions`` tokens (a learned table's limit)."""
    limit = stack.pe.max_positions
    if limit is not None and n_positions > limit:
        raise ValueError(
            f"{n_positions} positions needed but the {type(stack.pe).__name__} table has {limit} "
            f"(pe.max_len): shorten the prompt or max_new_tokens so they fit, or keep context=train"
        )


def context_windows(model: LanguageModel, context: int | None) -> tuple[int | None, int | None]:
    """(source window, decoder window): how many tokens each stack reads at most when the model was trained
    on blocks of ``context`` tokens (None: no window, the whole text).

    A decoder read all ``context`` tokens; an encoder-decoder's encoder read ``model.source_len(context)``
    of them and its decoder the rest, so each side keeps to its own training length.
    """
    if context is None:
        return None, None
    if context < 1:
        raise ValueError(f"context={context} must be >= 1 (or None for the whole text)")
    if isinstance(model, EncoderDecoder):
        source = model.source_len(context)
        return source, max(1, context - source)
    return None, context


class Decoding:
    """A text that grows token by token, read through the window the model was trained on.

    ``logits()`` gives the next-token logits (B, vocab) given the last ``window`` tokens of the text (all of
    them when ``window`` is None); ``append(new)`` adds a column of tokens. With ``use_cache`` the keys and
    values of the tokens already read are kept while the window's start stays put (the text is still
    shorter than the window), so each step reads only the new token. Once the window slides, every step
    re-encodes the window with a fresh cache. A cache that rolls (drop the oldest key, keep the rest) would be
    faster but is exact only for a one-layer model with a relative PE: from block 1 on, each cached key was
    computed while its token attended to tokens the window has since dropped, and an absolute PE placed
    it at a position it no longer has. Re-encoding keeps every step equal to an uncached forward over the
    window, which is what the model was trained to read. An encoding whose ``cache_stays_exact`` is False for the
    current length (RoPE with ``dynamic_ntk`` past its training length: every position's angle depends on the length)
    is re-encoded at every step too.

    The encoder-decoder reads all prompt tokens but the last with its encoder (its last ``source_window`` of
    them) and starts decoding from the last one, as in training (the decoder's first input is the token right
    after the source); it needs a prompt of at least 2 tokens.

    ``max_new_tokens``, when the caller knows it, sizes the cache's buffers once: the decoder reads at most
    ``longest`` = its tokens + max_new_tokens - 1 tokens (the last new token is never read back), or the window.
    """

    def __init__(
        self, model: DecoderLM | EncoderDecoder, prompt: Tensor, context: int | None = None, use_cache: bool = True,
        max_new_tokens: int | None = None,
    ) -> None:
        source_window, self.window = context_windows(model, context)
        if isinstance(model, EncoderDecoder):
            if prompt.shape[1] < 2:
                raise ValueError("the encoder-decoder needs a prompt of at least 2 tokens (source + first decoder token)")
            self.source, self.tokens = prompt[:, :-1], prompt[:, -1:]
            source = self.source if source_window is None else self.source[:, -source_window:]
            check_length(model.encoder, source.shape[1])
            self._forward = lambda ids, cache: model(source, ids, cache=cache)
        elif isinstance(model, DecoderLM):
            self.source, self.tokens = prompt[:, :0], prompt
            self._forward = lambda ids, cache: model(ids, cache=cache)
        else:
            raise TypeError(f"generation needs a DecoderLM or EncoderDecoder, got {type(model).__name__}; use fill_masks for an encoder")
        self.stack = model.decoder
        self.longest = None if max_new_tokens is None else self.tokens.shape[1] + max_new_tokens - 1
        self._capacity = self.longest if self.window is None or self.longest is None else min(self.longest, self.window)
        self.cache = KVCache(self._capacity) if use_cache else None
        self._cache_start = 0  # where in ``tokens`` the cached tokens start

    @property
    def window_start(self) -> int:
        """Index in ``tokens`` of the first token the model reads now."""
        return 0 if self.window is None else max(0, self.tokens.shape[1] - self.window)

    def logits(self) -> Tensor:
        """(B, vocab): the model's logits for the token after the text, read through the window."""
        start = self.window_start
        check_length(self.stack, self.tokens.shape[1] - start)
        if self.cache is None:
            return self._forward(self.tokens[:, start:], None)[:, -1]
        slid = start != self._cache_start  # the window slid: start a fresh cache (see the class docstring)
        # an encoding that places every token anew as the text grows (RoPE with dynamic_ntk past the training length)
        # makes the cached keys stale: re-encode, as an uncached step does
        if slid or not self.stack.cache_stays_exact(self.tokens.shape[1] - start):
            context, self.cache = self.cache.context, KVCache(self._capacity)
            self.cache.context = context  # an encoder-decoder's encoder output does not depend on the window
            self._cache_start = start
        unread = self.tokens[:, self._cache_start + self.cache.length :]
        return self._forward(unread, self.cache)[:, -1]

    def append(self, new: Tensor) -> None:
        """Add ``new`` (B, k) to the end of the text."""
        self.tokens = torch.cat((self.tokens, new), dim=1)

    def text(self) -> Tensor:
        """(B, T): the whole text, the encoder-decoder's source included."""
        return torch.cat((self.source, self.tokens), dim=1)


@torch.no_grad()
def generate(
    model: DecoderLM | EncoderDecoder,
    prompt: Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    context: int | None = None,
) -> Tensor:
    """prompt (B, T) token ids -> (B, T + max_new_tokens): the prompt followed by the new tokens.

    ``context``: the length the model was trained on; each new token is then drawn given at most that many
    tokens (the last ones; see ``Decoding``), so a text of any length stays in the range the model knows.
    None reads the whole text (a length-extrapolation test; a learned table stops at its size).
    """
    decoding = Decoding(model, prompt, context, use_cache, max_new_tokens)
    # fail before the first step, not after minutes
    longest = decoding.longest
    check_length(model.decoder, longest if decoding.window is None else min(longest, decoding.window))
    for _ in range(max_new_tokens):
        decoding.append(next_token(decoding.logits(), temperature, top_k, top_p, generator)[:, None])
    return decoding.text()


@torch.no_grad()
def token_nll(model: DecoderLM, tokens: Tensor, context: int | None = None, use_cache: bool = True) -> Tensor:
    """tokens (B, T) -> (B, T - 1): -log p(tokens[:, t] | what precedes it, read through the window) in nats.

    The model scores a text the way ``generate`` reads it (the same ``Decoding``), so the loss of a sample past
    the training length is measured with the windows it was written with.
    """
    decoding = Decoding(model, tokens[:, :1], context, use_cache, max_new_tokens=tokens.shape[1] - 1)
    losses = []
    for t in range(1, tokens.shape[1]):
        log_probs = decoding.logits().float().log_softmax(dim=-1)
        losses.append(-log_probs.gather(-1, tokens[:, t : t + 1]))
        decoding.append(tokens[:, t : t + 1])
    return torch.cat(losses, dim=1) if losses else tokens.new_zeros(tokens.shape[0], 0, dtype=torch.float32)


@torch.no_grad()
def fill_masks(
    model: EncoderMLM,
    ids: Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    context: int | None = None,
) -> Tensor:
    """ids (B, T) with ``model.mask_token_id`` at the blanks -> ids with every blank predicted (greedy by default).

    All blanks are predicted at once, bidirectionally. With ``context`` (the training length) and a longer text,
    each blank is read in the ``context``-token window centred on it (shifted to stay inside the text), as
    the encoder was trained to read; one forward pass per distinct window. None reads the whole text at once.
    """
    blanks = ids == model.mask_token_id
    if not blanks.any():
        return ids
    T = ids.shape[1]
    window = T if context is None else min(context, T)
    check_length(model.encoder, window)
    logits = torch.zeros(*ids.shape, model.vocab_size, device=ids.device)
    blank_positions = blanks.any(dim=0).nonzero().flatten().tolist()
    starts = {i: min(max(i - window // 2, 0), T - window) for i in blank_positions}
    for start in sorted(set(starts.values())):
        window_logits = model(ids[:, start : start + window]).float()  # (B, window, vocab)
        for i in (i for i, s in starts.items() if s == start):
            logits[:, i] = window_logits[:, i - start]
    logits = logits[blanks]  # (n_blanks, vocab)
    logits[:, model.mask_token_id] = float("-inf")  # a blank must not be filled with another blank
    filled = ids.clone()
    filled[blanks] = next_token(logits, temperature, top_k, top_p, generator)
    return filled
