"""The Engine's request record (seed: Engine 请求记录): original ticket, input and output
objects, budget, cancellation, first times and the continuation across pauses.

A request keeps its committed history when it gives its lane back; the Native binding can be
rebuilt (Snapshot or Replay). GenerationStart, first admission and first token are published
once; a pause does not restart the ingress timeout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

import msgspec

from ninfer.protocol import CkptRef, RequestSpec, SeqFacts  # noqa: F401  (RequestSpec re-exported)
from ninfer.sampling_params import SamplingParams


class Phase(str, Enum):
    QUEUED = "queued"              # fresh queue, waiting for admission
    BINDING = "binding"            # bound with a read-back in flight (materializing)
    RUNNING = "running"            # resident: holds a lane
    PAUSED = "paused"              # lane given back; resumes by Snapshot or Replay
    FINISHED = "finished"


class Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0          # prompt tokens served from a reused checkpoint (real reuse)
    prefill_tokens: int = 0         # prompt tokens computed by initial prefill
    replay_tokens: int = 0          # tokens recomputed by Replay after a pause


class Timings(msgspec.Struct):
    ttft_s: float | None = None
    e2e_s: float | None = None
    max_output_gap_s: float = 0.0
    queue_s: float | None = None


@dataclass(eq=False)
class Request:
    spec: RequestSpec
    rid: str
    ticket: int
    arrival: float = field(default_factory=time.monotonic)
    phase: Phase = Phase.QUEUED
    sid: int | None = None
    outputs: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: dict | None = None
    cancel_requested: bool = False
    # mirrors of the worker's sequence
    facts: SeqFacts | None = None
    # times (published once)
    first_admitted: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished_at: float | None = None
    max_gap: float = 0.0
    usage: Usage = field(default_factory=Usage)
    pauses: list[dict] = field(default_factory=list)
    # resume state
    snapshot: CkptRef | None = None
    replay_target: int | None = None        # frontier to rebuild before new progress
    recovery_pending: bool = False          # holds the full recovery permit
    wake: bool = False                      # a capacity event not caused by itself happened
    # scheduling
    overtaken: int = 0
    failed_epoch: int = -1
    source_cid: int | None = None           # the source it adopted (protected until bound)
    wait: CkptRef | None = None             # waiting reference on a blocked valuable source
    record: object = None                   # policy: the private record it continues
    save_points: list = field(default_factory=list)       # pending SavePoints, by frontier
    observed: set[int] = field(default_factory=set)        # candidate positions already observed

    @property
    def prompt(self) -> list[int]:
        return self.spec.prompt

    @property
    def params(self) -> SamplingParams:
        return self.spec.params

    @property
    def ledger(self) -> list[int]:
        return self.spec.prompt + self.outputs

    @property
    def frontier(self) -> int:
        return self.facts.frontier if self.facts is not None else 0

    @property
    def resident(self) -> bool:
        return self.phase in (Phase.BINDING, Phase.RUNNING)

    @property
    def in_prefill(self) -> bool:
        """Input remains to compute (initial prefill or Replay)."""
        return self.facts is not None and self.facts.frontier < self.facts.ledger_len - 1

    def note_tokens(self, tokens: list[int], now: float) -> None:
        if not tokens:
            return
        if self.first_token is None:
            self.first_token = now
        elif self.last_token is not None:
            self.max_gap = max(self.max_gap, now - self.last_token)
        self.last_token = now
        self.outputs.extend(tokens)

    def timings(self) -> Timings:
        t = Timings(max_output_gap_s=self.max_gap)
        if self.first_token is not None:
            t.ttft_s = self.first_token - self.arrival
        if self.finished_at is not None:
            t.e2e_s = self.finished_at - self.arrival
        if self.first_admitted is not None:
            t.queue_s = self.first_admitted - self.arrival
        return t
