"""What policy reads of a request (the controller's request record satisfies it). Policy keeps
its own per-request state in its own tables (the Scheduler's ``SchedState``, the
ResourceManager's ``CacheBook``); it never imports the controller."""

from __future__ import annotations

from typing import Protocol

from ninfer.protocol import CkptRef, Phase, RequestSpec, SeqFacts


class RequestView(Protocol):
    rid: str
    ticket: int
    spec: RequestSpec
    phase: Phase
    sid: int | None
    facts: SeqFacts | None
    outputs: list[int]
    snapshot: CkptRef | None          # its own pause snapshot, while paused by Snapshot
    replay_target: int | None         # frontier to rebuild before new progress
    recovery_pending: bool            # holds the full recovery permit
    awaiting_release: set[int]        # transactions its WAIT permit waits for (wait-for-release)
    finish_reason: object
    cancel_requested: bool
    prompt_logprobs: list             # prompt_logprobs entries it holds (tokens 1, 2, ...)

    @property
    def prompt(self) -> list[int]: ...

    @property
    def ledger(self) -> list[int]: ...

    @property
    def frontier(self) -> int: ...

    @property
    def resident(self) -> bool: ...

    @property
    def live(self) -> bool: ...
