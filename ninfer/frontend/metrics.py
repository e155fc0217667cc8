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


REQUEST_HISTOGRAMS = {   # stats()["requests"]["histograms"] key (frontend/request_stats.py) -> (name, help)
    "prompt_tokens": ("vllm:request_prompt_tokens", "Prompt tokens of finished requests"),
    "generation_tokens": ("vllm:request_generation_tokens", "Output tokens of finished requests"),
    "params_max_tokens": ("vllm:request_params_max_tokens", "max_tokens of submitted requests"),
    "time_per_output_token_s": ("vllm:request_time_per_output_token_seconds",
                                "Per request: (end - first token) / (output tokens - 1)"),
    "prefill_s": ("vllm:request_prefill_time_seconds", "Per request: first admission to first token"),
    "decode_s": ("vllm:request_decode_time_seconds", "Per request: first token to the end"),
    "inference_s": ("vllm:request_inference_time_seconds", "Per request: first admission to the end"),
}


class _StatsCollector:
    def __init__(self, stats: dict, model: str, stored_responses: int, info=None, server: dict | None = None,
                 config=None):
        self.s, self.model, self.stored = stats, model, stored_responses
        self.info, self.server, self.config = info, server or {}, config

    def _histogram(self, name: str, help_: str, h: dict) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(name, help_, labels=["model_name"])
        cum, buckets = 0, []
        for bound, n in zip([*h["bounds"], float("inf")], h["counts"]):
            cum += n
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cum))
        fam.add_metric([self.model], buckets, h["sum"])
        return fam

    def _faults(self):
        """Restarts of the actors, requests resubmitted across them, failures by kind."""
        s, req = self.s, self.s.get("requests") or {}
        yield self._labelled(CounterMetricFamily, "ninfer_actor_restarts",
                             "Actors replaced after a loss (worker: since the controller started)", "actor",
                             {"worker": s.get("worker_recoveries", 0), "controller": s.get("controller_restarts", 0)})
        yield self._one(CounterMetricFamily, "ninfer_requests_resubmitted",
                        "Requests without a token yet, started again after a worker or controller loss",
                        s.get("requests_resubmitted", 0))
        yield self._labelled(CounterMetricFamily, "ninfer_request_failures", "Requests that ended in an error, "
                             "by its kind (worker_lost, controller_lost, device_error, ...)", "kind",
                             req.get("failures_by_kind", {}))

    def _vllm_requests(self):
        """vLLM's per-request families, the iteration histogram and the cache config."""
        req = self.s.get("requests") or {}
        for key, (name, help_) in REQUEST_HISTOGRAMS.items():
            h = (req.get("histograms") or {}).get(key)
            if h is not None:
                yield self._histogram(name, help_, h)
        if "prompt_tokens_cached" in req:
            yield self._one(CounterMetricFamily, "vllm:prompt_tokens_cached",
                            "Prompt tokens served from the prefix cache, of finished requests",
                            req["prompt_tokens_cached"])
        if self.s.get("iteration_tokens"):
            yield self._histogram("vllm:iteration_tokens_total", "Tokens computed per engine step",
                                  self.s["iteration_tokens"])
        if self.server.get("params_n"):
            yield self._histogram("vllm:request_params_n", "n of HTTP requests", self.server["params_n"])
        if self.info is not None and hasattr(self.info, "kv_pages"):
            yield self._cache_config()

    def _cache_config(self) -> GaugeMetricFamily:
        """vLLM's ``cache_config_info``: the layout the worker runs (``WorkerInfo``: pages, dtype,
        lanes, context, chunk) and the memory flags of the config it was started with
        (``gpu_memory_utilization``, ``kv_cache_memory_bytes``: "None" when unset, as vLLM
        writes it; "" when the deployment cannot say)."""
        i, c = self.info, self.config
        labels = {"block_size": "64", "num_gpu_blocks": str(i.kv_pages), "cache_dtype": i.dtype,
                  "enable_prefix_caching": "True", "max_num_seqs": str(i.max_concurrency),
                  "max_model_len": str(i.max_context), "max_num_batched_tokens": str(i.prefill_chunk_tokens),
                  "state_slots": str(i.state_slots), "host_capacity_bytes": str(i.host_capacity),
                  "gpu_memory_utilization": "" if c is None else str(c.gpu_memory_utilization),
                  "kv_cache_memory_bytes": "" if c is None else str(c.memory_budget_bytes)}
        fam = GaugeMetricFamily("vllm:cache_config_info", "The KV cache's configuration",
                                labels=["model_name", *labels])
        fam.add_metric([self.model, *labels.values()], 1.0)
        return fam

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
            if h is not None:
                yield self._histogram(name, help_, h)
        yield from self._faults()
        yield from self._vllm_requests()
        if s.get("router"):
            yield from self._router(s["router"], s.get("frontend") or {}, s.get("replicas") or [])

    def _router(self, r: dict, front: dict, replicas: list):
        """A replicated deployment (issue 34): where requests went and why, and what the router
        knows of each replica (its published restore positions, how old they are, its load)."""
        counter, gauge = CounterMetricFamily, GaugeMetricFamily
        yield self._labelled(counter, "ninfer_router_routed", "Requests routed, by what decided the replica "
                             "(restore: a published restore position; inflight: a prefix in flight there; "
                             "session / load: no prefix to reuse)", "reason", r["routed_by_reason"])
        yield self._one(counter, "ninfer_router_rerouted", "Requests routed again after their replica was lost",
                        r["rerouted"])
        yield self._one(counter, "ninfer_router_decision_seconds", "Time spent choosing replicas", r["route_s"])
        yield self._one(gauge, "ninfer_router_decision_max_seconds", "The longest single routing decision",
                        r["route_max_s"])
        per = r.get("replicas", {})
        for key, name, help_ in (("summary_entries", "ninfer_router_summary_entries",
                                  "Restore positions a replica publishes (as the router holds them)"),
                                 ("summary_age_s", "ninfer_router_summary_age_seconds",
                                  "Seconds since a replica's summary last changed"),
                                 ("outstanding", "ninfer_router_outstanding", "Requests routed to a replica, not finished"),
                                 ("running", "ninfer_router_running", "Requests a replica has admitted, not finished"),
                                 ("lanes", "ninfer_router_lanes", "A replica's execution lanes")):
            yield self._labelled(gauge, name, help_, "replica",
                                 {k: v[key] for k, v in per.items() if v.get(key) is not None})
        states: dict = {}
        for rep in replicas:
            states[rep["state"]] = states.get(rep["state"], 0) + 1
        yield self._labelled(gauge, "ninfer_replicas", "Engine replicas by state (live, draining, starting, lost)",
                             "state",
                             states)
        yield self._labelled(counter, "ninfer_replica_events", "Replicas lost and replaced, requests failed or "
                             "re-routed with them, summaries resynchronised", "event",
                             {k: front.get(k, 0) for k in ("replicas_lost", "replicas_replaced", "replicas_drained",
                                                           "failed_in_flight", "rerouted", "summary_resyncs")})


def prometheus(stats: dict, stored_responses: int = 0, model: str = "ninfer", info=None,
               server: dict | None = None, config=None) -> bytes:
    """``stats``: ``engine.stats()``; ``info``: the engine's ``WorkerInfo`` (cache config);
    ``server``: what only the HTTP server counts (``params_n``: a histogram snapshot);
    ``config``: the ``EngineConfig`` the deployment runs with (``Engine.config``)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatsCollector(stats, model, stored_responses, info, server, config))
    return generate_latest(registry)
