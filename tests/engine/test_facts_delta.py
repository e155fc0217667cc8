"""Facts deltas (``native/reclaim.FactsSender`` -> wire -> ``engine/facts_mirror.FactsMirror``):
a quote asked against the last one arrives as the messages that changed and every id in order,
and is completed into exactly the complete quote — the same messages in the same order — and
the facts index is told what changed. Model-free: fabricated quotes whose unchanged messages are
the very objects of the quote before (as the worker's ``FactsMemo`` keeps them)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer import protocol as P
from ninfer.engine.facts_mirror import FactsMirror
from ninfer.errors import IntegrityError
from ninfer.native.reclaim import FactsSender
from ninfer.policy import reclaim as R


def _ck(cid: int, version: int) -> P.CheckpointFact:
    return P.CheckpointFact(cid, 1, version, P.CkptKind.CACHE, 64, (), True, False, False, (100 + cid,), None)


def _block(bid: int, version: int) -> P.BlockFact:
    return P.BlockFact(bid, version, "main", (bid - 100,), False, True, False, 64, None)


def _quote(cks: dict, blocks: dict) -> P.Facts:
    """A scoped quote as the worker orders it (checkpoints by id)."""
    return P.Facts({}, 0, (), 1, 1, dict(sorted(cks.items())), dict(blocks), False, partial=True)


def _wire(facts: P.Facts) -> P.Facts:
    return P.decode_reply(P.encode(P.StepReply(seq=1, facts=facts))).facts


ids = st.integers(1, 12)
edits = st.lists(st.tuples(st.sampled_from(["ck", "block"]), ids, st.booleans()), max_size=6)


@settings(max_examples=200, deadline=None)
@given(st.lists(edits, min_size=1, max_size=6), st.lists(st.sampled_from(["ok", "ok", "restart", "lost"]),
                                                         min_size=6, max_size=6))
def test_a_completed_delta_is_the_complete_quote(rounds, events):
    """Whatever came before — a restarted worker, a reply that never reached the controller —
    the completed quote is the complete one; and a quote asked against the one the worker sent
    last is a delta."""
    sender, mirror = FactsSender(), FactsMirror()
    cks = {cid: _ck(cid, 0) for cid in range(1, 6)}
    blocks = {100 + cid: _block(100 + cid, 0) for cid in range(1, 6)}
    delivered = False                    # the controller holds the quote the worker sent last
    for edit, event in zip(rounds, events):
        for kind, key, keep in edit:
            d, make, k = (cks, _ck, key) if kind == "ck" else (blocks, _block, 100 + key)
            if keep:
                d[k] = make(k, (d[k].version + 1) if k in d else 0)    # a new message object
            else:
                d.pop(k, None)
        if event == "restart":
            sender, delivered = FactsSender(), False     # the mirror's base is not its last quote
        full = _quote(cks, blocks)
        sent = sender.send(full, mirror.base)
        assert bool(sent.base) == delivered
        if event == "lost":              # the worker sent it, the controller never completed it
            delivered = False
            continue
        got = mirror.complete(_wire(sent))
        delivered = True
        assert got.seq == sender.seq and got.base == 0 and not got.check
        assert msgspec_equal(got, full) and list(got.checkpoints) == sorted(cks) and list(got.blocks) == list(blocks)
        if sent.base:                    # a delta carries only what is not the last quote's own object
            assert set(sent.checkpoints) <= set(cks) and len(sent.checkpoints) <= len(edit)


def msgspec_equal(got: P.Facts, full: P.Facts) -> bool:
    return got == msgspec.structs.replace(full, seq=got.seq)


def test_a_delta_ships_what_changed_and_tells_the_index():
    sender, mirror = FactsSender(), FactsMirror()
    cks = {cid: _ck(cid, 0) for cid in range(1, 40)}
    blocks = {100 + cid: _block(100 + cid, 0) for cid in range(1, 40)}
    first = mirror.complete(_wire(sender.send(_quote(cks, blocks), mirror.base)))
    R.facts_index(first).touches(1)
    cks[3] = _ck(3, 1)
    del blocks[105]
    sent = sender.send(_quote(cks, blocks), mirror.base)
    assert sent.base == first.seq and list(sent.checkpoints) == [3] and not sent.blocks
    # (the suite's NINFER_CHECK_FACTS has the complete quote ride along: not counted)
    assert len(P.encode(msgspec.structs.replace(sent, check=b""))) < len(P.encode(_quote(cks, blocks))) // 3
    got = mirror.complete(_wire(sent))
    ix = R.facts_index(got)          # brought forward on what the delta said changed (103 went)
    assert "touch" in ix.computed()
    ix.check_against_fresh()


def test_a_delta_the_mirror_cannot_complete_is_an_integrity_error():
    sender, mirror = FactsSender(), FactsMirror()
    q = _quote({1: _ck(1, 0)}, {101: _block(101, 0)})
    mirror.complete(_wire(sender.send(q, mirror.base)))
    delta = _wire(sender.send(q, mirror.base))
    assert delta.base == 1
    with pytest.raises(IntegrityError, match="facts delta"):
        FactsMirror().complete(delta)
