"""What every transformers architecture we export to provides: its config, and our weights mapped to its names and back.

An ``Architecture`` is built for one model (``support.architecture_for`` chooses it, or refuses in one line). Its maps
are exact: a weight is copied, transposed, or has its rows reordered, never rescaled, so ours -> transformers -> ours
gives back the very tensors (tests/test_export.py checks it bit for bit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor

from pe_geometry.model.transformer import DecoderLM


class ExportError(ValueError):
    """A model (or a checkpoint folder) that has no exact transformers counterpart; the message is one line."""


@dataclass
class Architecture:
    """One of transformers' architectures, with the settings that make it compute what ``model`` computes."""

    model: DecoderLM
    training_length: int | None  # the run's data.seq_len: the length RoPE's scalings stretch from

    model_type: ClassVar[str] = ""  # transformers' config.model_type
    # a transformers config key -> the config key of ours that sets it, for the lines that name a mismatch
    OUR_KEYS: ClassVar[dict[str, str]] = {}

    @property
    def tied(self) -> bool:
        """Whether the output head is the word embedding itself (embedding.tie_weights)."""
        return self.model.head.weight is self.model.W_E

    @property
    def layer_norm_eps(self) -> float:
        return float(self.model.input_stack.ln_final.eps)

    def config(self) -> dict[str, Any]:
        """The transformers config's keywords (``AutoConfig.for_model(model_type, **config())``)."""
        raise NotImplementedError

    def to_transformers(self) -> dict[str, Tensor]:
        """Our weights under transformers' names (the head included, tied or not)."""
        raise NotImplementedError

    def from_transformers(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """transformers' weights (``to_transformers``'s names) -> our ``state_dict`` (both names of a tied matrix)."""
        raise NotImplementedError

    def _state(self, ours: dict[str, Tensor], head: Tensor) -> dict[str, Tensor]:
        """Our whole ``state_dict`` from its distinct weights (``ours``) and the head: a module shared by several
        owners (a tied head, the encoding every attention layer holds) is listed once per name, one tensor for all."""
        ours = {**ours, "head.weight": head}
        names: dict[int, list[str]] = {}
        for name, t in self.model.state_dict(keep_vars=True).items():
            names.setdefault(id(t), []).append(name)
        state = {}
        for aliases in names.values():
            # a tied head is the word embedding: that weight, whatever the checkpoint's own head row says
            given = [ours[n] for n in aliases if n in ours and n != "head.weight"] or [ours[aliases[0]]]
            for name in aliases:
                state[name] = given[0]
        return contiguous(state)


def copy_pairs(source: dict[str, Tensor], source_prefix: str, target: dict[str, Tensor], target_prefix: str,
               pairs: tuple[tuple[str, str], ...], transpose: bool = False) -> None:
    """For each (source name, target name) of ``pairs``: the module's weight and bias copied across (the weight
    transposed where one side stores ``x @ W``). One table of names serves both directions, the pairs reversed."""
    for theirs, mine in pairs:
        weight = source[f"{source_prefix}{theirs}.weight"]
        target[f"{target_prefix}{mine}.weight"] = weight.T if transpose else weight
        target[f"{target_prefix}{mine}.bias"] = source[f"{source_prefix}{theirs}.bias"]


def reversed_pairs(pairs: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    return tuple((b, a) for a, b in pairs)


def contiguous(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Each tensor as its own contiguous copy (transposes and slices are views; safetensors wants plain tensors)."""
    return {name: t.detach().contiguous().clone() for name, t in state.items()}
