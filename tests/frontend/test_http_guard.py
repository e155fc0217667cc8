"""HTTP robustness below and at the edge of the app (issue 32, item 2), over raw sockets against
the real server in front of a scripted engine: read timeouts for headers and body, the cap on
connections per client address, malformed framing, disconnects logged as one line, and the
API key on every route but the probes."""

from __future__ import annotations

import json
import logging
import socket
import time

import httpx
import pytest

from ninfer.frontend.http_guard import Limits
from ninfer.frontend.render import ChatTokenizer
from ninfer.frontend.server import Server
from tests.frontend.scripted import ScriptedEngine, running

KEY = "guard-key"
LIMITS = Limits(read_timeout_s=1.0, max_connections_per_client=6)
AUTH = b"Authorization: Bearer " + KEY.encode() + b"\r\n"


@pytest.fixture(scope="module")
def guarded(tiny_model):
    engine = ScriptedEngine(ChatTokenizer(tiny_model))
    with running(Server(engine, "tiny", api_key=KEY, limits=LIMITS)) as base:
        yield engine, int(base.rsplit(":", 1)[1])


def _exchange(port: int, data: bytes, wait: float = 5.0) -> tuple[bytes, float]:
    """Send ``data``, read until the server closes (or ``wait`` passes): (reply, seconds)."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(wait)
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except TimeoutError:
            out += b"<still open>"
    return out, time.monotonic() - t0


def _error(reply: bytes, status: int) -> dict:
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), reply[:300]
    assert b"content-type: application/json" in head.lower() and b"connection: close" in head.lower(), head
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_a_body_that_never_arrives_is_a_408_and_the_connection_closes(guarded):
    _, port = guarded
    reply, took = _exchange(port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + AUTH +
                            b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"mo")
    err = _error(reply, 408)
    assert "request body did not arrive within 1 s (4 bytes came)" in err["message"] and err["code"] == "request_timeout"
    assert took < 4


def test_headers_that_never_complete_are_a_408(guarded):
    _, port = guarded
    reply, took = _exchange(port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
    assert "headers did not arrive within 1 s" in _error(reply, 408)["message"] and took < 4


def test_a_kept_alive_connection_that_starts_a_request_slowly_is_a_408(guarded):
    _, port = guarded
    reply, _ = _exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHo")
    first, _, rest = reply.partition(b'{"status":"ok"}')
    assert first.startswith(b"HTTP/1.1 200") and b"headers did not arrive" in rest, reply


def test_a_silent_connection_is_closed(guarded):
    _, port = guarded
    reply, took = _exchange(port, b"")
    assert reply == b"" and took < 4                  # closed, nothing said: nothing was asked


@pytest.mark.parametrize("data", [
    b"GARBAGE\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"GET /health HTTP/1.1\r\nBad Header\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nHost: y\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
], ids=["request-line", "negative-length", "bad-chunk", "header-without-colon", "two-lengths"])
def test_malformed_framing_is_a_400_in_the_openai_shape(guarded, data):
    _, port = guarded
    assert _error(_exchange(port, data)[0], 400)["code"] == "malformed_request"


def test_connections_beyond_the_cap_per_address_are_a_429(guarded):
    _, port = guarded
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(LIMITS.max_connections_per_client)]
    try:
        time.sleep(0.1)
        err = _error(_exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")[0], 429)
        assert err["code"] == "too_many_connections" and "at most 6" in err["message"]
    finally:
        for s in held:
            s.close()
    time.sleep(0.2)
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_a_client_that_goes_away_is_one_line_without_a_traceback(guarded, caplog, stream):
    engine, port = guarded
    engine.delay = 0.05
    body = json.dumps({"messages": [{"role": "user", "content": "word " * 100}], "stream": stream}).encode()
    try:
        with caplog.at_level(logging.INFO, logger="ninfer.server"):
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + AUTH +
                          b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
                time.sleep(0.3)
            deadline = time.monotonic() + 5
            while not engine.handles[-1].cancelled and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.2)
    finally:
        engine.delay = 0.002
    assert engine.handles[-1].cancelled
    mine = [r for r in caplog.records if r.name.startswith("ninfer")]
    assert [r.getMessage().split(" went away")[1] for r in mine if "went away" in r.getMessage()] == \
        [" during POST /v1/chat/completions"]
    assert not any(r.exc_info or r.levelno >= logging.ERROR for r in mine), [r.getMessage() for r in mine]


def test_a_body_cut_off_mid_way_is_one_line(guarded, caplog):
    _, port = guarded
    with caplog.at_level(logging.INFO, logger="ninfer.server"):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + AUTH + b"Content-Length: 100\r\n\r\n{")
            time.sleep(0.2)
        time.sleep(0.3)
    msgs = [r.getMessage() for r in caplog.records if r.name.startswith("ninfer")]
    assert sum("went away during POST /v1/chat/completions" in m for m in msgs) == 1, msgs
    assert not any(r.exc_info for r in caplog.records)


@pytest.mark.parametrize("method,path", [
    ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
    ("POST", "/v1/responses"), ("GET", "/v1/models"), ("GET", "/v1/responses/x"),
])
def test_every_route_but_the_probes_needs_the_key(guarded, method, path):
    _, port = guarded
    base = f"http://127.0.0.1:{port}"
    r = httpx.request(method, base + path, json={"prompt": "x"} if method == "POST" else None, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.request(method, base + path, json={"prompt": "x"} if method == "POST" else None, timeout=10,
                      headers={"authorization": "Bearer wrong"})
    assert r.status_code == 401


def test_the_probes_stay_open_and_anthropic_clients_key_header_is_accepted(guarded):
    _, port = guarded
    base = f"http://127.0.0.1:{port}"
    for path in ("/health", "/version"):
        assert httpx.get(base + path, timeout=10).status_code == 200, path
    r = httpx.post(f"{base}/tokenize", json={"prompt": "hello"}, headers={"x-api-key": KEY}, timeout=10)
    assert r.status_code == 200 and r.json()["count"] > 0
