"""Any corpus ``datasets`` can open: a hub name (online), a ``save_to_disk`` folder, parquet/json/csv/text files.

The keys mirror ``datasets.load_dataset``'s arguments (``path``, ``name``,
``data_files``, ``data_dir``, ``revision``, ``split``, ``streaming``), so

    python train.py data=hf data.path=parquet 'data.data_files={train: a.parquet, validation: b.parquet}'

does what ``load_dataset("parquet", data_files=...)`` does. A folder written by
``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` is opened with
``datasets.load_from_disk``. Map-style tables stay memory-mapped Arrow files;
with ``streaming=true`` nothing is converted up front and documents are read as
they are tokenized.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Annotated, Any

import datasets
from annotated_types import Ge, Gt, MinLen

from pe_geometry.data.corpus import Corpus, CorpusError
from pe_geometry.data.datamodule import TextDataModule

log = logging.getLogger(__name__)

AnyDataset = datasets.Dataset | datasets.IterableDataset
LOCAL_FORMATS = ("parquet", "json", "csv", "text", "arrow")


def _is_saved_folder(path: Path) -> bool:
    return path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file())


def _first_line(err: BaseException) -> str:
    """The error's first line, with its cause's (datasets wraps reader errors in a generic one)."""
    line = (str(err).strip().splitlines() or [""])[0]
    if err.__cause__ is not None:
        line += f"; cause: {type(err.__cause__).__name__}: {_first_line(err.__cause__)}"
    return line


def _is_empty_source_error(err: BaseException) -> bool:
    """datasets' ways of failing on an empty file or split (it has no message of its own for it)."""
    while err is not None:
        text = str(err)
        if isinstance(err, StopIteration) or "corresponds to no data" in text or "BatchSize must be greater than 0" in text:
            return True
        if isinstance(err, IndexError) and "list index out of range" in text:  # load_from_disk of an empty split
            return True
        err = err.__cause__ or err.__context__
    return False


class HFCorpus(Corpus):
    """Train and validation splits of a ``datasets`` source.

    ``split``: load only this split (``load_dataset``'s argument, e.g. ``"train[:10%]"``);
    otherwise ``train_split`` and ``validation_split`` are picked from the splits it has.
    With no validation split, the first ``val_size`` documents of the training split are
    held out (a float in (0, 1): a fraction; an integer: a number of documents, needed when
    streaming, where the length is unknown). ``max_docs``: at most this many documents of each
    split, the first ones.
    """

    def __init__(
        self,
        path: str,
        name: str | None = None,
        data_files: str | list | dict | None = None,
        data_dir: str | None = None,
        revision: str | None = None,
        split: str | None = None,
        train_split: str = "train",
        validation_split: str | None = "validation",
        val_size: float | int = 0.05,
        text_column: str = "text",
        max_docs: int | None = None,
        streaming: bool = False,
    ) -> None:
        if not path:
            raise CorpusError("data=hf needs data.path: a hub name, a save_to_disk folder, or parquet|json|csv|text with data.data_files")
        is_fraction = isinstance(val_size, float) and 0 < val_size < 1
        if not (is_fraction or (isinstance(val_size, int) and not isinstance(val_size, bool) and val_size >= 1)):
            raise CorpusError(f"data.val_size={val_size!r} must be a fraction in (0, 1) or a number of documents >= 1")
        if max_docs is not None and max_docs < 1:
            raise CorpusError(f"data.max_docs={max_docs} must be >= 1 (or null for every document)")
        self.path, self.name, self.data_files, self.data_dir, self.revision = path, name, data_files, data_dir, revision
        self.split, self.train_split, self.validation_split = split, train_split, validation_split
        self.val_size, self.text_column, self.max_docs, self.streaming = val_size, text_column, max_docs, streaming
        self._datasets: dict[str, AnyDataset] | None = None

    # -- opening -------------------------------------------------------------------------
    def _open(self) -> AnyDataset | datasets.DatasetDict | datasets.IterableDatasetDict:
        local = Path(self.path).expanduser()
        try:
            if _is_saved_folder(local):
                return self._open_saved_folder(local)
            arguments = {"name": self.name, "data_files": self.data_files, "data_dir": self.data_dir, "revision": self.revision,
                         "split": self.split}
            return datasets.load_dataset(self.path, **{k: v for k, v in arguments.items() if v is not None}, streaming=self.streaming)
        except CorpusError:
            raise
        except Exception as err:  # noqa: BLE001 - every loading failure becomes one line naming the source
            raise CorpusError(self._load_error(err, local)) from None

    def _open_saved_folder(self, folder: Path) -> datasets.Dataset | datasets.DatasetDict:
        if self.streaming:
            log.info("%s is a save_to_disk folder (already memory-mapped): data.streaming is not needed and is ignored", folder)
            self.streaming = False
        source = datasets.load_from_disk(str(folder))
        if self.split is not None:
            if not isinstance(source, datasets.DatasetDict) or self.split not in source:
                splits = list(source) if isinstance(source, datasets.DatasetDict) else []
                raise CorpusError(f"data.split={self.split!r} is not a split of {folder}; splits: {splits}")
            source = source[self.split]
        return source

    def _load_error(self, err: Exception, local: Path) -> str:
        problem = f"data.path={self.path!r} could not be loaded ({type(err).__name__}: {_first_line(err)})"
        if _is_empty_source_error(err):
            return f"{problem}: a file or split with no documents (datasets cannot load an empty one)"
        offline = datasets.config.HF_HUB_OFFLINE or datasets.config.HF_DATASETS_OFFLINE
        if offline and self.path not in LOCAL_FORMATS and not local.exists():
            return (
                f"{problem}; the hub is off (HF_DATASETS_OFFLINE=1): to download it, run online with "
                "HF_DATASETS_OFFLINE=0 HF_HUB_OFFLINE=0 python train.py ..., or use local data: data.path=<a save_to_disk folder>, "
                "or data.path=parquet|json|csv|text 'data.data_files={train: ..., validation: ...}'"
            )
        return problem

    # -- choosing the splits -------------------------------------------------------------
    def _limit(self, dataset: AnyDataset) -> AnyDataset:
        if self.max_docs is None:
            return dataset
        if isinstance(dataset, datasets.IterableDataset):
            return dataset.take(self.max_docs)
        return dataset.select(range(min(len(dataset), self.max_docs)))  # contiguous: no copy, no indices file

    def _hold_out(self, train: AnyDataset) -> tuple[AnyDataset, AnyDataset]:
        if isinstance(train, datasets.IterableDataset):
            if isinstance(self.val_size, float):
                raise CorpusError(
                    f"data.val_size={self.val_size} is a fraction, but a streamed dataset has no known length: "
                    "give a number of documents (e.g. data.val_size=1000) or a validation split"
                )
            return train.skip(self.val_size), train.take(self.val_size)
        n_docs = len(train)
        n_val = round(n_docs * self.val_size) if isinstance(self.val_size, float) else self.val_size
        n_val = max(1, n_val)
        if n_val >= n_docs:
            raise CorpusError(
                f"data.val_size={self.val_size} holds out {n_val} of the {n_docs} training documents, leaving none to train on"
            )
        return train.select(range(n_val, n_docs)), train.select(range(n_val))

    def _check_column(self, dataset: AnyDataset, split: str) -> None:
        columns = dataset.column_names
        if columns is None:  # a streamed dataset whose features are unknown until read
            columns = list(next(iter(dataset), {}).keys())
        if self.text_column not in columns:
            raise CorpusError(
                f"data.text_column={self.text_column!r} is not a column of the {split} split of {self.path}; columns: {columns}"
            )
        feature = (dataset.features or {}).get(self.text_column)
        if feature is not None and getattr(feature, "dtype", None) not in ("string", "large_string"):
            raise CorpusError(f"data.text_column={self.text_column!r} holds {feature}, not text; columns: {columns}")

    def text_datasets(self) -> dict[str, AnyDataset]:
        if self._datasets is None:
            source = self._open()
            if isinstance(source, (datasets.DatasetDict, datasets.IterableDatasetDict)):
                if self.train_split not in source:
                    raise CorpusError(f"data.train_split={self.train_split!r} is not a split of {self.path}; splits: {list(source)}")
                train = self._limit(source[self.train_split])
                validation = self._limit(source[self.validation_split]) if self.validation_split in source else None
                if validation is None:
                    log.info("%s has no %r split (splits: %s): holding out data.val_size=%s of %r",
                             self.path, self.validation_split, list(source), self.val_size, self.train_split)
            else:
                train, validation = self._limit(source), None
            if validation is None:
                train, validation = self._hold_out(train)
            self._datasets = {"train": train, "validation": validation}
            for split, dataset in self._datasets.items():
                if isinstance(dataset, datasets.Dataset) and len(dataset) == 0:
                    raise CorpusError(f"the corpus is empty: its {split} split has no documents")
                self._check_column(dataset, split)
        return self._datasets

    def fingerprint(self) -> str:
        """Map-style: the ``datasets`` fingerprints of the chosen splits (they change when the files do).
        Streaming: the loading arguments and the size and time of every named local file (a hub
        dataset streamed is keyed by name, so pin ``data.revision`` to keep the cache honest)."""
        chosen = self.text_datasets()
        payload: dict[str, Any] = {"text_column": self.text_column}
        if all(isinstance(d, datasets.Dataset) for d in chosen.values()):
            payload.update({split: d._fingerprint for split, d in chosen.items()})
        else:
            payload.update(path=self.path, name=self.name, data_files=self.data_files, data_dir=self.data_dir, revision=self.revision,
                           split=self.split, train_split=self.train_split, validation_split=self.validation_split,
                           val_size=self.val_size, max_docs=self.max_docs, files=self._local_file_stats())
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def _local_file_stats(self) -> list[tuple[str, int, int]]:
        files = self.data_files
        if isinstance(files, dict):
            files = [f for value in files.values() for f in ([value] if isinstance(value, str) else value)]
        elif isinstance(files, str):
            files = [files]
        found = [Path(f).expanduser() for f in files or [] if Path(f).expanduser().is_file()]
        return [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in found]


class HFDataModule(TextDataModule):
    """``TextDataModule`` over an ``HFCorpus``; its keys are ``load_dataset``'s plus the corpus choices."""

    def __init__(
        self,
        path: Annotated[str, MinLen(1), "a hub name, a save_to_disk folder, or parquet|json|csv|text|arrow"],
        name: str | None = None,
        data_files: str | list | dict | None = None,
        data_dir: str | None = None,
        revision: str | None = None,
        split: str | None = None,
        train_split: str = "train",
        validation_split: str | None = "validation",
        val_size: Annotated[float | int, Gt(0), "a fraction in (0, 1) or a number of documents >= 1"] = 0.05,
        text_column: Annotated[str, MinLen(1), "a column name"] = "text",
        max_docs: Annotated[int | None, Ge(1), "null for every document"] = None,
        streaming: bool = False,
        **settings: Any,
    ) -> None:
        corpus = HFCorpus(path, name, data_files, data_dir, revision, split, train_split, validation_split, val_size, text_column,
                          max_docs, streaming)
        super().__init__(corpus, **settings)
