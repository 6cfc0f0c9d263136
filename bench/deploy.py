"""The deployments of ``pdfabric bench compare``, and starting and stopping those it runs itself.

A deployment is either a running server's URL (``NAME=http://HOST:PORT``), which is left alone, or
a config file (``NAME=configs/x.toml``) or serve flags (``NAME=serve:FLAGS``), which become one
``pdfabric serve`` process on loopback, in a process group of its own (its workers join that
group). A started deployment's life:

1. starting: ``python -m pdfabric.cli serve ... --host 127.0.0.1 --port 0``; stdout and stderr go to
   a log file and a reader thread that keeps the last lines and watches for the ready line;
2. ready: the ready line (``pdfabric: serving 'MODEL' on http://HOST:PORT ...``) gave the URL and
   the served model name, and ``GET /health`` answered 200, both within the start-up timeout;
3. stopped: SIGTERM, and after a grace period SIGKILL to the whole group, whatever ended the run
   (the workload finished, an error, Ctrl-C, or SIGTERM to the bench itself).

A server that exits or does not become ready in time raises ``DeployError`` with its last log lines.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdfabric.bench.client import ClientConfig

READY_LINE = re.compile(r"pdfabric: serving '(?P<model>.*)' on (?P<url>https?://\S+)")
SERVE_PREFIX = "serve:"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
TAIL_LINES = 40


class DeployError(RuntimeError):
    """A deployment could not be started (the message carries the server's last log lines)."""


@dataclass(frozen=True)
class ServerSpec:
    """How to start one pdfabric deployment: a config file and/or extra ``pdfabric serve`` flags."""

    config: str | None = None
    flags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.config is None and not self.flags:
            raise ValueError("a started deployment needs a config file or serve flags")

    @classmethod
    def parse(cls, target: str) -> ServerSpec:
        """``serve:FLAGS`` or a path to a ``.toml`` config; the config is read now to fail early."""
        if target.startswith(SERVE_PREFIX):
            flags = tuple(shlex.split(target[len(SERVE_PREFIX):]))
            if not flags:
                raise ValueError(f"{target!r}: give the pdfabric serve flags after 'serve:'")
            return cls(flags=flags)
        from pdfabric.config import load_serve_config

        if not target.endswith(".toml"):
            raise ValueError(f"{target!r} is neither a URL (http://...), a .toml config nor serve:FLAGS")
        try:
            load_serve_config(target, {})
        except OSError as exc:
            raise ValueError(f"cannot read deployment config {target}: {exc.strerror or exc}") from exc
        except ValueError as exc:
            raise ValueError(f"bad deployment config {target}: {exc}") from exc
        return cls(config=target)

    def command(self) -> list[str]:
        """The ``pdfabric serve`` command line; flags after ``--host/--port`` override them."""
        cmd = [sys.executable, "-m", "pdfabric.cli", "serve"]
        if self.config is not None:
            cmd += ["--config", self.config]
        return cmd + ["--host", "127.0.0.1", "--port", "0", *self.flags]

    def describe(self) -> dict[str, Any]:
        return {"config": self.config, "flags": list(self.flags)}


@dataclass(frozen=True)
class Server:
    """A running deployment: where it serves, what model name it announced, and its process group."""

    url: str
    model: str
    pid: int
    command: tuple[str, ...]
    log_path: Path
    startup_s: float

    def describe(self) -> dict[str, Any]:
        return {"url": self.url, "served_model": self.model, "pid": self.pid, "command": list(self.command),
                "log": str(self.log_path), "startup_s": round(self.startup_s, 2)}


@dataclass(frozen=True)
class Deployment:
    """One entry of the comparison: a running server's ``url``, or a ``server`` that compare starts."""

    name: str
    url: str | None = None
    server: ServerSpec | None = None
    model: str | None = None  # None: --model, or the name a started server announces

    def describe(self) -> dict[str, Any]:
        if self.server is None:
            return {"kind": "url", "url": self.url}
        return {"kind": "started", **self.server.describe()}


def parse_deployments(specs: list[str], models: list[str], default_model: str | None) -> list[Deployment]:
    """The deployments named by the flags; raises ``ValueError`` on a bad entry (config files are read
    here, so that a typo fails before any deployment has run)."""
    out: list[Deployment] = []
    model_of: dict[str, str] = {}
    for spec in models:
        name, sep, model = spec.partition("=")
        if not sep or not model:
            raise ValueError(f"--deployment-model must be NAME=MODEL, got {spec!r}")
        model_of[name] = model
    for spec in specs:
        name, sep, target = spec.partition("=")
        if not sep or not _NAME.match(name) or not target:
            raise ValueError(f"--deployment must be NAME=URL, NAME=CONFIG.toml or NAME=serve:FLAGS with a "
                             f"plain name, got {spec!r}")
        if any(name == d.name for d in out):
            raise ValueError(f"deployment name {name!r} is given twice")
        model = model_of.pop(name, None)
        if target.startswith(("http://", "https://")):
            if model is None and default_model is None:
                raise ValueError(f"--deployment {name}={target}: give --model or "
                                 f"--deployment-model {name}=MODEL")
            out.append(Deployment(name, url=target.rstrip("/"), model=model or default_model))
        else:
            try:
                server = ServerSpec.parse(target)
            except ValueError as exc:
                raise ValueError(f"--deployment {name}: {exc}") from exc
            out.append(Deployment(name, server=server, model=model))
    if model_of:
        raise ValueError(f"--deployment-model names unknown deployments: {sorted(model_of)}")
    return out


class _LogReader(threading.Thread):
    """Copies the server's output to its log file, keeps the last lines, and spots the ready line."""

    def __init__(self, stream: IO[bytes], log_path: Path) -> None:
        super().__init__(daemon=True, name="pdfabric-bench-server-log")
        self.stream = stream
        self.log_path = log_path
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.ready: re.Match[str] | None = None
        self.ready_event = threading.Event()

    def run(self) -> None:
        with self.log_path.open("w", encoding="utf-8") as log:
            for raw in self.stream:
                line = raw.decode("utf-8", "replace").rstrip("\n")
                log.write(line + "\n")
                log.flush()
                self.tail.append(line)
                if self.ready is None and (m := READY_LINE.search(line)):
                    self.ready = m
                    self.ready_event.set()

    def last_lines(self) -> str:
        return "\n".join(f"  | {line}" for line in list(self.tail)) or "  | (no output)"


@contextlib.contextmanager
def started(spec: ServerSpec, log_path: Path, timeout_s: float = 180.0,
            grace_s: float = 15.0) -> Iterator[Server]:
    """Start ``spec``, wait until it serves, yield it, and always stop its whole process group."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = spec.command()
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    assert proc.stdout is not None  # stdout=PIPE
    reader = _LogReader(proc.stdout, log_path)
    reader.start()
    try:
        with _sigterm_as_exit():
            url, model = _wait_ready(proc, reader, t0 + timeout_s, timeout_s)
            yield Server(url=url, model=model, pid=proc.pid, command=tuple(cmd), log_path=log_path,
                         startup_s=time.monotonic() - t0)
    finally:
        stop(proc, grace_s)
        reader.join(timeout=5)


@contextlib.contextmanager
def serving(target: str, log_dir: Path | None, log_name: str) -> Iterator[str]:
    """The base URL of ``target``: a running server's URL as given, or a deployment (``serve:FLAGS`` or a
    ``.toml`` config) started here for the ``with`` block, its log ``log_name`` in ``log_dir`` (None:
    the temporary directory)."""
    if target.startswith(("http://", "https://")):
        yield target.rstrip("/")
        return
    log = Path(log_dir if log_dir is not None else tempfile.gettempdir()) / log_name
    with started(ServerSpec.parse(target), log) as server:
        yield server.url


def _wait_ready(proc: subprocess.Popen[bytes], reader: _LogReader, deadline: float,
                timeout_s: float) -> tuple[str, str]:
    """Wait for the ready line and then for ``/health`` 200; ``(url, served model)``."""
    while True:
        if reader.ready is not None and _healthy(reader.ready["url"]):
            return reader.ready["url"].rstrip("/"), reader.ready["model"]
        code = proc.poll()
        if code is not None:
            reader.join(timeout=2)  # let it take in the last lines
            raise DeployError(f"pdfabric serve exited with code {code} during start-up "
                              f"(command: {shlex.join(proc.args)}); its last output:\n{reader.last_lines()}")
        if time.monotonic() > deadline:
            what = "did not answer /health" if reader.ready else "did not print its ready line"
            raise DeployError(f"pdfabric serve {what} within {timeout_s:g}s "
                              f"(command: {shlex.join(proc.args)}); its last output:\n{reader.last_lines()}")
        reader.ready_event.wait(0.1)


def save_health(url: str, path: Path) -> None:
    """Writes the server's ``/health`` answer (its workers, with the latency profiles they refined while
    serving) to ``path``, for comparing with simulations; best effort: a failure only warns."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=5.0) as r:
            path.write_bytes(r.read())
    except (OSError, urllib.error.URLError) as exc:
        print(f"warning: could not save {url}/health: {exc}", file=sys.stderr)


@contextlib.contextmanager
def client_for(
    args: argparse.Namespace, dep: Deployment, out: Path
) -> Iterator[tuple[ClientConfig, dict[str, Any]]]:
    """The client config for ``dep`` (from the bench's client flags) and what the report says about
    it; a started deployment runs for exactly as long as the ``with`` block, with its log in ``out``."""
    from pdfabric.bench.options import client_from_args

    if dep.server is None:
        assert dep.url is not None  # a deployment has a URL or a server
        yield client_from_args(args, dep.url, dep.model), dep.describe()
        return
    print(f"{dep.name}: starting pdfabric {shlex.join(dep.server.command()[3:])}", file=sys.stderr)
    with started(dep.server, out / "server.log", args.start_timeout, args.stop_grace) as server:
        print(f"{dep.name}: serving {server.model!r} on {server.url} after {server.startup_s:.1f}s",
              file=sys.stderr)
        yield client_from_args(args, server.url, dep.model or server.model), {
            **dep.describe(), **server.describe()}
        save_health(server.url, out / "health.json")
    print(f"{dep.name}: stopped", file=sys.stderr)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=2.0) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def stop(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM the server (it stops its workers), SIGKILL its group after ``grace_s``; then make sure
    nothing in the group survives. A Ctrl-C during the grace period skips to SIGKILL."""
    try:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                print(f"pdfabric serve (pid {proc.pid}) still running {grace_s:g}s after SIGTERM: killing it",
                      file=sys.stderr)
    finally:
        _kill_group(proc.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """While a deployment runs, SIGTERM to this process unwinds (so the server is stopped) instead of
    killing it outright. Only the main thread can install signal handlers; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
