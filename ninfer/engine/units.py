"""The next unit of a request, computed from its mirrored frontiers (one progress counter per
request: ``execution_frontier`` against the ledger — chunked prefill, cache hits, Replay and
decode share this one code path).

    frontier < replay_target            Replay chunk (recompute committed history; no sampling)
    frontier < P - 1 (no output yet)    Prefill chunk (saves inside it, or cut at the first)
    frontier == ledger_len - 1          Decode row (computes the committed next input, samples)
    frontier == ledger_len              Control row with no tokens: sample from the
                                        continuation hidden (an exact hit)

A chunk ends at the chunk budget, the ledger's end or a rewrite execution frontier. The save
points it crosses are taken inside it when the worker keeps states at inner cuts (``inner``: the
forward runs the GDN segment by segment and keeps each image, so saves cost no extra forward);
otherwise the unit ends exactly on the first one, so the state there can be captured right
after. Prefill chunk ends themselves are never save points.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ninfer.engine.request import Request
from ninfer.protocol import Capture, UnitKind


@dataclass
class Save:
    """A save point a unit crosses (``inner``: strictly inside it) or ends on, and what planning
    decided for it."""

    sp: object               # the SavePoint (policy.resources)
    inner: bool = False
    declined: bool = False   # not attempted (counted as skipped once the unit runs)
    retire: list = field(default_factory=list)   # holds the worker gives up when the unit runs
    replace: list = field(default_factory=list)  # holds it gives up only if the save happens
    shared: object = None    # an identical kept checkpoint the save point joins instead
    capture: Capture | None = None               # the capture sent (None: declined or shared)
    room_refused: bool = False                   # the admission table gave it no room


@dataclass
class Unit:
    n_tokens: int
    kind: UnitKind
    saves: list[Save] = field(default_factory=list)   # in position order


def next_unit(req: Request, frontier: int, ledger_len: int, chunk: int, save_points=(), inner: bool = False) -> Unit:
    if req.replay_target is not None and frontier < req.replay_target:
        return Unit(min(chunk, req.replay_target - frontier), UnitKind.REPLAY)
    if frontier == ledger_len:
        return Unit(0, UnitKind.CONTROL)
    if frontier == ledger_len - 1 and req.outputs:
        return Unit(1, UnitKind.DECODE)
    # rule: unit-cuts
    end = min(frontier + chunk, ledger_len)
    for x in req.spec.split_points:          # rewrite execution frontiers: the math splits here
        if frontier < x < end:
            end = x
    crossed = [sp for sp in save_points if frontier < sp.frontier <= end]
    if crossed and not inner:
        end, crossed = crossed[0].frontier, crossed[:1]     # the unit ends on the first save point
    return Unit(end - frontier, UnitKind.PREFILL, [Save(sp, sp.frontier < end) for sp in crossed])


def account(req: Request, unit: Unit) -> None:
    """Initial prefill and Replay are counted separately; only work really executed counts."""
    if unit.kind is UnitKind.REPLAY:
        req.usage.replay_tokens += unit.n_tokens
    elif unit.kind is UnitKind.PREFILL or (unit.kind is UnitKind.DECODE and not req.outputs):
        req.usage.prefill_tokens += unit.n_tokens
