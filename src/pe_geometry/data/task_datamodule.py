"""data=task: a synthetic task (``data/tasks.py``) served as (block, answer mask) batches, generated on the fly.

Training batch i is generated from a generator seeded by (``seed``, i) alone, so every family trained at a seed sees
the same examples in the same order, a resumed run the batches the uninterrupted one would have seen, and a DDP rank
r every ``world_size``-th of them from r. Validation is ``val_examples`` held-out examples (their own seed stream and,
for the passkey, the held-out plays as filler), the same at every validation. The training task scores the answer
tokens only (``training/task.py``) and logs ``val/answer_accuracy`` and ``val/answer_exact_match``.

The tokenizer is a fixed word-level one over ``tasks.TASK_VOCAB``, one character a token (nothing is trained or
cached), so the code that reads a datamodule's ``tokenizer`` and token ``streams`` (the geometry callback, the text
sample) reads this one as it reads a corpus's; ``streams`` holds the first ``val_examples`` training examples and the
validation examples, blocks end to end.
"""

from __future__ import annotations

import functools
from typing import Any

import lightning as L
import numpy as np
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

from pe_geometry.data.position import DataPosition
from pe_geometry.data.tasks import TASK_VOCAB, TaskBatch, make_batch, play_filler
from pe_geometry.data.tokenizer import SPECIAL_TOKENS
from pe_geometry.settings.data import TaskDataSettings

SPLIT_STREAMS = {"train": 0, "validation": 1}  # each split draws from its own seed stream
ENDLESS = 2**31 - 1  # training batches in an "epoch": generated as asked for, never repeated


def task_tokenizer() -> Tokenizer:
    """A word-level tokenizer over ``TASK_VOCAB``, one character a token; decoding joins them back."""
    tokenizer = Tokenizer(models.WordLevel({token: i for i, token in enumerate(TASK_VOCAB)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def batch_seed(seed: int, split: str, index: int) -> int:
    """The seed of batch ``index`` of ``split``: a hash of the three (not their sum: seed 1's batch 0 is not seed 0's batch 1)."""
    return int(np.random.SeedSequence([seed, SPLIT_STREAMS[split], index]).generate_state(1)[0])


class TaskBatches(Dataset):
    """Batch ``index`` of a split, generated when asked for: (blocks (B, seq_len + 1), answer mask (B, seq_len + 1))."""

    def __init__(self, length: int, split: str, **batch: Any) -> None:
        self.length, self.split, self.batch = length, split, batch

    def __len__(self) -> int:
        return self.length

    def generate(self, index: int) -> TaskBatch:
        return make_batch(generator=batch_seed(self.batch["seed"], self.split, index),
                          **{k: v for k, v in self.batch.items() if k != "seed"})

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        made = self.generate(index)
        return made.blocks, made.answer_mask


class FromBatch(Sampler[int]):
    """Batch indices ``start * world_size + rank``, then every ``world_size``-th: this rank's share, from ``start`` on."""

    def __init__(self, length: int, start: int = 0, rank: int = 0, world_size: int = 1) -> None:
        self.length, self.start, self.rank, self.world_size = length, start, rank, world_size

    def __len__(self) -> int:
        return len(range(self.start * self.world_size + self.rank, self.length, self.world_size))

    def __iter__(self):
        return iter(range(self.start * self.world_size + self.rank, self.length, self.world_size))


class TaskDataModule(DataPosition, L.LightningDataModule):
    """Serves ``task`` as (blocks (B, seq_len + 1), answer mask (B, seq_len + 1)) batches; see the module docstring.
    Its settings, and the rule that the model is a decoder: ``TaskDataSettings``."""

    Settings = TaskDataSettings

    def __init__(self, **settings: Any) -> None:
        super().__init__()
        self.settings = s = self.Settings(**settings)  # each value's type and range, and that one example fits seq_len
        self.task, self.seq_len, self.batch_size, self.seed, self.sizes = s.task, s.seq_len, s.batch_size, s.seed, s.sizes
        self.val_examples, self.passkey_digits, self.key_len = s.val_examples, s.passkey_digits, s.key_len
        self.passkey_decoys = s.passkey_decoys
        self.tokenizer = task_tokenizer()

    # -- facts the model needs ---------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(TASK_VOCAB)

    @property
    def mask_token_id(self) -> int:
        return TASK_VOCAB.index("<mask>")

    def _batches(self, split: str, length: int) -> TaskBatches:
        filler = play_filler(split) if self.task == "passkey" else None
        return TaskBatches(length, split, task=self.task, batch_size=self.batch_size, seq_len=self.seq_len, seed=self.seed,
                           sizes=self.sizes, passkey_digits=self.passkey_digits, key_len=self.key_len, filler=filler,
                           passkey_decoys=self.passkey_decoys)

    @functools.cached_property
    def validation_batches(self) -> list[tuple[Tensor, Tensor]]:
        """The held-out examples, generated once: the last batch trimmed to ``val_examples``."""
        n = -(-self.val_examples // self.batch_size)
        batches = [self._batches("validation", n)[i] for i in range(n)]
        extra = n * self.batch_size - self.val_examples
        if extra:
            blocks, mask = batches[-1]
            batches[-1] = (blocks[: len(blocks) - extra], mask[: len(mask) - extra])
        return batches

    @functools.cached_property
    def streams(self) -> dict[str, np.ndarray]:
        """Token streams for the code that reads them (frequent rows, probe blocks): the first ``val_examples`` training
        examples and the validation examples, blocks end to end (``<eos>`` pads included)."""
        n = -(-self.val_examples // self.batch_size)
        train = torch.cat([self._batches("train", n)[i][0] for i in range(n)])[: self.val_examples]
        validation = torch.cat([blocks for blocks, _ in self.validation_batches])
        return {"train": train.reshape(-1).numpy().astype(np.uint8),
                "validation": validation.reshape(-1).numpy().astype(np.uint8)}

    def n_tokens(self, split: str) -> int:
        """Tokens in ``streams[split]`` (training generates without end; this is the sample the analysis reads)."""
        return int(len(self.streams[split]))

    def prepare_data(self) -> None:
        """Nothing to build: the task is generated."""

    def setup(self, stage: str | None = None) -> None:
        if self.task == "passkey":
            play_filler("train"), play_filler("validation")  # read the plays once, before the first batch

    # -- loaders ------------------------------------------------------------------------------
    def train_dataloader(self) -> DataLoader:
        trainer = getattr(self, "trainer", None)
        rank, world_size = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        position, _ = self.start_position()
        sampler = FromBatch(ENDLESS, position["batches"], rank, world_size)
        return DataLoader(self._batches("train", ENDLESS), batch_size=None, sampler=sampler, generator=self._loader_generator())

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.validation_batches, batch_size=None, generator=self._loader_generator())

    def _loader_generator(self) -> torch.Generator:
        """A loader's own generator: otherwise each new iterator draws a seed from the global RNG, and a resumed run's
        global draws (dropout, ``pe.randomize_positions``) would be one draw off the uninterrupted run's."""
        return torch.Generator().manual_seed(self.seed)
