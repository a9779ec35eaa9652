"""The settings of the optimiser (``optimizer=adamw``) and of our own callbacks (``callbacks.geometry``,
``callbacks.sample``): ``pe_geometry.training.optimizer.adamw_warmup_cosine``, ``pe_geometry.analysis.geometry_callback
.GeometryCallback`` and ``pe_geometry.training.sample.SampleTextCallback`` built from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

from annotated_types import Ge, Gt, Interval

from pe_geometry.settings.base import MAX_SEED, Settings, SettingsError, Sizes, component

Beta = Annotated[float, Interval(ge=0, lt=1)]


@component("pe_geometry.training.optimizer.adamw_warmup_cosine")
@dataclass(frozen=True)
class AdamWSettings(Settings):
    """AdamW (decay on matrices only), its LR warmed up linearly then decayed along a cosine (or, with
    ``decay_start``, held and then decayed linearly: warmup-stable-decay) to ``min_lr_ratio * lr``. The factory takes
    the model and ``trainer.max_steps`` besides (``configs.SUPPLIED``)."""

    group: ClassVar[str] = "optimizer"

    lr: Annotated[float, Gt(0)] = 1e-3
    weight_decay: Annotated[float, Ge(0)] = 0.1
    betas: Annotated[tuple[Beta, Beta], "a pair of numbers in [0, 1), e.g. [0.9,0.95]"] = (0.9, 0.95)
    warmup_steps: Annotated[int, Ge(0)] = 100
    min_lr_ratio: Annotated[float, Interval(ge=0, le=1), "of optimizer.lr"] = 0.1
    no_decay_embeddings: bool = False
    fused: bool = False  # torch's fused AdamW kernel (trainer=gpu sets it)
    lr_base_width: Annotated[int | None, Ge(1), "the d_model optimizer.lr is meant for"] = None
    decay_start: Annotated[int | None, Ge(0), "the step the LR starts to fall (warmup-stable-decay)"] = None


MEASURES = ("input", "hidden", "attention")  # what the geometry recorder can measure (analysis.record.MEASURES)


@component("pe_geometry.analysis.geometry_callback.GeometryCallback")
@dataclass(frozen=True)
class GeometryCallbackSettings(Settings):
    """When the geometry recorder measures (``every_n_steps``; the powered position probe every
    ``position_probe_every_n_steps``), on which rows (the ``n_tokens`` most frequent words, ``probe_batch_size``
    validation blocks, ``position_probe_blocks`` for the probe) and with which nulls (``analysis.record``)."""

    group: ClassVar[str] = "callbacks.geometry"

    every_n_steps: Annotated[int, Ge(1)] = 100
    n_tokens: Annotated[int, Ge(1)] = 1000
    measures: list[Literal[MEASURES]] = MEASURES
    probe_batch_size: Annotated[int, Ge(1)] = 8
    fixed_k: Annotated[int, Ge(1)] = 8
    positional_head_threshold: Annotated[float, Interval(gt=0, lt=1)] = 0.5
    seed: Annotated[int, Interval(ge=0, le=MAX_SEED)] = 0
    null_draws: Annotated[int, Ge(2), "so that the null has a spread"] = 100
    position_probe_every_n_steps: Annotated[int, Ge(1)] = 500
    position_probe_blocks: Annotated[int, Ge(5), "5-fold cross-validation by block"] = 128
    position_probe_permutations: Annotated[int, Ge(2)] = 20
    chunk_tokens: Annotated[int, Ge(1)] = 8192
    attention_null_draws: Annotated[int, Ge(2), "so that the null has a spread"] = 20

    def check(self, sizes: Sizes) -> None:
        if self.fixed_k > sizes.d_model:
            raise SettingsError(f"callbacks.geometry.fixed_k={self.fixed_k} must be at most model.d_model={sizes.d_model}")


@component("pe_geometry.training.sample.SampleTextCallback")
@dataclass(frozen=True)
class SampleTextSettings(Settings):
    """The text sample at the end of training: ``prompt`` continued by ``max_new_tokens`` tokens (an encoder fills
    every ``blank_every``-th of as many validation tokens), read through the training length (``context: train``) or
    the whole text (``full``)."""

    group: ClassVar[str] = "callbacks.sample"

    prompt: str = "ROMEO:\n"
    max_new_tokens: Annotated[int, Ge(0), "0: no sample"] = 48
    temperature: Annotated[float, Ge(0), "0: greedy"] = 0.8
    top_k: Annotated[int | None, Ge(0), "0 or null: off"] = 40
    top_p: Annotated[float | None, Interval(gt=0, le=1), "1 or null: off"] = 0.95
    blank_every: Annotated[int, Ge(1)] = 6
    seed: Annotated[int, Interval(ge=0, le=MAX_SEED)] = 0
    context: Literal["train", "full"] = "train"


@component("pe_geometry.training.progress.StepProgress")
@dataclass(frozen=True)
class StepProgressSettings(Settings):
    """The whole-run progress: a bar on a terminal, a log line every ``log_every_n_steps`` steps elsewhere."""

    group: ClassVar[str] = "callbacks.progress_bar"

    log_every_n_steps: Annotated[int, Ge(1)] = 50
    force_lines: bool | None = None  # null: lines when stdout is not a terminal


@component("pe_geometry.training.thread_follower.ThreadCountFollower")
@dataclass(frozen=True)
class ThreadFollowerSettings(Settings):
    """How often a run looks at how many CPU cores other processes hold, to move torch's thread count to the rest
    (``training.thread_follower``; a change needs two looks in a row that agree). Off where ``OMP_NUM_THREADS`` or
    ``MKL_NUM_THREADS`` is set, under DDP and without /proc/stat; ``callbacks.threads=null`` turns it off."""

    group: ClassVar[str] = "callbacks.threads"

    every_seconds: Annotated[float, Gt(0), "of wall time between looks"] = 10.0
