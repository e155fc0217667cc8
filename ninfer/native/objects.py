"""What the stores hold: KV blocks, StateImages, checkpoints and active sequences.

Sharing model (one rule makes the tail page safe without eager copies)::

    block of 64 positions:  [ written 0 .. filled-1 | free filled .. 63 ]
    a holder covering frontier F needs positions < F of its last block to stay unchanged.

Appending at ``filled`` never changes a position below it, so the one sequence holding the
block's *append claim* may keep writing into a partly filled block that checkpoints share
(seed: saving an inner input point copies no KV and no extra tail page). Any other writer whose
frontier is inside the block copies the written prefix first (COW). Full blocks are immutable.

Every object that a late message could name carries (id, generation): ids are reused only with
a new generation, so a stale reference is detected and ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import count

from ninfer.errors import NInferError
from ninfer.native.model.config import PAGE_SIZE
from ninfer.native.stores import Extent, Reservation
from ninfer.protocol import CkptKind, Owner, Phase
from ninfer.sampling_params import SamplingParams

_generation = count(1)


class NativeError(NInferError):
    """A request to the Program that contradicts its physical truth (a policy bug)."""


def next_generation() -> int:
    return next(_generation)


class _Noted:
    """Every attribute write puts the object's id in its ``noted`` set: the quote's record of
    which physical facts changed since the last quote (native/reclaim.py ``FactsMemo``). An
    in-place change of a container it holds (``holders``, ``owners``) calls ``note()`` —
    ``touch()`` does, by writing ``version``."""

    def __setattr__(self, name: str, value) -> None:
        object.__setattr__(self, name, value)
        self.note()

    def note(self) -> None:
        noted = self.__dict__.get("noted")
        if noted is not None:
            noted.add(self._noted_id())


@dataclass(eq=False)
class KvBlock(_Noted):
    """One 64-token page of one KV kind, shared by directories (sequences and checkpoints)."""

    bid: int
    kind: str
    holders: set[int] = field(default_factory=set)   # directory ids (checkpoint / sequence)
    filled: int = 0                                  # positions written, contiguous from 0
    page: int | None = None                          # Device replica: pool id
    host: Extent | None = None                       # Host replica
    host_filled: int = 0                             # positions the Host replica holds
    appender: int | None = None                      # sequence allowed to append at `filled`
    leases: int = 0                                  # copies / computes reading it now
    version: int = field(default_factory=next_generation)
    sink: set | None = field(default=None, repr=False)   # the Program's changed-block ids
    noted: set | None = field(default=None, repr=False)  # the quote's changed-block ids (last field)

    def _noted_id(self) -> int:
        return self.bid

    def touch(self) -> None:
        """A new version, and a placement report for every holder."""
        self.version = next_generation()
        if self.sink is not None:
            self.sink.add(self.bid)

    def bump(self) -> None:
        """A new version whose placement is unchanged (a holder came or went): no holder's
        placement report — a shared prefix's page has a holder per point above it, and each new
        point would report all of them again."""
        self.version = next_generation()


@dataclass(eq=False)
class StateImage(_Noted):
    """Every GDN recurrent + conv state and the continuation hidden of one exact position."""

    slot: int | None = None          # Device replica (state pool id)
    host: Extent | None = None       # Host replica
    leases: int = 0
    noted_as: int = field(default=0, repr=False)           # its checkpoint's cid (0: none yet)
    noted: set | None = field(default=None, repr=False)    # that checkpoint's quote record (last field)

    def _noted_id(self) -> int:
        return self.noted_as


@dataclass(eq=False)
class Checkpoint(_Noted):
    """An exact restorable position: input identity + frontier + immutable StateImage + the
    typed KV coverage [0, frontier)."""

    cid: int
    generation: int
    kind: CkptKind
    tokens: tuple[int, ...]          # input identity: token ids of positions 0..frontier-1
    digest: bytes                    # tokens + media + execution identity
    image: StateImage
    blocks: dict[str, list[KvBlock]]  # per KV kind, covering [0, frontier)
    owners: dict[Owner, int] = field(default_factory=dict)   # logical holders (opaque to Native)
    draft_base: int = 0                # the MTP head's coverage [draft_base, draft_frontier) (speculative.py)
    draft_frontier: int = 0
    version: int = field(default_factory=next_generation)
    sink: set | None = field(default=None, repr=False)   # the Program's changed-checkpoint ids
    noted: set | None = field(default=None, repr=False)  # the quote's changed-checkpoint ids (last field)

    def _noted_id(self) -> int:
        return self.cid

    @property
    def frontier(self) -> int:
        return len(self.tokens)

    def touch(self) -> None:
        self.version = next_generation()
        if self.sink is not None:
            self.sink.add(self.cid)


@dataclass(eq=False)
class Sequence:
    """The active execution of one request: committed ledger and its frontiers.

        ledger:  prompt tokens | committed output tokens
        execution_frontier = positions whose KV/state are computed
        ledger[execution_frontier] = the committed next input (when it exists)
    """

    sid: int
    generation: int
    ledger: list[int]
    prompt_len: int
    params: SamplingParams
    eos_ids: tuple[int, ...]
    frontier: int = 0
    blocks: dict[str, list[KvBlock]] = field(default_factory=dict)
    slot: int | None = None
    phase: Phase = Phase.MATERIALIZING      # MATERIALIZING -> RUNNING (bound) -> PAUSED / FINISHED
    reservation: Reservation = field(default_factory=Reservation)
    snapshot: Checkpoint | None = None      # while paused by Snapshot
    finished: str | None = None
    cancel_requested: bool = False          # release once the in-flight read-back completes
    draft_base: int = 0                       # the MTP head's entries draft_base .. draft_frontier-1 exist
    draft_frontier: int = 0
    drafts: list[int] = field(default_factory=list)   # MTP drafts the next decode row verifies
    media: object | None = None             # media.SeqMedia: the prompt's images and MRoPE rows
    grammar: object | None = None           # structured.GrammarState of a constrained request: a
    #                                          function of the committed output (dropped with the
    #                                          execution state, rebuilt from the ledger on demand)
    prompt_next: int = 0                    # prompt_logprobs: the next position whose entry is due
    #                                          (kept across pauses: Replay does not report one twice)

    @property
    def ledger_frontier(self) -> int:
        return self.frontier + 1

    @property
    def n_generated(self) -> int:
        return len(self.ledger) - self.prompt_len

    @property
    def outputs(self) -> list[int]:
        return self.ledger[self.prompt_len:]


def pages_for(positions: int) -> int:
    return (positions + PAGE_SIZE - 1) // PAGE_SIZE
