"""Where `pe-pretrained MODEL` spends its time: each phase of one run, timed in this process, with the machine's load.

    python experiments/benchmark_pretrained.py smollm2              # the record and the quantisation band
    python experiments/benchmark_pretrained.py gemma3 --no-band     # any pe-pretrained arguments after the model
    python experiments/benchmark_pretrained.py minilm --json /tmp/r.json

The run is the console script's own ``main`` (nothing re-implemented): the library functions it calls are wrapped by
timers for the run, and each timed call is counted in the record's column or, inside ``quantisation_band``, in the
band's. A phase nested in another (the probe's eigendecompositions inside the probe) is printed indented under it and
is part of its time; "rest" is the section's time that no phase covers. "GGUF parses" counts ``gguf.GGUFReader``
instances built (transformers' legacy loader builds one per call). Timings are as noisy as the machine: the load
average before and after is printed beside them, so compare two versions side by side in one session.
"""

from __future__ import annotations

import functools
import os
import resource
import sys
import time
from collections import defaultdict
from contextlib import ExitStack, contextmanager
from unittest import mock

import pe_geometry.offline  # noqa: F401  (before anything that could reach a hub)

SECTIONS = ("record", "band")


class Timers:
    """Seconds and calls per (phase, section); the section is 'band' inside quantisation_band, else 'record'."""

    def __init__(self) -> None:
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.section = "record"
        self.depth: dict[str, int] = {}
        self._stack: list[str] = []

    def wrap(self, phase: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self.depth.setdefault(phase, len(self._stack))
            self._stack.append(phase)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._stack.pop()
                self.seconds[phase, self.section] += time.perf_counter() - start
                self.calls[phase, self.section] += 1

        return timed

    @contextmanager
    def in_section(self, name: str):
        previous, self.section = self.section, name
        try:
            yield
        finally:
            self.section = previous


def _patches(timers: Timers) -> list:
    """mock.patch objects wrapping each phase where the code looks it up (module globals, class attributes)."""
    import gguf
    import torch

    from pe_geometry.analysis.measures import geometry, position_probe
    from pe_geometry.analysis.readers import checkpoints, pretrained

    def wrapped(target, attribute: str, phase: str):
        return mock.patch.object(target, attribute, timers.wrap(phase, getattr(target, attribute)))

    band = pretrained.quantisation_band

    @functools.wraps(band)
    def band_section(*args, **kwargs):
        with timers.in_section("band"):
            return timers.wrap("quantisation band (whole)", band)(*args, **kwargs)

    return [
        wrapped(checkpoints, "load", "load (whole)"),
        wrapped(pretrained, "load", "load (whole)"),
        wrapped(gguf.GGUFReader, "__init__", "GGUF parses (GGUFReader)"),
        wrapped(checkpoints, "_gguf_types", "GGUF tensor types"),
        wrapped(pretrained, "token_stream", "tokenise the plays"),
        wrapped(pretrained, "input_report", "input level (learned tables)"),
        wrapped(pretrained, "first_layer_attention", "block 0 split"),
        wrapped(checkpoints.Reader, "hidden_states", "forward: hidden states"),
        wrapped(geometry, "hidden_state_report", "hidden_state_report"),
        wrapped(pretrained, "position_probe", "position probe"),
        wrapped(position_probe.PositionProbeSums, "add", "probe: fold sums"),
        wrapped(position_probe, "_cv_r2", "probe: nested CV"),
        wrapped(torch.linalg, "eigh", "torch.linalg.eigh (any caller)"),
        wrapped(checkpoints.Reader, "attention", "forward: attention"),
        wrapped(pretrained, "recorded_distance", "attention distance"),
        wrapped(pretrained, "recorded_shares", "positional shares"),
        wrapped(pretrained, "rotation_null_shares", "rotation null"),
        mock.patch.object(pretrained, "quantisation_band", band_section),
    ]


def main(argv: list[str]) -> None:
    from pe_geometry.cli.pretrained import main as pe_pretrained

    timers = Timers()
    load_before = os.getloadavg()
    start = time.perf_counter()
    with ExitStack() as stack:
        for patch in _patches(timers):
            stack.enter_context(patch)
        results = pe_pretrained(argv)
    total = time.perf_counter() - start
    load_after = os.getloadavg()
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux

    record_s = results["timings"]["total_s"]
    band_s = results["timings"].get("band_s", 0.0)
    print(f"\n== benchmark_pretrained {' '.join(argv)}: {total:.1f} s in all (record {record_s:.1f} s, band "
          f"{band_s:.1f} s), peak RSS {peak_gb:.2f} GB, threads {__import__('torch').get_num_threads()}, "
          f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after ({os.cpu_count()} CPUs)")
    phases = list(timers.depth)  # in the order of their first call
    print(f"    {'phase':<40}{'record s':>10}{'calls':>7}{'band s':>10}{'calls':>7}")
    for phase in phases:
        cells = "".join(f"{timers.seconds[phase, s]:>10.2f}{timers.calls[phase, s]:>7d}" for s in SECTIONS)
        print(f"    {'  ' * timers.depth[phase] + phase:<40}{cells}")
    top = [p for p in phases if timers.depth[p] == 0 and p != "quantisation band (whole)"]
    rest = record_s - sum(timers.seconds[p, "record"] for p in top)
    print(f"    {'rest of the record':<40}{rest:>10.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
