"""The context transaction: at most one at a time (seed: Program 同时至多有一个上下文事务).

It carries binds with read-back, Host captures, demotions and pause snapshots. A later copy joins
the running transaction while its copies are still in flight; its completion comes once all of
them finished. Each part follows the seed's order (sources and destinations → leases and
reservations → copies → completion → publish → release sources) and knows how to abort: a copy
error aborts the whole transaction — every part's ``abort`` runs (leases dropped, destinations
freed, sequences whose read-back failed released, captures and pause snapshots that could not
be written deleted) and the settlement names exactly what it cost. A late or duplicate
completion names a transaction that is gone (or has another generation) and changes nothing::

    add(part, jobs) ──► copies run (transfer.py) ──► completion (tid, generation, error)
         ▲ joins while in flight                          │ progress / overdue
         └────────────────────────────────────────────────┴──► publish: every part's publish,
                                                               or every part's abort

Invariant (``check_integrity``): idle, no transaction is open and no copy is in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ninfer.errors import IntegrityError
from ninfer.native.objects import next_generation
from ninfer.native.transfer import TransferEngine

Job = Callable[[], None]


@dataclass(eq=False)
class TxPart:
    kind: str                                    # "bind" | "capture" | "demote" | "pause"
    publish: Callable[[], None]
    abort: Callable[[], tuple[list[int], list[int]]]   # -> (failed sids, lost cids)


@dataclass(eq=False)
class Transaction:
    tid: int
    generation: int
    parts: list[TxPart] = field(default_factory=list)


@dataclass
class TxSettled:
    tid: int
    generation: int
    ok: bool
    error: str = ""
    failed_sids: list[int] = field(default_factory=list)
    lost_cids: list[int] = field(default_factory=list)


class ContextTx:
    """The running transaction (``current``), its copies and their settlement; the bytes copied
    each way (observation)."""

    def __init__(self, transfers: TransferEngine, ids: Iterator[int]):
        self.transfers = transfers
        self.current: Transaction | None = None
        self.bytes_h2d = 0                           # observation: copies submitted each way
        self.bytes_d2h = 0
        self._ids = ids
        self._settled: list[TxSettled] = []          # transactions settled outside progress()

    def count(self, h2d: int = 0, d2h: int = 0) -> None:
        """Bytes of the copies a part submits (observation)."""
        self.bytes_h2d += h2d
        self.bytes_d2h += d2h

    def add(self, part: TxPart, jobs: list[Job]) -> int:
        """Start the context transaction, or join the running one while its copies are still
        in flight. One whose copies all finished is settled first (its completion may still be
        on its way; it will find the transaction gone)."""
        tx = self.current
        if tx is not None and not self.transfers.can_join(tx.tid, tx.generation):
            if self.transfers.finished(tx.tid, tx.generation):
                self._settled.append(self.publish(tx.tid, tx.generation, self.transfers.error_of(tx.tid, tx.generation)))
            tx = self.current
        if tx is None:
            tx = self.current = Transaction(next(self._ids), next_generation())
        tx.parts.append(part)
        self.transfers.submit(tx.tid, tx.generation, *jobs)
        return tx.tid

    def progress(self) -> list[TxSettled]:
        """One progress point: settle every transaction whose completion was delivered."""
        out, self._settled = self._settled, []
        for tid, gen, error in self.transfers.drain():
            r = self.publish(tid, gen, error)
            if r is not None:
                out.append(r)
        return out

    def publish(self, tid: int, generation: int, error: str = "") -> TxSettled | None:
        """Settle one completion: publish every part, or abort every part when a copy failed.
        A completion for a transaction that is gone, or with another generation (a reused
        descriptor), changes nothing and returns None."""
        tx = self.current
        if tx is None or tx.tid != tid or tx.generation != generation:
            return None
        self.current = None
        self.transfers.forget(tid, generation)
        out = TxSettled(tid, generation, ok=not error, error=error)
        for part in tx.parts:
            if error:
                failed, lost = part.abort()
                out.failed_sids += failed
                out.lost_cids += lost
            else:
                part.publish()
        return out

    def overdue(self) -> list[TxSettled]:
        """Settle the running transaction if its copies finished but no completion was
        delivered (dropped). The controller asks after its completion timeout."""
        tx = self.current
        if tx is not None and self.transfers.finished(tx.tid, tx.generation):
            r = self.publish(tx.tid, tx.generation, self.transfers.error_of(tx.tid, tx.generation))
            return [r] if r is not None else []
        return []

    def wait(self, timeout: float) -> None:
        """Block (without spinning) until a copy finishes or ``timeout`` passes."""
        if self.transfers.pending:
            self.transfers.wait(timeout)

    def check_integrity(self, idle: bool = False) -> None:
        if idle and (self.current is not None or self.transfers.busy):
            raise IntegrityError("a transaction is still in flight")
