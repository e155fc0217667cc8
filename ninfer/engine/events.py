"""Lifecycle publication (seed: Engine 请求记录 keeps the first times; GenerationStart 和首次
admitted/first-token 只发布一次): each moment of a request goes out once, on the same sink as its
tokens, and is kept in its record; at the end one summary line per request is logged.

    queued, generation_start   intake (``EngineCore.add``)
    admitted                   its first bind (outcomes: fresh)
    first_token                its first committed output token (outcomes: units)
    paused / resumed           every pause and every resume, with the route and why
    finished                   terminal (``EngineCore._finish``), just before its FinalEvent

A pause never republishes the once-only moments; a request paused twice has two ``paused`` and
two ``resumed`` events. A request kept across a worker loss carries its events to the new core
(``carry``), so nothing is published twice there either.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

from ninfer import protocol as P
from ninfer.lifecycle import as_dict, derive_timings
from ninfer.logs import fmt_s
from ninfer.protocol import Life

log = logging.getLogger("ninfer.requests")

ONCE = frozenset({Life.QUEUED, Life.GENERATION_START, Life.ADMITTED, Life.FIRST_TOKEN, Life.FINISHED})


class Lifecycle:
    def __init__(self, sink: Callable[[P.Event], None]):
        self.sink = sink

    def publish(self, req, kind: Life, t: float | None = None, **fields) -> bool:
        """Publish one moment of ``req`` (False: a once-only moment already published)."""
        if kind in ONCE and kind in req.published:
            return False
        req.published.add(kind)
        ev = P.LifecycleEvent(req.rid, kind, time.monotonic() if t is None else t, time.time(), **fields)
        req.life.append(ev)
        self.sink(ev)
        return True

    @staticmethod
    def timings(req) -> P.Timings:
        """``Output.timings`` of this request, derived from its events as any reader would."""
        return P.Timings(**derive_timings([as_dict(e) for e in req.life]))

    def summary(self, req, timings: P.Timings, lost: dict | None) -> None:
        """One line per finished request: work done, user-visible times, pauses, lost restore
        points (seed: 日志 ... 分别报告请求结果、命中与真实工作、物理搬运、抢占恢复和用户可见时延)."""
        if not log.isEnabledFor(logging.INFO):
            return
        u = req.usage
        routes = Counter(p.route for p in req.pauses)
        fields = {
            "event": "request", "rid": req.rid, "finish_reason": str(req.finish_reason),
            "error": None if req.error is None else req.error.kind.value,
            "prompt_tokens": u.prompt_tokens, "cached_tokens": u.cached_tokens,
            "prefill_tokens": u.prefill_tokens, "replay_tokens": u.replay_tokens,
            "completion_tokens": len(req.outputs),
            **{k: getattr(timings, k) for k in ("ttft_s", "e2e_s", "max_output_gap_s", "queue_s", "paused_s",
                                                "source_wait_s")},
            "pauses": {"snapshot": routes.get("snapshot", 0), "replay": routes.get("replay", 0)},
            "lost": lost,
        }
        text = (f"request {req.rid} {fields['finish_reason']}"
                + (f" ({fields['error']})" if fields["error"] else "")
                + f": prompt {u.prompt_tokens} (cached {u.cached_tokens}, prefill {u.prefill_tokens}, "
                  f"replay {u.replay_tokens}), completion {len(req.outputs)}; ttft {fmt_s(timings.ttft_s)}, "
                  f"e2e {fmt_s(timings.e2e_s)}, max gap {fmt_s(timings.max_output_gap_s)}, "
                  f"paused {fmt_s(timings.paused_s)} (snapshot {routes.get('snapshot', 0)}, "
                  f"replay {routes.get('replay', 0)})"
                + (f"; lost restore point at {lost['frontier']} ({lost['cause']}, {lost['tokens']} tokens "
                   f"recomputed)" if lost else ""))
        log.info(text, extra={"ninfer": fields})
