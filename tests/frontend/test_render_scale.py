"""Planning is linear in the conversation: a bounded number of renders whatever its length,
and where a bounded search gives up depth, the points it offers stay exact (issue 13)."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from ninfer.errors import RequestError
from ninfer.frontend import provenance
from ninfer.frontend.chat_plan import plan_chat
from ninfer.frontend.render import ChatTokenizer
from tests.frontend import _old_chat_plan as old
from tests.frontend.test_render_equivalence import CURRENT_TAG, TEMPLATES, TOOLS, conversation


class CountingTokenizer(ChatTokenizer):
    def __init__(self, model_dir, template=None):
        super().__init__(model_dir)
        if template is not None:
            self.chat_template = template
        self.renders: list[int] = []                 # messages per render

    def render(self, messages, tools=None, add_generation_prompt=True, *options):
        self.renders.append(len(messages))
        return super().render(messages, tools, add_generation_prompt, *options)


def agent_conversation(n: int) -> list[dict]:
    msgs = [{"role": "system", "content": "You are an agent."}]
    while len(msgs) < n - 1:
        k = len(msgs)
        msgs += [{"role": "user", "content": f"Step {k}: check the weather"},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"type": "function", "function": {"name": "get_weather", "arguments": {"city": f"c{k}"}}}]},
                 {"role": "tool", "content": f"rain {k}"},
                 {"role": "assistant", "content": f"It rains in c{k}."}]
    return msgs[:n - 1] + [{"role": "user", "content": "And tomorrow?"}]


def assert_points_exact(tok: ChatTokenizer, msgs: list[dict], tools, plan) -> None:
    """Every offered point is an exact frontier of the text, and TurnClosure survives a next
    user turn (the probe's tokens agree before it)."""
    r = provenance.render_with_provenance(tok, msgs, tools)
    assert plan.prompt == r.tokens
    for k in {plan.response_replay, plan.turn_closure, plan.recovery_frontier, *plan.markers} - {None}:
        c = r.offsets[k][0] if k < len(r.tokens) else len(r.text)
        assert tok.encode(r.text[:c]) == plan.prompt[:k]
    nxt = tok.encode(tok.render(msgs + [{"role": "user", "content": "next"}], tools))
    assert nxt[:plan.turn_closure] == plan.prompt[:plan.turn_closure]


@pytest.mark.parametrize("n", [200, 2400])
def test_renders_are_bounded_whatever_the_length(tiny_model, n):
    tok = CountingTokenizer(tiny_model)
    msgs = agent_conversation(n)
    plan = plan_chat(tok, msgs, TOOLS)
    # full text, marked text, probe, tools preamble; prefixes: the open turn, the system message
    assert len(tok.renders) <= 7
    assert sum(tok.renders) <= 5 * n
    assert_points_exact(tok, msgs, TOOLS, plan)
    if n <= 200:
        assert dataclasses.asdict(plan) == dataclasses.asdict(old.plan_chat(tok, msgs, TOOLS))


def test_a_long_run_of_non_prefix_renderings_gallops_from_the_start(tiny_model):
    """CURRENT_TAG tags the last user message: a next user turn re-renders it, and every prefix
    that ends before it tags an earlier one. The boundaries that survive are the ones before the
    first user message — found past the downward search's bound in O(log n) renders."""
    tok = CountingTokenizer(tiny_model, CURRENT_TAG)
    msgs = [{"role": "system", "content": "Rules."}]
    msgs += [{"role": "assistant", "content": f"note {i}"} for i in range(40)]
    for i in range(30):
        msgs += [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
    msgs.append({"role": "user", "content": "last question"})
    plan = plan_chat(tok, msgs)
    n = len(msgs)
    assert len(tok.renders) <= 6 + provenance.SEARCH_RENDERS + 2 * math.ceil(math.log2(n)) + 2
    assert dataclasses.asdict(plan) == dataclasses.asdict(old.plan_chat(tok, msgs))
    assert tok.decode(plan.prompt[:plan.turn_closure], skip_special_tokens=False).endswith("note 39<|im_end|>\n")
    assert_points_exact(tok, msgs, None, plan)


@pytest.mark.parametrize("template", list(TEMPLATES))
def test_past_the_search_bounds_points_are_shallower_but_exact(tiny_model, monkeypatch, template):
    """With the downward search cut to one render, plans may lose depth against the old
    planner, never exactness: every point is a true frontier and TurnClosure survives."""
    monkeypatch.setattr(provenance, "SEARCH_RENDERS", 1)
    tok = ChatTokenizer(tiny_model)
    if TEMPLATES[template] is not None:
        tok.chat_template = TEMPLATES[template]
    rng = random.Random(template)
    checked = 0
    for _ in range(25):
        msgs, tools = conversation(rng, max_len=40)
        try:
            plan = plan_chat(tok, msgs, tools)
        except RequestError:
            continue
        assert_points_exact(tok, msgs, tools, plan)
        checked += 1
    assert checked >= 10
