"""Request validation: bad input is a clear RequestError for that request alone."""

from __future__ import annotations

from ninfer import protocol as P
from ninfer.protocol import RequestSpec
from ninfer.errors import RequestError
from ninfer.protocol import MAX_ANCHORS, MAX_MARKERS


def validate_spec(spec: RequestSpec, info: P.WorkerInfo) -> None:
    p = spec.prompt
    if not isinstance(p, list) or not p:
        raise RequestError("prompt_token_ids must be a non-empty list of token ids")
    bad = next((t for t in p if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise RequestError(f"prompt token id {bad!r} is out of range: allowed 0..{info.vocab_size - 1}")
    spec.params.validate(info.vocab_size)
    total = len(p) + spec.params.max_tokens
    if total > info.max_context:
        raise RequestError(
            f"this engine's max_context is {info.max_context} tokens, but the request needs {total} "
            f"({len(p)} prompt + {spec.params.max_tokens} max_tokens)")
    for name, pos, cap in (("anchors", spec.anchors, MAX_ANCHORS), ("cache_markers", spec.markers, MAX_MARKERS)):
        if len(pos) > cap:
            raise RequestError(f"{name}: at most {cap} positions are allowed, got {len(pos)}")
        for x in pos:
            if not isinstance(x, int) or not 1 <= x <= len(p):
                raise RequestError(f"{name}: position {x!r} is outside the prompt (1..{len(p)})")
    for x in spec.split_points:
        if not isinstance(x, int) or not 1 <= x <= len(p):
            raise RequestError(f"split point {x!r} is outside the prompt (1..{len(p)})")
    for name in ("recovery_frontier", "response_replay", "turn_closure"):
        r = getattr(spec, name)
        if r is not None and (not isinstance(r, int) or not 1 <= r <= len(p)):
            raise RequestError(f"{name} {r!r} is outside the prompt (1..{len(p)})")
