"""The HTTP side of ``ninfer bench serve``: concurrent chat users streaming
``POST /chat/completions`` against any OpenAI-compatible server, one ``Record`` per request.

Each client runs its conversation's rounds one after another (a round starts when the client's
previous round has finished), and all clients run at once. A stream counts as an error unless
it answered 200, carried no error object, ended with a ``finish_reason`` other than ``error``
and closed with ``data: [DONE]``; a read that waits longer than ``timeout`` seconds (a stall)
is an error too.

    t0 ──request──> first content delta (TTFT) ──deltas (gaps)──> finish_reason ── usage ─ [DONE]

``ninfer bench trace --base-url`` streams legacy ``POST /completions`` (token-id prompts)
through the same reader (``stream_chat(..., path="/completions")``).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field

from ninfer.benchmarks.chat_workload import Conversation
from ninfer.errors import NInferError


class ServerError(NInferError):
    """The server under test could not be reached or listed no model."""


@dataclass
class Record:
    """One request as the client saw it; times in seconds, ``start_s`` from the run's start."""
    client: int
    round: int
    start_s: float = 0.0
    ttft_s: float | None = None          # to the first non-empty content (or tool-call) delta
    e2e_s: float | None = None           # to the end of the stream
    max_gap_s: float | None = None       # the longest wait between two content deltas
    gaps: list[float] = field(default_factory=list, repr=False)   # every inter-delta gap (ITL)
    output_tokens: int = 0               # usage.completion_tokens, else the content deltas counted
    prompt_tokens: int | None = None
    cached_tokens: int | None = None     # usage.prompt_tokens_details.cached_tokens
    finish_reason: str | None = None
    status: int | None = None
    error: str | None = None
    text: str = field(default="", repr=False)

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (vLLM's TPOT)."""
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def public(self) -> dict:
        d = asdict(self)
        del d["text"], d["gaps"]
        d["tpot_s"] = self.tpot_s
        return d


def auth_headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def first_model(base_url: str, api_key: str | None = None) -> str:
    """The first id that ``GET {base_url}/models`` lists."""
    import httpx
    try:
        r = httpx.get(f"{base_url}/models", headers=auth_headers(api_key), timeout=30)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        raise ServerError(f"cannot list models at {base_url}/models: {type(exc).__name__}: {exc}") from None


async def stream_chat(http, body: dict, rec: Record, t_run: float, path: str = "/chat/completions") -> None:
    """One streaming chat completion (``path="/completions"``: a legacy one, whose choices carry
    ``text`` instead of a ``delta``); fills ``rec`` (an exception is recorded, not raised)."""
    t0 = time.perf_counter()
    rec.start_s = t0 - t_run
    last = None
    deltas = 0
    done = False
    parts: list[str] = []
    try:
        async with http.stream("POST", path, json=body) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {_message((await resp.aread()).decode(errors='replace'))}"
                return
            async for line in _sse_lines(resp):
                if not line.startswith("data:"):
                    continue                               # blank separators, comments, event: lines
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = f"stream error: {_message(data)}"
                    return
                if chunk.get("usage"):
                    u = chunk["usage"]
                    rec.output_tokens = u.get("completion_tokens") or rec.output_tokens
                    rec.prompt_tokens = u.get("prompt_tokens")
                    details = u.get("prompt_tokens_details")      # None: the server does not say
                    rec.cached_tokens = details.get("cached_tokens") if isinstance(details, dict) else None
                for ch in chunk.get("choices") or []:
                    delta = ch.get("delta") or {}
                    piece = ch.get("text") or delta.get("content")
                    if piece or delta.get("tool_calls") or ch.get("logprobs"):   # a token whose text is held back
                        now = time.perf_counter()
                        if last is None:
                            rec.ttft_s = now - t0
                        else:
                            rec.max_gap_s = max(rec.max_gap_s or 0.0, now - last)
                            rec.gaps.append(now - last)
                        last = now
                        deltas += 1
                        parts.append(piece or "")
                    if ch.get("finish_reason"):
                        rec.finish_reason = ch["finish_reason"]
    except Exception as exc:                               # noqa: BLE001 — a load generator records, never dies
        rec.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return
    finally:
        rec.e2e_s = time.perf_counter() - t0
        rec.text = "".join(parts)
        if not rec.output_tokens:
            rec.output_tokens = deltas
    if rec.finish_reason is None:
        rec.error = "stream ended without a finish_reason"
    elif rec.finish_reason == "error":
        rec.error = "finish_reason error"
    elif not done:
        rec.error = "stream ended without data: [DONE]"


async def _sse_lines(resp):
    """The stream's lines, split at ``\n`` only: ``aiter_lines`` splits like ``str.splitlines``,
    also at U+0085 / U+2028 / U+2029, which JSON leaves unescaped inside a string (the text of
    arbitrary tokens can hold them), cutting a ``data:`` line in two."""
    buf = b""
    async for chunk in resp.aiter_bytes():
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode("utf-8", errors="replace")
    if buf:
        yield buf.decode("utf-8", errors="replace")


def _message(body: str) -> str:
    """The OpenAI error shape's message, else the body itself (shortened)."""
    try:
        err = json.loads(body)["error"]
        return str(err.get("message", err)) if isinstance(err, dict) else str(err)
    except (ValueError, KeyError, TypeError):
        return body[:200]


class Progress:
    """Completed requests on stderr (``ninfer.progress.bar``), errors counted in the postfix."""

    def __init__(self, total: int):
        from ninfer.progress import bar
        self.errors = 0
        self.bar = bar(total=total, desc="requests", unit="req")

    def update(self, rec: Record) -> None:
        self.bar.update(1)
        if rec.error is not None:
            self.errors += 1
            self.bar.set_postfix(errors=self.errors)

    def close(self) -> None:
        self.bar.close()


class Arrivals:
    """A request rate: each request waits for the next arrival of a Poisson process of
    ``rate`` per second (vLLM's ``--request-rate``); None lets every client send at once."""

    def __init__(self, rate: float | None, seed: int = 0):
        import random
        self.rate, self.rng, self.next_t = rate, random.Random(seed), None

    async def wait(self) -> None:
        if not self.rate:
            return
        now = time.perf_counter()
        self.next_t = max(now, self.next_t or now) + self.rng.expovariate(self.rate)
        await asyncio.sleep(self.next_t - now)


async def _run(base_url: str, model: str, convs: list[Conversation], rounds: int, sampling: dict,
               api_key: str | None, timeout: float, rate: float | None = None) -> tuple[list[Record], float]:
    import httpx
    arrivals = Arrivals(rate)
    limits = httpx.Limits(max_connections=len(convs), max_keepalive_connections=len(convs))
    progress = Progress(len(convs) * rounds)
    records: list[Record] = []

    async def user(c: int, conv: Conversation) -> None:
        for r in range(rounds):
            body = {"model": model, "messages": conv.ask(r), "stream": True,
                    "stream_options": {"include_usage": True}, "user": f"bench-client-{c}", **sampling}
            rec = Record(c, r)
            await arrivals.wait()
            await stream_chat(http, body, rec, t_run)
            records.append(rec)
            progress.update(rec)
            conv.answer(rec.text)              # an errored round continues with what arrived

    async with httpx.AsyncClient(base_url=base_url, headers=auth_headers(api_key), limits=limits,
                                 timeout=httpx.Timeout(timeout, connect=30)) as http:
        t_run = time.perf_counter()
        await asyncio.gather(*(user(c, conv) for c, conv in enumerate(convs)))
        wall = time.perf_counter() - t_run
    progress.close()
    records.sort(key=lambda r: (r.round, r.client))
    return records, wall


def run_load(base_url: str, model: str, convs: list[Conversation], rounds: int, sampling: dict,
             api_key: str | None = None, timeout: float = 120.0,
             rate: float | None = None) -> tuple[list[Record], float]:
    """Every conversation's ``rounds`` requests (at most one in flight per conversation; with
    ``rate``, starts no faster than a Poisson process of that rate); the records (by round,
    then client) and the wall time."""
    return asyncio.run(_run(base_url.rstrip("/"), model, convs, rounds, sampling, api_key, timeout, rate))
