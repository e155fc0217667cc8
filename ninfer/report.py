"""``ninfer report FILE``: the seed's evaluation order over a JSON-lines log or a bench JSON
(seed: 先检查是否失去应有的完整恢复点，再看严重退化和流中停顿，最后分析单个场景的复制、重算、CPU
调度和协议准备成本。完整命中也可能需要大量 H2D；低 TTFT 也可能伴随长时间暂停后的输出空窗。两者分别报告).

    1. lost restore points     a due restore point that was missing, with its cause
    2. degradation and stalls  failures, the longest output gap, paused time, and — reported
                               apart — low TTFT followed by a long output gap
    3. costs per scenario      bytes H2D / D2H, initial prefill vs Replay tokens, controller
                               time and protocol bytes where logged
    4. the per-request table   (or the bench rows)

Verdict lines come first, the table after. A log is what ``NINFER_LOG_FORMAT=json`` writes: the
``request`` and ``engine`` records (``ninfer.logs``); any other line, or a prefix before the JSON
object (Ray's ``(EngineControllerActor pid=…)``), is skipped. A bench JSON is a document with
``rows`` (and ``trace``), each row one scenario.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from statistics import median

STALL_S = 1.0          # an output gap at least this long is a stall


# ---- reading -------------------------------------------------------------------------------

def load(path: str | Path) -> tuple[str, dict]:
    """("log", {"requests": [...], "engine": [...]}) or ("bench", the document)."""
    text = Path(path).read_text()
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if isinstance(doc, dict) and ("rows" in doc or "trace" in doc or "benchmark" in doc):
        return "bench", doc
    requests: dict[str, dict] = {}
    engine: list[dict] = []
    for line in text.splitlines():
        i = line.find("{")
        if i < 0:
            continue
        try:
            obj = json.loads(line[i:])
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        if obj.get("event") == "request" and "rid" in obj:
            requests[obj["rid"]] = obj          # one summary per request (the last, if repeated)
        elif obj.get("event") == "engine":
            engine.append(obj)
    return "log", {"requests": list(requests.values()), "engine": engine}


# ---- the log ---------------------------------------------------------------------------------

def log_verdicts(data: dict, stall_s: float = STALL_S) -> list[str]:
    reqs, eng = data["requests"], data["engine"]
    out: list[str] = [f"{len(reqs)} requests, {len(eng)} engine summaries"]
    out += _lost(reqs, eng)
    out += _degradation(reqs, eng, stall_s)
    out += _costs(reqs, eng)
    return out


def _lost(reqs: list[dict], eng: list[dict]) -> list[str]:
    lost = [r for r in reqs if r.get("lost")]
    logged = sum((eng[-1].get("hit_losses_by_cause") or {}).values()) if eng else 0
    if not lost and not logged:
        return ["1. lost restore points: none (every due restore point was found)"]
    causes = Counter(r["lost"]["cause"] for r in lost)
    tokens = sum(r["lost"].get("tokens", 0) for r in lost)
    line = (f"1. LOST RESTORE POINTS: {len(lost)} requests missed a due restore point "
            f"({_counts(causes)}), {tokens} tokens recomputed")
    if lost:
        worst = max(lost, key=lambda r: r["lost"].get("tokens", 0))
        line += f"; worst {worst['rid']}: {worst['lost'].get('tokens', 0)} tokens ({worst['lost']['cause']})"
    out = [line]
    if logged > len(lost):
        out.append(f"   the engine counted {logged} lost hits in all "
                   f"({_counts(Counter(eng[-1]['hit_losses_by_cause']))})")
    return out


def _degradation(reqs: list[dict], eng: list[dict], stall_s: float) -> list[str]:
    out = []
    failed = Counter(r.get("error") or "error" for r in reqs if r.get("finish_reason") == "error")
    cancelled = sum(r.get("finish_reason") == "cancelled" for r in reqs)
    stalls = max((e.get("stalls") or 0 for e in eng), default=0)
    if failed or stalls:
        out.append(f"2. SEVERE: {sum(failed.values())} requests failed ({_counts(failed)})"
                   + (f"; the progress guard fired {stalls} times" if stalls else ""))
    else:
        out.append("2. degradation: no request failed" + (f" ({cancelled} cancelled)" if cancelled else ""))
    gaps = [r for r in reqs if r.get("max_output_gap_s")]
    if gaps:
        g = max(gaps, key=lambda r: r["max_output_gap_s"])
        over = [r for r in gaps if r["max_output_gap_s"] >= stall_s]
        tag = "STALL" if over else "stream"
        out.append(f"   {tag}: longest output gap {g['max_output_gap_s']:.3f} s ({g['rid']}); "
                   f"{len(over)} requests with a gap >= {stall_s:g} s")
    paused = [r for r in reqs if r.get("paused_s")]
    if paused:
        p = max(paused, key=lambda r: r["paused_s"])
        routes = Counter()
        for r in paused:
            routes.update(r.get("pauses") or {})
        out.append(f"   paused: {len(paused)} requests, {sum(r['paused_s'] for r in paused):.3f} s in all, longest "
                   f"{p['paused_s']:.3f} s ({p['rid']}); pauses by route: {_counts(routes)}")
    else:
        out.append("   paused: no request was paused")
    ttfts = [r["ttft_s"] for r in reqs if r.get("ttft_s") is not None]
    if ttfts:
        mid = median(ttfts)
        hidden = [r for r in reqs if r.get("ttft_s") is not None and r["ttft_s"] <= mid
                  and (r.get("max_output_gap_s") or 0) >= stall_s]
        out.append(f"   TTFT: median {mid:.3f} s, max {max(ttfts):.3f} s"
                   + (f"; low TTFT but a gap >= {stall_s:g} s later: {', '.join(r['rid'] for r in hidden)}"
                      if hidden else ""))
    return out


def _costs(reqs: list[dict], eng: list[dict]) -> list[str]:
    out = ["3. costs per scenario"]
    groups: dict[str, list[dict]] = {}
    for r in reqs:
        groups.setdefault(r.get("scenario") or "all", []).append(r)
    last = eng[-1] if eng else {}
    for name, rs in groups.items():
        pre = sum(r.get("prefill_tokens", 0) for r in rs)
        rep = sum(r.get("replay_tokens", 0) for r in rs)
        cached = sum(r.get("cached_tokens", 0) for r in rs)
        prompt = sum(r.get("prompt_tokens", 0) for r in rs)
        out.append(f"   [{name}] prompt {prompt} tokens: cached {cached}, prefill {pre}, Replay {rep}"
                   + (f" ({100 * rep / (pre + rep):.1f}% of computed prompt work is Replay)" if pre + rep else ""))
    if eng:
        h2d, d2h = last.get("bytes_h2d_total", 0), last.get("bytes_d2h_total", 0)
        ctrl = sum(e.get("controller_s") or 0 for e in eng)
        trips = sum(e.get("round_trips") or 0 for e in eng)
        proto = sum(e.get("protocol_bytes") or 0 for e in eng)
        cached = sum(r.get("cached_tokens", 0) for r in reqs)
        line = f"   copies: H2D {_bytes(h2d)}, D2H {_bytes(d2h)}"
        if cached and h2d:
            line += f" ({h2d / cached:.0f} B H2D per cached token: a full hit can still cost copies)"
        out.append(line)
        out.append(f"   controller: {1e3 * ctrl:.1f} ms outside the worker over {trips} round trips"
                   + (f" ({1e6 * ctrl / trips:.0f} us each)" if trips else "")
                   + (f"; protocol {_bytes(proto)}" if proto else ""))
    else:
        out.append("   copies, controller time, protocol bytes: not logged (no engine summaries)")
    return out


REQUEST_COLUMNS = ["rid", "finish", "prompt", "cached", "prefill", "replay", "out", "ttft_s", "e2e_s",
                   "gap_s", "paused_s", "pauses s/r", "lost"]


def request_rows(reqs: list[dict]) -> list[dict]:
    rows = []
    for r in reqs:
        p = r.get("pauses") or {}
        lost = r.get("lost")
        rows.append({"rid": r["rid"], "finish": r.get("finish_reason") + (f" ({r['error']})" if r.get("error") else ""),
                     "prompt": r.get("prompt_tokens"), "cached": r.get("cached_tokens"),
                     "prefill": r.get("prefill_tokens"), "replay": r.get("replay_tokens"),
                     "out": r.get("completion_tokens"), "ttft_s": r.get("ttft_s"), "e2e_s": r.get("e2e_s"),
                     "gap_s": r.get("max_output_gap_s"), "paused_s": r.get("paused_s"),
                     "pauses s/r": f"{p.get('snapshot', 0)}/{p.get('replay', 0)}",
                     "lost": f"{lost['cause']} ({lost.get('tokens', 0)})" if lost else ""})
    return rows


# ---- a bench JSON ----------------------------------------------------------------------------

def bench_rows(doc: dict) -> list[dict]:
    rows = []
    for part in ("trace", "rows"):
        for i, r in enumerate(doc.get(part) or []):
            if isinstance(r, dict):
                rows.append({"scenario": _label(r, part, i), **r})
    return rows


def _label(r: dict, part: str, i: int) -> str:
    keys = [k for k in ("transport", "mode", "C", "kv_pages", "host_MiB", "records") if k in r]
    return f"{part}[{i}]" + ("" if not keys else " " + ",".join(f"{k}={r[k]}" for k in keys))


def bench_verdicts(doc: dict, stall_s: float = STALL_S) -> list[str]:
    rows = bench_rows(doc)
    out = [f"bench {doc.get('benchmark', '?')}: {len(rows)} scenarios"]
    lost = [r for r in rows if r.get("hit_losses")]
    out.append("1. LOST RESTORE POINTS: " + "; ".join(f"{r['scenario']}: {r['hit_losses']} hits lost" for r in lost)
               if lost else "1. lost restore points: none reported")
    wrong = [r["scenario"] for r in rows if r.get("outputs_exact") is False]
    errs = [r for r in rows if r.get("capacity_errors") or r.get("stalls")]
    if wrong or errs:
        out.append("2. SEVERE: " + "; ".join([f"{s}: outputs differ from the reference" for s in wrong]
                                             + [f"{r['scenario']}: capacity errors {r.get('capacity_errors', 0)}, "
                                                f"stalls {r.get('stalls', 0)}" for r in errs]))
    else:
        out.append("2. degradation: outputs and progress as expected where reported")
    ttft = [r for r in rows if r.get("ttft_max_ms") is not None]
    if ttft:
        w = max(ttft, key=lambda r: r["ttft_max_ms"])
        out.append(f"   longest TTFT {w['ttft_max_ms']} ms ({w['scenario']})")
    pauses = [r for r in rows if r.get("preemptions") or r.get("pauses")]
    out.append("   pauses: " + ("; ".join(f"{r['scenario']}: {r.get('preemptions', r.get('pauses'))}" for r in pauses)
                                if pauses else "none"))
    out.append("3. costs per scenario" + ("" if any(_cost_parts(r) for r in rows) else ": none reported"))
    for r in rows:
        parts = _cost_parts(r)
        if parts:
            out.append(f"   [{r['scenario']}] " + ", ".join(parts))
    return out


def _cost_parts(r: dict) -> list[str]:
    parts = []
    if r.get("computed") is not None or r.get("prefill_computed") is not None:
        work = (f"computed {r['computed']}" if r.get("computed") is not None else f"prefill {r['prefill_computed']}")
        parts.append(work + (f" + Replay {r['replay']}" if r.get("replay") is not None else "")
                     + (f" vs floor {r['floor']} ({r.get('over_floor')}x)" if r.get("floor") is not None else ""))
    for k, name in (("bytes_h2d", "H2D"), ("bytes_d2h", "D2H")):
        if r.get(k) is not None:
            parts.append(f"{name} {_bytes(r[k])}")
    if r.get("controller_us_per_cycle") is not None:
        parts.append(f"controller {r['controller_us_per_cycle']:.0f} us/cycle")
    if r.get("plan_bytes") is not None:
        parts.append(f"protocol {r['plan_bytes']:.0f}+{r.get('reply_bytes', 0):.0f} B/cycle")
    return parts


# ---- output ----------------------------------------------------------------------------------

def render(path: str | Path, stall_s: float = STALL_S) -> str:
    kind, data = load(path)
    if kind == "bench":
        rows = bench_rows(data)
        cols = list(dict.fromkeys(k for r in rows for k in r))
        return "\n".join(bench_verdicts(data, stall_s)) + "\n\n" + table(rows, cols)
    if not data["requests"] and not data["engine"]:
        return f"{path}: no request or engine records (write the log with NINFER_LOG_FORMAT=json)"
    return "\n".join(log_verdicts(data, stall_s)) + "\n\n" + table(request_rows(data["requests"]), REQUEST_COLUMNS)


def table(rows: list[dict], columns: list[str]) -> str:
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines.append("-" * len(lines[0]))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def _counts(c: Counter) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))) or "-"


def _bytes(n: float) -> str:
    from ninfer.logs import fmt_bytes
    return fmt_bytes(n)
