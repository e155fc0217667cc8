"""Bounds on what one request body may make the server do, checked right after decoding and
before any rendering or tokenising (issue 32: a 10 MB tool description passed the body limit
and then took 15-38 s to be refused while every other stream stopped).

    JSON values     strings and containers at most ``max_values`` (numbers in number arrays —
                    token ids — at most ``max_numbers``): what the server then walks is bounded
    names and ids   every ``name``, ``id``, ``call_id``, ``tool_call_id``, ``model``, ... at most
                    ``max_name_chars`` (OpenAI's function names are ≤ 64)
    free text       every other string (message content, a tool's description or parameters,
                    tool-call arguments, instructions, a prompt, /tokenize input) counts toward
                    ``max_text_chars`` — one field and all together: text with more characters
                    than the context's tokens times the longest token cannot fit the context
    media           image / audio / file payloads are not text: their own limits apply
                    (frontend/media.py)

``check_body`` is one walk over the decoded object (≈ 1 µs a value); a body larger than
``offload.INLINE_BODY_BYTES`` is decoded and walked in the helper process (``decode_checked``).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from ninfer.frontend.offload import Refusal

NAME_KEYS = frozenset({"name", "id", "call_id", "tool_call_id", "model", "previous_response_id", "type", "role",
                       "user", "prompt_cache_key", "response_id", "tool_use_id", "stop_sequence"})
MEDIA_KEYS = frozenset({"image_url", "input_image", "url", "data", "file_data", "input_audio", "source",
                        "image", "file"})


@dataclass(frozen=True)
class BodyBounds:
    max_text_chars: int                   # max_context × the longest token's characters
    max_context: int
    max_values: int = 1 << 16
    max_numbers: int = 1 << 20
    max_name_chars: int = 256


class _Walk:
    def __init__(self, b: BodyBounds):
        self.b = b
        self.values = 0
        self.numbers = 0
        self.text = 0

    def refuse_text(self, where: str, chars: int, total: bool) -> Refusal:
        what = "the request's text" if total else f"{where}"
        return Refusal(400, f"{what} has {chars} characters: at least {chars * self.b.max_context // self.b.max_text_chars}"
                            f" tokens, more than this engine's max_context of {self.b.max_context} tokens",
                       None if total else where, "context_length_exceeded")

    def walk(self, x, where: str, key: str | None, media: bool = False) -> Refusal | None:
        """Inside a media payload (``media``) strings are neither names nor text, but every
        value still counts."""
        b = self.b
        if isinstance(x, str):
            self.values += 1
            n = len(x)
            if media:
                pass
            elif key in NAME_KEYS:
                if n > b.max_name_chars:
                    return Refusal(400, f"{where} has {n} characters: at most {b.max_name_chars} are allowed",
                                   where, "string_too_long")
            else:
                self.text += n
                if n > b.max_text_chars:
                    return self.refuse_text(where, n, False)
                if self.text > b.max_text_chars:
                    return self.refuse_text(where, self.text, True)
        elif isinstance(x, dict):
            self.values += 1 + len(x)
            for k, v in x.items():
                r = self.walk(v, f"{where}.{k}" if where else k, k, media or k in MEDIA_KEYS)
                if r is not None:
                    return r
        elif isinstance(x, list):
            if x and all(type(v) in (int, float) for v in x):
                self.numbers += len(x)
            else:
                self.values += 1
                for i, v in enumerate(x):
                    r = self.walk(v, f"{where}[{i}]", key, media)
                    if r is not None:
                        return r
        else:
            self.numbers += 1
        if self.values > b.max_values or self.numbers > b.max_numbers:
            return Refusal(413, f"the request body has too many JSON values (more than {b.max_values} strings and "
                                f"containers, or {b.max_numbers} numbers)", None, "too_many_values")
        return None


def check_body(body, bounds: BodyBounds) -> Refusal | None:
    """The first bound ``body`` breaks, else None."""
    try:
        return _Walk(bounds).walk(body, "", None)
    except RecursionError:
        return Refusal(400, "malformed JSON: nested too deeply")


def decode_checked(raw: bytes, bounds: BodyBounds, trim: bool = True):
    """``(True, (body, None))`` once the decoded body is within ``bounds``, else ``(True, (None,
    refusal))`` (a malformed body is a refusal too). In the helper process (``trim``: its heap
    goes back to the system after a large body), or inline for a small body."""
    from ninfer.frontend import offload
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        return True, (None, Refusal(400, f"malformed JSON: {exc}"))
    except RecursionError:
        return True, (None, Refusal(400, "malformed JSON: nested too deeply"))
    refusal = check_body(body, bounds)
    if refusal is not None:
        body = None
    if trim:
        offload.trim()
    return True, (body, refusal)
