"""A warm `python -m harness` for the tests: the real CLI in a real process, forked from one that has imported MLflow.

Most of a harness command's CPU time in this suite was importing MLflow, SQLAlchemy and Alembic (about 1.6 s of a
core, several hundred times a session). Each test worker starts one server (this file, run as a script) that imports
them once; `run()` asks it for a command: the server forks a handler, the handler forks the command's process, which
takes the caller's pipes as its stdout and stderr, /dev/null as stdin, the caller's working folder and environment,
and runs `harness/__main__.py` as `python -m harness` does (runpy, so click names the program as it would); the
handler waits for it and sends back its pid and then its exit status. What stays different from a fresh interpreter,
and why it does not matter here: the interpreter was started with the worker's PYTHON* variables (a call that
changes one of them, PYTHONPATH say, gets a real subprocess instead), and the hash seed is shared by all commands.
Signals, process groups and terminals are the real subprocess's business: `Project.popen` keeps using one.

HARNESS_TEST_WARM_CLI=0 turns it off (every command a fresh `python -m harness`).
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

_PRELOAD = ("mlflow", "mlflow.tracking", "mlflow.store.tracking.sqlalchemy_store", "mlflow.store.db.utils",
            "mlflow.store.tracking.rest_store", "alembic.command", "alembic.runtime.migration", "alembic.script",
            "sqlalchemy.dialects.sqlite", "click")


# --- the server (this file run as a script) ------------------------------------------------------------------------

def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise EOFError("the caller went away")
        data += chunk
    return data


def _command(request: dict, out_fd: int, err_fd: int) -> None:
    """In the command's own process: become `python -m harness ARGS` in the caller's folder and environment."""
    import runpy

    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.close(out_fd)
    os.close(err_fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as Python sets it up at start
    sys.path[0] = request["cwd"]  # `python -m`: the working folder first
    sys.argv = ["-m", *request["args"]]
    code = 0
    try:
        runpy.run_module("harness", run_name="__main__", alter_sys=True)
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        if not isinstance(done.code, (int, type(None))):
            print(done.code, file=sys.stderr)
    except BaseException:  # noqa: B036 - printed as the interpreter would
        import traceback

        traceback.print_exc()
        code = 1
    # What the interpreter does on its way out: wait for threads, run the exit handlers, flush.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _handle(conn: socket.socket) -> None:
    (size,) = struct.unpack("!I", _recv_exact(conn, 4))
    message, fds, _, _ = socket.recv_fds(conn, size, 2)
    message += _recv_exact(conn, size - len(message))
    request = json.loads(message)
    out_fd, err_fd = fds
    pid = os.fork()
    if pid == 0:
        conn.close()
        _command(request, out_fd, err_fd)
    os.close(out_fd)
    os.close(err_fd)
    conn.sendall(f"{pid}\n".encode())
    _, status = os.waitpid(pid, 0)
    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())


def serve(path: str) -> None:
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: dies with its worker
    for name in _PRELOAD:
        __import__(name)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # handlers are reaped by the kernel
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        if os.fork() == 0:
            server.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                _handle(conn)
            finally:
                os._exit(0)
        conn.close()


# --- the client (imported by tests/conftest.py) --------------------------------------------------------------------

_lock = threading.Lock()
_server: tuple[subprocess.Popen, str, dict[str, str]] | None = None


def enabled() -> bool:
    return os.environ.get("HARNESS_TEST_WARM_CLI", "1") != "0"


def _python_vars(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith("PYTHON") and k != "PYTHONUNBUFFERED"}


def _start() -> tuple[subprocess.Popen, str, dict[str, str]]:
    global _server
    with _lock:
        if _server is not None and _server[0].poll() is None:
            return _server
        folder = tempfile.mkdtemp(prefix="harness-warmcli-", dir="/tmp")  # short: an AF_UNIX path
        path = os.path.join(folder, "sock")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen([sys.executable, __file__, path], env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line.strip() != "ready":
            proc.kill()
            raise RuntimeError(f"the warm CLI server did not start (it said {line!r})")
        _server = (proc, path, _python_vars(env))
        atexit.register(_stop, proc, folder)
        return _server


def _stop(proc: subprocess.Popen, folder: str) -> None:
    proc.kill()
    proc.wait()
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(folder, "sock"))
        os.rmdir(folder)


def usable(env: dict[str, str]) -> bool:
    """Whether a command in `env` can be forked from the server: its interpreter-level variables are the server's."""
    if not enabled():
        return False
    return _python_vars({**env, "PYTHONUNBUFFERED": "1"}) == _python_vars({**os.environ})


def _text(data: bytes) -> str:
    """As subprocess's text mode reads it: the locale's encoding, universal newlines."""
    return io.TextIOWrapper(io.BytesIO(data)).read()


def run(args: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `python -m harness ARGS` run in `cwd` with `env`; subprocess.TimeoutExpired
    after `timeout` seconds (the command is killed first), as subprocess.run raises it."""
    if not Path(cwd).is_dir():
        raise FileNotFoundError(f"no such folder: {cwd}")
    _, path, _ = _start()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        message = json.dumps({"args": args, "cwd": str(cwd), "env": env}).encode()
        conn.sendall(struct.pack("!I", len(message)))
        socket.send_fds(conn, [message], [out_w, err_w])
        os.close(out_w)
        os.close(err_w)
        out_w = err_w = -1
        reader = conn.makefile("rb")
        pid = int(reader.readline())
        chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}

        def drain(fd: int) -> None:
            while block := os.read(fd, 65536):
                chunks[fd].append(block)

        threads = [threading.Thread(target=drain, args=(fd,), daemon=True) for fd in (out_r, err_r)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in threads):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            raise subprocess.TimeoutExpired([sys.executable, "-m", "harness", *args], timeout)
        status = reader.readline()
        code = int(status) if status.strip() else -signal.SIGKILL
        return code, _text(b"".join(chunks[out_r])), _text(b"".join(chunks[err_r]))
    finally:
        for fd in (out_w, err_w):
            if fd >= 0:
                os.close(fd)
        with contextlib.suppress(OSError):
            os.close(out_r)
        with contextlib.suppress(OSError):
            os.close(err_r)
        conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
