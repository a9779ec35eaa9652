"""A content-keyed disk cache for the tokenizer and the tokenized corpus.

The key hashes the corpus fingerprint and every tokenizer setting, so a changed
setting or a changed file never reuses a stale entry. One entry is a folder:
``tokenizer.json``, one ``<split>.npy`` token file per split (a 1-D uint16 or
uint32 array, opened memory-mapped, never read whole), and ``meta.json``, written
last, with each file's size and SHA-256. Every file is written to a temporary
name and renamed, so an interrupted run never leaves a half-written entry; on
load every checksum is verified, so a truncated, emptied *or overwritten* file
is reported and the entry rebuilt.

A write that fails for want of space or permission (a full disk, a read-only mount) raises
``pe_geometry.files.StorageError``: one line naming the file, which ``train.py`` prints as ``error: ...``. The
temporary file is removed and the previous file, if any, is left as it was.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from pe_geometry.files import atomic_write_bytes, storage_errors, temp_beside, write_all

log = logging.getLogger(__name__)

CACHE_VERSION = 2  # bump when the tokenization or storage format changes
_CHUNK_BYTES = 1 << 22


def cache_key(corpus_fingerprint: str, **settings: object) -> str:
    payload = json.dumps({"corpus": corpus_fingerprint, "version": CACHE_VERSION, **settings}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65,536), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def _npy_header(dtype: np.dtype, n: int) -> bytes:
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (n,)}
    buffer = tempfile.SpooledTemporaryFile()
    np.lib.format.write_array_header_1_0(buffer, header)
    buffer.seek(0)
    return buffer.read()


def atomic_write_tokens(path: Path, chunks: Iterable[np.ndarray], dtype: np.dtype) -> tuple[int, str]:
    """Stream 1-D id chunks into a ``.npy`` file without holding them all; returns (n_tokens, sha256).

    The header is written for length 0 and rewritten at the end (numpy pads it, so
    it keeps its size); the checksum covers the file's bytes after the header.
    """
    digest, n_tokens = hashlib.sha256(), 0
    with storage_errors(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = temp_beside(path)  # the umask's mode: a shared cache is readable by the team
    try:
        try:
            header = _npy_header(dtype, 0)
            write_all(fd, header, path)
            for chunk in chunks:  # (batches of documents: large enough to write unbuffered)
                data = np.ascontiguousarray(chunk, dtype=dtype).tobytes()
                digest.update(data)
                write_all(fd, data, path)
                n_tokens += len(chunk)
            final_header = _npy_header(dtype, n_tokens)
            assert len(final_header) == len(header), "npy header changed size"
            os.lseek(fd, 0, os.SEEK_SET)
            write_all(fd, final_header, path)
            with storage_errors(path):
                os.fsync(fd)
        finally:
            os.close(fd)
        with storage_errors(path):
            os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return n_tokens, digest.hexdigest()


def file_sha256(path: Path, offset: int = 0) -> str:
    """SHA-256 of a file's bytes from ``offset`` on, read in chunks (memory stays flat)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


class TokenCache:
    """One entry: ``tokenizer.json``, ``<split>.npy`` token files, and ``meta.json`` written last."""

    def __init__(self, root: str | Path, key: str) -> None:
        self.dir = Path(root) / key
        self._meta: dict = {"n_tokens": {}, "sha256": {}}

    def load(self, splits: list[str]) -> tuple[Tokenizer, dict[str, np.memmap]] | None:
        """The cached entry (token files memory-mapped), or None when missing or corrupt (then it is rebuilt)."""
        meta_path = self.dir / "meta.json"
        if not meta_path.exists():
            return None
        try:
            meta = json.loads(meta_path.read_text())
            tokenizer_bytes = (self.dir / "tokenizer.json").read_bytes()
            if hashlib.sha256(tokenizer_bytes).hexdigest() != meta["sha256"]["tokenizer.json"]:
                raise ValueError("tokenizer.json does not match its checksum in meta.json")
            tokenizer = Tokenizer.from_str(tokenizer_bytes.decode())
            if tokenizer.get_vocab_size() != meta["vocab_size"]:
                raise ValueError("tokenizer.json does not match meta.json")
            streams = {}
            for split in splits:
                path = self.dir / f"{split}.npy"
                stream = np.load(path, mmap_mode="r", allow_pickle=False)
                if stream.shape != (meta["n_tokens"][split],) or stream.dtype != token_dtype(meta["vocab_size"]):
                    raise ValueError(f"{split}.npy holds {stream.shape} {stream.dtype}, meta.json says {meta['n_tokens'][split]} tokens")
                if file_sha256(path, stream.offset) != meta["sha256"][path.name]:
                    raise ValueError(f"{split}.npy does not match its checksum in meta.json (overwritten bytes)")
                streams[split] = stream
            return tokenizer, streams
        except Exception as err:  # any corruption: say so, then rebuild
            log.warning("token cache %s is corrupt (%s: %s); rebuilding it", self.dir, type(err).__name__, err)
            return None

    def _target(self, name: str) -> Path:
        """Where an entry file is written. Whatever stands in the way (a directory at ``train.npy``, a file
        where the entry's folder belongs) is removed: the entry is being rebuilt, and its folder is ours."""
        path = self.dir / name
        with storage_errors(path):
            if not self.dir.is_dir() and (self.dir.exists() or self.dir.is_symlink()):  # a file, or a dangling link
                log.warning("token cache: removing %s, which stands where the entry's folder belongs", self.dir)
                self.dir.unlink()
            if path.is_dir() and not path.is_symlink():  # (a symlink is replaced by the rename itself)
                log.warning("token cache: removing the directory %s, which stands where a cache file belongs", path)
                shutil.rmtree(path)
        return path

    def save_tokenizer(self, tokenizer: Tokenizer) -> None:
        data = tokenizer.to_str().encode()
        atomic_write_bytes(self._target("tokenizer.json"), data)
        self._meta["vocab_size"] = tokenizer.get_vocab_size()
        self._meta["sha256"]["tokenizer.json"] = hashlib.sha256(data).hexdigest()

    def save_tokens(self, split: str, chunks: Iterable[np.ndarray], dtype: np.dtype) -> int:
        """Write one split's token file from id chunks; returns its number of tokens."""
        n_tokens, checksum = atomic_write_tokens(self._target(f"{split}.npy"), chunks, dtype)
        self._meta["n_tokens"][split] = n_tokens
        self._meta["sha256"][f"{split}.npy"] = checksum
        return n_tokens

    def commit(self) -> None:
        """Write meta.json last: only now is the entry complete."""
        atomic_write_bytes(self._target("meta.json"), json.dumps(self._meta, indent=2).encode())
