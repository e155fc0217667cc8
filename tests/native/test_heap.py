"""The CPU worker's heap settings (``native/heap.py``): in force on glibc, idempotent, left alone
with ``NINFER_HEAP=default``; a CPU Worker applies them when it starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHECK = ("from ninfer.native import heap; a = heap.keep_freed_memory(); b = heap.keep_freed_memory(); "
         "print(a, b)")


def _run(env: dict) -> str:
    r = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=60,
                       env={**os.environ, **env})
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux") or not os.confstr("CS_GNU_LIBC_VERSION"),
                    reason="glibc only")
def test_the_settings_hold_on_glibc_and_once():
    assert _run({"NINFER_HEAP": ""}) == "True True"


def test_default_leaves_the_heap_alone():
    assert _run({"NINFER_HEAP": "default"}) == "False False"


def test_a_cpu_worker_applies_them(tiny_model, monkeypatch):
    from ninfer.actors import worker as W
    from ninfer.config import EngineConfig
    calls = []
    monkeypatch.setattr(W, "keep_freed_memory", lambda: calls.append(1) or True)
    w = W.Worker(tiny_model, EngineConfig(max_concurrency=1, max_context=128, cost_calibration=False))
    try:
        assert calls == [1]
    finally:
        w.shutdown()
