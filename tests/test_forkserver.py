"""tests/forkserver.py: a forked command behaves as the subprocess it replaces (output, exit status, signals,
sessions, timeouts, a crash), and a command whose import-time environment differs is not forked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests import forkserver

pytestmark = pytest.mark.slow  # starts a server (torch and Lightning imported once) and forks from it

SCRIPT = textwrap.dedent("""
    import os, sys, time
    what = sys.argv[1]
    if what == "echo":
        print("argv", sys.argv[1:], "cwd", os.path.basename(os.getcwd()), "env", os.environ.get("PROBE"))
        print("to stderr", file=sys.stderr)
        sys.exit(3)
    if what == "crash":
        raise ValueError("boom")
    if what == "stream":
        print("started", flush=True)
        time.sleep(60)
    if what == "sid":
        print(os.getsid(0) == os.getpid(), flush=True)
""")


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.setattr(forkserver, "ENABLED", True)
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    return path


def test_a_forked_command_gives_what_the_subprocess_gives(script, tmp_path):
    cmd = [sys.executable, str(script), "echo", "x"]
    env = {**os.environ, "PROBE": "42"}
    assert forkserver.forkable(cmd, env)
    forked = forkserver.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    plain = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert (forked.returncode, forked.stdout, forked.stderr) == (plain.returncode, plain.stdout, plain.stderr) == (
        3, f"argv ['echo', 'x'] cwd {tmp_path.name} env 42\n", "to stderr\n")


def test_a_crash_is_exit_status_1_with_its_traceback(script, tmp_path):
    done = forkserver.run([sys.executable, str(script), "crash"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "ValueError: boom" in done.stderr and "Traceback" in done.stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL, signal.SIGINT])
def test_a_forked_process_is_a_real_process_that_a_signal_ends(script, tmp_path, signum):
    proc = forkserver.Popen([sys.executable, str(script), "stream"], cwd=tmp_path, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert isinstance(proc, forkserver.Popen) and proc.stdout.readline() == "started\n" and proc.poll() is None
    os.kill(proc.pid, signum)
    expected = 1 if signum == signal.SIGINT else -signum  # SIGINT: Python's KeyboardInterrupt, as a fresh interpreter
    assert proc.wait(timeout=60) == expected
    proc.stdout.close()


def test_start_new_session_gives_the_process_its_own_session(script, tmp_path):
    done = forkserver.run([sys.executable, str(script), "sid"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          start_new_session=True)
    assert done.stdout == "True\n"
    same = forkserver.run([sys.executable, str(script), "sid"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert same.stdout == "False\n"


def test_a_timeout_kills_the_process(script, tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        forkserver.run([sys.executable, str(script), "stream"], cwd=tmp_path, capture_output=True, text=True, timeout=3)


def test_another_import_time_environment_gets_a_fresh_interpreter(script):
    cmd = [sys.executable, str(script), "echo"]
    assert not forkserver.forkable(cmd, {**os.environ, "OMP_NUM_THREADS": "2"})
    assert not forkserver.forkable([sys.executable, "-c", "pass"], None)
    fresh = forkserver.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "2"}, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    assert type(fresh) is subprocess.Popen and fresh.wait(timeout=60) == 3
