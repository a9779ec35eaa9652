"""How many CPU threads torch uses in a run: the cores that are idle when it starts, unless the environment says.

Measured (docs/BENCHMARKS.md, the default run, 2-vCPU VM): idle, 2 threads train 1.66x faster than 1; with another
process holding one core, 1 thread is 1.53x faster than 2 (and on a loaded machine a step took 48 s with 2 threads
against 3.7 s with 1: threads that wait on each other spin). torch's default (every physical core) is right only on an
idle machine, so a run samples how busy the cores are for a quarter of a second before it builds anything. Set
``OMP_NUM_THREADS`` to choose yourself: on a cluster node, the cores the job was given. A ``local_parallel`` sweep
gives each job its share already (``hydra_plugins.pe_geometry.launchers``).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
PROC_STAT = Path("/proc/stat")


def cpu_times(stat: Path = PROC_STAT) -> tuple[int, int] | None:
    """(idle, total) jiffies of all CPUs from /proc/stat's first line; None where there is no such file (not Linux)."""
    try:
        fields = stat.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    values = [int(v) for v in fields[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return idle, sum(values[:8])  # user..steal (guest time is counted within user)


def idle_cores(seconds: float = 0.25, stat: Path = PROC_STAT) -> float | None:
    """How many cores were idle over the next ``seconds`` (0 .. the machine's cores), or None where it cannot tell."""
    before = cpu_times(stat)
    time.sleep(seconds)
    after = cpu_times(stat)
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1]) * (os.cpu_count() or 1)


def choose_threads(torch_default: int, environ: dict | None = None, idle: float | None = None) -> tuple[int, str]:
    """The number of threads a run should use and why, as its log says it. ``idle``: the idle cores sampled (None:
    sample now)."""
    environ = os.environ if environ is None else environ
    for variable in THREAD_VARIABLES:
        if environ.get(variable):
            return torch_default, f"{variable}={environ[variable]}"
    idle = idle_cores() if idle is None else idle
    if idle is None:
        return torch_default, "torch's default (how busy the cores are is unknown here)"
    threads = max(1, min(torch_default, math.floor(idle + 0.5)))
    return threads, f"{idle:.1f} of {os.cpu_count()} cores idle at the start; OMP_NUM_THREADS=N to choose"
