"""Run ``serve`` as a child process on loopback, as scripts and tests do: a free port, waiting
until ``/health`` answers, and stopping the processes again."""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 300.0, poll_s: float = 1.0) -> None:
    """Return once ``url``/health answers 200; raise ``RuntimeError`` if ``proc`` exits first or
    ``timeout_s`` passes (loading and warming up the bundled models takes minutes)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(poll_s)
    raise RuntimeError(f"{url} not ready after {timeout_s:.0f} s")


def stop(procs: list[subprocess.Popen], timeout_s: float = 30.0) -> None:
    """Terminate every process still running, then kill those that do not exit in ``timeout_s``."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()


@contextmanager
def serving(command: str, timeout_s: float = 900.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start ``command`` (a ``serve`` command line) on a free loopback port, wait until it is
    healthy, and yield (its URL, its process); stop it on the way out."""
    port = free_port()
    proc = subprocess.Popen([*shlex.split(command), "--port", str(port)])
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, timeout_s=timeout_s, poll_s=2.0)
        yield url, proc
    finally:
        stop([proc])


@contextmanager
def serving_drafts(target: str, drafts: dict[str, str], serve_args: Sequence[str] = (), timeout_s: float = 900.0):
    """``serve`` over an untrained router naming ``drafts`` (name -> model reference) for ``target``,
    as the checks that force each request's drafter use it (the router's choices are never asked):
    yields (an ``openai.OpenAI`` client of it, the served model's name)."""
    import openai

    from routing.router import Router

    with tempfile.TemporaryDirectory() as tmp:
        router = Path(tmp) / "router.pt"
        Router.create(dict(drafts), target).save(router)
        command = " ".join([sys.executable, "-m", "serving.server.cli_serve", "--router", str(router), *serve_args])
        with serving(command) as (url, _):
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=timeout_s)
            yield client, client.models.list().data[0].id
