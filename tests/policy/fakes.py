"""Fabricated facts for the model-free policy tests: a ResourceManager over a small made-up
worker (no model, no worker)."""

from __future__ import annotations

from ninfer import protocol as P
from ninfer.policy.resources import ResourceManager

INFO = P.WorkerInfo(protocol=1, model_type="t", vocab_size=100, max_context=4096, eos_ids=[], max_concurrency=4,
                    kv_pages=64, state_slots=8, page_bytes=1, image_bytes=1, host_capacity=0,
                    prefill_chunk_tokens=64, exec_identity=b"x", dtype="float32")


def resource_manager(**kw) -> ResourceManager:
    """A ResourceManager on ``INFO`` (``kw``: its options, e.g. ``divergence_min``)."""
    return ResourceManager(INFO, **kw)
