"""``ContextCache``: what reclaim and the worker's permit checks may rely on.

The context cache is the worker's physical truth about context: live sequences, checkpoints, KV
blocks, state slots, the Host arena and the one context transaction. This contract is its read
side and its one writer of reclaim actions, stated as mini-sglang states its cache contract in
``kvcache/base.py`` — each operation's semantics in its docstring:

- **reads** never change anything (no version, no placement report, no reservation): quotes,
  verification and simulation (``native/reclaim.py``) and the worker's demand checks are built
  on them alone, so the same facts give the same answers;
- **one writer**, ``apply``: the verified commit of typed reclaim actions — all of them or none;
- ``check_integrity``: every invariant the parts write beside their structures (context/*.py).

The Program (``native/program.py``) is the one implementation. Its other verbs (bind, pause,
execute, ...) write too; they are the worker's, each documented with what it reads and writes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ninfer.native.context.transaction import Transaction
    from ninfer.native.objects import Checkpoint, KvBlock, Sequence
    from ninfer.native.reclaim import FactsMemo
    from ninfer.native.stores import Extent, HostArena, IdPool
    from ninfer.protocol import Action, BindMode, CommitResult, Delete, Owner


@runtime_checkable
class ContextCache(Protocol):
    # ---- state, read only --------------------------------------------------------------------
    sequences: Mapping[int, "Sequence"]        # live sequences by sid
    checkpoints: Mapping[int, "Checkpoint"]    # checkpoints by cid
    blocks: Mapping[int, "KvBlock"]            # KV blocks of every kind by bid
    pools: Mapping[str, "IdPool"]              # typed Device pools (KV kinds, STATE)
    host: "HostArena"                          # the Host arena
    facts_memo: "FactsMemo"                    # the quote's fact messages, kept between quotes

    @property
    def tx(self) -> "Transaction | None":
        """The running context transaction, if any."""

    @property
    def image_bytes(self) -> int:
        """Bytes of one StateImage (Device slot = Host extent)."""

    @property
    def page_bytes(self) -> int:
        """Bytes of one Main KV page (Device page = Host extent)."""

    # ---- queries -------------------------------------------------------------------------------
    def checkpoint(self, cid: int, generation: int) -> "Checkpoint | None":
        """The checkpoint a (cid, generation) reference names; None once it is gone (or the id
        was reused under another generation)."""

    def device_checkpoints(self) -> set[int]:
        """Checkpoints with any Device content (a state slot or a KV page), O(Device capacity)."""

    def delete_ok(self, a: "Delete") -> str:
        """Why a quoted deletion may not be committed now: gone, changed since the quote (its
        version), or being read; "" when it may."""

    def host_duplicates(self, ck: "Checkpoint") -> list["Extent"]:
        """The Host replicas of ``ck``'s content the Device also holds and nobody reads (its
        image's, its Main pages' not held by a live sequence): releasing them loses nothing."""

    def pause_plan(self, seq: "Sequence") -> tuple[list["KvBlock"], list[int]]:
        """The Main blocks a Snapshot pause of ``seq`` would demote (those no other bound
        sequence reads) and the Host bytes it would allocate, its StateImage first."""

    def demotion_sizes(self, images: list["Checkpoint"], blocks: list["KvBlock"],
                       dropped: set[int] = frozenset()) -> list[int]:
        """Host bytes demoting these replicas allocates, in allocation order; ``dropped``:
        checkpoints whose Host duplicates are released first (their copies are written again)."""

    def host_holes_after(self, deleted: set[int], dropped: set[int] = frozenset()) -> list[tuple[int, int]]:
        """The Host's free extents (offset, size), merged, once the ``deleted`` checkpoints'
        exclusive Host replicas and the ``dropped`` ones' safe duplicates are released."""

    def freed_by_retiring(self, retire: list[tuple["Checkpoint", "Owner"]]) -> dict[str, int]:
        """Device units per pool that releasing these holds would free: only checkpoints whose
        last owner goes, only blocks all of whose holders go."""

    def seq_demand(self, seq: "Sequence", n_tokens: int) -> dict[str, int]:
        """What reserving ``seq``'s next unit of ``n_tokens`` (its speculative peak included)
        adds to what it already holds reserved."""

    def bind_demand(self, sid: int, source: "Checkpoint | None", mode: "BindMode",
                    first_tokens: int) -> dict[str, int]:
        """State slot, missing KV, growth and tail pages to bind to ``source`` and run a first
        unit of ``first_tokens``."""

    def shortfall(self, demand: dict[str, int]) -> dict[str, int]:
        """Per pool, how much of ``demand`` the unreserved free units do not cover."""

    # ---- the one writer ------------------------------------------------------------------------
    def apply(self, actions: list["Action"]) -> "CommitResult":
        """Commit reclaim actions quoted earlier, all or none. Each names the versions it relied
        on; generations, versions, holders and pins are verified again, and the demotions'
        Host destinations are placed first-fit before anything changes. Then: safe Host
        duplicates are released, deletions remove their checkpoints (blocks whose last holder
        they were are freed on every medium), demotions copy what the Host lacks inside the
        context transaction and free the Device replicas when it publishes. The result says
        what was freed at once, or why nothing was done ("stale: ...", "host: ...")."""

    # ---- integrity -----------------------------------------------------------------------------
    def check_integrity(self, idle: bool = False) -> None:
        """Raise IntegrityError unless every part's invariants hold; ``idle``: also no
        reservation, reader lease, orphaned image or transaction is left."""
