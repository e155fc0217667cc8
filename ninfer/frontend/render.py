"""Chat input -> exact prompt token ids, with the model's own template and tokenizer."""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer

from ninfer.errors import ModelLoadError, RequestError
from ninfer.frontend.template import render_template

_SURROGATE = re.compile("[\ud800-\udfff]")

# Pre-tokenizers that treat every split alike, wherever it sits in the input. Metaspace with
# prepend_scheme "first" is the known exception: it looks at the split's original offset.
_SPLIT_LOCAL_PRE_TOKENIZERS = {"BertPreTokenizer", "ByteLevel", "CharDelimiterSplit", "Delimiter", "Digits",
                               "Metaspace", "Punctuation", "Sequence", "Split", "UnicodeScripts", "Whitespace",
                               "WhitespaceSplit"}


class ChatTokenizer:
    """tokenizer.json + the chat template of tokenizer_config.json of one model directory."""

    def __init__(self, model_dir: str | Path):
        d = Path(model_dir)
        self.source = d                      # the directory (structured outputs read tokenizer.json)
        tok_file, cfg_file = d / "tokenizer.json", d / "tokenizer_config.json"
        if not tok_file.is_file():
            raise ModelLoadError(f"{d}: no tokenizer.json (needed for chat input and text output)")
        spec_text = tok_file.read_text()
        self.tokenizer = Tokenizer.from_str(spec_text)
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        template = cfg.get("chat_template")
        jinja_file = d / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        self.chat_template: str | None = template
        # encode_special_tokens makes special tokens plain text: nothing cuts the input then
        self.segment_cuts: dict[int, str] = ({} if getattr(self.tokenizer, "encode_special_tokens", False)
                                             else segment_cuts(json.loads(spec_text)))

    def encode(self, text: str) -> list[int]:
        check_text(text, "the text")
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def render(self, messages: list[dict], tools: list[dict] | None = None,
               add_generation_prompt: bool = True, template_kwargs: dict | None = None,
               continue_final: bool = False) -> str:
        """The template's text. ``template_kwargs``: extra template variables
        (``chat_template_kwargs``); ``continue_final``: cut the text right after the final
        message's content, leaving that message open for the model to continue."""
        if self.chat_template is None:
            raise RequestError("this model has no chat template; send prompt_token_ids instead")
        text = render_template(self.chat_template, messages, tools, add_generation_prompt, **(template_kwargs or {}))
        if _SURROGATE.search(text):
            raise RequestError(f"{_surrogate_source(messages, tools)} contains an unpaired surrogate "
                               "(a lone UTF-16 half such as \\ud800); text must be valid Unicode")
        return continue_final_message(text, messages) if continue_final else text


def continue_final_message(text: str, messages: list[dict]) -> str:
    """``text`` cut right after the final message's content (transformers'
    ``continue_final_message``): the last text part of its content is found last in the text,
    and its trailing whitespace is kept only where the template kept it."""
    final = messages[-1].get("content") if messages else None
    if isinstance(final, list):
        final = next((p.get("text") for p in reversed(final) if isinstance(p, dict) and "text" in p), None)
    if not isinstance(final, str) or not final.strip():
        raise RequestError("continue_final_message: the final message has no text to continue")
    at = text.rfind(final.strip())
    if at < 0:
        raise RequestError("continue_final_message: the chat template does not render the final message's text "
                           "as sent, so it cannot be continued")
    if text[at:at + len(final.lstrip())] == final:
        return text[:at + len(final.lstrip())]
    return text[:at + len(final.strip())]


def check_text(text: str, where: str) -> None:
    """Text the tokenizer cannot take (a lone surrogate, e.g. "\\ud800" decoded from JSON) is
    a RequestError naming ``where``, not a crash inside the tokenizer. One scan of ``text``."""
    if _SURROGATE.search(text):
        raise RequestError(f"{where} contains an unpaired surrogate (a lone UTF-16 half such as \\ud800); "
                           "text must be valid Unicode")


def _surrogate_source(messages: list[dict], tools: list[dict] | None) -> str:
    """The first message field (or tool) holding a surrogate; searched only once one was found."""
    def has(x) -> bool:
        if isinstance(x, str):
            return bool(_SURROGATE.search(x))
        if isinstance(x, dict):
            return any(has(k) or has(v) for k, v in x.items())
        if isinstance(x, (list, tuple)):
            return any(has(v) for v in x)
        return False

    for i, m in enumerate(messages):
        if isinstance(m, dict):
            for key, value in m.items():
                if has(value):
                    return f"messages[{i}].{key}"
    for j, tool in enumerate(tools or []):
        if has(tool):
            return f"tools[{j}]"
    return "the rendered chat"


def segment_cuts(spec: dict) -> dict[int, str]:
    """Added tokens after or before which tokenization provably restarts: id -> content.

    The tokenizers library first cuts the raw input at non-normalized added tokens (leftmost-
    longest), then normalizes, pre-tokenizes and encodes each piece on its own. So where such
    a token matched in a text S, encode(S[:p]) equals S's tokens up to the last cut before p
    followed by encode(S[cut:p]) — provided no token strips neighbouring whitespace or needs a
    single word, and no stage depends on where a piece sits in the input (Metaspace "first"),
    and nothing truncates or pads. Otherwise no cuts: frontiers then tokenize the whole prefix.
    """
    if spec.get("truncation") or spec.get("padding") or (spec.get("model") or {}).get("dropout"):
        return {}
    if not _split_local(spec.get("pre_tokenizer")):
        return {}
    return {t["id"]: t["content"] for t in spec.get("added_tokens", [])
            if not t.get("normalized", True) and t.get("content")
            and not (t.get("lstrip") or t.get("rstrip") or t.get("single_word"))}


def _split_local(pre: dict | None) -> bool:
    if pre is None:
        return True
    kind = pre.get("type")
    if kind not in _SPLIT_LOCAL_PRE_TOKENIZERS:
        return False
    if kind == "Metaspace" and pre.get("prepend_scheme", "always") == "first":
        return False
    return all(_split_local(p) for p in pre.get("pretokenizers", []))


@lru_cache(maxsize=4)
def load_chat_tokenizer(model_dir: str) -> ChatTokenizer:
    return ChatTokenizer(model_dir)


def render_chat(model_dir: str | Path, messages: list[dict], tools: list[dict] | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                chat_template_kwargs: dict | None = None) -> list[int]:
    """The exact prompt tokens the engine computes for an OpenAI-style chat input (with the
    same template options ``Engine.chat`` takes)."""
    tok = load_chat_tokenizer(str(Path(model_dir).resolve()))
    return tok.encode(tok.render(messages, tools, add_generation_prompt and not continue_final_message,
                                 chat_template_kwargs, continue_final_message))
