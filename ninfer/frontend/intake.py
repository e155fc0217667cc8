"""Request intake: chat input to exact prompt tokens, validation, request ids. Runs inside the
frontend actor (or the in-process engine); bad input is a RequestError for that request alone."""

from __future__ import annotations

import uuid

from ninfer import protocol as P
from ninfer.engine.request import RequestSpec
from ninfer.engine.validate import validate_spec
from ninfer.errors import ModelLoadError, RequestError
from ninfer.frontend.render import ChatTokenizer


class Intake:
    def __init__(self, model_dir: str, info: P.WorkerInfo):
        self.info = info
        try:
            self.tokenizer: ChatTokenizer | None = ChatTokenizer(model_dir)
        except ModelLoadError:
            self.tokenizer = None

    def validate(self, spec: RequestSpec) -> RequestSpec:
        if not spec.rid:
            spec.rid = uuid.uuid4().hex
        validate_spec(spec, self.info)
        return spec

    def chat(self, chat: P.ChatSpec) -> RequestSpec:
        if self.tokenizer is None:
            raise RequestError("this model directory has no tokenizer; send prompt_token_ids instead")
        if not isinstance(chat.messages, list) or not chat.messages:
            raise RequestError("messages must be a non-empty list")
        prompt = self.tokenizer.encode(self.tokenizer.render(chat.messages, chat.tools, add_generation_prompt=True))
        return RequestSpec(prompt=prompt, params=chat.params, session_id=chat.session_id,
                           markers=list(chat.markers), rid=chat.rid)

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None and ids else ""
