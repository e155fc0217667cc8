"""Prometheus exposition of ``engine.stats()`` through ``prometheus_client``: typed families
(counters, gauges, histograms with buckets), the ``model_name`` label on every sample, vLLM's
names where the meaning is the same (a vLLM dashboard works unchanged) and NInfer's own under
``ninfer_`` (lost hits by cause, replay vs prefill tokens, pauses by route, bytes moved, Host
arena use, controller CPU).

Every number comes from the controller's ``stats()``, so both transports and every client of
one deployment expose the same values.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ninfer.policy.resources import LOST_CAUSES

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
HISTOGRAMS = {   # stats()["telemetry"]["histograms"] key -> (vLLM name, help)
    "ttft_s": ("vllm:time_to_first_token_seconds", "Time to first token"),
    "itl_s": ("vllm:inter_token_latency_seconds", "Gap between consecutive token events of a request"),
    "e2e_s": ("vllm:e2e_request_latency_seconds", "Arrival to finish of a request"),
    "queue_s": ("vllm:request_queue_time_seconds", "Arrival to first admission of a request"),
}


class _StatsCollector:
    def __init__(self, stats: dict, model: str, stored_responses: int):
        self.s, self.model, self.stored = stats, model, stored_responses

    def _one(self, kind, name: str, help_: str, value, labels: dict | None = None):
        fam = kind(name, help_, labels=["model_name", *(labels or {})])
        fam.add_metric([self.model, *(labels or {}).values()], value)
        return fam

    def _labelled(self, kind, name: str, help_: str, label: str, values: dict):
        fam = kind(name, help_, labels=["model_name", label])
        for k, v in values.items():
            fam.add_metric([self.model, str(k)], v)
        return fam

    def collect(self):
        s, c = self.s, self.s["cache"]
        t = s.get("telemetry", {})
        counter, gauge = CounterMetricFamily, GaugeMetricFamily
        occ = s["occupancy"]
        main = occ.get("main", {"total": 0, "available": 0})
        yield from (
            self._one(counter, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                      c["queried_tokens"]),
            self._one(counter, "vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache (real reuse)",
                      c["reused_tokens"]),
            self._one(counter, "vllm:num_preemptions", "Requests paused to let older ones progress", s["preemptions"]),
            self._one(counter, "vllm:prompt_tokens", "Prompt tokens of finished requests", t.get("prompt_tokens", 0)),
            self._one(counter, "vllm:generation_tokens", "Output tokens of finished requests",
                      t.get("generation_tokens", 0)),
            self._labelled(counter, "vllm:request_success", "Finished requests by finish reason", "finished_reason",
                           t.get("finished_by_reason", {})),
            self._one(gauge, "vllm:num_requests_running", "Requests holding a lane", s["running"]),
            self._one(gauge, "vllm:num_requests_waiting", "Requests waiting for admission or paused",
                      s["waiting"] + s["paused"]),
            self._one(gauge, "vllm:kv_cache_usage_perc", "Fraction of main KV pages in use",
                      1.0 - main["available"] / main["total"] if main["total"] else 0.0),
            self._one(gauge, "ninfer_requests_paused", "Requests paused (Snapshot or Replay pending)", s["paused"]),
            self._one(counter, "ninfer_cache_queries", "Admissions that looked for a restore source", c["queries"]),
            self._one(counter, "ninfer_cache_hits", "Admissions that reused a checkpoint", c["hits"]),
            self._one(counter, "ninfer_cache_hit_losses", "Admissions whose deeper matching checkpoint was missing",
                      c["hit_losses"]),
            self._one(counter, "ninfer_cache_hit_loss_tokens", "Tokens those missing checkpoints would have saved",
                      c["hit_loss_tokens"]),
            self._labelled(counter, "ninfer_cache_hit_losses_by_cause",
                           "Hits lost to a missing restore point, by why it is missing", "cause",
                           {cause: c.get("hit_losses_by_cause", {}).get(cause, 0) for cause in LOST_CAUSES}),
            self._one(counter, "ninfer_cache_summary_hits", "Repeat-demand evidence used (never counted as hits)",
                      c["summary_hits"]),
            self._one(counter, "ninfer_cache_waiting_references", "Waiting references taken on a restore point",
                      c.get("waits", 0)),
            self._one(counter, "ninfer_cache_pending_waits", "Fresh requests that waited for another's pending save",
                      c.get("pending_waits", 0)),
            self._one(counter, "ninfer_cache_pending_saved_tokens",
                      "Prompt tokens not computed because a request waited", c.get("pending_saved_tokens", 0)),
            self._one(counter, "ninfer_cache_pending_wait_seconds", "Time fresh requests spent waiting for a pending save",
                      c.get("pending_wait_s", 0.0)),
            self._one(gauge, "ninfer_cache_records", "Context records the controller holds", c.get("records", 0)),
            self._one(counter, "ninfer_request_paused_seconds", "Time finished requests spent paused",
                      t.get("paused_s", 0.0)),
            self._one(counter, "ninfer_request_source_wait_seconds",
                      "Time finished requests waited for another request's pending restore point",
                      t.get("source_wait_s", 0.0)),
            self._one(counter, "ninfer_prefill_tokens", "Prompt tokens computed by initial prefill", s["prefill_tokens"]),
            self._one(counter, "ninfer_replay_tokens", "Tokens recomputed by Replay after a pause", s["replay_tokens"]),
            self._labelled(counter, "ninfer_pauses", "Pauses by resume route", "route", s["pauses"]),
            self._one(counter, "ninfer_bytes_h2d", "Bytes copied Host to Device", s["bytes_h2d"]),
            self._one(counter, "ninfer_bytes_d2h", "Bytes copied Device to Host", s["bytes_d2h"]),
            self._one(counter, "ninfer_capacity_errors", "Requests failed by the capacity contract", s["capacity_errors"]),
            self._labelled(gauge, "ninfer_pool_available", "Free units per pool", "pool",
                           {k: v["available"] for k, v in occ.items()}),
            self._labelled(gauge, "ninfer_pool_total", "Units per pool", "pool", {k: v["total"] for k, v in occ.items()}),
            self._one(gauge, "ninfer_host_capacity_bytes", "Pinned Host arena size", s.get("host_capacity_bytes", 0)),
            self._one(gauge, "ninfer_host_free_bytes", "Free bytes of the Host arena", s.get("host_free_bytes", 0)),
            self._one(gauge, "ninfer_host_largest_free_bytes", "Largest free extent of the Host arena",
                      s.get("host_largest_free_bytes", 0)),
            self._one(counter, "ninfer_controller_cycles", "Control cycles run", s.get("cycles", 0)),
            self._one(counter, "ninfer_controller_cpu_seconds", "Controller time spent in control cycles",
                      s.get("cycle_s", 0.0)),
            self._one(counter, "ninfer_worker_seconds", "Worker time spent executing steps", s.get("worker_s", 0.0)),
            self._one(gauge, "ninfer_stored_responses", "Responses kept for previous_response_id", self.stored),
        )
        spec = s.get("speculative")
        if spec:                              # vLLM's speculative-decoding counters
            yield self._one(counter, "vllm:spec_decode_num_drafts", "Decode steps that verified drafts",
                            spec["verify_rows"])
            yield self._one(counter, "vllm:spec_decode_num_draft_tokens", "Draft tokens verified", spec["drafted"])
            yield self._one(counter, "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", spec["accepted"])
            yield self._labelled(counter, "vllm:spec_decode_num_accepted_tokens_per_pos",
                                 "Draft tokens accepted, by draft position", "position",
                                 {str(i): n for i, n in enumerate(spec["accepted_by_position"])})
        so = s.get("structured")
        if so:                                # structured outputs: the grammar's work
            yield self._one(counter, "ninfer_structured_masks", "Token masks computed for constrained requests",
                            so["masks"])
            yield self._one(counter, "ninfer_structured_mask_seconds", "Time computing token masks", so["mask_s"])
            yield self._one(counter, "ninfer_structured_requests", "Grammar states built", so["requests"])
        for key, (name, help_) in HISTOGRAMS.items():
            h = t.get("histograms", {}).get(key)
            if h is None:
                continue
            fam = HistogramMetricFamily(name, help_, labels=["model_name"])
            cum, buckets = 0, []
            for bound, n in zip([*h["bounds"], float("inf")], h["counts"]):
                cum += n
                buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cum))
            fam.add_metric([self.model], buckets, h["sum"])
            yield fam


def prometheus(stats: dict, stored_responses: int = 0, model: str = "ninfer") -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatsCollector(stats, model, stored_responses))
    return generate_latest(registry)
