"""Request intake: chat input to the exact prompt and its restore positions, validation,
request ids, and the memory of produced outputs. Runs inside the frontend actor (or the
in-process engine); bad input is a RequestError for that request alone."""

from __future__ import annotations

import uuid

import msgspec

from ninfer import protocol as P
from ninfer.protocol import RequestSpec
from ninfer.frontend.validate import validate_spec
from ninfer.errors import ModelLoadError, RequestError
from ninfer.frontend.chat_plan import OutputMemory, plan_chat
from ninfer.frontend.render import ChatTokenizer

ROLES = ("system", "developer", "user", "assistant", "tool")


class Intake:
    def __init__(self, model_dir: str, info: P.WorkerInfo):
        self.info = info
        self.memory = OutputMemory()
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
        check_messages(chat.messages)
        plan = plan_chat(self.tokenizer, chat.messages, chat.tools, self.memory)
        markers = sorted(set(plan.markers) | set(chat.markers))
        if len(markers) > 4:
            raise RequestError(f"at most 4 cache markers are allowed, got {len(markers)}")
        params = chat.params
        if chat.fill_max_tokens:
            room = self.info.max_context - len(plan.prompt)
            if room < 1:
                raise RequestError(f"this engine's max_context is {self.info.max_context} tokens, but the "
                                   f"prompt alone has {len(plan.prompt)}")
            params = msgspec.structs.replace(params, max_tokens=min(params.max_tokens, room))
        return RequestSpec(prompt=plan.prompt, params=params, session_id=chat.session_id,
                           markers=markers, recovery_frontier=plan.recovery_frontier,
                           response_replay=plan.response_replay, turn_closure=plan.turn_closure,
                           split_points=plan.split_points, rid=chat.rid)

    def observe(self, ev: P.Event) -> None:
        """Remember the exact tokens of each finished output under the text the client sees."""
        if isinstance(ev, P.FinalEvent) and ev.token_ids and self.tokenizer is not None:
            ids = list(ev.token_ids)
            while ids and ids[-1] in self.info.eos_ids:
                ids.pop()
            self.memory.remember(self.text(ids), ids)

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None and ids else ""


def check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}] must be an object")
        if m.get("role") not in ROLES:
            raise RequestError(f"messages[{i}].role {m.get('role')!r} is not one of {', '.join(ROLES)}")
        c = m.get("content")
        if c is not None and not isinstance(c, (str, list)):
            raise RequestError(f"messages[{i}].content must be a string, a list of parts or null")
