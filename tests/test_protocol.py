"""Every protocol struct round-trips through its bytes (msgpack, typed decoding): the same
bytes travel over the in-process channel and over Ray."""

from __future__ import annotations

import array
import inspect
import re
import typing
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ninfer import protocol as P

STRUCTS = sorted((obj for _, obj in inspect.getmembers(P, inspect.isclass)
                  if issubclass(obj, msgspec.Struct) and obj.__module__ == P.__name__),
                 key=lambda c: c.__name__)


def _strategy(tp):
    """Every field drawn explicitly (hypothesis would otherwise pass msgspec's default
    factories through as values)."""
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        fields = msgspec.structs.fields(tp)
        return st.builds(tp, **{f.name: st.deferred(lambda t=f.type: _strategy(t)) for f in fields})
    origin = getattr(tp, "__origin__", None)
    args = getattr(tp, "__args__", ())
    if origin in (list,):
        return st.lists(_strategy(args[0]), max_size=3)
    if origin is dict:
        return st.dictionaries(_strategy(args[0]), _strategy(args[1]), max_size=3)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(_strategy(args[0]), max_size=3).map(tuple)
        return st.tuples(*[_strategy(a) for a in args])
    if args and type(tp).__name__ in ("UnionType", "_UnionGenericAlias") or origin is typing.Union:
        return st.one_of([_strategy(a) for a in args])
    return st.from_type(tp)


# msgpack carries 64-bit integers; NaN != NaN, so keep drawn floats finite
st.register_type_strategy(int, st.integers(-(2**62), 2**62))
st.register_type_strategy(float, st.floats(allow_nan=False, allow_infinity=False))


@pytest.mark.parametrize("cls", STRUCTS, ids=lambda c: c.__name__)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_struct_round_trips(cls, data):
    value = data.draw(_strategy(cls))
    raw = P.encode(value)
    assert msgspec.msgpack.decode(raw, type=cls) == value


def test_every_struct_is_covered():
    names = {c.__name__ for c in STRUCTS}
    for required in ("StepPlan", "StepReply", "WorkerInfo", "Facts", "Commit", "TokensEvent", "FinalEvent"):
        assert required in names


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=_strategy(P.StepPlan), reply=_strategy(P.StepReply), ev=_strategy(P.Event))
def test_channel_decoders(plan, reply, ev):
    assert P.decode_plan(P.encode(plan)) == plan
    assert P.decode_reply(P.encode(reply)) == reply
    assert P.decode_event(P.encode(ev)) == ev


@given(st.lists(st.integers(-2**31, 2**31 - 1)))
def test_tokens_pack_as_int32(tokens):
    data = P.pack_tokens(tokens)
    assert len(data) == 4 * len(tokens)
    assert P.unpack_tokens(data) == tokens
    assert P.pack_tokens(tuple(tokens)) == data == array.array("i", tokens).tobytes()   # little-endian hosts


def test_a_token_beyond_int32_is_refused_as_before():
    """Out of int32, or not an integer: the errors ``array`` raised (callers name the request)."""
    with pytest.raises(OverflowError):
        P.pack_tokens([1, 2**31])
    with pytest.raises(TypeError):
        P.pack_tokens([1, 2.5])


def test_event_union_keeps_old_encodings():
    """Adding the lifecycle event to the Event union leaves the older token and final
    encodings decoding as before (array-like: tag first, then the fields)."""
    old_tokens = msgspec.msgpack.encode(["tokens", "r1", 0, [5, 6]])
    assert P.decode_event(old_tokens) == P.TokensEvent("r1", 0, [5, 6])
    old_final = msgspec.msgpack.encode(["final", "r1", 0, [5], {"prompt_tokens": 3}, {"ttft_s": 0.1}, []])
    assert P.decode_event(old_final) == P.FinalEvent("r1", P.FinishReason.STOP, [5], P.Usage(prompt_tokens=3),
                                                     P.Timings(ttft_s=0.1), [])
    life = P.LifecycleEvent("r1", P.Life.PAUSED, 1.5, 2.5, route="replay", reason="forced", frontier=64)
    assert P.decode_events(P.encode([life, P.TokensEvent("r1", 0, [1])]))[0] == life
    assert str(P.Life.GENERATION_START) == "generation_start"


# ---- a request's result: typed usage, timings, pauses and failure --------------------------------

def _final() -> P.FinalEvent:
    return P.FinalEvent(
        "r1", P.FinishReason.ERROR, [5, 6],
        P.Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1, prefill_tokens=2, replay_tokens=4),
        P.Timings(ttft_s=0.5, e2e_s=1.5, max_output_gap_s=0.25, queue_s=0.1, arrival=10.0, admitted_at=10.1,
                  paused_s=0.2, source_wait_s=0.0),
        [P.PauseEntry("snapshot", 64, 10.2, 10.4), P.PauseEntry("replay", 70, 11.0)],
        P.Failure(P.ErrorKind.WORKER_LOST, "it went", retryable=True), prompt_token_ids=[1, 2, 3])


def test_final_event_round_trips_with_typed_fields():
    ev = P.decode_event(P.encode(_final()))
    assert ev == _final()
    assert isinstance(ev.usage, P.Usage) and isinstance(ev.timings, P.Timings)
    assert all(isinstance(p, P.PauseEntry) for p in ev.pauses) and ev.pauses[1].resumed_at is None
    assert ev.error.kind is P.ErrorKind.WORKER_LOST and ev.error.retryable
    lost = P.FinalEvent("r2", P.FinishReason.CANCELLED, [], None, None, [])    # ended outside the engine
    assert P.decode_event(P.encode(lost)) == lost


def test_result_structs_encode_as_the_former_dicts():
    """An older FinalEvent (dicts) still decodes, and a Failure / PauseEntry is on the wire the
    dict it replaced (``retryable`` and ``resumed_at`` only when set)."""
    raw = lambda v: msgspec.msgpack.decode(P.encode(v))       # noqa: E731
    assert raw(P.Failure(P.ErrorKind.TIMEOUT, "m")) == {"type": "timeout", "message": "m"}
    assert raw(P.Failure(P.ErrorKind.REPLICA_LOST, "m", True)) == {"type": "replica_lost", "message": "m",
                                                                  "retryable": True}
    assert raw(P.PauseEntry("replay", 3, 1.0)) == {"route": "replay", "frontier": 3, "paused_at": 1.0}
    old = msgspec.msgpack.encode(["final", "r1", 3, [], {}, {}, [{"route": "replay", "frontier": 3, "paused_at": 1.0,
                                                                 "resumed_at": 2.0}],
                                  {"type": "device_error", "message": "m"}])
    ev = P.decode_event(old)
    assert ev.pauses == [P.PauseEntry("replay", 3, 1.0, 2.0)] and ev.error == P.Failure(P.ErrorKind.DEVICE_ERROR, "m")


def test_an_unknown_error_kind_does_not_decode():
    bad = msgspec.msgpack.encode(["final", "r1", 3, [], None, None, [], {"type": "oops", "message": "m"}])
    with pytest.raises(msgspec.ValidationError, match="oops|enum"):
        P.decode_event(bad)
    life = ["life", "r1", int(P.Life.FINISHED), 1.0, 2.0, None, None, None, None, 3, "timeout"]
    assert P.decode_event(msgspec.msgpack.encode(life)).error is P.ErrorKind.TIMEOUT
    with pytest.raises(msgspec.ValidationError):
        P.decode_event(msgspec.msgpack.encode(life[:-1] + ["oops"]))
    with pytest.raises(TypeError):                     # a plain string is no kind, even a valid one
        P.Failure("timeout", "m")


def test_the_public_output_keeps_its_shapes():
    """``Output`` from a typed FinalEvent: ``error`` and ``pauses`` are the documented dicts,
    ``usage`` / ``timings`` the same attributes and values; an event made outside the engine
    (no books) gives zero usage and empty timings."""
    from ninfer.api import Engine, RequestHandle, TimingsView, UsageView

    class Runtime:
        info, client_id = None, "c"

        def attach(self, sink):
            pass

    eng = Engine(Runtime(), None, "inproc")
    for rid in ("r1", "r2"):
        eng._handles[rid] = RequestHandle(eng, rid)
    h1, h2 = eng._handles["r1"], eng._handles["r2"]
    eng._on_event(_final())
    out = h1.result(0)
    assert out.error == {"type": "worker_lost", "message": "it went", "retryable": True}
    assert type(out.error["type"]) is str
    assert out.pauses == [{"route": "snapshot", "frontier": 64, "paused_at": 10.2, "resumed_at": 10.4},
                          {"route": "replay", "frontier": 70, "paused_at": 11.0}]
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.cached_tokens,
            out.usage.prefill_tokens, out.usage.replay_tokens) == (3, 2, 1, 2, 4)
    assert out.timings == TimingsView(0.5, 1.5, 0.25, 0.1, 10.0, 10.1, 0.2, 0.0)
    assert h1.events()[-1]["error"] == "worker_lost" and type(h1.events()[-1]["error"]) is str
    eng._on_event(P.FinalEvent("r2", P.FinishReason.ERROR, [], None, None, [],
                               P.Failure(P.ErrorKind.REQUEST_ERROR, "bad")))
    out = h2.result(0)
    assert out.error == {"type": "RequestError", "message": "bad"} and out.pauses == []
    assert out.usage == UsageView() and out.timings == TimingsView()
    assert (out.timings.ttft_s, out.timings.max_output_gap_s, out.timings.paused_s) == (None, 0.0, 0.0)


def test_lost_error_takes_only_a_lost_kind():
    from ninfer.errors import LOST_KINDS, lost_error
    for kind in LOST_KINDS:
        f = lost_error(kind, "gone")
        assert f.retryable and f.kind is kind and f.message.startswith("gone; ")
    with pytest.raises(ValueError):
        lost_error(P.ErrorKind.DEVICE_ERROR, "x")


def test_every_error_kind_is_documented():
    """docs/api.md "Error types" lists exactly the ErrorKind values."""
    doc = (Path(__file__).resolve().parent.parent / "docs/api.md").read_text()
    section = doc.split("### Error types (`Output.error`)", 1)[1].split("\n### ", 1)[0]
    listed = re.findall(r"^\| `([A-Za-z_]+)` \|", section, flags=re.M)
    assert sorted(listed) == sorted(k.value for k in P.ErrorKind), listed
