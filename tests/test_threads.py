"""A run's CPU threads: the cores idle when it starts (measured: 2 threads 1.66x faster idle, 1 thread 1.53x faster
with a core taken), unless OMP_NUM_THREADS says."""

from __future__ import annotations

import pytest

from pe_geometry.training.threads import choose_threads, cpu_times, idle_cores


def write_stat(path, user, idle, iowait=0):
    path.write_text(f"cpu  {user} 0 0 {idle} {iowait} 0 0 0 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")


def test_cpu_times_reads_idle_and_iowait_against_the_total(tmp_path):
    stat = tmp_path / "stat"
    write_stat(stat, user=300, idle=600, iowait=100)
    assert cpu_times(stat) == (700, 1000)
    assert cpu_times(tmp_path / "missing") is None


def test_idle_cores_is_the_idle_share_of_the_interval_times_the_cores(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    write_stat(stat, user=0, idle=0)
    samples = iter([(0, 0), (150, 200)])  # 150 of 200 jiffies idle
    monkeypatch.setattr("pe_geometry.training.threads.cpu_times", lambda path: next(samples))
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert idle_cores(seconds=0, stat=stat) == pytest.approx(1.5)


@pytest.mark.parametrize("idle,expected", [(1.9, 2), (1.4, 1), (0.2, 1), (7.0, 2)])
def test_a_run_takes_the_idle_cores_at_most_torchs_default(idle, expected):
    threads, why = choose_threads(torch_default=2, environ={}, idle=idle)
    assert threads == expected and "idle" in why


def test_the_environment_decides_where_it_is_set():
    assert choose_threads(torch_default=2, environ={"OMP_NUM_THREADS": "2"}, idle=0.1) == (2, "OMP_NUM_THREADS=2")


def test_unknown_load_keeps_torchs_default(monkeypatch):
    monkeypatch.setattr("pe_geometry.training.threads.idle_cores", lambda: None)
    threads, why = choose_threads(torch_default=4, environ={})
    assert threads == 4 and "default" in why
