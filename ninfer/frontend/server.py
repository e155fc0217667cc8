"""``ninfer serve``: an OpenAI-compatible HTTP server (Starlette on uvicorn + uvloop).

    POST /v1/chat/completions   stream (SSE) and non-stream, tools + tool_choice, n, logprobs
    POST /v1/completions        the legacy endpoint: text or token prompts, echo, logprobs
    POST /v1/responses          store, previous_response_id, stream; GET / DELETE
                                /v1/responses/{id}, GET /v1/responses/{id}/input_items
    GET  /v1/models, /v1/models/{id}; POST /tokenize, /detokenize; GET /version, /health,
         /metrics (Prometheus)

Nothing CPU-heavy runs on the event loop: rendering, tokenising and every engine call run on a
bounded thread pool, and work that grows with one request's input (decoding a body over 1 MiB,
rendering and tokenising a large chat or prompt) in a helper process (``offload``). Cheap
limits come first: the body size while it streams in and its read timeout, then right after
decoding the bounds of ``bounds`` (JSON values, names, every free-text field against the
context), the message count. The connection layer's guards are ``http_guard``'s. One error
layer: every failure is OpenAI's error JSON with its status and the connection stays usable. A
client that disconnects cancels its requests in both modes and is one log line. Bound to
127.0.0.1 by default; with an API key every route but the probes (``OPEN``) needs it.
``usage.prompt_tokens_details.cached_tokens`` counts real reuse only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route

from ninfer.api import Engine
from ninfer.errors import NInferError
from ninfer.frontend import offload
from ninfer.frontend import anthropic as A
from ninfer.frontend import openai_api as oa
from ninfer.frontend import responses as R
from ninfer.frontend import schema as S
from ninfer.frontend.bounds import BodyBounds, decode_checked
from ninfer.frontend.http_guard import Limits, protocol_class
from ninfer.frontend.offload import INLINE_BODY_BYTES, INLINE_TEXT_CHARS, HelperLost, Refusal
from ninfer.frontend.request_stats import Histogram
from ninfer.frontend.metrics import CONTENT_TYPE as METRICS_TYPE
from ninfer.frontend.metrics import prometheus
from ninfer.frontend.streaming import ChoiceStream, Finish, Piece, run_choice
from ninfer.sampling_params import MAX_SEED

log = logging.getLogger("ninfer.server")
MAX_N = 16
MAX_CHOICES = 64                       # legacy completions: prompts x n


class Disconnected(Exception):
    pass


@dataclass
class Choice:
    """What one engine request of a response needs: how to submit it and how to read it."""

    submit: object                       # () -> RequestHandle, run on the intake pool
    stop: list[str]
    parse_tools: bool
    handle: object = None
    cancelled: bool = False              # cancelled by its client (Responses cancel)


@dataclass
class Collected:
    content: list[str] = field(default_factory=list)
    calls: list[dict] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    fin: Finish | None = None

    def add(self, piece: Piece) -> None:
        self.content.append(piece.content)
        self.calls += piece.calls
        self.logprobs += piece.logprobs

    @property
    def text(self) -> str:
        return "".join(self.content)


class Server:
    def __init__(self, engine: Engine, model_name: str, api_key: str | None = None,
                 max_body_bytes: int = 16 << 20, store_bytes: int = 64 << 20, default_max_tokens: int = 256,
                 max_messages: int = 4096, intake_threads: int = 4, aliases: list[str] | None = None,
                 limits: Limits | None = None):
        self.engine = engine
        self.limits = limits or Limits()
        self.model = model_name
        self.names = [model_name, *(aliases or [])]     # --served-model-name: every name is accepted
        self.api_key = api_key
        self.max_body = max_body_bytes
        self.max_messages = max_messages
        self.store = R.ResponseStore(store_bytes)
        self.default_max = default_max_tokens
        self.started = oa.now()
        self.pool = ThreadPoolExecutor(intake_threads, thread_name_prefix="ninfer-intake")
        # the probes never wait behind the intake threads (each may wait on a large input)
        self.probes = ThreadPoolExecutor(2, thread_name_prefix="ninfer-probe")
        self.offload = offload.shared()
        self.params_n = Histogram((1, 2, 5, 10, 20))      # vllm:request_params_n
        self.tok = engine._intake.tokenizer if engine._intake is not None else None
        self.max_token_chars = _max_token_chars(self.tok)
        max_context = engine.info.max_context
        self.bounds = BodyBounds(max_text_chars=max_context * min(self.max_token_chars, 1 << 20),
                                 max_context=max_context)
        self._token_strs: dict[int, str] = {}
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self._endpoint(self.chat), methods=["POST"]),
            Route("/v1/completions", self._endpoint(self.completions), methods=["POST"]),
            Route("/v1/responses", self._endpoint(self.responses), methods=["POST"]),
            Route("/v1/responses/{rid}", self._endpoint(self.response_get), methods=["GET"]),
            Route("/v1/responses/{rid}", self._endpoint(self.response_delete), methods=["DELETE"]),
            Route("/v1/responses/{rid}/input_items", self._endpoint(self.response_items), methods=["GET"]),
            Route("/v1/responses/{rid}/cancel", self._endpoint(self.response_cancel), methods=["POST"]),
            Route("/v1/messages", self._endpoint(self.messages, _anthropic_error), methods=["POST"]),
            Route("/v1/models", self._endpoint(self.models), methods=["GET"]),
            Route("/v1/models/{model:path}", self._endpoint(self.model_get), methods=["GET"]),
            Route("/tokenize", self._endpoint(self.tokenize), methods=["POST"]),
            Route("/detokenize", self._endpoint(self.detokenize), methods=["POST"]),
            Route("/version", self._endpoint(self.version), methods=["GET"]),
            Route("/health", self._endpoint(self.health), methods=["GET"]),
            Route("/ping", self._endpoint(self.health), methods=["GET", "POST"]),
            Route("/load", self._endpoint(self.server_load), methods=["GET"]),
            Route("/metrics", self._endpoint(self.metrics), methods=["GET"]),
            Route("/openapi.json", self._endpoint(self.openapi), methods=["GET"]),
            Route("/docs", self._endpoint(self.docs), methods=["GET"]),
        ], exception_handlers={HTTPException: self._http_error, Exception: self._internal_error})
        self.load = 0                                  # generation requests being answered (/load)
        self.app = self._counting(self.app)
        self.background: dict[str, tuple[Choice, asyncio.Task]] = {}   # Responses with background=true

    # ---- the error layer ----------------------------------------------------------------------
    def _endpoint(self, fn, render=None):
        """``fn`` behind the key, every failure one error response (``render``: its shape,
        OpenAI's by default)."""
        render = render or _error

        async def run(request: Request) -> Response:
            try:
                self._authorize(request)
                return await fn(request)
            except oa.ApiError as exc:
                return render(exc)
            except NInferError as exc:
                return render(oa.request_error(exc))
            except (Disconnected, ClientDisconnect):
                _gone(request)
                return Response(status_code=499)            # nobody reads it
            except Exception as exc:                       # a bug: say so, keep serving
                log.exception("internal error on %s", request.url.path)
                return render(_internal(exc))
        return run

    def _counting(self, app):
        """The ASGI app that counts the generation requests being answered (a stream until its
        last byte), vLLM's ``/load``."""
        async def counted(scope, receive, send):
            if scope["type"] != "http" or scope["path"] not in GENERATION:
                return await app(scope, receive, send)
            self.load += 1
            try:
                await app(scope, receive, send)
            finally:
                self.load -= 1
        return counted

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        """Unknown routes and wrong methods, in the OpenAI shape."""
        if exc.status_code == 404:
            err = oa.not_found(f"no route {request.method} {request.url.path}")
        elif exc.status_code == 405:
            err = oa.ApiError(405, f"method {request.method} is not allowed on {request.url.path}",
                              headers=exc.headers)
        else:
            err = oa.ApiError(exc.status_code, str(exc.detail))
        return _error(err)

    async def _internal_error(self, request: Request, exc: Exception) -> Response:
        if isinstance(exc, (ClientDisconnect, Disconnected)):
            _gone(request)
            return Response(status_code=499)
        log.exception("internal error on %s", request.url.path)
        return _error(_internal(exc))

    def _authorize(self, request: Request) -> None:
        """With an API key every route but the probes (``OPEN``) needs it: ``Authorization:
        Bearer KEY`` (OpenAI's clients) or ``x-api-key: KEY`` (Anthropic's)."""
        if self.api_key is None or request.url.path in OPEN:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:] if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
        if not secrets.compare_digest(given.encode(), self.api_key.encode()):
            raise oa.ApiError(401, "invalid or missing API key", kind="authentication_error",
                              code="invalid_api_key")

    async def _json(self, request: Request) -> dict:
        """The body as a JSON object: content type checked, size bounded while it streams in."""
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype and ctype != "application/json" and not ctype.endswith("+json"):
            raise oa.ApiError(415, f"the request body must be application/json (got Content-Type {ctype!r})")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            raise oa.ApiError(413, f"request body of {declared} bytes exceeds the limit of {self.max_body}")
        chunks, size = [], 0
        wait = self.limits.read_timeout_s
        try:
            async with asyncio.timeout(wait):           # a body sent too slowly (or never) is a 408
                async for part in request.stream():
                    size += len(part)
                    if size > self.max_body:
                        raise oa.ApiError(413, f"request body exceeds the limit of {self.max_body} bytes")
                    chunks.append(part)
        except TimeoutError:
            log.info("client %s did not send its request body within %g s: 408", _peer(request), wait)
            raise oa.ApiError(408, f"the request body did not arrive within {wait:g} s ({size} bytes came)",
                              code="request_timeout", headers={"connection": "close"}) from None
        raw = b"".join(chunks)
        del chunks
        if len(raw) > INLINE_BODY_BYTES:          # decoding many values holds the GIL: the helper's work
            body, refusal = await self._offloaded(decode_checked, raw, self.bounds)
        else:
            body, refusal = decode_checked(raw, self.bounds, trim=False)[1]
        if refusal is not None and refusal.message.startswith("malformed JSON") and b"\\ud" in raw.lower():
            refusal = refusal._replace(message=refusal.message + " (a lone UTF-16 surrogate escape such as \\ud800 "
                                                                 "is not valid text)")
        if len(raw) > INLINE_BODY_BYTES:          # the bytes go, and the heap they took with them
            del raw
            offload.trim()
        if refusal is not None:
            raise oa.ApiError(refusal.status, refusal.message, param=refusal.param, code=refusal.code)
        if not isinstance(body, dict):
            raise oa.bad("the request body must be a JSON object")
        return body

    async def _offloaded(self, fn, *args):
        """``fn(*args)`` in the helper process: its value or its Refusal; a lost helper is a 503."""
        try:
            return await self.offload.run_async(fn, *args)
        except HelperLost as exc:
            raise oa.ApiError(503, str(exc), kind="service_unavailable") from None

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.names:
            raise oa.ApiError(404, f"The model `{model}` does not exist.", kind="not_found_error", param="model",
                              code="model_not_found")

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, partial(fn, *args))

    async def _probe(self, fn):
        return await asyncio.get_running_loop().run_in_executor(self.probes, fn)

    async def _tokens(self, text: str | None, messages: list[dict] | None = None, tools: list[dict] | None = None,
                      add_generation_prompt: bool = True, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text or of rendered messages, at most max_context of them (vLLM refuses
        more, as the engine would): a small input on the intake threads (the encoding releases
        the GIL), a large one in the helper process."""
        args = (text, messages, tools, add_generation_prompt, add_special_tokens, self.engine.info.max_context)
        size = len(text) if text is not None else len(msgspec.json.encode([messages, tools]))
        if size <= INLINE_TEXT_CHARS:
            value = await self._off_loop(offload.tokenize_with, self.tok, *args)
            value = value[1]
        else:
            value = await self._offloaded(offload.tokenize_job, self.engine.model_dir, *args)
        if isinstance(value, Refusal):
            raise oa.ApiError(value.status, value.message, param=value.param, code=value.code)
        return value

    # ---- shared request parts -------------------------------------------------------------------
    def _sampling(self, req: S.Sampling, max_tokens: int | None, default_max: int, n: int | None) -> dict:
        if n is not None and not 1 <= n <= MAX_N:
            raise oa.bad(f"n must be between 1 and {MAX_N} (got {n})", "n")
        top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
        return dict(max_tokens=max_tokens or default_max, fill_max_tokens=max_tokens is None,
                    temperature=1.0 if req.temperature is None else req.temperature,
                    top_p=1.0 if req.top_p is None else req.top_p, top_k=top_k,
                    seed=secrets.randbelow(MAX_SEED) if req.seed is None else req.seed,
                    presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                    repetition_penalty=req.repetition_penalty or 1.0, ignore_eos=bool(req.ignore_eos))

    @staticmethod
    def _stop(req: S.Sampling) -> list[str]:
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > 4:
            raise oa.bad(f"stop: at most 4 stop strings are allowed, got {len(stop)}", "stop")
        return stop

    def _bound_prompt(self, messages: list[S.Message]) -> None:
        """Cheap limits before any rendering: the message count, and the prompt's characters
        against the context (no token is longer than ``max_token_chars`` characters)."""
        if len(messages) > self.max_messages:
            raise oa.bad(f"messages: at most {self.max_messages} messages are allowed, got {len(messages)}",
                         "messages")
        chars = 0
        for m in messages:
            c = m.content
            chars += len(c) if isinstance(c, str) else sum(len(p.text) for p in c or () if isinstance(p, S.TextPart))
        least = chars // self.max_token_chars
        if least > self.engine.info.max_context:
            raise oa.bad(f"this engine's max_context is {self.engine.info.max_context} tokens, but the messages "
                         f"have {chars} characters (at least {least} tokens)", "messages")

    def _token_str(self, tid: int) -> str:
        s = self._token_strs.get(tid)
        if s is None:
            s = self._token_strs[tid] = self.tok.decode([tid], skip_special_tokens=False) if self.tok else str(tid)
        return s

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids) if self.tok is not None and ids else ""

    def _submit_all(self, choices: list[Choice]) -> None:
        """Submit every choice (on the intake pool); one that cannot be submitted cancels the
        ones before it and fails the response."""
        try:
            for c in choices:
                c.handle = c.submit()
        except NInferError as exc:
            for c in choices:
                if c.handle is not None:
                    c.handle.cancel()
            raise oa.request_error(exc) from None

    async def _drive(self, choices: list[Choice], request: Request):
        """(index, Piece | Finish) of every choice as they come; Disconnected when the client
        goes away (its requests are cancelled)."""
        queue: asyncio.Queue = asyncio.Queue()
        gone = object()

        async def pump(i: int, c: Choice) -> None:
            try:
                async for item in run_choice(c.handle, ChoiceStream(self._decode, c.stop, c.parse_tools)):
                    queue.put_nowait((i, item))
            except Exception as exc:                        # a bug in one choice fails that choice
                log.exception("choice %d failed", i)
                queue.put_nowait((i, exc))

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            queue.put_nowait(gone)

        tasks = [asyncio.create_task(pump(i, c)) for i, c in enumerate(choices)]
        watcher = asyncio.create_task(watch()) if request is not None else None    # None: no client (background)
        left, done = len(choices), False
        try:
            while left:
                item = await queue.get()
                if item is gone:
                    raise Disconnected
                if isinstance(item[1], Exception):
                    raise item[1]
                if isinstance(item[1], Finish):
                    left -= 1
                yield item
            done = True
        except (Disconnected, asyncio.CancelledError):     # the client left (a stream is cancelled)
            if request is not None:
                _gone(request)
            raise
        finally:
            if watcher is not None:
                watcher.cancel()
            for t in tasks:
                t.cancel()
            if not done:
                for c in choices:
                    c.handle.cancel()

    async def _collect(self, choices: list[Choice], request: Request) -> list[Collected] | None:
        got = [Collected() for _ in choices]
        try:
            async for i, item in self._drive(choices, request):
                if isinstance(item, Finish):
                    got[i].fin = item
                else:
                    got[i].add(item)
        except Disconnected:
            return None
        failed = next((g.fin for g in got if g.fin.reason == "error"), None)
        if failed is not None:
            raise oa.engine_error(failed.out)
        return got

    # ---- chat completions ----------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        body = await self._json(request)
        req: S.ChatRequest = S.convert(body, S.ChatRequest)
        self._check_model(req.model)
        if not req.messages:
            raise oa.bad("messages must be a non-empty list", "messages")
        S.check_media(req.messages, images=bool(self.engine.info.vision_merge))
        self._bound_prompt(req.messages)
        if req.response_format is not None and req.response_format.type != "text":
            raise oa.bad(f"response_format {req.response_format.type!r} is not supported: NInfer has no "
                         "constrained decoding yet", "response_format")
        if req.top_logprobs is not None and not req.logprobs:
            raise oa.bad("top_logprobs requires logprobs to be true", "top_logprobs")
        choice = _tool_choice(req.tool_choice, req.tools)
        tools = body.get("tools") if choice != "none" else None
        sampling = self._sampling(req, req.max_completion_tokens or req.max_tokens, self.default_max, req.n)
        self.params_n.observe(req.n or 1)
        if req.logprobs:
            sampling["logprobs"] = req.top_logprobs or 0
        stop = self._stop(req)
        session = req.prompt_cache_key or req.user
        n = req.n or 1
        choices = [Choice(partial(self.engine.chat, body["messages"], tools=tools or None, session_id=session,
                                  **_nth_seed(sampling, i)), stop, bool(tools)) for i in range(n)]
        await self._off_loop(self._submit_all, choices)
        rid, created = choices[0].handle.rid, oa.now()
        ctx = ChatCtx(rid, created, choice, req)
        if req.stream:
            return _sse_response(self._chat_stream(choices, ctx, request))
        got = await self._collect(choices, request)
        if got is None:
            return Response(status_code=499)
        out = []
        for i, g in enumerate(got):
            _verify_tool_choice(choice, g.calls)
            msg = oa.chat_message("" if choice not in ("auto", "none") and g.calls else g.text, g.calls)
            out.append({"index": i, "message": msg, "finish_reason": g.fin.reason,
                        "logprobs": oa.chat_logprobs(g.logprobs, self._token_str, req.top_logprobs or 0)
                        if req.logprobs else None})
        usage = oa.usage_block(got[0].fin.out.usage, sum(g.fin.completion_tokens for g in got))
        return JSONResponse(oa.chat_completion(rid, self.model, created, out, usage))

    async def _chat_stream(self, choices: list[Choice], ctx: ChatCtx, request: Request):
        rid, created, req = ctx.rid, ctx.created, ctx.req
        content_ok = ctx.tool_choice in ("auto", "none")
        ncalls = [0] * len(choices)
        calls: list[list[dict]] = [[] for _ in choices]
        fins: list[Finish | None] = [None] * len(choices)
        opened = [False] * len(choices)

        def role(i: int) -> str:          # a choice opens with its first token, as vLLM's do
            opened[i] = True
            return _sse(oa.chunk(rid, self.model, created, {"role": "assistant", "content": ""}, index=i))
        try:
            async for i, item in self._drive(choices, request):
                if isinstance(item, Finish):
                    fins[i] = item
                    if item.reason == "error":
                        yield _sse(oa.engine_error(item.out).body())
                        yield "data: [DONE]\n\n"
                        return
                    continue
                if not opened[i]:
                    yield role(i)
                delta: dict = {}
                if item.content and content_ok:
                    delta["content"] = item.content
                if item.calls:
                    delta["tool_calls"] = oa.tool_call_deltas(item.calls, ncalls[i])
                    ncalls[i] += len(item.calls)
                    calls[i] += item.calls
                lp = oa.chat_logprobs(item.logprobs, self._token_str, req.top_logprobs or 0) \
                    if req.logprobs and item.logprobs else None
                if delta or lp:
                    yield _sse(oa.chunk(rid, self.model, created, delta, index=i, logprobs=lp))
        except Disconnected:
            return
        for i, fin in enumerate(fins):
            try:
                _verify_tool_choice(ctx.tool_choice, calls[i])
            except oa.ApiError as exc:
                yield _sse(exc.body())
                yield "data: [DONE]\n\n"
                return
            if not opened[i]:                                # it ended without a token
                yield role(i)
            yield _sse(oa.chunk(rid, self.model, created, {}, fin.reason, index=i))
        if req.stream_options is not None and req.stream_options.include_usage:
            final = oa.chunk(rid, self.model, created, {})
            final["choices"] = []
            final["usage"] = oa.usage_block(fins[0].out.usage, sum(f.completion_tokens for f in fins))
            yield _sse(final)
        yield "data: [DONE]\n\n"

    # ---- legacy completions ----------------------------------------------------------------------
    async def _prompts(self, prompt) -> list[list[int]]:
        """Text or token prompts -> token ids (``_tokens``), each at most max_context."""
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            prompt = [prompt]
        if not prompt:
            raise oa.bad("prompt must not be empty", "prompt")
        if not all(isinstance(p, str) for p in prompt) and not all(isinstance(p, list) for p in prompt):
            raise oa.bad("prompt must be a string, a list of token ids, or a list of strings or of token-id lists",
                         "prompt")
        out = []
        for p in prompt:
            if isinstance(p, str):
                if self.tok is None:
                    raise oa.bad("this model has no tokenizer; send token ids as the prompt", "prompt")
                p = await self._tokens(p)
            if not p:
                raise oa.bad("prompt must not be empty", "prompt")
            out.append(list(p))
        return out

    async def completions(self, request: Request) -> Response:
        body = await self._json(request)
        req: S.CompletionRequest = S.convert(body, S.CompletionRequest)
        self._check_model(req.model)
        if req.suffix:
            raise oa.bad("suffix is not supported", "suffix")
        if req.echo and req.logprobs is not None:
            raise oa.bad("echo with logprobs (prompt logprobs) is not supported", "echo")
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise oa.bad("best_of must equal n (NInfer returns every sample)", "best_of")
        sampling = self._sampling(req, req.max_tokens, 16, req.n)
        sampling.pop("fill_max_tokens")
        self.params_n.observe(req.n or 1)
        if req.logprobs is not None:
            sampling["logprobs"] = req.logprobs
        stop, n = self._stop(req), req.n or 1
        prompts = await self._prompts(req.prompt)
        if len(prompts) * n > MAX_CHOICES:
            raise oa.bad(f"at most {MAX_CHOICES} choices (prompts x n) are allowed", "prompt")
        choices = [Choice(partial(self.engine.generate, p, session_id=req.user, **_nth_seed(sampling, i)), stop, False)
                   for p in prompts for i in range(n)]
        await self._off_loop(self._submit_all, choices)
        rid, created = choices[0].handle.rid, oa.now()
        echo = [self._decode(p) if req.echo else "" for p in prompts for _ in range(n)]
        if req.stream:
            return _sse_response(self._completion_stream(choices, rid, created, req, echo, request))
        got = await self._collect(choices, request)
        if got is None:
            return Response(status_code=499)
        out = [{"index": i, "text": echo[i] + g.text, "finish_reason": g.fin.reason,
                "logprobs": oa.completion_logprobs(g.logprobs, self._token_str, len(echo[i]))
                if req.logprobs is not None else None} for i, g in enumerate(got)]
        firsts = [got[k * n].fin.out for k in range(len(prompts))]
        usage = oa.usage_block(oa.prompt_usage(firsts), sum(g.fin.completion_tokens for g in got))
        return JSONResponse(oa.completion(rid, self.model, created, out, usage))

    async def _completion_stream(self, choices, rid, created, req: S.CompletionRequest, echo, request):
        fins: list[Finish | None] = [None] * len(choices)
        offsets = [len(e) for e in echo]

        def part(i: int, text: str, reason=None, lps=None) -> str:
            return _sse(oa.completion(rid, self.model, created, [{"index": i, "text": text, "logprobs": lps,
                                                                  "finish_reason": reason}], None))
        echoed = [not e for e in echo]            # the echo goes out with the first token, not before
        try:
            async for i, item in self._drive(choices, request):
                if not echoed[i] and not (isinstance(item, Finish) and item.reason == "error"):
                    echoed[i] = True
                    yield part(i, echo[i])
                if isinstance(item, Finish):
                    fins[i] = item
                    if item.reason == "error":
                        yield _sse(oa.engine_error(item.out).body())
                        yield "data: [DONE]\n\n"
                        return
                    yield part(i, "", item.reason)
                    continue
                lps = None
                if req.logprobs is not None and item.logprobs:
                    lps = oa.completion_logprobs(item.logprobs, self._token_str, offsets[i])
                offsets[i] += len(item.content)
                if item.content or lps:
                    yield part(i, item.content, None, lps)
        except Disconnected:
            return
        if req.stream_options is not None and req.stream_options.include_usage:
            n = req.n or 1
            firsts = [fins[k].out for k in range(0, len(fins), n)]
            usage = oa.usage_block(oa.prompt_usage(firsts), sum(f.completion_tokens for f in fins))
            yield _sse(oa.completion(rid, self.model, created, [], usage))
        yield "data: [DONE]\n\n"

    # ---- responses ---------------------------------------------------------------------------------
    async def responses(self, request: Request) -> Response:
        body = await self._json(request)
        req: S.ResponsesRequest = S.convert(body, S.ResponsesRequest)
        self._check_model(req.model)
        call = R.parse_responses(req, self.store)
        _tool_choice(call.tool_choice if call.tool_choice != "none" else None, call.tools)
        sampling = self._sampling(req, req.max_output_tokens, self.default_max, None)
        choice = Choice(partial(self.engine.chat, call.messages, tools=call.tools,
                                session_id=req.prompt_cache_key or req.user, **sampling), [], bool(call.tools))
        background = body.get("background") is True
        if background and (req.stream or not call.store):
            raise oa.bad("background requires store (not false) and no stream", "background")
        await self._off_loop(self._submit_all, [choice])
        rid, created = f"resp_{uuid.uuid4().hex}", oa.now()
        if req.stream:
            return _sse_response(self._responses_stream(choice, call, rid, created, request))
        if background:                    # answered now; GET /v1/responses/{id} shows its progress
            obj = R.response_object(rid, self.model, created, call, [], "in_progress", None, 0)
            obj["background"] = True
            self.store.put(rid, obj, list(call.history), call.input_items)
            task = asyncio.create_task(self._finish_background(choice, call, rid, created))
            self.background[rid] = (choice, task)
            return JSONResponse(obj)
        got = await self._collect([choice], request)
        if got is None:
            return Response(status_code=499)
        return JSONResponse(self._response_done(got[0], call, rid, created))

    def _response_done(self, g: Collected, call: R.ResponsesCall, rid: str, created: int,
                       cancelled: bool = False) -> dict:
        if not cancelled:
            _verify_tool_choice(call.tool_choice, g.calls)
        status = "cancelled" if cancelled else "incomplete" if g.fin.reason == "length" else "completed"
        items = R.output_items(g.text, g.calls, "incomplete" if cancelled else status)
        obj = R.response_object(rid, self.model, created, call, items, status, g.fin.out.usage,
                                g.fin.completion_tokens, "max_output_tokens")
        self._keep(rid, call, obj, g.text, g.calls)
        return obj

    async def _finish_background(self, choice: Choice, call: R.ResponsesCall, rid: str, created: int) -> None:
        """A background response runs without its client; its end replaces the stored object."""
        try:
            got = await self._collect([choice], None)
            obj = self._response_done(got[0], call, rid, created, cancelled=choice.cancelled)
        except oa.ApiError as exc:
            obj = {**self.store.response(rid), "status": "failed",
                   "error": {"code": exc.code or exc.kind, "message": str(exc)}}
            self.store.put(rid, obj, list(call.history), call.input_items)
        except Exception:
            log.exception("background response %s failed", rid)
            obj = {**self.store.response(rid), "status": "failed", "error": {"code": "internal_error",
                                                                             "message": "internal error"}}
            self.store.put(rid, obj, list(call.history), call.input_items)
        finally:
            self.background.pop(rid, None)
        obj["background"] = True

    async def response_cancel(self, request: Request) -> Response:
        """Cancel a background response in progress (as OpenAI and vLLM: only those can be)."""
        rid = request.path_params["rid"]
        running = self.background.get(rid)
        if running is None:
            obj = self.store.response(rid)              # 404 when unknown
            raise oa.bad(f"response {rid!r} is {obj['status']}: only a background response in progress can be "
                         "cancelled", "response_id")
        choice, task = running
        choice.cancelled = True
        choice.handle.cancel()
        await asyncio.wait_for(asyncio.shield(task), 60.0)
        return JSONResponse(self.store.response(rid))

    # ---- Anthropic messages ----------------------------------------------------------------------------
    async def messages(self, request: Request) -> Response:
        """``POST /v1/messages`` (``frontend/anthropic.py``): the chat path under Anthropic's shapes."""
        body = await self._json(request)
        req = A.convert(body)
        self._check_model(req.model)
        messages, tools, choice = A.chat_input(req)
        if len(messages) > self.max_messages:
            raise oa.bad(f"messages: at most {self.max_messages} messages are allowed, got {len(messages)}",
                         "messages")
        if choice != "none":
            choice = _tool_choice(choice, tools)
        stop = list(req.stop_sequences or [])
        if len(stop) > 16:
            raise oa.bad(f"stop_sequences: at most 16 are allowed, got {len(stop)}", "stop_sequences")
        user = (req.metadata or {}).get("user_id")
        sampling = {**A.sampling(req), "seed": secrets.randbelow(MAX_SEED)}
        used = tools if choice != "none" else None
        c = Choice(partial(self.engine.chat, messages, tools=used, session_id=user if isinstance(user, str) else None,
                           **sampling), stop, bool(used))
        self.params_n.observe(1)
        await self._off_loop(self._submit_all, [c])
        mid = A.new_id()
        if req.stream:
            return _sse_response(self._messages_stream(c, choice, mid, request))
        got = await self._collect([c], request)
        if got is None:
            return Response(status_code=499)
        g = got[0]
        _verify_tool_choice(choice, g.calls)
        text = "" if choice not in ("auto", "none") and g.calls else g.text
        return JSONResponse(A.message(mid, self.model, text, g.calls, g.fin.reason, g.fin.stop, g.fin.out.usage,
                                      g.fin.completion_tokens))

    async def _messages_stream(self, c: Choice, choice, mid: str, request: Request):
        ev = A.EventStream(mid, self.model)
        started, calls, fin = False, [], None
        content_ok = choice in ("auto", "none")
        try:
            async for _, item in self._drive([c], request):
                if not started and not (isinstance(item, Finish) and item.reason == "error"):
                    started = True                       # message_start with the first token (honest TTFT)
                    for e in ev.start():
                        yield e
                if isinstance(item, Finish):
                    fin = item
                    continue
                for e in ev.text(item.content if content_ok else ""):
                    yield e
                for call in item.calls:
                    calls.append(call)
                    for e in ev.tool(call):
                        yield e
        except Disconnected:
            return
        if fin.reason == "error":
            yield ev.error(oa.engine_error(fin.out))
            return
        try:
            _verify_tool_choice(choice, calls)
        except oa.ApiError as exc:
            yield ev.error(exc)
            return
        for e in ev.end(fin.reason, fin.stop, A.usage(fin.out.usage, fin.completion_tokens)):
            yield e

    def _keep(self, rid: str, call: R.ResponsesCall, obj: dict, text: str, calls: list[dict]) -> None:
        if call.store:
            self.store.put(rid, obj, R.stored_history(call, text, calls), call.input_items)

    async def _responses_stream(self, choice: Choice, call: R.ResponsesCall, rid: str, created: int,
                                request: Request):
        ev = R.EventStream()
        obj = R.response_object(rid, self.model, created, call, [], "in_progress", None, 0)
        yield ev.event("response.created", response=obj)
        yield ev.event("response.in_progress", response=obj)
        got = Collected()
        try:
            async for _, item in self._drive([choice], request):
                if isinstance(item, Finish):
                    got.fin = item
                    continue
                got.add(item)
                for e in ev.text_delta(item.content):
                    yield e
                for c in item.calls:
                    for e in ev.call(c):
                        yield e
        except Disconnected:
            return
        fin = got.fin
        if fin.reason == "error":
            err = oa.engine_error(fin.out)
            yield ev.event("response.failed", response={**obj, "status": "failed",
                                                        "error": {"code": err.kind, "message": str(err)}})
            return
        try:
            _verify_tool_choice(call.tool_choice, got.calls)
        except oa.ApiError as exc:
            yield ev.event("error", code=exc.code, message=str(exc), param=None)
            return
        status = "incomplete" if fin.reason == "length" else "completed"
        for e in ev.close_message(status):
            yield e
        final = R.response_object(rid, self.model, created, call,
                                  R.output_items(got.text, got.calls, status, ev.msg_id), status,
                                  fin.out.usage, fin.completion_tokens, "max_output_tokens")
        self._keep(rid, call, final, got.text, got.calls)
        yield ev.event("response.completed" if status == "completed" else "response.incomplete", response=final)

    async def response_get(self, request: Request) -> Response:
        return JSONResponse(self.store.response(request.path_params["rid"]))

    async def response_delete(self, request: Request) -> Response:
        rid = request.path_params["rid"]
        self.store.delete(rid)
        return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})

    async def response_items(self, request: Request) -> Response:
        items = list(self.store.input_items(request.path_params["rid"]))
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise oa.bad("order must be 'asc' or 'desc'", "order")
        if order == "desc":
            items.reverse()
        return JSONResponse({"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
                             "last_id": items[-1]["id"] if items else None, "has_more": False})

    # ---- tokenizer and info -----------------------------------------------------------------------
    def _need_tokenizer(self) -> None:
        if self.tok is None:
            raise oa.bad("this model directory has no tokenizer")

    async def tokenize(self, request: Request) -> Response:
        body = await self._json(request)
        req: S.TokenizeRequest = S.convert(body, S.TokenizeRequest)
        self._check_model(req.model)
        self._need_tokenizer()
        if (req.prompt is None) == (req.messages is None):
            raise oa.bad("send exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            S.check_media(req.messages)
            self._bound_prompt(req.messages)
            ids = await self._tokens(None, body["messages"], body.get("tools"), req.add_generation_prompt)
        else:
            ids = await self._tokens(req.prompt, add_special_tokens=req.add_special_tokens)
        return JSONResponse({"count": len(ids), "max_model_len": self.engine.info.max_context, "tokens": list(ids),
                             "token_strs": [self._token_str(t) for t in ids] if req.return_token_strs else None})

    async def detokenize(self, request: Request) -> Response:
        req: S.DetokenizeRequest = S.convert(await self._json(request), S.DetokenizeRequest)
        self._check_model(req.model)
        self._need_tokenizer()
        vocab = self.engine.info.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise oa.bad(f"token id {bad} is out of range: allowed 0..{vocab - 1}", "tokens")
        return JSONResponse({"prompt": await self._off_loop(self.tok.decode, req.tokens)})

    def _model_card(self) -> dict:
        return {"id": self.model, "object": "model", "created": self.started, "owned_by": "ninfer",
                "root": self.engine.model_dir, "parent": None, "max_model_len": self.engine.info.max_context}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{**self._model_card(), "id": name} for name in self.names]})

    async def model_get(self, request: Request) -> Response:
        model = request.path_params["model"]
        self._check_model(model)
        return JSONResponse({**self._model_card(), "id": model})

    async def version(self, request: Request) -> Response:
        from ninfer import __version__
        return JSONResponse({"version": __version__})

    async def health(self, request: Request) -> Response:
        try:
            ok = await asyncio.wait_for(self._probe(self.engine.alive), timeout=5.0)
        except Exception as exc:
            return JSONResponse({"status": "unavailable", "detail": f"{type(exc).__name__}: {exc}"}, status_code=503)
        if not ok:
            return JSONResponse({"status": "unavailable",
                                 "detail": "the engine is not answering (shut down, or its controller is restarting)"},
                                status_code=503)
        return JSONResponse({"status": "ok"})

    async def server_load(self, request: Request) -> Response:
        return JSONResponse({"server_load": self.load})

    async def openapi(self, request: Request) -> Response:
        from ninfer.frontend.openapi import spec
        return JSONResponse(spec(self.model))

    async def docs(self, request: Request) -> Response:
        from ninfer.frontend.openapi import DOCS_HTML
        return HTMLResponse(DOCS_HTML)

    async def metrics(self, request: Request) -> Response:
        try:
            stats = await self._probe(self.engine.stats)
        except Exception as exc:
            return PlainTextResponse(f"# engine unavailable: {exc}\n", status_code=503)
        return Response(prometheus(stats, len(self.store), self.model, self.engine.info,
                                   {"params_n": self.params_n.snapshot()}), media_type=METRICS_TYPE)


@dataclass
class ChatCtx:
    rid: str
    created: int
    tool_choice: object
    req: S.ChatRequest


OPEN = frozenset({"/health", "/ping", "/metrics", "/version", "/load", "/docs", "/openapi.json"})  # no API key
GENERATION = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"})


def _anthropic_error(exc: oa.ApiError) -> JSONResponse:
    return JSONResponse(A.error_body(exc), status_code=exc.status, headers=exc.headers)


def _peer(request: Request) -> str:
    client = request.client
    return f"{client.host}:{client.port}" if client else "?"


def _gone(request: Request) -> None:
    """A client that went away is a line, not a traceback: it is no server error."""
    log.info("client %s went away during %s %s", _peer(request), request.method, request.url.path)


def _internal(exc: Exception) -> oa.ApiError:
    return oa.ApiError(500, f"internal error: {type(exc).__name__}: {exc}", kind="internal_error")


def _tool_choice(choice, tools) -> str | dict:
    """'none' | 'auto' | 'required' | {"type": "function", "function": {"name": ...}}, checked
    against the tools of the request."""
    if choice is None:
        return "auto"
    if isinstance(choice, S.NamedToolChoice):
        choice = {"type": "function", "function": {"name": choice.function.name}}
    if choice in ("none", "auto"):
        return choice
    if not tools:
        raise oa.bad("tool_choice requires tools", "tool_choice")
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        names = [t.function.name if isinstance(t, S.Tool) else t["function"]["name"] for t in tools]
        if name not in names:
            raise oa.bad(f"tool_choice names the function {name!r}, which is not among the tools", "tool_choice")
    return choice


def _verify_tool_choice(choice, calls: list[dict]) -> None:
    """``required`` and a named function are verified (NInfer does not constrain decoding yet):
    an answer without the call is a 422 instead of a silently different reply."""
    if choice == "required" and not calls:
        raise oa.ApiError(422, "tool_choice is 'required' but the model answered without a tool call "
                               "(NInfer verifies tool_choice; it does not constrain decoding)",
                          code="tool_choice_not_satisfied", param="tool_choice")
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if not any(c["function"]["name"] == name for c in calls):
            raise oa.ApiError(422, f"tool_choice names {name!r} but the model did not call it "
                                   "(NInfer verifies tool_choice; it does not constrain decoding)",
                              code="tool_choice_not_satisfied", param="tool_choice")


def _nth_seed(sampling: dict, i: int) -> dict:
    """Choice i of n samples with seed + i (identical for greedy decoding)."""
    return sampling if i == 0 else {**sampling, "seed": (sampling["seed"] + i) % (MAX_SEED + 1)}


def _max_token_chars(tok) -> int:
    """No token decodes to more characters than its longest vocabulary string (byte-level
    vocabularies spell each byte as one character) — the bound behind the cheap length check."""
    if tok is None:
        return 1 << 30
    return max(1, max((len(s) for s in tok.tokenizer.get_vocab(with_added_tokens=True)), default=1))


def _error(exc: oa.ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _sse_response(gen) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream", headers={"cache-control": "no-cache"})


def serve(engine: Engine, model_name: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          max_body_bytes: int = 16 << 20, log_level: str = "warning", max_messages: int = 4096,
          sock=None, aliases: list[str] | None = None, limits: Limits | None = None) -> None:
    """Serve until interrupted; on ``sock`` (bound by the caller, ``serve_flags.bind``) when
    given, else on host:port."""
    import uvicorn

    limits = limits or Limits()
    server = Server(engine, model_name, api_key=api_key, max_body_bytes=max_body_bytes, max_messages=max_messages,
                    aliases=aliases, limits=limits)
    server.offload.warm()                      # the helper for large inputs is up before the first one
    config = uvicorn.Config(server.app, host=host, port=port, loop="uvloop", log_level=log_level,
                            http=protocol_class(limits))
    uvicorn.Server(config).run(sockets=[sock] if sock is not None else None)
