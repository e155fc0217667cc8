"""The ResourceManager's context-cache rules, each stated on fabricated requests and cache points
(model-free, milliseconds): whether a source is worth it and restorable, takeover or branch,
Move or Fork, what a rewrite supersedes, what a waiter holds and what is public, the input
point, anchors, the old input point's retirement, repeat demand, adoption evidence, a save's
promotion, hits and lost hits, and where a prefill unit ends (docs/structures.md "Who decides
what"). tests/mutations.py breaks each rule in several ways and names these tests."""

from __future__ import annotations

from dataclasses import dataclass, field

from ninfer import protocol as P
from ninfer.engine.units import next_unit
from ninfer.policy.cost import CostModel
from ninfer.policy.index import digest
from ninfer.policy.records import MAX_ANCHORS, Level
from ninfer.policy.resources import Admission, ResourceManager, SaveKind, SavePoint
from ninfer.protocol import RecordOwner, RequestSpec, Role, UnitKind, WaiterOwner
from tests.policy.fakes import INFO, resource_manager


@dataclass(eq=False)
class Req:
    """What the ResourceManager reads of a request."""

    rid: str
    ticket: int
    prompt: list[int]
    session: str | None = None
    recovery_frontier: int | None = None
    split_points: list[int] = field(default_factory=list)
    anchors: list[int] = field(default_factory=list)
    outputs: list = field(default_factory=list)
    replay_target: int | None = None
    facts: object = None
    live: bool = True
    prompt_logprobs: list = field(default_factory=list)

    def __post_init__(self):
        self.spec = RequestSpec(prompt=self.prompt, session_id=self.session, recovery_frontier=self.recovery_frontier,
                                split_points=self.split_points, anchors=self.anchors)

    @property
    def ledger(self) -> list[int]:
        return self.prompt + self.outputs


T = list(range(1, 301))


def _rm(**kw) -> ResourceManager:
    return resource_manager(divergence_min=None, **kw)


def _point(rm: ResourceManager, cid: int, tokens, owner=None, device: bool = True, generation: int = 1,
           record=None, role: Role = Role.E):
    """A complete cache point of ``tokens``, held by ``owner`` (default: a new record's E)."""
    rec = record
    if owner is None:
        rec = rec or rm.table.new_record(None)
        owner = rec.owner(role)
        if role is Role.E:
            rec.e = cid
        elif role is Role.INPUT:
            rec.input_point = cid
        else:
            rec.anchors.append(cid)
    rm.table.add_ckpt(P.CkptRef(cid, generation, len(tokens), P.CkptKind.CACHE, device, not device),
                      tuple(tokens), owner)
    return rec


# ---- source-worth -----------------------------------------------------------------------------
def test_a_source_is_used_only_if_it_costs_no_more_than_computing_from_the_root():
    """source-worth: with 1 s per byte read back and 1 s per token computed, a Host point of
    one token whose image is 1 byte costs exactly what computing that token does — used; with
    one more byte (a page on the Host) it costs more — not used; a deeper Host point is used."""
    rm = _rm(cost=CostModel(h2d_bytes_per_s=1.0, prefill_s_per_token=1.0, fixed_bind_s=0.0))
    assert INFO.image_bytes == 1 and INFO.page_bytes == 1
    _point(rm, 1, T[:1], device=False)
    req = Req("r", 5, T[:50])
    assert rm.choose(req, 50, 50).cid == 1
    rm.table.ckpts[1].host_pages = 1
    assert rm.choose(req, 50, 50) is None
    _point(rm, 2, T[:5], device=False)
    assert rm.choose(req, 50, 50).cid == 2


# ---- restorable -------------------------------------------------------------------------------
def test_a_point_reported_without_its_draft_coverage_is_no_source_in_that_generation_only():
    """restorable: the worker's report names a checkpoint generation; that one is no source, a
    later checkpoint under the same id is."""
    rm = _rm()
    rec = _point(rm, 9, T[:40])
    req = Req("r", 5, T[:50])
    assert rm.choose(req, 50, 50).cid == 9
    rm.uncover([(9, 1)])
    assert rm.choose(req, 50, 50) is None
    rm.table.drop_owner(9, rec.owner(Role.E))              # released; the id comes back as generation 2
    _point(rm, 9, T[:40], generation=2)
    assert rm.choose(req, 50, 50).cid == 9


# ---- takeover-or-branch -----------------------------------------------------------------------
def test_a_record_is_taken_over_only_when_idle_not_published_later_and_of_no_other_session():
    """takeover-or-branch: an idle record published by an earlier ticket is taken over (also by
    a request without a session); an active one, one published after this request, or one of
    another named session branches."""
    rm = _rm()
    rec = rm.table.new_record("s")
    rec.publication_order = 3
    assert rm._may_take_over(rec, Req("r", 5, T, session="s"))
    assert rm._may_take_over(rec, Req("r", 5, T))
    assert not rm._may_take_over(rec, Req("r", 5, T, session="other"))
    assert not rm._may_take_over(rec, Req("r", 2, T, session="s"))
    rec.active = "x"
    assert not rm._may_take_over(rec, Req("r", 5, T, session="s"))


# ---- move-or-fork -----------------------------------------------------------------------------
def test_e_is_moved_only_by_its_sole_owner_its_own_wait_aside():
    """move-or-fork: a continuation Moves the record's E when the record is its only owner — its
    own waiting reference aside; a public entry serving E too, or a queued sibling extending it,
    makes it Fork."""
    rm = _rm()
    rec = _point(rm, 1, T[:100])
    req = Req("r", 5, T[:120])
    adm = rm.plan_admission(req, [req])
    assert adm.takeover and adm.mode is P.BindMode.MOVE and adm.mover == rec.owner(Role.E)
    rm.wait_on(req, adm)                                   # its own waiting reference on E
    assert rm.plan_admission(req, [req]).mode is P.BindMode.MOVE
    sibling = Req("s", 6, T[:110])
    assert rm.plan_admission(req, [req, sibling]).mode is P.BindMode.FORK
    ent = rm.table.new_entry(1, 100)
    rm.table.ckpts[1].owners.add(ent.owner)
    assert rm.plan_admission(req, [req]).mode is P.BindMode.FORK


# ---- supersede-at-admission -------------------------------------------------------------------
def test_a_rewrite_retires_the_deeper_e_it_no_longer_continues_and_keeps_one_it_continues():
    """supersede-at-admission: taking a record over from its input point @100, its E @150 is
    retired (by the record's E hold) when the prompt parts from it — kept when the prompt
    continues it, also when the prompt ends exactly at E."""
    rm = _rm()
    rec = _point(rm, 2, T[:150])
    _point(rm, 1, T[:100], record=rec, role=Role.INPUT)
    src = rm.table.ckpts[1]
    rewrite = Req("r", 5, T[:100] + [999] * 60)
    assert rm._superseded(rec, src, rewrite) == [P.Retire(2, 1, rec.owner(Role.E))]
    assert rm._superseded(rec, src, Req("r", 5, T[:160])) == []
    assert rm._superseded(rec, src, Req("r", 5, T[:150])) == []


# ---- waiter-carries-points / waiter-only-not-public -------------------------------------------
def test_a_waiter_holds_its_source_once_and_carries_only_compatible_points():
    """waiter-carries-points: a waiting reference holds its source and carries the record's
    input point and anchors that this prompt still continues (not the source again, not an
    anchor off its history); waiting on the same source again changes nothing; moving to
    another source releases the earlier holds first."""
    rm = _rm()
    rec = _point(rm, 3, T[:150])                           # E: the source
    _point(rm, 1, T[:100], record=rec, role=Role.INPUT)
    _point(rm, 2, T[:50], record=rec, role=Role.ANCHOR)
    _point(rm, 4, T[:60] + [999] * 20, record=rec, role=Role.ANCHOR)   # off this prompt's history
    req = Req("r", 5, T[:200])
    adm = Admission(source=rm.table.ckpts[3], record=rec, takeover=True)
    w = WaiterOwner("r")
    cmds = rm.wait_on(req, adm)
    assert cmds == [P.AddOwner(3, 1, w), P.AddOwner(1, 1, w), P.AddOwner(2, 1, w)]
    assert [r.cid for r in rm.book(req).carried] == [1, 2] and rm.stats.waits == 1
    assert rm.wait_on(req, adm) == [] and rm.stats.waits == 1
    other = _point(rm, 5, T[:120])
    cmds = rm.wait_on(req, Admission(source=rm.table.ckpts[5], record=other, takeover=False))
    assert cmds[:3] == [P.ReleaseOwner(3, 1, w), P.ReleaseOwner(1, 1, w), P.ReleaseOwner(2, 1, w)], cmds


def test_a_point_only_waiters_keep_is_public_only_to_its_own_waiter():
    """waiter-only-not-public: a point only waiting references keep is a source for its own
    waiter, no one else's; one a record also keeps is public."""
    rm = _rm()
    _point(rm, 1, T[:40], owner=WaiterOwner("w"))
    assert [c.cid for c in rm.candidates(T[:50], 50, "w")] == [1]
    assert rm.candidates(T[:50], 50, "x") == []
    rm.table.ckpts[1].owners.add(RecordOwner(77, Role.E))
    assert [c.cid for c in rm.candidates(T[:50], 50, "x")] == [1]


# ---- pending-source ---------------------------------------------------------------------------
def test_no_wait_for_a_point_the_producer_has_already_passed():
    """pending-source: a producer already at (or past) the point either published it or will not:
    nothing to wait for."""
    rm = _rm()
    producer = Req("a", 1, T)
    waiter = Req("w", 2, T[:250])
    pts = [SavePoint(200, [], [])]
    assert rm.pending_source(waiter, 0, [(producer, 150, pts)]) == ("a", 200)
    assert rm.pending_source(waiter, 0, [(producer, 200, pts)]) is None


# ---- input-point ------------------------------------------------------------------------------
def test_the_input_point_is_c_or_r_else_the_raw_prompt_end():
    """input-point: the frontend's C or R when it gives one, else P — the prompt's end, also for
    a request that already has outputs (a Replay's ledger is longer)."""
    assert ResourceManager.input_point(Req("r", 1, T[:80])) == 80
    assert ResourceManager.input_point(Req("r", 1, T[:80], recovery_frontier=60)) == 60
    assert ResourceManager.input_point(Req("r", 1, T[:80], outputs=[5, 6])) == 80


# ---- anchor-replacement -----------------------------------------------------------------------
def _anchors(rm: ResourceManager, n: int):
    rec = rm.table.new_record(None)
    for i in range(n):
        _point(rm, 10 + i, T[:20 * (i + 1)], record=rec, role=Role.ANCHOR)
    return rec


def test_at_the_anchor_limit_the_oldest_published_goes_unless_it_is_being_adopted():
    """anchor-replacement: below the limit nothing is replaced; at it the oldest published anchor
    goes (all still on this history); an anchor being adopted right now makes the save unsafe —
    it is given up (None)."""
    rm = _rm()
    rec = _anchors(rm, MAX_ANCHORS - 1)
    req = Req("r", 5, T)
    sp = SavePoint(250, [rec.owner(Role.ANCHOR)], [SaveKind.ANCHOR])
    assert rm.anchor_replace(req, sp, rec) == []
    rec = _anchors(rm, MAX_ANCHORS)
    assert rm.anchor_replace(req, sp, rec) == [P.Retire(10, 1, rec.owner(Role.ANCHOR))]
    rm.book(Req("x", 9, T)).source_cid = 10
    assert rm.anchor_replace(req, sp, rec) is None


# ---- retire-before-save -----------------------------------------------------------------------
def test_a_new_input_point_retires_the_old_one_an_anchor_save_does_not():
    """retire-before-save: a save that is the record's new input point retires its old one (by the
    record's input hold) before the destination is requested — the record the caller names, not
    only the request's book's; an anchor-only save retires nothing."""
    rm = _rm()
    rec = _point(rm, 1, T[:60], role=Role.INPUT)
    req = Req("r", 5, T[:100])
    inp = SavePoint(100, [rec.owner(Role.INPUT)], [SaveKind.INPUT])
    assert rm.retire_for(req, inp, rec) == [P.Retire(1, 1, rec.owner(Role.INPUT))]
    assert rm.retire_for(req, SavePoint(100, [rec.owner(Role.ANCHOR)], [SaveKind.ANCHOR]), rec) == []
    rm.book(req).record = rm.table.new_record(None)        # the book's record has no input point yet
    assert rm.retire_for(req, inp, rec) == [P.Retire(1, 1, rec.owner(Role.INPUT))]


# ---- compute-demand / repeat-demand-promotes ----------------------------------------------------
def test_a_prefill_commit_observes_the_positions_it_computes_across_once():
    """compute-demand: a commit of (start, end] observes the candidate positions inside it — the
    one at its end too, not the one at its start (restored or computed before)."""
    rm = _rm()
    a = Req("a", 1, T[:100], anchors=[40])
    rm.observe_prefill(a, 40, 100)
    assert rm.book(a).observed == {100}
    rm.observe_prefill(a, 0, 40)
    assert rm.book(a).observed == {40, 100}


def test_two_requests_computing_a_position_promote_the_point_kept_exactly_there():
    """repeat-demand-promotes: the second request computing a position lifts the record whose
    input point is exactly there to reuse, proving that position; a shallower point on the same
    path is not promoted."""
    rm = _rm()
    rec = _point(rm, 1, T[:100], role=Role.INPUT)
    low = _point(rm, 2, T[:40])
    rm.observe_prefill(Req("a", 1, T[:100]), 0, 100)
    assert rec.level is Level.NORMAL
    rm.observe_prefill(Req("b", 2, T[:100]), 0, 100)
    assert rec.level is Level.REUSE and rec.evidence.proven_frontier == 100 and rec.evidence.demand_time
    assert low.level is Level.NORMAL


def test_a_promotion_never_moves_demand_time_back_and_lifts_public_entries_too():
    """repeat-demand-promotes: the demand time becomes the later of the two; a public entry at
    the position is lifted as well."""
    rm = _rm()
    rec = _point(rm, 1, T[:100])
    ent = rm.table.new_entry(1, 100)
    rm.table.ckpts[1].owners.add(ent.owner)
    rec.evidence.demand_time = 50.0
    rm._promote(T[:100], 100, 20.0)
    assert rec.level is Level.REUSE and rec.evidence.demand_time == 50.0
    assert ent.level is Level.REUSE and ent.evidence.demand_time == 20.0


# ---- adoption-evidence ------------------------------------------------------------------------
def test_a_consume_resets_the_proven_position_and_a_fork_child_gets_the_adoptions():
    """adoption-evidence: a takeover (Consume) from the input point resets the record's proven
    position to the source's, even below its earlier one; a Fork child gets this adoption's time
    and position and the reuse level; a public entry serving the source is lifted too."""
    rm = _rm()
    rec = _point(rm, 2, T[:150])
    _point(rm, 1, T[:100], record=rec, role=Role.INPUT)
    rec.evidence.proven_frontier = 150
    src = rm.table.ckpts[1]
    rm._note_adoption(Req("r", 5, T[:120]), src, rec, takeover=True)
    assert rec.evidence.proven_frontier == 100 and rec.level is Level.REUSE
    other = _point(rm, 3, T[:80])
    ent = rm.table.new_entry(3, 80)
    rm.table.ckpts[3].owners.add(ent.owner)
    child = rm.table.new_record(None)
    rm._note_adoption(Req("s", 6, T[:120]), rm.table.ckpts[3], child, takeover=False)
    assert child.level is Level.REUSE and child.evidence.proven_frontier == 80 and child.evidence.demand_time
    assert other.evidence.proven_frontier == 80                # the parent: 80 covers its proven 0
    assert ent.level is Level.REUSE and ent.evidence.demand_time


# ---- save-is-no-evidence ----------------------------------------------------------------------
def test_a_save_at_a_repeatedly_computed_position_promotes_with_that_demand_time():
    """save-is-no-evidence: a save where two requests already computed promotes its new point's
    record to reuse, with the time of that computation — not the time of the save."""
    rm = _rm()
    d = digest(T[:100])
    rm.summary.observe(d, 100, "a", 10.0)
    rm.summary.observe(d, 100, "b", 20.0)
    req = Req("b", 2, T[:100])
    rec = rm.table.new_record(None)
    rm.book(req).record = rec
    sp = SavePoint(100, [rec.owner(Role.INPUT)], [SaveKind.INPUT])
    rm.on_captured(req, sp, P.CkptRef(7, 1, 100, P.CkptKind.CACHE, True, False))
    assert rec.input_point == 7 and rec.level is Level.REUSE and rec.evidence.demand_time == 20.0


# ---- hits-and-lost-hits -----------------------------------------------------------------------
def test_only_a_real_restore_is_a_hit_and_a_missing_deeper_point_is_a_lost_hit_with_its_cause():
    """hits-and-lost-hits: a query without a source is no hit; a remembered missing point deeper
    than what was restored is one lost hit of its cause, its tokens counted from the source; a
    missing point at the restored position itself is no loss; a Moved E is none either."""
    rm = _rm()
    _point(rm, 1, T[:40])
    s = rm.stats
    rm._note_missing(40, digest(T[:40]), "evicted")         # an earlier copy at 40: restored now
    rm._count_query(Req("r", 5, T[:100]), rm.table.ckpts[1])
    assert (s.queries, s.hits, s.reused_tokens, s.lost_hits) == (1, 1, 40, 0)
    rm._note_missing(60, digest(T[:60]), "evicted")
    rm._note_missing(90, digest(T[:90]), "skipped_no_room")
    rm._count_query(Req("r", 5, T[:100]), rm.table.ckpts[1])
    assert (s.queries, s.hits, s.reused_tokens) == (2, 2, 80)
    assert (s.lost_hits, s.lost_tokens, s.lost_by_cause) == (1, 50, {"skipped_no_room": 1})
    rm._count_query(Req("m", 6, T[:30]), None)
    assert (s.queries, s.hits, s.lost_hits) == (3, 2, 1)
    rm._note_missing(100, digest(T[:100]), "moved")
    rm._count_query(Req("c", 7, T[:120]), rm.table.ckpts[1])
    assert s.lost_hits == 1


# ---- unit-cuts --------------------------------------------------------------------------------
def test_a_prefill_unit_ends_at_a_save_point_a_split_point_or_the_chunk_never_past_the_ledger():
    """unit-cuts: without inner saves a unit ends exactly on the next save point (also one at the
    chunk's end), on a rewrite execution frontier, at the chunk, and never past the ledger; a save
    point at the frontier itself was captured already and cuts nothing."""
    req = Req("r", 1, T[:100], split_points=[70])
    sps = [SavePoint(0, [], []), SavePoint(30, [], []), SavePoint(64, [], [])]
    at = lambda u: [(sv.sp.frontier, sv.inner) for sv in u.saves]        # noqa: E731
    u = next_unit(req, 0, 100, 64, sps)
    assert (u.n_tokens, u.kind, at(u)) == (30, UnitKind.PREFILL, [(30, False)])
    u = next_unit(req, 30, 100, 34, sps)
    assert (u.n_tokens, at(u)) == (34, [(64, False)])      # the save point at the chunk's end
    u = next_unit(req, 64, 100, 64, sps)
    assert (u.n_tokens, at(u)) == (6, [])                  # the rewrite execution frontier at 70
    u = next_unit(req, 70, 100, 64, sps)
    assert (u.n_tokens, at(u)) == (30, [])                 # up to the ledger's end, not the chunk's


def test_with_inner_saves_a_unit_crosses_its_save_points_and_still_ends_at_a_split_point_or_the_chunk():
    """unit-cuts with inner saves (the worker keeps states inside a unit): the unit runs to the
    chunk, a rewrite execution frontier or the ledger's end, and carries every save point it
    crosses — inside it (inner) or on its end — in position order; none at its own frontier."""
    req = Req("r", 1, T[:100], split_points=[70])
    sps = [SavePoint(0, [], []), SavePoint(30, [], []), SavePoint(50, [], []), SavePoint(64, [], []),
           SavePoint(90, [], [])]
    at = lambda u: [(sv.sp.frontier, sv.inner) for sv in u.saves]        # noqa: E731
    u = next_unit(req, 0, 100, 64, sps, inner=True)
    assert (u.n_tokens, u.kind, at(u)) == (64, UnitKind.PREFILL, [(30, True), (50, True), (64, False)])
    u = next_unit(req, 30, 100, 64, sps, inner=True)
    assert (u.n_tokens, at(u)) == (40, [(50, True), (64, True)])         # the split point at 70
    u = next_unit(req, 70, 100, 64, sps, inner=True)
    assert (u.n_tokens, at(u)) == (30, [(90, True)])                     # the ledger's end
    u = next_unit(req, 64, 100, 4, sps, inner=True)
    assert (u.n_tokens, at(u)) == (4, [])                                # the chunk
