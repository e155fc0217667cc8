"""The Program in float64: every way of reaching a position — fresh, continued from a checkpoint
(Move / Fork, Device / Host, aligned / unaligned), exact hit, generation end, Snapshot, Replay —
gives the tokens of the isolated oracle. Every test ends with nothing held."""

from __future__ import annotations

import pytest

from ninfer.faults import Fault
from ninfer.native.layout import MAIN, STATE
from ninfer.native.program import BindMode, UnitKind, UnitRow
from ninfer.native.reclaim import quote
from ninfer.protocol import Delete, DemoteBlocks, DemoteState, DropHostCopy, Phase, Refusal, SnapshotOwner
from ninfer.reference import reference_generate
from tests.factories import random_prompt
from tests.native.program_driver import make_program, new_seq, row, run_batch, run_to_end, settle_transfers, step


@pytest.fixture
def prog(tiny_model):
    p = make_program(tiny_model, max_concurrency=4, kv_capacity=2048,
                     context_cache={"host_capacity_bytes": 32 << 20})
    yield p
    p.check_integrity(idle=True)
    assert p.is_empty(), "something leaked"
    p.shutdown()


@pytest.fixture
def oracle(tiny_model):
    def run(prompt, n=8, **kw):
        return reference_generate(tiny_model, prompt, max_tokens=n, dtype="float64", ignore_eos=True, **kw)
    return run


def _restores_exactly_then_empty(prog, ck, prompt, oracle, n: int) -> None:
    """A Fork of ``ck`` continues exactly; once it and the owner "rec" let go, nothing is held."""
    s = new_seq(prog, prompt + [7], n)
    assert prog.bind(s, ck, BindMode.FORK, first_tokens=1).ok
    settle_transfers(prog)
    assert run_to_end(prog, s) == oracle(prompt + [7], n)
    prog.release(s)
    prog.release_owner(ck, "rec")
    prog.check_integrity(idle=True)
    assert prog.is_empty()
    prog.shutdown()


def _capture_at(prog, prompt, owner="rec", where="auto"):
    """Prefill ``prompt`` in one unit and save its end as a checkpoint; release the sequence."""
    s = new_seq(prog, prompt, 4)
    assert prog.bind(s, None).ok
    assert not prog.reserve_unit(s, len(prompt))
    filler = None
    if where == "host":                  # no free Device slot: the save goes to the Host
        filler = prog.pools[STATE].available
        prog.pools[STATE].reserve(filler)
    r = row(prog, s, len(prompt), UnitKind.PREFILL, owner)
    if filler:
        prog.pools[STATE].unreserve(filler)
    [res] = prog.execute([r])
    prog.settle(s)
    settle_transfers(prog)
    prog.release(s)
    assert res.captured is not None and res.captured.frontier == len(prompt)
    return res.captured


def _demote_all(prog, ck):
    f = quote(prog)
    cf = f.checkpoints[ck.cid]
    res = prog.apply([DemoteState(ck.cid, ck.generation, cf.version),
                        DemoteBlocks(ck.cid, ck.generation, cf.blocks, tuple(f.blocks[b].version for b in cf.blocks))])
    assert res.ok, res.reason
    settle_transfers(prog)
    assert ck.image.slot is None and all(b.page is None for b in ck.blocks[MAIN])


@pytest.mark.parametrize("n", [1, 63, 64, 65, 129])
def test_fresh_sequence_matches_oracle(prog, oracle, n):
    prompt = random_prompt(n, seed=n)
    s = new_seq(prog, prompt, 10)
    assert prog.bind(s, None).ok
    assert run_to_end(prog, s, chunk=40) == oracle(prompt, 10)
    prog.release(s)


def test_batched_rows_with_one_chunk_per_call(prog, oracle):
    prompts = [random_prompt(n, seed=100 + n) for n in (5, 70, 129, 3)]
    seqs = [new_seq(prog, p, 12, temperature=0.8, seed=i) for i, p in enumerate(prompts)]
    for s in seqs:
        assert prog.bind(s, None).ok
    run_batch(prog, seqs, chunk=33)
    for i, (p, s) in enumerate(zip(prompts, seqs)):
        assert s.outputs == oracle(p, 12, temperature=0.8, seed=i)
        prog.release(s)


@pytest.mark.parametrize("where", ["device", "host"])
@pytest.mark.parametrize("mode", [BindMode.FORK, BindMode.MOVE])
@pytest.mark.parametrize("frontier,suffix", [(64, 10), (100, 30), (128, 1), (70, 70)],
                         ids=["aligned", "unaligned", "aligned-2", "unaligned-long"])
def test_continue_from_checkpoint(prog, oracle, where, mode, frontier, suffix):
    full = random_prompt(frontier + suffix, seed=frontier)
    ck = _capture_at(prog, full[:frontier])
    if where == "host":
        _demote_all(prog, ck)
    s = new_seq(prog, full, 8)
    out = prog.bind(s, ck, mode, first_tokens=suffix, mover="rec")
    assert out.ok and (out.tid is not None) == (where == "host")
    settle_transfers(prog)
    assert run_to_end(prog, s) == oracle(full)
    prog.release(s)
    if mode is BindMode.FORK:
        assert ck.cid in prog.checkpoints
        prog.release_owner(ck, "rec")
    else:
        assert ck.cid not in prog.checkpoints


def test_two_forks_of_one_unaligned_point_copy_the_tail(prog, oracle):
    """Both branches share the full pages; the second writer must copy the partly filled tail
    (the first one claimed the append right), and neither disturbs the other."""
    base = random_prompt(100, seed=5)
    ck = _capture_at(prog, base)
    a, b = base + random_prompt(20, seed=6), base + random_prompt(20, seed=7)
    sa, sb = new_seq(prog, a, 6), new_seq(prog, b, 6)
    assert prog.bind(sa, ck, BindMode.FORK, first_tokens=20).ok
    assert prog.bind(sb, ck, BindMode.FORK, first_tokens=20).ok
    assert sa.blocks[MAIN][0] is sb.blocks[MAIN][0]          # full page shared
    run_batch(prog, [sa, sb], chunk=64)
    assert sa.blocks[MAIN][1] is not sb.blocks[MAIN][1]      # tail copied by one of them
    assert sa.outputs == oracle(a, 6) and sb.outputs == oracle(b, 6)
    # the checkpoint itself is still exact: a third continuation matches too
    c = base + random_prompt(3, seed=8)
    sc = new_seq(prog, c, 6)
    assert prog.bind(sc, ck, BindMode.FORK, first_tokens=3).ok
    assert run_to_end(prog, sc) == oracle(c, 6)
    for s in (sa, sb, sc):
        prog.release(s)
    prog.release_owner(ck, "rec")


def test_inner_input_point_copies_no_kv(prog, oracle):
    """Saving a point inside a partly filled page adds a state image and no page; the writer
    keeps appending in place."""
    prompt = random_prompt(90, seed=9)
    s = new_seq(prog, prompt, 8)
    assert prog.bind(s, None).ok
    used_before = prog.pools[MAIN].used
    assert not prog.reserve_unit(s, 90)
    [r] = prog.execute([row(prog, s, 90, UnitKind.PREFILL, "in")])
    prog.settle(s)
    assert prog.pools[MAIN].used == used_before + 2           # just the sequence's own pages
    assert r.captured.blocks[MAIN] == s.blocks[MAIN]
    assert run_to_end(prog, s) == oracle(prompt)
    prog.release(s)
    prog.release_owner(r.captured, "in")


@pytest.mark.parametrize("where", ["device", "host"])
def test_exact_hit_samples_from_continuation_hidden(prog, oracle, where):
    prompt = random_prompt(77, seed=11)
    ck = _capture_at(prog, prompt)
    if where == "host":
        _demote_all(prog, ck)
    s = new_seq(prog, prompt, 8, temperature=1.0, seed=3)
    assert prog.bind(s, ck, BindMode.FORK, first_tokens=0).ok
    settle_transfers(prog)
    [r] = prog.execute([UnitRow(s, 0, UnitKind.CONTROL)])      # nothing to compute: just sample
    assert len(r.committed) == 1 and s.frontier == 77
    assert run_to_end(prog, s) == oracle(prompt, 8, temperature=1.0, seed=3)
    prog.release(s)
    prog.release_owner(ck, "rec")


def test_generation_end_serves_the_next_turn(prog, oracle):
    turn1 = random_prompt(50, seed=12)
    s = new_seq(prog, turn1, 10)
    assert prog.bind(s, None).ok
    out1 = run_to_end(prog, s)
    e = prog.freeze(s, owner="rec")
    assert e.frontier == len(turn1) + len(out1) - 1          # the last output is committed, not computed
    turn2 = turn1 + out1 + random_prompt(15, seed=13)
    s2 = new_seq(prog, turn2, 8)
    assert prog.bind(s2, e, BindMode.MOVE, first_tokens=16, mover="rec").ok
    assert run_to_end(prog, s2) == oracle(turn2)
    prog.release(s2)


def test_snapshot_pause_frees_the_device_and_reads_back(prog, oracle):
    """A Snapshot pause demotes the sequence's unique content to the Host in one commit: its
    slot and pages leave the Device once the copy publishes; the resume reads them back."""
    prompt = random_prompt(80, seed=14)
    s = new_seq(prog, prompt, 12, temperature=0.9, seed=5)
    assert prog.bind(s, None).ok
    step(prog, s, chunk=50)                   # mid-prefill
    step(prog, s, chunk=50)                   # prefill done, first token
    step(prog, s)                             # a decode
    free = {k: prog.pools[k].free for k in (MAIN, STATE)}
    r = prog.pause(s, to_host=True)
    snap = r.snapshot
    assert snap is not None and r.tid is not None and s.slot is None and s.phase is Phase.PAUSED
    settle_transfers(prog)
    assert prog.pools[MAIN].free == free[MAIN] + 2 and prog.pools[STATE].free == free[STATE] + 1
    assert snap.image.slot is None and all(b.page is None for b in snap.blocks[MAIN])
    h2d = prog.bytes_h2d
    assert prog.bind(s, snap, BindMode.MOVE, first_tokens=1, mover=SnapshotOwner(s.sid)).ok
    settle_transfers(prog)
    assert prog.bytes_h2d - h2d == prog.mem.image_bytes + 2 * prog.mem.page_bytes
    assert run_to_end(prog, s) == oracle(prompt, 12, temperature=0.9, seed=5)
    prog.release(s)


def test_snapshot_pause_without_host_room_is_destructive(tiny_model, oracle):
    prog = make_program(tiny_model, kv_capacity=2048, context_cache={"host_capacity_bytes": 0})
    prompt = random_prompt(40, seed=14)
    s = new_seq(prog, prompt, 6)
    assert prog.bind(s, None).ok
    step(prog, s)
    step(prog, s)
    free = prog.pools[MAIN].free
    r = prog.pause(s, to_host=True)
    assert r.snapshot is None and r.tid is None and r.freed[MAIN] == 1 and prog.pools[MAIN].free == free + 1
    assert prog.bind(s, None, first_tokens=len(s.ledger) - 1).ok        # Replay from the root
    while s.frontier < len(s.ledger) - 1:
        step(prog, s, stop_at=len(s.ledger) - 1)
    assert run_to_end(prog, s) == oracle(prompt, 6)
    prog.release(s)
    prog.check_integrity(idle=True)
    assert prog.is_empty()
    prog.shutdown()


@pytest.mark.parametrize("from_point", [False, True], ids=["replay-from-root", "replay-from-input-point"])
def test_destructive_pause_then_replay(prog, oracle, from_point):
    prompt = random_prompt(70, seed=15)
    ck = _capture_at(prog, prompt[:40]) if from_point else None
    s = new_seq(prog, prompt, 12, temperature=0.7, seed=9)
    assert prog.bind(s, None).ok
    for _ in range(6):
        step(prog, s, chunk=30)
    paused_at = s.frontier
    committed = list(s.outputs)
    assert prog.pause(s).snapshot is None
    assert prog.bind(s, ck, BindMode.FORK, first_tokens=10).ok
    while s.frontier < paused_at:             # Replay: recompute, never re-sample
        r = step(prog, s, chunk=25, stop_at=paused_at)
        assert r.committed == []
    assert s.outputs == committed
    assert run_to_end(prog, s) == oracle(prompt, 12, temperature=0.7, seed=9)
    prog.release(s)
    if ck is not None:
        prog.release_owner(ck, "rec")


def test_multi_pool_reservation_is_atomic(prog):
    s = new_seq(prog, random_prompt(10, seed=1), 4)
    free = {k: prog.pools[k].available for k in (MAIN, STATE)}
    # a bind needing more pages than exist: nothing stays reserved, the shortfall is exact
    big = new_seq(prog, random_prompt(10, seed=2), 4)
    big.ledger = random_prompt(prog.layout.main_pages * 64 + 70, seed=3)
    out = prog.bind(big, None, first_tokens=len(big.ledger))
    assert not out.ok and out.shortfall == {MAIN: 2}
    assert {k: prog.pools[k].available for k in (MAIN, STATE)} == free
    prog.release(big)
    prog.release(s)


def test_stale_commit_is_refused_and_changes_nothing(prog):
    ck = _capture_at(prog, random_prompt(30, seed=4))
    f = quote(prog)
    prog.add_owner(ck, "other")                    # holders changed after the quote
    res = prog.apply([Delete(ck.cid, ck.generation, f.checkpoints[ck.cid].version)])
    assert not res.ok and "stale" in res.reason
    assert ck.cid in prog.checkpoints
    prog.release_owner(ck, "other")
    f = quote(prog)
    res = prog.apply([Delete(ck.cid, ck.generation, f.checkpoints[ck.cid].version)])
    assert res.ok and res.freed[STATE] == 1 and ck.cid not in prog.checkpoints


def test_late_duplicate_and_reordered_completions_change_nothing(tiny_model, oracle):
    faults = [Fault(kind="completion_duplicate", count=0), Fault(kind="completion_reorder", count=0, steps=2)]
    prog = make_program(tiny_model, kv_capacity=2048, context_cache={"host_capacity_bytes": 32 << 20}, faults=faults)
    prompt = random_prompt(66, seed=21)
    ck = _capture_at(prog, prompt[:64], where="host")   # a Host capture is a transaction
    assert ck.image.slot is None and ck.image.host is not None and ck.image.leases == 0
    f = quote(prog)
    cf = f.checkpoints[ck.cid]
    res = prog.apply([DemoteBlocks(ck.cid, ck.generation, cf.blocks, tuple(f.blocks[b].version for b in cf.blocks))])
    assert res.ok and res.tid is not None
    tx = prog.tx
    settled = settle_transfers(prog)                          # duplicates arrive too: ignored
    assert [s.tid for s in settled] == [tx.tid]
    assert prog.publish(tx.tid, tx.generation) is None        # a late copy of the same completion
    assert prog.publish(tx.tid, tx.generation + 1) is None    # a reused descriptor's generation
    assert all(b.page is None for b in ck.blocks[MAIN])
    s = new_seq(prog, prompt, 6)
    assert prog.bind(s, ck, BindMode.FORK, first_tokens=2).ok
    settle_transfers(prog)
    assert run_to_end(prog, s) == oracle(prompt, 6)
    prog.release(s)
    prog.release_owner(ck, "rec")
    prog.check_integrity(idle=True)
    assert prog.is_empty()
    prog.shutdown()


def test_cancel_during_read_back_waits_for_the_reader(tiny_model):
    prog = make_program(tiny_model, kv_capacity=2048, context_cache={"host_capacity_bytes": 32 << 20},
                        faults=[Fault(kind="completion_delay", count=0, steps=3)])
    prompt = random_prompt(64, seed=22)
    ck = _capture_at(prog, prompt)
    _demote_all(prog, ck)
    s = new_seq(prog, prompt + [1, 2], 4)
    out = prog.bind(s, ck, BindMode.FORK, first_tokens=2)
    assert out.tid is not None
    prog.release(s)                                  # cancel while the copy is in flight
    assert s.cancel_requested and prog.tx is not None
    settle_transfers(prog)
    prog.release_owner(ck, "rec")
    prog.check_integrity(idle=True)
    assert prog.is_empty()
    prog.shutdown()


def test_move_refused_when_others_hold_the_source(prog):
    ck = _capture_at(prog, random_prompt(20, seed=30))
    prog.add_owner(ck, "public")
    s = new_seq(prog, random_prompt(20, seed=30) + [5], 4)
    out = prog.bind(s, ck, BindMode.MOVE, first_tokens=1, mover="rec")
    assert not out.ok and out.refusal is Refusal.NOT_MOVABLE and "cannot be moved" in out.detail
    prog.release(s)
    prog.release_owner(ck, "public")
    prog.release_owner(ck, "rec")


def test_adoption_verifies_exact_tokens(prog):
    ck = _capture_at(prog, random_prompt(20, seed=31))
    other = random_prompt(25, seed=32)
    s = new_seq(prog, other, 4)
    out = prog.bind(s, ck, BindMode.FORK, first_tokens=5)
    assert not out.ok and out.refusal is Refusal.NOT_EXACT and "not an exact prefix" in out.detail
    prog.release(s)
    prog.release_owner(ck, "rec")


def test_dropped_completion_is_recovered_after_timeout(tiny_model, oracle):
    prog = make_program(tiny_model, kv_capacity=2048, context_cache={"host_capacity_bytes": 32 << 20},
                        faults=[Fault(kind="completion_drop")])
    prompt = random_prompt(40, seed=23)
    ck = _capture_at(prog, prompt)
    f = quote(prog)
    cf = f.checkpoints[ck.cid]
    res = prog.apply([DemoteState(ck.cid, ck.generation, cf.version)])
    assert res.ok and res.tid is not None
    prog.wait_transfers(0.5)
    assert prog.progress() == [] and prog.tx is not None     # nothing is delivered ...
    overdue = prog.overdue()                                 # ... but the copy did finish
    assert [r.tid for r in overdue] == [res.tid] and overdue[0].ok
    assert ck.image.slot is None and ck.image.host is not None
    _restores_exactly_then_empty(prog, ck, prompt, oracle, 5)


def test_capture_falls_back_to_host_then_skips(tiny_model):
    """Device slot first, Host if the Device has none, skip if neither."""
    prog = make_program(tiny_model, max_concurrency=1, kv_capacity=1024,
                        context_cache={"device_state_slots": 0, "host_capacity_bytes": 1 << 20})
    prompt = random_prompt(30, seed=24)
    s = new_seq(prog, prompt, 3)
    assert prog.bind(s, None).ok                 # the only slot is the writer's
    assert not prog.reserve_unit(s, 10)
    [r] = prog.execute([row(prog, s, 10, UnitKind.PREFILL, "a")])
    prog.settle(s)
    settle_transfers(prog)
    assert r.captured is not None and r.captured.image.slot is None and r.captured.image.host is not None
    filler = prog.host.allocate(prog.host.largest_free(), kind="test")   # Host now full
    assert not prog.reserve_unit(s, 10)
    assert prog.prepare_capture("b") is None
    [r2] = prog.execute([UnitRow(s, 10, UnitKind.PREFILL)])
    prog.settle(s)
    assert r2.captured is None
    prog.host.release(filler)
    prog.release(s)
    prog.release_owner(r.captured, "a")
    prog.check_integrity(idle=True)
    assert prog.is_empty()
    prog.shutdown()


def test_bind_uses_what_permitted_retirements_free(tiny_model, oracle):
    """A bind short of a state slot succeeds by retiring an old point it is allowed to give
    up; a bind that would still be short retires nothing."""
    prog = make_program(tiny_model, max_concurrency=1, kv_capacity=1024,
                        context_cache={"device_state_slots": 1, "host_capacity_bytes": 0})
    p = random_prompt(50, seed=25)
    old = _capture_at(prog, p[:20], owner="old")          # takes the one extra slot
    blocker = new_seq(prog, random_prompt(5, seed=26), 2)
    assert prog.bind(blocker, None).ok                     # takes the other slot
    s = new_seq(prog, p, 4)
    out = prog.bind(s, None, first_tokens=50)
    assert not out.ok and out.shortfall == {STATE: 1}
    out = prog.bind(s, None, first_tokens=50, retire=[(old, "old")])
    assert out.ok and old.cid not in prog.checkpoints
    assert run_to_end(prog, s) == oracle(p, 4)
    for q in (s, blocker):
        prog.release(q)
    prog.check_integrity(idle=True)
    assert prog.is_empty()
    prog.shutdown()


# ---- failure is one path: a failed copy aborts its transaction and names what it cost ------

def _fail_next_copy(prog):
    from ninfer.faults import FaultPlan
    prog.transfers.faults = FaultPlan([Fault(kind="copy_error")])


def test_failed_read_back_releases_its_sequence_and_keeps_the_source(prog, oracle):
    prompt = random_prompt(70, seed=40)
    ck = _capture_at(prog, prompt[:64])
    _demote_all(prog, ck)
    _fail_next_copy(prog)
    s = new_seq(prog, prompt, 4)
    out = prog.bind(s, ck, BindMode.FORK, first_tokens=6)
    assert out.ok and out.tid is not None and s.phase is Phase.MATERIALIZING
    [r] = settle_transfers(prog)
    assert not r.ok and "injected copy error" in r.error and r.failed_sids == [s.sid] and r.lost_cids == []
    assert s.sid not in prog.sequences and ck.cid in prog.checkpoints      # a Fork's source survives
    s2 = new_seq(prog, prompt, 4)
    assert prog.bind(s2, ck, BindMode.FORK, first_tokens=6).ok
    settle_transfers(prog)
    assert run_to_end(prog, s2) == oracle(prompt, 4)
    prog.release(s2)
    prog.release_owner(ck, "rec")


def test_failed_host_capture_is_deleted(prog):
    _fail_next_copy(prog)
    prompt = random_prompt(30, seed=41)
    s = new_seq(prog, prompt, 4)
    assert prog.bind(s, None).ok
    assert not prog.reserve_unit(s, 30)
    held = prog.pools[STATE].available
    prog.pools[STATE].reserve(held)
    r = row(prog, s, 30, UnitKind.PREFILL, "cap")
    prog.pools[STATE].unreserve(held)
    [res] = prog.execute([r])
    prog.settle(s)
    assert res.capture_tid is not None
    [t] = settle_transfers(prog)
    assert not t.ok and t.lost_cids == [res.captured.cid] and res.captured.cid not in prog.checkpoints
    prog.release(s)


def test_failed_demotion_keeps_the_device_replica(prog):
    ck = _capture_at(prog, random_prompt(64, seed=42))
    _fail_next_copy(prog)
    f = quote(prog)
    res = prog.apply([DemoteState(ck.cid, ck.generation, f.checkpoints[ck.cid].version)])
    assert res.ok and res.tid is not None
    [t] = settle_transfers(prog)
    assert not t.ok and t.failed_sids == [] and t.lost_cids == []
    assert ck.image.slot is not None and ck.image.host is None and ck.image.leases == 0
    prog.release_owner(ck, "rec")


def test_failed_pause_snapshot_is_revoked_and_replays(prog, oracle):
    prompt = random_prompt(50, seed=43)
    s = new_seq(prog, prompt, 6)
    assert prog.bind(s, None).ok
    step(prog, s)
    step(prog, s)
    _fail_next_copy(prog)
    r = prog.pause(s, to_host=True)
    assert r.snapshot is not None and r.tid is not None
    [t] = settle_transfers(prog)
    assert not t.ok and t.lost_cids == [r.snapshot.cid] and s.snapshot is None and s.phase is Phase.PAUSED
    assert r.snapshot.cid not in prog.checkpoints
    assert prog.bind(s, None, first_tokens=len(s.ledger) - 1).ok           # Replay from the root
    while s.frontier < len(s.ledger) - 1:
        step(prog, s, stop_at=len(s.ledger) - 1)
    assert run_to_end(prog, s) == oracle(prompt, 6)
    prog.release(s)


def test_a_host_save_is_not_lost_to_a_read_back_in_flight(tiny_model, oracle):
    """One context transaction at a time, but a save that needs the Host while a read-back's
    completion is still on its way is not skipped: it joins the transaction while its copies
    run, or the finished one is settled first and the save starts the next."""
    prog = make_program(tiny_model, kv_capacity=2048, context_cache={"host_capacity_bytes": 32 << 20},
                        faults=[Fault(kind="completion_delay", count=0, steps=4)])
    prompt = random_prompt(70, seed=44)
    ck = _capture_at(prog, prompt[:64])
    _demote_all(prog, ck)
    s = new_seq(prog, prompt, 4)
    out = prog.bind(s, ck, BindMode.FORK, first_tokens=6)
    assert out.tid is not None
    other = new_seq(prog, random_prompt(30, seed=45), 3)
    assert prog.bind(other, None).ok and not prog.reserve_unit(other, 30)
    held = prog.pools[STATE].available
    prog.pools[STATE].reserve(held)
    r = row(prog, other, 30, UnitKind.PREFILL, "cap")
    prog.pools[STATE].unreserve(held)
    [res] = prog.execute([r])
    prog.settle(other)
    assert res.captured is not None and res.capture_tid is not None     # saved, not skipped
    settled = settle_transfers(prog)
    assert all(t.ok for t in settled) and {out.tid, res.capture_tid} == {t.tid for t in settled}
    assert s.phase is Phase.RUNNING and res.captured.image.leases == 0
    assert run_to_end(prog, s) == oracle(prompt, 4)
    for q in (s, other):
        prog.release(q)
    prog.release_owner(ck, "rec")
    prog.release_owner(res.captured, "cap")
    prog.check_integrity(idle=True)
    assert prog.is_empty()
    prog.shutdown()


def test_a_block_shared_by_two_demoted_checkpoints_is_copied_once(prog, oracle):
    """Two checkpoints that share a page both name it in one commit: one copy, and the Device
    page stays until that copy is published (it is never freed while being read)."""
    prompt = random_prompt(100, seed=46)
    s = new_seq(prog, prompt, 4)
    assert prog.bind(s, None).ok
    step(prog, s, chunk=80, capture_owner="a")
    step(prog, s, chunk=80, capture_owner="b")
    a, b = [ck for ck in prog.checkpoints.values()]
    prog.release(s)
    f = quote(prog)
    acts = [DemoteBlocks(c.cid, c.generation, f.checkpoints[c.cid].blocks,
                         tuple(f.blocks[x].version for x in f.checkpoints[c.cid].blocks)) for c in (a, b)]
    d2h = prog.bytes_d2h
    res = prog.apply(acts)
    assert res.ok and prog.bytes_d2h - d2h == 2 * prog.mem.page_bytes      # blocks 0 and 1, once each
    shared = a.blocks[MAIN][0]
    assert shared.page is not None and shared.leases == 1                  # still read by its copy
    settle_transfers(prog)
    assert shared.page is None and shared.host is not None
    s2 = new_seq(prog, prompt, 4)
    assert prog.bind(s2, b, BindMode.FORK, first_tokens=1).ok
    settle_transfers(prog)
    assert run_to_end(prog, s2) == oracle(prompt, 4)
    prog.release(s2)
    prog.release_owner(a, "a")
    prog.release_owner(b, "b")


def test_a_replaced_hold_goes_only_with_a_save_that_happens(tiny_model):
    """Finding 2: a new anchor's replacement is given up only when the save finds its
    destination — or first, when giving it up is what frees that destination; a save that
    cannot happen leaves the old anchor in place (seed: 无法安全替换则放弃本次保存)."""
    prog = make_program(tiny_model, kv_capacity=2048, context_cache={"host_capacity_bytes": 0})
    old = _capture_at(prog, random_prompt(30, seed=90), owner="anchor")
    full = prog.pools[STATE].available
    prog.pools[STATE].reserve(full)                      # no free slot
    prog.add_owner(old, "other")                         # retiring the anchor frees nothing now
    assert prog.prepare_capture("new", (), [(old, "anchor")]) is None
    assert "anchor" in old.owners                        # the failed save retired nothing
    prog.release_owner(old, "other")
    dest = prog.prepare_capture("new", (), [(old, "anchor")])
    assert dest is not None and old.cid not in prog.checkpoints     # replaced to make the room
    prog.drop_capture(dest)
    prog.pools[STATE].unreserve(full)
    prog.check_integrity(idle=True)
    assert prog.is_empty()
    prog.shutdown()


def test_host_copies_of_pages_read_back_are_safe_duplicates(tiny_model, oracle):
    """Finding 10: a restore reads Host pages back and keeps their Host copies — those are safe
    duplicates too: DropHostCopy releases them (the checkpoint stays whole on the Device), and a
    later demotion of the same pages writes them again (its sizes count them)."""
    prog = make_program(tiny_model, kv_capacity=2048, context_cache={"host_capacity_bytes": 32 << 20})
    prompt = random_prompt(130, seed=95)
    ck = _capture_at(prog, prompt[:128])
    f = quote(prog)
    cf = f.checkpoints[ck.cid]
    assert prog.apply([DemoteBlocks(ck.cid, ck.generation, cf.blocks,
                                      tuple(f.blocks[b].version for b in cf.blocks))]).ok
    settle_transfers(prog)
    assert all(b.page is None and b.host is not None for b in ck.blocks[MAIN])
    s = new_seq(prog, prompt, 3)
    assert prog.bind(s, ck, BindMode.FORK, first_tokens=2).ok          # pages read back
    settle_transfers(prog)
    assert run_to_end(prog, s) == oracle(prompt, 3)
    prog.release(s)
    pages = [b.host for b in ck.blocks[MAIN]]
    assert all(b.page is not None and b.host is not None for b in ck.blocks[MAIN])
    assert set(map(id, pages)) <= set(map(id, prog.host_duplicates(ck)))
    f = quote(prog)
    assert all(f.blocks[b].device and f.blocks[b].host for b in f.checkpoints[ck.cid].blocks)
    blocks = list(ck.blocks[MAIN])
    assert prog.demotion_sizes([], blocks) == []                          # copies there: free at once
    assert prog.demotion_sizes([], blocks, {ck.cid}) == [prog.mem.page_bytes] * 2
    free, size = prog.host.free_bytes, sum(e.size for e in pages)
    assert prog.apply([DropHostCopy(ck.cid, ck.generation, f.checkpoints[ck.cid].version)]).ok
    assert prog.host.free_bytes == free + size
    assert all(b.page is not None and b.host is None for b in ck.blocks[MAIN])
    f = quote(prog)
    cf = f.checkpoints[ck.cid]
    res = prog.apply([DemoteBlocks(ck.cid, ck.generation, cf.blocks, tuple(f.blocks[b].version for b in cf.blocks))])
    assert res.ok and res.tid is not None                                 # written again
    settle_transfers(prog)
    _restores_exactly_then_empty(prog, ck, prompt[:128], oracle, 3)


def test_a_safe_host_duplicate_is_released_without_losing_the_checkpoint(tiny_model, oracle):
    """Finding 10: DropHostCopy releases the Host replicas the Device also holds; the
    checkpoint stays restorable from the Device."""
    prog = make_program(tiny_model, kv_capacity=2048, context_cache={"host_capacity_bytes": 8 << 20})
    prompt = random_prompt(70, seed=91)
    ck = _capture_at(prog, prompt)
    ext = prog.host.allocate(prog.mem.image_bytes, kind="state")   # give it a Host copy as well
    prog.mem.slot_to_host(ck.image.slot, ext, snapshot_now=True)
    settle_transfers(prog)
    ck.image.host = ext
    free, size = prog.host.free_bytes, ext.size
    f = quote(prog)
    assert prog.apply([DropHostCopy(ck.cid, ck.generation, f.checkpoints[ck.cid].version)]).ok
    assert ck.image.host is None and ck.image.slot is not None and prog.host.free_bytes == free + size
    assert not prog.apply([DropHostCopy(ck.cid, ck.generation, quote(prog).checkpoints[ck.cid].version)]).ok
    s = new_seq(prog, prompt + [5, 6], 4)
    assert prog.bind(s, ck).ok
    assert run_to_end(prog, s) == oracle(prompt + [5, 6], 4)
    prog.release(s)
    prog.release_owner(ck, "rec")
    prog.check_integrity(idle=True)
    assert prog.is_empty()
    prog.shutdown()


def test_a_fork_takes_the_sources_device_slot_when_slots_are_short_and_a_host_copy_keeps_it(tiny_model, oracle):
    """Seed: Device 槽紧张且有 Host 副本时，Fork 可将 Device 槽交给新的 active identity — with no
    free State slot, a Fork from a checkpoint that the Host also holds needs no new slot: the
    writer takes the checkpoint's slot, the checkpoint stays restorable from its Host copy, and
    both continuations are exact. With a free slot it copies instead (the source keeps its own)."""
    prog = make_program(tiny_model, kv_capacity=2048,
                        context_cache={"host_capacity_bytes": 8 << 20})
    prompt = random_prompt(70, seed=93)
    ck = _capture_at(prog, prompt)
    ext = prog.host.allocate(prog.mem.image_bytes, kind="state")   # a Host copy as well
    prog.mem.slot_to_host(ck.image.slot, ext, snapshot_now=True)()
    ck.image.host = ext
    assert prog.bind_demand(0, ck, BindMode.FORK, 4)[STATE] == 1          # a slot is free: copy
    filler = prog.pools[STATE].available                                 # others hold every free slot
    prog.pools[STATE].reserve(filler)
    assert prog.bind_demand(0, ck, BindMode.FORK, 4)[STATE] == 0          # short: hand the slot over
    s = new_seq(prog, prompt + [5, 6], 4)
    assert prog.bind(s, ck, BindMode.FORK, first_tokens=2).ok
    assert ck.image.slot is None and ck.image.host is not None and ck.cid in prog.checkpoints
    assert run_to_end(prog, s) == oracle(prompt + [5, 6], 4)
    prog.release(s)
    prog.pools[STATE].unreserve(filler)
    _restores_exactly_then_empty(prog, ck, prompt, oracle, 3)           # from the Host copy
