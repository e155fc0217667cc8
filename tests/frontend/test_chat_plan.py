"""Typed R, the C-vs-R restore choice and markers land on exact token positions of the tiny
model's template (seed: the Frontend row, typed R, shared markers)."""

from __future__ import annotations

import pytest

from ninfer.errors import RequestError
from ninfer.frontend.chat_plan import OutputMemory, plan_chat
from ninfer.frontend.render import ChatTokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tok(tiny_model):
    return ChatTokenizer(tiny_model)


def text_before(tok, plan, k) -> str:
    return tok.decode(plan.prompt[:k], skip_special_tokens=False)


def test_user_turn_saves_c_and_the_closing_structure_is_recomputed(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    plan = plan_chat(tok, msgs)
    assert text_before(tok, plan, plan.response_replay).endswith("Weather in Paris?<|im_end|>\n")
    assert plan.turn_closure == plan.response_replay
    assert text_before(tok, plan, plan.recovery_frontier).endswith("Weather in Paris?")      # C
    assert plan.recovery_frontier < plan.response_replay
    assert plan.prompt[plan.recovery_frontier] == 2041                                      # <|im_end|> follows C
    assert plan.split_points == [plan.response_replay]
    # the automatic marker (end of the last source part) merges with the private C point; the
    # leading instructions get a structural opportunity
    assert plan.auto_marker == plan.recovery_frontier
    assert text_before(tok, plan, plan.markers[0]).endswith("Be brief.<|im_end|>\n")


def test_tool_result_turn_saves_r(tok):
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": '{"temp_c": 14}'}]
    plan = plan_chat(tok, msgs, TOOLS)
    # R follows a tool message: no C shortcut
    assert plan.recovery_frontier == plan.response_replay
    assert text_before(tok, plan, plan.response_replay).endswith("</tool_response><|im_end|>\n")
    # TurnClosure: before the first assistant start after the real user message
    assert text_before(tok, plan, plan.turn_closure).endswith("Weather in Paris?<|im_end|>\n")
    assert plan.turn_closure < plan.response_replay
    assert plan.split_points == sorted({plan.turn_closure, plan.response_replay})
    # the tools boundary is a structural opportunity
    assert any(text_before(tok, plan, m).endswith("</tool_call><|im_end|>\n") for m in plan.markers)


def test_structured_tool_call_uses_its_message_boundary_as_auto_marker(tok):
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}]
    plan = plan_chat(tok, msgs, TOOLS)
    assert text_before(tok, plan, plan.auto_marker).endswith("</tool_call><|im_end|>\n")


def test_explicit_markers_message_and_part_boundaries(tok):
    msgs = [{"role": "system", "content": "Policy text.", "cache_control": {"type": "ephemeral"}},
            {"role": "user", "content": [
                {"type": "text", "text": "A long shared document.\n", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Question?"}]}]
    plan = plan_chat(tok, msgs)
    texts = [text_before(tok, plan, m) for m in plan.markers]
    assert any(t.endswith("Policy text.<|im_end|>\n") for t in texts)          # message boundary
    assert any(t.endswith("A long shared document.\n") for t in texts)          # part boundary
    assert any(t.endswith("Question?") for t in texts)                          # the automatic one


def test_bpe_merge_across_an_append_invalidates_a_naive_position(tok):
    """A part boundary inside what the tokenizer merges into one token is not an exact frontier:
    it is never offered, although a naive character position exists."""
    msgs = [{"role": "user", "content": [
        {"type": "text", "text": "The weath", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "er is nice"}]}]
    plan = plan_chat(tok, msgs)
    texts = [text_before(tok, plan, m) for m in plan.markers]
    assert not any(t.endswith("The weath") for t in texts)
    assert any(t.endswith("er is nice") for t in texts)
    whole = tok.encode("<|im_start|>user\nThe weather is nice")
    naive = tok.encode("<|im_start|>user\nThe weath")
    assert whole[: len(naive)] != naive                      # the naive prefix really differs


def test_more_than_four_explicit_markers_is_an_error(tok):
    msgs = [{"role": "user", "content": [{"type": "text", "text": f"part {i}. ", "cache_control": {"type": "ephemeral"}}
                                         for i in range(5)]}]
    with pytest.raises(RequestError, match="at most 4"):
        plan_chat(tok, msgs)


def test_auto_marker_yields_to_four_explicit_ones(tok):
    msgs = [{"role": "user", "content": [{"type": "text", "text": f"Part {i} ends.\n", "cache_control": {"type": "ephemeral"}}
                                         for i in range(4)] + [{"type": "text", "text": "tail"}]}]
    plan = plan_chat(tok, msgs)
    assert len(plan.markers) == 4 and plan.auto_marker is None


def test_client_normalised_tool_call_falls_back_to_typed_r(tok):
    """Turn 2 rewrites turn 1's answer as a structured tool call: the generation end no longer
    matches, but turn 1's typed-R position is still an exact prefix of turn 2."""
    memory = OutputMemory()
    turn1 = [{"role": "user", "content": "Weather in Paris?"}]
    p1 = plan_chat(tok, turn1, TOOLS, memory)
    raw_answer = tok.encode("I will check the weather tool now")
    memory.remember(tok.decode(raw_answer), raw_answer)
    turn2 = turn1 + [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "rain"}]
    p2 = plan_chat(tok, turn2, TOOLS, memory)
    e_tokens = p1.prompt + raw_answer[:-1]
    assert p2.prompt[: len(e_tokens)] != e_tokens                           # E no longer matches
    assert p2.prompt[: p1.recovery_frontier] == p1.prompt[: p1.recovery_frontier]
    assert p2.prompt[: p1.response_replay] == p1.prompt[: p1.response_replay]


def test_remembered_output_tokens_are_reused_exactly(tok):
    """The assistant text the client sends back is computed with the exact tokens the model
    produced, so the next turn extends the generation end."""
    memory = OutputMemory()
    turn1 = [{"role": "user", "content": "Hi"}]
    p1 = plan_chat(tok, turn1, None, memory)
    produced = next(p for a in range(300, 2000, 7) for b in range(300, 2000, 13)
                    if tok.encode(tok.decode(p := [a, b])) != p)     # an output that does not re-encode
    text = tok.decode(produced)
    memory.remember(text, produced)
    turn2 = turn1 + [{"role": "assistant", "content": text}, {"role": "user", "content": "More"}]
    p2 = plan_chat(tok, turn2, None, memory)
    assert p2.prompt[: len(p1.prompt) + len(produced)] == p1.prompt + produced
    assert text_before(tok, p2, p2.response_replay).endswith("More<|im_end|>\n")
