"""Tokenizer and chat template of the tiny test model.

The tiny model has to look like a real Qwen-family checkpoint to the serving
runtime (byte-level BPE, ChatML special tokens, a Qwen2.5-style tool-calling chat
template) while being built entirely offline. `build_tokenizer` trains a small
byte-level BPE on the built-in corpus and writes the usual Hugging Face files;
`render_reference` is a plain-Python twin of `CHAT_TEMPLATE` that tests use to pin
the template's exact output.

Vocabulary layout (vocab_size = V): ids 0..V-10 are the 256 byte symbols plus the
learned merges, then the 3 special tokens, then the 6 extra (non-special) tokens,
in the order of `SPECIAL_TOKENS + EXTRA_TOKENS`; the vision model's tokenizer then
appends the 4 `VISION_TOKENS` (special), its learned part 4 ids shorter.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

from ninfer.tiny.corpus import CORPUS

SPECIAL_TOKENS: list[str] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EXTRA_TOKENS: list[str] = [
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
# special tokens of the Qwen3.5 vision model only (``--arch qwen3_5_vision``), appended last so
# the ids of every other token stay those of the text-only tiny models' layout
VISION_TOKENS: list[str] = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

# Qwen2's pre-tokenization regex (GPT-4 style, but digits are split one by one).
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

MODEL_MAX_LENGTH = 4096

# --------------------------------------------------------------------------- #
# Chat template
# --------------------------------------------------------------------------- #

_TOOLS_INTRO = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_OUTRO = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)

# Jinja string literals understand backslash escapes, so the template is kept as a
# raw string: the file on disk then reads like Qwen's own template.
CHAT_TEMPLATE: str = r"""{#- ChatML in the style of Qwen2.5 with Qwen3's thinking, without a default system prompt. -#}
{%- macro render_content(content) -%}
    {#- A string, null/missing (empty), or a list of {"type": "text", "text": ...} parts. -#}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part.type == "text" -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}

{#- A leading system (or developer) message becomes the first block. -#}
{%- if messages and messages[0].role in ["system", "developer"] -%}
    {%- set system_message = render_content(messages[0].content) -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set system_message = none -%}
    {%- set loop_messages = messages -%}
{%- endif -%}

{%- if tools -%}
    {{- "<|im_start|>system\n" -}}
    {%- if system_message -%}
        {{- system_message + "\n\n" -}}
    {%- endif -%}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" -}}
    {%- for tool in tools -%}
        {{- "\n" + (tool | tojson) -}}
    {%- endfor -%}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" -}}
{%- elif system_message is not none -%}
    {{- "<|im_start|>system\n" + system_message + "<|im_end|>\n" -}}
{%- endif -%}

{#- Thinking as Qwen3's template: an assistant's reasoning (reasoning_content, or a <think> block
    at the start of its content) is rendered only after the last user message; earlier turns keep
    their answer alone. -#}
{%- set ns = namespace(last_query=-1) -%}
{%- for message in loop_messages -%}
    {%- if message.role == "user" -%}
        {%- set ns.last_query = loop.index0 -%}
    {%- endif -%}
{%- endfor -%}

{%- for message in loop_messages -%}
    {%- set role = "system" if message.role == "developer" else message.role -%}
    {%- if role in ["user", "system"] -%}
        {{- "<|im_start|>" + role + "\n" + render_content(message.content) + "<|im_end|>\n" -}}
    {%- elif role == "assistant" -%}
        {%- set content = render_content(message.content) -%}
        {%- set reasoning = "" -%}
        {%- if message.reasoning_content is string -%}
            {%- set reasoning = message.reasoning_content -%}
        {%- elif "</think>" in content -%}
            {%- set reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n") -%}
            {%- set content = content.split("</think>")[-1].lstrip("\n") -%}
        {%- endif -%}
        {%- if loop.index0 > ns.last_query and reasoning -%}
            {%- set content = "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n") -%}
        {%- endif -%}
        {%- if not message.tool_calls -%}
            {{- "<|im_start|>assistant\n" + content + "<|im_end|>\n" -}}
        {%- else -%}
        {{- "<|im_start|>assistant" -}}
        {%- if content -%}
            {{- "\n" + content -}}
        {%- endif -%}
        {%- for tool_call in message.tool_calls -%}
            {%- set call = tool_call.function if tool_call.function is defined else tool_call -%}
            {{- "\n<tool_call>\n{\"name\": \"" + call.name + "\", \"arguments\": " -}}
            {%- if call.arguments is string -%}
                {{- call.arguments -}}
            {%- elif call.arguments is defined and call.arguments is not none -%}
                {{- call.arguments | tojson -}}
            {%- else -%}
                {{- "{}" -}}
            {%- endif -%}
            {{- "}\n</tool_call>" -}}
        {%- endfor -%}
        {{- "<|im_end|>\n" -}}
        {%- endif -%}
    {%- elif role == "tool" -%}
        {#- Consecutive tool results share one user block. -#}
        {%- if loop.first or loop.previtem.role != "tool" -%}
            {{- "<|im_start|>user" -}}
        {%- endif -%}
        {{- "\n<tool_response>\n" + render_content(message.content) + "\n</tool_response>" -}}
        {%- if loop.last or loop.nextitem.role != "tool" -%}
            {{- "<|im_end|>\n" -}}
        {%- endif -%}
    {%- else -%}
        {{- raise_exception("Unknown message role: " ~ message.role) -}}
    {%- endif -%}
{%- endfor -%}

{%- if add_generation_prompt -%}
    {{- "<|im_start|>assistant\n" -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- "<think>\n\n</think>\n\n" -}}
    {%- endif -%}
{%- endif -%}
"""


# The vision model's template also renders image parts, as Qwen3.5's does: one placeholder each,
# which the frontend expands to the image's token count (frontend/media.py expand_image_pads).
_TEXT_PART = """            {%- if part.type == "text" -%}
                {{- part.text -}}
"""
_IMAGE_PART = """            {%- elif part.type in ["image", "image_url"] -%}
                {{- "<|vision_start|><|image_pad|><|vision_end|>" -}}
"""
VISION_CHAT_TEMPLATE: str = CHAT_TEMPLATE.replace(_TEXT_PART, _TEXT_PART + _IMAGE_PART, 1)


def _content_text(content: Any) -> str:
    """Flatten message content (str, None, or a list of text parts) to a string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


def _tojson(value: Any) -> str:
    """JSON exactly as transformers' `tojson` filter writes it (no ASCII escaping)."""
    return json.dumps(value, ensure_ascii=False)


def _block(role: str, text: str) -> str:
    """One ChatML block."""
    return f"<|im_start|>{role}\n{text}<|im_end|>\n"


def _system_block(system: str | None, tools: list | None) -> str:
    """The leading block: the system prompt, plus the tool instructions if any."""
    if tools:
        head = system + "\n\n" if system else ""
        listing = "".join("\n" + _tojson(tool) for tool in tools)
        return f"<|im_start|>system\n{head}{_TOOLS_INTRO}{listing}{_TOOLS_OUTRO}<|im_end|>\n"
    return "" if system is None else _block("system", system)


def _tool_call_text(tool_call: Mapping) -> str:
    """`\\n<tool_call>\\n{...}\\n</tool_call>` for one OpenAI-shaped tool call."""
    call = tool_call.get("function", tool_call)
    args = call.get("arguments")
    if not isinstance(args, str):
        args = "{}" if args is None else _tojson(args)
    return f'\n<tool_call>\n{{"name": "{call["name"]}", "arguments": {args}}}\n</tool_call>'


def _assistant_content(message: Mapping, after_last_query: bool) -> str:
    """Qwen3's thinking: the reasoning (``reasoning_content``, or a leading ``<think>`` block of
    the content) is kept only after the last user message."""
    content = _content_text(message.get("content"))
    reasoning = ""
    if isinstance(message.get("reasoning_content"), str):
        reasoning = message["reasoning_content"]
    elif "</think>" in content:
        reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
        content = content.split("</think>")[-1].lstrip("\n")
    if after_last_query and reasoning:
        content = "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n")
    return content


def _assistant_with_calls(message: Mapping, content: str) -> str:
    """An assistant block whose tool calls follow its (optional) text."""
    body = "\n" + content if content else ""
    calls = "".join(_tool_call_text(tc) for tc in message["tool_calls"])
    return f"<|im_start|>assistant{body}{calls}<|im_end|>\n"


def _role_of(message: Mapping) -> str | None:
    return message.get("role")


def render_reference(
    messages: list[Mapping],
    tools: list[Mapping] | None = None,
    add_generation_prompt: bool = True,
    enable_thinking: bool | None = None,
) -> str:
    """Render `messages` exactly as `CHAT_TEMPLATE` does, in plain Python.

    Used by tests to pin the template: any change to the Jinja source that alters
    its output shows up as a mismatch with this function.
    """
    messages = list(messages)
    system = None
    if messages and _role_of(messages[0]) in ("system", "developer"):
        system = _content_text(messages[0].get("content"))
        messages = messages[1:]
    parts = [_system_block(system, tools)]
    last_query = max((i for i, m in enumerate(messages) if _role_of(m) == "user"), default=-1)
    for i, message in enumerate(messages):
        role = _role_of(message)
        role = "system" if role == "developer" else role
        if role in ("user", "system"):
            parts.append(_block(role, _content_text(message.get("content"))))
        elif role == "assistant":
            content = _assistant_content(message, i > last_query)
            parts.append(_assistant_with_calls(message, content) if message.get("tool_calls")
                         else _block("assistant", content))
        elif role == "tool":
            if i == 0 or _role_of(messages[i - 1]) != "tool":
                parts.append("<|im_start|>user")
            parts.append(f"\n<tool_response>\n{_content_text(message.get('content'))}\n</tool_response>")
            if i == len(messages) - 1 or _role_of(messages[i + 1]) != "tool":
                parts.append("<|im_end|>\n")
        else:
            raise ValueError(f"Unknown message role: {role}")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
        if enable_thinking is False:
            parts.append("<think>\n\n</think>\n\n")
    return "".join(parts)


# --------------------------------------------------------------------------- #
# Tokenizer
# --------------------------------------------------------------------------- #


def _empty_tokenizer() -> Tokenizer:
    """An untrained Qwen2-style byte-level BPE pipeline."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _train(corpus: Iterable[str], base_vocab: int) -> Tokenizer:
    """Train the BPE so that bytes + merges fill exactly `base_vocab` ids.

    The trainer sees no special tokens, so the learned vocabulary occupies ids
    0..base_vocab-1 and the added tokens can be appended after it.
    """
    tok = _empty_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=base_vocab,
        min_frequency=0,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    if tok.get_vocab_size() != base_vocab:
        raise ValueError(
            f"the built-in corpus only supports {tok.get_vocab_size()} byte/merge tokens, "
            f"{base_vocab} were requested"
        )
    return tok


def _add_tokens(tok: Tokenizer, more_special: list[str]) -> None:
    """Append the ChatML special tokens, the non-special tool/think tags, then ``more_special``."""
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in EXTRA_TOKENS])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in more_special])


def _added_tokens_decoder(tok: Tokenizer) -> dict[str, dict]:
    """The `added_tokens_decoder` entry of tokenizer_config.json."""
    out = {}
    for token_id, added in sorted(tok.get_added_tokens_decoder().items()):
        out[str(token_id)] = {
            "content": added.content,
            "lstrip": added.lstrip,
            "normalized": added.normalized,
            "rstrip": added.rstrip,
            "single_word": added.single_word,
            "special": added.special,
        }
    return out


def _tokenizer_config(tok: Tokenizer, chat_template: str) -> dict:
    """tokenizer_config.json contents, in the shape Qwen2.5 checkpoints use."""
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": _added_tokens_decoder(tok),
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def _special_tokens_map() -> dict:
    return {
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
    }


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build_tokenizer(out_dir: Path, vocab_size: int = 2048, vision: bool = False) -> None:
    """Train the tiny tokenizer and write tokenizer.json, tokenizer_config.json and
    special_tokens_map.json into `out_dir` (created if needed).

    `vocab_size` counts everything, added tokens included. Training is
    deterministic, so building twice gives byte-identical files. ``vision`` adds VISION_TOKENS
    and the template that renders image parts (VISION_CHAT_TEMPLATE).
    """
    more = VISION_TOKENS if vision else []
    n_added = len(SPECIAL_TOKENS) + len(EXTRA_TOKENS) + len(more)
    if vocab_size < 256 + n_added:
        raise ValueError(f"vocab_size must be at least {256 + n_added}, got {vocab_size}")
    tok = _train(CORPUS, vocab_size - n_added)
    _add_tokens(tok, more)
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"), pretty=True)
    template = VISION_CHAT_TEMPLATE if vision else CHAT_TEMPLATE
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(tok, template))
    _write_json(out_dir / "special_tokens_map.json", _special_tokens_map())


def token_ids(out_dir: Path) -> dict[str, int]:
    """Ids of the special and extra (and vision, where present) tokens saved in `out_dir`."""
    tok = Tokenizer.from_file(str(Path(out_dir) / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS + EXTRA_TOKENS + VISION_TOKENS}
    return {t: i for t, i in ids.items() if i is not None}
