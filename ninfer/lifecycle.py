"""A request's lifecycle as the client sees it, and the timings derived from it (seed: 日志和
TTFT 工具分别报告 ... 抢占恢复和用户可见时延). One function derives ``Output.timings`` from the
events, on the controller when it publishes the result and anywhere a caller holds the events
(``h.events()``, a log), so the two can never disagree.

    queued ── generation_start ── admitted ── first_token ── paused ─ resumed ─ ... ── finished
    |<────────── queue_s ──────────────>|                    |<-paused_s->|
    |<──────────────────── ttft_s ───────────────>|
    |<─────────────────────────────────────── e2e_s ──────────────────────────────────>|

``max_output_gap_s`` (the longest wait between two token commits, a pause's output gap
included) and ``source_wait_s`` (time waiting for a restore point another request was about to
publish) are measured on the controller and carried by the ``finished`` event.
"""

from __future__ import annotations

from ninfer import protocol as P

TIMINGS = ("ttft_s", "e2e_s", "max_output_gap_s", "queue_s", "paused_s", "source_wait_s", "arrival", "admitted_at")


def as_dict(ev: P.LifecycleEvent) -> dict:
    """The public form of one event: ``{"event": "paused", "t": ..., "wall": ..., ...}`` with the
    fields it carries (JSON-ready)."""
    out: dict = {"event": str(ev.kind), "t": ev.t, "wall": ev.wall}
    for name in ("ticket", "route", "reason", "frontier", "error", "max_output_gap_s", "source_wait_s"):
        v = getattr(ev, name)
        if v is not None:
            out[name] = v
    if ev.error is not None:
        out["error"] = P.ErrorKind(ev.error).value      # its public spelling, a plain str
    if ev.finish_reason is not None:
        out["finish_reason"] = str(P.FinishReason(ev.finish_reason))
    return out


def derive_timings(events: list[dict]) -> dict:
    """``Output.timings`` from a request's events (public dict form, in publication order).
    Intervals start at ``queued``; a pause still open when the request finished counts until
    ``finished``; a value whose moment has not happened is None."""
    first: dict[str, float] = {}
    paused_s, open_pause = 0.0, None
    fin: dict | None = None
    for ev in events:
        kind, t = ev["event"], ev["t"]
        first.setdefault(kind, t)
        if kind == "paused":
            open_pause = t
        elif kind == "resumed" and open_pause is not None:
            paused_s += t - open_pause
            open_pause = None
        elif kind == "finished":
            fin = ev
            if open_pause is not None:
                paused_s += t - open_pause
                open_pause = None
    start = first.get("queued")

    def since(kind: str) -> float | None:
        t = first.get(kind)
        return None if t is None or start is None else t - start
    return {"ttft_s": since("first_token"), "e2e_s": since("finished"),
            "max_output_gap_s": (fin or {}).get("max_output_gap_s") or 0.0,
            "queue_s": since("admitted"), "paused_s": paused_s,
            "source_wait_s": (fin or {}).get("source_wait_s") or 0.0,
            "arrival": start, "admitted_at": first.get("admitted")}
