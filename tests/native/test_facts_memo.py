"""The quote's kept messages (native/reclaim.py ``FactsMemo``): after each kind of change a
Program makes — a root bind, units and captures, a freeze, a Fork and a Move of a resident
point, demotions of its image and pages, a read-back from the Host, a pause, a deletion — the
memoised quote equals one built from scratch, whole and scoped. The Hypothesis state machine
(test_program_machine.py) checks the same after random steps; this walks each change on purpose."""

from __future__ import annotations

import pytest

from ninfer.native.program import BindMode
from ninfer.native.reclaim import quote, quote_from_scratch
from ninfer.protocol import Delete, DemoteBlocks, DemoteState
from tests.factories import random_prompt
from tests.native.program_driver import make_program, new_seq, settle_transfers, step


def _same(prog, what: str) -> None:
    for window in (None, []):
        got, want = quote(prog, window), quote_from_scratch(prog, window)
        assert got == want, f"after {what} (window {window}): memo {got} != scratch {want}"
        assert list(got.blocks) == list(want.blocks) and list(got.checkpoints) == list(want.checkpoints), what


@pytest.fixture
def prog(tiny_model):
    p = make_program(tiny_model, max_concurrency=3, max_context=512, kv_capacity=24 * 64,
                     context_cache={"device_state_slots": 3, "host_capacity_bytes": 16 << 20}, copy_engine="inline")
    yield p
    p.shutdown()


def test_memoised_facts_follow_every_kind_of_change(prog):
    prompt = random_prompt(150, seed=7)
    a = new_seq(prog, prompt, 4)
    _same(prog, "a new sequence")
    prog.bind(a, None, BindMode.FORK, first_tokens=64)
    _same(prog, "a root bind")
    settle_transfers(prog)
    step(prog, a, chunk=64, capture_owner="cap-a")
    _same(prog, "a unit with a capture")
    while not a.finished:
        step(prog, a, chunk=64)
    e = prog.freeze(a, "E-a")
    _same(prog, "a freeze")

    # a Fork of the resident point: the new sequence joins every page's holders
    b = new_seq(prog, list(e.tokens) + random_prompt(20, seed=8), 2)
    out = prog.bind(b, e, BindMode.FORK, first_tokens=8)
    assert out.ok, out
    _same(prog, "a Fork of a resident point")
    settle_transfers(prog)
    step(prog, b, chunk=8)
    _same(prog, "a unit past the forked point")

    # demotions of the point's image and pages (its pages are shared with b: those stay pinned)
    f = quote(prog)
    prog.apply([DemoteState(e.cid, e.generation, f.checkpoints[e.cid].version)])
    settle_transfers(prog)
    _same(prog, "a state demotion")
    prog.release(b)
    _same(prog, "a release")
    f = quote(prog)
    bids = tuple(x for x in f.checkpoints[e.cid].blocks if f.blocks[x].device and not f.blocks[x].pinned)
    assert bids
    prog.apply([DemoteBlocks(e.cid, e.generation, bids, tuple(f.blocks[x].version for x in bids))])
    settle_transfers(prog)
    _same(prog, "a page demotion")

    # a Fork of the demoted point reads its image and pages: leased until the copies publish
    d = new_seq(prog, list(e.tokens) + random_prompt(12, seed=10), 2)
    assert prog.bind(d, e, BindMode.FORK, first_tokens=8).ok
    _same(prog, "a Fork that reads the point back")
    settle_transfers(prog)
    _same(prog, "its read-back settled")
    prog.release(d)
    _same(prog, "the forked sequence released")

    # a Move of the demoted point reads it back from the Host
    c = new_seq(prog, list(e.tokens) + random_prompt(10, seed=9), 2)
    assert prog.bind(c, e, BindMode.MOVE, first_tokens=8, mover="E-a").ok
    _same(prog, "a Move that reads the point back")
    settle_transfers(prog)
    _same(prog, "the read-back settled")
    step(prog, c, chunk=8)
    prog.pause(c, to_host=True)
    settle_transfers(prog)
    _same(prog, "a pause to the Host")
    prog.release(c)
    _same(prog, "the paused sequence released")
    for ck in list(prog.checkpoints.values()):
        f = quote(prog)
        prog.apply([Delete(ck.cid, ck.generation, f.checkpoints[ck.cid].version)])
        _same(prog, "a deletion")
    assert prog.is_empty()


def test_a_new_point_over_a_shared_prefix_reports_no_sibling_placement(prog):
    """The placement report (``Program.placement_changes``, the controller's restore-cost mirror)
    is O(what changed): a point forked from a shared prefix joins the holders of the prefix's
    pages, which moves no page — the points already above that prefix are not reported again
    (a shared system prompt has hundreds of them). The memoised quote still follows (holders
    are facts)."""
    e = new_seq(prog, random_prompt(128, seed=21), 1)
    prog.bind(e, None, BindMode.FORK, first_tokens=128)
    settle_transfers(prog)
    while not e.finished:
        step(prog, e, chunk=128)
    base = prog.freeze(e, "E-base")
    prog.placement_changes()
    siblings = []
    for i in range(3):
        s = new_seq(prog, list(base.tokens) + random_prompt(6, seed=30 + i), 1)
        assert prog.bind(s, base, BindMode.FORK, first_tokens=6).ok
        settle_transfers(prog)
        while not s.finished:
            step(prog, s, chunk=8)
        siblings.append(prog.freeze(s, f"E-{i}").cid)
        reported = {cid for cid, *_ in prog.placement_changes()}
        assert base.cid not in reported and not reported & set(siblings[:-1]), (i, reported)
        _same(prog, f"sibling {i}")
