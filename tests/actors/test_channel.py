"""The step channel's frames and its bounded polling, without Ray: a worker-side ChannelServer
and the controller's frame calls over one Unix socket in this process."""

from __future__ import annotations

import socket
import threading
import time

from ninfer.actors import channel as ch


def test_the_poller_returns_at_once_when_the_frame_is_there_and_leaves_it_unread():
    a, b = socket.socketpair()
    with a, b:
        ch.send_frame(b, ch.OK, b"reply")
        t = time.perf_counter()
        ch.Poller(a).wait(30.0, 30.0)          # would block 30 s, then poll 30 s, if it missed it
        assert time.perf_counter() - t < 10.0
        assert ch.recv_frame(a) == (ch.OK, b"reply")


def test_the_poller_gives_up_after_its_window_and_the_blocking_recv_still_gets_the_frame():
    a, b = socket.socketpair()
    with a, b:
        ch.Poller(a).wait(0.001, 0.001)        # nothing arrives: it returns, having read nothing
        threading.Timer(0.05, ch.send_frame, (b, ch.OK, b"late")).start()
        assert ch.recv_frame(a) == (ch.OK, b"late")


def test_the_blocking_part_wakes_on_a_frame_that_arrives_meanwhile():
    a, b = socket.socketpair()
    with a, b:
        threading.Timer(0.05, ch.send_frame, (b, ch.OK, b"x")).start()
        t = time.perf_counter()
        ch.Poller(a).wait(30.0, 30.0)
        assert time.perf_counter() - t < 10.0
        assert ch.recv_frame(a) == (ch.OK, b"x")


def test_a_closed_peer_ends_the_poll_and_reads_as_closed():
    a, b = socket.socketpair()
    with a:
        b.close()
        ch.Poller(a).wait(30.0, 30.0)
        assert ch.recv_frame(a) is None


def test_the_window_comes_from_the_environment_and_zero_turns_polling_off(monkeypatch):
    monkeypatch.setenv("NINFER_STEP_POLL_US", "0")
    assert ch.poll_window_s() == 0.0
    a, b = socket.socketpair()
    with a, b:
        t = time.perf_counter()
        ch.Poller(a).wait(30.0, ch.poll_window_s())   # no window: no wait at all
        assert time.perf_counter() - t < 10.0
    monkeypatch.setenv("NINFER_STEP_POLL_US", "250")
    assert ch.poll_window_s() == 250e-6


def test_the_server_answers_frames_in_order_and_reports_a_handler_error():
    def handle(data: bytes) -> bytes:
        if data == b"bad":
            raise ValueError("no such plan")
        return data[::-1]
    server = ch.ChannelServer(handle)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(server.address)
    with sock:
        for msg in (b"abc", b"", b"xyz" * 1000):
            ch.send_frame(sock, ch.OK, msg)
            assert ch.recv_frame(sock) == (ch.OK, msg[::-1])
        ch.send_frame(sock, ch.OK, b"bad")
        assert ch.recv_frame(sock) == (ch.ERROR, b"ValueError: no such plan")
        ch.send_frame(sock, ch.OK, b"ok")      # the connection survives the error
        assert ch.recv_frame(sock) == (ch.OK, b"ko")
    server.close()
