"""The Forgetting Transformer (FoX; Lin, Nikishin, He and Courville, ICLR 2025) as a positional encoding.

Each self-attention layer reads a forget gate per head h and token t from its own input x (the block's normalised
residual stream), f_t,h = sigmoid(w_h . x_t + b_h), and query i's logit for key j <= i gains

    D_ij = sum_{l=j+1}^{i} log f_l,h = c_i - c_j,    c_t = log f_1 + ... + log f_t,

so O = softmax(QK^T / sqrt(d_head) + D) V under the causal mask. D_ii = 0: a token never forgets itself. A gate
fixed at f is ALiBi with slope -log f (D_ij = (i - j) log f); a gate at 1 is causal attention with no position
signal (NoPE); the learned gate makes the decay depend on what the tokens are (x-transformers calls it
data-dependent ALiBi). ``rotary=True`` also rotates q and k as RoPE does (``RotaryPE``, composed), the paper's
"FoX with RoPE" ablation; without it the gates and the causal mask are the only source of order, the paper's FoX.

Where the weights live: the encoding is the stack's, one module shared by its blocks like every encoding (the
settings, and RoPE's table with ``rotary``), but the gate is per layer: each self-attention asks the encoding for
its own ``ForgetGate`` (``layer_module``) and owns it as ``attn.pe_layer``. So ``blocks[i].attn.pe_layer.weight``
(H, d_model) and ``.bias`` (H,) are layer i's w and b, trained with that layer.

The data-dependent hooks, which model/attention.py calls on any encoding that has them (an encoding without them
costs one attribute test per layer call):

- ``layer_module()``: the module of weights the encoding keeps per self-attention layer (here the gate), or None;
- ``input_gates(x, layer)``: per-token values (B, H, T) float32 read from the layer's input x (B, T, D) with the
  layer's own module: here log f. A ``KVCache`` keeps them beside the keys (``KVCache.append_gates``, with the same
  window), so a cached step sees those of every key it attends to;
- ``gate_bias(gates, q_len, causal)``: the score term (B, H, Tq, S) they give the last Tq of the S tokens as
  queries: here c_i - c_j, c the cumulative sum over the S tokens a query sees. Only differences of c enter, so a
  cache (or a window) that starts the sum later gives the same D as the full pass.

Causal only: D sums the gates from a key up to its query, left to right. A bidirectional stack (``model=encoder``,
the encoder of ``model=encoder_decoder``) is refused (``check_causal``), as is ``randomize_positions``: the decay is
counted in tokens, not read from position ids (with ``rotary=True`` only the rotation would read them).

Initialisation: w ~ N(0, 0.02^2) as every weight matrix here, and b = ``gate_bias_init`` (5: f = sigmoid(5) = 0.9933,
log f = -0.0067, so D starts as a gentle ALiBi of slope 0.0067 per head and the model starts close to NoPE), as
x-transformers' ``DataDependentAlibi(bias_init=5)``. The paper's code (zhixuan-lin/forgetting-transformer,
``fgate_type="full"``) zeroes the bias (f = 0.5 at init, D_ij = -0.69 (i - j): strongly local); ``gate_bias_init=0``
is that. The gate is not an ``nn.Linear``, so the model's weight init (``LanguageModel._init_weights``, which zeroes
Linear biases) leaves it as built. Its bias is 1-d, so it takes no weight decay (training/optimizer.py), as the
paper's code exempts its gate biases.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pe_geometry.model.embedding import INIT_STD
from pe_geometry.model.positional import PositionalEncoding, RotaryPE
from pe_geometry.settings.positional import CAUSAL_ONLY, ForgettingSettings  # noqa: F401  (CAUSAL_ONLY: re-exported)


class ForgetGate(nn.Module):
    """One self-attention layer's forget gates: log f (B, H, T) = logsigmoid(x @ weight.T + bias).

    ``weight`` (H, d_model), ``bias`` (H,) start at N(0, INIT_STD^2) and ``bias_init``."""

    def __init__(self, d_model: int, n_heads: int, bias_init: float = 5.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_heads, d_model) * INIT_STD)
        self.bias = nn.Parameter(torch.full((n_heads,), float(bias_init)))

    def forward(self, x: Tensor) -> Tensor:
        """x (B, T, D) -> log f (B, H, T) in float32: the projection in the model's precision, the log sigmoid (whose
        sums decay the logits) in float32, as the paper's code."""
        logits = F.linear(x, self.weight, self.bias).float()  # (B, T, H)
        return F.logsigmoid(logits).transpose(1, 2)


class ForgettingPE(PositionalEncoding):
    """FoX (module docstring): a forget gate per layer, head and token whose log sums are added to the logits.

    ``rotary``: also rotate q and k as RoPE with ``base`` (the paper's FoX with RoPE; off: FoX alone).
    ``gate_bias_init``: every gate's bias b at init, f = sigmoid(b) (5: f = 0.9933; the paper's code: 0, f = 0.5).
    """

    Settings = ForgettingSettings  # causal_only: a bidirectional stack is refused (training/validate.py asks first)

    def __init__(self, d_model: int, n_heads: int, **settings: Any) -> None:
        super().__init__(d_model, n_heads, **settings)
        self.gate_bias_init = float(self.settings.gate_bias_init)
        self.rope = RotaryPE(d_model, n_heads, base=self.settings.base) if self.settings.rotary else None
        self._causal = True

    def check_causal(self, causal: bool) -> None:
        """ValueError (one line) for a bidirectional stack (``causal`` False): the gate bias is causal only."""
        self.settings.check_causal(causal)

    @property
    def causal(self) -> bool:  # type: ignore[override]
        return self._causal

    @causal.setter
    def causal(self, causal: bool) -> None:  # the stack sets it once built: an encoder's stack is refused here
        self.check_causal(causal)
        self._causal = causal

    def rotate_qk(self, q: Tensor, k: Tensor, start_pos: int = 0, positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if self.rope is None:
            return q, k
        return self.rope.rotate_qk(q, k, start_pos, positions=positions)

    def layer_module(self) -> ForgetGate:
        """A new layer's own gate (each self-attention calls this once and keeps the result as ``pe_layer``)."""
        return ForgetGate(self.d_model, self.n_heads, self.gate_bias_init)

    def input_gates(self, x: Tensor, layer: ForgetGate) -> Tensor:
        """log f (B, H, T) float32 of the layer's input x (B, T, D), by the layer's own gate."""
        return layer(x)

    def gate_bias(self, gates: Tensor, q_len: int, causal: bool) -> Tensor:
        """D (B, H, Tq, S) float32 from the log gates (B, H, S) of the S tokens the queries see, the queries being the
        last Tq of them: D_ij = c_i - c_j, c the cumulative sum over the S tokens. Keys after a query get a positive
        value, which the causal mask hides."""
        self.check_causal(causal)
        c = gates.float().cumsum(dim=-1)  # (B, H, S)
        return c[..., -q_len:, None] - c[..., None, :]
