"""Controller cost per engine cycle.

``steady``: C requests decode in lock-step with no memory pressure. ``pressure``: C requests
share a Main KV pool a third of their total need, with a Host for one or two snapshots, so
the chain reclaims, pauses and resumes. Per cycle we measure the controller's own CPU time
(cycle thread time minus the time spent inside the worker call), controller-worker round trips
per cycle (steady state must be 1: a quote is the pressure path's one extra) and the bytes of
the StepPlan/StepReply messages. The cycle runs on one torch thread and, when only a copy is in
flight, blocks on its completion, as the control loop does (spinning would starve the copy thread
of the GIL and fill the measurement with idle cycles).
"""

from __future__ import annotations

import time

from ninfer import protocol as P
from ninfer.actors.transport import InprocClient
from ninfer.actors.worker import Worker
from ninfer.config import EngineConfig
from ninfer.engine.core import EngineCore
from ninfer.protocol import Phase, RequestSpec
from ninfer.sampling_params import SamplingParams


class Metered(InprocClient):
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


def _decoding(core: EngineCore) -> bool:
    res = list(core.sched.resident.values())
    return not core.sched.fresh and bool(res) and all(
        r.phase is Phase.RUNNING and r.facts is not None and r.facts.frontier >= r.facts.ledger_len - 1 for r in res)


def measure(model_dir: str, concurrency: int, mode: str = "steady", decode_tokens: int = 64,
            dtype: str = "float32", prompt_tokens: int | None = None) -> dict:
    """One row. ``steady``: ``prompt_tokens`` (32) then ``decode_tokens`` (64), measured over
    the middle half of the decode; ``pressure``: 90 + 100 tokens each, every cycle to the end."""
    if mode == "steady":
        prompt_len, tokens = prompt_tokens or 32, decode_tokens
        cfg = EngineConfig(max_concurrency=concurrency, max_context=max(512, prompt_len + tokens), dtype=dtype,
                           prefill_chunk_tokens=512, context_cache={"host_capacity_bytes": 64 << 20})
    else:                        # a third of the pages the requests need together
        pages = max(4, concurrency * 3 // 3 + 1)
        cfg = EngineConfig(max_concurrency=concurrency, max_context=pages * 64, kv_capacity=pages * 64, dtype=dtype,
                           prefill_chunk_tokens=64, context_cache={"host_capacity_bytes": 4 << 20})
        prompt_len, tokens = 90, 100
    client = Metered(Worker(model_dir, cfg))
    core = EngineCore(client, cfg, lambda ev: None)
    for i in range(concurrency):
        core.add(RequestSpec(prompt=[(7 * i + j) % 2000 for j in range(prompt_len)],
                             params=SamplingParams(max_tokens=tokens, ignore_eos=True)))
    if mode == "steady":
        while not _decoding(core):       # warm up: everyone admitted and decoding
            core.cycle()
    client.worker_s = 0.0
    client.calls = client.plan_bytes = client.reply_bytes = 0
    cycles, total = 0, 0.0
    limit = decode_tokens // 2 if mode == "steady" else 4000
    while cycles < limit and core.busy():
        t = time.thread_time()
        worked = core.cycle()
        total += time.thread_time() - t
        cycles += 1
        if not worked and core.tx_busy:   # only a copy in flight: block on it as the control loop
            client.worker.wait(0.05)      # does; spinning starved the copy thread of the GIL
    stats = core.stats_dict()
    client.worker.shutdown()
    ctrl = total - client.worker_s
    cycles = max(1, cycles)
    return {"mode": mode, "C": concurrency, "cycles": cycles, "controller_us_per_cycle": 1e6 * ctrl / cycles,
            "worker_ms_per_cycle": 1e3 * client.worker_s / cycles,
            "round_trips_per_cycle": client.calls / cycles,
            "plan_bytes": client.plan_bytes / max(1, client.calls),
            "reply_bytes": client.reply_bytes / max(1, client.calls),
            "pauses": stats["preemptions"], "resumes": sum(stats["pauses"].values())}


def run(model_dir: str, out: str | None = None, plot: str | None = None, concurrency=(1, 2, 4, 8),
        pressure=(2, 4, 8), decode_tokens: int = 64, prompt_tokens: int = 32, dtype: str = "float32") -> dict:
    """Steady decode at each C of ``concurrency``, then the pressure mode at each C of ``pressure``
    (either may be empty); the defaults are the committed measurement."""
    from ninfer.benchmarks.common import ensure_model, report
    from ninfer.native.threads import pin as pin_threads
    from ninfer.progress import bar
    pin_threads(1)       # this thread runs the cycle and the worker, as the control loop does
    model_dir = ensure_model(model_dir)
    points = [("steady", c) for c in concurrency] + [("pressure", c) for c in pressure]
    rows = [measure(model_dir, c, mode, decode_tokens, dtype, prompt_tokens)
            for mode, c in bar(points, desc="controller", unit="run")]
    result = {"note": "controller time excludes the worker call; steady = decode without pressure, "
                      "pressure = a third of the pages needed",
              "config": {"concurrency": list(concurrency), "pressure": list(pressure), "decode_tokens": decode_tokens,
                         "prompt_tokens": prompt_tokens, "dtype": dtype}}
    return report("controller", result, rows, ["mode", "C", "controller_us_per_cycle", "worker_ms_per_cycle",
                                               "round_trips_per_cycle", "plan_bytes", "reply_bytes", "pauses",
                                               "resumes"], out, plot)
