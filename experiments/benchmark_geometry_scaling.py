"""Seconds per geometry record, per family, from d_model 128 to GPT-2 small's 768, against the training it annotates.

    python experiments/benchmark_geometry_scaling.py            # d 128 / 256 / 512 / 768 (~25 min on 2 cores)
    python experiments/benchmark_geometry_scaling.py --quick    # d 64 and 128 at short blocks, a smoke test (~15 s)

The ladder (positions = seq_len, random weights, learned PE so that every family runs):
d 128 / 4 layers / 4 heads / seq 128 (the default decoder), d 256 / 4 / 8 / 256, d 512 / 8 / 8 / 512,
d 768 / 12 / 12 / 1024 (experiment=gpt2_small's model); vocabulary 2048 (data=shakespeare's) but
32768 at d 768 (the preset's). Tokens are Zipf-distributed (exponent 1.2), so the frequent-token
rule and the per-token means see text-like counts.

Each family is timed through the callback's own code (``GeometryCallback.measure`` with its
``measures`` narrowed to one family, rows chosen by its ``choose_rows``, under torch.no_grad in
eval mode as ``_record`` runs it), at the callback's defaults (1000 word rows, 100 null draws,
8 probe blocks, 128 position-probe blocks, 20 relabellings, ``chunk_tokens`` 8192):
  (a) input + null: the input measures and their rotation null, second call (the first fills
      the chance-level caches; printed too);
  (b) hidden: the hidden-state measures of every layer on the 8 probe blocks; with the position
      probe, the record that also runs it; the probe's extra cost counts once in 5 records
      (position_probe_every_n_steps / every_n_steps = 500 / 100), "amortised";
  (c) attention: the block-0 attention split on 4 blocks.
Peak memory: the rise of the process's peak RSS during each family (VmHWM, reset before it
through /proc/self/clear_refs), or torch.cuda.max_memory_allocated on a GPU. On a CPU the allocator
reuses what earlier families freed, so that rise undercounts; ``--memory`` runs each family once
in a fresh process and prints its whole peak RSS instead (``--max-d`` to stop early).

Training time between two records: 100 optimiser steps (every_n_steps) of 32 blocks of
seq_len tokens: forward, backward (the model's own loss) and a torch AdamW step, eager, fp32.
Where 32 blocks are too slow or too large for this machine, at most ``--step-tokens`` tokens
are measured (e.g. 4 of the 32 blocks at d 768) and the forward + backward time is scaled
linearly to 32 blocks (the AdamW step, timed apart, is added once); the output says so.
The share = amortised record / (100 steps): the goal is <= 5 % at every size.
The cost law: per family, the slope of log(seconds) on log(d) (least squares over the ladder;
seq_len grows with d along it, so the exponent is that of the ladder, not of d alone).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import platform
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from benchmark import package_versions  # experiments/ is on sys.path when a script here runs

from pe_geometry.analysis.geometry_callback import GeometryCallback
from pe_geometry.model import DecoderLM
from pe_geometry.model.positional import LearnedPE


@dataclass(frozen=True)
class Shape:
    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    vocab_size: int


LADDER = [Shape(128, 4, 4, 128, 2048), Shape(256, 4, 8, 256, 2048), Shape(512, 8, 8, 512, 2048),
          Shape(768, 12, 12, 1024, 32768)]
QUICK = [Shape(64, 2, 2, 32, 2048), Shape(128, 4, 4, 64, 2048)]
BATCH_BLOCKS = 32  # blocks per optimiser step (data.batch_size)
FAMILIES = ("input", "hidden", "attention")


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


class PeakMemory:
    """The rise of peak memory inside a block: CUDA's allocator peak on a GPU, else the process's peak RSS."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.clear_refs = Path("/proc/self/clear_refs")

    def _rss_hwm(self) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return 0

    def __enter__(self) -> PeakMemory:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
        else:
            if self.clear_refs.exists():
                self.clear_refs.write_text("5")  # reset VmHWM to the current RSS
            self.start = self._rss_hwm()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.rise = torch.cuda.max_memory_allocated() - self.start
        else:
            self.rise = self._rss_hwm() - self.start


def build(shape: Shape, device: torch.device, seed: int = 0) -> tuple[DecoderLM, GeometryCallback]:
    """A random-weight decoder of the shape, and the callback at its defaults with its rows chosen from Zipf tokens."""
    torch.manual_seed(seed)
    model = DecoderLM(vocab_size=shape.vocab_size, d_model=shape.d_model, n_heads=shape.n_heads, n_layers=shape.n_layers,
                      pe=functools.partial(LearnedPE, max_len=shape.seq_len)).to(device)
    rng = np.random.default_rng(seed)
    callback = GeometryCallback()
    stream = rng.zipf(1.2, size=(2 + callback.n_probe_blocks) * shape.seq_len + 200_000) % shape.vocab_size
    train, validation = stream[:200_000], stream[200_000:]
    callback.choose_rows(train, validation, shape.vocab_size, shape.seq_len, specials=[0, 1, 2])
    return model, callback


def record(model: DecoderLM, callback: GeometryCallback, family: str, probe: bool = False) -> tuple[float, int]:
    """Seconds and peak-memory rise of one ``measure`` call narrowed to one family (as _record runs it)."""
    device = model.W_E.device
    callback.measures = (family,)
    model.eval()
    with torch.no_grad(), torch.random.fork_rng(devices=[]), PeakMemory(device) as memory:
        start = time.perf_counter()
        metrics = callback.measure(model, position_probe_now=probe)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    assert metrics and all(math.isfinite(v) or math.isnan(v) for v in metrics.values())
    return seconds, memory.rise


def step_time(model: DecoderLM, shape: Shape, step_tokens: int, steps: int) -> tuple[float, int, float, float]:
    """(seconds of a 32-block optimiser step, blocks measured, forward + backward s, AdamW s)."""
    device = model.W_E.device
    blocks = max(1, min(BATCH_BLOCKS, step_tokens // shape.seq_len))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randint(shape.vocab_size, (blocks, shape.seq_len + 1), device=device)
    fwd_bwd, opt = [], []
    for i in range(steps + 1):  # the first is a warm-up (allocations, AdamW state)
        start = time.perf_counter()
        model.loss(batch).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        middle = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:
            fwd_bwd.append(middle - start)
            opt.append(time.perf_counter() - middle)
    fb, op = float(np.median(fwd_bwd)), float(np.median(opt))
    return fb * BATCH_BLOCKS / blocks + op, blocks, fb, op


def rss_mb(field: str = "VmRSS") -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def one_family(shape: Shape, family: str, device: torch.device) -> None:
    """Run one family once in this (fresh) process; print its peak RSS and the rise over the built model's RSS."""
    model, callback = build(shape, device)
    base = rss_mb()
    probe = family == "probe"
    seconds, _ = record(model, callback, "hidden" if probe else family, probe=probe)
    print(f"MEMORY {family} peak {rss_mb('VmHWM'):.0f} MB, model and rows {base:.0f} MB, rise {rss_mb('VmHWM') - base:.0f} MB, "
          f"{seconds:.1f} s")


def memory_table(ladder: list[Shape], device: torch.device) -> None:
    """Peak RSS of each family in a fresh process (a process's allocator reuses what earlier families freed)."""
    import subprocess
    import sys

    print("\n| d | family | peak RSS (MB) | model and rows, before it (MB) | rise (MB) |\n|---|---|---|---|---|")
    for shape in ladder:
        for family in ("input", "hidden", "probe", "attention"):
            out = subprocess.run([sys.executable, __file__, "--one", family, "--d", str(shape.d_model), "--device", str(device)],
                                 capture_output=True, text=True, check=True).stdout
            peak, base, rise = (float(x) for x in re.findall(r"(-?[\d.]+) MB", out)[:3])
            label = "hidden + position probe" if family == "probe" else family
            print(f"| {shape.d_model} | {label} | {peak:.0f} | {base:.0f} | {rise:.0f} |", flush=True)


def exponent(d: list[int], seconds: list[float]) -> float:
    """Least-squares slope of log(seconds) on log(d)."""
    return float(np.polyfit(np.log(d), np.log(seconds), 1)[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="two small shapes, one timed step (a smoke test)")
    parser.add_argument("--step-tokens", type=int, default=4096,
                        help="at most this many tokens in the timed training step (scaled linearly to 32 blocks)")
    parser.add_argument("--steps", type=int, default=2, help="timed training steps per shape (after one warm-up)")
    parser.add_argument("--max-d", type=int, default=None, help="stop the ladder after this d_model")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    parser.add_argument("--memory", action="store_true",
                        help="only the peak memory of each family, each in a fresh process (the probe's takes as long as a probe)")
    parser.add_argument("--one", choices=("input", "hidden", "probe", "attention"), help=argparse.SUPPRESS)
    parser.add_argument("--d", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.one:
        one_family(next(s for s in LADDER + QUICK if s.d_model == args.d), args.one, torch.device(args.device))
        return
    device = torch.device(args.device)
    ladder = QUICK if args.quick else [s for s in LADDER if args.max_d is None or s.d_model <= args.max_d]
    steps = 1 if args.quick else args.steps
    if args.memory:
        memory_table(ladder, device)
        return
    defaults = GeometryCallback()
    probe_every = defaults.probe_every // defaults.every_n_steps
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    print(f"machine: {name}, {os.cpu_count()} CPU cores, {torch.get_num_threads()} torch threads, device {device}; "
          f"load average {load()} (1/5/15 min)")
    print(f"versions: {package_versions(('torch', 'numpy', 'scikit-learn', 'lightning'))}")
    print(f"callback defaults: {defaults.n_tokens} word rows, {defaults.null_draws} null draws, {defaults.probe_batch_size} "
          f"probe blocks, {defaults.n_probe_blocks} position-probe blocks (every {probe_every}th record), "
          f"{defaults.probe_permutations} relabellings, chunk_tokens {defaults.chunk_tokens}; a record every "
          f"{defaults.every_n_steps} steps of {BATCH_BLOCKS} blocks\n")
    rows, costs = [], {key: [] for key in ("input", "hidden", "probe", "attention", "record")}
    for shape in ladder:
        model, callback = build(shape, device)
        before = load()
        first_input, _ = record(model, callback, "input")
        t_input, m_input = record(model, callback, "input")
        t_hidden, m_hidden = record(model, callback, "hidden")
        t_with_probe, m_probe = record(model, callback, "hidden", probe=True)
        t_attention, m_attention = record(model, callback, "attention")
        t_probe = max(t_with_probe - t_hidden, 0.0)
        t_record = t_input + t_hidden + t_attention + t_probe / probe_every
        step_s, blocks, fb, op = step_time(model, shape, args.step_tokens, steps)
        share = t_record / (defaults.every_n_steps * step_s)
        scaled = ("" if blocks == BATCH_BLOCKS else
                  f" ({blocks} blocks measured: fwd+bwd {fb:.2f} s x {BATCH_BLOCKS / blocks:g} + AdamW {op:.2f} s)")
        print(f"d {shape.d_model}: input+null {t_input:.2f} s (first call {first_input:.2f} s), hidden {t_hidden:.2f} s, "
              f"hidden+probe {t_with_probe:.2f} s, attention {t_attention:.2f} s; step {step_s:.2f} s{scaled}; "
              f"share {100 * share:.2f} %; load {before} -> {load()}", flush=True)
        for key, value in (("input", t_input), ("hidden", t_hidden), ("probe", t_probe), ("attention", t_attention),
                           ("record", t_record)):
            costs[key].append(value)
        mb = [m / 2**20 for m in (m_input, m_hidden, m_probe, m_attention)]
        rows.append(f"| {shape.d_model} | {shape.n_layers} / {shape.n_heads} | {shape.seq_len} | {t_input:.2f} | {t_hidden:.2f} | "
                    f"{t_probe:.1f} | {t_attention:.2f} | {t_record:.2f} | {step_s:.2f}{' *' if scaled else ''} | "
                    f"{100 * share:.2f} % | {mb[0]:.0f} / {mb[1]:.0f} / {mb[2]:.0f} / {mb[3]:.0f} |")
        del model, callback
    print("\n| d | layers / heads | seq_len | (a) input + null (s) | (b) hidden (s) | position probe, extra (s) | "
          "(c) attention (s) | record, probe amortised (s) | training step, 32 blocks (s) | record / 100 steps | "
          "peak memory rise: input / hidden / hidden + probe / attention (MB) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print("(* = scaled from fewer blocks, see above)")
    if len(ladder) > 1:
        d = [s.d_model for s in ladder]
        laws = ", ".join(f"{key} d^{exponent(d, v):.2f}" for key, v in costs.items() if min(v) > 0)
        print(f"\ncost law (log-log least squares over d {d}, seq_len = positions growing with d): {laws}")
    print(f"load average at the end: {load()}")


if __name__ == "__main__":
    main()
