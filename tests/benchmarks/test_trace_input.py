"""The trace bench's arithmetic, model-free: the floors on a hand-checked trace and against brute
force, the hash id -> token block mapping and its length scaling, the three input formats, the
context cut, the arrival windows, and the token trace it writes."""

from __future__ import annotations

import json
import random

import pytest

from ninfer.benchmarks.trace import sample
from ninfer.benchmarks.trace_floor import floors
from ninfer.benchmarks.trace_input import (BlockTokens, TraceError, load, ordinary_vocab, save_tokens,
                                           scaled_output, windows)

#        tokens               ideal (beyond the longest lcp)   prompt ends (beyond the longest earlier prompt
#                                                               that is a prefix)
HAND = [([1, 2, 3, 4], 4, 4),                   # nothing earlier
        ([1, 2, 3, 4, 5, 6], 2, 2),             # lcp 4 with #0, which is a prefix
        ([1, 2, 7], 1, 3),                      # lcp 2 with #0; no earlier prompt is a prefix of it
        ([1, 2, 3, 4, 5, 6], 0, 0),             # a repeat of #1
        ([9], 1, 1),
        ([1, 2, 3, 4, 5, 7, 8], 2, 3)]          # lcp 5 with #1; #0 (4 tokens) is its longest prefix prompt


def test_floors_on_a_hand_checked_trace():
    f = floors([p for p, _, _ in HAND])
    assert f.ideal == [i for _, i, _ in HAND] and f.ends == [e for _, _, e in HAND]
    assert f.repeats == 1
    trie = {tuple(p[:k]) for p, _, _ in HAND for k in range(1, len(p) + 1)}
    assert f.ideal_total == len(trie) == 10                      # every distinct prefix once
    assert f.ends_total == 13


def _brute(prompts):
    def lcp(a, b):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        return k
    ideal = [len(p) - max((lcp(p, q) for q in prompts[:i]), default=0) for i, p in enumerate(prompts)]
    ends = [len(p) - max((len(q) for q in prompts[:i] if p[:len(q)] == q), default=0) for i, p in enumerate(prompts)]
    return ideal, ends


def test_floors_equal_brute_force_on_random_branching_prompts():
    rng = random.Random(7)
    for _ in range(150):
        prompts: list[list[int]] = []
        for _ in range(rng.randint(1, 14)):
            if prompts and rng.random() < 0.7:           # branch off (or repeat) an earlier prompt
                base = rng.choice(prompts)
                p = base[: rng.randint(0, len(base))] + [rng.randrange(3) for _ in range(rng.randint(0, 4))]
            else:
                p = [rng.randrange(3) for _ in range(rng.randint(1, 6))]
            prompts.append(p or [0])
        f = floors(prompts)
        assert (f.ideal, f.ends) == _brute(prompts), prompts


def test_each_hash_id_is_one_fixed_block_of_ordinary_tokens():
    a, b = BlockTokens(16, vocab=100, seed=0), BlockTokens(16, vocab=100, seed=0)
    assert a.block(5) == b.block(5) and len(a.block(5)) == 16    # fixed: the same in a fresh mapper
    assert a.block(5) != a.block(6) and a.block(5) != BlockTokens(16, 100, seed=1).block(5)
    assert all(0 <= t < 100 for h in range(50) for t in a.block(h))


def test_lengths_scale_by_block_tokens_over_the_source_block():
    m = BlockTokens(16, vocab=1000)
    # 1,100 tokens in 512-token blocks over 3 ids: the 2 whole blocks, or (head) with the last
    # block's head: ceil(1100 * 16 / 512) = 35 = 16 + 16 + 3
    assert m.prompt([7, 8, 9], 1100, 512) == m.block(7) + m.block(8)
    assert m.prompt([7, 8, 9], 1100, 512, "head") == m.block(7) + m.block(8) + m.block(9)[:3]
    for last in ("drop", "head"):
        assert len(m.prompt([7, 8, 9], 1536, 512, last)) == 48            # whole blocks: the same
        assert len(m.prompt([7, 8, 9], 9999, 512, last)) == 48            # never past its ids' blocks
        assert m.prompt([7], 100, 512, last) == m.block(7)[:4]            # under one block: its head
    assert len(m.prompt([7, 8, 9], 1030, 512, "head")) == 33             # every id gives at least one token
    assert len(BlockTokens(16, 1000).prompt([1, 2], 20, 16, "head")) == 20    # Bailian: 16 -> 16, unscaled
    assert [scaled_output(n, 16, 512) for n in (0, 6, 16, 500)] == [1, 1, 1, 16]


def test_dropping_the_partial_block_keeps_an_extended_prompt_a_prefix():
    # turn 2 extends turn 1; turn 1's last block was partial, so turn 2 has a whole block with a
    # new id there (the trace's ids cover whole block contents)
    m = BlockTokens(16, vocab=1000)
    turn1, turn2 = ([1, 2, 3], 1100), ([1, 2, 4, 5], 1900)
    drop = [m.prompt(ids, n, 512) for ids, n in (turn1, turn2)]
    head = [m.prompt(ids, n, 512, "head") for ids, n in (turn1, turn2)]
    assert drop[1][: len(drop[0])] == drop[0] and floors(drop).ends == [32, 16]
    assert head[1][: len(head[0])] != head[0] and floors(head).ends == [35, 60]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_three_formats_and_their_time_units(tmp_path):
    moon = _write(tmp_path / "m.jsonl", [
        {"timestamp": 1000, "input_length": 1024, "output_length": 64, "hash_ids": [0, 1]},
        {"timestamp": 3500, "input_length": 600, "output_length": 10, "hash_ids": [0, 2]}])
    fmt, reqs = load(moon, vocab=500)
    assert fmt == "mooncake"
    assert [(r.line, r.arrival_s, len(r.prompt), r.max_tokens) for r in reqs] == [(1, 0.0, 32, 2), (2, 2.5, 16, 1)]
    assert reqs[0].prompt[:16] == reqs[1].prompt                    # the shared id, the shared block
    assert [len(r.prompt) for r in load(moon, vocab=500, last_block="head")[1]] == [32, 19]
    bail = _write(tmp_path / "b.jsonl", [
        {"chat_id": 0, "parent_chat_id": -1, "timestamp": 10.0, "input_length": 40, "output_length": 5,
         "type": "text", "turn": 1, "hash_ids": [3, 4, 5]},
        {"chat_id": 1, "parent_chat_id": 0, "timestamp": 11.5, "input_length": 20, "output_length": 7,
         "type": "text", "turn": 2, "hash_ids": [3, 6]}])
    fmt, reqs = load(bail, vocab=500)
    assert fmt == "bailian"
    assert [(r.arrival_s, len(r.prompt), r.max_tokens) for r in reqs] == [(0.0, 32, 5), (1.5, 16, 7)]
    tok = _write(tmp_path / "t.jsonl", [{"prompt_token_ids": [5, 6, 7], "output_length": 3, "timestamp": 250}])
    fmt, reqs = load(tok, vocab=500)
    assert fmt == "tokens" and reqs[0].prompt == [5, 6, 7] and reqs[0].max_tokens == 3 and reqs[0].arrival_s == 0
    special = _write(tmp_path / "s.jsonl", [{"prompt_token_ids": [5, 510], "output_length": 1}])
    assert load(special, vocab=500, model_vocab=512)[1][0].prompt == [5, 510]   # a template's special token


def test_offset_limit_and_the_context_cut(tmp_path):
    rows = [{"timestamp": 100 * i, "input_length": 512 * 4, "output_length": 512, "hash_ids": [i, 10 + i, 20, 30]}
            for i in range(5)]
    path = _write(tmp_path / "m.jsonl", rows)
    _, reqs = load(path, vocab=500, offset=1, limit=3, max_context=40)
    assert [r.line for r in reqs] == [2, 3, 4] and reqs[0].arrival_s == 0.0   # arrivals from the first replayed
    r = reqs[0]
    assert (r.max_tokens, len(r.prompt), r.dropped) == (16, 24, 40)           # 64 tokens cut to 40 - 16
    full = load(path, vocab=500, offset=1, limit=1)[1][0]
    assert r.prompt == full.prompt[:24]                                       # the head is kept


@pytest.mark.parametrize("row,needle", [
    ({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": []}, "'hash_ids' must be a non-empty"),
    ({"timestamp": 0, "output_length": 1, "hash_ids": [1]}, "'input_length' must be a number"),
    ({"prompt_token_ids": [1, 999], "output_length": 1}, "token id 999 is outside the model's vocabulary 0..499"),
    ({"foo": 1}, "cannot tell the trace format"),
], ids=["empty-ids", "no-length", "token-out-of-vocab", "unknown"])
def test_a_bad_line_is_named(tmp_path, row, needle):
    path = _write(tmp_path / "bad.jsonl", [row])
    with pytest.raises(TraceError) as exc:
        load(path, vocab=500)
    assert needle in str(exc.value)
    if "tell" not in needle:
        assert f"{path}:1:" in str(exc.value)


def test_windows_group_by_arrival_and_skip_empty_ones(tmp_path):
    path = _write(tmp_path / "m.jsonl", [{"timestamp": t, "input_length": 512, "output_length": 1, "hash_ids": [i]}
                                         for i, t in enumerate([0, 1999, 2000, 7000, 7100])])
    _, reqs = load(path, vocab=500)
    assert [[r.line for r in g] for g in windows(reqs, 2.0)] == [[1, 2], [3], [4, 5]]


def test_the_saved_token_trace_replays_the_same_requests(tmp_path):
    path = _write(tmp_path / "m.jsonl", [{"timestamp": 40 * i, "input_length": 700, "output_length": 100,
                                          "hash_ids": [0, i + 1]} for i in range(3)])
    _, reqs = load(path, vocab=500, max_context=20)
    save_tokens(reqs, tmp_path / "t.jsonl")
    fmt, again = load(tmp_path / "t.jsonl", vocab=500)
    assert fmt == "tokens"
    assert [(r.prompt, r.max_tokens, r.arrival_s) for r in again] == [(r.prompt, r.max_tokens, r.arrival_s) for r in reqs]


def test_ordinary_vocabulary_stops_at_the_first_added_token(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 2048}))
    assert ordinary_vocab(tmp_path) == 2048
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"id": 2039, "content": "<|endoftext|>"},
                                                                          {"id": 2040, "content": "<|im_start|>"}]}))
    assert ordinary_vocab(tmp_path) == 2039


def test_the_checked_sample_spreads_over_the_slice():
    assert sample(600, 4) == [0, 200, 399, 599]
    assert sample(3, 8) == [0, 1, 2] and sample(10, 1) == [0] and sample(10, 0) == []
