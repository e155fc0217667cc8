"""The Python client surface of API.md: ``Engine.start``, ``generate``/``chat``, handles.

The in-process engine runs the EngineCore on one control thread; client calls hand it work
through a queue and receive events through per-request queues. Nothing else touches the core.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from ninfer import protocol as P
from ninfer.config import EngineConfig
from ninfer.lifecycle import as_dict
from ninfer.protocol import PromptLogprob, RequestSpec, TokenLogprob
from ninfer.errors import ErrorKind, RequestError, lost_error
from ninfer.sampling_params import SamplingParams

log = logging.getLogger("ninfer.api")


# ``Output.usage`` and ``Output.timings``: the structs the engine's FinalEvent carries (one
# definition each, in ninfer.protocol), under their public names
UsageView = P.Usage
TimingsView = P.Timings


@dataclass
class Output:
    """A terminal result (API.md: out.token_ids, text, finish_reason, error, usage, timings,
    pauses). ``error``: None or ``{"type", "message"}`` (and ``"retryable": True`` when a
    retry is served), ``type`` an ``ErrorKind`` value; ``pauses``: ``{"route", "frontier",
    "paused_at", "resumed_at"}`` each (no ``resumed_at`` when it ended paused).
    ``logprobs``: one ``TokenLogprob`` per output token when the request asked
    (``logprobs=k``), else None. ``prompt_logprobs`` (vLLM's ``RequestOutput.prompt_logprobs``):
    when the request asked (``prompt_logprobs=k``), one entry per prompt token — None for the
    first, then a ``PromptLogprob`` (token_id, logprob, rank, top) — else None."""

    rid: str
    token_ids: list[int]
    text: str
    finish_reason: str
    error: dict | None
    usage: UsageView
    timings: TimingsView
    pauses: list[dict] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)   # exactly what the engine computed
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[PromptLogprob | None] | None = None


@dataclass
class StreamEvent:
    """Newly committed tokens of one request; no event is ever repeated. ``logprobs``: one
    entry per token in ``token_ids`` when the request asked, else None. ``prompt_logprobs``:
    on the first event only, when the request asked (as ``Output.prompt_logprobs``)."""

    rid: str
    index: int
    token_ids: list[int]
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[PromptLogprob | None] | None = None


class RequestHandle:
    def __init__(self, engine: "Engine", rid: str):
        self._engine = engine
        self.rid = rid
        self._q: queue.Queue = queue.Queue()
        self._final: Output | None = None
        self._done = threading.Event()
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._aq: tuple[asyncio.AbstractEventLoop, asyncio.Queue] | None = None
        self._lock = threading.Lock()
        self._events: list[dict] = []
        self.prompt_token_ids: list[int] | None = None     # the prompt the engine runs, once known

    def events(self) -> list[dict]:
        """The lifecycle so far — queued, generation_start, admitted, first_token, paused,
        resumed, finished, each published once (one paused/resumed pair per pause) — as
        ``{"event": name, "t": controller time.monotonic(), "wall": time.time(), ...}``; the
        whole list once ``result()`` has returned."""
        with self._lock:
            return [dict(e) for e in self._events]

    def _note(self, event: dict) -> None:
        with self._lock:
            self._events.append(event)

    # called on the engine's control thread
    def _deliver(self, item) -> None:
        waiters = []
        with self._lock:
            if isinstance(item, Output):
                self._final = item
                self._done.set()
                waiters, self._async_waiters = self._async_waiters, []
            sink = self._aq
            if sink is None:
                self._q.put(item)
        if sink is not None:                               # an async reader: no thread blocks on it
            sink[0].call_soon_threadsafe(sink[1].put_nowait, item)
        for loop, fut in waiters:
            loop.call_soon_threadsafe(lambda f=fut: f.done() or f.set_result(None))

    def __iter__(self) -> Iterator[StreamEvent]:
        while True:
            item = self._q.get()
            if isinstance(item, Output):
                return
            yield item

    def result(self, timeout: float | None = None) -> Output:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.rid} did not finish within {timeout} s")
        return self._final

    def cancel(self) -> None:
        self._engine._cancel(self.rid)

    async def result_async(self) -> Output:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            if self._final is not None:
                return self._final
            self._async_waiters.append((loop, fut))
        await fut
        return self._final

    async def aiter(self) -> AsyncIterator[StreamEvent]:
        """Events on the caller's event loop: the control thread hands each one over with
        call_soon_threadsafe, so many concurrent streams cost no threads."""
        aq: asyncio.Queue = asyncio.Queue()
        with self._lock:
            while not self._q.empty():
                aq.put_nowait(self._q.get_nowait())
            self._aq = (asyncio.get_running_loop(), aq)
        while True:
            item = await aq.get()
            if isinstance(item, Output):
                return
            yield item


class Engine:
    """Handle to a running engine. ``Engine.start`` builds the in-process deployment (the same
    messages as Ray, one process) or the Ray one; ``ninfer.connect`` attaches to a running Ray
    deployment. The handle API is the same for both."""

    def __init__(self, runtime, model_dir: str | None, transport: str, media_budget_bytes: int | None = None,
                 generation_config: str = "vllm", config: EngineConfig | None = None):
        from ninfer.frontend.intake import Intake
        from ninfer.frontend.options import generation_defaults

        # what generate / chat use for a sampling argument left at None ("vllm": the documented
        # defaults; "auto": the model's generation_config.json first; max_tokens stays 16)
        found = generation_defaults(model_dir, generation_config)
        self.sampling_defaults = {**PY_DEFAULTS, **{k: v for k, v in found.items() if k in PY_DEFAULTS}}

        self.transport = transport
        self.model_dir = model_dir
        # the EngineConfig the deployment runs with (after fit_to_model); None when a deployment
        # cannot say (one started by an older NInfer). The worker's own facts: ``info``
        self.config = config
        self._handles: dict[str, RequestHandle] = {}
        self._lock = threading.Lock()
        self._counter = 0
        self._rt = runtime
        self.info = runtime.info
        budget = {} if media_budget_bytes is None else {"media_budget_bytes": media_budget_bytes}
        self._intake = Intake(model_dir, self.info, **budget) if model_dir else None
        if transport == "ray":
            runtime.attach(self._on_event, self._fail_outstanding)
        else:
            runtime.attach(self._on_event)

    @staticmethod
    def start(model: str | Path, config: EngineConfig | str | Path | dict | None = None,
              dtype: str | None = None, transport: str = "inproc", address: str | None = None,
              deployment: str = "ninfer", detached: bool = False, generation_config: str = "vllm",
              replicas: int = 1, router: str | dict | None = None, **kw) -> "Engine":
        """Start an engine on ``model``. transport="inproc": one process; "ray": the three
        actors on the Ray cluster at ``address``, else on the cluster this machine runs (as a
        plain ``ray.init()`` finds it), else on a private local Ray.

        ``generation_config`` (vLLM's ``--generation-config``): what ``generate`` / ``chat`` use for
        temperature, top_p, top_k, min_p and repetition_penalty left at None — "vllm" (default):
        the documented defaults (greedy); "auto": the model's generation_config.json where it sets
        them; a directory: that directory's file.

        The config is checked against the model here, before any actor starts: a bad model
        directory or config value is one ModelLoadError / ConfigError; values above what the
        model can use (a generic file's max_context) are lowered with a warning on the
        ``ninfer`` logger (``EngineConfig.fit_to_model``).

        ``replicas`` (Ray only): N whole engines behind one frontend, each placed on its own GPU
        (a placement group per replica; none needed on a CPU cluster); ``router``: how requests
        are routed to them — ``"exact"`` (default: the deepest exact restore position, net of
        load), ``"session"`` or ``"round-robin"``, or a dict of ``ninfer.replicas.router.RouterConfig``
        fields (docs/api.md, "Replicas")."""
        from ninfer import logs
        from ninfer.errors import ConfigError
        from ninfer.native.model.config import load_config

        cfg = EngineConfig.coerce(config)
        if dtype is not None:
            cfg = msgspec.structs.replace(cfg, dtype=dtype)
        fmt = logs.requested_format(cfg.log_format)
        if fmt:                                # asked for: this process and every actor log so
            logs.formatter(fmt)                # (a bad NINFER_LOG_FORMAT is one clear error)
            cfg = msgspec.structs.replace(cfg, log_format=fmt)
            logs.configure(fmt)
        cfg, notes = cfg.fit_to_model(load_config(model).max_position_embeddings)
        for note in notes:
            log.warning("%s", note)
        if not isinstance(replicas, int) or replicas < 1:
            raise ConfigError(f"replicas={replicas!r} is out of range: allowed >= 1")
        if router is not None and replicas == 1:
            raise ConfigError("router= (--routing) chooses among replicas: give replicas >= 2 (--replicas N) with it")
        if replicas > 1:
            if transport != "ray":
                raise ConfigError(f"replicas={replicas} needs transport='ray' (each replica is a controller and a "
                                  "GPU worker actor)")
            from ninfer.replicas.router import RouterConfig
            RouterConfig.coerce(router)            # a bad routing is one ConfigError before anything starts
            kw.update(replicas=replicas, router=router)
        if transport == "inproc":
            from ninfer.actors.runtime import InprocRuntime
            return Engine(InprocRuntime(str(model), cfg), str(model), transport, cfg.media_budget_bytes,
                          generation_config, cfg)
        if transport == "ray":
            from ninfer.actors.client import RayClientRuntime
            return Engine(RayClientRuntime.start(str(model), cfg, address, deployment, detached, **kw),
                          str(model), transport, cfg.media_budget_bytes, generation_config, cfg)
        raise RequestError(f"transport {transport!r} is not supported (use 'inproc' or 'ray')")

    # ---- requests -------------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[int], max_tokens: int = 16, temperature: float | None = None,
                 top_p: float | None = None, top_k: int | None = None, seed: int = 0, stop_token_ids: list[int] | None = None,
                 ignore_eos: bool = False, session_id: str | None = None, anchors: list[int] | None = None,
                 cache_markers: list[int] | None = None, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, repetition_penalty: float | None = None,
                 recovery_frontier: int | None = None, request_id: str | None = None,
                 logprobs: int | None = None, min_p: float | None = None, min_tokens: int = 0,
                 logit_bias: dict[int, float] | None = None, allowed_token_ids: list[int] | None = None,
                 bad_words: list[list[int]] | None = None, structured: P.Constraint | None = None,
                 prompt_logprobs: int | None = None) -> RequestHandle:
        """``logprobs=k``: every output token's raw log-probability and its k most likely
        alternatives (0..20), on the stream events and the Output; None: none.
        ``prompt_logprobs=k`` (vLLM's): every prompt token's raw log-probability given the tokens
        before it, its rank and the k most likely tokens there (0..20), on the first stream event
        and the Output; such a request restores no cached prefix (it computes its whole prompt,
        as in vLLM) but still saves points for others. ``min_p``,
        ``min_tokens``, ``logit_bias`` ({token id: bias}), ``allowed_token_ids`` and
        ``bad_words`` (token-id sequences) shape the draw as in vLLM (``SamplingParams``);
        ``structured``: a grammar the output follows (``ninfer.structured.json_schema(...)``,
        ``regex``, ``choice``, ``grammar``, ``tool_calls``).
        temperature, top_p, top_k, min_p and repetition_penalty left at None take the engine's
        defaults (0.0, 1.0, 0, 0.0, 1.0 unless ``Engine.start(generation_config="auto")``)."""
        temperature, top_p, top_k, min_p, repetition_penalty = self._defaults(
            temperature, top_p, top_k, min_p, repetition_penalty)
        params = _params(max_tokens, temperature, top_p, top_k, seed, stop_token_ids, ignore_eos,
                         presence_penalty, frequency_penalty, repetition_penalty, logprobs,
                         min_p, min_tokens, logit_bias, allowed_token_ids, bad_words, structured, prompt_logprobs)
        spec = RequestSpec(prompt=list(prompt_token_ids) if isinstance(prompt_token_ids, (list, tuple)) else prompt_token_ids,
                           params=params, session_id=session_id, anchors=list(anchors or []),
                           markers=list(cache_markers or []), recovery_frontier=recovery_frontier,
                           rid=request_id or "")
        h = self._submit(spec.rid, lambda rid: self._rt.submit(msgspec.structs.replace(spec, rid=rid)))
        h.prompt_token_ids = list(spec.prompt)
        return h

    def chat(self, messages: list[dict], tools: list[dict] | None = None, max_tokens: int = 16,
             temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
             seed: int = 0,
             session_id: str | None = None, cache_markers: list[int] | None = None,
             stop_token_ids: list[int] | None = None, ignore_eos: bool = False,
             presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
             repetition_penalty: float | None = None,
             request_id: str | None = None, fill_max_tokens: bool = False,
             logprobs: int | None = None, min_p: float | None = None, min_tokens: int = 0,
             logit_bias: dict[int, float] | None = None, allowed_token_ids: list[int] | None = None,
             bad_words: list[list[int]] | None = None, structured: P.Constraint | None = None,
             add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             prompt_logprobs: int | None = None) -> RequestHandle:
        """OpenAI-style chat input: rendered with the model's template; the frontend finds the
        typed R, the restore position and the markers (cache_control on messages or parts).
        ``fill_max_tokens``: treat max_tokens as a cap on the remaining context. ``logprobs``
        and the other sampling options (``prompt_logprobs`` too: of the rendered prompt): as in
        ``generate`` (OpenAI's ``logprobs=true, top_logprobs=k``). ``add_generation_prompt`` /
        ``continue_final_message`` (the final message left open for the model to continue; the
        two exclude each other) and ``chat_template_kwargs`` (extra template variables, e.g.
        ``{"enable_thinking": False}``) as in vLLM. ``handle.prompt_token_ids`` is the rendered prompt once this returns."""
        temperature, top_p, top_k, min_p, repetition_penalty = self._defaults(
            temperature, top_p, top_k, min_p, repetition_penalty)
        params = _params(max_tokens, temperature, top_p, top_k, seed, stop_token_ids, ignore_eos,
                         presence_penalty, frequency_penalty, repetition_penalty, logprobs,
                         min_p, min_tokens, logit_bias, allowed_token_ids, bad_words, structured, prompt_logprobs)
        template = None
        if not add_generation_prompt or continue_final_message or chat_template_kwargs:
            template = P.TemplateOptions(add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message,
                                         kwargs=dict(chat_template_kwargs or {}))
        chat = P.ChatSpec(messages=messages, tools=tools, params=params, session_id=session_id,
                          markers=list(cache_markers or []), fill_max_tokens=fill_max_tokens,
                          rid=request_id or "", template=template)
        prompt: list = []

        def send(rid: str) -> None:
            prompt.append(self._rt.submit_chat(msgspec.structs.replace(chat, rid=rid)))
        h = self._submit(chat.rid, send)
        h.prompt_token_ids = list(prompt[0]) if prompt and prompt[0] is not None else None
        return h

    def _defaults(self, temperature, top_p, top_k, min_p, repetition_penalty) -> tuple:
        d = self.sampling_defaults
        return tuple(d[k] if v is None else v for k, v in (
            ("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("min_p", min_p),
            ("repetition_penalty", repetition_penalty)))

    def _submit(self, rid: str, send) -> RequestHandle:
        with self._lock:
            self._counter += 1
            rid = rid or f"{self._rt.client_id}-{self._counter}"
            if rid in self._handles:
                raise RequestError(f"request id {rid!r} is already in use")
            handle = RequestHandle(self, rid)
            self._handles[rid] = handle
        try:
            send(rid)
        except RequestError:
            with self._lock:
                self._handles.pop(rid, None)
            raise
        return handle

    def _cancel(self, rid: str) -> None:
        self._rt.cancel(rid)

    def _on_event(self, ev: P.Event) -> None:
        observe = getattr(self._rt, "observe", None)       # in-process: the frontend is here
        if observe is not None:
            observe(ev)
        handle = self._handles.get(ev.rid)
        if handle is None:
            return
        if isinstance(ev, P.TokensEvent):
            handle._deliver(StreamEvent(ev.rid, ev.index, list(ev.token_ids), self._text(ev.token_ids),
                                        ev.logprobs, ev.prompt_logprobs))
            return
        if isinstance(ev, P.LifecycleEvent):
            handle._note(as_dict(ev))
            return
        with self._lock:
            self._handles.pop(ev.rid, None)
        if not any(e["event"] == "finished" for e in handle._events):
            # ended outside the engine core (rejected at its intake, connection or controller
            # lost): the client marks the end itself, so every handle's lifecycle has one
            handle._note({"event": "finished", "t": time.monotonic(), "wall": time.time(),
                          "finish_reason": str(ev.finish_reason),
                          **({"error": ev.error.kind.value} if ev.error is not None else {})})
        handle._deliver(Output(
            rid=ev.rid, token_ids=list(ev.token_ids), text=self._text(ev.token_ids),
            finish_reason=str(ev.finish_reason), error=None if ev.error is None else ev.error.as_dict(),
            usage=ev.usage if ev.usage is not None else P.Usage(),        # None: ended outside the engine
            timings=ev.timings if ev.timings is not None else P.Timings(),
            pauses=[p.as_dict() for p in ev.pauses], prompt_token_ids=list(ev.prompt_token_ids), logprobs=ev.logprobs,
            prompt_logprobs=ev.prompt_logprobs))

    @property
    def tokenizer(self):
        """The served model's tokenizer (None: an engine started without a model directory)."""
        return self._intake.tokenizer if self._intake is not None else None

    def _text(self, ids: list[int]) -> str:
        return self._intake.text(ids) if self._intake is not None else ""

    def _fail_outstanding(self, message: str) -> None:
        """The connection to the deployment was lost: no client waits forever."""
        for rid in list(self._handles):
            self._on_event(P.FinalEvent(rid, P.FinishReason.ERROR, [], None, None, [],
                                        lost_error(ErrorKind.CONNECTION_LOST, message)))

    # ---- engine-wide ----------------------------------------------------------------------
    def alive(self) -> bool:
        """Cheap liveness (what /health reports): no round trip behind a busy engine step where
        the runtime can tell without one."""
        probe = getattr(self._rt, "alive", None)
        if probe is not None:
            return probe()
        self.stats()
        return True

    def stats(self) -> dict[str, Any]:
        return self._rt.call("stats")

    def check_integrity(self) -> None:
        self._rt.call("check_integrity")

    def drain_replica(self, slot: int, replace: bool = True) -> dict:
        """A replicated deployment (``replicas=N``): replica ``slot`` takes no new request, stops
        once what it holds has finished, and (``replace``) a fresh replica takes its slot — a
        rolling restart that fails nothing. Returns the slot's replica (``stats()["replicas"]``'s
        fields). RequestError on an engine without replicas."""
        drain = getattr(self._rt, "drain", None)
        if drain is None:
            raise RequestError("this engine has no replicas (Engine.start(..., transport='ray', replicas=N))")
        return drain(slot, replace)

    def drop_caches(self) -> None:
        self._rt.call("drop_caches")

    def shutdown(self) -> None:
        self._rt.shutdown()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


# the documented defaults of generate / chat for the sampling values a model may set
PY_DEFAULTS = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def _params(max_tokens, temperature, top_p, top_k, seed, stop_token_ids, ignore_eos, presence_penalty,
            frequency_penalty, repetition_penalty, logprobs, min_p=0.0, min_tokens=0, logit_bias=None,
            allowed_token_ids=None, bad_words=None, structured=None, prompt_logprobs=None) -> SamplingParams:
    try:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
            stop_token_ids=tuple(stop_token_ids or ()), ignore_eos=ignore_eos,
            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty, logprobs=logprobs, min_p=min_p, min_tokens=min_tokens,
            logit_bias=tuple(sorted((int(t), float(b)) for t, b in (logit_bias or {}).items())),
            allowed_token_ids=tuple(allowed_token_ids or ()),
            bad_words=tuple(tuple(w) for w in bad_words or ()), structured=structured,
            prompt_logprobs=prompt_logprobs)
    except (TypeError, ValueError) as exc:
        raise RequestError(f"sampling options: {exc}") from None
    if (logprobs is not None or prompt_logprobs is not None or logit_bias or allowed_token_ids or bad_words
            or min_tokens or min_p):
        # here, not only at the intake: over Ray a value of the wrong type would otherwise
        # fail to decode instead of giving this request a clear RequestError
        params.validate()
    return params


def connect(address: str = "auto", deployment: str = "ninfer", model_dir: str | None = None,
            generation_config: str = "vllm") -> Engine:
    """A client handle to an engine already serving on a Ray cluster (``generation_config``: as
    in ``Engine.start``)."""
    from ninfer.actors.client import RayClientRuntime
    rt = RayClientRuntime.connect(address, deployment)
    config = _deployment_config(rt)
    return Engine(rt, model_dir or rt.model_dir, "ray", config.media_budget_bytes if config else None,
                  generation_config, config)


def _deployment_config(rt) -> EngineConfig | None:
    """The EngineConfig a running deployment was started with (its frontend keeps it encoded;
    a replicated one inside its identity, ``[config, replicas, router]``); None when it cannot
    say."""
    import ray
    try:
        raw = ray.get(rt.frontend.config.remote())
        try:
            return msgspec.msgpack.decode(raw, type=EngineConfig)
        except msgspec.ValidationError:
            return msgspec.msgpack.decode(msgspec.msgpack.decode(raw, type=list)[0], type=EngineConfig)
    except Exception:                 # noqa: BLE001 — an older frontend, or a config that no longer decodes
        return None
