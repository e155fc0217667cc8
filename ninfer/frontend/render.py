"""Chat input -> exact prompt token ids, with the model's own template and tokenizer."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer

from ninfer.errors import ModelLoadError, RequestError
from ninfer.frontend.template import render_template


class ChatTokenizer:
    """tokenizer.json + the chat template of tokenizer_config.json of one model directory."""

    def __init__(self, model_dir: str | Path):
        d = Path(model_dir)
        tok_file, cfg_file = d / "tokenizer.json", d / "tokenizer_config.json"
        if not tok_file.is_file():
            raise ModelLoadError(f"{d}: no tokenizer.json (needed for chat input and text output)")
        self.tokenizer = Tokenizer.from_file(str(tok_file))
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        template = cfg.get("chat_template")
        jinja_file = d / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        self.chat_template: str | None = template

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def render(self, messages: list[dict], tools: list[dict] | None = None,
               add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise RequestError("this model has no chat template; send prompt_token_ids instead")
        return render_template(self.chat_template, messages, tools, add_generation_prompt)


@lru_cache(maxsize=4)
def load_chat_tokenizer(model_dir: str) -> ChatTokenizer:
    return ChatTokenizer(model_dir)


def render_chat(model_dir: str | Path, messages: list[dict], tools: list[dict] | None = None,
                add_generation_prompt: bool = True) -> list[int]:
    """The exact prompt tokens the engine computes for an OpenAI-style chat input."""
    tok = load_chat_tokenizer(str(Path(model_dir).resolve()))
    return tok.encode(tok.render(messages, tools, add_generation_prompt))
