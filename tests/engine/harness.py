"""Drive an EngineCore synchronously (no control thread): deterministic cycles for named
scenario tests. The worker, transport and messages are the real ones."""

from __future__ import annotations

import functools

import msgspec

from ninfer import protocol as P
from ninfer.actors.transport import InprocClient
from ninfer.actors.worker import Worker
from ninfer.config import EngineConfig
from ninfer.engine.core import EngineCore
from ninfer.faults import Fault
from ninfer.frontend.validate import validate_spec
from ninfer.lifecycle import TIMINGS, as_dict, derive_timings
from ninfer.protocol import RequestSpec
from ninfer.reference import reference_generate, reference_prompt_logprobs
from ninfer.sampling_params import SamplingParams


class Harness:
    def __init__(self, model_dir: str, dtype: str = "float64", **cfg):
        self.model_dir = model_dir
        # the built-in cost defaults: measured rates would make source order depend on timing
        self.config = EngineConfig.from_dict({"dtype": dtype, "cost_calibration": False, **cfg})
        self.worker = Worker(model_dir, self.config)
        self.core = EngineCore(InprocClient(self.worker), self.config, self._sink)
        self.finals: dict[str, P.FinalEvent] = {}
        self.streams: dict[str, list[int]] = {}
        self.logprobs: dict[str, list[P.TokenLogprob]] = {}     # streamed, for requests that asked
        self.prompt_logprobs: dict[str, list] = {}              # streamed with the first token, when asked
        self.events: dict[str, list[dict]] = {}                 # lifecycle, public form
        self.dtype = dtype

    def _sink(self, ev) -> None:
        if isinstance(ev, P.TokensEvent):
            toks = self.streams.setdefault(ev.rid, [])
            assert ev.index == len(toks), "an event was repeated or skipped"
            toks.extend(ev.token_ids)
            if ev.logprobs is not None:
                assert len(ev.logprobs) == len(ev.token_ids), "a token without its logprob entry (or two)"
                self.logprobs.setdefault(ev.rid, []).extend(ev.logprobs)
            if ev.prompt_logprobs is not None:
                assert ev.index == 0 and ev.rid not in self.prompt_logprobs, "prompt logprobs sent twice"
                self.prompt_logprobs[ev.rid] = ev.prompt_logprobs
        elif isinstance(ev, P.LifecycleEvent):
            self.events.setdefault(ev.rid, []).append(as_dict(ev))
        else:       # the public spelling of the finish reason ("stop", "length", ...)
            self.finals[ev.rid] = msgspec.structs.replace(ev, finish_reason=str(ev.finish_reason))

    def submit(self, prompt: list[int], rid: str | None = None, **kw) -> str:
        params = {k: kw.pop(k) for k in list(kw) if k in SamplingParams.__struct_fields__}
        params.setdefault("ignore_eos", True)
        spec = RequestSpec(prompt=list(prompt), params=SamplingParams(**params), rid=rid or "", **kw)
        validate_spec(spec, self.core.info)        # the frontend's check, as on the user's path
        return self.core.add(spec).rid

    def req(self, rid: str):
        """The controller's record of a live request (None once it finished)."""
        return self.core.requests.get(rid)

    def inject(self, *faults: dict) -> None:
        """Faults from now on, as if configured (``EngineConfig(faults=...)``) at this moment."""
        from ninfer.faults import FaultPlan
        plan = FaultPlan([msgspec.convert(f, Fault) for f in faults])
        self.worker.faults = self.worker.prog.transfers.faults = plan

    def cycle(self) -> bool:
        if self.core.cycle():
            return True
        if self.core.tx_busy:
            self.worker.wait(1.0)
            return True
        return False

    def run(self, until=None, max_cycles: int = 20000) -> None:
        for _ in range(max_cycles):
            if until is not None and until():
                return
            if not self.core.busy():
                if until is None:
                    return
            self.cycle()
        raise AssertionError("the engine did not reach the condition (a hang?)")

    def done(self, *rids: str) -> bool:
        return all(r in self.finals for r in rids)

    def check_clean(self) -> None:
        """Leak check: after everything drains and the caches are dropped, nothing is held."""
        self.run()
        self.core.check_integrity()            # mirror == worker, before anything is dropped
        self.core.drop_caches()
        self.run()
        self.core.check_integrity()
        [out] = self.core.call_commands([P.Quote()])
        f = out.facts
        assert not f.checkpoints and not f.blocks, "something is still held after drop_caches"
        assert all(p.available == p.total for p in f.pools.values())

    def close(self) -> None:
        self.worker.shutdown()


@functools.lru_cache(maxsize=4096)
def _oracle(model_dir: str, prompt: tuple, dtype: str, params: SamplingParams) -> tuple:
    return tuple(reference_generate(model_dir, list(prompt), dtype=dtype, params=params))


def oracle(model_dir: str, prompt: list[int], dtype: str = "float64", **params) -> list[int]:
    params.setdefault("ignore_eos", True)
    params.pop("logprobs", None)                 # they never change the tokens
    params.pop("prompt_logprobs", None)
    return list(_oracle(model_dir, tuple(prompt), dtype, SamplingParams(**params)))


@functools.lru_cache(maxsize=1024)
def _oracle_logprobs(model_dir: str, prompt: tuple, dtype: str, params: SamplingParams) -> tuple:
    ids, lps = reference_generate(model_dir, list(prompt), dtype=dtype, params=params, return_logprobs=True)
    return tuple(ids), tuple(lps)


def oracle_logprobs(model_dir: str, prompt: list[int], logprobs: int, dtype: str = "float64",
                    **params) -> tuple[list[int], list[P.TokenLogprob]]:
    """The isolated run's tokens and their logprob entries (top ``logprobs`` alternatives)."""
    params.setdefault("ignore_eos", True)
    params.pop("prompt_logprobs", None)          # they never change the tokens
    ids, lps = _oracle_logprobs(model_dir, tuple(prompt), dtype, SamplingParams(**params, logprobs=logprobs))
    return list(ids), list(lps)


@functools.lru_cache(maxsize=256)
def _oracle_prompt_logprobs(model_dir: str, prompt: tuple, k: int, dtype: str) -> tuple:
    return tuple(reference_prompt_logprobs(model_dir, list(prompt), k, dtype=dtype))


def oracle_prompt_logprobs(model_dir: str, prompt: list[int], k: int, dtype: str = "float64") -> list:
    """The isolated run's prompt_logprobs: [None, entry of prompt token 1, ...]."""
    return list(_oracle_prompt_logprobs(model_dir, tuple(prompt), k, dtype))


def assert_prompt_logprobs_close(got, want, tol: float = 1e-9) -> None:
    """One entry per prompt token (the first None); same tokens, ranks and alternatives, values
    equal up to ``tol`` (chunking changes float64 logits only in the last bits)."""
    assert got is not None and len(got) == len(want), (got and len(got), len(want))
    assert got[0] is None and want[0] is None
    for i, (g, w) in enumerate(zip(got[1:], want[1:]), 1):
        assert (g.token_id, g.rank) == (w.token_id, w.rank), f"prompt token {i}: {g} vs {w}"
        assert abs(g.logprob - w.logprob) <= tol, f"prompt token {i}: {g.logprob} vs {w.logprob}"
        assert [t for t, _ in g.top] == [t for t, _ in w.top], f"prompt token {i}: alternatives differ"
        assert all(abs(a - b) <= tol for (_, a), (_, b) in zip(g.top, w.top)), f"prompt token {i}"


def force_pause(h: Harness, rid: str) -> None:
    """Pause a resident now as the preemption chain would (the core's test seam)."""
    h.core.preempt(rid)


def pause_while_drafting(h: Harness, prompt, seed_tokens: int = 6, **kw):
    """Submit ``prompt``, let it decode ``seed_tokens`` tokens (holding drafts), pause it as the
    preemption chain would and wait until it is paused: (rid, its Native sequence). The
    sequence held drafts before the pause and holds none after it."""
    rid = h.submit(prompt, **kw)
    h.run(until=lambda: len(h.streams.get(rid, [])) >= seed_tokens)
    seq = h.worker.prog.sequences[h.req(rid).sid]
    assert seq.drafts, "a decoding sequence holds its next drafts"
    force_pause(h, rid)
    h.run(until=lambda: h.req(rid) is not None and h.req(rid).phase.name == "PAUSED")
    assert seq.drafts == []
    return rid, seq


def run(h: Harness, prompt, **kw) -> P.FinalEvent:
    """Submit one request, run the engine until it ends, and return its final event (it must
    have completed normally)."""
    rid = h.submit(prompt, **kw)
    h.run(until=lambda: h.done(rid))
    f = h.finals[rid]
    assert f.finish_reason in ("length", "stop"), f.error
    return f


def assert_logprobs_close(got, want, tol: float = 1e-9) -> None:
    """Same tokens and alternatives, values equal up to ``tol`` (float64 models: chunking and
    recomputation change the logits only in the last bits)."""
    assert got is not None and len(got) == len(want), (got and len(got), len(want))
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.token_id == w.token_id, f"token {i}"
        assert abs(g.logprob - w.logprob) <= tol, f"token {i}: {g.logprob} vs {w.logprob}"
        assert [t for t, _ in g.top] == [t for t, _ in w.top], f"token {i}: alternatives differ"
        assert all(abs(a - b) <= tol for (_, a), (_, b) in zip(g.top, w.top)), f"token {i}"


LIFECYCLE_ONCE = ("queued", "generation_start", "admitted", "first_token", "finished")
REASONS = {"taken_back", "lane_take_back", "cannot_progress", "forced"}


def check_lifecycle(events: list[dict], pauses: list, finish: str | None = None) -> None:
    """Well-formed: the once-only moments at most once (finished exactly once, last), in their
    order; times never go back; one paused per pause, each followed by its resume (unless it
    ended paused), the routes and times those of ``Output.pauses`` (or of a FinalEvent's
    ``PauseEntry`` list: compared in their public form)."""
    pauses = [p if isinstance(p, dict) else p.as_dict() for p in pauses]
    kinds = [e["event"] for e in events]
    assert kinds[:2] == ["queued", "generation_start"], kinds
    assert kinds[-1] == "finished" and kinds.count("finished") == 1, kinds
    for k in LIFECYCLE_ONCE:
        assert kinds.count(k) <= 1, kinds
    present = [k for k in kinds if k in LIFECYCLE_ONCE]
    assert present == [k for k in LIFECYCLE_ONCE if k in present], f"once-only moments out of order: {kinds}"
    ts = [e["t"] for e in events]
    assert ts == sorted(ts), "a lifecycle time went back"
    assert all(e["wall"] > 0 for e in events)
    turns = [e for e in events if e["event"] in ("paused", "resumed")]
    assert [e["event"] for e in turns] == ["paused", "resumed"] * (len(turns) // 2) + ["paused"] * (len(turns) % 2)
    paused = [e for e in turns if e["event"] == "paused"]
    resumed = [e for e in turns if e["event"] == "resumed"]
    assert len(paused) == len(pauses), (kinds, pauses)
    if paused:
        assert "admitted" in kinds and kinds.index("admitted") < kinds.index("paused")
    for ev, p in zip(paused, pauses):
        assert ev["t"] == p["paused_at"] and ev["frontier"] == p["frontier"]
        assert ev["route"] in ("snapshot", "replay") and ev["reason"] in REASONS
    for ev, p in zip(resumed, pauses):
        assert ev["t"] == p["resumed_at"] and ev["route"] == p["route"]
    if finish is not None:
        assert events[-1]["finish_reason"] == finish


def assert_timings_derived(events: list[dict], timings) -> None:
    """``Output.timings`` (a FinalEvent's ``Timings`` from the harness, the same struct from the
    API, or a dict) are exactly the ones derived from the events."""
    got = derive_timings(events)
    for k in TIMINGS:
        want = timings[k] if isinstance(timings, dict) else getattr(timings, k)
        assert got[k] == want, (k, got[k], want)
