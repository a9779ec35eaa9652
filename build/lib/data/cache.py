"""A content-keyed disk cache for the tokenizer and the tokenized corpus.

The key hashes the corpus content and every tokenizer setting, so a changed
setting or a changed file never reuses a stale entry. Files are written to a
temporary name and renamed, so an interrupted run never leaves a half-written
entry; an entry that fails to load is reported and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

log = logging.getLogger(__name__)

CACHE_VERSION = 1  # bump when the tokenization or storage format changes


def cache_key(corpus_fingerprint: str, **settings: object) -> str:
    payload = json.dumps({"corpus": corpus_fingerprint, "version": CACHE_VERSION, **settings}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class TokenCache:
    """One entry: ``tokenizer.json``, ``<split>.npy`` token streams, and ``meta.json`` written last."""

    def __init__(self, root: str | Path, key: str) -> None:
        self.dir = Path(root) / key

    def load(self, splits: list[str]) -> tuple[Tokenizer, dict[str, np.ndarray]] | None:
        """The cached entry, or None when missing or unreadable (then it will be rebuilt)."""
        meta_path = self.dir / "meta.json"
        if not meta_path.exists():
            return None
        try:
            meta = json.loads(meta_path.read_text())
            tokenizer = Tokenizer.from_file(str(self.dir / "tokenizer.json"))
            streams = {}
            for split in splits:
                stream = np.load(self.dir / f"{split}.npy", allow_pickle=False)
                if stream.shape != (meta["n_tokens"][split],):
                    raise ValueError(f"{split}.npy holds {stream.shape[0]} tokens, meta.json says {meta['n_tokens'][split]}")
                streams[split] = stream
            if tokenizer.get_vocab_size() != meta["vocab_size"]:
                raise ValueError("tokenizer.json does not match meta.json")
            return tokenizer, streams
        except Exception as err:  # any corruption: say so, then rebuild
            log.warning("token cache %s is corrupt (%s: %s); rebuilding it", self.dir, type(err).__name__, err)
            return None

    def save(self, tokenizer: Tokenizer, streams: dict[str, np.ndarray]) -> None:
        atomic_write_bytes(self.dir / "tokenizer.json", tokenizer.to_str().encode())
        for split, stream in streams.items():
            with tempfile.TemporaryFile() as buffer:
                np.save(buffer, stream, allow_pickle=False)
                buffer.seek(0)
                atomic_write_bytes(self.dir / f"{split}.npy", buffer.read())
        meta = {"vocab_size": tokenizer.get_vocab_size(), "n_tokens": {s: int(a.shape[0]) for s, a in streams.items()}}
        atomic_write_bytes(self.dir / "meta.json", json.dumps(meta, indent=2).encode())
