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
    if len(p) > info.max_context:                  # before any per-token work
        raise RequestError(f"this engine's max_context is {info.max_context} tokens, but the prompt alone has "
                           f"{len(p)}")
    spans = _check_media(spec, info)
    bad = next((t for k, t in enumerate(p) if not isinstance(t, int) or isinstance(t, bool)
                or not (0 <= t < info.vocab_size or (t >= info.vocab_size and k in spans))), None)
    if bad is not None:
        raise RequestError(f"prompt token id {bad!r} is out of range: allowed 0..{info.vocab_size - 1}")
    spec.params.validate(info.vocab_size)
    if spec.params.prompt_logprobs is not None and spec.media:
        raise RequestError("prompt_logprobs is not supported for a prompt with images (their positions hold no "
                           "vocabulary token)")
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


def _check_media(spec: RequestSpec, info: P.WorkerInfo) -> set[int]:
    """Images: ordered, non-overlapping spans inside the prompt, each of its grid's merged-token
    count and carrying exactly its identity ids; no restore position strictly inside a span.
    Returns the positions the spans cover (where ids >= vocab_size are allowed)."""
    if not spec.media:
        return set()
    if not info.vision_merge:
        raise RequestError(f"this model ({info.model_type}) has no vision tower: image input is not supported")
    p, covered, last = spec.prompt, set(), 0
    m2 = info.vision_merge ** 2
    for i, it in enumerate(spec.media):
        t, h, w = it.grid_thw
        if min(t, h, w) < 1 or h % info.vision_merge or w % info.vision_merge or t * h * w // m2 != it.num_tokens:
            raise RequestError(f"media[{i}]: grid {list(it.grid_thw)} does not give {it.num_tokens} image tokens")
        if it.offset < last or it.offset + it.num_tokens > len(p):
            raise RequestError(f"media[{i}]: span {it.offset}..{it.offset + it.num_tokens} overlaps another "
                               f"image or lies outside the prompt (0..{len(p)})")
        if len(it.shape) != 2 or it.shape[0] != t * h * w or it.shape[0] * it.shape[1] * 4 != len(it.pixel_values):
            raise RequestError(f"media[{i}]: pixel_values of shape {list(it.shape)} and {len(it.pixel_values)} "
                               f"bytes do not fit grid {list(it.grid_thw)}")
        if p[it.offset:it.offset + it.num_tokens] != P.media_token_ids(it.digest, it.num_tokens, info.vocab_size):
            raise RequestError(f"media[{i}]: the prompt's ids at {it.offset}.. are not this image's identity ids")
        covered.update(range(it.offset, it.offset + it.num_tokens))
        last = it.offset + it.num_tokens
    inside = [x for x in [*spec.anchors, *spec.markers, *spec.split_points, spec.recovery_frontier,
                          spec.response_replay, spec.turn_closure]
              if isinstance(x, int) and x in covered and x - 1 in covered]
    if inside:
        raise RequestError(f"restore position {inside[0]} lies inside an image span")
    return covered
