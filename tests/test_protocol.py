"""Every protocol struct round-trips through its bytes (msgpack, typed decoding): the same
bytes travel over the in-process channel and over Ray."""

from __future__ import annotations

import inspect
import typing

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


@given(st.lists(st.integers(0, 2**31 - 1)))
def test_tokens_pack_as_int32(tokens):
    data = P.pack_tokens(tokens)
    assert len(data) == 4 * len(tokens)
    assert P.unpack_tokens(data) == tokens


def test_event_union_keeps_old_encodings():
    """Adding the lifecycle event to the Event union leaves the older token and final
    encodings decoding as before (array-like: tag first, then the fields)."""
    old_tokens = msgspec.msgpack.encode(["tokens", "r1", 0, [5, 6]])
    assert P.decode_event(old_tokens) == P.TokensEvent("r1", 0, [5, 6])
    old_final = msgspec.msgpack.encode(["final", "r1", 0, [5], {"prompt_tokens": 3}, {"ttft_s": 0.1}, []])
    assert P.decode_event(old_final) == P.FinalEvent("r1", P.FinishReason.STOP, [5], {"prompt_tokens": 3},
                                                     {"ttft_s": 0.1}, [])
    life = P.LifecycleEvent("r1", P.Life.PAUSED, 1.5, 2.5, route="replay", reason="forced", frontier=64)
    assert P.decode_events(P.encode([life, P.TokensEvent("r1", 0, [1])]))[0] == life
    assert str(P.Life.GENERATION_START) == "generation_start"
