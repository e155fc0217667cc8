"""One physical point per position (``one-physical-point``) for private input points: requests
that each compute the same prefix keep one checkpoint there, and every one of their records
holds it as its input point (several logical holders). The marker variant is
``test_context_rules.py::test_one_physical_point_per_shared_prefix`` (a public entry serves all
of them, so it does not see whether the later saves joined)."""

from __future__ import annotations

from ninfer import protocol as P
from tests.engine.harness import oracle
from tests.factories import random_prompt


def test_requests_computing_the_same_input_point_share_one_checkpoint_and_each_holds_it(make_harness, tiny_model,
                                                                                       monkeypatch):
    h = make_harness(max_concurrency=4, max_context=512, kv_capacity=16 * 64, prefill_chunk_tokens=64,
                     context_cache={"device_state_slots": 4, "host_capacity_bytes": 16 << 20})
    monkeypatch.setattr(h.core.rm, "pending_source", lambda *a, **kw: None)    # each computes it
    shared = random_prompt(70, seed=8)
    prompts = [shared + random_prompt(20, seed=9 + i) for i in range(3)]
    rids = [h.submit(p, max_tokens=3, recovery_frontier=70) for p in prompts]
    h.run(until=lambda: h.done(*rids))
    [out] = h.core.call_commands([P.Quote()])
    at70 = [c for c in out.facts.checkpoints.values() if c.kind is P.CkptKind.CACHE and c.frontier == 70]
    assert len(at70) == 1, [c.frontier for c in out.facts.checkpoints.values()]
    inputs = [o for o in at70[0].owners if isinstance(o, P.RecordOwner) and o.role is P.Role.INPUT]
    assert len(inputs) == 3, at70[0].owners
    for r, p in zip(rids, prompts):
        assert h.finals[r].token_ids == oracle(tiny_model, p, max_tokens=3)
    h.check_clean()
