"""``ninfer bench router``: the replica router's cost per request against the size of the
replicas' restore summaries (issue 34: flat, at most 1 ms, with 10k entries per replica).

Model-free: each replica's summary is filled with fabricated restore positions — histories of
1-4k tokens sharing 8 system prompts, each with its first turn's input point 10-50 tokens past
its system prompt (so a thousand entries share one bucket: the hot case) and more positions at
random depths (E, markers, divergence points) — applied as the SummaryEvents a replica sends. Then prompts of each
length are routed (half extend a published history, half share only a system prompt or nothing)
and each decision is timed: hashing the prompt, the bucket lookups, the exact checks, the
in-flight table, the scoring and the bookkeeping (``Router.route`` + ``Router.finished``)."""

from __future__ import annotations

import random
import time

from ninfer import protocol as P
from ninfer.policy.index import digest
from ninfer.replicas.router import Router, RouterConfig
from ninfer.replicas.summary import bucket_digest


def _histories(rng: random.Random, n: int, vocab: int = 2000) -> list[tuple[list[int], int]]:
    """(history, its first input point) pairs over 8 shared system prompts."""
    systems = [[rng.randrange(1, vocab) for _ in range(rng.randint(200, 1500))] for _ in range(8)]
    out = []
    for _ in range(n):
        base = rng.choice(systems)
        out.append((base + [rng.randrange(1, vocab) for _ in range(rng.randint(100, 2500))],
                    len(base) + rng.randint(10, 50)))
    return out


def _fill(router: Router, replica: int, histories: list[list[int]], entries: int, rng: random.Random,
          block: int) -> None:
    """``entries`` positions over ``histories``, published as deltas of 64 entries."""
    added, seq = [], 0
    per = max(1, entries // max(1, len(histories)))
    for h, first in histories:
        cuts = sorted({rng.randrange(16, len(h)) for _ in range(per - 2)} | {first, len(h)})
        for d in cuts:
            added.append((d, digest(h[:d]), bucket_digest(h, d, block)))
    added = added[:entries]
    for i in range(0, len(added), 64):
        ev = P.SummaryEvent("bench", seq, seq == 0, added[i:i + 64], [], 0)
        assert router.apply(replica, ev)
        seq += 1


def measure(entries: int, replicas: int = 2, lengths=(512, 2048, 4096), queries: int = 300, seed: int = 0,
            block: int = 64) -> list[dict]:
    rng = random.Random(seed)
    router = Router(RouterConfig(block_tokens=block))
    pools = []
    for r in range(replicas):
        router.add(r, 8)
        hist = _histories(rng, max(1, entries // 4))
        _fill(router, r, hist, entries, rng, block)
        pools.append(hist)
    rows = []
    for length in lengths:
        times = []
        for q in range(queries):
            if q % 2 == 0:                              # extends a published history
                h = rng.choice(rng.choice(pools))[0]
                prompt = (h + [rng.randrange(1, 2000) for _ in range(length)])[:length]
            else:                                       # shares a system prompt at most
                prompt = [rng.randrange(1, 2000) for _ in range(length)]
            t0 = time.perf_counter()
            router.route(f"q{length}-{q}", prompt)
            router.finished(f"q{length}-{q}")
            times.append(time.perf_counter() - t0)
        times.sort()
        rows.append({"entries_per_replica": entries, "replicas": replicas, "prompt_tokens": length,
                     "route_us_p50": round(1e6 * times[len(times) // 2], 1),
                     "route_us_p90": round(1e6 * times[int(len(times) * 0.9) - 1], 1),
                     "route_us_p99": round(1e6 * times[int(len(times) * 0.99) - 1], 1),
                     "route_us_max": round(1e6 * times[-1], 1),
                     "summary_entries": sum(router.table.size(r) for r in range(replicas)),
                     "restore_routed": router.by_reason.get("restore", 0)})
    return rows


def run(model_dir: str, out: str | None = None, plot: str | None = None, dtype: str = "float32",
        sizes=(100, 1000, 10000), replicas: int = 2, lengths=(512, 2048, 4096), queries: int = 300) -> dict:
    """``model_dir`` and ``dtype`` are the benches' common options; this one needs no model."""
    from ninfer.benchmarks.common import report
    from ninfer.progress import bar
    rows = []
    with bar(total=len(sizes), desc="router", unit="size") as progress:
        for n in sizes:
            rows.extend(measure(n, replicas, lengths, queries))
            progress.update()
    result = {"config": {"replicas": replicas, "entries_per_replica": list(sizes), "prompt_tokens": list(lengths),
                         "queries": queries, "block_tokens": 64}}
    return report("router", result, rows, ["entries_per_replica", "replicas", "prompt_tokens", "route_us_p50",
                                           "route_us_p90", "route_us_p99", "route_us_max", "summary_entries",
                                           "restore_routed"], out, plot)
