"""The Qwen3 reasoning parser (``frontend/reasoning.py``): the thinking apart from the answer,
the same however the text arrives in pieces (streaming and non-streaming split alike)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer.errors import ConfigError
from ninfer.frontend.reasoning import ThinkSplit, choose_parser, starts_inside

CASES = [
    ("<think>\nI should greet.\n</think>\n\nHello!", False, ("I should greet.", "Hello!")),
    ("Hello, no thinking here.", False, ("", "Hello, no thinking here.")),
    ("  <think>x</think>y", False, ("x", "y")),
    ("I think <think> is a tag</think>", False, ("", "I think <think> is a tag</think>")),
    ("<think>\nstill thinking when cut off", False, ("still thinking when cut off", "")),
    ("\nthought inside\n</think>\n\nanswer\n\nwith lines", True, ("thought inside", "answer\n\nwith lines")),
    ("<think>\n\n</think>\n\n", False, ("", "")),
    ("<think>a\n\nb</think>", False, ("a\n\nb", "")),
    ("<thi", False, ("", "<thi")),
]


def _whole(text: str, inside: bool) -> tuple[str, str]:
    s = ThinkSplit(inside)
    r, c = s.feed(text)
    r2, c2 = s.flush()
    return r + r2, c + c2


@pytest.mark.parametrize("text,inside,want", CASES, ids=[c[0][:20] for c in CASES])
def test_the_split(text, inside, want):
    assert _whole(text, inside) == want


@given(st.sampled_from(CASES), st.lists(st.integers(0, 60), max_size=8))
@settings(max_examples=200, deadline=None)
def test_any_chunking_splits_alike(case, cuts):
    text, inside, want = case
    s, r, c = ThinkSplit(inside), "", ""
    at = 0
    for cut in sorted(set(min(x, len(text)) for x in cuts)) + [len(text)]:
        a, b = s.feed(text[at:cut])
        r, c, at = r + a, c + b, cut
    a, b = s.flush()
    assert (r + a, c + b) == want


def test_choosing_the_parser():
    assert choose_parser("auto", "... <think> ...") == "qwen3"
    assert choose_parser("auto", "{% if enable_thinking %}") == "qwen3"
    assert choose_parser("auto", "plain ChatML") is None and choose_parser("none", "<think>") is None
    with pytest.raises(ConfigError, match="deepseek"):
        choose_parser("deepseek", "")
    assert starts_inside("<|im_start|>assistant\n<think>\n") and not starts_inside("<|im_start|>assistant\n")
