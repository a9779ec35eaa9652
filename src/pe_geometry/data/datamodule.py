"""corpus -> tokenizer -> token files (memory-mapped) -> blocks of seq_len + 1 tokens -> batches.

Every corpus takes the same path: its splits as ``datasets`` tables, a tokenizer
trained on a bounded sample of the training split, ``datasets.map`` into on-disk
token files, and blocks read lazily from those files, so memory stays flat
however large the corpus is.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import datasets
import lightning as L
import numpy as np
import torch
from tokenizers import Tokenizer
from torch.utils.data import DataLoader, Dataset, Sampler

from pe_geometry.data.cache import TokenCache, cache_key, token_dtype
from pe_geometry.data.corpus import Corpus, CorpusError, check_has_text
from pe_geometry.data.encode import MAP_BATCH_DOCS, encode_documents
from pe_geometry.data.position import DataPosition
from pe_geometry.data.tokenizer import SPECIAL_TOKENS, train_tokenizer, training_sample
from pe_geometry.settings.data import TextDataSettings

log = logging.getLogger(__name__)
SPLITS = ("train", "validation")


class BlockDataset(Dataset):
    """Blocks of ``seq_len + 1`` consecutive tokens, starting every ``seq_len`` tokens.

    Consecutive blocks overlap by one token, so every token is a target exactly once.
    """

    def __init__(self, stream: np.ndarray, seq_len: int) -> None:
        self.stream = stream  # a memmap stays a memmap: each block is read when asked for
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.stream) - 1) // self.seq_len)

    def __getitem__(self, i: int) -> torch.Tensor:
        start = i * self.seq_len
        return torch.from_numpy(self.stream[start : start + self.seq_len + 1].astype(np.int64))

    def __getstate__(self) -> dict:
        # A memmap pickles as a full in-memory copy; send its file instead (DataLoader workers under spawn).
        state = dict(self.__dict__)
        if isinstance(self.stream, np.memmap) and self.stream.filename is not None:
            state["stream"] = (self.stream.filename, self.stream.dtype, self.stream.offset, self.stream.shape)
        return state

    def __setstate__(self, state: dict) -> None:
        if isinstance(state["stream"], tuple):
            filename, dtype, offset, shape = state["stream"]
            state["stream"] = np.memmap(filename, dtype=dtype, mode="r", offset=offset, shape=shape)
        self.__dict__.update(state)


class EpochShuffleSampler(Sampler[int]):
    """A fresh permutation per epoch from (seed, epoch) alone, able to start mid-epoch.

    Lightning calls ``set_epoch`` at every epoch start. After a resume, ``skip``
    drops the samples the interrupted run had already consumed in that epoch, so
    the resumed run sees exactly the batches the uninterrupted one would have.
    ``__len__`` stays the full epoch so Lightning's batch counters line up.

    Under DDP each rank takes every ``world_size``-th sample of the same permutation
    (the last ``n % world_size`` samples of an epoch are dropped so the ranks stay in
    step), so the ranks see disjoint blocks; ``skip`` and ``__len__`` count this rank's
    samples. Lightning must not wrap it in a DistributedSampler as well
    (``trainer.use_distributed_sampler: false``, see configs/trainer/default.yaml).
    """

    def __init__(self, n: int, seed: int, rank: int = 0, world_size: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is not in [0, world_size={world_size})")
        self.n, self.seed, self.epoch, self.skip = n, seed, 0, 0
        self.rank, self.world_size = rank, world_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n // self.world_size

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.n, generator=generator)[: len(self) * self.world_size]
        order = order[self.rank :: self.world_size][self.skip :].tolist()
        self.skip = 0  # only the first epoch after a resume is partial
        return iter(order)


class TextDataModule(DataPosition, L.LightningDataModule):
    """Serves (B, seq_len + 1) token blocks; models derive inputs and targets per batch. Its settings (tokenizer, block
    length, batches, cache, loader): ``TextDataSettings``; the corpus is built from ``data.corpus`` and passed in."""

    Settings = TextDataSettings
    counts_epochs = True  # the position is (epoch, batches in it): each epoch is a fresh permutation

    def __init__(self, corpus: Corpus, **settings: Any) -> None:
        super().__init__()
        self.settings = s = self.Settings(**settings)  # each value's type and range, the vocabulary's for the tokenizer
        self.corpus, self.tokenizer_kind, self.requested_vocab_size = corpus, s.tokenizer, s.vocab_size
        self.seq_len, self.batch_size, self.num_workers = s.seq_len, s.batch_size, s.num_workers
        self.cache_dir = Path(s.cache_dir)
        self.seed, self.num_proc, self.tokenizer_sample_chars = s.seed, s.num_proc, s.tokenizer_sample_chars
        self.build_seconds: dict[str, float] = {}  # time per build phase, empty when served from the cache
        self.tokenizer: Tokenizer | None = None
        self.streams: dict[str, np.ndarray] = {}

    # -- building -----------------------------------------------------------------
    def _check_size(self) -> None:
        needed = self.seq_len + 1
        for split, stream in self.streams.items():
            if len(stream) < needed:
                raise CorpusError(
                    f"the corpus is too small: its {split} split has {len(stream)} tokens, "
                    f"data.seq_len={self.seq_len} needs at least {needed} tokens in each split"
                )

    def prepare_data(self) -> None:
        """Build the tokenizer and token files once (cached on disk, keyed by content + settings)."""
        if self.tokenizer is None:
            self._load_or_build()

    def _load_or_build(self) -> None:
        texts = self.corpus.text_datasets()
        column = self.corpus.text_column
        key = cache_key(
            self.corpus.fingerprint(), tokenizer=self.tokenizer_kind, vocab_size=self.requested_vocab_size,
            tokenizer_sample_chars=self.tokenizer_sample_chars,
        )
        cache = TokenCache(self.cache_dir, key)
        cached = cache.load(list(SPLITS))
        if cached is None:
            for split in SPLITS:
                check_has_text(texts[split], column, split)
            self._build(cache, texts, column)
            cached = cache.load(list(SPLITS))
            if cached is None:
                raise CorpusError(f"the token cache {cache.dir} could not be read back right after it was written")
        self.tokenizer, self.streams = cached
        self.cache_entry = cache.dir
        self._check_size()

    def _build(self, cache: TokenCache, texts: dict[str, datasets.Dataset | datasets.IterableDataset], column: str) -> None:
        log.info("training a %s tokenizer (vocab %d) and tokenizing the corpus", self.tokenizer_kind, self.requested_vocab_size)
        started = time.perf_counter()
        batches = (batch[column] for batch in texts["train"].select_columns([column]).iter(batch_size=MAP_BATCH_DOCS))
        tokenizer = train_tokenizer(training_sample(batches, self.tokenizer_sample_chars), self.tokenizer_kind, self.requested_vocab_size)
        learned = tokenizer.get_vocab_size()
        if self.tokenizer_kind == "bpe" and learned < self.requested_vocab_size:  # too little text for that many merges
            log.warning("the BPE tokenizer learned %d tokens, not data.vocab_size=%d: the training text has no more merges "
                        "to make (the model's vocabulary is %d)", learned, self.requested_vocab_size, learned)
        cache.save_tokenizer(tokenizer)
        self.build_seconds["tokenizer"] = time.perf_counter() - started
        dtype = token_dtype(tokenizer.get_vocab_size())
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        # datasets.map writes its Arrow output here (never beside the user's data); removed once copied into the token files.
        with tempfile.TemporaryDirectory(dir=self.cache_dir, prefix=".encode-", suffix=".tmp") as work:
            for split in SPLITS:
                started = time.perf_counter()
                (Path(work) / split).mkdir()
                chunks = encode_documents(texts[split], column, tokenizer, dtype, Path(work) / split, self.num_proc)
                n_tokens = cache.save_tokens(split, chunks, dtype)
                self.build_seconds[split] = time.perf_counter() - started
                log.info("%s: %d tokens (%s) in %.1f s", split, n_tokens, dtype.name, self.build_seconds[split])
        cache.commit()

    def setup(self, stage: str | None = None) -> None:
        if self.tokenizer is None:
            self._load_or_build()

    # -- facts the model needs (one source of truth: the trained tokenizer) ---------
    @property
    def vocab_size(self) -> int:
        assert self.tokenizer is not None, "call prepare_data()/setup() first"
        return self.tokenizer.get_vocab_size()

    @property
    def mask_token_id(self) -> int:
        return SPECIAL_TOKENS.index("<mask>")

    def n_tokens(self, split: str) -> int:
        return int(len(self.streams[split]))

    # -- loaders ---------------------------------------------------------------------
    def _loader(self, split: str, sampler: Sampler | None = None) -> DataLoader:
        return DataLoader(
            BlockDataset(self.streams[split], self.seq_len),
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=False,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            # Its own generator: otherwise each new iterator draws a worker seed from the
            # global RNG, and a resumed run's masks/dropout would be one draw off.
            generator=torch.Generator().manual_seed(self.seed),
        )

    def train_dataloader(self) -> DataLoader:
        trainer = getattr(self, "trainer", None)
        rank, world_size = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        sampler = EpochShuffleSampler(len(BlockDataset(self.streams["train"], self.seq_len)), self.seed, rank, world_size)
        position, resumed = self.start_position()
        if resumed:  # skip what the interrupted run consumed in its epoch
            sampler.set_epoch(position["epoch"])
            sampler.skip = position["batches"] * self.batch_size
        return self._loader("train", sampler)

    def val_dataloader(self) -> DataLoader:
        return self._loader("validation")
