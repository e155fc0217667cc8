"""Reclaim planning: choose physical actions for the current typed gap (seed: 回收与准入).

Input: one quote (physical facts with real holder sets) and the logical records. Output: a
batch of Native actions — demotions (Device→Host, zero restore loss when the Host has room
first-fit) and deletions — chosen in the seed's order for the scarce unit at hand:

* Device State first, then Main KV; the Host destination is prechecked by placement.
* Normal content before reuse content.
* Normal actions by marginal restore-token loss ÷ release useful for this gap, ties by
  retention order; reuse actions oldest real demand first.
* Loss uses the real surviving fallback after the action: the deepest other point that is an
  exact prefix (victims chosen together are not each other's fallback).
* Revocable holds (younger waiters, later-ticket pause snapshots) are considered only after
  optional cache, and only when the requester is allowed to revoke them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ninfer import protocol as P
from ninfer.policy.records import Level, RecordTable
from ninfer.placement import place_first_fit

OPTIONAL_PREFIXES = ("r", "m")


@dataclass
class Candidate:
    cid: int
    cls: int                  # 0 normal, 1 reuse, 2 revocable waiter, 3 revocable snapshot
    demand_time: float
    frontier: int


def _classify(owners: tuple[str, ...], table: RecordTable, may_revoke: Callable[[str], bool]) -> int | None:
    cls = 0
    for o in owners:
        if o.startswith(OPTIONAL_PREFIXES):
            level = _level(o, table)
            cls = max(cls, 1 if level == Level.REUSE else 0)
        elif o.startswith("w:") and may_revoke(o):
            cls = max(cls, 2)
        elif o.startswith("seq:") and may_revoke(o):
            cls = max(cls, 3)
        else:
            return None           # a necessary hold: not a reclaim candidate
    return cls


def _level(owner: str, table: RecordTable) -> str:
    if owner.startswith("m"):
        ent = table.entries.get(int(owner[1:]))
        return ent.level if ent else Level.NORMAL
    rec = table.records.get(int(owner[1:].split(".")[0]))
    return rec.level if rec else Level.NORMAL


def _demand_time(owners: tuple[str, ...], table: RecordTable) -> float:
    times = []
    for o in owners:
        if o.startswith("m"):
            ent = table.entries.get(int(o[1:]))
            times.append(ent.evidence.demand_time if ent and ent.evidence.demand_time else 0.0)
        elif o.startswith("r"):
            rec = table.records.get(int(o[1:].split(".")[0]))
            times.append(rec.evidence.demand_time if rec and rec.evidence.demand_time else 0.0)
    return max(times, default=0.0)


class Planner:
    """One planning pass over one quote."""

    def __init__(self, facts: P.Facts, table: RecordTable, protect: set[int],
                 may_revoke: Callable[[str], bool]):
        self.f = facts
        self.table = table
        self.victims: set[int] = set()
        self.demoted_images: set[int] = set()
        self.demoted_blocks: set[int] = set()
        self.host_free = list(facts.host_free)
        self.cands: dict[int, Candidate] = {}
        for cid, c in facts.checkpoints.items():
            if cid in protect or c.leased:
                continue
            cls = _classify(c.owners, table, may_revoke)
            if cls is not None:
                self.cands[cid] = Candidate(cid, cls, _demand_time(c.owners, table), c.frontier)

    # -- facts ---------------------------------------------------------------------------
    def _tokens(self, cid: int) -> tuple[int, ...] | None:
        info = self.table.ckpts.get(cid)
        return info.tokens if info else None

    def fallback(self, cid: int, gone: set[int]) -> int:
        """Deepest surviving exact-prefix point of ``cid`` (0 = root)."""
        toks = self._tokens(cid)
        if toks is None:
            return 0
        best = 0
        for other, info in self.table.ckpts.items():
            if other == cid or other in gone or other not in self.f.checkpoints:
                continue
            if info.ref.kind == "cache" and info.frontier <= len(toks) and info.tokens == toks[: info.frontier]:
                best = max(best, info.frontier)
        return best

    def freed_by_delete(self, group: frozenset[int], pool: str) -> int:
        """Device units of ``pool`` that deleting ``group`` (with the victims already chosen)
        frees in addition — shared references are counted once."""
        gone = self.victims | group
        if pool == P.STATE:
            return sum(1 for cid in group
                       if self.f.checkpoints[cid].image_device and cid not in self.demoted_images)
        seen: set[int] = set()
        for cid in group:
            for bid in self.f.checkpoints[cid].blocks:
                b = self.f.blocks[bid]
                if (bid not in seen and b.device and not b.pinned and bid not in self.demoted_blocks
                        and all(h in gone for h in b.holders)):
                    seen.add(bid)
        return len(seen)

    def freed_so_far(self, pool: str) -> int:
        """What the actions chosen so far (for any pool) free in ``pool``."""
        if pool == P.STATE:
            return len(self.demoted_images) + sum(
                1 for cid in self.victims if self.f.checkpoints[cid].image_device and cid not in self.demoted_images)
        freed = set(self.demoted_blocks)
        for cid in self.victims:
            for bid in self.f.checkpoints[cid].blocks:
                b = self.f.blocks[bid]
                if b.device and not b.pinned and all(h in self.victims for h in b.holders):
                    freed.add(bid)
        return len(freed)

    def movable_blocks(self, cid: int) -> list[int]:
        """Device blocks of this checkpoint that only checkpoints hold (no resident writer)."""
        c = self.f.checkpoints[cid]
        return [bid for bid in c.blocks
                if self.f.blocks[bid].device and not self.f.blocks[bid].pinned
                and bid not in self.demoted_blocks and all(h > 0 for h in self.f.blocks[bid].holders)]

    def _place(self, sizes: list[int]) -> bool:
        placed = place_first_fit(self.host_free, sizes)
        if placed is None:
            return False
        self.host_free = placed[1]
        return True

    # -- planning ------------------------------------------------------------------------
    def plan(self, need: dict[str, int]) -> tuple[list[P.Action], bool]:
        """Actions for the gap and whether they cover all of it."""
        actions: list[P.Action] = []
        for pool in (P.STATE, P.MAIN):          # seed: Device State first, then Main KV
            short = need.get(pool, 0) - self.freed_so_far(pool)
            while short > 0:
                acts, freed = self._best(pool, short)
                if not acts:
                    break
                actions.extend(acts)
                short -= freed
            if short > 0:
                return actions, False   # cannot cover this gap; the caller decides what next
        return actions, True

    def _delete_options(self, pool: str) -> list[frozenset[int]]:
        """Victim sets worth deleting for this pool: single checkpoints, and for every Device
        block all its remaining holders together (shared content goes only when every holder
        goes; aliases deleted together are not each other's fallback)."""
        migrating = self.demoted_images | {cid for cid, c in self.f.checkpoints.items()
                                           if set(c.blocks) & self.demoted_blocks}
        sets: set[frozenset[int]] = {frozenset({cid}) for cid in self.cands
                                     if cid not in self.victims and cid not in migrating}
        if pool == P.MAIN:
            for b in self.f.blocks.values():
                if not b.device or b.pinned or b.bid in self.demoted_blocks:
                    continue
                rest = frozenset(h for h in b.holders if h not in self.victims)
                if rest and all(h in self.cands and h not in migrating for h in rest):
                    sets.add(rest)
        return sorted(sets, key=sorted)

    def _set_loss(self, group: frozenset[int]) -> int:
        gone = self.victims | group
        return sum(self.cands[c].frontier - self.fallback(c, gone) for c in group)

    def _best(self, pool: str, short: int):
        options = []
        for cid, cand in self.cands.items():
            if cid in self.victims:
                continue
            c = self.f.checkpoints[cid]
            # demotion: zero restore loss if the Host takes it first-fit
            if pool == P.STATE and c.image_device and cid not in self.demoted_images:
                sizes = [] if c.image_host else [self.f.image_bytes]
                options.append((cand.cls, cand.demand_time, 0, 1, ("demote_state", cid), sizes))
            if pool == P.MAIN:
                blocks = self.movable_blocks(cid)[-short:]
                if blocks:
                    sizes = [self.f.page_bytes for b in blocks if not self.f.blocks[b].host]
                    options.append((cand.cls, cand.demand_time, 0, len(blocks),
                                    ("demote_blocks", cid, tuple(blocks)), sizes))
        for group in self._delete_options(pool):
            freed = self.freed_by_delete(group, pool)
            if freed:
                cls = max(self.cands[c].cls for c in group)
                hot = max(self.cands[c].demand_time for c in group)
                options.append((cls, hot, self._set_loss(group), freed, ("delete", group), []))
        if not options:
            return [], 0

        def key(o):
            cls, hot, loss, freed, what, _ = o
            if cls == 0:
                return (0, loss / freed, hot, str(what))
            return (cls, hot, loss / freed, str(what))

        for cls, hot, loss, freed, what, sizes in sorted(options, key=key):
            if sizes and not self._place(sizes):
                continue
            if what[0] == "delete":
                acts = []
                for cid in sorted(what[1]):
                    self.victims.add(cid)
                    c = self.f.checkpoints[cid]
                    acts.append(P.Delete(cid, c.generation, c.version))
                return acts, freed
            cid = what[1]
            c = self.f.checkpoints[cid]
            if what[0] == "demote_state":
                self.demoted_images.add(cid)
                return [P.DemoteState(cid, c.generation, c.version)], freed
            bids = what[2]
            self.demoted_blocks.update(bids)
            return [P.DemoteBlocks(cid, c.generation, bids, tuple(self.f.blocks[b].version for b in bids))], freed
        return [], 0
