"""The periodic engine summary (vLLM's throughput log): every ``log_stats_interval_s`` while the
engine is busy, one INFO line on ``ninfer.stats`` with the interval's rates and the engine's
state — prefill / Replay / generation tokens per second, running / waiting / paused requests,
the cache hit rate, bytes copied each way, Host use, lost restore points, pauses, and what the
controller itself cost (cycle time outside the worker, protocol bytes).

It is checked once per engine cycle (one clock read); an idle engine runs no cycles and logs
nothing, and its idle time is in no window.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import msgspec

from ninfer.logs import fmt_bytes

log = logging.getLogger("ninfer.stats")


class EngineSnapshot(msgspec.Struct, frozen=True):
    """What the summary reads of the engine: cumulative counters and the current state. The
    core builds one when a window closes (``EngineCore.snapshot``); the summary keeps no
    reference to the core."""

    counters: dict[str, float]        # cumulative: differences over a window are its rates
    busy: bool                        # requests are open
    running: int
    waiting: int
    paused: int
    host_capacity: int
    host_free: int
    lost_by_cause: dict[str, int]
    stalls: int


class EngineSummary:
    def __init__(self, interval_s: float, first: EngineSnapshot):
        self.interval = interval_s
        self._at = self._seen = time.monotonic()     # window start; the last cycle
        self._last = first.counters

    def tick(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        """Once per cycle (``snapshot`` is called only when a window closes). An idle engine
        runs no cycles: a gap longer than the interval since the last one closes the window at
        that cycle, so idle time never dilutes the rates."""
        if self.interval <= 0:
            return
        now = time.monotonic()
        if now - self._seen > self.interval:
            self._close(self._seen, snapshot(), busy=False)
            self._at = now
        self._seen = now
        if now - self._at >= self.interval:
            snap = snapshot()
            self._close(now, snap, busy=snap.busy)

    def _close(self, end: float, snap: EngineSnapshot, busy: bool) -> None:
        cur = snap.counters
        if end > self._at and (cur != self._last or busy) and log.isEnabledFor(logging.INFO):
            self._emit(end - self._at, snap, self._last)
        self._at, self._last = end, cur

    @staticmethod
    def _emit(dt: float, snap: EngineSnapshot, last: dict) -> None:
        cur = snap.counters
        d = {k: cur[k] - last[k] for k in cur}

        def rate(k: str) -> float:
            return round(d[k] / dt, 1)
        host_cap = snap.host_capacity
        host_used = max(0, host_cap - snap.host_free) if host_cap else 0
        fields = {
            "event": "engine", "interval_s": round(dt, 3),
            "prefill_tps": rate("prefill"), "replay_tps": rate("replay"), "generation_tps": rate("generated"),
            "running": snap.running, "waiting": snap.waiting, "paused": snap.paused,
            "finished": d["finished"], "cache_hits": d["hits"], "cache_queries": d["queries"],
            "cache_hit_rate": round(d["hits"] / d["queries"], 3) if d["queries"] else None,
            "hit_losses": d["hit_losses"], "hit_losses_by_cause": dict(snap.lost_by_cause),
            "bytes_h2d": d["h2d"], "bytes_d2h": d["d2h"], "bytes_h2d_total": cur["h2d"], "bytes_d2h_total": cur["d2h"],
            "host_used_bytes": host_used, "host_capacity_bytes": host_cap,
            "host_use": round(host_used / host_cap, 3) if host_cap else None,
            "preemptions": d["preemptions"], "stalls": snap.stalls,
            "controller_s": round(d["controller_s"], 6), "round_trips": d["round_trips"],
            "protocol_bytes": d["protocol_bytes"],
        }
        hit = "-" if fields["cache_hit_rate"] is None else f"{100 * fields['cache_hit_rate']:.1f}%"
        text = (f"engine: prefill {fields['prefill_tps']} tok/s, replay {fields['replay_tps']} tok/s, "
                f"generation {fields['generation_tps']} tok/s | running {fields['running']}, waiting "
                f"{fields['waiting']}, paused {fields['paused']} | cache hit rate {hit} ({d['hits']}/{d['queries']}), "
                f"lost {d['hit_losses']} | H2D {fmt_bytes(d['h2d'])}, D2H {fmt_bytes(d['d2h'])} | Host "
                f"{fmt_bytes(host_used)} of {fmt_bytes(host_cap)} | controller {1e3 * d['controller_s']:.1f} ms, "
                f"{d['round_trips']} round trips")
        log.info(text, extra={"ninfer": fields})
