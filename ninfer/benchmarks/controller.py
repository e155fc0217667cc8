"""Controller cost per steady decode cycle (issue: Engine controller I).

C requests decode in lock-step with no memory pressure. Per cycle we measure the controller's
own CPU time (cycle thread time minus the time spent inside the worker call), round trips per
cycle and the bytes of the StepPlan/StepReply messages.
"""

from __future__ import annotations

import time

from ninfer import protocol as P
from ninfer.actors.transport import InprocClient
from ninfer.actors.worker import Worker
from ninfer.config import EngineConfig
from ninfer.engine.core import EngineCore
from ninfer.protocol import RequestSpec
from ninfer.sampling_params import SamplingParams


class _Metered(InprocClient):
    def __init__(self, worker):
        super().__init__(worker)
        self.worker_s = 0.0
        self.calls = 0
        self.plan_bytes = 0
        self.reply_bytes = 0

    def step(self, plan):
        data = P.encode(plan)
        t = time.thread_time()
        out = self.worker.handle(data)
        self.worker_s += time.thread_time() - t
        self.calls += 1
        self.plan_bytes += len(data)
        self.reply_bytes += len(out)
        return P.decode_reply(out)


def measure(model_dir: str, concurrency: int, decode_tokens: int = 64, dtype: str = "float32") -> dict:
    cfg = EngineConfig(max_concurrency=concurrency, max_context=512, dtype=dtype, prefill_chunk_tokens=512,
                       context_cache={"host_capacity_bytes": 64 << 20})
    client = _Metered(Worker(model_dir, cfg))
    core = EngineCore(client, cfg, lambda ev: None)
    for i in range(concurrency):
        core.add(RequestSpec(prompt=list(range(10 + i, 42 + i)),
                             params=SamplingParams(max_tokens=decode_tokens, ignore_eos=True)))
    while core.sched.fresh or any(r.in_prefill for r in core.sched.resident.values()):   # warm up
        core.cycle()
    client.worker_s = 0.0
    client.calls = client.plan_bytes = client.reply_bytes = 0
    cycles, total = 0, 0.0
    while cycles < decode_tokens // 2:
        t = time.thread_time()
        core.cycle()
        total += time.thread_time() - t
        cycles += 1
    client.worker.shutdown()
    ctrl = total - client.worker_s
    return {"C": concurrency, "cycles": cycles, "controller_us_per_cycle": 1e6 * ctrl / cycles,
            "worker_ms_per_cycle": 1e3 * client.worker_s / cycles,
            "round_trips_per_cycle": client.calls / cycles,
            "plan_bytes": client.plan_bytes / client.calls, "reply_bytes": client.reply_bytes / client.calls}


def run(model_dir: str, out: str | None = None) -> dict:
    from ninfer.benchmarks.common import ensure_model, report
    model_dir = ensure_model(model_dir)
    rows = [measure(model_dir, c) for c in (1, 2, 4, 8)]
    result = {"note": "steady decode, no pressure; controller time excludes the worker call"}
    report("controller", result, rows, ["C", "controller_us_per_cycle", "worker_ms_per_cycle",
                                        "round_trips_per_cycle", "plan_bytes", "reply_bytes"], out)
    return {**result, "rows": rows}
