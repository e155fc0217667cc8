"""Request latency distributions kept by the controller, so ``engine.stats()`` carries them
over either transport and every client (``/metrics`` of any server, the Python API) reads the
same numbers.

Histograms have fixed buckets (vLLM's boundaries for the same quantities) and cost one bisect
per observation: time to first token, end to end, queue time (arrival to first admission) and
inter-token latency (the gap between consecutive token events of one request — a pause shows
up here as one long gap).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)


class Histogram:
    """Counts per upper bound (the last bucket is +Inf), their sum and count."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect_left(self.bounds, v)] += 1
        self.sum += v
        self.count += 1

    def snapshot(self) -> dict:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum, "count": self.count}


class Telemetry:
    def __init__(self):
        self.hist = {"ttft_s": Histogram(TTFT_BUCKETS), "e2e_s": Histogram(LATENCY_BUCKETS),
                     "queue_s": Histogram(LATENCY_BUCKETS), "itl_s": Histogram(ITL_BUCKETS)}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.paused_s = 0.0              # time finished requests spent paused
        self.source_wait_s = 0.0         # ... and waiting for another request's pending point
        self.finished = Counter()

    def token_gap(self, gap: float | None) -> None:
        if gap is not None:
            self.hist["itl_s"].observe(gap)

    def finished_request(self, req, timings) -> None:
        """``timings``: the request's derived ``protocol.Timings`` (``ninfer.lifecycle``)."""
        for name in ("ttft_s", "e2e_s", "queue_s"):
            v = getattr(timings, name)
            if v is not None:
                self.hist[name].observe(v)
        self.paused_s += timings.paused_s or 0.0
        self.source_wait_s += timings.source_wait_s or 0.0
        self.prompt_tokens += req.usage.prompt_tokens
        self.generation_tokens += len(req.outputs)
        self.finished[str(req.finish_reason)] += 1

    def snapshot(self) -> dict:
        return {"histograms": {k: h.snapshot() for k, h in self.hist.items()},
                "prompt_tokens": self.prompt_tokens, "generation_tokens": self.generation_tokens,
                "paused_s": self.paused_s, "source_wait_s": self.source_wait_s,
                "finished_by_reason": dict(self.finished)}
