"""A fork server for the slow tests' ``train.py`` processes: the imports a run pays before its first step (torch,
Lightning, Hydra, the package: about 5 CPU-s a process on these cores) are paid once per pytest worker, and each
process is a fork of a server that has them (a zygote, as Android starts its apps, or multiprocessing's forkserver).

``run`` and ``Popen`` take the arguments of ``subprocess.run`` / ``subprocess.Popen`` that the tests use. A command
of the form ``[sys.executable, <a .py script>, args...]`` whose environment agrees with the server's on what is read
at import (``AT_IMPORT``: threads, offline switches, ``PYTHONPATH``) is forked from the server; anything else, or
every command with ``PE_TEST_FORKSERVER=0``, goes to ``subprocess`` as it is. The tests about processes themselves
(process trees, a start's own time, Ctrl-C before training starts) call ``subprocess``. A forked process is a real
process: its own pid, which a test can signal, stop or kill; its own session with ``start_new_session``; its exit
status as a subprocess's (a signal: minus its number). Its parent is the server, which reaps it and reports the
status over the connection the client opened, so ``poll``/``wait`` read that connection.

What differs from a fresh interpreter: the modules the server imported are imported already (their import-time
state is the server's: hence ``AT_IMPORT``), and the process's start is not timed by the tests that time a start
(they keep ``subprocess``).

    python tests/forkserver.py SOCKET   # the server (started by the first ``run``/``Popen`` of a worker)
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ENABLED = os.environ.get("PE_TEST_FORKSERVER", "1") != "0"  # PE_TEST_FORKSERVER=0: every command a fresh interpreter
# Environment variables read when the preloaded modules are imported: a command that sets them otherwise than the
# server had them gets a fresh interpreter.
AT_IMPORT = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONPATH", "PYTHONHASHSEED", "HF_HUB_OFFLINE",
             "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "PYTHONWARNINGS", "PYTHONDONTWRITEBYTECODE")
PRELOAD = ("torch", "lightning.pytorch", "hydra", "omegaconf", "pe_geometry.training.pipeline", "pe_geometry.cli.train")


# -- the server --------------------------------------------------------------------------------------------------------
def serve(path: str) -> None:
    import importlib

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the worker's to handle (it kills what was forked)
    parent = os.getppid()

    def watch_parent() -> None:  # the server ends with the worker that started it, however that ended
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch_parent, daemon=True).start()
    for name in PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        request = json.loads(message.decode())
        pid = os.fork()
        if pid == 0:  # the child: becomes the command; its exit leaves through the interpreter's own path
            listener.close()
            conn.close()
            _become(request, fds)  # does not return
        for fd in fds:
            os.close(fd)
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        threading.Thread(target=_report, args=(conn, pid), daemon=True).start()


def _report(conn: socket.socket, pid: int) -> None:
    _, status = os.waitpid(pid, 0)
    try:
        conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
    except OSError:  # the client went away
        pass
    conn.close()


def _become(request: dict, fds: list[int]) -> None:
    import runpy

    if request["new_session"]:
        os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    for signum in (signal.SIGTERM, signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process's own streams, open until it exits)
    sys.stdout = open(1, "w", buffering=1 if unbuffered else -1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")  # noqa: SIM115
    script, *args = request["argv"][1:]
    sys.argv = [script, *args]
    sys.path[0] = str(Path(script).resolve().parent)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit:
        raise
    except BaseException:  # as the interpreter would: the traceback on stderr, exit status 1
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        raise SystemExit(1) from None
    raise SystemExit(0)


# -- the client --------------------------------------------------------------------------------------------------------
_server: dict = {}
_lock = threading.Lock()
_live: dict[int, bool] = {}  # pid -> in a session of its own, for every forked process not yet reported ended


def kill_all() -> None:
    """SIGKILL every forked process still running (its process group when it leads one): Ctrl-C's cleanup, as
    tests/conftest.py's ``pytest_keyboard_interrupt`` does for its own children."""
    for pid, own_session in list(_live.items()):
        try:
            os.killpg(pid, signal.SIGKILL) if own_session else os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _server_path() -> str:
    """The worker's server, started on first use with this process's environment; None if it would not start."""
    with _lock:
        if _server.get("pid") and _server["proc"].poll() is None:
            return _server["path"]
        folder = tempfile.mkdtemp(prefix="pe-forkserver-")
        path = os.path.join(folder, "socket")
        proc = subprocess.Popen([sys.executable, __file__, path], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PE_TEST_FORKSERVER": "0"})
        if proc.stdout.readline().strip() != "ready":
            proc.kill()
            _server["failed"] = True
            raise RuntimeError("the fork server did not start")
        _server.update(pid=proc.pid, proc=proc, path=path, env=dict(os.environ))
        atexit.register(proc.kill)
        return path


def forkable(args, env: dict | None) -> bool:
    if not ENABLED or not isinstance(args, (list, tuple)) or len(args) < 2:
        return False
    if str(args[0]) != sys.executable or not str(args[1]).endswith(".py"):
        return False
    env = dict(os.environ if env is None else env)
    if not all(env.get(key) == os.environ.get(key) for key in AT_IMPORT) or _server.get("failed"):
        return False
    try:
        _server_path()
    except RuntimeError:  # (its own error went to stderr) every command then gets a fresh interpreter
        return False
    return True


def _fd_for(spec, default: int) -> tuple[int, object]:
    """(the child's fd, the parent's end or None) for a stdin/stdout/stderr argument."""
    if spec is subprocess.PIPE:
        read, write = os.pipe()
        return (read, write) if default == 0 else (write, read)
    if spec is subprocess.DEVNULL:
        return os.open(os.devnull, os.O_RDWR), None
    if spec is None:
        return os.dup(default), None
    if spec is subprocess.STDOUT:
        return -1, None
    return os.dup(spec if isinstance(spec, int) else spec.fileno()), None


class Popen:
    """``subprocess.Popen``'s face over a forked process (``forkable``), or a ``subprocess.Popen`` itself."""

    def __new__(cls, args, *, env=None, **kwargs):
        if not forkable(args, env):
            return subprocess.Popen(args, env=env, **kwargs)
        return super().__new__(cls)

    def __init__(self, args, *, cwd=None, env=None, stdin=None, stdout=None, stderr=None, text=False,
                 start_new_session=False, universal_newlines=None) -> None:
        text = bool(text or universal_newlines)
        self.args, self.returncode = args, None
        child_in, parent_in = _fd_for(stdin, 0)
        child_out, parent_out = _fd_for(stdout, 1)
        child_err, parent_err = (os.dup(child_out), None) if stderr is subprocess.STDOUT else _fd_for(stderr, 2)
        request = {"argv": [str(a) for a in args], "cwd": str(cwd or os.getcwd()), "env": dict(os.environ if env is None else env),
                   "new_session": bool(start_new_session)}
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(_server_path())
        socket.send_fds(self._conn, [json.dumps(request).encode()], [child_in, child_out, child_err])
        for fd in (child_in, child_out, child_err):
            os.close(fd)
        self._buffer = b""
        self.pid = self._message()["pid"]
        _live[self.pid] = bool(start_new_session)
        mode = "" if text else "b"
        self.stdin = os.fdopen(parent_in, "w" + mode) if parent_in is not None else None
        self.stdout = os.fdopen(parent_out, "r" + mode) if parent_out is not None else None
        self.stderr = os.fdopen(parent_err, "r" + mode) if parent_err is not None else None

    def _message(self, timeout: float | None = None) -> dict | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                return None
            chunk = self._conn.recv(4096)
            if not chunk:
                raise RuntimeError(f"the fork server lost process {getattr(self, 'pid', '?')}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def poll(self) -> int | None:
        if self.returncode is None:
            message = self._message(timeout=0)
            if message is not None:
                self.returncode = message["returncode"]
                self._conn.close()
                _live.pop(self.pid, None)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            message = self._message(timeout)
            if message is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = message["returncode"]
            self._conn.close()
            _live.pop(self.pid, None)
        return self.returncode

    def communicate(self, input=None, timeout: float | None = None):
        if self.stdin is not None:
            if input:
                self.stdin.write(input)
            self.stdin.close()
        outputs: dict = {}

        def read(name: str, stream) -> None:
            outputs[name] = stream.read()
            stream.close()

        readers = [threading.Thread(target=read, args=(name, stream), daemon=True)
                   for name, stream in (("stdout", self.stdout), ("stderr", self.stderr)) if stream is not None]
        for reader in readers:
            reader.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return outputs.get("stdout"), outputs.get("stderr")

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for stream in (self.stdout, self.stderr, self.stdin):
            if stream is not None:
                stream.close()
        self.wait()


def run(args, *, input=None, capture_output: bool = False, timeout: float | None = None, check: bool = False,
        **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run`` over ``Popen`` above: a forkable command is forked from the server."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    if not forkable(args, kwargs.get("env")):
        return subprocess.run(args, input=input, timeout=timeout, check=check, **kwargs)
    proc = Popen(args, **kwargs)
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    done = subprocess.CompletedProcess(args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


if __name__ == "__main__":
    serve(sys.argv[1])
