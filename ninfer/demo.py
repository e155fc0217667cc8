"""``ninfer demo``: the main job on the built-in tiny model, through the real Ray actors.

Three agent sessions share a system prompt with tools. Each session asks, gets an answer,
sends a tool call with its result (the client normalises the call, as agent frameworks do),
and follows up. The engine is deliberately small (two lanes, a few KV pages), so younger
requests are paused and resumed while older ones finish — and every output is checked against
the isolated oracle. The tiny model's weights are random, so its words are noise; what the
demo shows is the path and the numbers: cache reuse, pauses, TTFT. The report goes to stdout,
its steps to stderr (``ninfer.progress.note``; NINFER_PROGRESS=0 hides them).
"""

from __future__ import annotations

import time
from pathlib import Path

from ninfer.api import Engine
from ninfer.native.threads import pin as pin_threads
from ninfer.progress import note
from ninfer.reference import reference_generate

SYSTEM = ("You are a travel assistant for a small agency. Answer briefly, prefer facts from tools, "
          "and never invent prices. Use the weather tool for any question about packing.")
TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]
CITIES = ["Paris", "Lyon", "Oslo"]
DEMO_CONFIG = {"max_concurrency": 2, "max_context": 768, "kv_capacity": 12 * 64, "prefill_chunk_tokens": 96,
               "context_cache": {"device_state_slots": 2, "host_capacity_bytes": 8 << 20}}


def ensure_model(model_dir: str | Path) -> Path:
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        from ninfer.tiny.build import make_tiny_model

        print(f"building the tiny model in {path} ...")
        make_tiny_model(path)
    return path


def _turns(city: str) -> list[list[dict]]:
    """Messages each turn appends before generating (the answer is appended by the loop)."""
    call = {"role": "assistant", "content": None, "tool_calls": [{
        "type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}]}
    return [
        [{"role": "user", "content": f"What should I pack for {city} tomorrow?"}],
        [call, {"role": "tool", "content": '{"temp_c": 14, "sky": "rain"}'}],
        [{"role": "user", "content": "And the day after?"}],
    ]


def run_demo(model_dir: str | Path = "models/tiny", dtype: str = "float32", transport: str = "ray",
             max_tokens: int = 40) -> int:
    pin_threads(1)
    path = ensure_model(model_dir)
    print(f"starting the engine on {path} ({dtype}, transport={transport}) ...")
    t0 = time.perf_counter()
    engine = Engine.start(path, config=DEMO_CONFIG, dtype=dtype, transport=transport, deployment="ninfer-demo")
    print(f"  ready in {time.perf_counter() - t0:.1f} s: C={engine.info.max_concurrency}, "
          f"{engine.info.kv_pages} KV pages, {engine.info.state_slots} state slots\n")
    rows, mismatches = [], 0
    try:
        history = {c: [{"role": "system", "content": SYSTEM}] for c in CITIES}
        for turn in range(3):
            note(f"demo: turn {turn + 1}/3, {len(CITIES)} sessions generating together ...")
            handles = {}
            for i, city in enumerate(CITIES):          # the sessions' turns run concurrently
                history[city].extend(_turns(city)[turn])
                handles[city] = engine.chat(history[city], tools=TOOLS, max_tokens=max_tokens,
                                            temperature=0.8, seed=10 * i + turn, session_id=city,
                                            ignore_eos=True)
            for i, city in enumerate(CITIES):
                out = handles[city].result(600)
                if i == 0:
                    note(f"demo: turn {turn + 1}/3, comparing each reply with an isolated, uncached oracle run ...")
                # the engine computes the model's own earlier answers with the exact tokens it
                # produced; the oracle runs that same prompt alone, uncached
                prompt = out.prompt_token_ids
                ref = reference_generate(path, prompt, max_tokens=max_tokens, temperature=0.8,
                                         seed=10 * i + turn, dtype=dtype, ignore_eos=True)
                mismatches += out.token_ids != ref
                history[city].append({"role": "assistant", "content": out.text})
                rows.append((city, turn + 1, out))
        _print_table(rows)
        _print_stats(engine.stats(), mismatches, len(rows))
        note("demo: dropping the caches and checking that nothing is left held ...")
        engine.drop_caches()
        engine.check_integrity()
        print("\nleak check after drop_caches: clean")
    finally:
        engine.shutdown()
    return 1 if mismatches else 0


def _print_table(rows) -> None:
    head = f"{'session':<8} {'turn':>4} {'prompt':>6} {'cached':>6} {'prefill':>7} {'replay':>6} " \
           f"{'pauses':>6} {'ttft_ms':>8} {'e2e_ms':>8}"
    print(head)
    print("-" * len(head))
    for city, turn, out in rows:
        u, t = out.usage, out.timings
        pauses = ",".join(p["route"][0] for p in out.pauses) or "-"
        print(f"{city:<8} {turn:>4} {u.prompt_tokens:>6} {u.cached_tokens:>6} {u.prefill_tokens:>7} "
              f"{u.replay_tokens:>6} {pauses:>6} {1000 * (t.ttft_s or 0):>8.0f} {1000 * (t.e2e_s or 0):>8.0f}")
    print("pauses: s = resumed by Snapshot, r = resumed by Replay")


def _print_stats(s: dict, mismatches: int, total: int) -> None:
    c = s["cache"]
    print(f"\ncache: {c['hits']}/{c['queries']} admissions reused a checkpoint, {c['reused_tokens']} of "
          f"{c['queried_tokens']} prompt tokens served from cache; {c['hit_losses']} hits lost to a missing "
          f"checkpoint; {c['captures']} saves, {c['captures_skipped']} skipped")
    print(f"work:  {s['prefill_tokens']} tokens prefilled, {s['replay_tokens']} replayed; "
          f"{s['bytes_d2h'] >> 10} KiB to Host, {s['bytes_h2d'] >> 10} KiB back")
    print(f"pressure: {s['preemptions']} pauses (resumed: {s['pauses']['snapshot']} by Snapshot, "
          f"{s['pauses']['replay']} by Replay), {s['capacity_errors']} capacity errors; "
          f"{s['round_trips'] / max(1, s['cycles']):.2f} controller-worker round trips per cycle")
    verdict = "all identical" if not mismatches else f"{mismatches} DIFFER"
    print(f"oracle: {total} outputs compared with isolated, uncached runs — {verdict}")
