"""The controller's per-cycle channel to the GPU worker actor.

A plain Ray actor call costs ≈ 1 ms p50 on these machines (DESIGN.md §8), several times the
controller's own work per cycle. Ray's compiled graphs get the round trip to ≈ 0.09 ms, but
their channels busy-poll: measured here, an idle compiled graph kept the worker process at 60 %
of a core and a waiting controller at a third of one — on a 2-core node that CPU is taken from
the model. So the steady cycle runs over a Unix-domain stream socket between the two actor
processes (both on the one node the product serves), set up through Ray: the worker listens,
tells the controller where, and the controller connects. A round trip is tens of microseconds,
waiting costs nothing (a blocked ``recv``), and the bytes are the same msgspec bytes as over a
plain call. Setup, supervision and the worker's other methods stay plain actor calls.

Waking a process blocked in ``recv`` costs ≈ 70 µs on these machines (a halted vCPU is woken by
the host; measured: a reply after 3 ms of blocking is seen 70 µs late at p50, 10 µs late when the
receiver polls), paid twice per cycle — a quarter of the transport's cost. So each side polls for
a bounded window where the next frame is due: the controller blocks until shortly before the
reply is expected (the previous round trip's length) and polls from there; the worker polls
briefly after each reply for the next plan. Past the window both block as before, so an idle
engine costs nothing (``NINFER_STEP_POLL_US=0`` turns polling off; the default is 300).

Frames are ``kind (1 byte) | length (8 bytes) | payload``: kind 0 a reply, 1 an exception in
the worker's ``handle`` (its text; the control loop treats it as it treated a failed Ray task).
A worker that stops answering (hung) is lost too once a step waited ``step_timeout_s``
(``WorkerTimeout``; the recovery kills it). A dead worker closes the socket, so the step in flight fails at once with ``WorkerLost`` and the
control loop recreates the worker (and with it a new channel). ``NINFER_RAY_STEP_CHANNEL=call``
keeps plain actor calls; actors on different nodes use them too.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import struct
import sys
import threading
import time
import uuid
from collections.abc import Callable

log = logging.getLogger("ninfer.ray")
HEADER = struct.Struct("!BQ")
OK, ERROR = 0, 1


def normal_priority() -> str | None:
    """Niceness 0 for every thread of this process (Ray starts its workers at 15; on Linux
    niceness is per thread, and a new thread inherits its creator's); why not, if it fails."""
    tids = [0]
    if os.path.isdir("/proc/self/task"):
        tids += [int(t) for t in os.listdir("/proc/self/task")]
    why = None
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) > 0:
                os.setpriority(os.PRIO_PROCESS, tid, 0)
        except PermissionError as exc:  # no privilege to lower niceness
            why = why or str(exc)
        except OSError:                 # the thread ended meanwhile
            pass
    return why


class WorkerStepError(RuntimeError):
    """The worker's ``handle`` raised (not a death): the cycle fails as a Ray task error would."""


def poll_window_s() -> float:
    return max(0, int(os.environ.get("NINFER_STEP_POLL_US", "300"))) / 1e6


class Poller:
    """Waits for a socket to turn readable: blocked for ``block_s`` (returning early when it is
    readable), then polling for up to ``poll_s``; after that the caller's blocking ``recv``
    waits as before. A ``select`` blocks with microsecond timeouts (a ``poll``'s are rounded up
    to milliseconds); a socket beyond ``select``'s descriptor range sleeps instead."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.fd = sock.fileno()
        self.poll = select.poll()
        self.poll.register(self.fd, select.POLLIN)

    def wait(self, block_s: float, poll_s: float) -> None:
        if poll_s <= 0:
            return
        if block_s > 0:
            if self.fd < 1024:
                if select.select([self.fd], [], [], block_s)[0]:
                    return
            else:
                time.sleep(block_s)
        end = time.perf_counter() + poll_s
        while not self.poll.poll(0):
            if time.perf_counter() >= end:
                return


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            return None                                   # the peer closed
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket) -> tuple[int, bytes] | None:
    head = _recv_exact(sock, HEADER.size)
    if head is None:
        return None
    kind, n = HEADER.unpack(head)
    body = _recv_exact(sock, n) if n else b""
    return None if body is None else (kind, body)


def send_frame(sock: socket.socket, kind: int, data: bytes) -> None:
    sock.sendmsg([HEADER.pack(kind, len(data)), data])


def _address() -> str:
    """An abstract-namespace address on Linux (no file to clean up), a temp path elsewhere."""
    name = f"ninfer-step-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    if sys.platform.startswith("linux"):
        return "\0" + name
    import tempfile
    return os.path.join(tempfile.gettempdir(), name + ".sock")


class ChannelServer:
    """The worker side: one thread serving one controller connection at a time."""

    def __init__(self, handle: Callable[[bytes], bytes]):
        self.handle = handle
        self.address = _address()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.address)
        self.sock.listen(1)
        threading.Thread(target=self._serve, name="ninfer-step-channel", daemon=True).start()

    def _serve(self) -> None:
        normal_priority()                                 # the step is on every token's path
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return                                    # closed
            with conn:
                self._connection(conn)

    def _connection(self, conn: socket.socket) -> None:
        poller, window = Poller(conn), poll_window_s()
        try:
            while (frame := recv_frame(conn)) is not None:
                try:
                    reply, kind = self.handle(frame[1]), OK
                except Exception as exc:                  # a death exits the process inside handle
                    reply, kind = f"{type(exc).__name__}: {exc}".encode(), ERROR
                send_frame(conn, kind, reply)
                poller.wait(0.0, window)                  # the next plan is due within the window
        except OSError:
            pass                                          # the controller went away

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class FrameSender:
    """A one-way frame stream to a listener (the controller's events to the frontend)."""

    def __init__(self, address: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(address)

    def send(self, data: bytes) -> bool:
        """False when the listener is gone (the caller falls back to an actor call)."""
        try:
            send_frame(self.sock, OK, data)
            return True
        except OSError:
            self.close()
            return False

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


async def serve_frames(address: str, on_frame: Callable[[bytes], None]):
    """An asyncio listener calling ``on_frame`` for every frame of every connection."""
    import asyncio

    async def connection(reader, writer) -> None:
        try:
            while True:
                kind, n = HEADER.unpack(await reader.readexactly(HEADER.size))
                on_frame(await reader.readexactly(n) if n else b"")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
    return await asyncio.start_unix_server(connection, path=address)


async def serve_connections(address: str, handler):
    """An asyncio listener handing each connection (reader, writer) to ``handler``."""
    import asyncio
    return await asyncio.start_unix_server(handler, path=address)


def new_address() -> str:
    return _address()


class StepChannel:
    """The controller side: bytes -> bytes over the worker's socket, or plain actor calls."""

    def __init__(self, actor, lost: Callable[[str], Exception], timeout_s: float | None = None,
                 timed_out: Callable[[str], Exception] | None = None):
        import ray
        self.actor, self.lost, self.sock = actor, lost, None
        self.timeout_s, self.timed_out = timeout_s, timed_out or lost
        if os.environ.get("NINFER_RAY_STEP_CHANNEL", "socket") != "socket":
            return
        address, node = ray.get(actor.channel_address.remote())
        if node != ray.get_runtime_context().get_node_id() or address is None:
            log.info("the GPU worker is on another node: steps use plain actor calls")
            return
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(address)
        sock.settimeout(timeout_s)                        # a hung worker: TimeoutError in recv
        self.sock, self.poller, self.window = sock, Poller(sock), poll_window_s()
        self.last_s = 0.0                                 # the previous round trip

    @property
    def direct(self) -> bool:
        return self.sock is not None

    def call(self, data: bytes) -> bytes:
        if self.sock is None:
            import ray
            from ray.exceptions import RayActorError
            from ray.exceptions import GetTimeoutError
            try:
                return ray.get(self.actor.handle.remote(data), timeout=self.timeout_s)
            except RayActorError as exc:
                raise self.lost(f"{type(exc).__name__}: {str(exc).splitlines()[0]}") from None
            except GetTimeoutError:
                raise self.timed_out(self._no_answer()) from None
        try:
            t0 = time.perf_counter()
            send_frame(self.sock, OK, data)
            # the reply is due about when the previous one came: block until shortly before, then poll
            self.poller.wait(self.last_s - self.window, 2 * self.window)
            frame = recv_frame(self.sock)
            self.last_s = time.perf_counter() - t0
        except TimeoutError:
            raise self.timed_out(self._no_answer()) from None
        except OSError as exc:
            raise self.lost(f"the step channel to the GPU worker failed: {exc}") from None
        if frame is None:
            raise self.lost("the GPU worker closed the step channel (it died)")
        kind, body = frame
        if kind == ERROR:
            raise WorkerStepError(body.decode(errors="replace"))
        return body

    def _no_answer(self) -> str:
        return f"the GPU worker did not answer a step within step_timeout_s={self.timeout_s} s (hung)"

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass
