"""``ninfer bench serve``: a streaming chat load against any OpenAI-compatible server (ours,
vLLM, SGLang), reported per round.

``clients`` simulated chat users run at once; each sends ``rounds`` streaming chat completions,
one after another, every round's prompt carrying the earlier rounds' replies (see
``chat_workload``), so rounds after the first exercise prefix reuse. Per round and in total:
requests, errors, TTFT p50/p95/p99, end-to-end p50/p95, the longest inter-delta gap, output
tokens per second (the round's tokens over the span from its first start to its last end; in
total over the run's wall time) and mean cached prompt tokens as the server reports them.

Without ``base_url`` the bench starts ``ninfer serve --transport inproc`` on the built-in tiny
model on a free loopback port (the engine config below) and stops it at the end.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ninfer.benchmarks.chat_workload import conversations
from ninfer.benchmarks.http_load import Record, ServerError, first_model, run_load

# The built-in server: every lane the engine allows, a context that fits 4+ rounds of the mix
# or --prompt-words turns of a few hundred words, and a Host tier that keeps every client's
# history cached between its rounds.
LOCAL_CONFIG = """max_concurrency = 8
max_context = 4096
kv_capacity = 32768
dtype = "float32"
prefill_chunk_tokens = 256

[context_cache]
device_state_slots = 16
host_capacity_bytes = 268435456
"""
COLUMNS = ["round", "requests", "errors", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p90_ms",
           "itl_p50_ms", "itl_p90_ms", "itl_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "max_gap_ms", "out_tok_s",
           "prompt_mean", "cached_mean"]


class LocalServer:
    """``ninfer serve`` on the tiny model in a child process, for ``with``: yields the base URL."""

    def __init__(self, model_dir: str, name: str = "tiny", transport: str = "inproc", replicas: int = 1,
                 routing: str | None = None):
        self.model_dir, self.name, self.transport = model_dir, name, transport
        self.replicas = ["--replicas", str(replicas), "--routing", routing or "exact"] if replicas > 1 else []
        self.tmp = tempfile.TemporaryDirectory(prefix="ninfer-bench-serve-")
        self.log = Path(self.tmp.name) / "server.log"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> str:
        import httpx
        cfg = Path(self.tmp.name) / "engine.toml"
        cfg.write_text(LOCAL_CONFIG)
        port = _free_port()
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "ninfer.cli", "serve", "--model", self.model_dir,
                                          "--config", str(cfg), "--port", str(port), "--transport", self.transport,
                                          "--deployment", f"bench-serve-{port}",
                                          "--served-model-name", self.name, *self.replicas],
                                         stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"ninfer serve exited with {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    return f"{base}/v1"
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.__exit__()
        raise ServerError("ninfer serve did not come up within 300 s")

    def tail(self, n: int = 5) -> str:
        return " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-n:])

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.tmp.cleanup()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(xs: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default)."""
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    i = int(k)
    return xs[i] + (xs[min(i + 1, len(xs) - 1)] - xs[i]) * (k - i)


def ms(v: float | None, digits: int = 1) -> float | None:
    return None if v is None else round(1e3 * v, digits)


def summarise(name, recs: list[Record], span_s: float | None = None) -> dict:
    """One table row; ``span_s`` defaults to the first start to the last end of ``recs``."""
    ok = [r for r in recs if r.error is None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    itl = [g for r in ok for g in r.gaps]
    if span_s is None and recs:
        span_s = max(r.start_s + (r.e2e_s or 0) for r in recs) - min(r.start_s for r in recs)
    tokens = sum(r.output_tokens for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    prompt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    return {"round": name, "requests": len(recs), "errors": len(recs) - len(ok),
            "ttft_p50_ms": ms(pct(ttft, 50)), "ttft_p90_ms": ms(pct(ttft, 90)), "ttft_p95_ms": ms(pct(ttft, 95)),
            "ttft_p99_ms": ms(pct(ttft, 99)),
            "tpot_p50_ms": ms(pct(tpot, 50), 2), "tpot_p90_ms": ms(pct(tpot, 90), 2), "tpot_p99_ms": ms(pct(tpot, 99), 2),
            "itl_p50_ms": ms(pct(itl, 50), 2), "itl_p90_ms": ms(pct(itl, 90), 2), "itl_p99_ms": ms(pct(itl, 99), 2),
            "e2e_p50_ms": ms(pct(e2e, 50)), "e2e_p90_ms": ms(pct(e2e, 90)), "e2e_p95_ms": ms(pct(e2e, 95)),
            "e2e_p99_ms": ms(pct(e2e, 99)),
            "max_gap_ms": ms(max((r.max_gap_s for r in ok if r.max_gap_s is not None), default=None)),
            "out_tok_s": round(tokens / span_s, 1) if span_s else None, "output_tokens": tokens,
            "prompt_mean": round(sum(prompt) / len(prompt), 1) if prompt else None,
            "cached_mean": round(sum(cached) / len(cached), 1) if cached else None,
            "finished": sum(r.finish_reason is not None for r in recs)}


# --structured json: every reply follows this schema (bounded, so a small model's answer ends)
BENCH_SCHEMA = {"type": "object", "properties": {
    "answer": {"type": "string", "maxLength": 64},
    "confidence": {"type": "number"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
    "required": ["answer", "confidence", "tags"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "bench", "schema": BENCH_SCHEMA}}


def run(base_url: str | None = None, model: str | None = None, api_key: str | None = None, clients: int = 64,
        rounds: int = 4, max_tokens: int = 32, prompt_words: int | None = None, temperature: float = 0.0,
        ignore_eos: bool = False, timeout: float = 120.0, model_dir: str = "models/tiny", out: str | None = None,
        plot: str | None = None, request_rate: float | None = None, transport: str = "inproc",
        structured: str = "none", replicas: int = 1, routing: str = "exact") -> dict:
    """Run the load, print the table (and the JSON unless ``out``), write ``out`` / ``plot``.

    ``structured``: "none"; "json" (every request carries ``RESPONSE_FORMAT``); "both" (the same
    load unconstrained, then constrained, one after the other on the same server: the rows of
    each, and the grammar's cost per constrained token from the server's /metrics when it is
    NInfer's). ``replicas`` > 1: the built-in server runs that many engines over Ray behind its
    router (``routing``)."""
    from contextlib import nullcontext

    from ninfer.benchmarks.common import ensure_model
    local = base_url is None
    runs = {"none": [""], "json": ["json"], "both": ["", "json"]}[structured]
    loads = []
    if replicas > 1:
        transport = "ray"
    with LocalServer(ensure_model(model_dir), transport=transport, replicas=replicas, routing=routing) if local \
            else nullcontext(base_url) as url:
        model = model or first_model(url, api_key)
        sampling = {"max_tokens": max_tokens, "temperature": temperature} | ({"ignore_eos": True} if ignore_eos else {})
        workload = f"--prompt-words {prompt_words}" if prompt_words else "built-in chat mix"
        for kind in runs:
            print(f"bench serve: {clients} clients x {rounds} rounds, max_tokens {max_tokens}, {workload}, "
                  f"{'json_schema responses, ' if kind else ''}model {model} at {url}", file=sys.stderr)
            before = grammar_counters(url, api_key) if kind else None
            extra = {"response_format": RESPONSE_FORMAT} if kind else {}
            records, wall = run_load(url, model, conversations(clients, rounds, prompt_words), rounds,
                                     sampling | extra, api_key, timeout, request_rate)
            cost = grammar_cost(before, grammar_counters(url, api_key), records) if kind else None
            loads.append((kind, records, wall, cost))
    config = {"clients": clients, "rounds": rounds, "max_tokens": max_tokens, "prompt_words": prompt_words,
              "temperature": temperature, "ignore_eos": ignore_eos, "timeout_s": timeout, "base_url": url,
              "model": model, "request_rate": request_rate, "structured": structured,
              "server": f"built in: ninfer serve --transport {transport}"
                        + (f" --replicas {replicas} --routing {routing}" if replicas > 1 else "") + ", tiny model"
                        if local else "external"}
    if local:
        config["engine_config"] = LOCAL_CONFIG
    return _report(loads, config, out, plot)


def grammar_counters(url: str, api_key: str | None) -> dict | None:
    """NInfer's ``ninfer_structured_*`` counters from the server's /metrics (None elsewhere)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    base = url[:-3] if url.endswith("/v1") else url
    try:
        text = httpx.get(f"{base}/metrics", timeout=10,
                         headers={"authorization": f"Bearer {api_key}"} if api_key else {}).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for smp in fam.samples:
                if smp.name in ("ninfer_structured_masks_total", "ninfer_structured_mask_seconds_total"):
                    out[smp.name] = smp.value
        return out
    except Exception:                      # not NInfer, or no /metrics: no grammar cost to report
        return None


def grammar_cost(before: dict | None, after: dict | None, records: list[Record]) -> dict | None:
    if after is None or "ninfer_structured_masks_total" not in after:
        return None
    before = before or {}
    masks = after["ninfer_structured_masks_total"] - before.get("ninfer_structured_masks_total", 0)
    secs = after["ninfer_structured_mask_seconds_total"] - before.get("ninfer_structured_mask_seconds_total", 0)
    tokens = sum(r.output_tokens for r in records if r.error is None)
    return {"masks": int(masks), "mask_s": round(secs, 4), "output_tokens": tokens,
            "mask_us_per_mask": round(1e6 * secs / masks, 1) if masks else None,
            "mask_us_per_token": round(1e6 * secs / tokens, 1) if tokens else None}


def _report(loads: list, config: dict, out, plot) -> dict:
    from ninfer.benchmarks.common import report
    rounds = config["rounds"]
    rows, records, wall, both = [], [], 0.0, len(loads) > 1
    for kind, recs, w, cost in loads:
        tag = f"{kind or 'plain'} " if both else ""
        rows += [summarise(f"{tag}{r}" if both else r, [x for x in recs if x.round == r]) for r in range(rounds)]
        row = summarise(f"{tag}total", recs, w)
        if cost is not None:
            row["mask_us_per_token"] = cost["mask_us_per_token"]
        rows.append(row)
        records, wall = records + recs, wall + w
    total = summarise("total", records, wall) if both else rows.pop()
    errors = [x.public() for x in records if x.error is not None]
    result = {"config": config, "wall_s": round(wall, 2),
              "errors": total["errors"], "unfinished": total["requests"] - total["finished"],
              "error_samples": errors[:20]}
    grammar = [cost for kind, _, _, cost in loads if kind]
    if grammar:
        result["grammar"] = grammar[0]          # mask time per constrained token (NInfer's /metrics)
    every = {"requests": [x.public() for x in records]}
    if out:                                       # every request's record only in the file
        result.update(every)
    columns = COLUMNS + (["mask_us_per_token"] if grammar else [])
    data = report("serve", result, rows + [total], columns, out, plot, plot_only=every)
    if errors:
        print(f"{len(errors)} of {len(records)} requests failed; first: {errors[0]['error']}", file=sys.stderr)
    return data
