"""Ray vs in-process (issue: Actors on Ray): controller-worker round trips per cycle, the
per-cycle overhead of the transport (a cycle's round-trip wall time minus the worker's own
time), and decode throughput of the tiny model at C = 1, 2, 4, 8."""

from __future__ import annotations


from ninfer.api import Engine
from ninfer.benchmarks.common import decode_window


def measure(engine: Engine, concurrency: int, max_tokens: int = 48, prompt_tokens: int = 16) -> dict:
    before = engine.stats()
    hs = [engine.generate([7 + i] * prompt_tokens, max_tokens=max_tokens, ignore_eos=True, seed=i)
          for i in range(concurrency)]
    firsts, outs, end = decode_window(hs)
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


def run(model_dir: str, out: str | None = None, plot: str | None = None, transports=("inproc", "ray"),
        concurrency=(1, 2, 4, 8), max_tokens: int = 48, prompt_tokens: int = 16, lanes: int = 8,
        dtype: str = "float32") -> dict:
    """One engine per transport (``lanes`` lanes), warmed up, then each C of ``concurrency``
    requests of ``prompt_tokens`` decoding ``max_tokens``; the defaults are the committed run."""
    from ninfer.benchmarks.common import ensure_model, report
    from ninfer.progress import bar
    model_dir = ensure_model(model_dir)
    context = max(256, prompt_tokens + max_tokens)
    cfg = {"max_concurrency": lanes, "max_context": context, "prefill_chunk_tokens": 256,
           "context_cache": {"host_capacity_bytes": 64 << 20}}
    rows = []
    progress = bar(total=len(transports) * len(concurrency), desc="actors", unit="run")
    for transport in transports:
        progress.set_description(f"actors ({transport}: starting)")
        eng = Engine.start(model_dir, config=cfg, dtype=dtype, transport=transport, deployment="ninfer-bench")
        try:
            progress.set_description(f"actors ({transport})")
            measure(eng, 1, 8, prompt_tokens)          # warm up
            for c in concurrency:
                rows.append({"transport": transport, **measure(eng, c, max_tokens, prompt_tokens)})
                progress.update()
        finally:
            eng.shutdown()
    progress.close()
    result = {"note": f"tiny model, {dtype}, CPU; overhead = round-trip wall time minus worker time per cycle",
              "config": {"transports": list(transports), "concurrency": list(concurrency), "max_tokens": max_tokens,
                         "prompt_tokens": prompt_tokens, "lanes": lanes, "dtype": dtype}}
    return report("actors", result, rows, ["transport", "C", "round_trips_per_cycle", "overhead_ms_per_cycle",
                                           "worker_ms_per_cycle", "decode_tok_s"], out, plot)
