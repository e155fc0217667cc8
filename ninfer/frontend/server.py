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
from ninfer.frontend import options as O
from ninfer.frontend import responses as R
from ninfer.frontend import schema as S
from ninfer.frontend.bounds import BodyBounds, decode_checked
from ninfer.frontend.http_guard import Limits, protocol_class
from ninfer.frontend.intake import RESERVED_TEMPLATE_VARS
from ninfer.frontend.offload import INLINE_BODY_BYTES, INLINE_TEXT_CHARS, HelperLost, Refusal
from ninfer.frontend.request_stats import Histogram
from ninfer.frontend.metrics import CONTENT_TYPE as METRICS_TYPE
from ninfer.frontend.metrics import prometheus
from ninfer.frontend.reasoning import ThinkSplit, choose_parser, starts_inside
from ninfer.frontend.streaming import ChoiceStream, Finish, Piece, run_choice
from ninfer.sampling_params import MAX_SEED

log = logging.getLogger("ninfer.server")
MAX_N = O.MAX_N
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
    shape: O.Shaping = O.Shaping()
    reasoning: bool = False              # split the thinking off (a reasoning parser is on)


@dataclass
class Collected:
    content: list[str] = field(default_factory=list)
    calls: list[dict] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    thought: list[str] = field(default_factory=list)
    fin: Finish | None = None

    def add(self, piece: Piece) -> None:
        self.content.append(piece.content)
        self.calls += piece.calls
        self.logprobs += piece.logprobs
        self.token_ids += piece.token_ids
        self.thought.append(piece.reasoning)

    @property
    def reasoning(self) -> str:
        return "".join(self.thought)

    @property
    def text(self) -> str:
        return "".join(self.content)


class Server:
    def __init__(self, engine: Engine, model_name: str, api_key: str | None = None,
                 max_body_bytes: int = 16 << 20, store_bytes: int = 64 << 20, default_max_tokens: int | None = None,
                 max_messages: int = 4096, intake_threads: int = 4, aliases: list[str] | None = None,
                 limits: Limits | None = None, generation_config: str = "auto", reasoning_parser: str = "auto"):
        """``default_max_tokens``: a chat or Responses answer without max_tokens may use this many
        tokens, capped by the rest of the context (None: the rest of the context, as vLLM).
        ``generation_config``: vLLM's ``--generation-config`` — ``auto`` applies the sampling
        defaults of the model's generation_config.json to what a request leaves unset, ``vllm``
        ignores them, a directory reads that directory's file. ``reasoning_parser``: vLLM's
        ``--reasoning-parser`` (``qwen3``, ``none``, or ``auto``: qwen3 when the chat template
        knows ``<think>``)."""
        self.engine = engine
        self.limits = limits or Limits()
        self.model = model_name
        self.names = [model_name, *(aliases or [])]     # --served-model-name: every name is accepted
        self.api_key = api_key
        self.max_body = max_body_bytes
        self.max_messages = max_messages
        self.store = R.ResponseStore(store_bytes)
        self.default_max = default_max_tokens or engine.info.max_context
        self.gen_defaults = O.generation_defaults(engine.model_dir, generation_config)
        self.started = oa.now()
        self.pool = ThreadPoolExecutor(intake_threads, thread_name_prefix="ninfer-intake")
        # the probes never wait behind the intake threads (each may wait on a large input)
        self.probes = ThreadPoolExecutor(2, thread_name_prefix="ninfer-probe")
        self.offload = offload.shared()
        self.params_n = Histogram((1, 2, 5, 10, 20))      # vllm:request_params_n
        self.tok = engine.tokenizer
        self.max_token_chars = _max_token_chars(self.tok)
        max_context = engine.info.max_context
        self.bounds = BodyBounds(max_text_chars=max_context * min(self.max_token_chars, 1 << 20),
                                 max_context=max_context)
        self.eos_ids = tuple(getattr(engine.info, "eos_ids", ()))
        self.reasoning_parser = choose_parser(reasoning_parser, (self.tok.chat_template or "") if self.tok else "")
        end = self.tok.tokenizer.token_to_id("</think>") if self.tok else None
        self.think_end_id = end
        start = self.tok.tokenizer.token_to_id("<think>") if self.tok else None
        self.think_tags = (start, end) if self.reasoning_parser and start is not None and end is not None else None
        self._book = None
        self.facts = O.ModelFacts(
            vocab_size=engine.info.vocab_size, template=(self.tok.chat_template or "") if self.tok else "",
            adds_special_tokens=bool(self.tok and self.tok.tokenizer.encode("", add_special_tokens=True).ids))
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
            Route("/reset_prefix_cache", self._endpoint(self.reset_prefix_cache), methods=["POST"]),
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
                      add_generation_prompt: bool = True, add_special_tokens: bool = True, limit: bool = True,
                      template_kwargs: dict | None = None, continue_final: bool = False) -> list[int]:
        """Token ids of a text or of rendered messages (with the template's extra variables and
        a continued final message), at most max_context of them (vLLM refuses more, as the
        engine would; ``limit=False``: any number, the caller truncates): a small input on the
        intake threads (the encoding releases the GIL), a large one in the helper process."""
        args = (text, messages, tools, add_generation_prompt, add_special_tokens,
                self.engine.info.max_context if limit else None, template_kwargs, continue_final)
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
        return O.sampling(req, self.facts, max_tokens, default_max, n, self.tok, self.gen_defaults)

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

    def _token_str_of(self, shape: O.Shaping):
        return _as_token_id if shape.tokens_as_ids else self._token_str

    def _token_str(self, tid: int) -> str:
        s = self._token_strs.get(tid)
        if s is None:
            s = self._token_strs[tid] = self.tok.decode([tid], skip_special_tokens=False) if self.tok else str(tid)
        return s

    def _decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens) if self.tok is not None and ids else ""

    def _decoder(self, shape: O.Shaping):
        return self._decode if shape.skip_special_tokens else partial(self._decode, skip_special_tokens=False)

    def book(self):
        """The grammar book of the served model (structured outputs), loaded on first use."""
        if self._book is None:
            from ninfer.structured import book_for
            if self.tok is None:
                raise oa.bad("structured outputs need the model's tokenizer")
            self._book = book_for(self.tok.source, self.engine.info.vocab_size, self.eos_ids)
        return self._book

    def _constraint(self, req: S.Sampling, tool_choice=None, tools=None, parallel: bool = True,
                    think: bool = True) -> dict:
        """``structured=`` for the engine: the request's output format, or the tool-call grammar
        of a ``required`` / named tool_choice (the call is then always made); not both."""
        needs_book = (req.response_format is not None and req.response_format.type != "text") or any(
            getattr(req, k, None) is not None for k in ("structured_outputs", "guided_json", "guided_regex",
                                                        "guided_choice", "guided_grammar"))
        text = getattr(req, "text", None)
        needs_book = needs_book or (text is not None and text.format is not None and text.format.type != "text")
        tags = self.think_tags if think else None
        c = O.constraint(req, self.book() if needs_book else None, tags) if needs_book else None
        forced = tool_choice == "required" or isinstance(tool_choice, dict)
        if forced and c is not None:
            raise oa.bad("a required or named tool_choice already constrains the answer: drop the output format",
                         "tool_choice")
        if forced:
            return self._tool_grammar(tool_choice, tools, parallel, think)
        return {"structured": c} if c is not None else {}

    def _tool_grammar(self, tool_choice, tools, parallel: bool = True, think: bool = True) -> dict:
        """``structured=`` of a ``required`` / named tool_choice (chat, Responses, and
        Anthropic's ``any`` / ``tool``): the tool-call grammar, so the call is always made."""
        if not (tool_choice == "required" or isinstance(tool_choice, dict)):
            return {}
        from ninfer import structured as st
        name = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
        tag = self.tok is not None and self.tok.tokenizer.token_to_id("<tool_call>") is not None
        tags = self.think_tags if think else None
        return {"structured": O.checked(st.tool_calls(tools, name, parallel, tag), self.book(), "tool_choice", tags)}

    def _think_split(self, c: Choice):
        """The choice's reasoning split, starting inside the thinking when the prompt ends in
        ``<think>`` (a template that opens it for the model)."""
        if not c.reasoning or self.reasoning_parser is None:
            return None
        tail = self._decode(_prompt_ids(c.handle)[-4:], skip_special_tokens=False)
        return ThinkSplit(starts_inside(tail))

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
                stream = ChoiceStream(self._decoder(c.shape), c.stop, c.parse_tools, c.shape.include_stop_str,
                                      c.shape.stop_ids, c.shape.min_tokens, self._think_split(c))
                async for item in run_choice(c.handle, stream):
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
        O.refuse_unsupported(req, True, self.facts)
        if req.top_logprobs is not None and not req.logprobs:
            raise oa.bad("top_logprobs requires logprobs to be true", "top_logprobs")
        choice = _tool_choice(req.tool_choice, req.tools)
        tools = body.get("tools") if choice != "none" else None
        sampling = self._sampling(req, req.max_completion_tokens or req.max_tokens, self.default_max, req.n)
        sampling.update(O.template(req, self.facts))
        sampling.update(await self._off_loop(partial(self._constraint, req, choice, body.get("tools"),
                                                     req.parallel_tool_calls is not False)))
        self.params_n.observe(req.n or 1)
        if req.logprobs:
            sampling["logprobs"] = req.top_logprobs or 0
        plp = O.prompt_logprobs(req)
        if plp is not None:
            sampling["prompt_logprobs"] = plp
        stop = self._stop(req)
        session = req.prompt_cache_key or req.user
        n, shape = req.n or 1, O.shaping(req, self.eos_ids)
        think = self.reasoning_parser is not None
        messages = _with_reasoning_content(body["messages"])
        choices = [Choice(partial(self.engine.chat, messages, tools=tools or None, session_id=session,
                                  **_nth_seed(sampling, i)), stop, bool(tools), shape=shape, reasoning=think)
                   for i in range(n)]
        await self._off_loop(self._submit_all, choices)
        rid, created = req.request_id or choices[0].handle.rid, oa.now()
        ctx = ChatCtx(rid, created, choice, req, shape, _chat_echo(req, body["messages"]),
                      think and req.include_reasoning is not False)
        if req.stream:
            return _sse_response(self._chat_stream(choices, ctx, request))
        got = await self._collect(choices, request)
        if got is None:
            return Response(status_code=499)
        out = []
        token_str = self._token_str_of(shape)
        for i, g in enumerate(got):
            calls = g.calls[:1] if shape.first_call_only else g.calls
            msg = oa.chat_message(ctx.echo + ("" if choice not in ("auto", "none") and calls else g.text), calls)
            if ctx.reasoning:
                msg.update(reasoning_content=g.reasoning or None, reasoning=g.reasoning or None)
            out.append({"index": i, "message": msg, "finish_reason": g.fin.reason,
                        "logprobs": oa.chat_logprobs(g.logprobs, token_str, req.top_logprobs or 0)
                        if req.logprobs else None})
            if shape.return_token_ids:
                out[-1]["token_ids"] = g.token_ids
        usage = oa.usage_block(got[0].fin.out.usage, sum(g.fin.completion_tokens for g in got))
        obj = oa.chat_completion(rid, self.model, created, out, usage)
        if plp is not None:               # vLLM's: the prompt's, once for the response
            obj["prompt_logprobs"] = oa.prompt_logprobs(got[0].fin.out.prompt_logprobs, self._token_str)
        if shape.return_token_ids:
            obj["prompt_token_ids"] = _prompt_ids(choices[0].handle)
        return JSONResponse(obj)

    async def _chat_stream(self, choices: list[Choice], ctx: ChatCtx, request: Request):
        rid, created, req, shape = ctx.rid, ctx.created, ctx.req, ctx.shape
        content_ok = ctx.tool_choice in ("auto", "none")
        token_str = self._token_str_of(shape)
        ncalls = [0] * len(choices)
        calls: list[list[dict]] = [[] for _ in choices]
        fins: list[Finish | None] = [None] * len(choices)
        opened = [False] * len(choices)
        prompt = _prompt_ids(choices[0].handle)
        counted = [0] * len(choices)
        usage_each = shape.continuous_usage and req.stream_options.include_usage

        def emit(i: int, delta: dict, reason=None, lp=None, ids=None) -> str:
            ch = oa.chunk(rid, self.model, created, delta, reason, index=i, logprobs=lp)
            if ids is not None:
                ch["choices"][0]["token_ids"] = ids
            if usage_each:
                ch["usage"] = {"prompt_tokens": len(prompt), "completion_tokens": counted[i],
                               "total_tokens": len(prompt) + counted[i]}
            return _sse(ch)

        def open_choice(i: int):
            """A choice opens with its first token, as vLLM's do: the role chunk (with the
            prompt's ids and the usage so far when asked), then a chat echo."""
            opened[i] = True
            first = oa.chunk(rid, self.model, created, {"role": "assistant", "content": ""}, index=i)
            if shape.return_token_ids:
                first["prompt_token_ids"] = prompt
            if usage_each:
                first["usage"] = {"prompt_tokens": len(prompt), "completion_tokens": 0, "total_tokens": len(prompt)}
            yield _sse(first)
            if ctx.echo:
                yield emit(i, {"content": ctx.echo})
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
                    for chunk in open_choice(i):
                        yield chunk
                counted[i] += len(item.token_ids)
                delta: dict = {}
                if item.reasoning and ctx.reasoning:
                    delta["reasoning_content"] = delta["reasoning"] = item.reasoning
                if item.content and content_ok:
                    delta["content"] = item.content
                new_calls = item.calls
                if shape.first_call_only:
                    new_calls = new_calls[:max(0, 1 - ncalls[i])]
                if new_calls:
                    delta["tool_calls"] = oa.tool_call_deltas(new_calls, ncalls[i])
                    ncalls[i] += len(new_calls)
                calls[i] += item.calls
                lp = oa.chat_logprobs(item.logprobs, token_str, req.top_logprobs or 0) \
                    if req.logprobs and item.logprobs else None
                ids = item.token_ids if shape.return_token_ids else None
                if delta or lp or ids:
                    yield emit(i, delta, lp=lp, ids=ids)
        except Disconnected:
            return
        for i, fin in enumerate(fins):
            if not opened[i]:                                # it ended without a token
                for chunk in open_choice(i):
                    yield chunk
            counted[i] = fin.completion_tokens
            yield emit(i, {}, fin.reason)
        if req.stream_options is not None and req.stream_options.include_usage:
            final = oa.chunk(rid, self.model, created, {})
            final["choices"] = []
            final["usage"] = oa.usage_block(fins[0].out.usage, sum(f.completion_tokens for f in fins))
            yield _sse(final)
        yield "data: [DONE]\n\n"

    # ---- legacy completions ----------------------------------------------------------------------
    async def _prompts(self, prompt, add_special_tokens: bool = True, truncate: int | None = None) -> list[list[int]]:
        """Text or token prompts -> token ids (``_tokens``), each at most max_context unless
        ``truncate`` (``truncate_prompt_tokens``) keeps each prompt's last k tokens (-1: max_context)."""
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            prompt = [prompt]
        if not prompt:
            raise oa.bad("prompt must not be empty", "prompt")
        if not all(isinstance(p, str) for p in prompt) and not all(isinstance(p, list) for p in prompt):
            raise oa.bad("prompt must be a string, a list of token ids, or a list of strings or of token-id lists",
                         "prompt")
        keep = self.engine.info.max_context if truncate == -1 else truncate
        out = []
        for p in prompt:
            if isinstance(p, str):
                if self.tok is None:
                    raise oa.bad("this model has no tokenizer; send token ids as the prompt", "prompt")
                p = await self._tokens(p, add_special_tokens=add_special_tokens, limit=keep is None)
            if keep is not None:
                p = p[len(p) - keep:] if keep and len(p) > keep else p
            if not p:
                raise oa.bad("prompt must not be empty", "prompt")
            out.append(list(p))
        return out

    async def completions(self, request: Request) -> Response:
        body = await self._json(request)
        req: S.CompletionRequest = S.convert(body, S.CompletionRequest)
        self._check_model(req.model)
        O.refuse_unsupported(req, False, self.facts)
        # echo with logprobs: the echoed prompt's logprobs are prompt logprobs (as in vLLM)
        plp = O.prompt_logprobs(req, req.logprobs if req.echo else None)
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise oa.bad("best_of must equal n (NInfer returns every sample)", "best_of")
        if req.truncate_prompt_tokens == 0:
            raise oa.bad("truncate_prompt_tokens must be -1 or at least 1", "truncate_prompt_tokens")
        sampling = self._sampling(req, req.max_tokens or 16, 16, req.n)       # OpenAI's default: 16
        sampling.pop("fill_max_tokens")
        self.params_n.observe(req.n or 1)
        if req.logprobs is not None:
            sampling["logprobs"] = req.logprobs
        if plp is not None:
            sampling["prompt_logprobs"] = plp
        sampling.update(await self._off_loop(partial(self._constraint, req, think=False)))
        stop, n, shape = self._stop(req), req.n or 1, O.shaping(req, self.eos_ids)
        prompts = await self._prompts(req.prompt, req.add_special_tokens is not False, req.truncate_prompt_tokens)
        if len(prompts) * n > MAX_CHOICES:
            raise oa.bad(f"at most {MAX_CHOICES} choices (prompts x n) are allowed", "prompt")
        choices = [Choice(partial(self.engine.generate, p, session_id=req.user, **_nth_seed(sampling, i)), stop, False,
                          shape=shape) for p in prompts for i in range(n)]
        await self._off_loop(self._submit_all, choices)
        rid, created = req.request_id or choices[0].handle.rid, oa.now()
        echo = [self._decoder(shape)(p) if req.echo else "" for p in prompts for _ in range(n)]
        if req.stream:
            return _sse_response(self._completion_stream(choices, rid, created, req, echo, request))
        got = await self._collect(choices, request)
        if got is None:
            return Response(status_code=499)
        token_str = self._token_str_of(shape)
        out = [{"index": i, "text": echo[i] + g.text, "finish_reason": g.fin.reason,
                "logprobs": self._completion_logprobs(req, c, g.fin.out, g.logprobs, token_str, len(echo[i]))}
               for i, (c, g) in enumerate(zip(choices, got))]
        if plp is not None:               # vLLM's: each choice carries its prompt's
            for o, g in zip(out, got):
                o["prompt_logprobs"] = oa.prompt_logprobs(g.fin.out.prompt_logprobs, self._token_str)
        if shape.return_token_ids:
            for o, c, g in zip(out, choices, got):
                o.update(prompt_token_ids=_prompt_ids(c.handle), token_ids=g.token_ids)
        firsts = [got[k * n].fin.out for k in range(len(prompts))]
        usage = oa.usage_block(oa.prompt_usage(firsts), sum(g.fin.completion_tokens for g in got))
        return JSONResponse(oa.completion(rid, self.model, created, out, usage))

    @staticmethod
    def _completion_logprobs(req: S.CompletionRequest, choice: Choice, out, entries: list, token_str,
                             offset: int) -> dict | None:
        """A choice's ``logprobs``: its answer's, after the echoed prompt's (echo with logprobs)."""
        if req.logprobs is None:
            return None
        answer = oa.completion_logprobs(entries, token_str, offset)
        if not req.echo:
            return answer
        prompt = oa.echo_logprobs(_prompt_ids(choice.handle), out.prompt_logprobs, token_str, req.logprobs)
        return oa.joined_logprobs(prompt, answer)

    async def _completion_stream(self, choices, rid, created, req: S.CompletionRequest, echo, request):
        fins: list[Finish | None] = [None] * len(choices)
        offsets = [len(e) for e in echo]
        shape = choices[0].shape
        token_str = self._token_str_of(shape)
        counted = [0] * len(choices)
        usage_each = shape.continuous_usage and req.stream_options.include_usage

        def part(i: int, text: str, reason=None, lps=None, ids=None, first=False) -> str:
            c = {"index": i, "text": text, "logprobs": lps, "finish_reason": reason}
            if shape.return_token_ids:
                c["token_ids"] = ids or []
                if first:
                    c["prompt_token_ids"] = _prompt_ids(choices[i].handle)
            obj = oa.completion(rid, self.model, created, [c], None)
            if usage_each:
                p = len(_prompt_ids(choices[i].handle))
                obj["usage"] = {"prompt_tokens": p, "completion_tokens": counted[i], "total_tokens": p + counted[i]}
            return _sse(obj)
        # the echo (and the prompt's ids) go out with the first token, not before
        echoed = [not e and not shape.return_token_ids for e in echo]
        try:
            async for i, item in self._drive(choices, request):
                if not echoed[i] and not (isinstance(item, Finish) and item.reason == "error"):
                    echoed[i] = True
                    lps = None
                    if echo[i] and req.logprobs is not None:       # the echoed prompt's logprobs
                        entries = item.out.prompt_logprobs if isinstance(item, Finish) else item.prompt_logprobs
                        lps = oa.echo_logprobs(_prompt_ids(choices[i].handle), entries, token_str, req.logprobs)
                    yield part(i, echo[i], lps=lps, first=True)
                if isinstance(item, Finish):
                    fins[i] = item
                    if item.reason == "error":
                        yield _sse(oa.engine_error(item.out).body())
                        yield "data: [DONE]\n\n"
                        return
                    counted[i] = item.completion_tokens
                    yield part(i, "", item.reason)
                    continue
                counted[i] += len(item.token_ids)
                lps = None
                if req.logprobs is not None and item.logprobs:
                    lps = oa.completion_logprobs(item.logprobs, token_str, offsets[i])
                offsets[i] += len(item.content)
                if item.content or lps or (shape.return_token_ids and item.token_ids):
                    yield part(i, item.content, None, lps, item.token_ids)
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
        O.refuse_unsupported(req, False, self.facts)
        call = R.parse_responses(req, self.store)
        _tool_choice(call.tool_choice if call.tool_choice != "none" else None, call.tools)
        sampling = self._sampling(req, req.max_output_tokens, self.default_max, None)
        sampling.update(O.responses_template(req, self.facts))
        sampling.update(await self._off_loop(partial(self._constraint, req, call.tool_choice, call.tools,
                                                     req.parallel_tool_calls is not False)))
        choice = Choice(partial(self.engine.chat, call.messages, tools=call.tools,
                                session_id=req.prompt_cache_key or req.user, **sampling), self._stop(req),
                        bool(call.tools), shape=O.shaping(req, self.eos_ids),
                        reasoning=self.reasoning_parser is not None)
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
        status = "cancelled" if cancelled else "incomplete" if g.fin.reason == "length" else "completed"
        items = R.output_items(g.text, g.calls, "incomplete" if cancelled else status, reasoning=g.reasoning)
        obj = R.response_object(rid, self.model, created, call, items, status, g.fin.out.usage,
                                g.fin.completion_tokens, "max_output_tokens", self._reasoning_tokens(g))
        self._keep(rid, call, obj, g.text, g.calls, g.reasoning)
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
        images: dict[tuple[int, int], str] = {}
        messages, tools, choice = A.chat_input(req, images)
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
        parallel = not (req.tool_choice is not None and req.tool_choice.disable_parallel_tool_use)
        sampling.update(await self._off_loop(self._tool_grammar, choice, used, parallel))   # any / tool: a grammar
        c = Choice(partial(self.engine.chat, messages, tools=used, session_id=user if isinstance(user, str) else None,
                           **sampling), stop, bool(used))
        self.params_n.observe(1)
        try:
            await self._off_loop(self._submit_all, [c])
        except oa.ApiError as exc:           # an image the preparation refused: named as the client sent it
            message, path = A.request_path(str(exc), images) if exc.status == 400 else (str(exc), None)
            if path is None:
                raise
            raise oa.ApiError(400, message, kind=exc.kind, param=path, code=exc.code) from None
        mid = A.new_id()
        if req.stream:
            return _sse_response(self._messages_stream(c, choice, mid, request))
        got = await self._collect([c], request)
        if got is None:
            return Response(status_code=499)
        g = got[0]
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
                    for e in ev.start(len(_prompt_ids(c.handle))):   # the prompt's length (the reuse split comes last)
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
        for e in ev.end(fin.reason, fin.stop, A.usage(fin.out.usage, fin.completion_tokens)):
            yield e

    def _reasoning_tokens(self, g: Collected) -> int:
        """Output tokens spent thinking: up to and with ``</think>`` (all of them when the
        answer never closed its thinking)."""
        if not g.reasoning:
            return 0
        ids = list(g.fin.out.token_ids)[:g.fin.completion_tokens]
        return ids.index(self.think_end_id) + 1 if self.think_end_id in ids else len(ids)

    def _keep(self, rid: str, call: R.ResponsesCall, obj: dict, text: str, calls: list[dict],
              reasoning: str = "") -> None:
        if call.store:
            self.store.put(rid, obj, R.stored_history(call, text, calls, reasoning), call.input_items)

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
                for e in ev.reasoning_delta(item.reasoning):
                    yield e
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
        status = "incomplete" if fin.reason == "length" else "completed"
        for e in ev.close_reasoning() + ev.close_message(status):
            yield e
        final = R.response_object(rid, self.model, created, call,
                                  R.output_items(got.text, got.calls, status, ev.msg_id, got.reasoning, ev.rs_id),
                                  status, fin.out.usage, fin.completion_tokens, "max_output_tokens",
                                  self._reasoning_tokens(got))
        self._keep(rid, call, final, got.text, got.calls, got.reasoning)
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
            if req.continue_final_message and req.add_generation_prompt and "add_generation_prompt" in body:
                raise oa.bad("continue_final_message and add_generation_prompt cannot both be true",
                             "continue_final_message")
            clash = next((k for k in req.chat_template_kwargs or {} if k in RESERVED_TEMPLATE_VARS), None)
            if clash is not None:
                raise oa.bad(f"chat_template_kwargs.{clash} is set by the request itself", "chat_template_kwargs")
            ids = await self._tokens(None, body["messages"], body.get("tools"),
                                     req.add_generation_prompt and not req.continue_final_message,
                                     template_kwargs=req.chat_template_kwargs,
                                     continue_final=bool(req.continue_final_message))
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

    async def reset_prefix_cache(self, request: Request) -> Response:
        """vLLM's ``POST /reset_prefix_cache``: every optional cache entry is released (between
        benchmark runs, or to start a test from an empty cache). Only while no request is open —
        vLLM too refuses while blocks are in use: a 409, nothing released. vLLM's ``device`` query
        parameter is accepted (every tier is released whichever it names); anything else is a 400."""
        unknown = sorted(set(request.query_params) - {"device"})
        if unknown:
            raise oa.bad(f"/reset_prefix_cache takes no parameter {unknown[0]!r} (only vLLM's 'device')", unknown[0])
        stats = await self._probe(self.engine.stats)
        open_ = stats.get("running", 0) + stats.get("waiting", 0) + stats.get("paused", 0)
        if self.load or open_:
            raise oa.ApiError(409, f"the prefix cache is reset only while no request is open ({max(open_, self.load)} "
                                   "open now); retry once they finish", kind="conflict_error")
        await self._probe(self.engine.drop_caches)
        return JSONResponse({"status": "ok"})

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
                                   {"params_n": self.params_n.snapshot()}, getattr(self.engine, "config", None)),
                        media_type=METRICS_TYPE)


@dataclass
class ChatCtx:
    rid: str
    created: int
    tool_choice: object
    req: S.ChatRequest
    shape: O.Shaping = O.Shaping()
    echo: str = ""                        # chat echo: the final message's text, prepended
    reasoning: bool = False               # answers carry reasoning_content (a parser, included)


def _chat_echo(req: S.ChatRequest, messages: list[dict]) -> str:
    """vLLM's chat ``echo``: the final message's text when it has the answer's role (assistant
    with a generation prompt, else the final message's own role): a continued message comes back
    whole."""
    if not req.echo or not messages:
        return ""
    last = messages[-1]
    role = "assistant" if req.add_generation_prompt is not False and not req.continue_final_message \
        else last.get("role")
    if last.get("role") != role:
        return ""
    c = last.get("content")
    if isinstance(c, list):
        return "".join(p.get("text", "") for p in c if isinstance(p, dict) and p.get("type") == "text")
    return c or ""


def _with_reasoning_content(messages: list) -> list:
    """Assistant messages sent back with vLLM's newer ``reasoning`` field render as
    ``reasoning_content``, the name chat templates read."""
    if not any(isinstance(m, dict) and "reasoning" in m and "reasoning_content" not in m for m in messages):
        return messages
    return [{**m, "reasoning_content": m["reasoning"]}
            if isinstance(m, dict) and "reasoning" in m and "reasoning_content" not in m else m for m in messages]


def _prompt_ids(handle) -> list[int]:
    """The prompt a submitted request runs (``RequestHandle.prompt_token_ids``)."""
    return list(getattr(handle, "prompt_token_ids", None) or [])


def _as_token_id(tid: int) -> str:
    """``return_tokens_as_token_ids``: a logprob's token as vLLM spells it."""
    return f"token_id:{tid}"


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
          sock=None, aliases: list[str] | None = None, limits: Limits | None = None,
          generation_config: str = "auto", reasoning_parser: str = "auto") -> None:
    """Serve until interrupted; on ``sock`` (bound by the caller, ``serve_flags.bind``) when
    given, else on host:port."""
    import uvicorn

    limits = limits or Limits()
    server = Server(engine, model_name, api_key=api_key, max_body_bytes=max_body_bytes, max_messages=max_messages,
                    aliases=aliases, limits=limits, generation_config=generation_config,
                    reasoning_parser=reasoning_parser)
    server.offload.warm()                      # the helper for large inputs is up before the first one
    config = uvicorn.Config(server.app, host=host, port=port, loop="uvloop", log_level=log_level,
                            http=protocol_class(limits))
    uvicorn.Server(config).run(sockets=[sock] if sock is not None else None)
