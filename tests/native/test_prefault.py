"""The CPU Host backing's prefault (``native/memory.py`` ``Prefault``): pages are faulted in ahead
of the arena's high-water mark by ``margin`` bytes and no further, their contents are kept, and
the thread ends with its backing. Residency is read with ``mincore`` on a fresh anonymous
mapping (no page of it resident until something writes it)."""

from __future__ import annotations

import ctypes
import gc
import mmap
import sys
import time

import pytest
import torch

from ninfer.native.memory import Prefault

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise / mincore: Linux")

MIB = 1 << 20
PAGE = mmap.PAGESIZE


def _fresh(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return buf, torch.frombuffer(buf, dtype=torch.uint8)


def _resident(t: torch.Tensor, lo: int, hi: int) -> list[int]:
    """Per page of ``t[lo:hi]`` (page-aligned offsets): 1 where resident."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    n = (hi - lo) // PAGE
    vec = (ctypes.c_ubyte * n)()
    assert libc.mincore(t.data_ptr() + lo, hi - lo, vec) == 0, ctypes.get_errno()
    return [b & 1 for b in vec]


def _caught_up(p: Prefault, nbytes: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while p.faulted() < nbytes:
        assert time.monotonic() < deadline, f"prefault stuck at {p.faulted()} of {nbytes} bytes"
        time.sleep(0.005)


def _supported() -> bool:
    buf, t = _fresh(4 * PAGE)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    ok = libc.madvise(t.data_ptr(), 4 * PAGE, 23) == 0
    del t
    return ok


needs_populate = pytest.mark.skipif(not _supported(), reason="the kernel has no MADV_POPULATE_WRITE (< 5.14)")


@needs_populate
def test_pages_are_faulted_in_a_margin_ahead_of_the_high_water_mark():
    buf, t = _fresh(32 * MIB)
    p = Prefault(t, margin=8 * MIB)
    time.sleep(0.05)
    assert p.faulted() == 0 and not p.running()                     # nothing before the first allocation
    assert not any(_resident(t, 0, 32 * MIB))
    p.grew(64 << 10)
    _caught_up(p, 8 * MIB + (64 << 10))
    time.sleep(0.05)
    assert p.faulted() == 8 * MIB + (64 << 10)                      # a margin above the mark, no further
    assert all(_resident(t, 0, 8 * MIB))
    assert not any(_resident(t, 16 * MIB, 32 * MIB))
    p.grew(3 * MIB)                                                 # still half a margin ahead: nothing to do
    time.sleep(0.05)
    assert p.faulted() == 8 * MIB + (64 << 10)
    p.grew(12 * MIB)
    _caught_up(p, 20 * MIB)
    assert all(_resident(t, 0, 20 * MIB))
    assert not any(_resident(t, 24 * MIB, 32 * MIB))
    p.grew(31 * MIB)                                                # never past the capacity
    _caught_up(p, 32 * MIB)
    assert p.faulted() == 32 * MIB and all(_resident(t, 0, 32 * MIB))
    p.join(5)
    assert not p.running()                                          # everything faulted in: done


@needs_populate
def test_a_prefault_keeps_what_the_pages_hold():
    buf, t = _fresh(16 * MIB)
    p = Prefault(t, margin=2 * MIB)
    p.grew(1)
    _caught_up(p, 2 * MIB)
    t[5 * MIB: 5 * MIB + 4096] = 7                                  # written ahead of the prefault
    t[100] = 9                                                      # and below it
    p.grew(8 * MIB)
    _caught_up(p, 10 * MIB)
    assert bool((t[5 * MIB: 5 * MIB + 4096] == 7).all()) and int(t[100]) == 9
    assert int(t[9 * MIB]) == 0


@needs_populate
def test_the_thread_ends_with_its_backing():
    buf, t = _fresh(16 * MIB)
    p = Prefault(t, margin=MIB)
    p.grew(1)
    _caught_up(p, MIB)
    assert p.running()
    del t
    gc.collect()
    p.join(5)
    assert not p.running()


@needs_populate
def test_a_cpu_program_prefaults_as_its_arena_grows(tiny_model):
    """The Program wires its arena's growth to its backing's prefault (a CPU backing: not pinned)."""
    from tests.native.program_driver import make_program
    prog = make_program(tiny_model, context_cache={"host_capacity_bytes": 256 * MIB})
    pre = prog.mem.prefault
    assert pre is not None and pre.faulted() == 0 and not pre.running()
    assert pre.margin == 32 * MIB                                   # an eighth of the arena (at most 64 MiB)
    assert prog.host.allocate(100 * MIB) is not None
    _caught_up(pre, 100 * MIB + pre.margin)
