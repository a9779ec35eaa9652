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
from typing import Any

import datasets

from pe_geometry.data.corpus import Corpus, CorpusError
from pe_geometry.data.datamodule import TextDataModule
from pe_geometry.settings.data import HFCorpusSettings, HFDataSettings

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
    """Train and validation splits of a ``datasets`` source, as ``settings`` (``HFCorpusSettings``: ``data=hf``'s
    keys, which ``HFDataModule`` has checked) choose them: the source, the splits, the held-out share, the column."""

    def __init__(self, settings: HFCorpusSettings) -> None:
        self.settings = settings
        self.text_column = settings.text_column
        self.streaming = settings.streaming  # switched off for a save_to_disk folder (already memory-mapped)
        self._datasets: dict[str, AnyDataset] | None = None

    # -- opening -------------------------------------------------------------------------
    def _open(self) -> AnyDataset | datasets.DatasetDict | datasets.IterableDatasetDict:
        s = self.settings
        local = Path(s.path).expanduser()
        try:
            if _is_saved_folder(local):
                return self._open_saved_folder(local)
            arguments = {"name": s.name, "data_files": s.data_files, "data_dir": s.data_dir, "revision": s.revision, "split": s.split}
            return datasets.load_dataset(s.path, **{k: v for k, v in arguments.items() if v is not None}, streaming=self.streaming)
        except CorpusError:
            raise
        except Exception as err:  # noqa: BLE001 - every loading failure becomes one line naming the source
            raise CorpusError(self._load_error(err, local)) from None

    def _open_saved_folder(self, folder: Path) -> datasets.Dataset | datasets.DatasetDict:
        if self.streaming:
            log.info("%s is a save_to_disk folder (already memory-mapped): data.streaming is not needed and is ignored", folder)
            self.streaming = False
        source = datasets.load_from_disk(str(folder))
        split = self.settings.split
        if split is not None:
            if not isinstance(source, datasets.DatasetDict) or split not in source:
                splits = list(source) if isinstance(source, datasets.DatasetDict) else []
                raise CorpusError(f"data.split={split!r} is not a split of {folder}; splits: {splits}")
            source = source[split]
        return source

    def _load_error(self, err: Exception, local: Path) -> str:
        problem = f"data.path={self.settings.path!r} could not be loaded ({type(err).__name__}: {_first_line(err)})"
        if _is_empty_source_error(err):
            return f"{problem}: a file or split with no documents (datasets cannot load an empty one)"
        offline = datasets.config.HF_HUB_OFFLINE or datasets.config.HF_DATASETS_OFFLINE
        if offline and self.settings.path not in LOCAL_FORMATS and not local.exists():
            return (
                f"{problem}; the hub is off (HF_DATASETS_OFFLINE=1): to download it, run online with "
                "HF_DATASETS_OFFLINE=0 HF_HUB_OFFLINE=0 python train.py ..., or use local data: data.path=<a save_to_disk folder>, "
                "or data.path=parquet|json|csv|text 'data.data_files={train: ..., validation: ...}'"
            )
        return problem

    # -- choosing the splits -------------------------------------------------------------
    def _limit(self, dataset: AnyDataset) -> AnyDataset:
        max_docs = self.settings.max_docs
        if max_docs is None:
            return dataset
        if isinstance(dataset, datasets.IterableDataset):
            return dataset.take(max_docs)
        return dataset.select(range(min(len(dataset), max_docs)))  # contiguous: no copy, no indices file

    def _hold_out(self, train: AnyDataset) -> tuple[AnyDataset, AnyDataset]:
        val_size = self.settings.val_size
        if isinstance(train, datasets.IterableDataset):
            if isinstance(val_size, float):
                raise CorpusError(
                    f"data.val_size={val_size} is a fraction, but a streamed dataset has no known length: "
                    "give a number of documents (e.g. data.val_size=1000) or a validation split"
                )
            return train.skip(val_size), train.take(val_size)
        n_docs = len(train)
        n_val = round(n_docs * val_size) if isinstance(val_size, float) else val_size
        n_val = max(1, n_val)
        if n_val >= n_docs:
            raise CorpusError(
                f"data.val_size={val_size} holds out {n_val} of the {n_docs} training documents, leaving none to train on"
            )
        return train.select(range(n_val, n_docs)), train.select(range(n_val))

    def _check_column(self, dataset: AnyDataset, split: str) -> None:
        columns = dataset.column_names
        if columns is None:  # a streamed dataset whose features are unknown until read
            columns = list(next(iter(dataset), {}).keys())
        if self.text_column not in columns:
            raise CorpusError(
                f"data.text_column={self.text_column!r} is not a column of the {split} split of {self.settings.path}; columns: {columns}"
            )
        feature = (dataset.features or {}).get(self.text_column)
        if feature is not None and getattr(feature, "dtype", None) not in ("string", "large_string"):
            raise CorpusError(f"data.text_column={self.text_column!r} holds {feature}, not text; columns: {columns}")

    def text_datasets(self) -> dict[str, AnyDataset]:
        if self._datasets is None:
            s = self.settings
            source = self._open()
            if isinstance(source, (datasets.DatasetDict, datasets.IterableDatasetDict)):
                if s.train_split not in source:
                    raise CorpusError(f"data.train_split={s.train_split!r} is not a split of {s.path}; splits: {list(source)}")
                train = self._limit(source[s.train_split])
                validation = self._limit(source[s.validation_split]) if s.validation_split in source else None
                if validation is None:
                    log.info("%s has no %r split (splits: %s): holding out data.val_size=%s of %r",
                             s.path, s.validation_split, list(source), s.val_size, s.train_split)
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
            s = self.settings
            payload.update(path=s.path, name=s.name, data_files=s.data_files, data_dir=s.data_dir, revision=s.revision, split=s.split,
                           train_split=s.train_split, validation_split=s.validation_split, val_size=s.val_size, max_docs=s.max_docs,
                           files=self._local_file_stats())
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def _local_file_stats(self) -> list[tuple[str, int, int]]:
        files = self.settings.data_files
        if isinstance(files, dict):
            files = [f for value in files.values() for f in ([value] if isinstance(value, str) else value)]
        elif isinstance(files, str):
            files = [files]
        found = [Path(f).expanduser() for f in files or [] if Path(f).expanduser().is_file()]
        return [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in found]


class HFDataModule(TextDataModule):
    """``TextDataModule`` over an ``HFCorpus``; its keys are ``load_dataset``'s plus the corpus choices
    (``HFDataSettings``: the corpus reads its part, ``HFCorpusSettings``, the data module the rest)."""

    Settings = HFDataSettings

    def __init__(self, **settings: Any) -> None:
        super().__init__(HFCorpus(self.Settings(**settings)), **settings)
