"""Tokenization throughput and peak memory of data=hf on synthetic corpora of growing size.

    python experiments/benchmark_data.py                  # about 50 MB and 200 MB of text
    python experiments/benchmark_data.py --quick          # about 5 MB and 20 MB (a smoke test)
    python experiments/benchmark_data.py --sizes-mb 50 200 --num-proc 2 --tokenizer-sample-mb 10

Each corpus is made of real play speeches (the default corpus, as the framework
reads it) drawn at random into documents of 8 speeches, written as parquet shards
in a temporary folder. Each size is then built in a fresh subprocess through the
real path (``HFDataModule(path="parquet", data_files=...)``: load_dataset's Arrow
conversion, the tokenizer trained on a bounded sample, ``datasets.map`` into token
files) with its own empty caches, and that process reports:
- tokens/s of the tokenization step alone, and end to end (loading + tokenizer + tokenization);
- peak resident memory, ``ru_maxrss``. It counts the pages of memory-mapped Arrow files the
  process has read (datasets maps the converted corpus; ``datasets.map`` reads all of it),
  which the kernel can drop at any time, so the peak of *anonymous* memory (RssAnon,
  sampled every 20 ms) is printed beside it: that is the memory the process actually holds,
  and it must not grow with the corpus beyond the tokenizer's sample. With ``--streaming``
  nothing is memory-mapped and ``ru_maxrss`` itself stays flat.
With ``--num-proc`` above 1 the tokenizing processes are separate: their largest
``ru_maxrss`` is printed too (RssAnon is sampled for the main process only).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


SPEECHES_PER_DOC = 8
DOCS_PER_ROW_GROUP = 1000
SHARD_MB = 25


# ----------------------------------------------------------------------------- corpus generation (parent)
def play_speeches() -> list[str]:
    from pe_geometry.data.corpus import ShakespeareCorpus

    splits = ShakespeareCorpus().splits()
    return [s for doc in splits["train"] for s in doc.text.split("\n\n") if s.strip()]


def write_corpus(folder: Path, size_mb: float, speeches: list[str], seed: int) -> list[str]:
    """Parquet shards of about ``size_mb`` MB of text in total; returns their paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    target, written, shards = size_mb * 1e6, 0, []
    while written < target:
        path = folder / f"train-{len(shards):04d}.parquet"
        with pq.ParquetWriter(path, pa.schema([("text", pa.string())])) as writer:
            shard_bytes = 0
            while shard_bytes < SHARD_MB * 1e6 and written < target:
                docs = ["\n\n".join(rng.choices(speeches, k=SPEECHES_PER_DOC)) for _ in range(DOCS_PER_ROW_GROUP)]
                n_bytes = sum(len(d.encode()) for d in docs)
                writer.write_table(pa.table({"text": docs}))
                shard_bytes, written = shard_bytes + n_bytes, written + n_bytes
        shards.append(str(path))
    return shards


# ----------------------------------------------------------------------------- one measured build (child)
class AnonPeak(threading.Thread):
    """Samples this process's RssAnon (kB) from /proc/self/status; ``peak_kb`` is the largest seen."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak_kb, self.running = 0, True

    def run(self) -> None:
        while self.running:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    self.peak_kb = max(self.peak_kb, int(line.split()[1]))
            time.sleep(0.02)


def measure(train_files: list[str], val_file: str, cache_dir: str, num_proc: int, sample_chars: int, streaming: bool) -> dict:
    sampler = AnonPeak()
    sampler.start()
    from pe_geometry.data.hf import HFDataModule

    dm = HFDataModule(
        path="parquet", data_files={"train": train_files, "validation": val_file}, vocab_size=2048, seq_len=128,
        cache_dir=cache_dir, num_proc=num_proc, tokenizer_sample_chars=sample_chars, streaming=streaming,
    )
    started = time.perf_counter()
    dm.prepare_data()
    total_s = time.perf_counter() - started
    sampler.running = False
    sampler.join()
    n_tokens = dm.n_tokens("train") + dm.n_tokens("validation")
    tokenize_s = dm.build_seconds["train"] + dm.build_seconds["validation"]
    return {
        "n_tokens": n_tokens,
        "total_s": total_s,
        "tokenizer_s": dm.build_seconds["tokenizer"],
        "tokenize_s": tokenize_s,
        "tokenize_tokens_per_s": n_tokens / tokenize_s,
        "end_to_end_tokens_per_s": n_tokens / total_s,
        "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "children_maxrss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        "peak_anon_mb": sampler.peak_kb / 1024,
    }


# ----------------------------------------------------------------------------- driver
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[50, 200])
    parser.add_argument("--quick", action="store_true", help="5 MB and 20 MB")
    parser.add_argument("--num-proc", type=int, default=1)
    parser.add_argument("--tokenizer-sample-mb", type=float, default=10, help="data.tokenizer_sample_chars, in MB")
    parser.add_argument("--streaming", action="store_true", help="data.streaming=true: parquet read as it is tokenized")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # JSON arguments of one measured build
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(**json.loads(args.child))))
        return
    sizes = [5, 20] if args.quick else args.sizes_mb
    speeches = play_speeches()
    sample_chars = int(args.tokenizer_sample_mb * 1e6)
    print(f"{len(speeches)} play speeches; documents of {SPEECHES_PER_DOC}; tokenizer sample {sample_chars:,} characters; "
          f"num_proc={args.num_proc}; streaming={args.streaming}; {os.cpu_count()} CPUs")
    print(f"{'corpus':>8} {'tokens':>12} {'tokenize tok/s':>15} {'end-to-end tok/s':>17} {'total s':>8} "
          f"{'ru_maxrss MB':>13} {'peak anon MB':>13} {'workers maxrss MB':>18}")
    for size_mb in sizes:
        with tempfile.TemporaryDirectory(prefix="benchmark_data-") as tmp:
            folder = Path(tmp)
            train_files = write_corpus(folder, size_mb, speeches, seed=0)
            (folder / "val").mkdir()
            val_file = write_corpus(folder / "val", 1, speeches, seed=1)[0]
            child_args = {"train_files": train_files, "val_file": val_file, "cache_dir": str(folder / "tokens"),
                          "num_proc": args.num_proc, "sample_chars": sample_chars, "streaming": args.streaming}
            # A fresh process per size (ru_maxrss is a lifetime peak); datasets' Arrow cache inside the temp folder.
            env = {**os.environ, "HF_DATASETS_CACHE": str(folder / "hf-cache"), "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
            result = subprocess.run([sys.executable, __file__, "--child", json.dumps(child_args)], env=env,
                                    capture_output=True, text=True, check=False)
            if result.returncode:
                sys.exit(f"error: the {size_mb} MB build failed:\n{result.stderr[-3000:]}")
            r = json.loads(result.stdout.strip().splitlines()[-1])
            print(f"{size_mb:>6.0f}MB {r['n_tokens']:>12,} {r['tokenize_tokens_per_s']:>15,.0f} {r['end_to_end_tokens_per_s']:>17,.0f} "
                  f"{r['total_s']:>8.1f} {r['maxrss_mb']:>13.0f} {r['peak_anon_mb']:>13.0f} {r['children_maxrss_mb']:>18.0f}", flush=True)


if __name__ == "__main__":
    main()
