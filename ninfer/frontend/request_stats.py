"""Per-request distributions vLLM's dashboards read, kept where every request enters and ends:
the frontend's intake (the Ray frontend actor, or the in-process runtime) sees each request's
spec at submission and its final event, from every client of a deployment.

    at submission   vllm:request_params_max_tokens
    at the end      vllm:request_prompt_tokens, vllm:request_generation_tokens,
                    vllm:request_time_per_output_token_seconds (e2e - ttft over tokens - 1),
                    vllm:request_prefill_time_seconds (admission to first token),
                    vllm:request_decode_time_seconds (first token to the end),
                    vllm:request_inference_time_seconds (admission to the end),
                    vllm:prompt_tokens_cached (real reuse), failures by error kind

The engine's own times come from the request's lifecycle (``Output.timings``): ``queue_s`` is
arrival to first admission, ``ttft_s`` arrival to first token, ``e2e_s`` arrival to the end.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import Counter

# vLLM's boundaries for the same quantities (as the controller's telemetry uses them)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)


class Histogram:
    """Counts per upper bound (the last bucket is +Inf), their sum and count — the shape of
    ``stats()["telemetry"]["histograms"]`` that ``frontend/metrics.py`` exposes."""

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


def one_two_five(top: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``top``."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > top:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class RequestStats:
    def __init__(self, max_context: int):
        tokens = one_two_five(max_context)
        self.hist = {"prompt_tokens": Histogram(tokens), "generation_tokens": Histogram(tokens),
                     "params_max_tokens": Histogram(tokens), "time_per_output_token_s": Histogram(TPOT_BUCKETS),
                     "prefill_s": Histogram(LATENCY_BUCKETS), "decode_s": Histogram(LATENCY_BUCKETS),
                     "inference_s": Histogram(LATENCY_BUCKETS)}
        self.cached_tokens = 0
        self.failures: Counter = Counter()
        self._lock = threading.Lock()           # observed on the control thread, read on others

    def submitted(self, spec) -> None:
        with self._lock:
            self.hist["params_max_tokens"].observe(spec.params.max_tokens)

    def finished(self, ev) -> None:
        """A ``FinalEvent`` (the engine's, or one the frontend made for a lost request)."""
        u, t = ev.usage, ev.timings
        with self._lock:
            if ev.error is not None:
                self.failures[ev.error.kind.value] += 1
            if u is None or t is None:               # ended outside the engine: no books of its own
                return
            n = u.completion_tokens
            self.hist["prompt_tokens"].observe(u.prompt_tokens)
            self.hist["generation_tokens"].observe(n)
            self.cached_tokens += u.cached_tokens
            ttft, e2e, queue = t.ttft_s, t.e2e_s, t.queue_s
            if ttft is not None and e2e is not None and n > 1:
                self.hist["time_per_output_token_s"].observe((e2e - ttft) / (n - 1))
            if ttft is not None and queue is not None:
                self.hist["prefill_s"].observe(max(0.0, ttft - queue))
            if ttft is not None and e2e is not None:
                self.hist["decode_s"].observe(max(0.0, e2e - ttft))
            if queue is not None and e2e is not None:
                self.hist["inference_s"].observe(max(0.0, e2e - queue))

    def snapshot(self) -> dict:
        with self._lock:
            return {"histograms": {k: h.snapshot() for k, h in self.hist.items()},
                    "prompt_tokens_cached": self.cached_tokens, "failures_by_kind": dict(self.failures)}
