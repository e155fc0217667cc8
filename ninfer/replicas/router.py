"""Which replica serves a request (issue 34). Pure and model-free: the replicated frontend calls
it on its event loop; tests drive it with fabricated summaries.

``exact`` routing (the default) scores every live replica r for a prompt of L tokens:

    depth_r  = max(deepest published restore position of r that is a prefix of the prompt,
                   deepest B-token block boundary the prompt shares with a request in flight on r)
    wait_r   = max(0, outstanding_r + 1 - lanes_r)      requests it would queue behind for a lane
    score_r  = depth_r - queue_tokens * wait_r

and sends it to the highest score; ties go to the session's last replica, then the replica with
fewer outstanding requests, then the one chosen least recently. A restore position saves exactly ``depth_r``
tokens of prefill there (the seed: reusable only where a StateImage and KV exist for that exact
position); a request in flight that shares the prefix will save it there (the replica's
pending-point wait and divergence positions compute a shared prefix once), so requests arriving
together with a shared prefix go where the first went. ``queue_tokens`` prices one place in the
queue in prompt tokens: a hot prefix fills its replica's free lanes, and past them it keeps
requests only while the prefix is worth more than the wait.

``session`` routing sends a session to the replica its first request went to (a new session,
or none: the least loaded); ``round-robin`` rotates over the live replicas.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum

import msgspec

from ninfer import protocol as P
from ninfer.errors import ConfigError, NInferError
from ninfer.replicas.summary import BLOCK, CAP, PromptHashes, SummaryTable


class Routing(StrEnum):
    EXACT = "exact"
    SESSION = "session"
    ROUND_ROBIN = "round-robin"


class Reason(StrEnum):
    """Why a request went where it went (``/metrics``: ``ninfer_router_routed_total{reason}``)."""

    RESTORE = "restore"          # the deepest published restore position, net of load
    INFLIGHT = "inflight"        # a prefix shared with a request in flight there
    SESSION = "session"          # no prefix to reuse: the session's last replica
    LOAD = "load"                # no prefix to reuse: the least loaded (then least recently chosen)
    STICKY = "sticky"            # session routing: the session's replica
    ROUND_ROBIN = "round_robin"


class NoReplica(NInferError):
    """No replica is live to take a request (all lost; replacements still starting)."""


class RouterConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the replicated frontend routes (``Engine.start(..., router={...})``)."""

    routing: str = "exact"           # exact | session | round-robin
    queue_tokens: int = 1024         # prompt tokens one place in a replica's queue is worth
    block_tokens: int = BLOCK        # the router's hashing granularity (prompt buckets)
    summary_cap: int = CAP           # restore positions one replica publishes at most
    sessions: int = 65_536           # sessions whose replica the router remembers (LRU)

    def __post_init__(self) -> None:
        if self.routing not in tuple(Routing):
            raise ConfigError(f"routing={self.routing!r} is not one of {', '.join(Routing)}")
        for name in ("queue_tokens",):
            if getattr(self, name) < 0:
                raise ConfigError(f"router: {name}={getattr(self, name)} is out of range: allowed >= 0")
        for name in ("block_tokens", "summary_cap", "sessions"):
            if getattr(self, name) < 1:
                raise ConfigError(f"router: {name}={getattr(self, name)} is out of range: allowed >= 1")

    @classmethod
    def coerce(cls, value) -> "RouterConfig":
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(routing=value)
        try:
            return msgspec.convert(value, cls)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"router: {exc}") from None


@dataclass
class Decision:
    replica: int
    reason: Reason
    depth: int = 0                   # prompt tokens the chosen replica is expected to reuse
    score: int = 0


@dataclass
class Load:
    lanes: int
    outstanding: int = 0             # routed there and not finished (queued + running)
    running: int = 0                 # admitted there and not finished


@dataclass
class _Placed:
    replica: int
    session: str | None
    running: bool = False
    keys: list = field(default_factory=list)      # its bucket keys in the in-flight table


class InflightTable:
    """Block-boundary digests of the prompts in flight, per replica:
    (b, digest of the first b tokens) -> {replica: requests}. b = 0 is left out (every prompt
    shares it)."""

    def __init__(self):
        self._at: dict[tuple[int, bytes], Counter] = {}

    def add(self, replica: int, prompt: PromptHashes) -> list:
        keys = prompt.buckets()[1:]
        for k in keys:
            self._at.setdefault(k, Counter())[replica] += 1
        return keys

    def remove(self, replica: int, keys: list) -> None:
        for k in keys:
            c = self._at.get(k)
            if c is None:
                continue
            c[replica] -= 1
            if c[replica] <= 0:
                del c[replica]
                if not c:
                    del self._at[k]

    def match(self, prompt: PromptHashes, replicas) -> dict[int, int]:
        best: dict[int, int] = {}
        for k in reversed(prompt.buckets()[1:]):
            c = self._at.get(k)
            if not c:
                continue
            for r in c:
                if r in replicas and r not in best:
                    best[r] = k[0]
            if len(best) >= len(replicas):
                break
        return best

    def __len__(self) -> int:
        return len(self._at)


class Router:
    """The routing state of one replicated deployment: live replicas and their load, their
    published restore positions, the prompts in flight, sessions' replicas, and counters."""

    def __init__(self, config: RouterConfig | None = None):
        self.config = config or RouterConfig()
        self.mode = Routing(self.config.routing)
        self.loads: dict[int, Load] = {}
        self.table = SummaryTable(self.config.block_tokens)
        self.inflight = InflightTable()
        self.sessions: OrderedDict[str, int] = OrderedDict()
        self.placed: dict[str, _Placed] = {}
        self.by_reason: Counter = Counter()
        self.rerouted = 0
        self.decisions = 0
        self.route_s = 0.0
        self.route_max_s = 0.0
        self._turn = 0
        self._chosen: dict[int, int] = {}          # replica -> the decision that last chose it
        self.draining: set[int] = set()            # live, finishing what they hold, taking nothing new

    # ---- replicas ----------------------------------------------------------------------------
    def add(self, replica: int, lanes: int) -> None:
        """A replica is live (new or replaced: its summary starts empty)."""
        self.table.drop(replica)
        self.loads[replica] = Load(lanes)
        self._chosen[replica] = -1

    def drain(self, replica: int) -> None:
        """A replica takes no new request from now on (what it holds finishes there); its
        positions steer nothing."""
        if replica in self.loads:
            self.draining.add(replica)
            self.table.drop(replica)

    def open(self) -> dict[int, Load]:
        """The replicas a new request may go to."""
        return {r: load for r, load in self.loads.items() if r not in self.draining}

    def remove(self, replica: int) -> list[str]:
        """A replica is gone: it takes no request and steers none; returns the requests that
        were placed on it (the caller re-routes or fails them)."""
        self.loads.pop(replica, None)
        self.draining.discard(replica)
        self.table.drop(replica)
        rids = [rid for rid, p in self.placed.items() if p.replica == replica]
        for rid in rids:
            p = self.placed.pop(rid)
            self.inflight.remove(replica, p.keys)
        for s in [s for s, r in self.sessions.items() if r == replica]:
            del self.sessions[s]
        self._chosen.pop(replica, None)
        return rids

    def apply(self, replica: int, ev: P.SummaryEvent) -> bool:
        """One summary delta of a live replica (False: out of order; resynchronise)."""
        if replica not in self.loads or replica in self.draining:
            return True
        return self.table.apply(replica, ev)

    # ---- requests ----------------------------------------------------------------------------
    def route(self, rid: str, prompt, session: str | None = None, rerouted: bool = False) -> Decision:
        """Choose a live replica for request ``rid`` and account it there (in flight, load)."""
        live = self.open()
        if not live:
            raise NoReplica("no replica is serving (replacements are starting): retry shortly")
        t0 = time.perf_counter()
        hashes = PromptHashes(prompt, self.config.block_tokens) if self.mode is Routing.EXACT else None
        if self.mode is Routing.EXACT:
            d = self._exact(hashes, session, live)
        elif self.mode is Routing.SESSION:
            d = self._sticky(session, live)
        else:
            d = self._rotate(live)
        self._chosen[d.replica] = self._turn
        self._turn += 1
        load = self.loads[d.replica]
        load.outstanding += 1
        keys = self.inflight.add(d.replica, hashes) if hashes is not None else []
        self.placed[rid] = _Placed(d.replica, session, keys=keys)
        if session is not None:
            self.sessions[session] = d.replica
            self.sessions.move_to_end(session)
            while len(self.sessions) > self.config.sessions:
                self.sessions.popitem(last=False)
        self.by_reason[d.reason] += 1
        self.decisions += 1
        self.rerouted += rerouted
        dt = time.perf_counter() - t0
        self.route_s += dt
        self.route_max_s = max(self.route_max_s, dt)
        return d

    def _order(self, live) -> list[int]:
        """Open replicas in this decision's rotation (round-robin)."""
        live = sorted(live)
        k = self._turn % len(live)
        return live[k:] + live[:k]

    def _idle_key(self, r: int) -> tuple:
        """Among equals: fewer outstanding requests, then chosen least recently, then lower id."""
        return (-self.loads[r].outstanding, -self._chosen.get(r, -1), -r)

    def _exact(self, hashes: PromptHashes, session: str | None, live: dict[int, Load]) -> Decision:
        restore = self.table.match(hashes, live)
        flying = self.inflight.match(hashes, live)
        mine = self.sessions.get(session) if session is not None else None
        best, best_key = None, None
        # rule: replica-score
        for r, load in live.items():
            depth = max(restore.get(r, 0), flying.get(r, 0))
            wait = max(0, load.outstanding + 1 - load.lanes)
            score = depth - self.config.queue_tokens * wait
            key = (score, r == mine, *self._idle_key(r))
            if best_key is None or key > best_key:
                best_key = key
                best = Decision(r, Reason.LOAD, depth, score)
        if best.depth > 0:
            best.reason = Reason.RESTORE if restore.get(best.replica, 0) >= flying.get(best.replica, 0) \
                else Reason.INFLIGHT
        elif best.replica == mine:
            best.reason = Reason.SESSION
        return best

    def _least_loaded(self, live) -> int:
        return max(live, key=self._idle_key)

    def _sticky(self, session: str | None, live) -> Decision:
        mine = self.sessions.get(session) if session is not None else None
        if mine is not None and mine in live:
            return Decision(mine, Reason.STICKY)
        return Decision(self._least_loaded(live), Reason.LOAD)

    def _rotate(self, live) -> Decision:
        return Decision(self._order(live)[0], Reason.ROUND_ROBIN)

    def admitted(self, rid: str) -> None:
        """The replica admitted it (a lane): running from now on."""
        p = self.placed.get(rid)
        if p is not None and not p.running:
            p.running = True
            self.loads[p.replica].running += 1

    def finished(self, rid: str) -> int | None:
        """It ended (or left its replica): no longer in flight there. Its replica, if known."""
        p = self.placed.pop(rid, None)
        if p is None:
            return None
        load = self.loads.get(p.replica)
        if load is not None:
            load.outstanding -= 1
            load.running -= p.running
        self.inflight.remove(p.replica, p.keys)
        return p.replica

    def replica_of(self, rid: str) -> int | None:
        p = self.placed.get(rid)
        return p.replica if p is not None else None

    # ---- what /metrics shows -----------------------------------------------------------------
    def snapshot(self, now: float | None = None) -> dict:
        now = time.monotonic() if now is None else now
        reps = {}
        for r, load in sorted(self.loads.items()):
            view = self.table.views.get(r)
            reps[str(r)] = {"lanes": load.lanes, "outstanding": load.outstanding, "running": load.running,
                            "draining": r in self.draining,
                            "summary_entries": self.table.size(r),
                            "summary_events": view.events if view else 0,
                            "summary_age_s": None if view is None or view.updated is None else now - view.updated}
        return {"routing": str(self.mode), "queue_tokens": self.config.queue_tokens, "decisions": self.decisions,
                "routed_by_reason": {str(k): self.by_reason.get(k, 0) for k in Reason}, "rerouted": self.rerouted,
                "route_s": self.route_s, "route_max_s": self.route_max_s, "inflight_keys": len(self.inflight),
                "sessions": len(self.sessions), "replicas": reps}
