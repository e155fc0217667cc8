"""The controller's side of facts deltas (``native/reclaim.FactsSender`` is the worker's).

A reclaim quote of a full Device carries ~1,000 checkpoint and block messages, and consecutive
quotes share nearly all of them. The controller keeps the last quote it completed; the next one
is asked against its number and arrives as the messages that changed plus every id in order,
and is completed here into exactly the quote a complete one would have been (same messages, same
order). The ids that changed bring the facts index forward (``reclaim.index_from_delta``)
without comparing every message again.

A delta against a quote this mirror does not hold cannot arrive: the worker sends one only
against the number the plan names, and only when that is the quote it sent last (a restarted
worker starts over with a complete one). ``NINFER_CHECK_FACTS`` (the suite) has the worker send
the complete quote beside each delta, and the completion must equal it.
"""

from __future__ import annotations

import msgspec

from ninfer import protocol as P
from ninfer.errors import IntegrityError
from ninfer.policy.reclaim import index_from_delta


class FactsMirror:
    def __init__(self):
        self.last: P.Facts | None = None

    @property
    def base(self) -> int:
        """The number of the quote held complete (0: none): a quote asks for a delta against it."""
        return self.last.seq if self.last is not None else 0

    def complete(self, facts: P.Facts) -> P.Facts:
        """``facts`` as a complete quote (a delta completed from the quote it is against)."""
        if facts.base == 0:
            self.last = facts
            return facts
        last = self.last
        if last is None or last.seq != facts.base:
            raise IntegrityError(f"facts delta against quote {facts.base}, but the controller holds "
                                 f"{self.base}")
        lc, lb, nc, nb = last.checkpoints, last.blocks, facts.checkpoints, facts.blocks
        ck_order, block_order = facts.order
        cks = {k: nc.get(k) or lc[k] for k in ck_order}
        blocks = {k: nb.get(k) or lb[k] for k in block_order}
        full = msgspec.structs.replace(facts, checkpoints=cks, blocks=blocks, base=0, order=((), ()), check=b"")
        if facts.check and ((want := P.decode_facts(facts.check)) != full or list(cks) != list(want.checkpoints)
                            or list(blocks) != list(want.blocks)):
            raise IntegrityError("a completed facts delta differs from the complete quote")
        index_from_delta(last, full, [*nc, *(lc.keys() - cks.keys())], [*nb, *(lb.keys() - blocks.keys())])
        self.last = full
        return full
