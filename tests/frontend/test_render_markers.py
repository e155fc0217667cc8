"""User text never collides with the renderer's internal marks (issue 13)."""

from __future__ import annotations

import pytest

import ninfer
from ninfer.frontend import provenance
from ninfer.frontend.chat_plan import plan_chat
from ninfer.frontend.render import ChatTokenizer

# every character the sentinels used to be, alone, paired, and as unmatched begin/end marks
OLD_MARKS = "".join(chr(c) for c in range(0xE000, 0xE002)) + "\ue0ffnext-user probe" + \
    "".join(chr(c) for c in range(0xE100, 0xE200))
NASTY = ["\ue000", "\ue001", "\ue000\ue100", "\ue001\ue100", "x\ue001\ue105y", "\ue000\ue1ff tail",
         "\ue0ffnext-user probe", OLD_MARKS, "\ue000\ue100inner\ue001\ue100", "end\ue000",
         "\ue000\uf000x\ue001\uf000"]   # the last one made the old strip index past its tags


@pytest.fixture(scope="module")
def tok(tiny_model):
    return ChatTokenizer(tiny_model)


def _conversation(text: str) -> list[dict]:
    return [{"role": "system", "content": "Be brief." + text},
            {"role": "user", "content": text},
            {"role": "assistant", "content": "Sure " + text},
            {"role": "user", "content": [{"type": "text", "text": text, "cache_control": {"type": "ephemeral"}},
                                         {"type": "text", "text": " and more " + text}]}]


@pytest.mark.parametrize("text", NASTY, ids=range(len(NASTY)))
def test_content_with_marker_characters_plans_exactly(tok, tiny_model, text):
    msgs = _conversation(text)
    plan = plan_chat(tok, msgs)
    assert plan.prompt == ninfer.render_chat(tiny_model, msgs)
    # provenance still works: C before the user turn's closing structure, the part marker
    assert plan.recovery_frontier < plan.response_replay
    assert tok.decode(plan.prompt[:plan.recovery_frontier], skip_special_tokens=False).endswith(" and more " + text)
    assert any(tok.decode(plan.prompt[:m], skip_special_tokens=False).endswith("Be brief." + text + "<|im_end|>\n")
               for m in plan.markers)


def test_a_text_using_up_the_sentinel_pool_gives_fewer_points_never_wrong_ones(tok, tiny_model, monkeypatch):
    """With no free code point left there is no content provenance and no probe: the plan
    keeps only points that need neither, and the prompt is still exact."""
    monkeypatch.setattr(provenance, "_POOL", ((0xE000, 0xE004),))
    text = "".join(chr(c) for c in range(0xE000, 0xE004))
    msgs = [{"role": "user", "content": "Weather?" + text}]
    plan = plan_chat(tok, msgs)
    assert plan.prompt == ninfer.render_chat(tiny_model, msgs)
    assert plan.recovery_frontier == plan.turn_closure == 0           # no probe: nothing survives
    assert plan.response_replay == len(plan.prompt) - 3               # before <|im_start|>assistant\n
    assert plan.markers == []                                         # no source parts


def test_sentinels_avoid_the_rendered_text():
    used = "".join(chr(c) for c in range(0xE000, 0xE300))
    probe, marks = provenance.choose_marks(used, 70000)
    taken = {probe, marks.begin, marks.end, *marks.digits}
    assert len(taken) == 3 + len(marks.digits) and not taken & set(used)
    assert marks.width == 3                                           # 256 ** 2 < 70000 tags
    assert provenance.choose_marks("", 1) == ("\ue0ff", provenance.Sentinels("\ue000", "\ue001", "".join(
        chr(c) for c in range(0xE100, 0xE200)), 1))                   # what they always were
