"""Host-resident checkpoints in an estimate of Host reclaim order, kept incrementally (issue:
bounded policy cost — reclaim candidates in ordered structures, never a directory rescan).

A scoped quote carries the Device's content in full; for Host placement it carries only a
*window*: the first Host-resident checkpoints in this order. The Planner then ranks exactly
inside the window (fit first, capped gain, loss per freed byte, pruning — seed: Host 放置预检),
and when no admissible set inside the window places an allocation, the controller quotes again
without a window (``EngineStats.wide_quotes`` counts how often).

The estimate follows the seed's order as far as it is static: optional normal content first,
by restore-token loss to its nearest surviving exact prefix (every Host victim frees at least a
StateImage, which caps the counted gain of any single Host allocation, so the per-byte order is
the loss order), ties by cid; then reuse content, oldest real demand first; then revocable holds
(waiting references, pause snapshots). Checkpoints a necessary hold keeps are left out. What it
cannot see statically — whether a victim's extent lets a multi-page allocation fit, a fallback
added since the checkpoint last changed — the Planner judges exactly inside the window.

Updates are O(affected · log n): the record table marks a checkpoint when it is added, loses
an owner or is deleted, when its placement changes, and when its records' evidence changes; the
marks are folded in before each window is read.
"""

from __future__ import annotations

from sortedcontainers import SortedList

from ninfer.policy.reclaim import Cls
from ninfer.policy.records import Level, RecordTable
from ninfer.protocol import EntryOwner, RecordOwner, SnapshotOwner, WaiterOwner


class HostOrder:
    def __init__(self, table: RecordTable):
        self.table = table
        self.order: SortedList = SortedList()
        self.keys: dict[int, tuple] = {}

    def window(self, k: int) -> list[int]:
        """The first ``k`` Host-resident checkpoints in reclaim order (estimate)."""
        self.refresh()
        return [key[-1] for key in self.order.islice(0, k)]

    def refresh(self) -> None:
        dirty = self.table.dirty
        for cid in dirty:
            old = self.keys.pop(cid, None)
            if old is not None:
                self.order.remove(old)
            key = self._key(cid)
            if key is not None:
                self.keys[cid] = key
                self.order.add(key)
        dirty.clear()

    def __len__(self) -> int:
        return len(self.order)

    def check(self, on_device: dict[int, bool]) -> str:
        """Why the order disagrees with the checkpoints' real placement (``on_device``: cid ->
        StateImage on the Device, from a full quote) or with their owners' classes; "" when it
        agrees. The loss estimate is the one taken when the checkpoint last changed (the
        Planner ranks exactly inside the window), so only membership and class are checked."""
        self.refresh()
        for cid, info in self.table.ckpts.items():
            if cid in on_device and info.ref.device != on_device[cid]:
                return f"checkpoint {cid}: the mirror says on_device={info.ref.device}, the worker {on_device[cid]}"
            want, got = self._key(cid), self.keys.get(cid)
            if (want is None) != (got is None) or (want is not None and want[0] != got[0]):
                return f"checkpoint {cid}: Host order has {got}, its owners and placement give {want}"
            if want is not None and want[0] == 1 and want[1] != got[1]:
                return f"checkpoint {cid}: Host order keeps demand {got[1]}, its records say {want[1]}"
        if set(self.keys) - set(self.table.ckpts):
            return "the Host order names deleted checkpoints"
        return ""

    def _key(self, cid: int) -> tuple | None:
        table = self.table
        info = table.ckpts.get(cid)
        if info is None or info.ref.device or not info.owners:
            return None                          # gone, or on the Device (always quoted)
        cls = Cls.NORMAL
        demand = 0.0
        for o in info.owners:
            if isinstance(o, RecordOwner):
                rec = table.records.get(o.record)
            elif isinstance(o, EntryOwner):
                rec = table.entries.get(o.entry)
            elif isinstance(o, WaiterOwner):
                cls = max(cls, Cls.WAITER)
                continue
            elif isinstance(o, SnapshotOwner):
                cls = max(cls, Cls.SNAPSHOT)
                continue
            else:
                return None                      # a necessary hold: never a Host victim
            if rec is not None and rec.level == Level.REUSE:
                cls = max(cls, Cls.REUSE)
                demand = max(demand, rec.evidence.demand_time or 0.0)
        if cls is Cls.NORMAL:
            prefixes = table.prefixes_of(cid)
            return (0, info.frontier - (prefixes[0][0] if prefixes else 0), cid)
        return (cls, demand if cls is Cls.REUSE else 0.0, cid)
