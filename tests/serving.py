"""`ninfer serve` in a child process for tests: a free loopback port, the log in a file (never
an unread pipe that fills and blocks the server), wait until /health answers, stop."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _output(proc: subprocess.Popen) -> str:
    log = getattr(proc, "log", None)
    if log is not None:
        log.seek(0)
        return log.read()
    return proc.stderr.read() if proc.stderr else ""


def wait_up(proc: subprocess.Popen, base: str) -> None:
    for _ in range(600):
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, _output(proc)
        time.sleep(0.1)
    raise AssertionError("ninfer serve did not come up")


@contextmanager
def serving(model: str, workdir: Path, config: str, *args: str, **popen):
    """``ninfer serve --transport inproc`` on ``model`` with the TOML ``config``; yields
    (base URL, process). ``popen``: more keywords for ``subprocess.Popen`` (``preexec_fn``)."""
    cfg = workdir / "engine.toml"
    cfg.write_text(config)
    port = free_port()
    log = open(workdir / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "ninfer.cli", "serve", "--model", model, "--config", str(cfg),
                             "--port", str(port), "--transport", "inproc", *args],
                            stdout=log, stderr=subprocess.STDOUT, text=True, env=dict(os.environ), **popen)
    proc.log = log
    base = f"http://127.0.0.1:{port}"
    try:
        wait_up(proc, base)
        yield base, proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
