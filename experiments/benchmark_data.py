"""Cold-cache tokenization of data=hf against ``tokenizers`` alone, and peak memory, on synthetic corpora of growing size.

    python experiments/benchmark_data.py                  # 50 MB and 500 MB of text
    python experiments/benchmark_data.py --quick          # 2 MB and 5 MB (a smoke test, under a minute)
    python experiments/benchmark_data.py --sizes-mb 50 --repeats 3 --num-proc 2

Each corpus is made of real play speeches (the default corpus, as the framework
reads it) drawn at random into documents of 8 speeches, written as parquet shards
in a temporary folder (train shards and a 1 MB validation file). On each corpus,
in fresh processes, alternating which goes first in each repeat:

- **project**: the real cold-cache path, ``HFDataModule(path="parquet", data_files=...)``
  with empty caches. ``load_dataset``'s parquet -> Arrow conversion is timed on its own
  (printed "besides", outside the ratio); the measured time is ``prepare_data()`` after it: the
  tokenizer trained on the first ``tokenizer_sample_chars`` of the training split, both
  splits encoded by ``datasets.map``, the token files and checksums written and read back.
- **tokenizers alone**, the ceiling: the same documents already in memory as Python
  strings (reading them is not timed), the same byte-level BPE built with the bare
  ``tokenizers`` API and trained on the same sample, ``encode_batch_fast`` over every
  document, ids + <eos> into numpy and written to a file per split.

Both must produce byte-identical token streams (the script stops if they do not), so
the two do the same work. Printed per size: both times (median over repeats), their
ratio, the ratio of their CPU seconds (user + system, all threads and worker
processes: steadier than wall time when other jobs share the cores), each side's
split into tokenizer training and encoding + writing, and the project's peak memory:
- ``ru_maxrss``, which also counts the pages of memory-mapped Arrow files the process
  has read (datasets maps the converted corpus and ``datasets.map`` reads all of it;
  the kernel can drop them at any time), and
- the peak of *anonymous* memory (RssAnon, sampled every 20 ms): the memory the process
  actually holds, which must not grow with the corpus beyond the tokenizer's sample.
With ``--num-proc`` above 1 the tokenizing processes are separate: their largest
``ru_maxrss`` is printed too (RssAnon is sampled for the main process only). With
``--streaming`` the project reads the parquet files as it tokenizes: nothing is
memory-mapped and ``ru_maxrss`` itself stays flat.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import itertools
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SPEECHES_PER_DOC = 8
DOCS_PER_ROW_GROUP = 1000
SHARD_MB = 25
VOCAB_SIZE = 2048
LIBRARY_BATCH_DOCS = 1000  # documents per encode_batch_fast call in the library-alone path
SPECIALS = ["<unk>", "<mask>", "<eos>"]


# ----------------------------------------------------------------------------- corpus generation (parent)
def play_speeches() -> list[str]:
    from pe_geometry.data.corpus import ShakespeareCorpus

    splits = ShakespeareCorpus().splits()
    return [s for doc in splits["train"] for s in doc.text.split("\n\n") if s.strip()]


def write_corpus(folder: Path, size_mb: float, speeches: list[str], seed: int) -> list[str]:
    """Parquet shards of about ``size_mb`` MB of text in total; returns their paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
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


def default_sample_chars() -> int:
    """data.tokenizer_sample_chars's default, from the datamodule itself (one source of truth)."""
    from pe_geometry.data.datamodule import TextDataModule

    return inspect.signature(TextDataModule.__init__).parameters["tokenizer_sample_chars"].default


# ----------------------------------------------------------------------------- measured builds (children)
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

    def stop(self) -> float:
        self.running = False
        self.join()
        return self.peak_kb / 1024


def cpu_seconds() -> float:
    """User + system seconds of this process (all threads) and its finished children."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def measure_project(train_files: list[str], val_file: str, work: str, num_proc: int, sample_chars: int, streaming: bool = False) -> dict:
    sampler = AnonPeak()
    sampler.start()
    from pe_geometry.data.hf import HFDataModule

    dm = HFDataModule(
        path="parquet", data_files={"train": train_files, "validation": val_file}, vocab_size=VOCAB_SIZE, seq_len=128,
        cache_dir=str(Path(work) / "tokens"), num_proc=num_proc, tokenizer_sample_chars=sample_chars, streaming=streaming,
    )
    started = time.perf_counter()
    dm.corpus.text_datasets()  # load_dataset: parquet -> Arrow (nothing when streaming), outside the comparison
    arrow_s = time.perf_counter() - started
    cpu, started = cpu_seconds(), time.perf_counter()
    dm.prepare_data()
    seconds, cpu = time.perf_counter() - started, cpu_seconds() - cpu
    meta = json.loads((dm.cache_entry / "meta.json").read_text())
    return {
        "seconds": seconds, "cpu_s": cpu, "arrow_s": arrow_s,
        "tokenizer_s": dm.build_seconds["tokenizer"], "encode_s": dm.build_seconds["train"] + dm.build_seconds["validation"],
        "n_tokens": dm.n_tokens("train") + dm.n_tokens("validation"),
        "sha256": {split: meta["sha256"][f"{split}.npy"] for split in ("train", "validation")},
        "vocab_sha256": hashlib.sha256(json.dumps(dm.tokenizer.get_vocab(), sort_keys=True).encode()).hexdigest(),
        "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "children_maxrss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        "peak_anon_mb": sampler.stop(),
    }


def measure_library(train_files: list[str], val_file: str, work: str, num_proc: int, sample_chars: int, streaming: bool = False) -> dict:
    """tokenizers alone: train on the same sample, encode_batch_fast every document, write the ids."""
    del num_proc, streaming  # the library parallelises encode_batch_fast over its own threads, the text is in memory
    sampler = AnonPeak()  # (as in the project's build: the same 20 ms sampling on both sides)
    sampler.start()
    import numpy as np
    import pyarrow.parquet as pq
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    splits = {"train": train_files, "validation": [val_file]}
    docs = {split: [t or "" for f in files for t in pq.read_table(f, columns=["text"]).column("text").to_pylist()]
            for split, files in splits.items()}  # in memory before the clock starts: the ceiling reads nothing
    sample, n_chars = [], 0
    for text in docs["train"]:
        if n_chars >= sample_chars:
            break
        sample.append(text[: sample_chars - n_chars])
        n_chars += len(sample[-1])

    cpu, started = cpu_seconds(), time.perf_counter()
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([  # GPT-2's byte-level split, whitespace-free runs cut at 64
        pre_tokenizers.Split(Regex(r"\S{64}"), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(sample, trainer)
    tokenizer_s = time.perf_counter() - started
    eos, n_tokens = tokenizer.token_to_id("<eos>"), 0
    for split, texts in docs.items():
        fd = os.open(Path(work) / f"{split}.ids", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for i in range(0, len(texts), LIBRARY_BATCH_DOCS):
            ids = [e.ids for e in tokenizer.encode_batch_fast(texts[i : i + LIBRARY_BATCH_DOCS])]
            for doc in ids:
                doc.append(eos)
            flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.uint16, count=sum(map(len, ids)))
            os.write(fd, flat.tobytes())
            n_tokens += len(flat)
        os.fsync(fd)
        os.close(fd)
    seconds, cpu = time.perf_counter() - started, cpu_seconds() - cpu
    return {
        "seconds": seconds, "cpu_s": cpu, "tokenizer_s": tokenizer_s, "encode_s": seconds - tokenizer_s, "n_tokens": n_tokens,
        "sha256": {split: hashlib.sha256((Path(work) / f"{split}.ids").read_bytes()).hexdigest() for split in docs},
        "vocab_sha256": hashlib.sha256(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode()).hexdigest(),
        "peak_anon_mb": sampler.stop(),
    }


SIDES = {"project": measure_project, "library": measure_library}


def run_child(side: str, arguments: dict, folder: Path) -> dict:
    """One measured build in a fresh process (ru_maxrss is a lifetime peak; nothing cached in memory)."""
    work = Path(tempfile.mkdtemp(prefix=f"{side}-", dir=folder))
    # datasets' Arrow cache inside the run's own folder: every project build starts cold.
    env = {**os.environ, "HF_DATASETS_CACHE": str(work / "hf-cache"), "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    child = json.dumps({"side": side, **arguments, "work": str(work)})
    result = subprocess.run([sys.executable, __file__, "--child", child], env=env, capture_output=True, text=True, check=False)
    if result.returncode:
        sys.exit(f"error: the {side} build failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- driver
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[50, 500])
    parser.add_argument("--quick", action="store_true", help="2 MB and 5 MB, a 1 MB tokenizer sample")
    parser.add_argument("--repeats", type=int, default=1, help="builds per side and size (times: the median)")
    parser.add_argument("--num-proc", type=int, default=1, help="data.num_proc of the project's build")
    parser.add_argument("--streaming", action="store_true", help="data.streaming=true: the project reads parquet as it tokenizes")
    parser.add_argument("--tokenizer-sample-mb", type=float, help="data.tokenizer_sample_chars in millions (default: the project's)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # JSON arguments of one measured build
    args = parser.parse_args()
    if args.child:
        arguments = json.loads(args.child)
        print(json.dumps(SIDES[arguments.pop("side")](**arguments)))
        return
    sizes = [2, 5] if args.quick else args.sizes_mb
    sample_mb = args.tokenizer_sample_mb or (1 if args.quick else default_sample_chars() / 1e6)
    sample_chars = int(sample_mb * 1e6)
    speeches = play_speeches()
    print(f"{len(speeches)} play speeches; documents of {SPEECHES_PER_DOC}; vocab {VOCAB_SIZE}; tokenizer sample "
          f"{sample_chars:,} characters; num_proc={args.num_proc}; streaming={args.streaming}; {args.repeats} repeat(s); "
          f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}", flush=True)
    for size_mb in sizes:
        with tempfile.TemporaryDirectory(prefix="benchmark_data-") as tmp:
            folder = Path(tmp)
            arguments = {"train_files": write_corpus(folder / "train", size_mb, speeches, seed=0),
                         "val_file": write_corpus(folder / "val", 1, speeches, seed=1)[0],
                         "num_proc": args.num_proc, "sample_chars": sample_chars, "streaming": args.streaming}
            runs: dict[str, list[dict]] = {"project": [], "library": []}
            for repeat in range(args.repeats):
                for side in ("project", "library") if repeat % 2 == 0 else ("library", "project"):
                    runs[side].append(run_child(side, arguments, folder))
            report(size_mb, runs)


def report(size_mb: float, runs: dict[str, list[dict]]) -> None:
    project, library = runs["project"][0], runs["library"][0]
    if (project["sha256"], project["vocab_sha256"]) != (library["sha256"], library["vocab_sha256"]):
        sys.exit(f"error: at {size_mb:g} MB the project and tokenizers alone did not produce the same tokenizer and token "
                 f"streams ({project['n_tokens']:,} vs {library['n_tokens']:,} tokens): the comparison is void")

    def median(side: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[side])

    def fastest(side: str) -> float:
        return min(r["seconds"] for r in runs[side])

    def each(side: str) -> str:
        return ", ".join(f"{r['seconds']:.1f}" for r in runs[side])

    p_s, l_s = median("project", "seconds"), median("library", "seconds")
    n = project["n_tokens"]
    print(f"{size_mb:g} MB: {n:,} tokens (identical in both); "
          f"project {p_s:.1f} s = tokenizer {median('project', 'tokenizer_s'):.1f} + encode/write {median('project', 'encode_s'):.1f} "
          f"({n / p_s / 1e6:.2f} M tokens/s; parquet -> Arrow {median('project', 'arrow_s'):.1f} s besides); "
          f"tokenizers alone {l_s:.1f} s = {median('library', 'tokenizer_s'):.1f} + {median('library', 'encode_s'):.1f} "
          f"({n / l_s / 1e6:.2f} M tokens/s)", flush=True)
    p_cpu, l_cpu = median("project", "cpu_s"), median("library", "cpu_s")
    print(f"{size_mb:g} MB: ratio {p_s / l_s:.2f} (project / tokenizers alone, wall); "
          f"CPU seconds {p_cpu:.1f} / {l_cpu:.1f} = {p_cpu / l_cpu:.2f}; "
          f"runs: project {each('project')} s, library {each('library')} s (fastest: ratio {fastest('project') / fastest('library'):.2f})",
          flush=True)
    print(f"{size_mb:g} MB: project peak memory: anonymous {max(r['peak_anon_mb'] for r in runs['project']):.0f} MB, "
          f"ru_maxrss {max(r['maxrss_mb'] for r in runs['project']):.0f} MB, "
          f"worker processes' ru_maxrss {max(r['children_maxrss_mb'] for r in runs['project']):.0f} MB "
          f"(tokenizers alone, the whole text in memory: anonymous {max(r['peak_anon_mb'] for r in runs['library']):.0f} MB); "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
