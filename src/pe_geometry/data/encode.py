"""Documents -> token id chunks, through ``datasets.map`` (batched, optionally several processes).

Each document becomes its ids followed by <eos>. A map-style dataset is encoded
into Arrow files in a work folder (``num_proc`` processes), which are then read
back one record batch at a time through ordinary file reads, so neither the text
nor the ids are ever held whole in memory. A streaming dataset is encoded lazily
as it is iterated (``num_proc`` does not apply).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
from tokenizers import Tokenizer

MAP_BATCH_DOCS = 256  # documents per datasets.map batch (and per Arrow record batch): bounds memory for long documents


class EncodeBatch:
    """A picklable ``datasets.map`` function: an Arrow batch of texts -> an Arrow table {"ids": ids + [<eos>] per text}.

    The ids go from the tokenizer's lists into one flat numpy array and an offsets
    array, which become an Arrow list column without another copy. Returned as a list
    of lists of ints, ``datasets`` would convert them to Arrow one element at a time
    and then cast them: about 7 % of the encoding step.
    """

    def __init__(self, tokenizer: Tokenizer, text_column: str, dtype: np.dtype) -> None:
        self.tokenizer, self.text_column, self.dtype = tokenizer, text_column, np.dtype(dtype)
        self.eos = tokenizer.token_to_id("<eos>")

    def __call__(self, batch: pa.Table) -> pa.Table:
        texts = [text or "" for text in batch.column(self.text_column).to_pylist()]  # a missing value (None) is an empty document
        # encode_batch_fast: ids without character offsets, about twice as fast and lighter
        ids = [encoding.ids for encoding in self.tokenizer.encode_batch_fast(texts)]
        for doc in ids:
            doc.append(self.eos)
        offsets = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, ids), dtype=np.int64, count=len(ids)), out=offsets[1:])
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=self.dtype, count=int(offsets[-1]))
        return pa.table({"ids": pa.LargeListArray.from_arrays(offsets, flat)})


@contextmanager
def _tokenizer_threads_off():
    """Worker processes each encode single-threaded: one process per core, and no tokenizers
    warning about a fork after its thread pool was used (it was, to train the tokenizer)."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def encode_documents(
    dataset: datasets.Dataset | datasets.IterableDataset,
    text_column: str,
    tokenizer: Tokenizer,
    dtype: np.dtype,
    work_dir: Path,
    num_proc: int = 1,
) -> Iterator[np.ndarray]:
    """Yield the split's token stream in chunks (1-D arrays of ``dtype``), in document order."""
    encode = EncodeBatch(tokenizer, text_column, dtype)
    features = datasets.Features({"ids": datasets.LargeList(datasets.Value(dtype.name))})
    dataset = dataset.with_format("arrow")  # batches in and out as Arrow tables, no Python dicts between
    if isinstance(dataset, datasets.IterableDataset):
        encoded = dataset.map(encode, batched=True, batch_size=MAP_BATCH_DOCS, remove_columns=dataset.column_names, features=features)
        for batch in encoded.iter(batch_size=MAP_BATCH_DOCS):
            yield batch.column("ids").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        return
    processes = num_proc if num_proc > 1 and len(dataset) > 1 else None
    with _tokenizer_threads_off() if processes else nullcontext():
        encoded = dataset.map(
            encode,
            batched=True,
            batch_size=MAP_BATCH_DOCS,
            writer_batch_size=MAP_BATCH_DOCS,
            num_proc=processes,
            remove_columns=dataset.column_names,
            features=features,
            cache_file_name=str(work_dir / "ids.arrow"),  # ours to delete, never beside the user's data
            load_from_cache_file=False,
            new_fingerprint=work_dir.name,  # skips hashing the tokenizer-holding function
            desc="tokenizing",
        )
    for cache_file in encoded.cache_files:  # one per process, in document order
        # Plain reads, not the memory map: pages of a read map would count as resident memory.
        with pa.OSFile(cache_file["filename"]) as source:
            for record_batch in pa.ipc.open_stream(source):
                yield record_batch.column("ids").flatten().to_numpy(zero_copy_only=False)
