"""The Program's tensors and the byte-exact copies between Device slots/pages and Host extents.

Device (model dtype unless noted)::

    k, v    [La, P, 64, Hkv, D]     Main KV pages
    conv    [Ll, S, C, K-1]         per state slot
    ssm     [Ll, S, Hv, Dk, Dv]     per state slot (fp32 / fp64)
    hidden  [S, H]                  continuation hidden per state slot

Host: one uint8 backing. A StateImage occupies one extent laid out as
``conv | ssm | hidden`` (each part 16-byte aligned); a KV page one extent ``k | v``.
Copies are plain byte copies, so a restored image is bit-identical to the saved one.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
import weakref
from collections.abc import Callable

import torch

from ninfer.errors import ConfigError
from ninfer.native.model.forward import ModelCache
from ninfer.native.model.model import HybridModel
from ninfer.native.stores import Extent

Job = Callable[[], None]
log = logging.getLogger("ninfer.memory")


def _a16(n: int) -> int:
    return (n + 15) // 16 * 16


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def host_backing(host_bytes: int, pin: bool) -> torch.Tensor:
    """The one Host backing tensor, exactly ``host_bytes`` long.

    On CUDA its pages are pinned by registering them (``cudaHostRegister``), as SGLang pins its
    host KV pool: ``torch.empty(pin_memory=True)`` goes through the caching host allocator,
    which rounds every block up to a power of two (an 8.6 GB arena would take 16 GiB of locked
    memory). The registration is undone when the tensor is collected. Where registering is
    refused, the caching allocator's pinned memory is the fallback (logged).

    On the CPU an untouched torch.empty costs address space, not resident memory, but the
    kernel still refuses more than the node can back; that refusal is a config value this node
    cannot serve, so it is reported as one, naming the field."""
    try:
        t = torch.empty(host_bytes, dtype=torch.uint8)
    except RuntimeError as exc:
        reason = str(exc).strip().splitlines()[-1]
        raise ConfigError(
            f"context_cache.host_capacity_bytes={host_bytes} cannot be allocated on this node ({reason}): "
            "allowed at most what the node's memory can back (default 8 GiB + 8 × the model's StateImage)") from None
    if pin and host_bytes:
        t = _pin_exact(t)
    return t


def _pin_exact(t: torch.Tensor) -> torch.Tensor:
    cudart = torch.cuda.cudart()
    ptr, n = t.data_ptr(), t.numel()
    err = cudart.cudaHostRegister(ptr, n, 0)          # cudaHostRegisterDefault
    if int(getattr(err, "value", err)) != 0:
        log.warning("cudaHostRegister of the %d-byte Host arena failed (%s); using the caching host "
                    "allocator's pinned memory (rounded up to a power of two)", n, err)
        return t.pin_memory()
    weakref.finalize(t, cudart.cudaHostUnregister, ptr)
    return t


MADV_POPULATE_WRITE = 23      # Linux >= 5.14: fault pages in writable, contents kept
PREFAULT_MARGIN = 64 << 20    # the most the CPU Host backing is faulted in ahead of its arena's high-water mark


class Prefault:
    """Faults the Host backing's pages in ahead of the arena's high-water mark, off the engine's
    thread.

    A CPU Host backing is an untouched ``torch.empty``: its first write to a page costs a page
    fault, and a Device-to-Host page copy (128 KiB) into fresh memory took ~75 us against ~9 us
    into memory already touched — an admission demoting a dozen pages paid ~1 ms while the arena
    grew. The arena allocates first-fit from offset 0, so its pages are first written in order
    of its high-water mark (``HostArena.high``): from the first allocation on, a daemon thread
    keeps ``margin`` bytes above it faulted in with ``madvise(MADV_POPULATE_WRITE)``, which keeps
    the contents (a racing copy into the same page is safe) and runs without the GIL. Resident
    memory is what the arena has used plus the margin. A pinned (CUDA) backing is locked, so
    resident, when registered: nothing to do. Where the kernel refuses the advice, the thread
    ends and first writes fault as before."""

    CHUNK = 2 << 20

    def __init__(self, backing: torch.Tensor, margin: int = PREFAULT_MARGIN):
        self.margin = margin
        self.capacity = backing.numel()
        self._base = backing.data_ptr()
        self._backing = weakref.ref(backing)
        self._done = 0                                  # bytes from the start faulted in
        self._want = 0
        self._wake = threading.Event()
        weakref.finalize(backing, self._wake.set)       # a collected backing ends the thread
        self._thread: threading.Thread | None = None    # started by the arena's first allocation

    def grew(self, high: int) -> None:
        """The arena's high-water mark rose to ``high`` (called on the engine's thread). A Program
        whose Host arena is never used (most of a test suite's) starts no thread and faults nothing."""
        if high + self.margin // 2 > self._want:
            self._want = min(self.capacity, high + self.margin)
            self._wake.set()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ninfer-host-prefault", daemon=True)
                self._thread.start()

    def faulted(self) -> int:
        """How many bytes from the backing's start are faulted in (observation and tests)."""
        return self._done

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def running(self) -> bool:
        """Whether its thread is alive (not yet started, or ended: False)."""
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        while self._done < self.capacity:
            self._wake.wait()
            self._wake.clear()
            while self._done < self._want:
                backing = self._backing()
                if backing is None:
                    return
                start = self._base + self._done
                end = self._base + min(self._want, self._done + self.CHUNK)
                lo = start - start % mmap.PAGESIZE      # the advice wants a page-aligned start
                if madvise(lo, end - lo, MADV_POPULATE_WRITE) != 0:
                    log.debug("no Host prefault: madvise refused (errno %d)", ctypes.get_errno())
                    return
                self._done = end - self._base
                del backing
            if self._backing() is None:
                return


class Memory:
    """``scratch``: one more KV page and state slot past the pools (indices ``pages`` and
    ``slots``), written only by a CUDA graph's padding rows (native/graphs.py)."""

    def __init__(self, model: HybridModel, pages: int, slots: int, host_bytes: int, scratch: bool = False):
        self.model = model
        self.device = model.device
        self.scratch = (pages, slots) if scratch else None
        self.cache: ModelCache = model.new_cache(pages + scratch, slots + scratch)
        self.hidden = torch.zeros(slots + scratch, model.cfg.hidden_size, dtype=model.dtype, device=self.device)
        self.host = host_backing(host_bytes, pin=self.device.type == "cuda")
        # a margin of an eighth of the arena, at most 64 MiB: a small arena (a test's) faults little
        self.prefault = (Prefault(self.host, margin=min(PREFAULT_MARGIN, max(host_bytes // 8, mmap.PAGESIZE)))
                         if host_bytes and self.device.type != "cuda" else None)
        c = self.cache
        self._conv_bytes = _bytes(c.conv[:, 0])
        self._ssm_bytes = _bytes(c.ssm[:, 0])
        self._hid_bytes = _bytes(self.hidden[0])
        self.image_bytes = _a16(self._conv_bytes) + _a16(self._ssm_bytes) + _a16(self._hid_bytes)
        self._page_half = _bytes(c.k[:, 0])
        self.page_bytes = 2 * _a16(self._page_half)

    # -- host views -----------------------------------------------------------------------
    def _view(self, offset: int, like: torch.Tensor) -> torch.Tensor:
        return self.host[offset: offset + _bytes(like)].view(like.dtype).view(like.shape)

    def _image_views(self, ext: Extent) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c, o = self.cache, ext.offset
        conv = self._view(o, c.conv[:, 0])
        o += _a16(self._conv_bytes)
        ssm = self._view(o, c.ssm[:, 0])
        o += _a16(self._ssm_bytes)
        return conv, ssm, self._view(o, self.hidden[0])

    def _page_views(self, ext: Extent) -> tuple[torch.Tensor, torch.Tensor]:
        k = self._view(ext.offset, self.cache.k[:, 0])
        return k, self._view(ext.offset + _a16(self._page_half), self.cache.v[:, 0])

    # -- state slots ----------------------------------------------------------------------
    def zero_slot(self, slot: int) -> None:
        self.cache.reset_slot(slot)
        self.hidden[slot].zero_()

    def copy_slot(self, src: int, dst: int) -> None:
        c = self.cache
        c.conv[:, dst] = c.conv[:, src]
        c.ssm[:, dst] = c.ssm[:, src]
        self.hidden[dst] = self.hidden[src]

    def write_image(self, dst: int, image: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """Write a StateImage's parts — conv [Ll, C, K-1], ssm [Ll, Hv, Dk, Dv], hidden [H], as
        a forward kept them at an inner cut — into slot ``dst``."""
        c = self.cache
        c.conv[:, dst] = image[0]
        c.ssm[:, dst] = image[1]
        self.hidden[dst] = image[2]

    def slot_to_host(self, slot: int, ext: Extent, snapshot_now: bool) -> Job:
        c = self.cache
        return self.image_to_host((c.conv[:, slot], c.ssm[:, slot], self.hidden[slot]), ext, snapshot_now)

    def image_to_host(self, src: tuple[torch.Tensor, ...], ext: Extent, snapshot_now: bool) -> Job:
        """D2H of a StateImage. ``snapshot_now``: the writer keeps computing in that slot, so the
        source is cloned at submission — on the CPU before the copy thread reads it; on CUDA on
        the compute stream, in its order (the copy stream waits for compute before the job runs,
        but compute never waits for the copy stream, so the slot itself may be overwritten by the
        next step while the D2H is still reading). The clone is marked used by the copy stream,
        so the caching allocator keeps it until that copy is done. ``src``: a slot's parts, or
        an image a forward kept at an inner cut (``write_image``)."""
        if snapshot_now:
            src = tuple(t.clone() for t in src)
        dst = self._image_views(ext)
        cuda = self.device.type == "cuda"

        def job() -> None:
            for d, s in zip(dst, src):
                if cuda and snapshot_now:
                    s.record_stream(torch.cuda.current_stream(self.device))   # the copy stream
                d.copy_(s, non_blocking=True)
        return job

    def host_to_slot(self, ext: Extent, slot: int) -> Job:
        src = self._image_views(ext)
        c = self.cache

        def job() -> None:
            c.conv[:, slot].copy_(src[0], non_blocking=True)
            c.ssm[:, slot].copy_(src[1], non_blocking=True)
            self.hidden[slot].copy_(src[2], non_blocking=True)
        return job

    # -- KV pages -------------------------------------------------------------------------
    def copy_page_prefix(self, src: int, dst: int, n: int) -> None:
        """COW: the written prefix (positions 0..n-1) of one page into another."""
        c = self.cache
        c.k[:, dst, :n] = c.k[:, src, :n]
        c.v[:, dst, :n] = c.v[:, src, :n]

    def page_to_host(self, page: int, ext: Extent) -> Job:
        k, v = self._page_views(ext)
        c = self.cache

        def job() -> None:
            k.copy_(c.k[:, page], non_blocking=True)
            v.copy_(c.v[:, page], non_blocking=True)
        return job

    def host_to_page(self, ext: Extent, page: int) -> Job:
        k, v = self._page_views(ext)
        c = self.cache

        def job() -> None:
            c.k[:, page].copy_(k, non_blocking=True)
            c.v[:, page].copy_(v, non_blocking=True)
        return job
