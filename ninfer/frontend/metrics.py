"""Prometheus text exposition of engine statistics: vLLM-compatible names where a vLLM user
would look for them (prefix-cache queries/hits in tokens, preemptions, running/waiting), plus
NInfer's own (replay tokens, hits lost to a missing checkpoint, bytes moved, pauses by route)."""

from __future__ import annotations


def prometheus(s: dict, stored_responses: int = 0) -> str:
    c = s["cache"]
    rows = [
        ("vllm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache", c["queried_tokens"]),
        ("vllm:prefix_cache_hits_total", "counter", "Prompt tokens served from the prefix cache (real reuse)", c["reused_tokens"]),
        ("vllm:num_preemptions_total", "counter", "Requests paused to let older ones progress", s["preemptions"]),
        ("vllm:num_requests_running", "gauge", "Requests holding a lane", s["running"]),
        ("vllm:num_requests_waiting", "gauge", "Requests waiting for admission or paused", s["waiting"] + s["paused"]),
        ("ninfer_cache_queries_total", "counter", "Admissions that looked for a restore source", c["queries"]),
        ("ninfer_cache_hits_total", "counter", "Admissions that reused a checkpoint", c["hits"]),
        ("ninfer_cache_hit_losses_total", "counter", "Admissions whose deeper matching checkpoint was missing", c["hit_losses"]),
        ("ninfer_cache_hit_loss_tokens_total", "counter", "Tokens those missing checkpoints would have saved", c["hit_loss_tokens"]),
        ("ninfer_cache_summary_hits_total", "counter", "Repeat-demand evidence used (never counted as hits)", c["summary_hits"]),
        ("ninfer_cache_pending_waits_total", "counter", "Fresh requests that waited for another's pending save",
         c.get("pending_waits", 0)),
        ("ninfer_cache_pending_saved_tokens_total", "counter", "Prompt tokens not computed because a request waited",
         c.get("pending_saved_tokens", 0)),
        ("ninfer_cache_pending_wait_seconds_total", "counter", "Time fresh requests spent waiting for a pending save",
         c.get("pending_wait_s", 0.0)),
        ("ninfer_prefill_tokens_total", "counter", "Prompt tokens computed by initial prefill", s["prefill_tokens"]),
        ("ninfer_replay_tokens_total", "counter", "Tokens recomputed by Replay after a pause", s["replay_tokens"]),
        ("ninfer_bytes_h2d_total", "counter", "Bytes copied Host to Device", s["bytes_h2d"]),
        ("ninfer_bytes_d2h_total", "counter", "Bytes copied Device to Host", s["bytes_d2h"]),
        ("ninfer_capacity_errors_total", "counter", "Requests failed by the capacity contract", s["capacity_errors"]),
        ("ninfer_stored_responses", "gauge", "Responses kept for previous_response_id", stored_responses),
    ]
    out = []
    for name, kind, help_, value in rows:
        out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
    out += ["# HELP ninfer_pauses_total Pauses by resume route", "# TYPE ninfer_pauses_total counter"]
    for route, n in s["pauses"].items():
        out.append(f'ninfer_pauses_total{{route="{route}"}} {n}')
    from ninfer.policy.resources import LOST_CAUSES
    out += ["# HELP ninfer_cache_hit_losses_by_cause_total Hits lost to a missing restore point, by why it is missing",
            "# TYPE ninfer_cache_hit_losses_by_cause_total counter"]
    by = c.get("hit_losses_by_cause", {})
    for cause in LOST_CAUSES:
        out.append(f'ninfer_cache_hit_losses_by_cause_total{{cause="{cause}"}} {by.get(cause, 0)}')
    out += ["# HELP ninfer_pool_available Free units per pool", "# TYPE ninfer_pool_available gauge"]
    for pool, v in s["occupancy"].items():
        out.append(f'ninfer_pool_available{{pool="{pool}"}} {v["available"]}')
        out.append(f'ninfer_pool_total{{pool="{pool}"}} {v["total"]}')
    return "\n".join(out) + "\n"
