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
from ninfer.benchmarks.common import router_label


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
                 dtype: str = "float32", seed: int = 0, progress=None) -> dict:
    system, tasks, tools, normalise = workload(seed, sessions, turns)
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
            if progress is not None:
                progress.update()
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


def trace(seed: int = 0, sessions: int = 8, turns: int = 6, system_len: int = 1500, vocab: int = 2000):
    """The issue's agent trace: a shared system prompt (+ tools), then per session, turn t's
    prompt = turn t-1's prompt + its output + a segment — a user segment of 40-120 tokens on even
    turns, a tool result of 120-300 on odd ones (drawn up front from a seeded RNG)."""
    rng = random.Random(seed)
    system = [rng.randrange(1, vocab) for _ in range(system_len)]
    segments = [[[rng.randrange(1, vocab) for _ in range(rng.randint(40, 120) if t % 2 == 0 else rng.randint(120, 300))]
                 for t in range(turns)] for _ in range(sessions)]
    return system, segments


def run_trace(model_dir: str, transport: str = "inproc", sessions: int = 8, turns: int = 6,
              out_tokens: int = 32, dtype: str = "float32", check=None, system_tokens: int = 1500,
              lanes: int | None = None, seed: int = 0, progress=None, replicas: int = 1,
              routing: str | None = None) -> dict:
    """Round by round: every session's turn t is submitted together once every turn t-1 is
    done. Computed prompt tokens (prefill + replay) against the floor with the shared prefix
    charged once (each prompt's tokens beyond its longest common prefix with everything
    submitted or generated before it), and TTFT mean / max; per round the computed, cached and
    floor tokens, and every request's TTFT and end-to-end time (for the plot). ``lanes``:
    max_concurrency (default: one per session, at most 8). ``check(prompt, tokens)`` may
    compare outputs with the reference; ``progress.update()`` is called per finished request.
    ``replicas`` > 1: that many engines over Ray, routed by ``routing`` (issue 34)."""
    system, segments = trace(seed, sessions, turns, system_tokens)
    longest = system_tokens + sum(max(len(segments[s][t]) for s in range(sessions)) for t in range(turns))
    cfg = {"max_concurrency": lanes or min(sessions, 8), "max_context": max(4096, longest + turns * out_tokens),
           "prefill_chunk_tokens": 256,
           "context_cache": {"host_capacity_bytes": 256 << 20, "device_state_slots": 2 * sessions}}
    extra = {} if replicas == 1 else {"replicas": replicas, "router": routing}
    eng = Engine.start(model_dir, config=cfg, dtype=dtype, transport=transport, **extra)
    computed: list[list[int]] = []
    prompts = [system + segments[s][0] for s in range(sessions)]
    floor = work = 0
    ttft: list[float] = []
    e2e: list[float] = []
    rounds: list[dict] = []
    t0 = time.perf_counter()
    for t in range(turns):
        handles = []
        floor0, work0, cached = floor, work, 0
        for s in range(sessions):
            p = prompts[s]
            floor += len(p) - max((_lcp(p, c) for c in computed), default=0)
            computed.append(p)
            handles.append((s, p, eng.generate(p, max_tokens=out_tokens, ignore_eos=True, session_id=f"agent-{s}",
                                               cache_markers=[len(system)])))
        for s, p, h in handles:
            res = h.result(1200)
            work += res.usage.prefill_tokens + res.usage.replay_tokens
            cached += res.usage.cached_tokens
            if res.timings.ttft_s is not None:
                ttft.append(res.timings.ttft_s)
            if res.timings.e2e_s is not None:
                e2e.append(res.timings.e2e_s)
            if check is not None:
                check(p, res.token_ids)
            computed.append(p + res.token_ids)
            if t + 1 < turns:
                prompts[s] = p + res.token_ids + segments[s][t + 1]
            if progress is not None:
                progress.update()
        rounds.append({"round": t, "computed": work - work0, "cached": cached, "floor": floor - floor0})
    wall = time.perf_counter() - t0
    stats = eng.stats()
    eng.shutdown()
    c = stats["cache"]
    name = transport if replicas == 1 else f"{transport} x{replicas} {router_label(routing)}"
    spread = "/".join(str(x.get("finished", 0)) for x in sorted(stats.get("replicas", []), key=lambda x: x["slot"]))
    return {"transport": name, "requests": sessions * turns, "computed": work, "floor": floor, "spread": spread,
            "routed_by_reason": (stats.get("router") or {}).get("routed_by_reason"),
            "over_floor": round(work / max(1, floor), 3),
            "ttft_mean_ms": round(1e3 * sum(ttft) / max(1, len(ttft)), 1), "ttft_max_ms": round(1e3 * max(ttft, default=0), 1),
            "pending_waits": c.get("pending_waits", 0), "pending_saved_tokens": c.get("pending_saved_tokens", 0),
            "hits": c["hits"], "preemptions": stats["preemptions"], "wall_s": round(wall, 2),
            "rounds": rounds, "ttft_ms": [round(1e3 * x, 1) for x in ttft], "e2e_ms": [round(1e3 * x, 1) for x in e2e]}


def run(model_dir: str, out: str | None = None, plot: str | None = None, transports=("inproc", "ray"),
        sessions: int = 8, turns: int = 6, system_tokens: int = 1500, out_tokens: int = 32,
        lanes: int | None = None, capacities=((16, 2), (64, 64)), dtype: str = "float32", seed: int = 0,
        replicas: int = 1, routings=("exact",)) -> dict:
    """The agent trace on each of ``transports`` (outputs checked against the reference), then
    the multi-turn workload at each (KV pages, Host MiB) of ``capacities`` (either may be empty);
    the defaults are the committed measurement."""
    import sys

    from ninfer.benchmarks.common import ensure_model, report, table
    from ninfer.native.threads import pin as pin_threads
    from ninfer.progress import bar
    from ninfer.reference import reference_generate
    # the oracle runs on this thread: one thread, as the engine's own threads (a second one only
    # fights them and the other cores' work; it made the default run ~2x slower on 2 busy cores)
    pin_threads(1)
    model_dir = ensure_model(model_dir)
    mismatches: list[int] = []
    refs: dict[tuple, list[int]] = {}

    def check(prompt, tokens):
        key = (tuple(prompt), len(tokens))
        if key not in refs:
            refs[key] = reference_generate(model_dir, prompt, max_tokens=len(tokens), dtype=dtype, ignore_eos=True)
        if tokens != refs[key]:
            mismatches.append(len(prompt))
    traces = []
    if transports:
        print(f"agent trace: {sessions} sessions x {turns} turns, {system_tokens:,}-token shared system prompt, "
              "rounds submitted together", file=sys.stderr)
    runs = [(t, 1, None) for t in transports]
    if replicas > 1:                            # one engine first: the replicated rows compare with it
        runs = (runs or [("inproc", 1, None)]) + [("ray", replicas, r) for r in routings]
    for transport, n, routing in runs:
        mismatches.clear()
        desc = transport if n == 1 else f"{transport} x{n} {router_label(routing)}"
        with bar(total=sessions * turns, desc=f"trace ({desc})", unit="req") as progress:
            traces.append(run_trace(model_dir, transport, sessions, turns, out_tokens, dtype, check, system_tokens,
                                    lanes, seed, progress, n, routing))
        traces[-1]["outputs_exact"] = not mismatches
        traces[-1]["vs_one"] = round(traces[-1]["computed"] / max(1, traces[0]["computed"]), 4)
    if traces:
        print(table(traces, ["transport", "requests", "computed", "floor", "over_floor"]
                    + (["vs_one", "spread"] if replicas > 1 else [])
                    + ["ttft_mean_ms", "ttft_max_ms", "pending_waits", "pending_saved_tokens", "wall_s",
                       "outputs_exact"]))
        print(file=sys.stderr)
    w_sessions, w_turns = 6, 5
    rows = []
    for pages, mib in capacities:
        with bar(total=w_sessions * w_turns, desc=f"workload ({pages} pages, {mib} MiB)", unit="req") as progress:
            rows.append(run_capacity(model_dir, kv_pages=pages, host_bytes=mib << 20, sessions=w_sessions,
                                     turns=w_turns, dtype=dtype, seed=seed, progress=progress))
    result = {"workload": f"{w_sessions} agent sessions x {w_turns} turns, shared 150-token system prompt, "
                          "30% tool-call normalisation",
              "config": {"transports": list(transports), "replicas": replicas,
                         "routings": [router_label(r) for r in routings] if replicas > 1 else [],
                         "sessions": sessions, "turns": turns,
                         "system_tokens": system_tokens, "out_tokens": out_tokens, "lanes": lanes or min(sessions, 8),
                         "capacities": [list(c) for c in capacities], "dtype": dtype, "seed": seed},
              "trace": traces}
    return report("agent", result, rows, ["kv_pages", "host_MiB", "prefill_computed", "replay", "floor", "over_floor",
                                          "hits", "queries", "hit_losses", "preemptions", "wall_s"], out, plot)
