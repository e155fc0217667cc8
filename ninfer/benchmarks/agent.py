"""Multi-turn agent workload: prefill tokens computed vs the infinite-cache floor (issue:
Engine controller II — the context cache).

Sessions share a system prompt; each turn appends the previous answer and a tool result, and
sometimes the client normalises the previous tool call (the history after the response start
is rewritten), as agent frameworks do. Each session submits its next turn when the previous one
finishes. The floor is what an infinite, exact cache would still have to compute: for every
request, the prompt tokens beyond its longest common prefix with anything submitted or
generated before it.
"""

from __future__ import annotations

import random
import time

from ninfer.api import Engine


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def workload(seed: int, sessions: int, turns: int, vocab: int = 2000):
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(150)]
    tasks = [[rng.randrange(vocab) for _ in range(30)] for _ in range(sessions)]
    tools = [[[rng.randrange(vocab) for _ in range(rng.randint(20, 40))] for _ in range(turns)]
             for _ in range(sessions)]
    normalise = [[rng.random() < 0.3 for _ in range(turns)] for _ in range(sessions)]
    return system, tasks, tools, normalise


def run_capacity(model_dir: str, kv_pages: int, host_bytes: int, sessions: int = 6, turns: int = 5,
                 dtype: str = "float32") -> dict:
    system, tasks, tools, normalise = workload(0, sessions, turns)
    cfg = {"max_concurrency": 4, "max_context": 1024, "kv_capacity": kv_pages * 64, "prefill_chunk_tokens": 128,
           "context_cache": {"host_capacity_bytes": host_bytes, "device_state_slots": 4}}
    eng = Engine.start(model_dir, config=cfg, dtype=dtype)
    computed: list[list[int]] = []            # every sequence computed so far (prompt + output)
    floor = 0
    prompts = [system + tasks[s] for s in range(sessions)]
    pending = {s: None for s in range(sessions)}
    turn = [0] * sessions
    usage = {"prefill": 0, "replay": 0, "cached": 0}
    t0 = time.perf_counter()

    def submit(s: int):
        nonlocal floor
        p = prompts[s]
        floor += len(p) - max((_lcp(p, c) for c in computed), default=0)
        computed.append(p)                    # an infinite cache would hold it from now on
        pending[s] = (p, eng.generate(p, max_tokens=12, temperature=0.7, seed=s * 100 + turn[s], ignore_eos=True,
                                      session_id=f"agent-{s}", recovery_frontier=len(p) - 2,
                                      cache_markers=[len(system)]))
    for s in range(sessions):
        submit(s)
    while pending:
        for s in list(pending):
            p, h = pending[s]
            out = h.result(600)
            usage["prefill"] += out.usage.prefill_tokens
            usage["replay"] += out.usage.replay_tokens
            usage["cached"] += out.usage.cached_tokens
            computed.append(p + out.token_ids)
            turn[s] += 1
            del pending[s]
            if turn[s] < turns:
                answer = out.token_ids
                if normalise[s][turn[s]]:                       # the client rewrote the tool call
                    answer = [(t * 7 + 3) % 2000 for t in answer][: max(1, len(answer) - 3)]
                prompts[s] = p + answer + tools[s][turn[s]]
                submit(s)
    wall = time.perf_counter() - t0
    stats = eng.stats()
    eng.shutdown()
    c = stats["cache"]
    return {"kv_pages": kv_pages, "host_MiB": host_bytes >> 20, "requests": sessions * turns,
            "prefill_computed": usage["prefill"], "replay": usage["replay"], "floor": floor,
            "over_floor": round((usage["prefill"] + usage["replay"]) / max(1, floor), 3),
            "cached_tokens": usage["cached"], "hits": c["hits"], "queries": c["queries"],
            "hit_losses": c["hit_losses"], "preemptions": stats["preemptions"], "wall_s": round(wall, 2)}


def run(model_dir: str, out: str | None = None) -> dict:
    from ninfer.benchmarks.common import ensure_model, report
    model_dir = ensure_model(model_dir)
    rows = [run_capacity(model_dir, kv_pages=16, host_bytes=2 << 20),
            run_capacity(model_dir, kv_pages=64, host_bytes=64 << 20)]
    result = {"workload": "6 agent sessions x 5 turns, shared 150-token system prompt, 30% tool-call normalisation"}
    report("agent", result, rows, ["kv_pages", "host_MiB", "prefill_computed", "replay", "floor", "over_floor",
                                   "hits", "queries", "hit_losses", "preemptions", "wall_s"], out)
    return {**result, "rows": rows}
