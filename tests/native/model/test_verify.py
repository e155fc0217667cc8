"""Verify rows (speculative decoding): a committed input and its drafts in one row equal decoding
them one by one, and ``roll_back`` leaves exactly the state after the kept prefix — in float64,
on both forward paths, with decode rows and a prefill chunk in the same call."""

from __future__ import annotations

import pytest
import torch

from ninfer.native.model.forward import ForwardBatch, SeqInput
from ninfer.native.model.model import HybridModel
from ninfer.native.model.paths import BATCHED, PER_SEQUENCE

PROMPT = [5, 17, 300, 42, 99, 1000, 7, 8, 9, 10, 11, 12]
VERIFY = [13, 14, 15, 16]           # the committed input and three drafts
OTHER = [40, 41, 42, 43, 44, 45, 46]


@pytest.fixture(scope="module")
def model(tiny_model):
    return HybridModel.load(tiny_model, "float64")


def _prefill(m, cache):
    """Sequence A (slot 1, pages 0-1) holds PROMPT; sequence B (slot 2, pages 2-3) OTHER[:-1]."""
    m.forward(ForwardBatch.build([SeqInput(PROMPT, 0, [0, 1], state_slot=1),
                                  SeqInput(OTHER[:-1], 0, [2, 3], state_slot=2)]), cache)


def _one_by_one(m, n):
    cache = m.new_cache(6, 4)
    _prefill(m, cache)
    logits = []
    for i in range(n):
        out = m.forward(ForwardBatch.build([SeqInput([VERIFY[i]], len(PROMPT) + i, [0, 1], state_slot=1)]), cache)
        logits.append(out.logits[0])
    return torch.stack(logits), cache


@pytest.mark.parametrize("path", [BATCHED, PER_SEQUENCE], ids=lambda p: p.name)
@pytest.mark.parametrize("keep", [1, 2, 4])
def test_a_verify_row_equals_decoding_and_rolls_back_to_the_kept_prefix(model, path, keep, monkeypatch):
    monkeypatch.setattr(model, "path", path)
    cache = model.new_cache(6, 4)
    _prefill(model, cache)
    # the verify row beside a decode row (B's next token) and a prefill chunk (C, slot 3, page 4)
    batch = ForwardBatch.build([
        SeqInput(VERIFY, len(PROMPT), [0, 1], state_slot=1, logits="all", verify=True),
        SeqInput(OTHER[-1:], len(OTHER) - 1, [2, 3], state_slot=2),
        SeqInput(PROMPT[:9], 0, [4], state_slot=3),
    ])
    out = model.forward(batch, cache)
    want, ref = _one_by_one(model, len(VERIFY))
    assert (out.logits[:len(VERIFY)] - want).abs().max() < 1e-12
    model.roll_back(cache, batch, 0, 1, keep)
    _, ref = _one_by_one(model, keep)
    assert (cache.ssm[:, 1] - ref.ssm[:, 1]).abs().max() < 1e-12
    assert (cache.conv[:, 1] - ref.conv[:, 1]).abs().max() < 1e-12
    # the neighbours are untouched by the verify row's bookkeeping
    alone = model.new_cache(6, 4)
    _prefill(model, alone)
    model.forward(ForwardBatch.build([SeqInput(OTHER[-1:], len(OTHER) - 1, [2, 3], state_slot=2)]), alone)
    assert (cache.ssm[:, 2] - alone.ssm[:, 2]).abs().max() < 1e-12
