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
from ninfer.frontend import offload
from ninfer.frontend.chat_plan import OutputMemory, plan_chat
from ninfer.frontend.offload import INLINE_TEXT_CHARS
from ninfer.frontend.render import ChatTokenizer
from ninfer.frontend.request_stats import RequestStats

ROLES = ("system", "developer", "user", "assistant", "tool")


MEDIA_BUDGET = 512 * 2 ** 20       # prepared pixel_values kept by the frontend (MediaCache)


class Intake:
    def __init__(self, model_dir: str, info: P.WorkerInfo, media_budget_bytes: int = MEDIA_BUDGET,
                 media_limits=None):
        self.info = info
        self.model_dir = str(model_dir) if model_dir is not None else None
        self.memory = OutputMemory()
        self.stats = RequestStats(info.max_context)
        try:
            self.tokenizer: ChatTokenizer | None = ChatTokenizer(model_dir)
        except ModelLoadError:
            self.tokenizer = None
        self.media = None          # (MediaCache, ImageParams, ImageTokens, MediaLimits) of a vision model
        if info.vision_merge:
            from ninfer.frontend.media import DEFAULT_LIMITS, MediaCache, media_config
            params, tokens = media_config(model_dir)
            self.media = (MediaCache(media_budget_bytes), params, tokens, media_limits or DEFAULT_LIMITS)

    def validate(self, spec: RequestSpec) -> RequestSpec:
        if not spec.rid:
            spec.rid = uuid.uuid4().hex
        validate_spec(spec, self.info)
        self.stats.submitted(spec)
        if spec.params.structured is not None:
            self.check_structured(spec.params.structured)
        return spec

    def check_structured(self, c: P.Constraint) -> None:
        """A grammar the worker's matcher could not use is this request's RequestError."""
        from ninfer.structured import book_for, check
        if not isinstance(c, P.Constraint) or not isinstance(c.grammar, str):
            raise RequestError("structured must be a ninfer.structured constraint")
        if self.model_dir is None:
            raise RequestError("structured outputs need the model's tokenizer")
        check(c, book_for(self.model_dir, self.info.vocab_size, tuple(self.info.eos_ids)), f"structured ({c.kind})")

    def chat(self, chat: P.ChatSpec) -> RequestSpec:
        if self.tokenizer is None:
            raise RequestError("this model directory has no tokenizer; send prompt_token_ids instead")
        check_messages(chat.messages)
        check_template(chat.template, chat.messages)
        images = self._images(chat.messages)
        plan = self._plan(chat.messages, chat.tools, chat.template)
        media: list[P.MediaItem] = []
        if images:
            plan, media = self._expand(plan, images)
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
                           split_points=plan.split_points, rid=chat.rid, media=media)

    def _plan(self, messages: list[dict], tools: list[dict] | None, template: P.TemplateOptions | None = None):
        """The chat plan (with the request's template options): here for a small input, in the
        helper process for a large one (its rendering and tokenising would hold this interpreter
        for seconds: ``offload``)."""
        try:
            size = len(msgspec.json.encode([messages, tools]))
        except (TypeError, ValueError, msgspec.EncodeError):
            size = 0                                  # what the template makes of it is said here
        if size <= INLINE_TEXT_CHARS:
            return plan_chat(self.tokenizer, messages, tools, self.memory, template)
        value = offload.shared().run(offload.plan_chat_job, self.model_dir, messages, tools,
                                     self._remembered(messages), self.info.max_context, template)
        if isinstance(value, offload.Refusal):
            raise RequestError(value.message)
        return value

    def _remembered(self, messages: list[dict]) -> dict[str, tuple[int, ...]]:
        """The remembered outputs a plan of these messages can use (the helper has no memory of
        its own): looked up by every assistant text, as sent and stripped."""
        found = {}
        for m in messages:
            if m.get("role") != "assistant":
                continue
            c = m.get("content")
            texts = [c] if isinstance(c, str) else [p.get("text") for p in c or () if isinstance(p, dict)]
            for t in texts:
                for key in {t, t.strip()} if isinstance(t, str) else ():
                    ids = self.memory.get(key)
                    if ids is not None:
                        found[key] = ids
        return found

    def _images(self, messages: list[dict]) -> list:
        """Every image part, prepared, in template order (message by message, part by part)."""
        found = [(i, j, p) for i, m in enumerate(messages) if isinstance(m.get("content"), list)
                 for j, p in enumerate(m["content"]) if isinstance(p, dict) and p.get("type") in ("image_url", "image")]
        if not found:
            return []
        if self.media is None:
            raise RequestError(f"messages[{found[0][0]}].content[{found[0][1]}]: image parts are not supported by "
                               f"this model ({self.info.model_type}: no vision tower)")
        from ninfer.frontend.media import part_url, read_image_url
        cache, params, _, limits = self.media
        out = []
        for i, j, part in found:
            where = f"messages[{i}].content[{j}].image_url"
            data = read_image_url(part_url(part.get("image_url"), where), limits, where)
            out.append(cache.get_or_prepare(data, params, max_image_pixels=limits.max_image_pixels, where=where))
        return out

    def _expand(self, plan, images: list):
        """Expand each image's one rendered pad to its token count, carrying identity ids, and
        move every plan position past an image by the added tokens (a position never lands
        inside a span: a rendered frontier is before or after the one pad)."""
        from ninfer.frontend.media import expand_image_pads, request_media
        _, _, tokens, _ = self.media
        pads = [k for k, t in enumerate(plan.prompt) if t == tokens.pad]
        ids, spans = expand_image_pads(plan.prompt, images, tokens)
        ids, media = request_media(ids, images, spans, self.info.vocab_size)

        def moved(x):
            if x is None:
                return None
            return x + sum(im.num_tokens - 1 for k, im in zip(pads, images) if k < x)
        plan.prompt = ids
        plan.markers = [moved(x) for x in plan.markers]
        plan.split_points = [moved(x) for x in plan.split_points]
        plan.recovery_frontier = moved(plan.recovery_frontier)
        plan.response_replay = moved(plan.response_replay)
        plan.turn_closure = moved(plan.turn_closure)
        return plan, media

    def observe(self, ev: P.Event) -> None:
        """Remember the exact tokens of each finished output under the text the client sees;
        count the request (``RequestStats``)."""
        if isinstance(ev, P.FinalEvent):
            self.stats.finished(ev)
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


# what the template is always given by the renderer: never a chat_template_kwargs entry
RESERVED_TEMPLATE_VARS = ("messages", "tools", "add_generation_prompt", "continue_final_message")


def check_template(opts: P.TemplateOptions | None, messages: list) -> None:
    """The template options of one chat: a clear RequestError naming the field."""
    if opts is None:
        return
    if opts.add_generation_prompt and opts.continue_final_message:
        raise RequestError("continue_final_message and add_generation_prompt cannot both be true "
                           "(set add_generation_prompt to false to continue the final message)")
    if not isinstance(opts.kwargs, dict) or any(not isinstance(k, str) for k in opts.kwargs):
        raise RequestError("chat_template_kwargs must be an object with string keys")
    clash = [k for k in opts.kwargs if k in RESERVED_TEMPLATE_VARS]
    if clash:
        raise RequestError(f"chat_template_kwargs.{clash[0]} is set by the request itself, not by chat_template_kwargs")
