"""The serve bench's client against canned streams (httpx.MockTransport, no server): what counts
as a finished stream, what counts as an error, and what is measured from the chunks."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from ninfer.benchmarks.chat_workload import Conversation, conversations
from ninfer.benchmarks.http_load import Record, stream_chat
from ninfer.benchmarks.serve import pct, summarise


def _sse(*chunks) -> bytes:
    return b"".join(f"data: {c if isinstance(c, str) else json.dumps(c)}\n\n".encode() for c in chunks)


def _delta(text: str | None = None, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": {} if text is None else {"content": text}, "finish_reason": finish}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 3,
                                  "prompt_tokens_details": {"cached_tokens": 12}}}
GOOD = [_delta(""), _delta("a"), _delta("b"), _delta("c"), _delta(None, "length"), USAGE, "[DONE]"]


def _run(status: int, body: bytes) -> Record:
    def handler(request: httpx.Request) -> httpx.Response:
        sent = json.loads(request.content)
        assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
        return httpx.Response(status, content=body, headers={"content-type": "text/event-stream"})

    async def go() -> Record:
        rec = Record(0, 0)
        async with httpx.AsyncClient(base_url="http://x/v1", transport=httpx.MockTransport(handler)) as http:
            await stream_chat(http, {"stream": True, "stream_options": {"include_usage": True}}, rec, 0.0)
        return rec
    return asyncio.run(go())


def test_a_complete_stream_is_measured():
    rec = _run(200, _sse(*GOOD))
    assert rec.error is None and rec.finish_reason == "length"
    assert rec.text == "abc" and rec.output_tokens == 3
    assert (rec.prompt_tokens, rec.cached_tokens) == (20, 12)
    assert rec.ttft_s is not None and rec.max_gap_s is not None and rec.e2e_s >= rec.ttft_s


def test_a_line_separator_inside_the_text_does_not_cut_the_data_line():
    chunks = [_delta("a\u2028b\u0085c\u2029"), _delta(None, "length"), USAGE, "[DONE]"]
    body = b"".join(f"data: {json.dumps(c, ensure_ascii=False) if isinstance(c, dict) else c}\n\n".encode()
                    for c in chunks)
    rec = _run(200, body)
    assert rec.error is None and rec.text == "a\u2028b\u0085c\u2029"


def test_without_usage_the_deltas_are_counted():
    rec = _run(200, _sse(*[c for c in GOOD if c is not USAGE]))
    assert rec.error is None and rec.output_tokens == 3 and rec.cached_tokens is None


@pytest.mark.parametrize("chunks,needle", [
    ([_delta("a"), USAGE, "[DONE]"], "without a finish_reason"),
    ([_delta("a"), _delta(None, "stop")], "without data: [DONE]"),
    ([_delta("a"), {"error": {"message": "engine failed", "type": "server_error"}}, "[DONE]"], "engine failed"),
    ([_delta("a"), _delta(None, "error"), "[DONE]"], "finish_reason error"),
    ([_delta("a"), "{not json"], "JSONDecodeError"),
], ids=["no-finish", "no-done", "error-chunk", "finish-error", "bad-json"])
def test_a_stream_that_did_not_finish_cleanly_is_an_error(chunks, needle):
    rec = _run(200, _sse(*chunks))
    assert rec.error is not None and needle in rec.error


def test_an_http_error_keeps_status_and_message():
    body = {"error": {"message": "max_tokens too large", "type": "invalid_request_error"}}
    rec = _run(400, json.dumps(body).encode())
    assert rec.status == 400 and rec.error == "HTTP 400: max_tokens too large"


def test_each_round_extends_the_previous_prompt_and_reply():
    conv = conversations(3, 3)[2]
    first = conv.ask(0)
    conv.answer("reply zero")
    second = conv.ask(1)
    assert second[:len(first)] == first and second[len(first)] == {"role": "assistant", "content": "reply zero"}
    assert len({c.turns[0] for c in conversations(64, 1)}) == 64          # the built-in mix: 64 distinct users
    words = Conversation(conversations(2, 2, prompt_words=7)[0].turns)
    assert all(len(t.split()) == 7 for t in words.turns)


def test_percentiles_and_a_row():
    assert pct([1, 2, 3, 4], 50) == 2.5 and pct([5], 99) == 5 and pct([], 50) is None
    recs = [Record(c, 0, start_s=0.0, ttft_s=0.1 * (c + 1), e2e_s=1.0, output_tokens=10) for c in range(4)]
    recs.append(Record(4, 0, start_s=0.5, e2e_s=1.5, error="HTTP 500: x"))
    row = summarise(0, recs)
    assert row["requests"] == 5 and row["errors"] == 1 and row["ttft_p50_ms"] == 250.0
    assert row["out_tok_s"] == 20.0                     # 40 tokens over the 0 .. 2 s span


def test_request_rate_spaces_starts_as_a_poisson_process(monkeypatch):
    """--request-rate R: each start waits for the next arrival; gaps average 1/R (no real sleep)."""
    import asyncio

    from ninfer.benchmarks import http_load
    clock = [0.0]
    monkeypatch.setattr(http_load.time, "perf_counter", lambda: clock[0])

    async def fake_sleep(s):
        clock[0] += s
    monkeypatch.setattr(http_load.asyncio, "sleep", fake_sleep)
    arrivals = http_load.Arrivals(rate=20.0, seed=3)
    starts = []

    async def go():
        for _ in range(2000):
            await arrivals.wait()
            starts.append(clock[0])
    asyncio.run(go())
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert abs(sum(gaps) / len(gaps) - 1 / 20.0) < 0.1 / 20.0
    assert http_load.Arrivals(None).rate is None
