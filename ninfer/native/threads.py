"""Torch's intra-op thread count for the calling thread, made to stick.

``torch.set_num_threads`` sets a process-wide count and the calling thread's OpenMP count; a
thread that has not yet run a parallel op adopts the process-wide count *at its first parallel
op* (ATen's lazy per-thread init). So when two threads set different counts — the control
thread ``cpu_threads`` for the forward, the copy thread 1 for its copies — whichever sets last
decides the count of any thread that had not yet run an op: the forward ran on one thread with
``cpu_threads = 2`` (measured: ``torch.get_num_threads()`` in the control thread read 1 after
the copy thread started). ``pin`` sets the count, forces this thread's lazy init and sets it
again, so a later ``set_num_threads`` elsewhere changes only the process-wide default.

A thread that ran a parallel op on n > 1 threads keeps its OpenMP team (n - 1 pool threads,
asleep) until it exits. libgomp counts every team's threads, and once they exceed the cores it
stops spinning between parallel regions: the forward's workers then sleep and are woken for
each of its thousands of ops (measured on 2 cores, a 2-thread forward on a thread of its own:
13.6k tokens/s alone, 4.3k with a 2-thread team left on the main thread). So heavy work that
must run at the forward's count but off the forward's thread (building the model, calibrating)
runs ``on_own_thread``, whose team goes with it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def pin(n: int) -> int:
    """Fix this thread's torch intra-op threads at ``n``; returns the count now in force here."""
    torch.set_num_threads(n)
    torch.get_num_threads()           # this thread's lazy init: adopts the process-wide count now
    torch.set_num_threads(n)          # in case another thread set it in between
    return torch.get_num_threads()


def on_own_thread(fn: Callable[[], T], n: int, name: str) -> T:
    """``fn()`` on a new thread pinned at ``n`` torch threads, joined; its result, or its exception
    raised here. The thread's OpenMP team ends with it."""
    box: dict = {}

    def run() -> None:
        pin(n)
        try:
            box["value"] = fn()
        except BaseException as exc:          # noqa: BLE001 - raised again on the caller's thread
            box["error"] = exc

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
