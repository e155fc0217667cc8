"""``GET /openapi.json`` and ``GET /docs``: the server's routes as an OpenAPI 3.1 document, the
request bodies generated from the same msgspec structs that decode them (``schema.py``,
``anthropic.py``), so the document cannot drift from what the server accepts."""

from __future__ import annotations

import msgspec

from ninfer.frontend import anthropic as A
from ninfer.frontend import schema as S

ROUTES = [   # (method, path, summary, request struct or None)
    ("post", "/v1/chat/completions", "OpenAI chat completions (stream, tools, n, logprobs)", S.ChatRequest),
    ("post", "/v1/completions", "OpenAI legacy completions (text or token prompts)", S.CompletionRequest),
    ("post", "/v1/responses", "OpenAI Responses (store, previous_response_id, stream, background)",
     S.ResponsesRequest),
    ("get", "/v1/responses/{response_id}", "A stored response", None),
    ("delete", "/v1/responses/{response_id}", "Delete a stored response", None),
    ("get", "/v1/responses/{response_id}/input_items", "A stored response's input items", None),
    ("post", "/v1/responses/{response_id}/cancel", "Cancel a background response in progress", None),
    ("post", "/v1/messages", "Anthropic messages (text, tools, tool results, images; stream)", A.MessagesRequest),
    ("get", "/v1/models", "The served model (and its aliases)", None),
    ("get", "/v1/models/{model}", "One served model", None),
    ("post", "/tokenize", "Token ids of a prompt or of rendered chat messages", S.TokenizeRequest),
    ("post", "/detokenize", "Text of token ids", S.DetokenizeRequest),
    ("get", "/health", "Liveness (no API key)", None),
    ("get", "/ping", "Liveness, vLLM's alias (no API key)", None),
    ("get", "/load", "Generation requests being answered (no API key)", None),
    ("post", "/reset_prefix_cache", "Release every optional cache entry (409 while requests are open)", None),
    ("get", "/version", "NInfer's version (no API key)", None),
    ("get", "/metrics", "Prometheus metrics (no API key)", None),
]


def spec(model: str) -> dict:
    structs = [r[3] for r in ROUTES if r[3] is not None]
    refs, components = msgspec.json.schema_components(structs, ref_template="#/components/schemas/{name}")
    by_struct = dict(zip(structs, refs))
    from ninfer import __version__
    paths: dict = {}
    for method, path, summary, struct in ROUTES:
        op: dict = {"summary": summary, "responses": {"200": {"description": "OK"},
                                                       "4XX": {"description": "OpenAI's error JSON "
                                                               "(Anthropic's on /v1/messages)"}}}
        params = [seg[1:-1] for seg in path.split("/") if seg.startswith("{")]
        if params:
            op["parameters"] = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
                                for p in params]
        if struct is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": by_struct[struct]}}}
        paths.setdefault(path, {})[method] = op
    return {"openapi": "3.1.0", "info": {"title": f"NInfer serving {model}", "version": __version__},
            "paths": paths, "components": {"schemas": components,
                                           "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
            "security": [{"bearer": []}]}


DOCS_HTML = """<!doctype html>
<html><head><title>NInfer API</title><meta charset="utf-8">
<link rel="stylesheet" href="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css"></head>
<body><div id="ui"><p>The API is described by <a href="/openapi.json">/openapi.json</a> (this page draws it with
Swagger UI from a CDN; offline, read the JSON).</p></div>
<script src="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"></script>
<script>if (window.SwaggerUIBundle) SwaggerUIBundle({url: "/openapi.json", dom_id: "#ui"});</script>
</body></html>
"""
