"""How many CPU threads torch uses in a run: the cores that are idle when it starts, unless the environment says.

Measured (docs/BENCHMARKS.md, the default run, 2-vCPU VM): idle, 2 threads train 1.66x faster than 1; with another
process holding one core, 1 thread is 1.53x faster than 2 (and on a loaded machine a step took 48 s with 2 threads
against 3.7 s with 1: threads that wait on each other spin). torch's default (every physical core) is right only on an
idle machine, so a run samples how busy the cores are for a quarter of a second before it builds anything. Set
``OMP_NUM_THREADS`` to choose yourself: on a cluster node, the cores the job was given. A ``local_parallel`` sweep
gives each job its share already (``hydra_plugins.pe_geometry.launchers``). While the run trains, the callback
``callbacks.threads`` (``training.thread_follower``) moves the count with the machine (``ThreadFollower``).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
PROC_STAT = Path("/proc/stat")


@functools.cache
def torch_default_threads() -> int:
    """torch's own count as this process started (every physical core): the most a run or its follower takes. Its
    first call must come before anything sets a count (a sweep's later jobs in the same process must not inherit the
    count an earlier job chose)."""
    import torch

    return torch.get_num_threads()


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


def own_cpu_seconds() -> float:
    """CPU time this process (all its threads) has used: what it takes of the cores itself."""
    times = os.times()
    return times.user + times.system


def others_busy_cores(before: tuple[tuple[int, int], float], after: tuple[tuple[int, int], float],
                      cores: int, ticks_per_second: float) -> float | None:
    """How many cores other processes kept busy between two samples ``((idle, total) jiffies, own CPU seconds)``:
    the machine's busy time less this process's own (a run counting its own threads as load would shed them)."""
    (idle0, total0), own0 = before
    (idle1, total1), own1 = after
    if total1 <= total0:
        return None
    span = (total1 - total0) / cores  # jiffies per core over the interval
    busy = (total1 - total0) - (idle1 - idle0)
    own = (own1 - own0) * ticks_per_second
    return max(0.0, busy - own) / span


class ThreadFollower:
    """Moves torch's thread count with the machine while a run trains: at each look (the callback
    ``training.thread_follower.ThreadCountFollower``, every ``callbacks.threads.every_seconds``) it measures how many
    cores other processes held since the last look, and uses the rest (at least 1, at most ``most``, the count torch
    would take). A change needs two looks in a row that agree (one busy burst elsewhere does not move it) and is
    logged. Where the count was given (``OMP_NUM_THREADS`` or ``MKL_NUM_THREADS`` set), under DDP, or without
    /proc/stat the callback makes none. Before: started beside a CPU-bound process that ended early, a run kept its
    one thread for its whole life (0.54x the plain-PyTorch loop, issue 54)."""

    def __init__(self, threads: int, most: int, stat: Path = PROC_STAT, set_threads=None, cores: int | None = None,
                 clock=own_cpu_seconds) -> None:
        import torch

        self.threads, self.most, self.stat = threads, most, stat
        self.set_threads = set_threads or torch.set_num_threads
        self.cores = cores or os.cpu_count() or 1
        self.clock = clock
        self.ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last: tuple[tuple[int, int], float] | None = None
        self._pending: int | None = None
        self.changes: list[tuple[int, int, int]] = []  # (step, from, to)

    def sample(self) -> tuple[tuple[int, int], float] | None:
        times = cpu_times(self.stat)
        return None if times is None else (times, self.clock())

    def start(self) -> None:
        self._last = self.sample()

    def look(self, step: int) -> None:
        """One look: the target count from the load since the last look; a change once two looks agree."""
        now = self.sample()
        if now is None or self._last is None:
            self._last = now
            return
        held = others_busy_cores(self._last, now, self.cores, self.ticks)
        self._last = now
        if held is None:
            return
        target = max(1, min(self.most, math.floor(self.cores - held + 0.5)))
        log.debug("threads: look at step %d: other processes held ~%.2f of %d cores, %d wanted, %d used", step, held,
                  self.cores, target, self.threads)  # (hydra.verbose=pe_geometry.training.threads shows them)
        if target == self.threads:
            self._pending = None
            return
        if self._pending != target:
            self._pending = target  # the first look that asks for it: wait for a second
            return
        log.info("threads: %d -> %d at step %d (other processes held ~%.1f of %d cores)", self.threads, target,
                 step, held, self.cores)
        self.changes.append((step, self.threads, target))
        self.set_threads(target)
        self.threads, self._pending = target, None


def use_idle_cores() -> tuple[int, str]:
    """A side command's threads, by a run's rule (the cores idle now; ``OMP_NUM_THREADS`` wins): torch's default
    takes every core, and on a loaded machine threads that wait on each other spin (pe-generate took 14.3 s at load 4.4
    against 2.2 s with one thread, issue 54)."""
    import torch

    threads, why = choose_threads(torch.get_num_threads())
    torch.set_num_threads(threads)
    return threads, why
