"""A run's CPU threads: the cores idle when it starts (measured: 2 threads 1.66x faster idle, 1 thread 1.53x faster
with a core taken), unless OMP_NUM_THREADS says."""

from __future__ import annotations

import pytest

from pe_geometry.training.threads import ThreadFollower, choose_threads, cpu_times, idle_cores, others_busy_cores


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


# ------------------------------------------------------------------ following the machine while a run trains

def test_others_busy_cores_subtracts_this_processs_own_time():
    """2 cores, 1 s (200 jiffies at 100 Hz): 150 busy, of which this process used 0.5 s (50 jiffies): others held 1."""
    before, after = ((0, 0), 10.0), ((50, 200), 10.5)
    assert others_busy_cores(before, after, cores=2, ticks_per_second=100) == pytest.approx(1.0)
    # our own threads alone keep both cores busy: nobody else is there
    assert others_busy_cores(((0, 0), 0.0), ((0, 200), 2.0), cores=2, ticks_per_second=100) == pytest.approx(0.0)
    assert others_busy_cores(((0, 200), 0.0), ((0, 200), 0.0), cores=2, ticks_per_second=100) is None  # no time passed


class FakeMachine:
    """/proc/stat and this process's CPU time, advanced by hand: each tick is one second of 2 cores at 100 Hz."""

    def __init__(self, tmp_path):
        self.stat, self.idle, self.total, self.own = tmp_path / "stat", 0, 0, 0.0
        self.write()

    def write(self):
        busy = self.total - self.idle
        self.stat.write_text(f"cpu  {busy} 0 0 {self.idle} 0 0 0 0 0 0\n")

    def second(self, others: float, ours: float):
        """One second in which other processes keep ``others`` cores busy and we keep ``ours``."""
        self.total += 200
        self.idle += round(200 - 100 * (others + ours))
        self.own += ours
        self.write()


def follower_on(machine, threads: int):
    set_to = []
    follower = ThreadFollower(threads, most=2, stat=machine.stat, set_threads=set_to.append, cores=2,
                              clock=lambda: machine.own)
    follower.ticks = 100
    return follower, set_to


def test_the_count_moves_up_when_the_other_process_ends_after_two_looks_that_agree(tmp_path):
    machine = FakeMachine(tmp_path)
    follower, set_to = follower_on(machine, threads=1)  # started beside a CPU-bound process
    follower.start()
    machine.second(others=1, ours=1)
    follower.look(50)
    assert set_to == []  # still busy elsewhere
    machine.second(others=0, ours=1)
    follower.look(100)
    assert set_to == []  # one look asking for 2 is not enough
    machine.second(others=0, ours=1)
    follower.look(150)
    assert set_to == [2] and follower.threads == 2 and follower.changes == [(150, 1, 2)]


def test_the_count_moves_down_when_another_process_takes_a_core_and_never_below_1(tmp_path):
    machine = FakeMachine(tmp_path)
    follower, set_to = follower_on(machine, threads=2)
    follower.start()
    for step in (50, 100):
        machine.second(others=1, ours=1)
        follower.look(step)
    assert set_to == [1]
    for step in (150, 200):
        machine.second(others=2, ours=0.2)  # everything taken: one thread still
        follower.look(step)
    assert set_to == [1]


def test_a_single_busy_look_does_not_flap(tmp_path):
    machine = FakeMachine(tmp_path)
    follower, set_to = follower_on(machine, threads=2)
    follower.start()
    for step, others in ((50, 1), (100, 0), (150, 1), (200, 0)):
        machine.second(others=others, ours=1)
        follower.look(step)
    assert set_to == []


def test_the_pipeline_follows_only_where_it_chose_the_count(monkeypatch):
    from pe_geometry.training.threads import THREAD_VARIABLES

    _, why = choose_threads(4, environ={"OMP_NUM_THREADS": "3"}, idle=1.0)
    assert why.startswith(THREAD_VARIABLES)  # the pipeline's test: told by the environment -> no follower
    _, why = choose_threads(4, environ={}, idle=1.0)
    assert not why.startswith(THREAD_VARIABLES)


def test_a_step_computes_the_same_numbers_with_one_or_two_threads():
    """What the follower changes is how many threads compute, not what: a decoder's loss and gradients agree."""
    import torch

    from pe_geometry.model import DecoderLM, SinusoidalPE

    torch.manual_seed(0)
    model = DecoderLM(vocab_size=97, d_model=32, n_heads=4, n_layers=2, pe=SinusoidalPE)
    block = torch.randint(0, 97, (4, 17))
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            model.zero_grad()
            loss = model.loss(block)
            loss.backward()
            results.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    finally:
        torch.set_num_threads(before)
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-6)
    for g1, g2 in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("command, argv", [
    ("pe_geometry.cli.report", ["{folder}", "--no-pretrained"]),
    ("pe_geometry.cli.bench", ["extrapolation", "{folder}", "--out", "{folder}/out"]),
    ("pe_geometry.cli.extrapolate", ["{folder}/missing"]),
    ("pe_geometry.cli.verdict", ["{folder}"]),
])
def test_every_side_command_chooses_its_threads_as_a_run_does(command, argv, tmp_path, monkeypatch):
    """pe-report, pe-bench, pe-extrapolate, pe-verdict took torch's default (every core) whatever the load."""
    import importlib

    import pe_geometry.training.threads as threads

    calls = []
    monkeypatch.setattr(threads, "use_idle_cores", lambda: calls.append(1) or (1, "test"))
    main = importlib.import_module(command).main
    with pytest.raises(SystemExit):  # an empty folder: refused after the threads are chosen
        main([a.format(folder=tmp_path) for a in argv])
    assert calls == [1]


def test_use_idle_cores_sets_torchs_count_by_the_runs_rule(monkeypatch):
    import torch

    import pe_geometry.training.threads as threads

    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "choose_threads", lambda default: (1, "1.0 of 2 cores idle at the start"))
    try:
        assert threads.use_idle_cores() == (1, "1.0 of 2 cores idle at the start")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
