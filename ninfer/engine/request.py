"""The Engine's request record (seed: Engine 请求记录): original ticket, input and output
objects, budget, cancellation, first times and the continuation across pauses.

A request keeps its committed history when it gives its lane back; the Native binding can be
rebuilt (Snapshot or Replay). GenerationStart, first admission and first token are published
once; a pause does not restart the ingress timeout. Scheduling and cache state live in the
Scheduler's and the ResourceManager's own tables.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ninfer.protocol import CkptRef, FinishReason, Phase, RequestSpec, SeqFacts, Usage  # noqa: F401  (re-exported)
from ninfer.protocol import Failure, Life, LifecycleEvent, PauseEntry, PromptLogprob, TokenLogprob
from ninfer.sampling_params import SamplingParams


@dataclass(eq=False)
class Request:
    spec: RequestSpec
    rid: str
    ticket: int
    arrival: float = field(default_factory=time.monotonic)
    phase: Phase = Phase.QUEUED
    sid: int | None = None
    outputs: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)   # one per output, when asked
    # prompt_logprobs, when asked: the entries of prompt tokens 1, 2, ... in order, each once
    # (kept across pauses; ``len`` = prompt positions whose entry it holds)
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: Failure | None = None
    cancel_requested: bool = False
    facts: SeqFacts | None = None           # mirror of the worker's sequence
    # times (published once: ``life`` holds the published events, ``published`` their kinds)
    life: list[LifecycleEvent] = field(default_factory=list)
    published: set[Life] = field(default_factory=set)
    first_admitted: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished_at: float | None = None
    max_gap: float = 0.0
    usage: Usage = field(default_factory=Usage)
    pauses: list[PauseEntry] = field(default_factory=list)
    # the continuation across pauses
    snapshot: CkptRef | None = None         # its own pause snapshot (Snapshot route)
    replay_target: int | None = None        # frontier to rebuild before new progress
    recovery_pending: bool = False          # holds the full recovery permit
    # transactions whose release its next unit waits for (its permit came back WAIT: the
    # reclaim committed for it frees the capacity once these copies publish)
    awaiting_release: set[int] = field(default_factory=set)

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
        return self.phase in (Phase.MATERIALIZING, Phase.RUNNING)

    @property
    def live(self) -> bool:
        """Neither terminal nor being cancelled."""
        return self.finish_reason is None and not self.cancel_requested

    def note_prompt_logprobs(self, first: int, entries: list[PromptLogprob]) -> bool:
        """Keep the entries of prompt tokens ``first``, ``first + 1``, ... that it does not hold
        yet (a repeat is dropped). False when they would leave a gap: positions were skipped."""
        have = len(self.prompt_logprobs)
        if first > have + 1:
            return False
        self.prompt_logprobs.extend(entries[have + 1 - first:])
        return True

    def note_tokens(self, tokens: list[int], now: float, logprobs: list[TokenLogprob] = ()) -> float | None:
        """Record committed tokens; the gap since the previous token event (None for the first)."""
        if not tokens:
            return None
        self.logprobs.extend(logprobs)          # the worker sends one per token, or none
        gap = None
        if self.first_token is None:
            self.first_token = now
        elif self.last_token is not None:
            gap = now - self.last_token
            self.max_gap = max(self.max_gap, gap)
        self.last_token = now
        self.outputs.extend(tokens)
        return gap
