"""A scripted engine for the HTTP layer's tests, and the real server in front of it in a thread:
what the tiny random model cannot be made to say — a tool call, a stop string split across
tokens — is scripted (the last user message is the answer, tokenised with the real tokenizer and
streamed token by token; a completion's prompt ids are its answer)."""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import uvicorn

from ninfer.api import Output, StreamEvent, TimingsView, UsageView
from ninfer.frontend.http_guard import Limits, protocol_class
from ninfer.frontend.render import ChatTokenizer
from tests.serving import free_port

OPEN_GATE = threading.Event()
OPEN_GATE.set()


class ScriptedHandle:
    def __init__(self, rid: str, ids: list[int], delay: float, chunk: int = 1):
        self.rid, self.ids, self.delay, self.chunk = rid, ids, delay, chunk
        self.prompt_token_ids = list(ids)       # as RequestHandle: the prompt it runs (here also its answer)
        self.sent = 0
        self.cancelled = False
        self.gate = OPEN_GATE
        self.error: dict | None = None          # the engine ends it with this error after its tokens

    async def aiter(self):
        while not self.gate.is_set() and not self.cancelled:       # the prompt's prefill, as long as a test holds it
            await asyncio.sleep(0.005)
        while self.sent < len(self.ids) and not self.cancelled:
            await asyncio.sleep(self.delay)
            first, self.sent = self.sent, min(len(self.ids), self.sent + self.chunk)
            yield StreamEvent(self.rid, first, self.ids[first:self.sent])    # several tokens per event

    async def result_async(self) -> Output:
        while self.sent < len(self.ids) and not self.cancelled:
            await asyncio.sleep(0.005)
        reason = "error" if self.error else "cancelled" if self.cancelled else "stop"
        return Output(self.rid, self.ids[:self.sent], "", reason, self.error,
                      UsageView(prompt_tokens=len(self.prompt_token_ids), completion_tokens=self.sent), TimingsView())

    def cancel(self) -> None:
        self.cancelled = True


class ScriptedEngine:
    model_dir = "scripted"

    def __init__(self, tok: ChatTokenizer):
        self.tokenizer = tok
        self.info = SimpleNamespace(max_context=4096, vocab_size=tok.tokenizer.get_vocab_size(), vision_merge=0,
                                    eos_ids=[tok.tokenizer.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>")])
        self.handles: list[ScriptedHandle] = []
        self.kwargs: list[dict] = []            # what each chat was asked (sampling, structured, ...)
        self.delay = 0.002
        self.chunk = 1
        self.gate = OPEN_GATE
        self.error: dict | None = None

    def chat(self, messages, tools=None, **kw) -> ScriptedHandle:
        self.kwargs.append(kw)
        return self._handle(self.tokenizer.encode(messages[-1]["content"]))

    def generate(self, prompt_token_ids, **kw) -> ScriptedHandle:
        return self._handle(list(prompt_token_ids))

    def _handle(self, ids: list[int]) -> ScriptedHandle:
        h = ScriptedHandle(f"s{len(self.handles)}", ids, self.delay, self.chunk)
        h.gate, h.error = self.gate, self.error
        self.handles.append(h)
        return h

    def alive(self) -> bool:
        return True


@contextmanager
def running(server, limits: Limits | None = None):
    """``server`` (a frontend ``Server``) on a free loopback port behind the connection guards,
    as ``ninfer serve`` runs it; yields the base URL."""
    port = free_port()
    limits = limits or server.limits
    srv = uvicorn.Server(uvicorn.Config(server.app, host="127.0.0.1", port=port, log_level="warning",
                                        http=protocol_class(limits)))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
