"""Which transformers architecture computes exactly what a model of ours computes, or one line saying why none does.

Exportable: a decoder (``model=decoder``) with the pre-LN block (``model.norm=pre``), no layer pattern, a plain word
embedding (``embedding.scaled=false``, tied or not), plain multi-head attention (no ``n_kv_heads``, ``qk_norm``,
``window`` or ``logn_scaling``; either kernel), and one of

- ``pe=learned`` -> GPT-2 (its table of ``pe.max_len`` rows; ``pe.shuffle`` is a control arm, not exported);
- ``pe=rope`` -> GPT-NeoX: full or partial rotation (both ``partial_rotary`` styles) and the scalings ``none``,
  ``linear``, ``ntk``, ``llama3``, and ``yarn`` with ``yarn_ramp=dims`` on a full rotation;
- ``pe=none`` -> GPT-NeoX with nothing rotated.

Everything else is refused, naming what differs: transformers has no architecture for FIRE, Kerple, CoPE, FoX, xPos,
T5's bias in a decoder or the sinusoidal table; its ALiBi models each differ from our block (BLOOM normalises the
embeddings and uses the tanh GELU, MPT has no biases, Falcon divides the ALiBi bias by sqrt(d_head) and rounds its
slopes to bfloat16); BERT normalises the summed embeddings (a LayerNorm ours has not) and is post-LN.
"""

from __future__ import annotations

from torch import nn

from pe_geometry.model.attention import ExplicitAttention, SDPAttention
from pe_geometry.model.embedding import TokenEmbedding
from pe_geometry.model.export.architecture import Architecture, ExportError
from pe_geometry.model.export.gpt2 import GPT2
from pe_geometry.model.export.gpt_neox import GPTNeoX
from pe_geometry.model.positional import LearnedPE, NoPE, RotaryPE
from pe_geometry.model.transformer import MLP, DecoderLM, EncoderDecoder, EncoderMLM

SUPPORTED = ("exportable: a pre-LN decoder (model=decoder) with pe=learned (GPT-2), pe=rope (GPT-NeoX) or pe=none "
             "(GPT-NeoX, nothing rotated)")
ARCHITECTURES: dict[str, type[Architecture]] = {"gpt2": GPT2, "gpt_neox": GPTNeoX}
# Why the families transformers has no exact architecture for are refused, in the refusal's words.
NO_ARCHITECTURE = {
    "alibi": "no transformers architecture matches our ALiBi block exactly (BLOOM normalises the embeddings and uses "
             "the tanh GELU, MPT has no biases, Falcon divides the ALiBi bias by sqrt(d_head) and rounds its slopes "
             "to bfloat16)",
    "sinusoidal": "transformers has no decoder that adds the fixed sinusoidal table",
    "xpos": "transformers has no xPos decoder",
    "t5_bias": "transformers has T5's bias only in T5's own encoder-decoder (RMSNorm, no biases, gated MLP options)",
    "fire": "transformers has no FIRE architecture",
    "kerple": "transformers has no Kerple architecture",
    "cope": "transformers has no CoPE architecture",
    "forgetting": "transformers has no Forgetting Transformer architecture",
}


def refuse(what: str) -> ExportError:
    return ExportError(f"{what}; {SUPPORTED}")


def _family(pe: nn.Module) -> str:
    return getattr(getattr(type(pe), "Settings", None), "family", "") or type(pe).__name__


def _check_block(model: nn.Module) -> None:
    """Refuse (one line) a layout or a block transformers' GPT-2 / GPT-NeoX do not compute exactly."""
    if isinstance(model, EncoderMLM):
        raise refuse("model=encoder: BERT (and RoBERTa) normalise the summed embeddings with a LayerNorm our encoder "
                     "has not, and are post-LN; no transformers encoder matches ours exactly")
    if isinstance(model, EncoderDecoder):
        raise refuse("model=encoder_decoder: no transformers encoder-decoder has our block (LayerNorm with bias, "
                     "biased projections, one shared embedding, our encodings on both sides)")
    if type(model) is not DecoderLM:
        raise refuse(f"{type(model).__name__} is not our DecoderLM (model=xtransformers is x-transformers' own)")
    s = model.config.settings
    if s.norm != "pre":
        raise refuse(f"model.norm={s.norm}: GPT-2 and GPT-NeoX normalise each sublayer's input (pre-LN)")
    if s.layer_pattern is not None:
        raise refuse("model.layer_pattern: GPT-2 and GPT-NeoX give every layer the same encoding and no window")
    stack = model.input_stack
    if type(stack.embedding) is not TokenEmbedding or stack.embedding.scale != 1.0:
        raise refuse("embedding.scaled=true: GPT-2 and GPT-NeoX add the word embedding unscaled (sqrt(d_model) is "
                     "not a setting of theirs)")
    for i, block in enumerate(model.blocks):
        attn = block.attn
        if type(attn) not in (SDPAttention, ExplicitAttention):
            raise refuse(f"block {i}'s attention is {type(attn).__name__}, not ours (attention=sdpa|explicit)")
        a = attn.settings
        for key, value, plain in (("n_kv_heads", attn.n_kv_heads, model.config.n_heads), ("qk_norm", a.qk_norm, False),
                                  ("window", a.window, None), ("logn_scaling", a.logn_scaling, False)):
            if value != plain:
                raise refuse(f"attention.{key}={value}: GPT-2 and GPT-NeoX have plain multi-head attention "
                             f"(attention.{key}={plain})")
        if type(block.mlp) is not MLP or block.norm != "pre":
            raise refuse(f"block {i} is not our pre-LN block with the GELU MLP")
        norms = [block.ln_attn, block.ln_mlp, stack.ln_final]
        if any(type(n) is not nn.LayerNorm or n.eps != stack.ln_final.eps or n.bias is None for n in norms):
            raise refuse(f"block {i}'s LayerNorms are not the plain ones (one eps, with bias)")


def architecture_for(model: nn.Module, training_length: int | None = None) -> Architecture:
    """The architecture that computes what ``model`` computes (``training_length``: the run's data.seq_len, what a
    RoPE scaling stretches from), or ``ExportError``: one line naming what differs and what is exportable."""
    _check_block(model)
    pe = model.input_stack.pe
    family = _family(pe)
    if type(pe) is LearnedPE:
        if pe.shuffle:
            raise refuse("pe.shuffle=true: a control arm whose every forward reads the table in a random order; "
                         "transformers reads position t at row t")
        return GPT2(model, training_length)
    if type(pe) is NoPE:
        return GPTNeoX(model, training_length)
    if type(pe) is RotaryPE:
        _check_rope(pe)
        return GPTNeoX(model, training_length)
    if family in NO_ARCHITECTURE:
        raise refuse(f"pe={family}: {NO_ARCHITECTURE[family]}")
    raise refuse(f"pe={family}: an encoding transformers has no architecture for")


def _check_rope(pe: RotaryPE) -> None:
    """Refuse the rotations GPT-NeoX cannot reproduce exactly (one line each)."""
    R, d_head = pe.rotary_dims, pe.d_head
    if int(d_head * (R / d_head)) != R:  # transformers truncates d_head x partial_rotary_factor
        raise refuse(f"pe.rotary_fraction={pe.rotary_fraction}: {R} of {d_head} dims rotate, which transformers' "
                     f"int(d_head x partial_rotary_factor) cannot give")
    scaling = pe.scaling
    if scaling == "dynamic_ntk":
        raise refuse("pe.scaling=dynamic_ntk: transformers' dynamic RoPE keeps the keys it cached at the base of a "
                     "shorter text, where ours re-encodes them, so generation past the training length differs; "
                     "transformers' RoPE scalings we match: none, linear, ntk, llama3, yarn (yarn_ramp=dims)")
    if scaling in ("yarn", "llama3", "dynamic_ntk") and pe.training_length is None:
        raise refuse(f"pe.scaling={scaling} with pe.training_length=null: transformers needs the length it stretches from")
    if scaling == "yarn":
        if pe.yarn_ramp != "dims":
            raise refuse("pe.scaling=yarn with pe.yarn_ramp=turns (the paper's ramp, linear in the turns): transformers "
                         "implements the official code's ramp, linear in the pair index (pe.yarn_ramp=dims)")
        if R != d_head and pe.attention_factor != 1.0:
            raise refuse(f"pe.scaling=yarn with pe.rotary_fraction={pe.rotary_fraction}: ours multiplies all of q and "
                         "k by the YaRN attention factor, transformers only the rotated dims")
        if not pe.yarn_alpha:
            raise refuse("pe.yarn_alpha=0: transformers reads beta_slow=0 as its default 1")
