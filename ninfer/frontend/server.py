"""``ninfer serve``: an OpenAI-compatible HTTP server (Starlette on uvicorn + uvloop).

    POST /v1/chat/completions   stream (SSE) and non-stream, tools, stream_options.include_usage
    POST /v1/responses          store, previous_response_id
    GET  /v1/models, /health, /metrics (Prometheus)

Bound to 127.0.0.1 by default; optional API key; a request body size limit; OpenAI-shaped
errors (400 bad input, 401, 404 unknown previous_response_id, 413, 503 engine down) — a bad
request fails alone and the engine keeps serving. ``usage.prompt_tokens_details.cached_tokens``
counts real reuse only.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ninfer.api import Engine
from ninfer.errors import NInferError
from ninfer.frontend import openai_api as oa
from ninfer.frontend.metrics import prometheus
from ninfer.frontend.responses import ResponseStore, parse_responses, response_object, stored_messages


class Server:
    def __init__(self, engine: Engine, model_name: str, api_key: str | None = None,
                 max_body_bytes: int = 16 << 20, store_bytes: int = 64 << 20, default_max_tokens: int = 256):
        self.engine = engine
        self.model = model_name
        self.api_key = api_key
        self.max_body = max_body_bytes
        self.store = ResponseStore(store_bytes)
        self.default_max = default_max_tokens
        self.started = int(time.time())
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ])

    # ---- plumbing ---------------------------------------------------------------------------
    async def _body(self, request: Request) -> dict:
        if self.api_key is not None:
            auth = request.headers.get("authorization", "")
            if auth != f"Bearer {self.api_key}":
                raise oa.ApiError(401, "invalid or missing API key", kind="authentication_error",
                                  code="invalid_api_key")
        size = int(request.headers.get("content-length") or 0)
        if size > self.max_body:
            raise oa.ApiError(413, f"request body of {size} bytes exceeds the limit of {self.max_body}")
        raw = await request.body()
        if len(raw) > self.max_body:
            raise oa.ApiError(413, f"request body exceeds the limit of {self.max_body} bytes")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise oa.bad(f"malformed JSON: {exc}") from None
        if not isinstance(body, dict):
            raise oa.bad("the request body must be a JSON object")
        return body

    @staticmethod
    def _error(exc: oa.ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    def _submit_chat(self, messages, tools, sampling, session_id):
        try:
            return self.engine.chat(messages, tools=tools, session_id=session_id, **sampling)
        except NInferError as exc:
            raise oa.request_error(exc) from None

    # ---- chat completions ----------------------------------------------------------------------
    def _submit_choices(self, call: oa.ChatCall) -> list:
        """One engine request per choice. With n > 1 choice i samples with seed + i (identical
        for greedy decoding); they arrive together, so the prompt is computed once and the
        others Fork from its point. A choice that cannot be submitted cancels the ones before."""
        handles = []
        try:
            for i in range(call.n):
                sampling = call.sampling if i == 0 else {**call.sampling, "seed": call.sampling["seed"] + i}
                handles.append(self._submit_chat(call.messages, call.tools, sampling, call.session_id))
        except oa.ApiError:
            for h in handles:
                h.cancel()
            raise
        return handles

    async def chat(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            call = oa.parse_chat(body, self.default_max)
            handles = self._submit_choices(call)
        except oa.ApiError as exc:
            return self._error(exc)
        rid = handles[0].rid
        if call.stream:
            return StreamingResponse(self._stream(handles, call, rid, request), media_type="text/event-stream")
        outs = [await h.result_async() for h in handles]
        failed = next((o for o in outs if o.finish_reason == "error"), None)
        if failed is not None:
            return self._error(_engine_error(failed))
        texts = []
        for out in outs:
            text = out.text
            cut = oa.check_stop(text, call.stop)
            if cut is not None:
                text = text[:cut]
                out.finish_reason = "stop"
            texts.append(text)
        return JSONResponse(oa.chat_completion(rid, self.model, texts, outs))

    async def _stream(self, handles, call: oa.ChatCall, rid: str, request: Request):
        """Server-sent chunks of every choice as they come (``index`` tells them apart), then
        each choice's finish, one usage block (stream_options.include_usage) and [DONE]."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, handle) -> None:
            try:
                async for item in self._choice(i, handle, call, rid, request):
                    await queue.put(item)
            finally:
                await queue.put(None)

        for i in range(len(handles)):
            yield _sse(oa.chunk(rid, self.model, {"role": "assistant", "content": ""}, index=i))
        tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
        outs, error, left = [None] * len(handles), None, len(handles)
        try:
            while left:
                item = await queue.get()
                if item is None:
                    left -= 1
                elif item[0] == "sse":
                    yield item[1]
                else:
                    _, i, out = item
                    outs[i] = out
                    if out is not None and out.finish_reason == "error" and error is None:
                        error = out
        finally:
            for t in tasks:
                t.cancel()
            if await request.is_disconnected():
                for h in handles:
                    h.cancel()
        if error is not None:
            yield _sse(_engine_error(error).body())
        elif call.include_usage and all(o is not None for o in outs):
            final = oa.chunk(rid, self.model, {})
            final["choices"] = []
            final["usage"] = oa.usage_block(outs[0].usage, sum(len(o.token_ids) for o in outs))
            yield _sse(final)
        yield "data: [DONE]\n\n"

    async def _choice(self, i: int, handle, call: oa.ChatCall, rid: str, request: Request):
        """One choice's stream: ("sse", chunk) items, then ("out", i, its Output or None)."""
        ids: list[int] = []
        sent = ""
        stopped = False
        async for ev in handle.aiter():
            if await request.is_disconnected():
                handle.cancel()                            # the client went away: free its resources
                yield ("out", i, None)
                return
            ids.extend(ev.token_ids)
            text = self.engine._text(ids)
            if text.endswith("\ufffd"):
                continue                                   # an incomplete UTF-8 sequence: wait
            cut = oa.check_stop(text, call.stop)
            if cut is not None:
                text, stopped = text[:cut], True
            if len(text) > len(sent):
                yield ("sse", _sse(oa.chunk(rid, self.model, {"content": text[len(sent):]}, index=i)))
                sent = text
            if stopped:
                handle.cancel()
                break
        out = await handle.result_async()
        if not stopped:
            text = self.engine._text(list(out.token_ids))  # flush what was held back
            if len(text) > len(sent):
                yield ("sse", _sse(oa.chunk(rid, self.model, {"content": text[len(sent):]}, index=i)))
                sent = text
        if out.finish_reason != "error":
            _, calls = oa.split_tool_calls(sent)
            reason = "stop" if stopped else oa.finish(out.finish_reason, calls)
            yield ("sse", _sse(oa.chunk(rid, self.model, {}, reason, index=i)))
        yield ("out", i, out)

    # ---- responses ---------------------------------------------------------------------------
    async def responses(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            call = parse_responses(body, self.store, self.default_max)
            handle = self._submit_chat(call.messages, call.tools, call.sampling, call.session_id)
        except oa.ApiError as exc:
            return self._error(exc)
        out = await handle.result_async()
        if out.finish_reason == "error":
            return self._error(_engine_error(out))
        rid = f"resp_{uuid.uuid4().hex}"
        if call.store:
            self.store.put(rid, stored_messages(call, out.text))
        return JSONResponse(response_object(rid, self.model, call, out.text, out))

    # ---- info --------------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": self.started, "owned_by": "ninfer"}]})

    async def health(self, request: Request) -> Response:
        try:
            self.engine.stats()
        except Exception as exc:
            return JSONResponse({"status": "unavailable", "detail": str(exc)}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        try:
            stats = self.engine.stats()
        except Exception as exc:
            return PlainTextResponse(f"# engine unavailable: {exc}\n", status_code=503)
        return PlainTextResponse(prometheus(stats, len(self.store)), media_type="text/plain; version=0.0.4")


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _engine_error(out) -> oa.ApiError:
    err = out.error or {}
    kind = err.get("type", "error")
    status = 503 if kind in ("worker_lost", "controller_lost", "connection_lost") else \
        400 if kind == "RequestError" else 500
    return oa.ApiError(status, err.get("message", "the request failed"), kind=kind)


def serve(engine: Engine, model_name: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          max_body_bytes: int = 16 << 20, log_level: str = "warning") -> None:
    import uvicorn

    server = Server(engine, model_name, api_key=api_key, max_body_bytes=max_body_bytes)
    uvicorn.run(server.app, host=host, port=port, loop="uvloop", log_level=log_level)
