"""The OpenAI request shapes as msgspec Structs: one typed decode per request, errors that name
the JSON path (``$.messages[0].tool_calls[0].function.name``) instead of hand-written dict walks.

Unknown fields are ignored (as vLLM does); a known field of the wrong type or out of range is a
400 naming it. The raw message dicts still go to the chat template (so a request renders exactly
as ``ninfer.render_chat`` renders the same input), but only after they validated here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from ninfer.frontend.openai_api import ApiError, bad

Prob = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
Seed = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Positive = Annotated[int, Meta(ge=1)]


class Function(Struct):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(Struct):
    function: Function
    id: str | None = None
    type: Literal["function"] = "function"


class TextPart(Struct, tag="text", tag_field="type"):
    text: str
    cache_control: dict[str, Any] | None = None


class ImagePart(Struct, tag="image_url", tag_field="type"):
    image_url: Any = None


class AudioPart(Struct, tag="input_audio", tag_field="type"):
    input_audio: Any = None


class FilePart(Struct, tag="file", tag_field="type"):
    file: Any = None


Part = TextPart | ImagePart | AudioPart | FilePart
MEDIA_PARTS = (ImagePart, AudioPart, FilePart)


class Message(Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Part] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None              # vLLM's newer name for reasoning_content
    cache_control: dict[str, Any] | None = None


class FunctionDef(Struct):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Struct):
    function: FunctionDef
    type: Literal["function"] = "function"


class NamedFunction(Struct):
    name: str


class NamedToolChoice(Struct):
    function: NamedFunction
    type: Literal["function"] = "function"


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class StreamOptions(Struct):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class ResponseFormat(Struct):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class Sampling(Struct, kw_only=True):
    """What chat, completions and Responses share. Fields of vLLM's request schema that NInfer
    does not implement are typed here too, so that ``frontend/options.py`` can refuse them with
    a 400 naming the field instead of silently ignoring them."""

    model: str | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    seed: Seed | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None
    # vLLM's sampling parameters (chat and completions alike)
    min_p: Prob | None = None
    min_tokens: Annotated[int, Meta(ge=0)] | None = None
    logit_bias: dict[str, float] | None = None
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1)] | None = None
    prompt_logprobs: int | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    # vLLM's extra parameters
    add_special_tokens: bool | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    priority: int | None = None
    request_id: str | None = None
    logits_processors: list[Any] | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    max_repetition_pattern_size: int | None = None
    min_repetition_pattern_size: int | None = None
    repetition_min_count: int | None = None


class ChatRequest(Sampling, kw_only=True):
    messages: list[Message]
    max_tokens: Positive | None = None
    max_completion_tokens: Positive | None = None
    n: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    # vLLM's chat-only fields
    bad_words: list[str] | None = None
    echo: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    include_reasoning: bool | None = None


class CompletionRequest(Sampling, kw_only=True):
    prompt: str | list[str | int | list[int]]      # text, token ids, or a list of either (checked)
    max_tokens: Positive | None = None
    n: int | None = None
    echo: bool | None = None
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    suffix: str | None = None
    best_of: int | None = None
    prompt_embeds: Any = None


class ResponseTool(Struct, kw_only=True):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(Struct):
    format: TextFormat | None = None


class ResponsesRequest(Sampling, kw_only=True):
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    tools: list[ResponseTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    max_output_tokens: Positive | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    max_tool_calls: int | None = None
    parallel_tool_calls: bool | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    service_tier: str | None = None
    prompt: dict[str, Any] | None = None


class TokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


def convert(body: dict, kind: type) -> Any:
    """The typed request, or a 400 that names the offending field."""
    try:
        return msgspec.convert(body, kind)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        param = msg.rsplit("at `$.", 1)[1].rstrip("`") if "at `$." in msg else None
        raise bad(msg.replace("`$.", "`"), param) from None
    except RecursionError:
        raise bad("the request is nested too deeply") from None


def check_media(messages: list[Message], images: bool = False) -> None:
    """Media parts this model cannot see are a clear 400: every one on a text-only model; audio
    and file parts always; image_url parts only where ``images`` is false."""
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            for j, p in enumerate(m.content):
                if isinstance(p, MEDIA_PARTS) and not (images and isinstance(p, ImagePart)):
                    kind = type(p).__struct_config__.tag
                    what = "text only" if not images else "images only"
                    raise ApiError(400, f"messages[{i}].content[{j}]: {kind} parts are not supported by this "
                                        f"model ({what})", param=f"messages[{i}].content[{j}].type")
