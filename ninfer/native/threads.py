"""Torch's intra-op thread count for the calling thread, made to stick.

``torch.set_num_threads`` sets a process-wide count and the calling thread's OpenMP count; a
thread that has not yet run a parallel op adopts the process-wide count *at its first parallel
op* (ATen's lazy per-thread init). So when two threads set different counts — the control
thread ``cpu_threads`` for the forward, the copy thread 1 for its copies — whichever sets last
decides the count of any thread that had not yet run an op: the forward ran on one thread with
``cpu_threads = 2`` (measured: ``torch.get_num_threads()`` in the control thread read 1 after
the copy thread started). ``pin`` sets the count, forces this thread's lazy init and sets it
again, so a later ``set_num_threads`` elsewhere changes only the process-wide default.
"""

from __future__ import annotations

import torch


def pin(n: int) -> int:
    """Fix this thread's torch intra-op threads at ``n``; returns the count now in force here."""
    torch.set_num_threads(n)
    torch.get_num_threads()           # this thread's lazy init: adopts the process-wide count now
    torch.set_num_threads(n)          # in case another thread set it in between
    return torch.get_num_threads()
