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


class ThreadsChosen(Exception):
    """Raised by the stand-in for ``use_idle_cores``: the command got that far, and stops there."""


@pytest.mark.parametrize("command, argv, early_check", [
    ("pe_geometry.cli.report", ["{folder}", "--no-pretrained"], "pe_geometry.cli.report.reportable_runs"),
    ("pe_geometry.cli.bench", ["extrapolation", "{folder}", "--out", "{folder}/out"],
     "pe_geometry.benchmarks.extrapolation.check"),
    ("pe_geometry.cli.extrapolate", ["{folder}"], None),
    ("pe_geometry.cli.verdict", ["{folder}"], None),
])
def test_every_side_command_chooses_its_threads_as_a_run_does(command, argv, early_check, tmp_path, monkeypatch):
    """pe-report, pe-bench, pe-extrapolate, pe-verdict took torch's default (every core) whatever the load. Each asks
    ``use_idle_cores`` once its input has passed the checks made before torch loads (``early_check``, here waved
    through: an empty folder is refused there, in a second)."""
    import importlib

    import pe_geometry.training.threads as threads

    def chosen():
        raise ThreadsChosen

    monkeypatch.setattr(threads, "use_idle_cores", chosen)
    if early_check:
        # the module as sys.modules holds it (a test that re-imports modules leaves the package's attribute on an older
        # copy, which a dotted-string target would patch instead)
        module_name, _, name = early_check.rpartition(".")
        monkeypatch.setattr(importlib.import_module(module_name), name, lambda *args: [])
    main = importlib.import_module(command).main
    with pytest.raises(ThreadsChosen):
        main([a.format(folder=tmp_path) for a in argv])


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


def test_our_own_threads_keeping_every_core_busy_is_no_reason_to_shed_one(tmp_path):
    """The machine is 100% busy, all of it ours (2 threads on 2 cores): others hold 0, the count stays at 2."""
    machine = FakeMachine(tmp_path)
    follower, set_to = follower_on(machine, threads=2)
    follower.start()
    for step in (50, 100, 150):
        machine.second(others=0, ours=2)
        follower.look(step)
    assert set_to == [] and follower.threads == 2


# ------------------------------------------------------------------ the callback (callbacks.threads)

class FakeTrainer:
    world_size = 1
    global_step = 0


def callback_on(machine, monkeypatch, set_to, every_seconds=10.0):
    """The callback of the default config, on ``machine``, its wall clock set by hand (``callback.now``)."""
    from pe_geometry.training import thread_follower, threads

    made_by = threads.ThreadFollower

    def follower(now, most):
        made = made_by(now, most, stat=machine.stat, set_threads=set_to.append, cores=2,
                                      clock=lambda: machine.own)
        made.ticks = 100
        look = made.look
        made.look = lambda step: callback.looks.append(step) or look(step)  # (the steps it looked at)
        return made

    monkeypatch.setattr(threads, "ThreadFollower", follower)
    monkeypatch.setattr(threads, "torch_default_threads", lambda: 2)
    monkeypatch.setattr(thread_follower.ThreadCountFollower, "why_not", staticmethod(lambda trainer: None))
    callback = thread_follower.ThreadCountFollower(every_seconds=every_seconds)
    callback.now, callback.looks = 0.0, []
    callback.clock = lambda: callback.now
    return callback


def test_the_callback_looks_every_few_seconds_and_logs_each_change(tmp_path, monkeypatch, caplog):
    """Started on 1 thread beside a process that has ended: looks at 10 s and 20 s (none at 15 s) agree on 2."""
    import logging

    import torch

    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # the count the run started with
    machine, set_to = FakeMachine(tmp_path), []
    callback = callback_on(machine, monkeypatch, set_to)
    trainer = FakeTrainer()
    callback.on_train_start(trainer, None)
    with caplog.at_level(logging.INFO, logger="pe_geometry.training.threads"):
        for now, step in ((5, 10), (10, 20), (15, 30), (20, 40)):
            machine.second(others=0, ours=1)
            callback.now, trainer.global_step = now, step
            callback.on_train_batch_end(trainer, None, None, None, 0)
    assert callback.looks == [20, 40] and set_to == [2]
    assert [r.getMessage() for r in caplog.records] == ["threads: 1 -> 2 at step 40 (other processes held ~0.0 of 2 cores)"]


def test_the_callback_keeps_the_count_where_it_was_given_under_ddp_or_without_proc_stat(monkeypatch):
    from pe_geometry.training import thread_follower, threads

    for variable in threads.THREAD_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(threads, "cpu_times", lambda *stat: (0, 0))
    follows = thread_follower.ThreadCountFollower.why_not
    assert follows(FakeTrainer()) is None
    monkeypatch.setenv("MKL_NUM_THREADS", "3")
    assert follows(FakeTrainer()) == "MKL_NUM_THREADS=3 fixes it"
    monkeypatch.delenv("MKL_NUM_THREADS")
    ddp = FakeTrainer()
    ddp.world_size = 2
    assert "DDP" in follows(ddp)
    monkeypatch.setattr(threads, "cpu_times", lambda *stat: None)
    assert "unknown" in follows(FakeTrainer())

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the callback then makes no follower and its batch hook does nothing
    callback = thread_follower.ThreadCountFollower()
    callback.on_train_start(FakeTrainer(), None)
    callback.on_train_batch_end(FakeTrainer(), None, None, None, 0)
    assert callback.follower is None


def test_the_callbacks_settings_refuse_a_look_interval_of_zero():
    from pe_geometry.settings import SettingsError
    from pe_geometry.training.thread_follower import ThreadCountFollower

    assert ThreadCountFollower().every_seconds == 10.0
    with pytest.raises(SettingsError, match=r"callbacks\.threads\.every_seconds=0"):
        ThreadCountFollower(every_seconds=0)


def test_a_fit_on_an_idle_machine_is_unchanged_by_the_follower(tmp_path, monkeypatch):
    """A look every batch on a machine only this run uses (on 2 threads, as a run starts on an idle 2-core machine):
    no count changes, and the losses are those of the same fit without the callback, bit for bit (it takes no random
    numbers, touches no weights)."""
    import lightning as L
    import torch

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)
            self.losses = []

        def training_step(self, batch, batch_idx):
            x = torch.randn(16, 8)  # the RNG: a callback drawing from it would change every later loss
            loss = ((self.layer(x) - x.sum(1, keepdim=True)) ** 2).mean()
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(range(12), batch_size=1)

    def fit(callbacks):
        torch.manual_seed(0)
        model = Tiny()
        L.Trainer(max_steps=12, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, callbacks=callbacks, default_root_dir=tmp_path).fit(model)
        return model.losses

    machine, set_to = FakeMachine(tmp_path), []
    callback = callback_on(machine, monkeypatch, set_to, every_seconds=1.0)
    ticking = callback.clock

    def clock():  # each batch end one more second, both cores busy with this run's two threads alone
        callback.now += 1
        machine.second(others=0, ours=2)
        return ticking()

    callback.clock = clock
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with_follower = fit([callback])
        without = fit([])
    finally:
        torch.set_num_threads(before)
    assert callback.looks == list(range(1, 13))  # a look at every step
    assert callback.follower.changes == [] and set_to == [] and callback.follower.threads == 2
    assert with_follower == without and len(without) == 12


def test_pe_generate_chooses_its_threads_as_a_run_does(tmp_path, monkeypatch):
    """pe-generate (a Hydra command, not in the list above) asks before it loads the run (here a missing one)."""
    from omegaconf import OmegaConf

    import pe_geometry.training.threads as threads
    from pe_geometry.cli.generate import run
    from pe_geometry.configs import CONFIG_DIR

    def chosen():
        raise ThreadsChosen

    cfg = OmegaConf.load(CONFIG_DIR / "generate.yaml")
    del cfg["defaults"], cfg["hydra"]
    cfg.merge_with({"ckpt_path": str(tmp_path / "missing" / "last.ckpt")})
    monkeypatch.setattr(threads, "use_idle_cores", chosen)
    with pytest.raises(ThreadsChosen):
        run(cfg)


def test_the_pipeline_and_the_follower_share_torchs_default():
    """The pipeline kept its own cached copy: the follower's first read came after the pipeline had set the count, so
    its ceiling was the starting count and a run started on 1 thread could never take a freed core."""
    from pe_geometry.training import pipeline, threads

    assert pipeline.torch_default_threads is threads.torch_default_threads
