"""Reclaim and admission planning over one quote (seed: 回收与准入; Host 放置预检).

Input: one quote (physical facts with real holder sets and Host extents) and the logical
records. Output: a batch of Native actions — demotions (Device→Host) and deletions.

Ranking for the current typed gap (Device State first, then Main KV):

* normal content before reuse content; the reuse segment is ordered by latest real demand and
  kept to a soft target of 3/4 of each physical pool (unique footprint; the single newest
  record may exceed it) — older reuse content beyond the target ranks as normal;
* normal actions by marginal restore-token loss ÷ release useful for this gap, ties by
  retention order; reuse actions oldest real demand first;
* loss uses the real surviving fallback after the action (victims chosen together are not
  each other's fallback); a demotion loses nothing unless its Host destination needs victims,
  whose loss it then carries;
* revocable holds (younger waiters, later-ticket pause snapshots) come after optional cache,
  only when the requester may revoke them.

Host placement is judged by first-fit into contiguous free extents after the victims are
removed — byte totals do not count; victims that make the allocation fit are chosen in reclaim
order, unneeded ones are dropped again, and if nothing admissible places it nothing is deleted.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

from ninfer import protocol as P
from ninfer.placement import fits_first_fit, merge_extents, merge_into, place_first_fit
from ninfer.policy.records import Level, RecordTable
from ninfer.protocol import EntryOwner, Owner, RecordOwner, SnapshotOwner, WaiterOwner

SOFT_TARGET = 0.75


class Cls(IntEnum):
    """A reclaim candidate's class, in reclaim order."""

    NORMAL = 0                # optional cache, normal retention
    REUSE = 1                 # optional cache in the reuse segment
    WAITER = 2                # a revocable waiting reference
    SNAPSHOT = 3              # a revocable pause snapshot


@dataclass
class Candidate:
    cid: int
    cls: Cls
    demand_time: float
    frontier: int


class FactsIndex:
    """What one quote's facts say about blocks, indexed once and lazily: facts are frozen, and
    one settlement builds many planners over the same facts (one per need, its deletions-only
    alternative, the pause routes and the capture rooms)."""

    __slots__ = ("facts", "_listers", "_releasable", "_unheld", "_movable", "_touch", "_shared", "_groups", "_held",
                 "_host_free")

    def __init__(self, facts: P.Facts):
        self.facts = facts
        self._listers: dict[int, list[int]] | None = None
        self._releasable: dict[int, tuple[int, ...]] | None = None
        self._unheld: set[int] | None = None
        self._held: dict[int, frozenset[int]] = {}     # block -> its holders, as a set (taken once)
        self._host_free: list[tuple[int, int]] | None = None
        self._movable: dict[int, list[int]] = {}
        self._touch: dict[int, list[int]] | None = None
        self._shared: dict[frozenset[int], list[int]] | None = None
        self._groups: dict[frozenset[int], dict] = {}

    @property
    def listers(self) -> dict[int, list[int]]:
        """Block -> the checkpoints that list it."""
        if self._listers is None:
            listers: dict[int, list[int]] = {}
            for cid, c in self.facts.checkpoints.items():
                for bid in c.blocks:
                    listers.setdefault(bid, []).append(cid)
            self._listers = listers
        return self._listers

    @property
    def releasable(self):
        """(block, holders) of the Device blocks no sequence pins (sequence holders are
        negative), as a dict's items."""
        if self._releasable is None:
            self._releasable = {bid: b.holders for bid, b in self.facts.blocks.items() if b.device and not b.pinned}
        return self._releasable.items()

    @property
    def host_free(self) -> list[tuple[int, int]]:
        """The quote's free Host extents, sorted and merged (once per quote)."""
        if self._host_free is None:
            self._host_free = merge_extents(sorted(set(self.facts.host_free)))
        return self._host_free

    @property
    def unheld(self) -> set[int]:
        """The releasable blocks only checkpoints hold (no sequence: sequence holders are
        negative) — judged once per block, not once per checkpoint that lists it (a shared
        prefix's pages are listed by every point above it)."""
        if self._unheld is None:
            self._unheld = {bid for bid, holders in self.releasable if all(h > 0 for h in holders)}
        return self._unheld

    def movable(self, cid: int) -> list[int]:
        """Device blocks of this checkpoint that only checkpoints hold (no resident writer)."""
        got = self._movable.get(cid)
        if got is None:
            unheld = self.unheld
            got = self._movable[cid] = [bid for bid in self.facts.checkpoints[cid].blocks if bid in unheld]
        return got

    def _scan(self) -> None:
        """Per checkpoint, the releasable blocks no sequence holds that it holds or lists (one
        pass, the first time a deletion's release is counted on these facts)."""
        touch: dict[int, list[int]] = {}
        listers, unheld = self.listers, self.unheld
        for bid, holders in self.releasable:
            if bid not in unheld:
                continue                         # a sequence holds it: no deletion frees it
            for m in set(holders).union(listers.get(bid, ())):
                touch.setdefault(m, []).append(bid)
        self._touch = touch

    def touches(self, m: int) -> bool:
        """Whether ``m`` holds or lists any releasable Device block (else no deletion of it frees
        a page by itself)."""
        return bool(self.touch_lists().get(m))

    def entries(self, m: int, victims: frozenset[int]) -> list[tuple]:
        """The Device blocks a deletion of ``m`` might free once ``victims`` are deleted: (block,
        all its holders, the checkpoints that list it) — each block ``m`` holds (not being a
        victim itself), or lists once no holder is left besides the victims. Set operations, not
        a pass per holder: a shared prefix's page has a holder per point above it, and each of
        them asks for its entries."""
        out = []
        blocks, listers, held = self.facts.blocks, self.listers, self._held
        for bid in self.touch_lists().get(m, ()):
            holders = held.get(bid)
            if holders is None:
                holders = held[bid] = frozenset(blocks[bid].holders)
            lst = listers.get(bid, ())
            if (m in holders and m not in victims) or (m in lst and holders <= victims):
                out.append((bid, holders, lst))
        return out

    @property
    def shared(self) -> dict[frozenset[int], list[int]]:
        """The releasable blocks two or more checkpoints hold (and no sequence), by holder set."""
        if self._shared is None:
            shared: dict[frozenset[int], list[int]] = {}
            for bid, holders in self.releasable:
                if len(holders) > 1 and len(g := frozenset(holders)) > 1 and all(h > 0 for h in g):
                    shared.setdefault(g, []).append(bid)
            self._shared = shared
        return self._shared

    def groups(self, victims: frozenset[int]) -> dict[frozenset[int], list[int]]:
        """The groups of two or more holders left on a block once ``victims`` are deleted, with
        their blocks (kept per victim set: the passes of a settlement mostly share one)."""
        got = self._groups.get(victims)
        if got is None:
            got = {}
            for g, bids in self.shared.items():
                rest = g - victims if not victims.isdisjoint(g) else g
                if len(rest) > 1:
                    got.setdefault(rest, []).extend(bids)
            if len(self._groups) > 8:
                self._groups.clear()
            self._groups[victims] = got
        return got

    # ---- bringing an index forward to the next quote -------------------------------------
    def derived(self, facts: P.Facts, changes: tuple[list[int], list[int]] | None = None) -> "FactsIndex | None":
        """The index of ``facts`` built from this one (another quote's, usually the one before):
        only the messages that differ are re-indexed — consecutive quotes of a full Device share
        nearly all of their ~1,000 messages, and indexing them all was ~2 ms of each admission's
        settlement on the trace slice. Each part this index had computed (listers, releasable and
        unheld blocks, the per-checkpoint touch lists, the shared holder sets) is brought
        forward; the rest stay lazy. ``changes``: the ids that differ (a superset will do), when
        the caller knows them. None when more than half of the messages differ (built anew
        then). Orders inside the lists may differ from an index built anew; every use is a set's
        (``NINFER_CHECK_FACTS`` compares the two as sets on every derivation:
        ``check_against_fresh``)."""
        was = self.facts
        if changes is not None:         # what a facts delta said changed (``index_from_delta``)
            dck, dbk = changes
        else:
            dck = _changed(was.checkpoints, facts.checkpoints)
            dbk = _changed(was.blocks, facts.blocks)
        if 2 * (len(dck) + len(dbk)) > len(facts.checkpoints) + len(facts.blocks):
            return None
        ix = FactsIndex(facts)
        ckb, ckn, blb = was.checkpoints, facts.checkpoints, was.blocks
        relisted: set[int] = set()          # blocks whose listing checkpoints changed
        listers = None
        if self._listers is not None:
            listers, copied = dict(self._listers), set()
            for cid in dck:
                o, n = ckb.get(cid), ckn.get(cid)
                ob, nb = (o.blocks if o is not None else ()), (n.blocks if n is not None else ())
                if ob == nb:
                    continue
                for bid in ob:
                    _cow_remove(listers, copied, bid, cid)
                for bid in nb:
                    _cow_add(listers, copied, bid, cid)
                relisted.update(ob)
                relisted.update(nb)
        if self._releasable is None or self._unheld is None:
            ix.adopt(listers=listers)
            return ix
        rel = dict(self._releasable)
        unheld = set(self._unheld)
        for bid in dbk:
            b = facts.blocks.get(bid)
            if b is not None and b.device and not b.pinned:
                rel[bid] = b.holders
                if all(h > 0 for h in b.holders):
                    unheld.add(bid)
                else:
                    unheld.discard(bid)
            else:
                rel.pop(bid, None)
                unheld.discard(bid)
        gone = set(dbk)
        held = {bid: h for bid, h in self._held.items() if bid not in gone}
        touch = None
        if self._touch is not None and listers is not None:
            touch, copied = dict(self._touch), set()
            for bid in relisted.union(dbk):
                old = (set(self._releasable[bid]).union(self._listers.get(bid, ()))
                       if bid in self._unheld else set())
                new = set(rel[bid]).union(listers.get(bid, ())) if bid in unheld else set()
                for m in old - new:
                    _cow_remove(touch, copied, m, bid)
                for m in new - old:
                    _cow_add(touch, copied, m, bid)
        shared = None
        if self._shared is not None:
            shared, copied = dict(self._shared), set()
            for bid in dbk:
                for holders, present, change in ((blb[bid].holders if bid in blb else (), bid in self._unheld, _cow_remove),
                                                 (rel.get(bid, ()), bid in unheld, _cow_add)):
                    g = frozenset(holders)
                    if present and len(g) > 1:
                        change(shared, copied, g, bid)
        ix.adopt(listers=listers, releasable=rel, unheld=unheld, held=held, touch=touch, shared=shared)
        return ix

    def adopt(self, listers=None, releasable=None, unheld=None, held=None, touch=None, shared=None) -> None:
        """Take parts a derivation built for this index's facts (None: left lazy)."""
        self._listers, self._releasable, self._unheld = listers, releasable, unheld
        self._held = held if held is not None else {}
        self._touch, self._shared = touch, shared

    def touch_lists(self) -> dict[int, list[int]]:
        """Per checkpoint, the releasable blocks no sequence holds that it holds or lists."""
        if self._touch is None:
            self._scan()
        return self._touch

    def computed(self) -> dict[str, object]:
        """The parts computed so far (a derivation brings these forward), by name."""
        return {name: part for name, part in (("listers", self._listers), ("releasable", self._releasable),
                                              ("unheld", self._unheld), ("touch", self._touch),
                                              ("shared", self._shared)) if part is not None}

    def check_against_fresh(self) -> None:
        """``NINFER_CHECK_FACTS``: every part computed so far equals, as sets, the part an
        index built anew computes."""
        fresh = FactsIndex(self.facts)

        def as_sets(d):
            return {k: sorted(v) for k, v in d.items()}
        want = {"listers": lambda: as_sets(fresh.listers), "releasable": lambda: dict(fresh.releasable),
                "unheld": lambda: fresh.unheld, "shared": lambda: as_sets(fresh.shared),
                "touch": lambda: as_sets(fresh.touch_lists())}
        for name, got in self.computed().items():
            if (as_sets(got) if name in ("listers", "shared", "touch") else got) != want[name]():
                raise AssertionError(f"derived facts index: its {name} differ from an index built anew")


_INDEXES: list[FactsIndex] = []         # the latest few (a settlement plans on a quote and on it less a pause)


def index_from_delta(before: P.Facts, facts: P.Facts, checkpoints: list[int], blocks: list[int]) -> None:
    """Index ``facts`` now, brought forward from ``before``'s index on the ids a facts delta
    said changed (a superset will do) — without comparing every message; ``facts_index`` then
    finds it. Nothing when ``before`` has no index any more (``facts_index`` builds one then)."""
    base = next((b for b in _INDEXES if b.facts is before), None)
    ix = base.derived(facts, (checkpoints, blocks)) if base is not None else None
    if ix is not None:
        if os.environ.get("NINFER_CHECK_FACTS", "0") != "0":
            ix.check_against_fresh()
        _INDEXES[:] = [ix] + _INDEXES[:2]


def facts_index(facts: P.Facts) -> FactsIndex:
    """The index of this facts object: the one ``index_from_delta`` brought forward when a facts
    delta completed it, else built anew. Nothing is derived from an index by comparing
    messages here: a caller's facts are frozen structs over plain dicts, and a base whose dicts
    were changed in place since (tests build quotes that way) would hide the changes."""
    for ix in _INDEXES:
        if ix.facts is facts:
            return ix
    ix = FactsIndex(facts)
    _INDEXES[:] = [ix] + _INDEXES[:2]
    return ix


def _changed(before: dict, after: dict) -> list[int]:
    """Ids whose message differs between two quotes' dicts (added, removed or changed)."""
    out = [k for k, v in after.items() if before.get(k) != v]
    out += [k for k in before if k not in after]
    return out


def _cow_add(d: dict, copied: set, key, item) -> None:
    """Append ``item`` to the list ``d[key]`` (made if missing), copying the list once per
    derivation before it changes: the base index keeps its own."""
    got = d.get(key)
    if got is None:
        d[key] = [item]
        copied.add(key)
        return
    if key not in copied:
        got = d[key] = list(got)
        copied.add(key)
    got.append(item)


def _cow_remove(d: dict, copied: set, key, item) -> None:
    """Remove ``item`` from the list ``d[key]`` (the key goes with its last item), copying the
    list first as ``_cow_add`` does."""
    got = d[key]
    if key not in copied:
        got = d[key] = list(got)
        copied.add(key)
    got.remove(item)
    if not got:
        del d[key]
        copied.discard(key)


def _owner_record(owner: Owner, table: RecordTable):
    if isinstance(owner, EntryOwner):
        return table.entries.get(owner.entry)
    if isinstance(owner, RecordOwner):
        return table.records.get(owner.record)
    return None


# rule: reclaim-classes
def _classify(owners: tuple[Owner, ...], table: RecordTable, may_revoke: Callable[[Owner], bool]) -> Cls | None:
    """0 normal / 1 reuse optional cache, 2 a revocable waiting reference, 3 a revocable pause
    snapshot; None when some holder is necessary (never a reclaim candidate)."""
    cls = Cls.NORMAL
    for o in owners:
        if isinstance(o, (RecordOwner, EntryOwner)):
            rec = _owner_record(o, table)
            cls = max(cls, Cls.REUSE if rec is not None and rec.level == Level.REUSE else Cls.NORMAL)
        elif isinstance(o, WaiterOwner) and may_revoke(o):
            cls = max(cls, Cls.WAITER)
        elif isinstance(o, SnapshotOwner) and may_revoke(o):
            cls = max(cls, Cls.SNAPSHOT)
        else:
            return None           # a necessary hold: not a reclaim candidate
    return cls


def _never(owner: Owner) -> bool:
    return False


def _demand_time(owners: tuple[Owner, ...], table: RecordTable) -> float:
    times = [rec.evidence.demand_time or 0.0 for o in owners if (rec := _owner_record(o, table)) is not None]
    return max(times, default=0.0)


class Survey(dict):
    """cid -> (owners, revocable, class without revocation, demand time), kept across
    settlements. An entry reads its owners (compared with the quote's when read) and their
    records' and entries' existence, level and evidence; ``forget`` drops the entries of the
    records and entries named (``RecordTable.touched_records``: inserted, deleted or touched)."""

    def __init__(self):
        super().__init__()
        self.by_record: dict[int, set[int]] = {}

    def __setitem__(self, cid: int, entry: tuple) -> None:
        super().__setitem__(cid, entry)
        for o in entry[0]:
            if isinstance(o, (RecordOwner, EntryOwner)):
                self.by_record.setdefault(o.record if isinstance(o, RecordOwner) else o.entry, set()).add(cid)

    def forget(self, ids: set[int]) -> None:
        for rid in ids:
            for cid in self.by_record.pop(rid, ()):
                self.pop(cid, None)


def stale_survey(survey: dict, table: RecordTable) -> list[int]:
    """The kept survey entries that differ from their owners' classes and demand times now (the
    check behind ``NINFER_CHECK_FACTS``: every record change that moves one must have been noted)."""
    return [cid for cid, (owners, revocable, cls, hot) in survey.items()
            if (not revocable and cls != _classify(owners, table, _never)) or hot != _demand_time(owners, table)]


class _GroupFloor(NamedTuple):
    """Bounds below the groups' ranks (``Planner._order``): below every group's, below every group
    with a member whose loss floor is not 0, and the candidates whose floor is 0."""
    any: tuple
    lossy: tuple
    lossless: set[int]


class _Order:
    """One planner's options for one pool but the groups, in the order of their rank's lower
    bound, read lazily (``Planner._order`` sorts the candidates into its runs). Each option is
    (bound, sequence, kind, item, exact); a run is the candidates of one (action, class, demand
    time, loss floor), few on any Device (on the trace slice nearly every point is normal with
    demand time 0), and within a run the bounds rise with the ids — so the sorted runs are merged
    only as far as scans read (``at``): a choice reads the few options below its best, not the
    ~700 of a full Device. ``floor``: see ``Planner._order``."""

    __slots__ = ("read", "floor", "_heads", "_cands", "_most", "_rank", "_seq")

    def __init__(self, runs: dict[tuple, list[int]], cands: dict[int, Candidate], most: int, rank,
                 floor: _GroupFloor | None):
        self.read: list[tuple] = []
        self._heads: list[tuple] = []
        self._cands, self._most, self._rank, self.floor, self._seq = cands, most, rank, floor, 0
        for key, cids in runs.items():
            cids.sort()
            self._push(key, cids, 0)

    def _push(self, key: tuple, cids: list[int], i: int) -> None:
        """The run's ``i``-th option onto the merge (its bound from the run's key)."""
        kind, cls, hot, floor = key
        cid = cids[i]
        if kind == "delete":
            item, exact = frozenset({cid}), False
            bound = self._rank(cls, hot, floor, self._most, (kind, item))
        else:
            item, exact = self._cands[cid], True
            bound = self._rank(cls, hot, 0, 1, (kind, cid))
        self._seq += 1
        heapq.heappush(self._heads, (bound, self._seq, kind, item, exact, key, cids, i))

    def at(self, i: int) -> tuple | None:
        """The ``i``-th option by bound; None past the last."""
        read = self.read
        while len(read) <= i:
            if not self._heads:
                return None
            bound, seq, kind, item, exact, key, cids, j = heapq.heappop(self._heads)
            read.append((bound, seq, kind, item, exact))
            if j + 1 < len(cids):
                self._push(key, cids, j + 1)
        return read[i]


class Planner:
    """One planning pass over one quote."""

    def __init__(self, facts: P.Facts, table: RecordTable, protect: set[int],
                 may_revoke: Callable[[Owner], bool], tickets: dict[Owner, int] | None = None,
                 prior: "Planner | None" = None, demote: bool = True,
                 window_short: Callable[[], None] | None = None, survey: dict | None = None,
                 reading: set[int] | frozenset[int] = frozenset()):
        """``prior``: an earlier planning pass over the same quote in this cycle (another
        intent's remedies): what it chose is not chosen again, and its Host destinations stay
        placed. ``demote=False``: deletions only (the alternative when a plan that started
        with demotions cannot cover the gap). On scoped facts (``facts.partial``: the Device's
        content and a window of Host candidates) ``window_short`` is called when a Host
        placement found no admissible victims inside the window — the caller may quote a
        wider one and plan again. ``survey``: the owners' classes and demand times per cid (a
        ``Survey`` the caller keeps across settlements, or a dict for one), shared by a
        settlement's passes; an entry whose quoted owners differ is taken again. ``reading``: the
        points this step's binds read (their sources, the requester's own snapshot): no
        demotion moves a Device page one of them lists."""
        self.demote = demote
        self.window_short = window_short or (prior.window_short if prior else None)
        self.f = facts
        self.table = table
        self.tickets = tickets or {}          # pause-snapshot or waiter owner -> its request's original ticket
        self.steps: list[list[P.Action]] = []  # the plan as separately committable steps
        self.victims: set[int] = set(prior.victims) if prior else set()
        self.demoted_images: set[int] = set(prior.demoted_images) if prior else set()
        self.demoted_blocks: set[int] = set(prior.demoted_blocks) if prior else set()
        self.host_used: list[tuple[int, int]] = list(prior.host_used) if prior else []
        self.dup_dropped: set[int] = set(prior.dup_dropped) if prior else set()   # Host duplicates released
        self.dup_pages: set[int] = set(prior.dup_pages) if prior else set()       # ... of these blocks
        self._memo_version: tuple | None = None        # the Host placement memo and the state it was taken on
        self._memo: dict = {}
        self._release: tuple | None = None             # (victim count, blocks they free, entries, groups)
        self._ticket_memo: dict[int, int | None] = {}
        self.ix = facts_index(facts)
        # a page a bind of this step reads would be copied back at once: moving it frees nothing
        # for the gap (seed: 能补足实际缺口的完整物理动作; 实际读取期间的 reader lease)
        self.read_blocks = frozenset(bid for cid in reading if (c := facts.checkpoints.get(cid)) is not None
                                     for bid in c.blocks)
        self.cands: dict[int, Candidate] = {}
        self._reuse: list[Candidate] = []      # the candidates of class REUSE when surveyed (a few)
        # exact prefixes of a point: the same on the same facts (a pass in the same settlement)
        self.prefix_memo: dict[int, list[tuple[int, int]]] = (
            prior.prefix_memo if prior is not None and prior.f is facts else {})
        self.least_memo: dict[int, int] = prior.least_memo if prior is not None and prior.f is facts else {}
        self.floor_memo: dict[int, int] = prior.floor_memo if prior is not None and prior.f is facts else {}
        self._migrating_memo: tuple | None = None
        self._orders: dict[str, _Order] = {}     # per pool: the options by their rank's lower bound
        self._group_bounds: dict[str, dict] = {}     # per pool: a group's bound (``_group_bound``)
        if survey is None:
            survey = prior.survey if prior is not None and prior.table is table else {}
        self.survey = survey
        for cid, c in facts.checkpoints.items():
            if cid in protect or c.leased:
                continue
            got = survey.get(cid)
            if got is None or got[0] != c.owners:
                # a class without revocable holds does not depend on who may revoke
                revocable = any(isinstance(o, (WaiterOwner, SnapshotOwner)) for o in c.owners)
                got = survey[cid] = (c.owners, revocable, None if revocable else _classify(c.owners, table, _never),
                                     _demand_time(c.owners, table))
            cls = _classify(c.owners, table, may_revoke) if got[1] else got[2]
            if cls is not None:
                hot = got[3]
                # rule: revocation-order
                if cls >= Cls.WAITER:     # revocable holds: the youngest holder's first (seed: 优先考虑较年轻等待者)
                    hot = -max((self.tickets.get(o, -1) for o in c.owners
                                if isinstance(o, (WaiterOwner, SnapshotOwner))), default=-1)
                cand = self.cands[cid] = Candidate(cid, cls, hot, c.frontier)
                if cls is Cls.REUSE:
                    self._reuse.append(cand)
        self._hot_protection_covers_proven_only()
        self._apply_soft_target()

    # rule: hot-protection
    def _hot_protection_covers_proven_only(self) -> None:
        """Private hot protection is per record and covers its proven position only: a deeper,
        not yet proven point of a reuse record is normal content for that record when another
        surviving, exact point *of the same record* still covers the proven position (seed:
        私有热保护对应其已证明的采用位置; 同一 owner 真正幸存的较早、精确兼容恢复点仍覆盖这个位置) —
        another history's point does not count, nor an input point shallower than the proven
        position. A shared hot owner (a public entry) protects on its own."""
        ckpts, table = self.table.ckpts, self.table

        def protects(rec, cand: Candidate) -> bool:
            proven = rec.evidence.proven_frontier
            if cand.frontier <= proven or proven <= 0:
                return True
            # the record's own points that ``_prefixes`` would list at or past the proven position
            # (asked of these few points: every candidate's prefix list would be a pass over
            # its tokens, and a shared system prompt puts hundreds of candidates above it)
            return not any((o := ckpts.get(other)) is not None and o.frontier >= proven and self._is_live(other)
                           and table.is_prefix(other, cand.cid) for _, other in rec.points())

        for cand in self._reuse:
            if cand.cls is not Cls.REUSE:
                continue
            owners = self.f.checkpoints[cand.cid].owners
            if any(isinstance(o, EntryOwner) and (e := _owner_record(o, self.table)) is not None
                   and e.level == Level.REUSE for o in owners):
                continue
            recs = [r for o in owners if isinstance(o, RecordOwner)
                    and (r := _owner_record(o, self.table)) is not None and r.level == Level.REUSE]
            if recs and not any(protects(r, cand) for r in recs):
                cand.cls = Cls.NORMAL

    # ==== retention ======================================================================
    def _footprint(self, cid: int) -> tuple[set, set, set]:
        """(Device pages, Device slots, Host extents) of one checkpoint, as identities: a
        union over several points counts shared content once."""
        c = self.f.checkpoints[cid]
        pages = {b for b in c.blocks if self.f.blocks[b].device}
        slots = {cid} if c.image_device else set()
        host = ({c.image_at} if c.image_at else set()) | {
            self.f.blocks[b].host_at for b in c.blocks if self.f.blocks[b].host_at}
        return pages, slots, host

    # rule: soft-target
    def _apply_soft_target(self) -> None:
        """The reuse segment is kept per record (private records and public entries), newest
        real demand first, to 3/4 of each physical pool counted by unique footprint (all of
        the record's points); older reuse records beyond it rank as normal for this pass. The
        single newest record may exceed the target alone (seed: 复用段 … 软目标)."""
        holders: dict[int, tuple[float, set[int]]] = {}
        for c in self._reuse:
            if c.cls is not Cls.REUSE:
                continue
            for o in self.f.checkpoints[c.cid].owners:
                rec = _owner_record(o, self.table)
                if rec is None or rec.level != Level.REUSE:
                    continue
                pts = {c2 for _, c2 in rec.points()} if isinstance(o, RecordOwner) else {rec.cid}
                holders[id(rec)] = (rec.evidence.demand_time or 0.0, {p for p in pts if p in self.f.checkpoints})
        pages: set = set()
        slots: set = set()
        hosted: set = set()
        host = 0                  # the bytes of ``hosted``, kept as it grows (not summed per record)
        cap = self.f.pools
        kept: set[int] = set()
        for i, (_, pts) in enumerate(sorted(holders.values(), key=lambda x: (-x[0], min(x[1], default=0)))):
            for cid in pts:
                p, s, h = self._footprint(cid)
                pages |= p
                slots |= s
                for extent in h - hosted:
                    host += extent[1]
                hosted |= h
            over = (len(pages) > SOFT_TARGET * cap[P.MAIN].total or len(slots) > SOFT_TARGET * cap[P.STATE].total
                    or (self.f.host_capacity and host > SOFT_TARGET * self.f.host_capacity))
            if over and i > 0:
                break
            kept |= pts
        for c in self._reuse:
            if c.cls is Cls.REUSE and c.cid not in kept:
                c.cls = Cls.NORMAL

    # ==== facts ==========================================================================
    def _tokens(self, cid: int) -> tuple[int, ...] | None:
        info = self.table.ckpts.get(cid)
        return info.tokens if info else None

    def _prefixes(self, cid: int) -> list[tuple[int, int]]:
        """(frontier, cid) of the live cache points that are exact prefixes of ``cid`` (itself
        excluded), deepest first — found through the prefix index (one pass over the tokens),
        never by scanning the directory. Cached for this pass. On scoped facts a point outside
        them (Host content only) is live when the records still know it."""
        got = self.prefix_memo.get(cid)
        if got is None:
            live = self.f.checkpoints
            got = [(f, o) for f, o in self.table.prefixes_of(cid)
                   if o in live or (self.f.partial and o in self.table.ckpts)]
            self.prefix_memo[cid] = got
        return got

    def _is_live(self, cid: int) -> bool:
        """A point ``_prefixes`` may list (its liveness test, for one point)."""
        return cid in self.f.checkpoints or (self.f.partial and cid in self.table.ckpts)

    @property
    def _live(self):
        """The points ``_prefixes`` counts: the facts' (on scoped facts, any the records know)."""
        return self.table.ckpts if self.f.partial else self.f.checkpoints

    def fallback(self, cid: int, gone: set[int]) -> int:
        """Deepest surviving exact-prefix point of ``cid`` (0 = root)."""
        return next((f for f, other in self._prefixes(cid) if other not in gone), 0)

    # rule: nested-loss
    def loss(self, group: frozenset[int] | set[int]) -> int:
        """Restore-token loss of deleting ``group`` (with the victims already chosen), counted
        per history: each member loses down to its surviving fallback, less what a co-deleted
        shallower point of the same history (or an identical alias) already counts — nested E,
        input point and Shared do not add the same coverage twice, and aliases deleted
        together are not each other's fallback."""
        gone = self.victims | set(group)
        total = 0
        for c in group:
            f = self.cands[c].frontier
            floor = self.fallback(c, gone)
            for pf, other in self._prefixes(c):
                if other in group and (pf < f or other < c):
                    floor = max(floor, pf)
                    break
            total += f - floor
        return total

    def _freed_blocks(self, gone: set[int]) -> set[int]:
        out = set()
        for cid in gone:
            for bid in self.f.checkpoints[cid].blocks:
                b = self.f.blocks[bid]
                if b.device and not b.pinned and all(h in gone for h in b.holders):
                    out.add(bid)
        return out

    def _freed_by_victims(self) -> set[int]:
        """The Device blocks the plan's deletions free so far (memoised: victims only grow)."""
        if self._release is None or self._release[0] != len(self.victims):
            self._release = (len(self.victims), self._freed_blocks(self.victims), {}, None)
        return self._release[1]

    def _entries(self, m: int) -> list[tuple]:
        """``FactsIndex.entries`` of ``m`` for the victims so far (memoised per victim set)."""
        self._freed_by_victims()
        memo = self._release[2]
        got = memo.get(m)
        if got is None:
            got = memo[m] = self.ix.entries(m, frozenset(self.victims))
        return got

    def _groups(self) -> dict[frozenset[int], list[int]]:
        """``FactsIndex.groups`` for the victims so far."""
        self._freed_by_victims()
        if self._release[3] is None:
            self._release = (*self._release[:3], self.ix.groups(frozenset(self.victims)))
        return self._release[3]

    # rule: useful-release
    def freed_by_delete(self, group: frozenset[int], pool: str) -> int:
        """Device units of ``pool`` that deleting ``group`` (with the victims already chosen)
        frees in addition — shared references are counted once: a block goes when all its
        holders go and a deleted checkpoint lists it; what the victims and the chosen
        demotions free already does not count."""
        if pool == P.STATE:
            return sum(1 for cid in group
                       if self.f.checkpoints[cid].image_device and cid not in self.demoted_images)
        before = self._freed_by_victims() | self.demoted_blocks
        gone = group | self.victims       # every holder gone, and a deleted point lists it
        freed = {bid for m in group for bid, holders, listers in self._entries(m)
                 if holders <= gone and not gone.isdisjoint(listers)}
        return len(freed - before)

    def freed_so_far(self, pool: str) -> int:
        """What the actions chosen so far (for any pool) free in ``pool``."""
        if pool == P.STATE:
            return len(self.demoted_images) + sum(
                1 for cid in self.victims if self.f.checkpoints[cid].image_device and cid not in self.demoted_images)
        return len(self._freed_by_victims() | self.demoted_blocks)

    # rule: sources-stay-put
    def movable_blocks(self, cid: int) -> list[int]:
        """Device blocks of this checkpoint that only checkpoints hold (no resident writer) and no
        bind of this step reads."""
        return [bid for bid in self.ix.movable(cid) if bid not in self.demoted_blocks and bid not in self.read_blocks]

    # ==== Host placement ===================================================================
    def _host_freed_by(self, gone: set[int]) -> list[tuple[int, int]]:
        """Host extents deleting ``gone`` (plus the victims) would free."""
        gone = gone | self.victims
        out = []
        for cid in gone:
            c = self.f.checkpoints[cid]
            if c.image_at and not (cid in self.dup_dropped and c.image_device):
                out.append(c.image_at)
            for bid in c.blocks:
                b = self.f.blocks[bid]
                if b.host_at and bid not in self.dup_pages and all(h in gone for h in b.holders) and not b.pinned:
                    out.append(b.host_at)
        return out

    def _dup_extents(self, cid: int) -> list[tuple[int, int]]:
        """The Host replicas of this checkpoint's content that the Device also holds (safe
        duplicates: releasing them loses nothing) — its StateImage's and those of its Main KV
        pages that no live sequence holds (Native releases exactly these)."""
        c = self.f.checkpoints[cid]
        out = [c.image_at] if c.image_device and c.image_at and not c.leased else []
        return out + [self.f.blocks[b].host_at for b in self._dup_page_ids(cid)]

    def _dup_page_ids(self, cid: int) -> list[int]:
        """Its pages on both media, not yet released in this plan."""
        return [bid for bid in self.f.checkpoints[cid].blocks
                if (b := self.f.blocks[bid]).device and b.host_at and not b.pinned and bid not in self.dup_pages]

    def _host_copy(self, cid: int) -> bool:
        """Its StateImage still has a Host replica (not released as a duplicate in this plan)."""
        return self.f.checkpoints[cid].image_host and cid not in self.dup_dropped

    def _page_on_host(self, bid: int) -> bool:
        """The block's complete Host copy is still there (not released as a duplicate)."""
        return self.f.blocks[bid].host and bid not in self.dup_pages

    def _holes(self, extra_victims: set[int], dups: set[int] = frozenset()) -> list[tuple[int, int]]:
        """The Host's free extents once ``extra_victims`` (and the plan's victims) are deleted and
        ``dups`` released, less what this plan already placed. Memoised: a Host placement ranks
        every candidate for every victim it adds, and each demotion option of a need places an
        image of the same size on the same state — the same sets come back many times. What it
        reads besides its arguments (the victims, the released duplicates, the placed extents)
        only grows inside a planner, so their sizes name its state; the memo starts afresh when
        one grows. Callers do not mutate the list."""
        key = ("holes", frozenset(extra_victims), frozenset(dups))
        return self._memoised(key, lambda: self._holes_now(extra_victims, dups))

    def _memoised(self, key: tuple, compute):
        """``compute()`` once per ``key`` on this planner's current state (see ``_holes``): the
        memo is emptied when the victims, the placed extents or the released duplicates grow."""
        version = (len(self.victims), len(self.host_used), len(self.dup_dropped), len(self.dup_pages))
        if self._memo_version != version:
            self._memo_version, self._memo = version, {}
        got = self._memo.get(key)
        if got is None:
            got = self._memo[key] = compute()
        return got

    def _host_freed_bytes(self, gone: frozenset[int]) -> int:
        """Bytes of ``_host_freed_by(gone)`` as the ranking counts them (memoised like ``_holes``)."""
        return self._memoised(("freed", gone), lambda: sum(s for _, s in self._host_freed_by(set(gone))))

    def _fits(self, extra_victims: set[int], dups: set[int], sizes: list[int]) -> bool:
        """``sizes`` place first-fit into ``_holes(extra_victims, dups)`` (memoised with it)."""
        key = ("fits", frozenset(extra_victims), frozenset(dups), tuple(sizes))
        return self._memoised(key, lambda: fits_first_fit(self._holes(extra_victims, dups), sizes))

    def _holes_now(self, extra_victims: set[int], dups: set[int]) -> list[tuple[int, int]]:
        dup = [e for cid in dups for e in self._dup_extents(cid)]
        dup += [c.image_at for cid in self.dup_dropped
                if (c := self.f.checkpoints[cid]).image_device and c.image_at and not c.leased]
        dup += [self.f.blocks[bid].host_at for bid in self.dup_pages]
        # the quote's free extents merged once per quote; the few freed and released ones put
        # in their places (``merge_into``: the same list as merging them all again)
        extra = self._host_freed_by(extra_victims) + dup
        free = merge_into(self.ix.host_free, extra)
        if free is None:
            free = merge_extents(sorted(set(list(self.f.host_free) + extra)))
        if not self.host_used:
            return free
        # remove what this plan already placed (first-fit from the lowest offset)
        placed = place_first_fit(free, [s for _, s in self.host_used])
        return placed[1] if placed else []

    # rule: host-gain-cap
    def host_gain_cap(self, holes: list[tuple[int, int]], sizes: list[int]) -> int:
        """What a Host victim's freed bytes count for when ranking (seed: 排序收益以字节缺口为
        上限): the byte shortfall, or — when the free bytes suffice but do not fit — the
        largest single allocation."""
        free = sum(s for _, s in holes)
        need = sum(sizes)
        return need - free if free < need else max(sizes)

    def _ranked(self, c: Candidate, chosen: set[int], sizes: list[int], cap: int, base: int,
                dups: set[int]):
        """``_host_rank``, memoised on the planner's state: the demotion options of one need each
        run a placement of their own, and their rankings mostly repeat (the same candidates
        against the same victims chosen so far); ``cap`` and ``base`` follow from the key."""
        key = ("rank", c.cid, frozenset(chosen), tuple(sizes), frozenset(dups))
        return self._memoised(key, lambda: self._host_rank(c, chosen, sizes, cap, base, dups))

    # rule: host-fit-first
    def _host_rank(self, c: Candidate, chosen: set[int], sizes: list[int], cap: int, base: int,
                   dups: set[int] = frozenset()):
        """Reclaim order for the next Host victim: normal before reuse content; an action that
        lets the request fit before one that only adds free bytes; normal content by loss per
        useful freed byte (capped), reuse content oldest demand first."""
        fits = self._fits(chosen | {c.cid}, dups, sizes)
        gain = min(cap, max(1, self._host_freed_bytes(frozenset(chosen | {c.cid})) - base))
        loss = self.loss(chosen | {c.cid}) - self.loss(chosen) if chosen else self.loss({c.cid})
        order = loss / gain if c.cls is Cls.NORMAL else c.demand_time
        return (c.cls, not fits, order, c.cid)

    def place_host(self, sizes: list[int], admissible: Callable[[Candidate], bool],
                   budget: float | Callable[[], float] | None = None, dups: bool = True,
                   keep: frozenset[int] | set[int] = frozenset()) -> tuple[list, int] | None:
        """Room for ``sizes`` on the Host, first-fit into contiguous free extents (byte totals
        do not count). Safe Host duplicates go first (seed: Host 先释放安全的重复副本); then
        victims, added one by one in reclaim order (``_host_rank``); then what is no longer
        needed is pruned. Returns (actions, loss) — a victim is its cid, a released duplicate
        ``("dup", cid)`` — or None if no admissible set places it (then nothing is deleted).
        ``keep``: blocks this allocation demotes — their Host copies are not released."""
        if not sizes:
            return [], 0
        if self._fits(set(), set(), sizes):
            return [], 0
        migrating = self._migrating()
        spare: list[int] = []
        # rule: host-dups-first
        if dups:
            spare = sorted((cid for cid in self.f.checkpoints
                            if cid not in self.victims and cid not in migrating and cid not in self.dup_dropped
                            and self._dup_extents(cid) and not keep & set(self._dup_page_ids(cid))),
                           key=lambda cid: (-sum(s for _, s in self._dup_extents(cid)), cid))
        taken: list[int] = []
        for cid in spare:
            if self._fits(set(), set(taken), sizes):
                break
            taken.append(cid)
        pool = [c for c in self.cands.values()
                if c.cid not in self.victims and c.cid not in migrating and admissible(c)
                and self.f.checkpoints[c.cid].image_at]
        if sum(size for _, size in self._holes({c.cid for c in pool}, set(taken))) < sum(sizes):
            # not even every admissible victim frees the bytes: nothing places it (without this the
            # loop below ranks every candidate for every victim it adds before finding that out)
            if self.f.partial and self.window_short is not None:
                self.window_short()
            return None
        chosen: list[int] = []
        while True:
            holes = self._holes(set(chosen), set(taken))
            if fits_first_fit(holes, sizes):
                break
            rest = [c for c in pool if c.cid not in chosen]
            if not rest:
                if self.f.partial and self.window_short is not None:
                    self.window_short()
                return None
            cap = self.host_gain_cap(holes, sizes)
            base = self._host_freed_bytes(frozenset(chosen))
            chosen.append(min(rest, key=lambda c: self._ranked(c, set(chosen), sizes, cap, base, set(taken))).cid)
        # rule: host-prune
        for cid in list(chosen):                     # drop actions no longer needed
            rest = [x for x in chosen if x != cid]
            if self._fits(set(rest), set(taken), sizes):
                chosen = rest
        taken = [c for c in taken if c not in chosen]    # a deleted one frees its copies anyway
        for cid in list(taken):
            rest = [x for x in taken if x != cid]
            if self._fits(set(chosen), set(rest), sizes):
                taken = rest
        loss = self.loss(set(chosen))
        if budget is not None and loss >= (budget() if callable(budget) else budget):
            return None
        return chosen + [("dup", cid) for cid in taken], loss

    def commit_host(self, sizes: list[int], victims: list) -> list[P.Action]:
        acts: list[P.Action] = []
        for v in victims:
            if isinstance(v, tuple):                 # a safe Host duplicate released first
                c = self.f.checkpoints[v[1]]
                self.dup_pages.update(self._dup_page_ids(v[1]))
                self.dup_dropped.add(v[1])
                acts.append(P.DropHostCopy(c.cid, c.generation, c.version))
        acts += self._delete([v for v in victims if not isinstance(v, tuple)])
        placed = place_first_fit(self._holes(set()), sizes)
        assert placed is not None
        for off, size in zip(placed[0], sizes):
            self.host_used.append((off, size))
        return acts

    def _delete(self, cids) -> list[P.Action]:
        acts = []
        for cid in sorted(cids):
            self.victims.add(cid)
            c = self.f.checkpoints[cid]
            acts.append(P.Delete(cid, c.generation, c.version))
        return acts

    # ==== reclaim for a Device gap ============================================================
    def plan(self, need: dict[str, int]) -> tuple[list[P.Action], bool]:
        """Actions for the gap (beyond what earlier passes freed) and whether they cover it."""
        actions: list[P.Action] = []
        base = {pool: self.freed_so_far(pool) for pool in (P.STATE, P.MAIN)}
        # rule: state-before-kv
        for pool in (P.STATE, P.MAIN):          # seed: Device State first, then Main KV
            short = need.get(pool, 0) + base[pool] - self.freed_so_far(pool)
            while short > 0:
                acts, freed = self._best(pool, short)
                if not acts:
                    break
                actions.extend(acts)
                short -= freed
            if short > 0:
                return actions, False   # cannot cover this gap; the caller decides what next
        return actions, True

    def _migrating(self) -> set[int]:
        """The checkpoints whose content a chosen demotion moves (memoised: the demotions only
        grow inside a planner). Callers do not mutate it."""
        key = (len(self.demoted_images), len(self.demoted_blocks))
        if self._migrating_memo is None or self._migrating_memo[0] != key:
            listers = self.ix.listers
            self._migrating_memo = (key, self.demoted_images | {cid for bid in self.demoted_blocks
                                                                 for cid in listers.get(bid, ())})
        return self._migrating_memo[1]

    def _delete_options(self, pool: str) -> list[frozenset[int]]:
        """Victim sets worth deleting for this pool: single checkpoints, and for every Device
        block all its remaining holders together (shared content goes only when every holder
        goes; aliases deleted together are not each other's fallback)."""
        migrating = self._migrating()
        sets: dict[frozenset[int], None] = {frozenset({cid}): None for cid in self.cands
                                            if cid not in self.victims and cid not in migrating}
        if pool == P.MAIN:
            for rest, bids in self._groups().items():
                if (rest not in sets and any(bid not in self.demoted_blocks for bid in bids)
                        and all(h in self.cands and h not in migrating for h in rest)):
                    sets[rest] = None
        return list(sets)

    def _ticket(self, cid: int) -> int | None:
        """The original ticket of the pause snapshot this checkpoint is (None: not one)."""
        if cid not in self._ticket_memo:
            self._ticket_memo[cid] = min((self.tickets[o] for o in self.f.checkpoints[cid].owners
                                          if isinstance(o, SnapshotOwner) and o in self.tickets), default=None)
        return self._ticket_memo[cid]

    # rule: host-admission
    def host_admission(self, cand: Candidate):
        """Which Host content a demotion of ``cand`` may replace, and the loss budget
        (seed admission table): a pause snapshot may replace optional cache, then pause
        snapshots of later tickets; other content (a Host write-back of existing content) only
        by its own eligibility — normal content replaces normal, reuse content also older reuse
        — and for less loss than the restore coverage it keeps."""
        ticket = self._ticket(cand.cid)
        if ticket is not None:
            def snapshot_may(v: Candidate) -> bool:
                other = self._ticket(v.cid)
                return v.cls <= Cls.REUSE or (other is not None and other > ticket)
            return snapshot_may, None
        def own(v: Candidate) -> bool:
            return v.cls is Cls.NORMAL or (cand.cls is Cls.REUSE and v.cls is Cls.REUSE and v.demand_time < cand.demand_time)
        # the budget is computed only if Host victims are needed at all (most placements fit)
        return own, lambda: cand.frontier - self.fallback(cand.cid, self.victims)

    def _options(self, pool: str, short: int) -> list[tuple]:
        """(cls, demand time, loss, freed, action, host sizes, host victims) per option — every
        option, each evaluated: the exhaustive form of ``_choose`` (the tests hold the two equal)."""
        options = []
        for cid, cand in self.cands.items():
            if cid not in self.victims:
                options += self._demotion_options(cand, pool, short)
        for group in self._delete_options(pool):
            options += self._delete_option(group, pool)
        return options

    def _demotion_options(self, cand: Candidate, pool: str, short: int) -> list[tuple]:
        """The demotion option of ``cand`` for this pool, if its content can move (none or one)."""
        cid = cand.cid
        c = self.f.checkpoints[cid]
        if pool == P.STATE and self.demote and c.image_device and cid not in self.demoted_images:
            sizes = [] if self._host_copy(cid) else [self.f.image_bytes]
            host = self._demotion_room(cand, sizes)
            if host is not None:
                return [(cand.cls, cand.demand_time, host[1], 1, ("demote_state", cid), sizes, host[0])]
        if pool == P.MAIN and self.demote:
            blocks = self.movable_blocks(cid)[-short:]
            # rule: page-groups
            while blocks:                 # page groups that do not fit are halved and retried
                sizes = [self.f.page_bytes for b in blocks if not self._page_on_host(b)]
                host = self._demotion_room(cand, sizes, frozenset(blocks))
                if host is not None:
                    return [(cand.cls, cand.demand_time, host[1], len(blocks),
                             ("demote_blocks", cid, tuple(blocks)), sizes, host[0])]
                blocks = blocks[len(blocks) // 2:] if len(blocks) > 1 else []
        return []

    def _delete_option(self, group: frozenset[int], pool: str) -> list[tuple]:
        """The deletion option of ``group`` for this pool, if it frees anything (none or one)."""
        freed = self.freed_by_delete(group, pool)
        if not freed:
            return []
        cls = max(self.cands[c].cls for c in group)
        hot = max(self.cands[c].demand_time for c in group)
        return [(cls, hot, self.loss(group), freed, ("delete", group), [], [])]

    def _least_loss(self, cid: int) -> int:
        """A lower bound of what deleting ``cid`` loses, whatever else goes with it: down to its
        deepest exact prefix point, surviving or not (``loss`` never counts less)."""
        got = self.least_memo.get(cid)
        if got is None:
            listed = self.prefix_memo.get(cid)
            deepest = (next((pf for pf, _ in listed), 0) if listed is not None
                       else self.table.deepest_prefix(cid, self._live))
            got = self.least_memo[cid] = self.cands[cid].frontier - deepest
        return got

    def _loss_floor(self, cid: int) -> int:
        """``_least_loss`` where it is known, else a cheaper lower bound of it: 0 where the point
        may lose nothing (the root, or a live point with its very tokens may exist), else 1 — no
        prefix list is brought up to date. A bound built on it is made exact (``_group_bound``)
        only when a scan reaches it."""
        got = self.least_memo.get(cid)
        if got is None:
            got = self.floor_memo.get(cid)
            if got is None:
                got = self.floor_memo[cid] = int(not self.table.may_lose_nothing(cid, self.cands[cid].frontier,
                                                                                  self._live))
        return got

    def _most(self, pool: str, members: int) -> int:
        """At most what deleting ``members`` checkpoints frees in ``pool``: a slot each, or every
        Device block no sequence pins (a bound that holds whatever the victims)."""
        return members if pool == P.STATE else len(self.ix.releasable)

    def _group_bound(self, pool: str, group: frozenset[int], least: Callable[[int], int] | None = None) -> tuple:
        """A lower bound of a deletion's rank (``_rank`` with a loss no greater and a release no
        smaller than it can ever have on these facts: it loses at least ``_least_loss`` of each
        member — or ``least``, a bound of it — and frees at most ``_most``)."""
        least = least or self._least_loss
        return self._rank(max(self.cands[c].cls for c in group), max(self.cands[c].demand_time for c in group),
                          sum(least(c) for c in group), self._most(pool, len(group)), ("delete", group))

    def _order(self, pool: str) -> _Order:
        """This planner's options for ``pool`` but the groups, by their rank's lower bound — each
        candidate's demotion (if its content is on the Device) and its single deletion (where it
        can free anything of the pool; its bound on ``_loss_floor``: not exact) — sorted into the
        runs of an ``_Order``. Built once per pool: the bounds do not move as the plan grows, and
        an option closed since is skipped (``_open``).

        Its ``floor`` (Main only; None: no group can be an option): a bound below every group's
        rank, one below every group with a member whose floor is not 0, and the candidates whose
        floor is 0. A group's members hold a releasable page only checkpoints hold, so each is a
        candidate whose deletion is in the order: its class, demand and floor are counted here."""
        got = self._orders.get(pool)
        if got is not None:
            return got
        main = pool == P.MAIN
        most = self._most(pool, 1)
        cks = self.f.checkpoints
        touch = self.ix.touch_lists() if main else None
        demote = ("demote_blocks" if main else "demote_state") if self.demote else None
        runs: dict[tuple, list[int]] = {}
        for cid, cand in self.cands.items():
            on_device = True if main else cks[cid].image_device
            # a demotion loses at least nothing
            if demote and on_device:
                runs.setdefault((demote, cand.cls, cand.demand_time, 0), []).append(cid)
            # a single deletion (``_group_bound`` of a one-member group), where it can free
            # anything of this pool: a Device image, a releasable page it holds or lists (a
            # Host-only candidate's deletion would only ever be evaluated to nothing)
            if most and (touch.get(cid) if main else on_device):
                runs.setdefault(("delete", cand.cls, cand.demand_time, self._loss_floor(cid)), []).append(cid)
        floor = None
        deletions = [(key, cids) for key, cids in runs.items() if key[0] == "delete"]
        if main and sum(len(cids) for _, cids in deletions) > 1 and self._most(pool, 2):
            # any group has two or more of these candidates: its class, demand and least loss
            # are at least the smallest, and its loss at least the two smallest least losses —
            # or, with a member whose floor is not 0, at least 1 (``_choose`` then lists only
            # the groups of candidates whose floor is 0: on a full Device a few identical aliases)
            least = heapq.nsmallest(2, (key[3] for key, cids in deletions for _ in cids[:2]))
            cls, hot = min(key[1] for key, _ in deletions), min(key[2] for key, _ in deletions)
            most2 = self._most(pool, 2)
            floor = _GroupFloor(self._rank(cls, hot, least[0] + least[1], most2, ("delete", ())),
                                self._rank(cls, hot, 1, most2, ("delete", ())),
                                {cid for key, cids in deletions if not key[3] for cid in cids})
        got = self._orders[pool] = _Order(runs, self.cands, most, self._rank, floor)
        return got

    def _open(self, pool: str, kind: str, item) -> bool:
        """The option is one the plan can still take (exactly ``_delete_options`` and the
        demotions' conditions)."""
        if kind == "demote_state":
            return item.cid not in self.victims and item.cid not in self.demoted_images
        if kind == "demote_blocks":
            return item.cid not in self.victims and bool(self.movable_blocks(item.cid))
        migrating = self._migrating()
        if len(item) == 1:
            (cid,) = item
            return cid not in self.victims and cid not in migrating
        bids = self._groups().get(item)
        return (bids is not None and any(bid not in self.demoted_blocks for bid in bids)
                and all(h in self.cands and h not in migrating for h in item))

    def _evaluate(self, pool: str, short: int, kind: str, item) -> list[tuple]:
        if kind == "delete":
            return self._delete_option(item, pool)
        return self._demotion_options(item, pool, short)

    def _demotion_room(self, cand: Candidate, sizes: list[int], keep: frozenset[int] = frozenset()):
        """``place_host`` for a demotion of ``cand`` under its Host admission (judged only when
        the Host has no room as it is: most demotions place without victims)."""
        if not sizes or self._fits(set(), set(), sizes):
            return [], 0
        may, budget = self.host_admission(cand)
        return self.place_host(sizes, lambda v: may(v) and v.cid != cand.cid, budget, keep=keep)

    @staticmethod
    # rule: reclaim-ranking
    def _rank(cls: Cls, hot: float, loss: int, freed: int, what: tuple) -> tuple:
        """An option's place in reclaim order (smallest first): normal content by loss per
        useful freed unit, then older demand; other content by class, older demand, loss per
        unit; last, its action (deletions before demotions, then the checkpoints' ids)."""
        tie = (what[0], tuple(sorted(what[1])) if what[0] == "delete" else what[1])
        if cls is Cls.NORMAL:
            return (0, loss / freed, hot, tie)
        return (cls, hot, loss / freed, tie)

    def _choose(self, pool: str, short: int) -> tuple | None:
        """The option ``_rank`` puts first, evaluating options in the order of their rank's
        lower bound and stopping at the first whose bound is not below the best found (exactly
        ``min(self._options(pool, short), key=rank)``: most options are never evaluated — with
        a full Device nearly every plan's winner is a demotion that loses nothing). The groups
        of holders left on a block are listed only when their floor is below the best."""
        best, best_rank = None, None

        def scan(at):
            """The options ``at(0), at(1), ...`` (each (bound, sequence, kind, item, exact), sorted
            by bound; None past the last) in that order: a deletion's bound from cheaper least
            losses is made exact when reached, and goes back in its place when that raises it."""
            nonlocal best, best_rank
            back: list[tuple] = []      # raised bounds, as a heap
            i = seq = 0
            while True:
                entry = at(i)
                if back and (entry is None or back[0][0] < entry[0]):
                    entry = heapq.heappop(back)
                elif entry is None:
                    return
                else:
                    i += 1
                bound, _, kind, item, exact = entry
                if best_rank is not None and bound >= best_rank:
                    return
                if not self._open(pool, kind, item):
                    continue
                if not exact:
                    real = self._group_bound(pool, item)     # on the least losses themselves
                    if real > bound:
                        seq += 1
                        heapq.heappush(back, (real, seq, kind, item, True))
                        continue
                for o in self._evaluate(pool, short, kind, item):
                    r = self._rank(*o[:5])
                    if best_rank is None or r < best_rank:
                        best, best_rank = o, r
        order = self._order(pool)
        scan(order.at)
        floor = order.floor
        if floor is not None and (best_rank is None or floor.any < best_rank):
            memo = self._group_bounds.setdefault(pool, {})
            groups = []
            # a group with a member whose loss floor is not 0 is not below the best when a loss
            # of 1 is not: only the groups of the others are listed then
            members = self.cands.keys() if best_rank is None or floor.lossy < best_rank else floor.lossless
            for g in self._groups():
                if not members >= g:
                    continue                    # not open (``_open``) or not below the best
                bound = memo.get(g)
                if bound is None:
                    bound = memo[g] = self._group_bound(pool, g, self._loss_floor)
                # a group whose bound is not below the best is never evaluated (``scan`` stops
                # there): whether it is still open is asked only of the others
                if (best_rank is None or bound < best_rank) and self._open(pool, "delete", g):
                    groups.append((bound, len(groups), "delete", g, False))
            groups.sort()
            scan(lambda i: groups[i] if i < len(groups) else None)
        return best

    def _best(self, pool: str, short: int):
        chosen = self._choose(pool, short)
        if chosen is None:
            return [], 0
        cls, hot, loss, freed, what, sizes, host_victims = chosen
        acts = self.commit_host(sizes, host_victims) if sizes else []
        if what[0] == "delete":
            acts += self._delete(what[1])
        elif what[0] == "demote_state":
            cid = what[1]
            c = self.f.checkpoints[cid]
            self.demoted_images.add(cid)
            acts.append(P.DemoteState(cid, c.generation, c.version))
        else:
            cid, bids = what[1], what[2]
            c = self.f.checkpoints[cid]
            self.demoted_blocks.update(bids)
            acts.append(P.DemoteBlocks(cid, c.generation, bids, tuple(self.f.blocks[b].version for b in bids)))
        self.steps.append(acts)
        return acts, freed

    # ==== admission of a new capture ===========================================================
    def plan_capture(self, benefit: int, own_demand: float | None, owner_reuse: bool) -> list[P.Action] | None:
        """Make room for one StateImage capture when neither Device nor Host has it free.

        Without own repeat demand: the owner's retention level bounds what may be replaced
        (normal owners replace normal content only) and the fixed new-coverage benefit must
        exceed the cumulative deletion loss (Host and Device steps share the budget).
        With own repeat demand: normal content, or reuse content whose demand is older than
        the candidate's own, may be replaced, without a coverage budget.
        Returns the actions, or None to skip the save (it never blocks necessary work)."""
        # rule: capture-admission
        if own_demand is not None:
            admissible = lambda c: c.cls is Cls.NORMAL or (c.cls is Cls.REUSE and c.demand_time < own_demand)  # noqa: E731
            budget = None
        else:
            admissible = lambda c: c.cls is Cls.NORMAL or (c.cls is Cls.REUSE and owner_reuse)  # noqa: E731
            budget = benefit
        best = None
        taken = self.victims | self._migrating()
        # 1. a Device slot: delete an admissible Device image, or release the Device copy of one
        #    that has a Host copy
        for cid, cand in self.cands.items():
            c = self.f.checkpoints[cid]
            if cid in taken or not c.image_device or not admissible(cand):
                continue
            loss = self.loss({cid})
            if budget is None or loss < budget:
                opt = (loss, 1, ("delete", cid), [], [])
                best = min(best, opt, key=lambda o: (o[0], o[1], str(o[2]))) if best else opt
            # a demotion frees the slot for this step's capture only when the image already has
            # a Host copy (its Device copy goes at once); one that must copy frees it once the
            # copy publishes — after the capture (the worker would skip the save)
            if self._host_copy(cid):
                opt = (0, 0, ("demote", cid), [], [])
                best = min(best, opt, key=lambda o: (o[0], o[1], str(o[2]))) if best else opt
        # 2. the capture itself on the Host
        host = self.place_host([self.f.image_bytes], admissible, budget)
        if host is not None:
            opt = (host[1], 2, ("host",), [self.f.image_bytes], host[0])
            best = min(best, opt, key=lambda o: (o[0], o[1], str(o[2]))) if best else opt
        if best is None:
            return None
        _, _, what, sizes, host_victims = best
        acts = self.commit_host(sizes, host_victims) if sizes else []
        if what[0] == "delete":
            return acts + self._delete([what[1]])
        if what[0] == "demote":
            c = self.f.checkpoints[what[1]]
            self.demoted_images.add(what[1])
            return acts + [P.DemoteState(what[1], c.generation, c.version)]
        return acts
