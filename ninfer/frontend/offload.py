"""Work whose cost grows with one request's input, done in a helper process instead of the
interpreter that serves every other request.

Measured on the tiny model's tokenizer (2 busy cores): ``Tokenizer.encode`` of 1 MB of text
held the GIL for 0.59 s (``encode_batch`` releases it: 39 ms), and a plan's Python work over
its offsets another ~0.3 s per 2 M tokens; decoding a 12-24 MB JSON body of many small values
took 0.2-0.6 s in msgspec, also under the GIL. A native call that releases the GIL covers the
first only, so such inputs go to a helper process ("a process pool, or a bounded native call —
measure"): the server's event loop, the control thread of an in-process engine and the frontend
actor's loop keep running, and the memory the work takes is the helper's (returned to the
system after a large input, ``malloc_trim``).

    small input  ──► inline (bounded: a few ms)
    large input  ──► Offload.run(fn, ...) ──► helper process: decode + bounds / render + count
                                               + plan / tokenize ──► a bounded result or an error

Child functions return ``(True, value)`` or ``(False, Refusal)``: an exception of ours would
not survive pickling with its fields. A helper that dies (killed, out of memory) fails that
request with a 503 and the pool is built again for the next.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import logging
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
from concurrent.futures import Future
from typing import NamedTuple

from ninfer.errors import NInferError

log = logging.getLogger("ninfer.server")

INLINE_BODY_BYTES = 1 << 20       # JSON bodies up to this are decoded where they arrive
INLINE_TEXT_CHARS = 64 << 10      # chat inputs / prompts with less text are planned where they arrive


class Refusal(NamedTuple):
    """A request error found in the helper: what the server answers (status, message, param, code)."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None


class HelperLost(NInferError):
    """The helper process died while working on this request (the request fails alone: 503)."""


class Offload:
    """One helper process (a plain subprocess speaking length-prefixed pickles over its stdin
    and stdout: multiprocessing's pools bring a resource tracker that prints tracebacks when a
    Ray actor is killed), started lazily, started again after it dies. Jobs run one at a time
    in the order submitted; ``shared()`` is the process's one instance."""

    def __init__(self):
        self._proc: subprocess.Popen | None = None
        self._jobs: queue.Queue | None = None
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[subprocess.Popen, Future]] = {}
        self._ids = itertools.count()

    def _started(self) -> tuple[subprocess.Popen, queue.Queue]:
        with self._lock:
            if self._proc is None or self._proc.lost or self._proc.poll() is not None:
                env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
                proc = subprocess.Popen([sys.executable, "-c", "from ninfer.frontend.offload import _child; _child()"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
                proc.lost = False                          # its output ended (it may not be reaped yet)
                self._proc, self._jobs = proc, queue.Queue()
                threading.Thread(target=self._write, args=(proc, self._jobs), daemon=True,
                                 name="ninfer-offload-in").start()
                threading.Thread(target=self._read, args=(proc,), daemon=True, name="ninfer-offload-out").start()
            return self._proc, self._jobs

    def submit(self, fn, *args) -> Future:
        fut: Future = Future()
        data = pickle.dumps((None, fn, args), protocol=pickle.HIGHEST_PROTOCOL)
        while True:
            proc, jobs = self._started()
            with self._lock:
                if proc.lost:                             # it died between the two: the next one
                    continue
                jid = next(self._ids)
                self._pending[jid] = (proc, fut)
            jobs.put(_HEAD.pack(jid) + data)
            return fut

    @staticmethod
    def _write(proc: subprocess.Popen, jobs: queue.Queue) -> None:
        """Jobs go out on this thread: a large one fills the pipe until the helper reads it, and
        no caller (an event loop) may wait for that."""
        while True:
            data = jobs.get()
            try:
                proc.stdin.write(_HEAD.pack(len(data)) + data)
                proc.stdin.flush()
            except (OSError, ValueError):
                return                                 # it died: its reader fails what it had

    def _lost(self, proc: subprocess.Popen) -> None:
        """The helper's output ended: it is never used again, and what it had fails, alone."""
        with self._lock:
            proc.lost = True
            lost = [jid for jid, (p, _) in self._pending.items() if p is proc]
            futs = [self._pending.pop(jid)[1] for jid in lost]
        for fut in futs:
            if not fut.done():
                fut.set_exception(HelperLost("the helper process preparing this request was lost (killed or out "
                                             "of memory)"))

    def _read(self, proc: subprocess.Popen) -> None:
        try:
            while True:
                head = proc.stdout.read(_HEAD.size)
                if len(head) < _HEAD.size:
                    break
                jid, ok, value = pickle.loads(proc.stdout.read(_HEAD.unpack(head)[0]))
                with self._lock:
                    _, fut = self._pending.pop(jid, (None, None))
                if fut is not None:
                    fut.set_result(value) if ok else fut.set_exception(value)
        except (OSError, EOFError, pickle.UnpicklingError):
            pass
        self._lost(proc)

    def result(self, fut: Future):
        """The child's value (a Refusal is returned as is); a lost helper raises HelperLost."""
        ok, value = fut.result()
        return value

    def run(self, fn, *args):
        return self.result(self.submit(fn, *args))

    async def run_async(self, fn, *args):
        ok, value = await asyncio.wrap_future(self.submit(fn, *args))
        return value

    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def warm(self) -> None:
        """Start the helper now (a start takes a moment), so the first large request does not wait."""
        self.submit(_ping)

    def shutdown(self) -> None:
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()


_HEAD = struct.Struct("<Q")


_SHARED: Offload | None = None
_SHARED_LOCK = threading.Lock()


def shared() -> Offload:
    """The process's one helper pool (the server, the in-process intake and the frontend actor
    each use the one of their process)."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = Offload()
        return _SHARED


# ---- in the helper process --------------------------------------------------------------------

def _child() -> None:
    """The helper's loop: a job in, its value (or exception) out; the parent closing stdin (it
    exited, or was killed) ends it. It runs at a lower priority than the processes serving
    tokens: on a busy machine its seconds of work must not take their CPU."""
    try:
        os.nice(10)
    except OSError:
        pass
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr                         # a stray print must not corrupt the replies
    while True:
        head = stdin.read(_HEAD.size)
        if len(head) < _HEAD.size:
            return
        frame = stdin.read(_HEAD.unpack(head)[0])
        jid = _HEAD.unpack(frame[:_HEAD.size])[0]
        _, fn, args = pickle.loads(frame[_HEAD.size:])
        try:
            reply = (jid, True, fn(*args))
        except Exception as exc:                    # noqa: BLE001 — the parent raises it for that request
            reply = (jid, False, exc)
        try:
            data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:                    # noqa: BLE001
            data = pickle.dumps((jid, False, RuntimeError(f"{type(exc).__name__}: {exc}")))
        stdout.write(_HEAD.pack(len(data)) + data)
        stdout.flush()


def _ping() -> tuple[bool, None]:
    return True, None


def trim() -> None:
    """Give the heap a large input freed back to the system (glibc keeps it otherwise)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


_TOKENIZERS: dict[str, object] = {}


def tokenizer(model_dir: str):
    """The helper's ChatTokenizer of ``model_dir`` (loaded once per helper)."""
    from ninfer.frontend.render import ChatTokenizer
    tok = _TOKENIZERS.get(model_dir)
    if tok is None:
        tok = _TOKENIZERS[model_dir] = ChatTokenizer(model_dir)
    return tok


def _refused(exc: Exception) -> tuple[bool, Refusal]:
    return False, Refusal(400, str(exc))


def plan_chat_job(model_dir: str, messages: list[dict], tools: list[dict] | None,
                  remembered: dict[str, list[int]], max_context: int, template=None):
    """A chat input's plan (``chat_plan.plan_chat``, with the request's ``TemplateOptions``). A
    prompt that cannot fit is refused after one render and a count, before the plan's per-token
    work: the rendered text's tokens less every byte of the assistant texts the plan may replace
    by remembered outputs (each token spans at least one byte) is a lower bound on the prompt."""
    from ninfer.errors import RequestError
    from ninfer.frontend.chat_plan import OutputMemory, plan_chat
    tok = tokenizer(model_dir)
    try:
        if template is None:
            text = tok.render(messages, tools, True)
        else:
            cont = template.continue_final_message
            text = tok.render(messages, tools, template.add_generation_prompt and not cont,
                              template.kwargs or None, cont)
        count = len(tok.tokenizer.encode_batch([text], add_special_tokens=False)[0])
        least = count - sum(len(t.encode("utf-8", "surrogatepass")) for t in remembered)
        if least > max_context:
            del text
            trim()
            return False, Refusal(400, f"this engine's max_context is {max_context} tokens, but the prompt alone "
                                       f"has at least {least}", "messages", "context_length_exceeded")
        memory = OutputMemory()
        for t, ids in remembered.items():
            memory.remember(t, list(ids))
        plan = plan_chat(tok, messages, tools, memory, template)
    except RequestError as exc:
        return _refused(exc)
    trim()
    return True, plan


def tokenize_job(model_dir: str, *args):
    """``tokenize_with`` in the helper."""
    return tokenize_with(tokenizer(model_dir), *args)


def tokenize_with(tok, text: str | None, messages: list[dict] | None, tools: list[dict] | None,
                  add_generation_prompt: bool, add_special_tokens: bool, max_context: int | None,
                  template_kwargs: dict | None = None, continue_final: bool = False):
    """The token ids of a text (``add_special_tokens`` as the tokenizer adds them) or of chat
    messages as the template renders them (``template_kwargs``: chat_template_kwargs;
    ``continue_final``: the final message left open); more than ``max_context`` (None: no
    limit, the caller truncates) is refused before the ids are built. The encoding is
    ``encode_batch``'s, which releases the GIL."""
    from ninfer.errors import RequestError
    from ninfer.frontend.render import check_text
    try:
        if messages is not None:
            text = tok.render(messages, tools, add_generation_prompt, template_kwargs, continue_final)
            add_special_tokens = False
        check_text(text, "the prompt")
        enc = tok.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]
    except RequestError as exc:
        return _refused(exc)
    if max_context is not None and len(enc) > max_context:
        n = len(enc)
        del enc
        trim()
        return False, Refusal(400, f"this engine's max_context is {max_context} tokens, but the prompt has {n}",
                              "messages" if messages is not None else "prompt", "context_length_exceeded")
    return True, list(enc.ids)
