"""RoPE (and NoPE) -> GPT-NeoX (transformers' ``gpt_neox``): the same pre-LN block, weight for weight.

With ``use_parallel_residual=False`` a GPT-NeoX layer is ours: x + attn(LN(x)), then + mlp(LN(.)), LayerNorms with
bias, biased projections (``attention_bias=True``), an exact-GELU MLP (``hidden_act="gelu"``), a final LayerNorm.
It rotates the first ``partial_rotary_factor`` of each head with GPT-NeoX's frequencies theta_i = rope_theta^(-2i/R).

Two layouts of the rotating pairs: ours rotates the pairs of neighbouring dims (2i, 2i+1) of the first R dims,
GPT-NeoX the pairs (i, i + R/2) ("rotate_half"). Ordering each head's first R query and key rows as [0, 2, .., R-2,
1, 3, .., R-1] puts our pair i where GPT-NeoX rotates by theta_i, with the same sign; q.k is unchanged because
queries and keys are reordered alike (values are not). The fused ``query_key_value`` holds, per head, its query,
key and value rows.

Frequencies and scalings, for R rotating dims whose frequencies ours writes theta_i = base^(-2i/D) (D = R for
``partial_rotary=neox``, d_head for ``p_rope``): rope_theta = base^(R/D) gives the same theta_i; ``linear`` and
``llama3`` are transformers' rope types of the same names (llama3's smooth factor is our ramp in the turns, with
alpha = low_freq_factor, beta = high_freq_factor); ``ntk`` is the default type with the NTK base; ``yarn`` is
transformers' yarn with ``yarn_ramp=dims`` (the ramp it implements), beta_fast = yarn_beta, beta_slow = yarn_alpha.
NoPE is ``partial_rotary_factor=0``: nothing rotates.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pe_geometry.model.export.architecture import Architecture, contiguous, copy_pairs, reversed_pairs
from pe_geometry.model.positional import NoPE, RotaryPE

# transformers' name in a layer -> ours: the LayerNorms and the linear layers, copied as they are
NORMS = (("input_layernorm", "ln_attn"), ("post_attention_layernorm", "ln_mlp"))
LINEARS = (("attention.dense", "attn.o"), ("mlp.dense_h_to_4h", "mlp.up"), ("mlp.dense_4h_to_h", "mlp.down"))


class GPTNeoX(Architecture):
    model_type = "gpt_neox"
    OUR_KEYS = {"vocab_size": "the run's tokenizer (data.vocab_size)", "hidden_size": "model.d_model",
                "num_hidden_layers": "model.n_layers", "num_attention_heads": "model.n_heads",
                "intermediate_size": "model.d_ff", "tie_word_embeddings": "embedding.tie_weights",
                "layer_norm_eps": "the LayerNorm eps (1e-5)", "hidden_act": "the MLP's exact GELU ('gelu')",
                "use_parallel_residual": "our sequential block (false)", "attention_bias": "biased projections (true)",
                "rope_type": "pe.scaling", "rope_theta": "pe.base", "partial_rotary_factor": "pe.rotary_fraction",
                "factor": "pe.scaling_factor", "original_max_position_embeddings": "pe.training_length",
                "low_freq_factor": "pe.low_freq_factor", "high_freq_factor": "pe.high_freq_factor",
                "beta_fast": "pe.yarn_beta", "beta_slow": "pe.yarn_alpha", "attention_factor": "pe.yarn_attention_factor"}

    @property
    def pe(self) -> RotaryPE | NoPE:
        return self.model.input_stack.pe

    @property
    def d_head(self) -> int:
        return self.model.d_model // self.model.config.n_heads

    @property
    def rotary_dims(self) -> int:
        return self.pe.rotary_dims if isinstance(self.pe, RotaryPE) else 0

    def rope_parameters(self) -> dict[str, Any]:
        """transformers' ``rope_parameters`` that rotate as our encoding does (``support`` refused the rest)."""
        R = self.rotary_dims
        if R == 0:  # NoPE: nothing rotates (the theta is never read)
            return {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.0}
        pe = self.pe
        D, s = pe.frequency_dims, pe.scaling_factor
        base = pe.base * s ** (D / (R - 2)) if pe.scaling == "ntk" else pe.base
        params: dict[str, Any] = {"rope_type": "default", "rope_theta": base if D == R else base ** (R / D),
                                  "partial_rotary_factor": R / self.d_head}
        if pe.scaling == "linear":
            params.update(rope_type="linear", factor=s)
        elif pe.scaling == "llama3":
            params.update(rope_type="llama3", factor=s, low_freq_factor=pe.low_freq_factor,
                          high_freq_factor=pe.high_freq_factor, original_max_position_embeddings=pe.training_length)
        elif pe.scaling == "yarn":
            params.update(rope_type="yarn", factor=s, original_max_position_embeddings=pe.training_length,
                          beta_fast=pe.yarn_beta, beta_slow=pe.yarn_alpha, attention_factor=pe.attention_factor,
                          truncate=True)
        return params

    def config(self) -> dict[str, Any]:
        m = self.model
        s = m.config.settings
        return {
            "vocab_size": m.vocab_size, "hidden_size": m.d_model, "num_hidden_layers": s.n_layers,
            "num_attention_heads": s.n_heads, "intermediate_size": s.mlp_width, "hidden_act": "gelu",
            "layer_norm_eps": self.layer_norm_eps, "use_parallel_residual": False, "attention_bias": True,
            "tie_word_embeddings": self.tied, "rope_parameters": self.rope_parameters(),
            "max_position_embeddings": self.training_length or 2048,
            "attention_dropout": s.dropout, "hidden_dropout": s.dropout,
        }

    def _order(self) -> Tensor:
        """Each head's rows in GPT-NeoX's layout: the even rotating dims, the odd ones, then the rest (module doc)."""
        R = self.rotary_dims
        return torch.tensor([*range(0, R, 2), *range(1, R, 2), *range(R, self.d_head)])

    def to_transformers(self) -> dict[str, Tensor]:
        ours = self.model.state_dict()
        H, dh, order = self.model.config.n_heads, self.d_head, self._order()
        out = {"gpt_neox.embed_in.weight": ours["decoder.embedding.embed.weight"],
               "gpt_neox.final_layer_norm.weight": ours["decoder.ln_final.weight"],
               "gpt_neox.final_layer_norm.bias": ours["decoder.ln_final.bias"],
               "lm_head.weight": ours["head.weight"]}
        for i in range(len(self.model.blocks)):
            b, n = f"decoder.blocks.{i}.", f"gpt_neox.layers.{i}."
            copy_pairs(ours, b, out, n, reversed_pairs(NORMS))
            for kind in ("weight", "bias"):
                q = ours[f"{b}attn.q.{kind}"].unflatten(0, (H, dh))  # (H, dh[, D])
                k, v = ours[f"{b}attn.kv.{kind}"].unflatten(0, (2, H, dh)).unbind(0)
                out[f"{n}attention.query_key_value.{kind}"] = torch.stack((q[:, order], k[:, order], v), 1).flatten(0, 2)
            copy_pairs(ours, b, out, n, reversed_pairs(LINEARS))
        return contiguous(out)

    def from_transformers(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        H, dh, back = self.model.config.n_heads, self.d_head, self._order().argsort()
        ours = {"decoder.embedding.embed.weight": state["gpt_neox.embed_in.weight"],
                "decoder.ln_final.weight": state["gpt_neox.final_layer_norm.weight"],
                "decoder.ln_final.bias": state["gpt_neox.final_layer_norm.bias"]}
        for i in range(len(self.model.blocks)):
            b, n = f"decoder.blocks.{i}.", f"gpt_neox.layers.{i}."
            copy_pairs(state, n, ours, b, NORMS)
            for kind in ("weight", "bias"):
                q, k, v = state[f"{n}attention.query_key_value.{kind}"].unflatten(0, (H, 3, dh)).unbind(1)
                ours[f"{b}attn.q.{kind}"] = q[:, back].flatten(0, 1)
                ours[f"{b}attn.kv.{kind}"] = torch.stack((k[:, back], v)).flatten(0, 2)
            copy_pairs(state, n, ours, b, LINEARS)
        return self._state(ours, state.get("lm_head.weight", state["gpt_neox.embed_in.weight"]))
