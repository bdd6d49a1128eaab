"""A warm ``shortcutlab`` for the tests that run the user guide's command lines: one server process
imports the CLI (torch, Lightning, every model and callback: some 7 s) once, then forks a child
per command that runs ``cli.console_main`` with the command's arguments, folder, environment and
standard streams, exactly as the console script would, and answers its exit status.

    python tests/helpers/fork_server.py serve SOCKET            # the server (ForkServer starts it)
    python tests/helpers/fork_server.py SOCKET shortcutlab ...  # one command through it (the client)

Each command runs in a fresh fork of the same warm process, so nothing one command does reaches
the next. Commands run one at a time (the user guide's blocks run in order).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Optional

IDLE_EXIT_S = 900


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
    server.listen()
    server.settimeout(IDLE_EXIT_S)  # left behind by a killed test: it goes by itself
    print("ready", flush=True)
    while True:
        try:
            connection, _ = server.accept()
        except TimeoutError:
            return
        connection.settimeout(None)
        message, fds, _, _ = socket.recv_fds(connection, 1 << 16, 3)
        while not message.endswith(b"\n"):
            message += connection.recv(1 << 16)
        sys.stdout.flush()
        sys.stderr.flush()
        child = os.fork()
        if child == 0:
            server.close()
            connection.close()
            _run_child(json.loads(message), fds)
        for fd in fds:
            os.close(fd)
        _, status = os.waitpid(child, 0)
        connection.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
        connection.close()


def client(path: str, argv: list[str]) -> int:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(path)
    request = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}) + "\n"
    socket.send_fds(connection, [request.encode()], [0, 1, 2])
    answer = b""
    while not answer.endswith(b"\n"):
        chunk = connection.recv(64)
        if not chunk:
            return 1  # the server went away
        answer += chunk
    return int(answer)


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
        self.log.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def command(self) -> str:
        return f"{sys.executable} {__file__} {self.path} shortcutlab"


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        sys.exit(client(sys.argv[1], sys.argv[2:]))
