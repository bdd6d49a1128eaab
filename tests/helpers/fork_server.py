"""A warm ``shortcutlab`` for the tests that run command lines: one server process imports the
CLI (torch, Lightning, every model and callback: some 8 s on a 2-core CPU) once, then forks a
child per command that runs ``cli.console_main`` with the command's arguments, folder,
environment and standard streams, exactly as the console script would.

    python tests/helpers/fork_server.py serve SOCKET            # the server (ForkServer starts it)
    python tests/helpers/fork_server.py SOCKET shortcutlab ...  # one command through it (the client)
    python tests/helpers/fork_server.py SOCKET python SCRIPT ...  # a script, as ``python SCRIPT ...``

The client stands for the command: it passes on the signals a test or a stand-in ``scontrol``
sends it (SIGINT, SIGTERM, SIGUSR1, SIGUSR2, SIGHUP) to the command's process and ends with its
exit status, or by its signal. Each command runs in a fresh fork of the same warm process, so
nothing one command does reaches the next; several run at once (the tasks of one SLURM job step).
What a fresh interpreter alone shows (import-time output, the installed console script, a package
that shadows the CLI's own) is tested with real processes.
"""
from __future__ import annotations

import json
import os
import runpy
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Optional

IDLE_EXIT_S = 900
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


def _run_child(request: dict, fds: list[int]) -> None:
    for number, fd in enumerate(fds):
        os.dup2(fd, number)
    for fd in fds:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # as a new interpreter would: the command's PYTHONPATH ahead of the installed packages
    sys.path[:0] = [os.path.abspath(p) for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.argv = request["argv"]
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    import cli

    code = 0
    try:
        if request["argv"][0] == "python":  # python SCRIPT ARGS: a torchrun worker (torchrun_workers)
            sys.argv = request["argv"][1:]
            sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
            runpy.run_path(sys.argv[0], run_name="__main__")
        else:
            cli.console_main()  # reads sys.argv, as the console script does
    except SystemExit as stop:
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: BLE001 (as the interpreter would: a traceback and status 1)
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve(path: str) -> None:
    import cli  # noqa: F401 (the warm-up: everything a command imports)
    import commands.lightning_cli  # noqa: F401
    from commands import _catalogue

    _catalogue.import_all()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    waiting = selectors.DefaultSelector()
    waiting.register(server, selectors.EVENT_READ)
    running: dict[int, socket.socket] = {}  # child pid -> its client's connection
    print("ready", flush=True)
    idle_since = time.monotonic()
    while running or time.monotonic() - idle_since < IDLE_EXIT_S:  # left behind by a killed test: it goes by itself
        if waiting.select(timeout=0.05):
            connection, _ = server.accept()
            message, fds, _, _ = socket.recv_fds(connection, 1 << 16, 3)
            while not message.endswith(b"\n"):
                message += connection.recv(1 << 16)
            sys.stdout.flush()
            sys.stderr.flush()
            child = os.fork()
            if child == 0:
                server.close()
                for other in (connection, *running.values()):
                    other.close()
                _run_child(json.loads(message), fds)
            for fd in fds:
                os.close(fd)
            connection.sendall(f"pid {child}\n".encode())
            running[child] = connection
        while running:
            child, status = os.waitpid(-1, os.WNOHANG)
            if child == 0:
                break
            connection = running.pop(child)
            try:
                connection.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass  # its client was killed
            connection.close()
            idle_since = time.monotonic()


def _lines(connection: socket.socket):
    """The server's answers, one line at a time."""
    pending = b""
    while True:
        while b"\n" not in pending:
            chunk = connection.recv(64)
            if not chunk:
                return
            pending += chunk
        line, _, pending = pending.partition(b"\n")
        yield line.decode()


def client(path: str, argv: list[str]) -> int:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(path)
    request = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}) + "\n"
    for signum in FORWARDED:  # held until the command's pid is known, then passed on
        signal.pthread_sigmask(signal.SIG_BLOCK, [signum])
    socket.send_fds(connection, [request.encode()], [0, 1, 2])
    answers = _lines(connection)
    pid = int(next(answers, "pid 0").split()[1])
    if not pid:
        return 1  # the server went away
    for signum in FORWARDED:
        signal.signal(signum, lambda received, _frame: os.kill(pid, received))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
    code = next(answers, "exit 1").split()[1]
    code = int(code)
    if code < 0:  # ended by a signal: end the same way
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def torchrun_workers(command: list[str], shortcutlab: list[str]) -> list[str]:
    """A ``torch.distributed.run`` command line whose workers are warm forks running its script
    (``--no-python`` and this client before the script; ``shortcutlab``: :meth:`ForkServer.argv`)."""
    at = next(i for i, word in enumerate(command) if word.endswith(".py"))
    return [*command[:at], "--no-python", *shortcutlab[:-1], "python", *command[at:]]


class ForkServer:
    """The server as a context manager; :meth:`command` is the command line that runs
    ``shortcutlab ARGS...`` through it."""

    def __init__(self, env: dict[str, str]) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="sl"))  # a socket's path is at most 107 bytes
        self.path = str(self.folder / "cli.sock")
        self.env = env
        self.process: Optional[subprocess.Popen] = None

    def __enter__(self) -> "ForkServer":
        # its own output in a file: a server left behind holds none of the test run's streams
        self.log = open(self.folder / "server.log", "w")
        self.process = subprocess.Popen([sys.executable, __file__, "serve", self.path], env=self.env,
                                        stdout=subprocess.PIPE, stderr=self.log, text=True)
        if self.process.stdout.readline().strip() != "ready":
            self.process.wait()
            raise RuntimeError("the shortcutlab fork server did not start: "
                               + (self.folder / "server.log").read_text()[-2000:])
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.kill()
        self.process.wait()
        self.process.stdout.close()
        self.log.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def argv(self) -> list[str]:
        return [sys.executable, __file__, self.path, "shortcutlab"]

    def command(self) -> str:
        return " ".join(self.argv())


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        sys.exit(client(sys.argv[1], sys.argv[2:]))
