"""Every message between the client, the frontend, the controller and the GPU worker, in one
module: msgspec structs, tagged unions for kinds, IntEnums for states, encoded once to bytes
and decoded with a typed decoder per channel. The same bytes travel over the in-process channel
and over Ray.

Controller -> worker: one ``StepPlan`` per engine cycle (steady state: one round trip)::

    commands    run first, in order (freezes, releases, owner changes, maintenance)
    intents     the ordered work of the cycle — the resume, resident row permits (recovery
                holder first, then ticket), one prefill/replay chunk, fresh binds. Each
                carries the conditional remedies the policy quoted for it (reclaim batches,
                take-backs of younger residents) and what to do if it is still short. The
                worker verifies and executes exactly this order; guards (Scheduler bounds
                stated as data) say when an intent is not attempted.
    quote       answer with Facts (and exact demands) after the commands: the prelude of a
                pressure cycle

The worker advances the context transaction at the step's three progress points (start, after
admission before the execution choice, after Control/Decode): completed copies are published
(or aborted, when one failed) and reported as ``Settled``; the controller settles its books —
requests bound, snapshots on the Host, capacity events, failures — in its transaction state
machine. A late or duplicate completion names a transaction that is gone (or has another
generation) and changes nothing.

Worker -> controller: a ``StepReply`` with typed outcomes keyed by intent id, the results of
the units that ran, the transactions settled at the progress points and pool occupancy.
"""

from __future__ import annotations

import array
import hashlib
import struct
import sys
from enum import IntEnum

import msgspec

from ninfer.errors import ErrorKind  # noqa: F401 (a Failure's kind: one vocabulary, re-exported)
from ninfer.sampling_params import Constraint, SamplingParams  # noqa: F401 (Constraint travels in params)

PROTOCOL_VERSION = 2
PAGE = 64                      # tokens per Main-KV page (seed: Main KV 页为 64 token)

# Pool kinds: Main KV, backend KV pools (later wave; zero-sized until enabled), StateImage slots.
MAIN = "main"
MTP = "mtp"
DFLASH = "dflash"
STATE = "state"
KV_KINDS = (MAIN, MTP, DFLASH)


# ---- states and kinds (one enum per concept, shared by every package) ---------------------

class Phase(IntEnum):
    """A request's execution phase. The worker's sequences use the bound subset."""

    QUEUED = 0          # fresh queue, waiting for admission (controller only)
    MATERIALIZING = 1   # bound, read-back in flight: may not execute yet
    RUNNING = 2         # bound: holds a lane and a writer state, may execute units
    PAUSED = 3          # lane given back; resumes by Snapshot or Replay
    FINISHED = 4        # terminal (finished, cancelled, failed) / released


class FinishReason(IntEnum):
    STOP = 0
    LENGTH = 1
    CANCELLED = 2
    ERROR = 3

    def __str__(self) -> str:          # the public API's spelling: "stop" | "length" | ...
        return self.name.lower()


class UnitKind(IntEnum):
    PREFILL = 0
    REPLAY = 1
    DECODE = 2
    CONTROL = 3
    VERIFY = 4          # a decode row that also verifies its sequence's drafts (speculative.py)
    NORMALIZE = 5


class BindMode(IntEnum):
    FORK = 0            # the immutable source stays; share full pages, copy state (tail on write)
    MOVE = 1            # exclusive hand-over of the source's state and KV references


class CkptKind(IntEnum):
    CACHE = 0           # restore point kept for reuse (input point, anchor, marker, E)
    SNAPSHOT = 1        # pause snapshot of a sequence's execution position


class Role(IntEnum):
    """The roles a private record's restore points play."""

    E = 0               # committed generation end
    INPUT = 1           # input-side restore point (C or R, or P for raw input)
    ANCHOR = 2          # explicit private anchor


# ---- owners of checkpoints (a tagged union; the worker never interprets them but one) -------

class RecordOwner(msgspec.Struct, tag="rec", frozen=True, array_like=True):
    """A private record's use of a restore point."""

    record: int
    role: Role


class EntryOwner(msgspec.Struct, tag="entry", frozen=True, array_like=True):
    """A public shared entry (marker)."""

    entry: int


class WaiterOwner(msgspec.Struct, tag="wait", frozen=True, array_like=True):
    """A queued request's waiting reference on its chosen source."""

    rid: str


class SnapshotOwner(msgspec.Struct, tag="snap", frozen=True, array_like=True):
    """A paused sequence's own execution snapshot (the one owner the worker names itself)."""

    sid: int


Owner = RecordOwner | EntryOwner | WaiterOwner | SnapshotOwner


# ---- physical facts and reclaim actions (quote / commit) -----------------------------------

class PoolFact(msgspec.Struct, array_like=True, frozen=True):
    kind: str
    total: int
    free: int
    reserved: int

    @property
    def available(self) -> int:
        return self.free - self.reserved


class BlockFact(msgspec.Struct, array_like=True, frozen=True, gc=False):
    bid: int
    version: int
    kind: str
    holders: tuple[int, ...]      # checkpoint ids; sequences appear as negative ids
    pinned: bool                  # a bound/materializing sequence holds it, or a read is in flight
    device: bool
    host: bool                    # a Host replica holding every written position exists
    filled: int
    host_at: tuple[int, int] | None = None     # (offset, size) of its Host extent


class CheckpointFact(msgspec.Struct, array_like=True, frozen=True, gc=False):
    cid: int
    generation: int
    version: int
    kind: CkptKind
    frontier: int
    owners: tuple[Owner, ...]
    image_device: bool
    image_host: bool
    leased: bool
    blocks: tuple[int, ...]       # main KV blocks covering [0, frontier)
    image_at: tuple[int, int] | None = None    # (offset, size) of its StateImage Host extent


class Facts(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    pools: dict[str, PoolFact]
    host_capacity: int
    host_free: tuple[tuple[int, int], ...]    # (offset, size) of free extents, by offset
    image_bytes: int                          # one StateImage on the Host
    page_bytes: int                           # one Main-KV page on the Host
    checkpoints: dict[int, CheckpointFact]
    blocks: dict[int, BlockFact]
    tx_busy: bool
    # checkpoints outside these facts (a scoped quote): all of them hold Host content only
    partial: bool = False
    # a quote's number (its worker's, from 1) and, in a delta, the number of the quote it is
    # against: then ``checkpoints`` and ``blocks`` hold only the messages that are not the
    # base's, and ``order`` every id of the quote in its order (checkpoints, blocks); the
    # controller completes it from the base (``FactsMirror``). base 0: complete as sent.
    seq: int = 0
    base: int = 0
    order: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
    # NINFER_CHECK_FACTS: the complete quote beside its delta, encoded (the controller compares)
    check: bytes = b""


class Delete(msgspec.Struct, tag="delete", frozen=True, array_like=True):
    cid: int
    generation: int
    version: int


class DemoteState(msgspec.Struct, tag="demote_state", frozen=True, array_like=True):
    cid: int
    generation: int
    version: int


class DemoteBlocks(msgspec.Struct, tag="demote_blocks", frozen=True, array_like=True):
    cid: int
    generation: int
    bids: tuple[int, ...]
    versions: tuple[int, ...]


class DropHostCopy(msgspec.Struct, tag="drop_host_copy", frozen=True, array_like=True):
    """Release the Host replica of a checkpoint's StateImage that the Device also holds: a
    safe duplicate, nothing is lost."""

    cid: int
    generation: int
    version: int


Action = Delete | DemoteState | DemoteBlocks | DropHostCopy


class CommitResult(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    ok: bool
    reason: str = ""
    tid: int | None = None        # migrations in flight; capacity arrives when published
    freed: dict[str, int] = {}    # Device units freed immediately


def unit_pages(frontier: int, n_tokens: int, held: int, tail_appendable: bool) -> int:
    """Main pages a unit of ``n_tokens`` at ``frontier`` needs beyond the ``held`` ones: growth
    pages plus one tail copy when the frontier is inside a page this writer may not append to.
    The one formula for Native's demand and the controller's prediction of it.

        positions  [ page 0 | page 1 | ... | page f//64 (filled f%64) | new pages ... ]
    """
    growth = max(0, -(-(frontier + n_tokens) // PAGE) - held)
    cow = 1 if n_tokens and frontier % PAGE and not tail_appendable else 0
    return growth + cow


# ---- token ids as compact int32 bytes ------------------------------------------------------

TOKEN_BYTES = struct.calcsize("<i")      # one packed token id (a piece of a packing is the packing of the piece)

def pack_tokens(tokens: list[int] | tuple[int, ...]) -> bytes:
    """Token ids as little-endian int32 (``struct`` converts a tuple or list ~2x faster than
    ``array``; anything it refuses goes through ``array``, which raises as it always did)."""
    try:
        return struct.pack(f"<{len(tokens)}i", *tokens)
    except struct.error:
        a = array.array("i", tokens)
        if sys.byteorder != "little":
            a.byteswap()
        return a.tobytes()


def unpack_tokens(data: bytes) -> list[int]:
    a = array.array("i")
    a.frombytes(data)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


# ---- references ----------------------------------------------------------------------------

class CkptRef(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A Native checkpoint as policy sees it (an opaque handle plus its exact frontier)."""

    cid: int
    generation: int
    frontier: int
    kind: CkptKind
    device: bool                   # StateImage has a Device replica
    host: bool                     # StateImage has a Host replica


class Retire(msgspec.Struct, array_like=True, frozen=True):
    cid: int
    generation: int
    owner: Owner


class TxRef(msgspec.Struct, array_like=True, frozen=True):
    tid: int
    generation: int


# ---- commands (run in order before the intents) -------------------------------------------

class MediaItem(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One image of a prompt: its pads are prompt[offset : offset + num_tokens], each carrying
    ``media_token_ids(digest, num_tokens, vocab)`` (the media identity in the token stream);
    ``pixel_values``: raw little-endian float32 bytes of shape ``shape`` ([N, 3·T·P·P]), the
    vision tower's input for grid ``grid_thw`` (t, h, w in patches)."""

    offset: int
    num_tokens: int
    digest: bytes
    grid_thw: tuple[int, int, int]
    pixel_values: bytes
    shape: tuple[int, int]


def media_token_ids(digest: bytes, num_tokens: int, vocab_size: int) -> list[int]:
    """The identity ids of an image's pads: id_j = vocab_size + (blake2b(digest + j) mod 2^30).
    Every comparison by token id (prefix index, records, checkpoints, input digests) then
    compares media identity; the model never embeds these ids (the tower's rows replace them)."""
    out = []
    for j in range(num_tokens):
        h = hashlib.blake2b(digest + j.to_bytes(4, "little"), digest_size=8).digest()
        out.append(vocab_size + int.from_bytes(h, "little") % (1 << 30))
    return out


class NewSeq(msgspec.Struct, tag="new_seq", array_like=True):
    rid: str
    tokens: bytes                  # packed ledger (prompt)
    prompt_len: int
    params: SamplingParams
    media: list[MediaItem] = []    # the prompt's images (spans over identity ids), in order


class Pause(msgspec.Struct, tag="pause", array_like=True):
    """Give back a sequence's lane at a stable commit boundary: with ``to_host`` a Snapshot
    whose unique Device content is demoted to the Host (after deleting ``host_victims`` for
    its destination) — or, when the destination does not fit, a destructive pause (Replay)."""

    sid: int
    to_host: bool = False
    host_victims: list[Delete] = []


class Freeze(msgspec.Struct, tag="freeze", array_like=True):
    sid: int
    owner: Owner


class Release(msgspec.Struct, tag="release", array_like=True):
    sid: int


class AddOwner(msgspec.Struct, tag="add_owner", array_like=True):
    cid: int
    generation: int
    owner: Owner


class ReleaseOwner(msgspec.Struct, tag="release_owner", array_like=True):
    cid: int
    generation: int
    owner: Owner


class Overdue(msgspec.Struct, tag="overdue", array_like=True):
    """Settle the running transaction if its copies finished but their completion never came
    (a dropped completion, after the controller's timeout)."""


class Commit(msgspec.Struct, tag="commit", array_like=True):
    actions: list[Action]


class Quote(msgspec.Struct, tag="quote", array_like=True):
    pass


class CheckIntegrity(msgspec.Struct, tag="check_integrity", array_like=True):
    idle: bool = False


class Settle(msgspec.Struct, tag="settle", array_like=True):
    """Return a sequence's unused reservation (e.g. when its recovery permit ends)."""

    sid: int


class HoldPages(msgspec.Struct, tag="hold_pages", array_like=True):
    """Test hook at the actor boundary: keep ``pages`` Main pages reserved by an outside
    party (0 releases them), to provoke capacity situations."""

    pages: int


class DropEncoderCache(msgspec.Struct, tag="drop_encoder_cache", array_like=True):
    """Release every cached vision-tower output (an optional cache: drop_caches)."""


Command = (NewSeq | Pause | Freeze | Release | AddOwner | ReleaseOwner | Overdue | Commit | Quote
           | CheckIntegrity | Settle | HoldPages | DropEncoderCache)


# ---- intents -------------------------------------------------------------------------------

class Outcome(IntEnum):
    OK = 0              # permitted (a bind: bound, its first unit permitted)
    SHORT = 1           # still short after its remedies; nothing was kept for it
    WAIT = 2            # its remedies started copies: the capacity arrives when they publish
    SKIPPED = 3         # a guard held: not attempted
    REFUSED = 4         # a typed refusal (see Refusal)
    FAILED = 5          # a device or programming error


class Refusal(IntEnum):
    NONE = 0
    STALE_SOURCE = 1        # the source checkpoint is gone or has another generation
    SOURCE_IN_FLIGHT = 2    # a copy of the source is still in flight: wait for its publication
    NOT_BOUND = 3           # the sequence is not bound (paused by an earlier take-back, gone)
    NOT_EXACT = 4           # the source is not an exact prefix / has another execution identity
    NOT_MOVABLE = 5         # a Move whose source other owners still hold


class Guard(msgspec.Struct, array_like=True, frozen=True):
    """Skip the intent when none of ``unless_ok`` succeeded and at least ``at_least`` of
    ``ok_among`` (earlier intents of this plan) did. The Scheduler's bounds stated as data:

        lanes          Guard((), earlier fresh binds, free lanes)
        overtaking     Guard((blocked j,), binds after j, j's remaining budget)
        one chunk      Guard((), earlier chunk units, 1)
    """

    unless_ok: tuple[int, ...]
    ok_among: tuple[int, ...]
    at_least: int


class Capture(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Save the unit's end state as a new checkpoint for ``owner`` (an optional cache write).
    ``retire`` lists holds it replaces, given up first; ``room`` the admitted replacements,
    committed only when the save finds no Device slot nor Host room and they make it fit;
    ``replace`` holds the new point supersedes (an anchor's oldest published or stale one),
    given up only when the save really happens — or to make room for it (seed: 锚点 … 无法
    安全替换则放弃本次保存)."""

    owner: Owner
    retire: list[Retire] = []
    room: list[Action] = []
    replace: list[Retire] = []     # holds given up only if the save finds its destination
    # 0: the state at the unit's end; else a position strictly inside the unit (an inner cut: the
    # forward keeps the state there as it crosses it — no unit ends for the save's sake)
    at: int = 0


class UnitSpec(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One execution unit: ``n_tokens == 0`` samples from the continuation hidden (an exact
    hit); otherwise ledger[frontier : frontier + n_tokens] are computed. Units of at most one
    token run in the Control/Decode batch, longer ones as the cycle's prefill turn. ``captures``:
    its saves in position order — inner cuts first, the end's (``at == 0``) last — each prepared
    in that order before the unit runs."""

    n_tokens: int
    kind: UnitKind
    hold: bool = False             # keep the unused reservation (full recovery permit)
    captures: list[Capture] = []


class Reclaim(msgspec.Struct, tag="reclaim", array_like=True, gc=False):
    """A batch of quoted reclaim actions (deletions, demotions), verified at commit."""

    actions: list[Action]


class TakeBack(msgspec.Struct, tag="take_back", array_like=True, gc=False):
    """Pause a resident for the requester (its lane and capacity); the route as in Pause. The
    one take-back mechanism: for memory (a step of the remedy chain, committed only as part of
    the prefix that covers the shortfall) and for a lane (``lane``: the oldest paused request's
    resume needs the victim's lane, which the worker does not count — it leads the resume's
    remedies and is committed before the permit check, whatever the shortfall)."""

    sid: int
    to_host: bool = False
    host_victims: list[Delete] = []
    lane: bool = False


Remedy = Reclaim | TakeBack


class RowIntent(msgspec.Struct, tag="row", array_like=True, omit_defaults=True, gc=False):
    """A resident's unit permit: a Decode/Control row or the cycle's prefill/replay chunk.
    Short: commit the smallest prefix of ``remedies`` that covers the gap now (else one that
    covers it once its copies publish: WAIT; else nothing), then ``on_short`` if still short
    (the young row that cannot progress pauses itself)."""

    iid: int
    sid: int
    unit: UnitSpec
    remedies: list[Remedy] = []
    on_short: Pause | None = None
    guards: list[Guard] = []


class BindIntent(msgspec.Struct, tag="bind", array_like=True, omit_defaults=True, gc=False):
    """Admit (``new``) or resume (``sid``) a sequence from ``source`` (None = empty prefix) and
    reserve its first unit (``first_tokens``; a resume: rebuild + the first new unit). The
    unit runs in this step when the sequence is bound by the progress point before it."""

    iid: int
    sid: int = 0
    new: NewSeq | None = None
    source: CkptRef | None = None
    mode: BindMode = BindMode.FORK
    first_tokens: int = 0
    mover: Owner | None = None
    retire: list[Retire] = []
    unit: UnitSpec | None = None
    unit_guards: list[Guard] = []
    remedies: list[Remedy] = []
    guards: list[Guard] = []


Intent = RowIntent | BindIntent


class DemandQuery(msgspec.Struct, array_like=True, omit_defaults=True):
    """Read-only: what an intent would need now (answered in a quoting reply)."""

    iid: int
    sid: int = 0                   # a resident's unit of n_tokens ...
    n_tokens: int = 0
    source: CkptRef | None = None  # ... or a bind (sid 0: a new sequence)
    mode: BindMode = BindMode.FORK
    first_tokens: int = 0
    bind: bool = False


class StepPlan(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    seq: int
    commands: list[Command] = []
    intents: list[Intent] = []
    quote: bool = False
    demands: list[DemandQuery] = []
    # with ``quote``: None = every checkpoint; a list = the Device's content plus these
    # Host-resident checkpoints (the policy's window of Host candidates)
    host_window: list[int] | None = None
    # with ``quote``: the number of the last quote the controller holds complete (0: none);
    # the worker answers with a delta against it when that is the quote it sent last
    facts_base: int = 0


# ---- replies ---------------------------------------------------------------------------------

class SeqCreated(msgspec.Struct, tag="seq_created", array_like=True):
    sid: int
    generation: int


class CkptOut(msgspec.Struct, tag="ckpt", array_like=True):
    ref: CkptRef | None            # None: nothing saved


class PauseOut(msgspec.Struct, tag="paused", array_like=True, omit_defaults=True):
    sid: int
    snapshot: CkptRef | None = None   # None: destructive (Replay)
    tid: int | None = None            # the snapshot's demotion in flight
    freed: dict[str, int] = {}        # Device units freed at once


class CommitOut(msgspec.Struct, tag="commit_out", array_like=True):
    result: CommitResult


class FactsOut(msgspec.Struct, tag="facts", array_like=True):
    facts: Facts


class Ack(msgspec.Struct, tag="ack", array_like=True):
    value: bool = True


class CompletionsOut(msgspec.Struct, tag="completions", array_like=True):
    done: list[TxRef]


class Failed(msgspec.Struct, tag="failed", array_like=True):
    message: str


CommandOut = SeqCreated | CkptOut | PauseOut | CommitOut | FactsOut | Ack | CompletionsOut | Failed


class SeqFacts(msgspec.Struct, array_like=True, gc=False):
    """What the controller needs to plan the next unit without a round trip."""

    frontier: int
    ledger_len: int
    blocks: int                    # Main pages held
    tail_ok: bool                  # may append in place at the frontier (no tail copy)
    reserved: int                  # Main pages still reserved (recovery permits keep theirs)
    spec: int = 0                  # MTP drafts its next decode row verifies (its speculative peak)


class Applied(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One remedy the worker committed for an intent (in plan order)."""

    index: int
    commit: CommitResult | None = None
    paused: PauseOut | None = None


class IntentOut(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    iid: int
    outcome: Outcome
    refusal: Refusal = Refusal.NONE
    detail: str = ""
    shortfall: dict[str, int] = {}
    sid: int = 0                   # a bind: the sequence it bound (created)
    tid: int | None = None         # a bind: its read-back transaction
    applied: list[Applied] = []
    paused: PauseOut | None = None     # the row paused itself (on_short)
    facts: SeqFacts | None = None


class CaptureResult(IntEnum):
    NONE = 0            # no capture was asked
    SAVED = 1
    NO_ROOM = 2         # no slot, no Host room, and the admitted room did not make it fit
    STALE_ROOM = 3      # the admitted replacements changed since the quote


class CaptureOut(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What became of one of a unit's captures (``UnitSpec.captures``, same order)."""

    result: CaptureResult = CaptureResult.NONE
    captured: CkptRef | None = None
    tid: int | None = None                 # its Host copy's transaction
    room_applied: CommitResult | None = None


class TokenLogprob(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """The log-probability of one committed output token and, when asked, its top
    alternatives: raw log_softmax of the model's logits in float64 (before penalties,
    temperature and top-k/top-p; vLLM's default "raw_logprobs"). ``top``: (token_id, logprob)
    pairs ordered by logprob desc, ties by id asc; empty when the request asked for 0."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class PromptLogprob(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One prompt token's entry of vLLM's ``prompt_logprobs``: its raw log-probability given
    the tokens before it (log_softmax in float64 of the logits at the position before it, as
    ``TokenLogprob``), its ``rank`` as vLLM counts it (how many vocabulary entries have a
    logprob >= its own: 1 = the most likely) and the ``top`` k most likely tokens at that
    position — (token_id, logprob) pairs ordered by logprob desc, ties by id asc, whose ranks are
    1..k; empty when the request asked for 0."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


class UnitOut(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    sid: int
    ran: bool
    committed: list[int] = []
    finish: FinishReason | None = None
    captures: list[CaptureOut] = []     # one per UnitSpec.captures entry
    facts: SeqFacts | None = None
    error: str | None = None       # the forward failed: the sequence was released
    logprobs: list[TokenLogprob] = []   # one per committed token, when the request asked
    # prompt_logprobs (when the request asked): the entries of prompt tokens prompt_from,
    # prompt_from + 1, ... that this unit's rows computed (the logits of position i give token
    # i + 1's entry; a position recomputed by Replay is not sent again)
    prompt_logprobs: list[PromptLogprob] = []
    prompt_from: int = 0


class Settled(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A transaction published (ok) or aborted (a copy failed) at a progress point. An abort
    names what it cost: sequences whose read-back failed (released) and checkpoints that were
    lost (a capture never written, a pause snapshot revoked)."""

    tid: int
    generation: int
    ok: bool
    point: int = 0                  # 1: step start, 2: after admission, 3: after Control/Decode
    error: str = ""
    failed_sids: list[int] = []
    lost_cids: list[int] = []


class PoolState(msgspec.Struct, array_like=True):
    total: int
    available: int


class StepReply(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    seq: int
    commands: list[CommandOut] = []
    intents: list[IntentOut] = []
    units: list[UnitOut] = []
    settled: list[Settled] = []
    tx: TxRef | None = None          # the transaction still in flight after the step
    pools: dict[str, PoolState] = {}
    host_free: int = 0
    host_largest: int = 0
    host_images: int = 0             # StateImages the Host's free extents hold, first-fit
    host_kv_pages: int = 0           # KV pages with only a Host replica (bind demands need a quote)
    placement: list[tuple[int, int, bool, int]] = []   # (cid, generation, image on Device, Main
    #                                  pages only on the Host) of checkpoints whose placement changed
    facts: Facts | None = None
    demands: dict[int, dict[str, int]] = {}
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    faults_fired: dict[str, int] = {}
    spec: SpecStats | None = None    # the speculative backend's counters (None: not configured)
    uncovered: list[tuple[int, int]] = []   # (cid, generation) of checkpoints without the draft
    #                                  coverage their restore needs (DFlash): no query source
    vision: VisionStats | None = None  # the encoder cache's counters (None: no vision tower)
    graphs: GraphStats | None = None   # the Program's graphs (None: eager only)
    worker_s: float = 0.0            # time the worker spent on this plan (observation)
    structured: StructuredStats | None = None   # grammar work (None: no constrained request yet)


class SpecStats(msgspec.Struct, array_like=True, gc=False):
    """The speculative backend's counters (Native keeps them; every StepReply carries them)."""

    verify_rows: int = 0          # decode rows that carried drafts
    drafted: int = 0              # drafts verified
    accepted: int = 0             # drafts kept
    committed: int = 0            # tokens committed by decode rows of speculating sequences (bonus included)
    decode_rows: int = 0          # decode rows of speculating sequences (target steps)
    by_position: list[int] = []   # drafts kept, per draft position
    offered: list[int] = []       # drafts verified, per draft position
    entries: int = 0              # context positions the draft computed (MTP catch-up, DFlash append)
    restarts: int = 0             # draft contexts restarted (MTP: at the bridge; DFlash: a gap)
    coverage_dropped: int = 0     # checkpoints whose draft coverage was dropped for room
    short: int = 0                # units run without drafts for want of a draft page
    method: str = "mtp"

    def as_dict(self) -> dict:
        return {"method": self.method, "verify_rows": self.verify_rows, "drafted": self.drafted,
                "accepted": self.accepted, "acceptance": self.accepted / max(self.drafted, 1),
                "acceptance_by_position": [a / max(o, 1) for a, o in zip(self.by_position, self.offered)],
                "accepted_by_position": list(self.by_position),
                "tokens_per_step": self.committed / max(self.decode_rows, 1), "decode_steps": self.decode_rows,
                "draft_entries": self.entries, "context_restarts": self.restarts,
                "coverage_dropped": self.coverage_dropped, "short_of_pages": self.short,
                "mean_accepted_per_block": self.accepted / max(self.verify_rows, 1)}


class GraphStats(msgspec.Struct, array_like=True, gc=False):
    """The Program's graphs of the forward (native/graphs.py)."""

    backend: str = "cuda"         # "cuda", or the tests' CPU stand-in "replay"
    buckets: list[int] = []       # member-count buckets captured (profile "decode")
    verify_buckets: list[int] = []   # and of profile "verify" (rows of 1 + k drafts), with a draft backend
    capture_s: float = 0.0        # time to capture them all at startup
    replays: int = 0              # calls run by replaying a graph
    padded: int = 0               # of which had fewer rows than their bucket (padding rows ran)
    eager: int = 0                # calls run eagerly (verify and decode rows mixed, images, no bucket)
    verify_replays: int = 0       # replays of a graph with verify rows (alone or beside a chunk)
    # profile "chunk": [decode-row bucket (0 = the chunk alone), chunk length] pairs captured
    chunk_buckets: list[list[int]] = []
    chunk_replays: int = 0        # replays of a chunk graph (its chunk padded to the length)
    # and beside verify rows (with a draft backend): [verify-row bucket, chunk length] pairs
    verify_chunk_buckets: list[list[int]] = []

    def as_dict(self) -> dict:
        return {"backend": self.backend, "buckets": list(self.buckets), "verify_buckets": list(self.verify_buckets),
                "chunk_buckets": [list(b) for b in self.chunk_buckets],
                "verify_chunk_buckets": [list(b) for b in self.verify_chunk_buckets],
                "capture_s": self.capture_s, "replays": self.replays, "verify_replays": self.verify_replays,
                "chunk_replays": self.chunk_replays, "padded": self.padded, "eager": self.eager}


class VisionStats(msgspec.Struct, array_like=True, gc=False):
    """The worker's vision-tower output cache (an optional cache keyed by media digest)."""

    encodes: int = 0              # images run through the tower
    hits: int = 0                 # chunks that found an image's rows cached
    evictions: int = 0            # outputs dropped for the byte budget
    entries: int = 0
    bytes: int = 0
    budget_bytes: int = 0

    def as_dict(self) -> dict:
        return {"encodes": self.encodes, "encoder_cache_hits": self.hits, "encoder_cache_evictions": self.evictions,
                "encoder_cache_entries": self.entries, "encoder_cache_bytes": self.bytes,
                "encoder_cache_budget_bytes": self.budget_bytes}


class StructuredStats(msgspec.Struct, array_like=True, gc=False):
    """The worker's grammar work for structured outputs (ninfer/structured.py)."""

    requests: int = 0             # grammar states built (a rebuild after a destructive pause included)
    masks: int = 0                # token masks computed
    mask_s: float = 0.0           # time computing them (the grammar's cost per constrained token)
    rebuilt: int = 0              # states rebuilt from a committed output (Replay)

    def as_dict(self) -> dict:
        return {"requests": self.requests, "masks": self.masks, "mask_s": self.mask_s,
                "mask_us_per_token": 1e6 * self.mask_s / self.masks if self.masks else 0.0,
                "rebuilt": self.rebuilt}


class WorkerInfo(msgspec.Struct):
    """Sent once at start: the layout and model facts the controller plans with."""

    protocol: int
    model_type: str
    vocab_size: int
    max_context: int
    eos_ids: list[int]
    max_concurrency: int
    kv_pages: int
    state_slots: int
    page_bytes: int
    image_bytes: int
    host_capacity: int
    prefill_chunk_tokens: int
    exec_identity: bytes
    dtype: str
    h2d_bytes_per_s: float = 0.0       # measured at startup (0: not calibrated)
    prefill_s_per_token: float = 0.0
    vision_merge: int = 0              # the vision tower's spatial merge size (0: no vision tower)
    inner_cuts: bool = False           # it saves at positions inside a unit (Capture.at; no draft backend)


# ---- codecs (module level: importable by Ray workers) --------------------------------------

_enc = msgspec.msgpack.Encoder()
_plan_dec = msgspec.msgpack.Decoder(StepPlan)
_reply_dec = msgspec.msgpack.Decoder(StepReply)
_info_dec = msgspec.msgpack.Decoder(WorkerInfo)
_facts_dec = msgspec.msgpack.Decoder(Facts)


def encode(msg) -> bytes:
    return _enc.encode(msg)


def decode_plan(data: bytes) -> StepPlan:
    return _plan_dec.decode(data)


def decode_reply(data: bytes) -> StepReply:
    return _reply_dec.decode(data)


def decode_info(data: bytes) -> WorkerInfo:
    return _info_dec.decode(data)


def decode_facts(data: bytes) -> Facts:
    return _facts_dec.decode(data)


# ---- controller -> frontend / client: request events ------------------------------------------

class TokensEvent(msgspec.Struct, tag="tokens", array_like=True, gc=False):
    """Newly committed output tokens (``index`` = position of the first one in the output).
    Replay never re-publishes: every token is sent exactly once, and with it its logprob entry
    (``logprobs``: one per token when the request asked, else None). New fields go last, with
    defaults: an older encoding still decodes."""

    rid: str
    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    # vLLM's prompt_logprobs, on the event of the first output token only (when the request
    # asked): one entry per prompt token, the first None (nothing comes before it)
    prompt_logprobs: list[PromptLogprob | None] | None = None


# A request's result (FinalEvent): map-encoded, not array_like — their encodings are the dicts
# a FinalEvent carried before they were typed (an older FinalEvent still decodes; a Failure's
# bytes are the former error dict's), and Usage and Timings are ``Output.usage`` / ``.timings``.

class Usage(msgspec.Struct, gc=False):
    """A request's token counts (``Output.usage``; the engine's record keeps it up to date)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0          # prompt tokens served from a reused checkpoint (real reuse)
    prefill_tokens: int = 0         # prompt tokens computed by initial prefill
    replay_tokens: int = 0          # tokens recomputed by Replay after a pause


class Timings(msgspec.Struct, gc=False):
    """``Output.timings``: derived from the request's lifecycle events
    (``ninfer.lifecycle.derive_timings``); times are the controller's time.monotonic()."""

    ttft_s: float | None = None
    e2e_s: float | None = None
    max_output_gap_s: float = 0.0
    queue_s: float | None = None
    arrival: float | None = None           # the ``queued`` moment
    admitted_at: float | None = None       # the first admission
    paused_s: float = 0.0                  # time spent paused (every pause, until its resume)
    source_wait_s: float = 0.0             # time waiting for a restore point another request
    #                                        was about to publish (a pending source)


class PauseEntry(msgspec.Struct, omit_defaults=True, gc=False):
    """One pause of a request (``Output.pauses``, as ``as_dict()``): its route ("snapshot" |
    "replay"; the one it resumed by once it has), the frontier it paused at, and when."""

    route: str
    frontier: int
    paused_at: float
    resumed_at: float | None = None        # None: it ended paused

    def as_dict(self) -> dict:
        out = {"route": self.route, "frontier": self.frontier, "paused_at": self.paused_at}
        if self.resumed_at is not None:
            out["resumed_at"] = self.resumed_at
        return out


class Failure(msgspec.Struct, frozen=True, omit_defaults=True, gc=False):
    """Why a request ended with FinishReason.ERROR: ``Output.error`` is its ``as_dict()``
    (``{"type", "message"}``, and ``"retryable": True`` when a retry is served)."""

    kind: ErrorKind = msgspec.field(name="type")
    message: str
    retryable: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ErrorKind):
            raise TypeError(f"a failure's kind is an ErrorKind, not {self.kind!r}")

    def as_dict(self) -> dict:
        out = {"type": self.kind.value, "message": self.message}
        if self.retryable:
            out["retryable"] = True
        return out


class FinalEvent(msgspec.Struct, tag="final", array_like=True):
    """A request's result. ``usage`` and ``timings`` are None when it ended outside the engine
    (rejected at the controller's intake, or ended by the frontend or client when what held it
    was lost): no books of its own."""

    rid: str
    finish_reason: FinishReason
    token_ids: list[int]
    usage: Usage | None
    timings: Timings | None
    pauses: list[PauseEntry]
    error: Failure | None = None
    prompt_token_ids: list[int] = []   # the exact prompt the engine computed
    logprobs: list[TokenLogprob] | None = None   # one per output token, when the request asked
    # vLLM's prompt_logprobs when the request asked: [None, entry of prompt token 1, ...] (complete
    # once a token was committed; a request that ended before holds the positions computed)
    prompt_logprobs: list[PromptLogprob | None] | None = None


class Life(IntEnum):
    """A request's lifecycle moments, in the order they can happen (seed: GenerationStart 和首次
    admitted/first-token 只发布一次). PAUSED and RESUMED repeat once per pause; the others are
    published at most once per request."""

    QUEUED = 0              # the controller accepted it (its intake queue)
    GENERATION_START = 1    # the engine opened its record: original ticket, ingress timeout runs
    ADMITTED = 2            # first admission (a lane and its first unit); a resume is RESUMED
    FIRST_TOKEN = 3         # first output token committed (Replay never re-commits it)
    PAUSED = 4
    RESUMED = 5
    FINISHED = 6

    def __str__(self) -> str:          # the public spelling: "queued", "generation_start", ...
        return self.name.lower()


class LifecycleEvent(msgspec.Struct, tag="life", array_like=True, omit_defaults=True, gc=False):
    """One lifecycle moment of a request, published once on the same path as its tokens.
    ``t``: time.monotonic() on the controller; ``wall``: time.time() at the same moment.

        paused     route (planned: "snapshot" keeps State/KV, "replay" is destructive), reason
                   (taken_back | lane_take_back | cannot_progress | forced), frontier
        resumed    route (taken: a revoked snapshot resumes by "replay"), frontier
        finished   finish_reason, error (its ErrorKind), max_output_gap_s and source_wait_s (measured
                   on the controller: token commits and pending-source waits are no events)
    """

    rid: str
    kind: Life
    t: float
    wall: float = 0.0
    ticket: int | None = None               # generation_start: the original FIFO ticket
    route: str | None = None
    reason: str | None = None
    frontier: int | None = None
    finish_reason: FinishReason | None = None
    error: ErrorKind | None = None
    max_output_gap_s: float | None = None
    source_wait_s: float | None = None


class SummaryEvent(msgspec.Struct, tag="summary", array_like=True, gc=False):
    """A replica's exact restore positions changed since its previous SummaryEvent (issue 34;
    ``ninfer/replicas/summary.py``). Only a replica's controller publishes it, on the same path
    as its request events, so the router sees a request's E no later than its final event.

        epoch    the publishing summary's identity (a new one after a restart: ``reset``)
        seq      0, 1, 2, ... within an epoch: a gap means a lost event (resynchronise)
        reset    forget everything of this replica first (its caches started empty)
        added    (depth, digest of tokens[:depth], digest of tokens[:depth // B * B])
        removed  (depth, digest)
        size     entries the replica publishes after this event
    """

    epoch: str
    seq: int
    reset: bool
    added: list[tuple[int, bytes, bytes]]
    removed: list[tuple[int, bytes]]
    size: int


Event = TokensEvent | FinalEvent | LifecycleEvent | SummaryEvent
_event_dec = msgspec.msgpack.Decoder(Event)
_events_dec = msgspec.msgpack.Decoder(list[Event])


def decode_event(data: bytes) -> Event:
    return _event_dec.decode(data)


def decode_events(data: bytes) -> list[Event]:
    return _events_dec.decode(data)


# ---- client -> frontend / controller: requests --------------------------------------------------

MAX_ANCHORS = 4       # explicit private anchors per request (seed: 最多四个显式私有长锚点)
MAX_MARKERS = 4       # public shared markers per request (seed: 最多四个调用方 marker)


class RequestSpec(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a client submits (token level; the chat frontend fills the typed fields)."""

    prompt: list[int]
    params: SamplingParams = SamplingParams()
    session_id: str | None = None
    anchors: list[int] = []                 # <= 4 private restore positions
    markers: list[int] = []                 # <= 4 public shared positions
    recovery_frontier: int | None = None    # input restore point (C or R) from the frontend
    response_replay: int | None = None      # typed R: ResponseReplay
    turn_closure: int | None = None         # typed R: TurnClosure
    split_points: list[int] = []            # rewrite execution frontiers: units end there
    rid: str = ""
    media: list[MediaItem] = []             # images: spans of identity ids (media_token_ids)


_spec_dec = msgspec.msgpack.Decoder(RequestSpec)


class TemplateOptions(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How a chat is rendered (vLLM's request fields of the same names): the generation prompt
    or a continued final message (its text left open: no end-of-turn after it), and the extra
    variables the chat template sees (``chat_template_kwargs``, e.g. ``enable_thinking``)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: dict = {}


class ChatSpec(msgspec.Struct, kw_only=True, omit_defaults=True):
    """An OpenAI-style chat request; the frontend renders it to the exact prompt tokens."""

    messages: list[dict]
    tools: list[dict] | None = None
    params: SamplingParams = SamplingParams()
    session_id: str | None = None
    markers: list[int] = []
    fill_max_tokens: bool = False    # max_tokens unset: up to the remaining context (capped)
    rid: str = ""
    template: TemplateOptions | None = None


_chat_dec = msgspec.msgpack.Decoder(ChatSpec)


def decode_chat(data: bytes) -> ChatSpec:
    return _chat_dec.decode(data)


def decode_spec(data: bytes) -> RequestSpec:
    return _spec_dec.decode(data)
