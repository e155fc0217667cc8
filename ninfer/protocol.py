"""Every message between the controller and the GPU worker (and, later, the frontend), in one
module. msgspec structs, tagged unions for kinds, encoded once to bytes and decoded with a
typed decoder per channel; the same bytes travel over the in-process channel and over Ray.

Controller -> worker, one ``StepPlan`` per engine cycle (steady state: one round trip)::

    pre       commands run first, in order (publish completions, releases, freezes, pauses,
              owner changes, reclaim commits, quotes ...)
    rows      Decode / Control rows in permit order (recovery first, then original ticket):
              each reserves its unit; a short row is skipped, the others still run
    binds     admissions and resumes in order; they use only the headroom left by the rows
    chunks    Prefill / Replay candidates in turn order: the first one holding its permit
              runs (at most one chunk per call)

Worker -> controller: a ``StepReply`` with per-command / per-row / per-bind results, the
transfer completions drained since the last reply, and pool occupancy.
"""

from __future__ import annotations

import array
import sys

import msgspec

from ninfer.sampling_params import SamplingParams

PROTOCOL_VERSION = 1

# Pool kinds: Main KV, backend KV pools (later wave; zero-sized until enabled), StateImage slots.
MAIN = "main"
MTP = "mtp"
DFLASH = "dflash"
STATE = "state"
KV_KINDS = (MAIN, MTP, DFLASH)


# ---- physical facts and reclaim actions (quote / commit) -----------------------------------

class PoolFact(msgspec.Struct, array_like=True, frozen=True):
    kind: str
    total: int
    free: int
    reserved: int

    @property
    def available(self) -> int:
        return self.free - self.reserved


class BlockFact(msgspec.Struct, array_like=True, frozen=True):
    bid: int
    version: int
    kind: str
    holders: tuple[int, ...]      # checkpoint ids; sequences appear as negative ids
    pinned: bool                  # a bound/materializing sequence holds it, or a read is in flight
    device: bool
    host: bool                    # a Host replica holding every written position exists
    filled: int
    host_at: tuple[int, int] | None = None     # (offset, size) of its Host extent


class CheckpointFact(msgspec.Struct, array_like=True, frozen=True):
    cid: int
    generation: int
    version: int
    kind: str
    frontier: int
    owners: tuple[str, ...]
    image_device: bool
    image_host: bool
    leased: bool
    blocks: tuple[int, ...]       # main KV blocks covering [0, frontier)
    image_at: tuple[int, int] | None = None    # (offset, size) of its StateImage Host extent


class Facts(msgspec.Struct, frozen=True):
    pools: dict[str, PoolFact]
    host_capacity: int
    host_free: tuple[tuple[int, int], ...]    # (offset, size) of free extents, by offset
    image_bytes: int                          # one StateImage on the Host
    page_bytes: int                           # one Main-KV page on the Host
    checkpoints: dict[int, CheckpointFact]
    blocks: dict[int, BlockFact]
    tx_busy: bool


class Delete(msgspec.Struct, tag="delete", frozen=True):
    cid: int
    generation: int
    version: int


class DemoteState(msgspec.Struct, tag="demote_state", frozen=True):
    cid: int
    generation: int
    version: int


class DemoteBlocks(msgspec.Struct, tag="demote_blocks", frozen=True):
    cid: int
    generation: int
    bids: tuple[int, ...]
    versions: tuple[int, ...]


Action = Delete | DemoteState | DemoteBlocks


class CommitResult(msgspec.Struct, frozen=True):
    ok: bool
    reason: str = ""
    tid: int | None = None        # migrations in flight; capacity arrives when published
    freed: dict[str, int] = {}    # Device units freed immediately



# ---- token ids as compact int32 bytes ------------------------------------------------------

def pack_tokens(tokens: list[int]) -> bytes:
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

class CkptRef(msgspec.Struct, array_like=True, frozen=True):
    """A Native checkpoint as policy sees it (an opaque handle plus its exact frontier)."""

    cid: int
    generation: int
    frontier: int
    kind: str                      # "cache" | "snapshot"
    device: bool                   # StateImage has a Device replica
    host: bool                     # StateImage has a Host replica


class Retire(msgspec.Struct, array_like=True, frozen=True):
    cid: int
    generation: int
    owner: str


# ---- commands (run in order before the rows) ----------------------------------------------

class NewSeq(msgspec.Struct, tag="new_seq", array_like=True):
    rid: str
    tokens: bytes                  # packed ledger (prompt)
    prompt_len: int
    params: SamplingParams


class Pause(msgspec.Struct, tag="pause", array_like=True):
    sid: int
    destructive: bool = False


class Freeze(msgspec.Struct, tag="freeze", array_like=True):
    sid: int
    owner: str


class Release(msgspec.Struct, tag="release", array_like=True):
    sid: int


class AddOwner(msgspec.Struct, tag="add_owner", array_like=True):
    cid: int
    generation: int
    owner: str


class ReleaseOwner(msgspec.Struct, tag="release_owner", array_like=True):
    cid: int
    generation: int
    owner: str


class Publish(msgspec.Struct, tag="publish", array_like=True):
    tid: int
    generation: int


class Overdue(msgspec.Struct, tag="overdue", array_like=True):
    """Completions whose copy finished but whose message never came (after a timeout)."""


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


Command = (NewSeq | Pause | Freeze | Release | AddOwner | ReleaseOwner | Publish | Overdue | Commit | Quote
           | CheckIntegrity | Settle | HoldPages)


# ---- rows, binds, plan ---------------------------------------------------------------------

class RowSpec(msgspec.Struct, array_like=True, omit_defaults=True):
    sid: int
    n_tokens: int                  # 0: sample from the continuation hidden
    kind: str = "decode"           # prefill | replay | decode | control
    capture_owner: str | None = None
    capture_where: str = "auto"
    capture_retire: list[Retire] = []
    hold: bool = False             # keep the unused reservation (full recovery permit)


class BindSpec(msgspec.Struct, array_like=True, omit_defaults=True):
    """Admit (``new``) or resume (``sid``) a sequence from ``source`` (None = empty prefix)."""

    sid: int = 0
    new: NewSeq | None = None        # create the sequence first (dropped again if the bind fails)
    source: CkptRef | None = None
    mode: str = "fork"               # "fork" | "move"
    first_tokens: int = 0            # the first unit (a recovery permit: rebuild + first new unit)
    mover: str | None = None
    retire: list[Retire] = []
    unit: RowSpec | None = None      # run it this cycle if bound: n <= 1 as a row, else a chunk
    rank: int = 0                    # its place among the chunk candidates
    fresh: bool = False              # a fresh admission (counts against StepPlan.max_new)
    budget: int | None = None        # if this fresh bind fails: later fresh successes allowed


class StepPlan(msgspec.Struct, omit_defaults=True):
    seq: int
    pre: list[Command] = []
    rows: list[RowSpec] = []
    binds: list[BindSpec] = []
    chunks: list[RowSpec] = []       # ranks 0, 1, ... in list order
    max_new: int = 0                 # fresh admissions allowed (free lanes)


# ---- replies ---------------------------------------------------------------------------------

class SeqCreated(msgspec.Struct, tag="seq_created", array_like=True):
    sid: int
    generation: int


class CkptOut(msgspec.Struct, tag="ckpt", array_like=True):
    ref: CkptRef | None            # None: nothing saved (destructive pause)


class CommitOut(msgspec.Struct, tag="commit_out", array_like=True):
    result: CommitResult


class FactsOut(msgspec.Struct, tag="facts", array_like=True):
    facts: Facts


class Ack(msgspec.Struct, tag="ack", array_like=True):
    value: bool = True


class CompletionsOut(msgspec.Struct, tag="completions", array_like=True):
    done: list[tuple[int, int]]


class Failed(msgspec.Struct, tag="failed", array_like=True):
    message: str


CommandOut = SeqCreated | CkptOut | CommitOut | FactsOut | Ack | CompletionsOut | Failed


class SeqFacts(msgspec.Struct, array_like=True):
    """What the controller needs to plan the next unit without a round trip."""

    frontier: int
    ledger_len: int
    blocks: int                    # Main pages held
    tail_ok: bool                  # may append in place at the frontier (no tail copy)
    reserved: int                  # Main pages still reserved (recovery permits keep theirs)


class RowOut(msgspec.Struct, array_like=True, omit_defaults=True):
    sid: int
    ran: bool
    shortfall: dict[str, int] = {}
    committed: list[int] = []
    finish: str | None = None
    captured: CkptRef | None = None
    capture_skipped: bool = False
    facts: SeqFacts | None = None
    error: str | None = None


class BindOut(msgspec.Struct, array_like=True, omit_defaults=True):
    sid: int
    ok: bool
    skipped: bool = False            # not attempted (lanes or overtaking budget exhausted)
    shortfall: dict[str, int] = {}
    tid: int | None = None
    busy: bool = False
    facts: SeqFacts | None = None
    error: str | None = None


class PoolState(msgspec.Struct, array_like=True):
    total: int
    available: int


class StepReply(msgspec.Struct, omit_defaults=True):
    seq: int
    pre: list[CommandOut] = []
    rows: list[RowOut] = []
    binds: list[BindOut] = []
    chunk: RowOut | None = None
    chunk_short: dict[int, dict[str, int]] = {}
    completions: list[tuple[int, int]] = []
    pools: dict[str, PoolState] = {}
    host_free: int = 0
    host_largest: int = 0
    tx_busy: bool = False
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    worker_s: float = 0.0            # time the worker spent on this plan (observation)


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


# ---- codecs (module level: importable by Ray workers) --------------------------------------

_enc = msgspec.msgpack.Encoder()
_plan_dec = msgspec.msgpack.Decoder(StepPlan)
_reply_dec = msgspec.msgpack.Decoder(StepReply)
_info_dec = msgspec.msgpack.Decoder(WorkerInfo)


def encode(msg) -> bytes:
    return _enc.encode(msg)


def decode_plan(data: bytes) -> StepPlan:
    return _plan_dec.decode(data)


def decode_reply(data: bytes) -> StepReply:
    return _reply_dec.decode(data)


def decode_info(data: bytes) -> WorkerInfo:
    return _info_dec.decode(data)


# ---- controller -> frontend / client: request events ------------------------------------------

class TokensEvent(msgspec.Struct, tag="tokens", array_like=True):
    """Newly committed output tokens (``index`` = position of the first one in the output).
    Replay never re-publishes: every token is sent exactly once."""

    rid: str
    index: int
    token_ids: list[int]


class FinalEvent(msgspec.Struct, tag="final", array_like=True):
    rid: str
    finish_reason: str                 # "stop" | "length" | "cancelled" | "error"
    token_ids: list[int]
    usage: dict[str, int]
    timings: dict[str, float | None]
    pauses: list[dict]
    error: dict | None = None
    prompt_token_ids: list[int] = []   # the exact prompt the engine computed


Event = TokensEvent | FinalEvent
_event_dec = msgspec.msgpack.Decoder(Event)
_events_dec = msgspec.msgpack.Decoder(list[Event])


def decode_event(data: bytes) -> Event:
    return _event_dec.decode(data)


def decode_events(data: bytes) -> list[Event]:
    return _events_dec.decode(data)


# ---- client -> frontend / controller: requests ------------------------------------------------------------------------

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


_spec_dec = msgspec.msgpack.Decoder(RequestSpec)


class ChatSpec(msgspec.Struct, kw_only=True, omit_defaults=True):
    """An OpenAI-style chat request; the frontend renders it to the exact prompt tokens."""

    messages: list[dict]
    tools: list[dict] | None = None
    params: SamplingParams = SamplingParams()
    session_id: str | None = None
    markers: list[int] = []
    fill_max_tokens: bool = False    # max_tokens unset: up to the remaining context (capped)
    rid: str = ""


_chat_dec = msgspec.msgpack.Decoder(ChatSpec)


def decode_chat(data: bytes) -> ChatSpec:
    return _chat_dec.decode(data)


def decode_config(data: bytes):
    from ninfer.config import EngineConfig
    return msgspec.msgpack.decode(data, type=EngineConfig)


def decode_spec(data: bytes) -> "RequestSpec":
    return _spec_dec.decode(data)
