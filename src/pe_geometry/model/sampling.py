"""Text generation from the three model layouts (torch only).

- ``generate``: autoregressive sampling for ``DecoderLM`` and ``EncoderDecoder``,
  incremental with a ``KVCache`` by default (``use_cache=False`` re-reads the
  whole sequence each step; both give the same logits).
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
from pe_geometry.model.transformer import DecoderLM, EncoderDecoder, EncoderMLM, LanguageModel


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


def check_length(model: LanguageModel, n_positions: int) -> None:
    """Raise ValueError when the decoder cannot place ``n_positions`` tokens (a learned table's limit)."""
    stack = model.decoder if isinstance(model, (DecoderLM, EncoderDecoder)) else model.encoder
    limit = stack.pe.max_positions
    if limit is not None and n_positions > limit:
        raise ValueError(
            f"{n_positions} positions needed but the {type(stack.pe).__name__} table has {limit} "
            f"(pe.max_len): shorten the prompt or max_new_tokens so they fit"
        )


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
) -> Tensor:
    """prompt (B, T) token ids -> (B, T + max_new_tokens): the prompt followed by the new tokens.

    The encoder-decoder reads all prompt tokens but the last with its encoder and
    starts decoding from the last one, as in training (the decoder's first input is
    the token right after the source); it needs a prompt of at least 2 tokens.
    """
    if isinstance(model, EncoderDecoder):
        if prompt.shape[1] < 2:
            raise ValueError("the encoder-decoder needs a prompt of at least 2 tokens (source + first decoder token)")
        src, tokens = prompt[:, :-1], prompt[:, -1:]

        def logits_of(ids: Tensor, cache: KVCache | None) -> Tensor:
            return model(src, ids, cache=cache)
    elif isinstance(model, DecoderLM):
        src, tokens = prompt[:, :0], prompt

        def logits_of(ids: Tensor, cache: KVCache | None) -> Tensor:
            return model(ids, cache=cache)
    else:
        raise TypeError(f"generate() needs a DecoderLM or EncoderDecoder, got {type(model).__name__}; use fill_masks for an encoder")
    # The last sampled token is never read back, so the decoder places T + max_new_tokens - 1 tokens.
    check_length(model, tokens.shape[1] + max_new_tokens - 1)
    cache = KVCache() if use_cache else None
    unread = tokens
    for _ in range(max_new_tokens):
        logits = logits_of(unread if use_cache else tokens, cache)[:, -1]  # (B, vocab)
        new = next_token(logits, temperature, top_k, top_p, generator)[:, None]  # (B, 1)
        tokens = torch.cat((tokens, new), dim=1)
        unread = new
    return torch.cat((src, tokens), dim=1)


@torch.no_grad()
def fill_masks(
    model: EncoderMLM,
    ids: Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """ids (B, T) with ``model.mask_token_id`` at the blanks -> ids with every blank predicted.

    All blanks are predicted in one bidirectional pass (greedy by default).
    """
    check_length(model, ids.shape[1])
    blanks = ids == model.mask_token_id
    if not blanks.any():
        return ids
    logits = model(ids)[blanks]  # (n_blanks, vocab)
    logits[:, model.mask_token_id] = float("-inf")  # a blank must not be filled with another blank
    filled = ids.clone()
    filled[blanks] = next_token(logits, temperature, top_k, top_p, generator)
    return filled
