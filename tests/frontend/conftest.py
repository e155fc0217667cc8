"""One `ninfer serve` (in-process transport, the tiny model, an API key) for every HTTP test of
this package, started on a free loopback port; and helpers to reach it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import pytest

KEY = "test-key"


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


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


@pytest.fixture(scope="session")
def served(tiny_model, tmp_path_factory):
    cfg = tmp_path_factory.mktemp("serve") / "engine.toml"
    cfg.write_text('max_concurrency = 2\nmax_context = 1024\ndtype = "float32"\n\n[context_cache]\n'
                   'host_capacity_bytes = 16777216\n')
    port = free_port()
    log = open(cfg.parent / "serve.log", "w+")          # a file, never an unread pipe that fills
    proc = subprocess.Popen([sys.executable, "-m", "ninfer.cli", "serve", "--model", tiny_model, "--config", str(cfg),
                             "--port", str(port), "--transport", "inproc", "--api-key", KEY,
                             "--served-model-name", "tiny", "--max-body-bytes", "2000000"],
                            stdout=log, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    proc.log = log
    base = f"http://127.0.0.1:{port}"
    wait_up(proc, base)
    yield SimpleNamespace(base=base, pid=proc.pid, model=tiny_model)
    proc.terminate()
    proc.wait(timeout=30)
    log.close()


@pytest.fixture
def server(served) -> str:
    return served.base


def scrape(server: str) -> dict:
    """/metrics parsed by prometheus_client's own parser: family name -> family."""
    from prometheus_client.parser import text_string_to_metric_families
    return {f.name: f for f in text_string_to_metric_families(httpx.get(f"{server}/metrics", timeout=30).text)}


def metric(server: str, sample: str, **labels) -> float:
    """The value of one sample (its exposed name, e.g. ``vllm:prefix_cache_hits_total``)."""
    for fam in scrape(server).values():
        for s in fam.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(sample)
