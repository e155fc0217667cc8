"""The next unit of a request, computed from its mirrored frontiers (one progress counter per
request: ``execution_frontier`` against the ledger — chunked prefill, cache hits, Replay and
decode share this one code path).

    frontier < replay_target            Replay chunk (recompute committed history; no sampling)
    frontier < P - 1 (no output yet)    Prefill chunk, cut at the next save point
    frontier == ledger_len - 1          Decode row (computes the committed next input, samples)
    frontier == ledger_len              Control row with no tokens: sample from the
                                        continuation hidden (an exact hit)

A chunk never crosses a save point: the unit ends exactly on it, so the state there can be
captured right after (prefill chunk ends themselves are never save points).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ninfer.engine.request import Request
from ninfer.protocol import UnitKind


@dataclass
class Unit:
    n_tokens: int
    kind: UnitKind
    save_index: int | None   # index into the request's save points of the point it ends on
    declined: bool = False   # its save was not attempted (counted as skipped once it runs)
    retire: list = field(default_factory=list)   # holds the worker gives up when it runs
    replace: list = field(default_factory=list)  # holds it gives up only if the save happens
    shared: object = None    # an identical kept checkpoint its save point joins instead


def next_unit(req: Request, frontier: int, ledger_len: int, chunk: int, save_points=()) -> Unit:
    if req.replay_target is not None and frontier < req.replay_target:
        return Unit(min(chunk, req.replay_target - frontier), UnitKind.REPLAY, None)
    if frontier == ledger_len:
        return Unit(0, UnitKind.CONTROL, None)
    if frontier == ledger_len - 1 and req.outputs:
        return Unit(1, UnitKind.DECODE, None)
    # rule: unit-cuts
    end = min(frontier + chunk, ledger_len)
    for x in req.spec.split_points:          # rewrite execution frontiers: the math splits here
        if frontier < x < end:
            end = x
    save = None
    for i, sp in enumerate(save_points):
        if frontier < sp.frontier <= end:
            end, save = sp.frontier, i
            break
    return Unit(end - frontier, UnitKind.PREFILL, save)


def account(req: Request, unit: Unit) -> None:
    """Initial prefill and Replay are counted separately; only work really executed counts."""
    if unit.kind is UnitKind.REPLAY:
        req.usage.replay_tokens += unit.n_tokens
    elif unit.kind is UnitKind.PREFILL or (unit.kind is UnitKind.DECODE and not req.outputs):
        req.usage.prefill_tokens += unit.n_tokens
