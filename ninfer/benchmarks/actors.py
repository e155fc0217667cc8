"""Ray vs in-process (issue: Actors on Ray): controller-worker round trips per cycle, the
per-cycle overhead of the transport (a cycle's round-trip wall time minus the worker's own
time), and decode throughput of the tiny model at C = 1, 2, 4, 8."""

from __future__ import annotations

import time

from ninfer.api import Engine


def measure(engine: Engine, concurrency: int, max_tokens: int = 48) -> dict:
    before = engine.stats()
    hs = [engine.generate([7 + i] * 16, max_tokens=max_tokens, ignore_eos=True, seed=i) for i in range(concurrency)]
    firsts = []
    for h in hs:
        for _ in h:
            firsts.append(time.perf_counter())
            break
    outs = [h.result(600) for h in hs]
    end = time.perf_counter()
    after = engine.stats()
    cycles = after["cycles"] - before["cycles"]
    rts = after["round_trips"] - before["round_trips"]
    cycle_s = after["cycle_s"] - before["cycle_s"]
    worker_s = after["worker_s"] - before["worker_s"]
    decoded = sum(len(o.token_ids) - 1 for o in outs)
    return {"C": concurrency, "round_trips_per_cycle": rts / max(1, cycles),
            "overhead_ms_per_cycle": 1e3 * (cycle_s - worker_s) / max(1, cycles),
            "worker_ms_per_cycle": 1e3 * worker_s / max(1, cycles),
            "decode_tok_s": decoded / max(1e-9, end - min(firsts))}


def run(model_dir: str, out: str | None = None) -> dict:
    from ninfer.benchmarks.common import ensure_model, report
    model_dir = ensure_model(model_dir)
    rows = []
    for transport in ("inproc", "ray"):
        cfg = {"max_concurrency": 8, "max_context": 256, "prefill_chunk_tokens": 256,
               "context_cache": {"host_capacity_bytes": 64 << 20}}
        eng = Engine.start(model_dir, config=cfg, dtype="float32", transport=transport, deployment="ninfer-bench")
        try:
            measure(eng, 1, 8)                               # warm up
            for c in (1, 2, 4, 8):
                rows.append({"transport": transport, **measure(eng, c)})
        finally:
            eng.shutdown()
    result = {"note": "tiny model, float32, CPU; overhead = round-trip wall time minus worker time per cycle"}
    report("actors", result, rows, ["transport", "C", "round_trips_per_cycle", "overhead_ms_per_cycle",
                                    "worker_ms_per_cycle", "decode_tok_s"], out)
    return {**result, "rows": rows}
