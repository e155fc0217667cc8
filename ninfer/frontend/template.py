"""The model's own Jinja chat template, compiled in a sandbox configured like transformers'
(trim_blocks, lstrip_blocks, loop controls, a non-escaping ``tojson``, ``raise_exception``),
so a template renders here exactly as it does in ``apply_chat_template``."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ninfer.errors import RequestError


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render_template(source: str, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True, **extra) -> str:
    """Render messages to text; a template-raised error is a RequestError for this request."""
    try:
        return compile_template(source).render(messages=messages, tools=tools,
                                               add_generation_prompt=add_generation_prompt, **extra)
    except jinja2.exceptions.TemplateError as exc:
        raise RequestError(f"chat template rejected the messages: {exc}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
        # the template met input of a shape it does not handle (a part list where it adds strings)
        raise RequestError(f"chat template failed on the messages: {type(exc).__name__}: {exc}") from None
