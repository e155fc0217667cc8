"""``ninfer bench trace FILE``: replay a production trace and measure reuse against its floors.

The trace (Mooncake or Qwen-Bailian hash ids, or explicit token prompts; ``trace_input``)
becomes token prompts; they are replayed in arrival order, either in windows (the requests whose
arrival falls in the same ``window_s`` seconds are submitted together, the next window once the
previous has finished) or at their recorded times multiplied by ``time_scale`` (0: all at once).
Every request is greedy with ``ignore_eos``, so its output length is the trace's (scaled).

One run per transport and capacity on an engine started here (``inproc`` / ``ray``), or one run
against any OpenAI-compatible server (``base_url``: streaming ``/completions`` with token-id
prompts; cached tokens as ``usage.prompt_tokens_details.cached_tokens`` reports them). Per run:
prompt, cached and computed prompt tokens (computed = prefill + replay; over HTTP prompt −
cached), computed ÷ the ideal floor and ÷ the prompt-ends floor (``trace_floor``), the hit
fraction beside the ideal one, TTFT and end-to-end p50/p90/p99, pauses by route, Host traffic
and lost hits by cause (``engine.stats()``). On an engine, a sample of outputs is compared with
``reference_generate`` and, after the run, ``drop_caches()`` then ``check_integrity()`` must pass.

A capacity is ``ample`` (the largest Main-KV pool the layout allows, C full contexts, and a
2 GiB Host tier) or ``(pages, host MiB)``: a Main-KV budget of 64-token pages and a Host tier.

``replicas`` N > 1 (issue 34) adds, per capacity, one run of N engine replicas over Ray per
routing mode (``exact``, ``session``, ``round-robin``), each engine with that capacity; every row
then reports ``vs_one``: its computed prompt tokens ÷ those of the first one-engine run of the
same capacity (how much reuse the routing lost), and how the requests were spread and why.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass, field

from ninfer.benchmarks.common import router_label
from ninfer.benchmarks.trace_floor import Floors, floors
from ninfer.benchmarks.trace_input import (SOURCE, TraceRequest, load, model_vocab, ordinary_vocab, save_tokens,
                                          windows)

AMPLE = "ample"                  # the capacity entry: C full contexts of Main KV, a 2 GiB Host
AMPLE_HOST_MIB = 2048
COLUMNS = ["run", "requests", "errors", "prompt", "cached", "computed", "ideal", "ends", "over_ideal", "over_ends",
           "hit", "ideal_hit", "ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "pauses", "h2d_MiB",
           "d2h_MiB", "hit_losses", "checked", "outputs_exact", "integrity", "wall_s"]
REPLICA_COLUMNS = ["vs_one", "spread", "routed"]      # with --replicas: after "over_ends"


@dataclass
class Arrival:
    """Windows of ``window_s`` trace seconds, or (``time_scale`` set) the recorded times."""
    window_s: float | None = 2.0
    time_scale: float | None = None

    def describe(self) -> str:
        if self.time_scale is not None:
            return f"at the recorded times x {self.time_scale:g}"
        return f"in {self.window_s:g}-second windows, each after the previous finished"


@dataclass
class Served:
    """One request's outcome, whoever served it (None: not reported)."""
    line: int
    prompt: int
    cached: int | None = None
    computed: int | None = None
    replay: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    error: str | None = None
    tokens: list[int] | None = field(default=None, repr=False)


# ---- replay on an engine ---------------------------------------------------------------------

def _served(r: TraceRequest, out) -> Served:
    u = out.usage
    return Served(r.line, u.prompt_tokens or len(r.prompt), u.cached_tokens, u.prefill_tokens + u.replay_tokens,
                  u.replay_tokens, out.timings.ttft_s, out.timings.e2e_s,
                  None if out.error is None else f"{out.error.get('type')}: {out.error.get('message')}",
                  list(out.token_ids))


def replay_engine(eng, reqs: list[TraceRequest], arrival: Arrival, timeout: float, progress) -> list[Served]:
    """Every request through ``eng.generate`` (greedy, ignore_eos), by ``arrival``."""
    done: dict[int, Served] = {}

    def submit(r: TraceRequest):
        return r, eng.generate(r.prompt, max_tokens=r.max_tokens, ignore_eos=True)

    def finish(r: TraceRequest, h, wait: float | None = timeout) -> bool:
        try:
            done[r.line] = _served(r, h.result(wait))
        except TimeoutError:
            if wait:
                raise
            return False
        progress.update()
        return True
    if arrival.time_scale is None:
        for group in windows(reqs, arrival.window_s):
            for r, h in [submit(r) for r in group]:
                finish(r, h)
    else:
        t0, live = time.perf_counter(), deque()
        for r in reqs:
            due = t0 + r.arrival_s * arrival.time_scale
            while (now := time.perf_counter()) < due:
                live = deque(x for x in live if not finish(*x, wait=0))
                time.sleep(min(due - now, 0.005))
            live.append(submit(r))
        for r, h in live:
            finish(r, h)
    return [done[r.line] for r in reqs]


def engine_config(lanes: int, chunk: int, max_context: int, capacity, state_slots: int | None) -> dict:
    pages, mib = capacity if capacity != AMPLE else (None, AMPLE_HOST_MIB)
    cache = {"host_capacity_bytes": mib << 20}
    if state_slots is not None:
        cache["device_state_slots"] = state_slots
    return {"max_concurrency": lanes, "max_context": max_context, "prefill_chunk_tokens": chunk,
            "kv_capacity": None if pages is None else pages * 64, "context_cache": cache}


def run_engine(model_dir: str, reqs, arrival: Arrival, transport: str, cfg: dict, dtype: str, timeout: float,
               desc: str, replicas: int = 1, routing: str | None = None) -> tuple[list[Served], dict, str, float]:
    """One replay on a fresh engine (``replicas`` > 1: that many over Ray, routed by ``routing``):
    outcomes, ``stats()``, the integrity verdict after ``drop_caches()`` ("ok" or the error),
    wall seconds."""
    from ninfer.api import Engine
    from ninfer.progress import bar
    extra = {} if replicas == 1 else {"replicas": replicas, "router": routing}
    eng = Engine.start(model_dir, config=cfg, dtype=dtype, transport=transport, **extra)
    try:
        t0 = time.perf_counter()
        with bar(total=len(reqs), desc=desc, unit="req") as progress:
            served = replay_engine(eng, reqs, arrival, timeout, progress)
        wall = time.perf_counter() - t0
        stats = eng.stats()
        try:
            eng.drop_caches()
            eng.check_integrity()
            integrity = "ok"
        except Exception as exc:                       # noqa: BLE001 — reported as the run's verdict
            integrity = f"{type(exc).__name__}: {exc}"
    finally:
        eng.shutdown()
    return served, stats, integrity, wall


# ---- replay over HTTP ------------------------------------------------------------------------

def replay_http(base_url: str, model: str, reqs: list[TraceRequest], arrival: Arrival, api_key: str | None,
                timeout: float) -> tuple[list[Served], float]:
    """Every request as a streaming ``/completions`` with a token-id prompt (greedy, ignore_eos,
    ``logprobs: 0`` so a token whose text is held back still marks the first token)."""
    import asyncio
    return asyncio.run(_http(base_url.rstrip("/"), model, reqs, arrival, api_key, timeout))


async def _http(url, model, reqs, arrival: Arrival, api_key, timeout) -> tuple[list[Served], float]:
    import asyncio

    import httpx

    from ninfer.benchmarks.http_load import Progress, Record, auth_headers, stream_chat
    progress = Progress(len(reqs))
    width = max(len(g) for g in windows(reqs, arrival.window_s)) if arrival.time_scale is None else len(reqs)
    limits = httpx.Limits(max_connections=min(width, 512), max_keepalive_connections=min(width, 512))

    async def one(r: TraceRequest) -> Served:
        body = {"model": model, "prompt": r.prompt, "max_tokens": r.max_tokens, "temperature": 0.0,
                "ignore_eos": True, "logprobs": 0, "stream": True, "stream_options": {"include_usage": True}}
        rec = Record(r.line, 0)
        await stream_chat(http, body, rec, t_run, path="/completions")
        progress.update(rec)
        prompt = rec.prompt_tokens or len(r.prompt)
        return Served(r.line, prompt, rec.cached_tokens, None if rec.cached_tokens is None else prompt - rec.cached_tokens,
                      0, rec.ttft_s, rec.e2e_s, rec.error)
    async with httpx.AsyncClient(base_url=url, headers=auth_headers(api_key), limits=limits,
                                 timeout=httpx.Timeout(timeout, connect=30)) as http:
        t_run = time.perf_counter()
        if arrival.time_scale is None:
            served = []
            for group in windows(reqs, arrival.window_s):
                served += await asyncio.gather(*(one(r) for r in group))
        else:
            tasks = []
            for r in reqs:
                await asyncio.sleep(max(0.0, t_run + r.arrival_s * arrival.time_scale - time.perf_counter()))
                tasks.append(asyncio.create_task(one(r)))
            served = list(await asyncio.gather(*tasks))
        wall = time.perf_counter() - t_run
    progress.close()
    return served, wall


# ---- the report --------------------------------------------------------------------------------

def summarise(name: str, served: list[Served], fl: Floors, stats: dict | None, wall: float) -> dict:
    from ninfer.benchmarks.serve import ms, pct
    prompt = sum(s.prompt for s in served)
    known = all(s.computed is not None for s in served)
    cached = sum(s.cached or 0 for s in served) if known else None
    computed = sum(s.computed for s in served) if known else None
    ttft = [s.ttft_s for s in served if s.error is None and s.ttft_s is not None]
    e2e = [s.e2e_s for s in served if s.error is None and s.e2e_s is not None]
    row = {"run": name, "requests": len(served), "errors": sum(s.error is not None for s in served),
           "prompt": prompt, "cached": cached, "computed": computed,
           "replay": sum(s.replay for s in served), "ideal": fl.ideal_total, "ends": fl.ends_total,
           "over_ideal": None if computed is None else round(computed / max(1, fl.ideal_total), 4),
           "over_ends": None if computed is None else round(computed / max(1, fl.ends_total), 4),
           "hit": None if cached is None else round(cached / max(1, prompt), 4),
           "ideal_hit": round(1 - fl.ideal_total / max(1, prompt), 4), "wall_s": round(wall, 1)}
    for q in (50, 90, 99):
        row[f"ttft_p{q}_ms"] = ms(pct(ttft, q))
        row[f"e2e_p{q}_ms"] = ms(pct(e2e, q))
    if stats is not None:
        c = stats["cache"]
        row.update(pauses=stats["pauses"]["snapshot"] + stats["pauses"]["replay"], pauses_by_route=stats["pauses"],
                   preemptions=stats["preemptions"], h2d_MiB=round(stats["bytes_h2d"] / 2**20, 1),
                   d2h_MiB=round(stats["bytes_d2h"] / 2**20, 1), bytes_h2d=stats["bytes_h2d"],
                   bytes_d2h=stats["bytes_d2h"], hit_losses=c["hit_losses"], hit_loss_tokens=c["hit_loss_tokens"],
                   hit_losses_by_cause=c["hit_losses_by_cause"], hits=c["hits"],
                   queries=c["queries"], pending_waits=c["pending_waits"], captures=c["captures"],
                   capacity_errors=stats["capacity_errors"], stalls=stats["stalls"], cycles=stats["cycles"],
                   revocations=stats["revocations"], take_backs=stats["take_backs"], wide_quotes=stats["wide_quotes"],
                   copy_failures=stats["copy_failures"])
    return row


def sample(n: int, k: int) -> list[int]:
    """``k`` indices spread evenly over ``range(n)`` (first and last included)."""
    if k <= 0 or n == 0:
        return []
    if k >= n:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)}) if k > 1 else [0]


def check(model_dir: str, reqs: list[TraceRequest], served: list[Served], idx: list[int], dtype: str,
          refs: dict) -> list[int]:
    """The lines among ``idx`` whose outputs differ from ``reference_generate`` (``refs``
    keeps the references across runs)."""
    from ninfer.reference import reference_generate
    bad = []
    for i in idx:
        r, s = reqs[i], served[i]
        if r.line not in refs:
            refs[r.line] = reference_generate(model_dir, r.prompt, max_tokens=r.max_tokens, dtype=dtype, ignore_eos=True)
        if s.error is not None or s.tokens != refs[r.line]:
            bad.append(r.line)
    return bad


def run(trace_file: str, model_dir: str = "models/tiny", out: str | None = None, plot: str | None = None,
        fmt: str = "auto", block_tokens: int = 16, limit: int | None = 600, offset: int = 0,
        window_s: float | None = 2.0, time_scale: float | None = None, transports=("inproc",),
        base_url: str | None = None, served_model: str | None = None, api_key: str | None = None,
        capacities=(AMPLE,), lanes: int = 4, chunk: int = 2048, max_context: int | None = None,
        state_slots: int | None = None, check_n: int = 4, dtype: str = "float32", seed: int = 0,
        timeout: float = 600.0, save: str | None = None, last_block: str = "drop", replicas: int = 1,
        routings=("exact",)) -> dict:
    """Load and convert the trace, compute its floors, replay it once per (transport, capacity)
    or once against ``base_url``; the table, the JSON (with the floors and every request's
    numbers per run, as columns, when ``out`` is given) and the plot."""
    import json
    from pathlib import Path

    from ninfer.benchmarks.common import ensure_model, report
    from ninfer.progress import note
    model_dir = ensure_model(model_dir)
    if max_context is None:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        max_context = cfg.get("max_position_embeddings") or (cfg.get("text_config") or {})["max_position_embeddings"]
    if base_url is None:
        _check_capacities(capacities, max_context, lanes)
    arrival = Arrival(window_s, time_scale)
    fmt, reqs = load(trace_file, ordinary_vocab(model_dir), fmt, block_tokens, offset, limit, max_context, seed,
                     last_block, model_vocab(model_dir))
    if save:
        save_tokens(reqs, save)
    fl = floors([r.prompt for r in reqs])
    info = _describe(str(trace_file), fmt, reqs, fl, arrival, block_tokens, last_block, offset, max_context)
    note(f"bench trace: {len(reqs)} requests of {trace_file} ({fmt}, {info['source']} -> {block_tokens}), "
         f"{info['prompt_tokens']:,} prompt tokens, ideal floor {fl.ideal_total:,}, prompt-ends floor "
         f"{fl.ends_total:,}; {arrival.describe()}")
    if base_url is not None:
        from ninfer.benchmarks.http_load import first_model
        model = served_model or first_model(base_url.rstrip("/"), api_key)
        served, wall = replay_http(base_url, model, reqs, arrival, api_key, timeout)
        rows = [summarise(f"http {model}", served, fl, None, wall)]
        series = {rows[0]["run"]: served}
    else:
        runs = [(t, c, 1, None) for t in transports for c in capacities]
        if replicas > 1:
            runs += [("ray", c, replicas, routing) for c in capacities for routing in routings]
        rows, series = engine_runs(model_dir, reqs, fl, arrival, runs, lanes, chunk, max_context, state_slots,
                                   check_n, dtype, timeout)
    result = {"trace": info,
              "config": {"transports": list(transports) if base_url is None else [], "base_url": base_url,
                         "capacities": [c if c == AMPLE else list(c) for c in capacities],
                         "ample": {"kv_pages": "C full contexts (the layout's most)", "host_MiB": AMPLE_HOST_MIB},
                         "lanes": lanes, "prefill_chunk_tokens": chunk, "state_slots": state_slots, "check": check_n,
                         "dtype": dtype, "seed": seed, "limit": limit, "window_s": window_s, "time_scale": time_scale,
                         "replicas": replicas, "routings": [router_label(r) for r in routings] if replicas > 1 else []}}
    every = {"floors": {"line": [r.line for r in reqs], "prompt": [len(r.prompt) for r in reqs], "ideal": fl.ideal,
                        "ends": fl.ends},
             "requests": {name: _columns(ss) for name, ss in series.items()}}
    if out:
        result.update(every)
    columns = COLUMNS
    if replicas > 1:
        at = COLUMNS.index("over_ends") + 1
        columns = COLUMNS[:at] + REPLICA_COLUMNS + COLUMNS[at:]
    return report("trace", result, rows, columns, out, plot, plot_only=every)


def _check_capacities(capacities, max_context: int, lanes: int) -> None:
    """Every Main-KV budget within the layout's curve, before any run starts."""
    from ninfer.config import kv_page_bounds
    from ninfer.errors import ConfigError
    lo, hi = kv_page_bounds(max_context, lanes)
    bad = [c for c in capacities if c != AMPLE and not lo <= c[0] <= hi]
    if bad:
        raise ConfigError(f"--capacity pages must be {lo}..{hi} for max_context {max_context} and {lanes} lanes "
                          f"(one full context .. one per lane), not {bad[0][0]}")


def _describe(path: str, fmt: str, reqs: list[TraceRequest], fl: Floors, arrival: Arrival, block_tokens: int,
              last_block: str, offset: int, max_context: int) -> dict:
    """The replayed slice and its floors (the JSON's ``trace``)."""
    return {"file": path, "format": fmt, "source": "tokens" if fmt == "tokens" else f"{SOURCE[fmt][0]}-token blocks",
            "block_tokens": block_tokens, "last_block": None if fmt == "tokens" else last_block,
            "offset": offset, "requests": len(reqs), "prompt_tokens": sum(len(r.prompt) for r in reqs),
            "output_tokens": sum(r.max_tokens for r in reqs), "ideal_floor": fl.ideal_total,
            "ends_floor": fl.ends_total, "repeats": fl.repeats, "max_context": max_context,
            "truncated": sum(r.dropped > 0 for r in reqs), "dropped_tokens": sum(r.dropped for r in reqs),
            "arrival": arrival.describe(),
            "windows": len(windows(reqs, arrival.window_s)) if arrival.time_scale is None else None}


def engine_runs(model_dir: str, reqs: list[TraceRequest], fl: Floors, arrival: Arrival, runs, lanes: int, chunk: int,
                max_context: int, state_slots: int | None, check_n: int, dtype: str,
                timeout: float) -> tuple[list[dict], dict]:
    """One fresh engine per (transport, capacity) of ``runs``: its row (outputs of ``check_n``
    requests compared with the reference, the integrity verdict) and its requests."""
    from ninfer.native.threads import pin as pin_threads
    pin_threads(1)         # the oracle on this thread: one, as the engine's own
    refs: dict = {}
    idx = sample(len(reqs), check_n)
    rows, series = [], {}
    one: dict = {}                                  # capacity -> computed by the first one-engine run
    for transport, cap, replicas, routing in runs:
        size = AMPLE if cap == AMPLE else f"{cap[0]}:{cap[1]}"
        name = f"{transport} {size}" if replicas == 1 else f"{transport} x{replicas} {router_label(routing)} {size}"
        cfg = engine_config(lanes, chunk, max_context, cap, state_slots)
        served, stats, integrity, wall = run_engine(model_dir, reqs, arrival, transport, cfg, dtype, timeout, name,
                                                    replicas, routing)
        bad = check(model_dir, reqs, served, idx, dtype, refs)
        row = {"transport": transport, **summarise(name, served, fl, stats, wall),
               "kv_pages": stats["occupancy"].get("main", {}).get("total") // replicas,
               "host_MiB": cfg["context_cache"]["host_capacity_bytes"] >> 20, "checked": len(idx),
               "outputs_exact": not bad, "mismatched_lines": bad, "integrity": integrity,
               "replicas": replicas, "routing": None if routing is None else router_label(routing)}
        if replicas == 1:
            one.setdefault(size, row["computed"])
        elif stats.get("router"):
            row.update(_routing_columns(stats))
        if one.get(size) and row["computed"] is not None:
            row["vs_one"] = round(row["computed"] / one[size], 4)
        rows.append(row)
        series[name] = served
    return rows, series


def _routing_columns(stats: dict) -> dict:
    """How a replicated run spread its requests (finished per replica) and why (routed by reason)."""
    r = stats["router"]
    per = sorted(stats.get("replicas", []), key=lambda x: x["slot"])
    reasons = {k: v for k, v in r["routed_by_reason"].items() if v}
    return {"spread": "/".join(str(x.get("finished", 0)) for x in per),
            "routed": ",".join(f"{k}:{v}" for k, v in reasons.items()),
            "routed_by_reason": r["routed_by_reason"], "route_us_mean": round(1e6 * r["route_s"] / max(1, r["decisions"]), 1),
            "route_us_max": round(1e6 * r["route_max_s"], 1),
            "replica_prefill": [x.get("prefill_tokens") for x in per]}


def _columns(served: list[Served]) -> dict:
    """Every request of a run, one list per field in the order of ``floors`` (columns keep the
    JSON small); ``errors``: [line, message] of the failed ones."""
    from ninfer.benchmarks.serve import ms
    return {"cached": [s.cached for s in served], "computed": [s.computed for s in served],
            "ttft_ms": [ms(s.ttft_s) for s in served], "e2e_ms": [ms(s.e2e_s) for s in served],
            "errors": [[s.line, s.error] for s in served if s.error is not None]}


def failed(data: dict) -> list[str]:
    """Why a finished run should exit 1: errors, outputs that differ, a failed integrity check."""
    why = []
    for row in data["rows"]:
        if row["errors"]:
            why.append(f"{row['run']}: {row['errors']} requests failed")
        if row.get("outputs_exact") is False:
            why.append(f"{row['run']}: outputs differ from reference_generate on lines {row['mismatched_lines']}")
        if row.get("integrity", "ok") != "ok":
            why.append(f"{row['run']}: {row['integrity']}")
    for w in why:
        print(w, file=sys.stderr)
    return why
