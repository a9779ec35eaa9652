"""A run's own tokenizer (a ``tokenizers.Tokenizer``: byte-level BPE or one token per character, data/tokenizer.py)
as a transformers fast tokenizer, so ``AutoTokenizer.from_pretrained(folder)`` encodes text to the ids the run read.

Every document followed an ``<eos>`` in training, and ``pe-generate`` starts a prompt with one (model/sampling.py's
``prompt_ids``): the exported tokenizer does the same (``<eos>`` is its bos token, put before each text by its
post-processor), so ``tokenizer(text)`` gives what our generation reads, and ``skip_special_tokens`` drops it again.
"""

from __future__ import annotations

from tokenizers import Tokenizer, processors

from pe_geometry.extras import needs_extra
from pe_geometry.settings.data import SPECIAL_TOKENS

UNK, MASK, EOS = SPECIAL_TOKENS  # ids 0, 1, 2 in every vocabulary of ours


def fast_tokenizer(tokenizer: Tokenizer):
    """A ``transformers.PreTrainedTokenizerFast`` over a copy of ``tokenizer``, with our special tokens named."""
    with needs_extra("pretrained", "a transformers tokenizer"):
        from transformers import PreTrainedTokenizerFast

    copy = Tokenizer.from_str(tokenizer.to_str())
    eos_id = copy.token_to_id(EOS)
    copy.post_processor = processors.TemplateProcessing(single=f"{EOS} $A", pair=f"{EOS} $A {EOS} $B",
                                                        special_tokens=[(EOS, eos_id)])
    return PreTrainedTokenizerFast(tokenizer_object=copy, bos_token=EOS, eos_token=EOS, unk_token=UNK, mask_token=MASK)
