"""The cycle's prefill turn end to end (``one-chunk-per-cycle``, ``fresh-chunk-turn``): one
Prefill/Replay chunk runs per cycle, and a fresh bind's first chunk runs only when no resident
took the turn (its bind still happens: it holds a lane and waits for its turn). The rule monitor
checks the same on every cycle; here the frontiers themselves are watched."""

from __future__ import annotations

from tests.engine.harness import oracle
from tests.factories import random_prompt


def _chunks_per_cycle(h, *rids) -> list[list[str]]:
    """Run to the end; per cycle, the requests whose frontier grew by a chunk (more than one)."""
    out = []
    while not h.done(*rids):
        before = {r: (q.frontier if (q := h.req(r)) is not None and q.facts is not None else None) for r in rids}
        h.cycle()
        out.append([r for r in rids if (q := h.req(r)) is not None and q.facts is not None
                    and before[r] is not None and q.frontier - before[r] > 1])
    return out


def test_a_fresh_binds_first_chunk_waits_while_a_residents_chunk_runs(make, tiny_model):
    """A resident is still prefilling when a long prompt arrives: the newcomer binds (a lane is
    free) but its first chunk waits for the turn; never two chunks in a cycle, both prompts
    prefill in turns, and both answers equal the oracle's."""
    h = make(max_concurrency=2, kv_capacity=8 * 64, max_context=512, prefill_chunk_tokens=32,
             context_cache={"host_capacity_bytes": 0})
    pa, pb = random_prompt(200, seed=16), random_prompt(200, seed=17)
    a = h.submit(pa, max_tokens=2)
    h.cycle()
    h.cycle()
    assert h.req(a).frontier < 150, "the resident is still prefilling"
    b = h.submit(pb, max_tokens=2)
    grew = _chunks_per_cycle(h, a, b)
    assert all(len(g) <= 1 for g in grew), grew
    order = [g[0] for g in grew if g]
    assert b in order[:4] and a in order[order.index(b):], order        # in turns, not a first to the end
    for rid, p in ((a, pa), (b, pb)):
        assert h.finals[rid].token_ids == oracle(tiny_model, p, max_tokens=2)
    h.check_clean()


def test_a_replay_resume_takes_the_cycles_chunk_turn(make, tiny_model):
    """B, the oldest, is paused destructively while the younger O prefills; a new arrival wakes
    B, whose Replay resume is a chunk: it takes the cycle's turn (no older resident: no fallback
    chunk for O), and O's next chunk waits. Never two chunks in a cycle; all answers exact."""
    from tests.engine.harness import force_pause

    h = make(max_concurrency=2, kv_capacity=16 * 64, max_context=512, prefill_chunk_tokens=16,
             context_cache={"host_capacity_bytes": 0})
    pb, po, pz = random_prompt(40, seed=18), random_prompt(200, seed=19), random_prompt(8, seed=20)
    b = h.submit(pb, max_tokens=20)
    h.run(until=lambda: len(h.streams.get(b, [])) >= 3)
    o = h.submit(po, max_tokens=2)
    h.cycle()
    h.cycle()
    force_pause(h, b)
    h.run(until=lambda: h.req(b).phase.name == "PAUSED", max_cycles=20)
    assert h.req(o).frontier < 150, "O is still prefilling"
    z = h.submit(pz, max_tokens=2)                 # a real event: B resumes
    grew = _chunks_per_cycle(h, b, o, z)
    assert all(len(g) <= 1 for g in grew), grew
    assert h.finals[b].pauses and h.finals[b].pauses[0].route == "replay"
    for rid, p, n in ((b, pb, 20), (o, po, 2), (z, pz, 2)):
        assert h.finals[rid].token_ids == oracle(tiny_model, p, max_tokens=n)
    h.check_clean()


def test_a_decoding_resident_ahead_in_the_rotation_leaves_the_prefill_turn_alternating(make, tiny_model):
    """chunk-rotation: the chunk's owner goes to the back of the rotation — not the rotation
    turned by one. D, admitted first, decodes at the front of the rotation; A and B prefill
    long prompts in strict alternation."""
    h = make(max_concurrency=3, kv_capacity=12 * 64, max_context=512, prefill_chunk_tokens=32,
             context_cache={"host_capacity_bytes": 0})
    pd, pa, pb = random_prompt(10, seed=21), random_prompt(200, seed=22), random_prompt(200, seed=23)
    d = h.submit(pd, max_tokens=60)
    h.run(until=lambda: len(h.streams.get(d, [])) >= 1)
    a, b = h.submit(pa, max_tokens=2), h.submit(pb, max_tokens=2)
    grew = _chunks_per_cycle(h, d, a, b)
    order = [g[0] for g in grew if g]
    assert order[:6] in ([a, b] * 3, [b, a] * 3), order
    for rid, p, n in ((d, pd, 60), (a, pa, 2), (b, pb, 2)):
        assert h.finals[rid].token_ids == oracle(tiny_model, p, max_tokens=n)
    h.check_clean()
