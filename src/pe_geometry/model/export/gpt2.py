"""Learned absolute positions -> GPT-2 (transformers' ``gpt2``): the same pre-LN block, weight for weight.

GPT-2 adds a learned position table to the word embedding, normalises each sublayer's input (LayerNorm with bias),
projects q, k, v with one biased matrix, and has a biased MLP and a final LayerNorm; with ``activation_function="gelu"``
its MLP uses the exact GELU, as ours. Its ``Conv1D`` layers hold the transpose of an ``nn.Linear`` weight (x @ W + b),
so each matrix is transposed; ``c_attn`` is our ``q`` and ``kv`` (key rows, then value rows) stacked.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pe_geometry.model.export.architecture import Architecture, contiguous, copy_pairs, reversed_pairs

# transformers' name in a block -> ours: the LayerNorms, and the Conv1D layers (each our nn.Linear transposed)
NORMS = (("ln_1", "ln_attn"), ("ln_2", "ln_mlp"))
CONV1D = (("attn.c_proj", "attn.o"), ("mlp.c_fc", "mlp.up"), ("mlp.c_proj", "mlp.down"))


class GPT2(Architecture):
    model_type = "gpt2"
    OUR_KEYS = {"vocab_size": "the run's tokenizer (data.vocab_size)", "n_embd": "model.d_model",
                "n_layer": "model.n_layers", "n_head": "model.n_heads", "n_inner": "model.d_ff",
                "n_positions": "pe.max_len", "tie_word_embeddings": "embedding.tie_weights",
                "layer_norm_epsilon": "the LayerNorm eps (1e-5)", "activation_function": "the MLP's exact GELU ('gelu')",
                "scale_attn_weights": "q.k / sqrt(d_head) (true)", "scale_attn_by_inverse_layer_idx": "false",
                "add_cross_attention": "false"}

    def config(self) -> dict[str, Any]:
        m = self.model
        s = m.config.settings
        return {
            "vocab_size": m.vocab_size, "n_embd": m.d_model, "n_layer": s.n_layers, "n_head": s.n_heads,
            "n_inner": s.mlp_width, "n_positions": int(m.input_stack.pe.max_len),
            "activation_function": "gelu", "layer_norm_epsilon": self.layer_norm_eps,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "add_cross_attention": False, "tie_word_embeddings": self.tied,
            "resid_pdrop": s.dropout, "embd_pdrop": s.dropout, "attn_pdrop": s.dropout,
        }

    def to_transformers(self) -> dict[str, Tensor]:
        ours = self.model.state_dict()
        out = {"transformer.wte.weight": ours["decoder.embedding.embed.weight"],
               "transformer.wpe.weight": ours["decoder.pe.weight"],
               "transformer.ln_f.weight": ours["decoder.ln_final.weight"],
               "transformer.ln_f.bias": ours["decoder.ln_final.bias"],
               "lm_head.weight": ours["head.weight"]}
        for i in range(len(self.model.blocks)):
            b, h = f"decoder.blocks.{i}.", f"transformer.h.{i}."
            copy_pairs(ours, b, out, h, reversed_pairs(NORMS))
            out[f"{h}attn.c_attn.weight"] = torch.cat((ours[f"{b}attn.q.weight"], ours[f"{b}attn.kv.weight"])).T
            out[f"{h}attn.c_attn.bias"] = torch.cat((ours[f"{b}attn.q.bias"], ours[f"{b}attn.kv.bias"]))
            copy_pairs(ours, b, out, h, reversed_pairs(CONV1D), transpose=True)
        return contiguous(out)

    def from_transformers(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        d = self.model.d_model
        ours = {"decoder.embedding.embed.weight": state["transformer.wte.weight"],
                "decoder.pe.weight": state["transformer.wpe.weight"],
                "decoder.ln_final.weight": state["transformer.ln_f.weight"],
                "decoder.ln_final.bias": state["transformer.ln_f.bias"]}
        for i in range(len(self.model.blocks)):
            b, h = f"decoder.blocks.{i}.", f"transformer.h.{i}."
            copy_pairs(state, h, ours, b, NORMS)
            qkv, qkv_bias = state[f"{h}attn.c_attn.weight"].T, state[f"{h}attn.c_attn.bias"]
            ours[f"{b}attn.q.weight"], ours[f"{b}attn.kv.weight"] = qkv[:d], qkv[d:]
            ours[f"{b}attn.q.bias"], ours[f"{b}attn.kv.bias"] = qkv_bias[:d], qkv_bias[d:]
            copy_pairs(state, h, ours, b, CONV1D, transpose=True)
        return self._state(ours, state.get("lm_head.weight", state["transformer.wte.weight"]))
