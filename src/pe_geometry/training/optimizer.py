"""The optimiser and its learning-rate schedule, as ``configs/optimizer/*.yaml`` build them.

``optimizer=adamw`` names ``adamw_warmup_cosine`` with ``_partial_: true``: Hydra binds the settings
(``optimizer.lr``, ``optimizer.no_decay_embeddings``, ...) and ``LanguageModelTask`` calls the result
with the model and the run's length. Another optimiser is another function of the same shape,
``(model, max_steps, **settings) -> what LightningModule.configure_optimizers returns``, and a yaml
beside adamw.yaml that names it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from pe_geometry.model.embedding import TokenEmbedding
from pe_geometry.model.positional import PositionalEncoding
from pe_geometry.settings.training import AdamWSettings

# (model, max_steps) -> {"optimizer": ..., "lr_scheduler": ...}, the settings already bound
OptimizerFactory = Callable[..., dict[str, Any]]


def embedding_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The word embedding(s) and the parameters of the positional encoding(s): E and a learned P. A model built from
    other modules than ours names its own (``model.embedding_parameters()``: model=xtransformers)."""
    own = getattr(model, "embedding_parameters", None)
    if callable(own):
        return list({id(p): p for p in own()}.values())
    modules = [m for m in model.modules() if isinstance(m, (TokenEmbedding, PositionalEncoding))]
    return list({id(p): p for m in modules for p in m.parameters()}.values())


def warmup_cosine(step: int, warmup_steps: int, max_steps: int, min_ratio: float) -> float:
    """LR multiplier: linear warm-up, then cosine decay to ``min_ratio`` at ``max_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_stable_decay(step: int, warmup_steps: int, decay_start: int, max_steps: int, min_ratio: float) -> float:
    """LR multiplier: linear warm-up, constant until ``decay_start``, then linear decay to ``min_ratio`` at
    ``max_steps`` (Hu et al. 2024, MiniCPM's WSD). Up to ``decay_start`` it does not depend on ``max_steps``: one
    long run's checkpoint at step S, resumed as a branch (``branch=true``) with ``optimizer.decay_start=S`` and a
    shorter ``trainer.max_steps``, is exactly the run that was trained for that length from the start."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start) / max(1, max_steps - decay_start))
    return 1.0 - (1 - min_ratio) * progress


def weight_decay_groups(model: torch.nn.Module, weight_decay: float, no_decay_embeddings: bool) -> list[dict[str, Any]]:
    """Two parameter groups: matrices decay by ``weight_decay``; biases, norms and other 1-d parameters do not.

    With ``no_decay_embeddings`` the word embedding and a learned position table keep their scale too
    (decay shrinks E and P towards the origin, a pull that could shape their geometry); a tied output
    head is E, so it goes with it.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    kept = {id(p) for p in embedding_parameters(model)} if no_decay_embeddings else set()
    decay = [p for p in params if p.dim() >= 2 and id(p) not in kept]
    no_decay = [p for p in params if p.dim() < 2 or id(p) in kept]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def width_scaled_groups(groups: list[dict[str, Any]], model: torch.nn.Module, lr: float, base_width: int) -> list[dict[str, Any]]:
    """``groups`` with the hidden matrices' learning rate scaled by ``base_width / model.d_model`` (muP's rule for Adam,
    Yang et al. 2022, Tensor Programs V, table 3): a matrix whose both sides grow with the width (attention and MLP
    weights, an untied output head) gets lr * base_width / d_model; the word embedding, the positional encoding's
    parameters (a learned table), norms and biases keep ``lr``. The tied output head is the word embedding, so it
    keeps ``lr`` with it. Unlike full muP the initialisation and the output multiplier stay as they are: the
    "muP-style" rule the width curve states. At ``d_model == base_width`` every group has ``lr``."""
    ratio = base_width / model.d_model
    vectors_like = {id(p) for p in embedding_parameters(model)}
    out = []
    for group in groups:
        hidden = [p for p in group["params"] if p.dim() >= 2 and id(p) not in vectors_like]
        rest = [p for p in group["params"] if not (p.dim() >= 2 and id(p) not in vectors_like)]
        out += [{**group, "params": params, "lr": lr * scale} for params, scale in ((hidden, ratio), (rest, 1.0)) if params]
    return out


def adamw_warmup_cosine(model: torch.nn.Module, max_steps: int, **settings: Any) -> dict[str, Any]:
    """AdamW on ``weight_decay_groups``, its LR warmed up linearly over ``warmup_steps`` then decayed along a
    cosine to ``min_lr_ratio * lr`` at ``max_steps``, stepped every optimiser step.

    ``decay_start``: warmup-stable-decay instead of the cosine (``warmup_stable_decay``): constant from the warm-up to
    ``decay_start``, then linear to ``min_lr_ratio * lr`` at ``max_steps``. A ``decay_start`` past ``max_steps`` keeps
    the rate constant to the end.

    ``fused``: torch's fused AdamW, one kernel for every parameter's update (``trainer=gpu`` sets it; the same
    update up to float rounding). Off: torch's own choice (its multi-tensor loop on CUDA, a per-parameter loop on
    a CPU), which is why off passes ``None``, not ``False``: ``False`` would also switch the multi-tensor loop off.

    ``lr_base_width``: ``lr`` is the rate at that width, and the hidden matrices' rate scales as 1 / d_model from
    there (``width_scaled_groups``); None: one rate for every parameter.

    ``settings``: ``AdamWSettings`` (each one's default, type and range)."""
    s = AdamWSettings(**settings)
    lr, warmup_steps, min_lr_ratio, decay_start = s.lr, s.warmup_steps, s.min_lr_ratio, s.decay_start
    groups = weight_decay_groups(model, s.weight_decay, s.no_decay_embeddings)
    if s.lr_base_width is not None:
        groups = width_scaled_groups(groups, model, lr, s.lr_base_width)
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=tuple(s.betas), fused=True if s.fused else None)
    if decay_start is None:
        def multiplier(step: int) -> float:
            return warmup_cosine(step, warmup_steps, max_steps, min_lr_ratio)
    else:
        def multiplier(step: int) -> float:
            return warmup_stable_decay(step, warmup_steps, decay_start, max_steps, min_lr_ratio)
    # a plain function, not a callable object: LambdaLR's state_dict leaves it out, so a branch's resume keeps the
    # schedule its own config builds (its decay_start), not the trunk's
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


adamw_warmup_cosine.Settings = AdamWSettings  # as a class's: the settings the factory takes besides (model, max_steps)
