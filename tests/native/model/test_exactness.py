"""Float64 exactness of the model math: however a sequence is cut into calls, the result is the
same — one-shot prefill == chunked prefill with carried state == token-by-token decode — for
GDN, conv and paged attention across page boundaries. This is what makes every later cache,
chunking and resume path invisible in the output."""

from __future__ import annotations

import pytest
import torch

from ninfer.native.model import gdn
from ninfer.native.model.forward import ForwardBatch, SeqInput
from ninfer.native.model.model import HybridModel
from tests.factories import logits_in_chunks, random_prompt

TOL = 1e-9


@pytest.fixture(scope="module")
def model64(tiny_model) -> HybridModel:
    return HybridModel.load(tiny_model, "float64")


@pytest.fixture(scope="module")
def qwen3_64(tiny_qwen3) -> HybridModel:
    return HybridModel.load(tiny_qwen3, "float64")


@pytest.fixture(scope="module")
def one_shot(model64):
    tokens = random_prompt(200, seed=7)
    return tokens, logits_in_chunks(model64, tokens, [])


@pytest.mark.parametrize("cuts", [
    [63], [64], [65], [127], [128], [129],
    [1, 2, 3], [63, 64, 65, 127, 128, 129], [17, 100, 199], [5, 70, 133, 190],
], ids=lambda c: "cut@" + "-".join(map(str, c)))
def test_chunked_prefill_equals_one_shot(model64, one_shot, cuts):
    tokens, ref = one_shot
    got = logits_in_chunks(model64, tokens, cuts)
    assert (got - ref).abs().max().item() < TOL
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_token_by_token_decode_equals_one_shot(model64, one_shot):
    tokens, ref = one_shot
    got = logits_in_chunks(model64, tokens, list(range(1, len(tokens))))
    assert (got - ref).abs().max().item() < TOL
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_pure_attention_model_is_cut_invariant(qwen3_64):
    tokens = random_prompt(150, seed=3)
    ref = logits_in_chunks(qwen3_64, tokens, [])
    for cuts in ([64], [63, 65, 128, 129], list(range(1, 150))):
        got = logits_in_chunks(qwen3_64, tokens, cuts)
        assert (got - ref).abs().max().item() < TOL


def test_scattered_pages_and_slots_equal_contiguous(model64, one_shot):
    """The page table is an indirection: any permutation of physical pages gives the same math."""
    tokens, ref = one_shot
    table = [7, 2, 5, 0]          # 4 pages for 200 tokens, deliberately out of order
    cache = model64.new_cache(8, 3)
    got = logits_in_chunks(model64, tokens, [64, 130], page_table=table, slot=2, cache=cache)
    assert (got - ref).abs().max().item() < TOL


def test_batched_decode_rows_and_a_chunk_equal_isolated_runs(model64):
    """One call mixing decode rows of several sequences with one prefill chunk equals each
    sequence computed alone."""
    seqs = [random_prompt(n, seed=s) for n, s in ((70, 1), (129, 2), (5, 3))]
    chunk_tokens = random_prompt(90, seed=4)
    alone = [logits_in_chunks(model64, s, [])[-1] for s in seqs]
    alone_chunk = logits_in_chunks(model64, chunk_tokens, [])[-1]

    cache = model64.new_cache(16, 4)
    tables = [[0, 1], [2, 3, 4], [5], [6, 7]]
    # bring each sequence to its last token, separately
    for i, s in enumerate(seqs):
        logits_in_chunks(model64, s[:-1], [], page_table=tables[i], slot=i, cache=cache)
    rows = [SeqInput([s[-1]], len(s) - 1, tables[i], i) for i, s in enumerate(seqs)]
    rows.append(SeqInput(chunk_tokens, 0, tables[3], 3))
    out = model64.forward(ForwardBatch.build(rows), cache).logits
    for i in range(3):
        assert (out[i] - alone[i]).abs().max().item() < TOL
    assert (out[3] - alone_chunk).abs().max().item() < TOL


# ---- op level: the two GDN forms and the conv, with explicit initial states ---------------

def _gdn_inputs(T: int, seed: int, hk=2, hv=4, dk=16, dv=8):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    q, k, v = r(T, hk, dk), r(T, hk, dk), r(T, hv, dv)
    decay = -torch.rand(T, hv, generator=g, dtype=torch.float64) * 0.5
    beta = torch.rand(T, hv, generator=g, dtype=torch.float64)
    s0 = r(hv, dk, dv) * 0.1
    return q, k, v, decay, beta, s0


@pytest.mark.parametrize("T", [1, 5, 63, 64, 65, 130])
def test_chunk_rule_equals_recurrent_rule(T):
    q, k, v, g, beta, s0 = _gdn_inputs(T, seed=T)
    o_c, s_c = gdn.chunk_gated_delta_rule(q, k, v, g, beta, s0)
    o_r, s_r = gdn.recurrent_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], s0[None])
    assert (o_c - o_r[0]).abs().max().item() < TOL
    assert (s_c - s_r[0]).abs().max().item() < TOL


def test_chunk_rule_continues_from_its_own_final_state():
    q, k, v, g, beta, s0 = _gdn_inputs(150, seed=11)
    o_all, s_all = gdn.chunk_gated_delta_rule(q, k, v, g, beta, s0)
    o1, s1 = gdn.chunk_gated_delta_rule(q[:77], k[:77], v[:77], g[:77], beta[:77], s0)
    o2, s2 = gdn.chunk_gated_delta_rule(q[77:], k[77:], v[77:], g[77:], beta[77:], s1)
    assert (torch.cat([o1, o2]) - o_all).abs().max().item() < TOL
    assert (s2 - s_all).abs().max().item() < TOL


@pytest.mark.parametrize("T", [1, 2, 3, 10])
def test_conv_prefill_equals_steps(T):
    g = torch.Generator().manual_seed(T)
    C, K = 12, 4
    x = torch.randn(T, C, generator=g, dtype=torch.float64)
    w = torch.randn(C, K, generator=g, dtype=torch.float64)
    state = torch.randn(C, K - 1, generator=g, dtype=torch.float64)
    y, final = gdn.causal_conv1d(x, state, w)
    s = state[None]
    for t in range(T):
        y_t, s = gdn.causal_conv1d_step(x[t:t + 1], s, w)
        assert (y_t[0] - y[t]).abs().max().item() < TOL
    assert torch.equal(s[0], final)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("T", [gdn.CONV_SPLIT_ROWS, gdn.CONV_SPLIT_ROWS + 1, 2000])
def test_long_conv_leaves_x_in_place_with_the_same_bits(dtype, T, monkeypatch):
    """A chunk of ``CONV_SPLIT_ROWS`` or more rows is convolved without concatenating x to the
    state: the same products summed in the same order as the concatenated form, bit for bit,
    output and final state — the first K-1 rows (which read the state) included."""
    g = torch.Generator().manual_seed(T)
    C, K = 24, 4
    x, w, state = (torch.randn(*s, generator=g, dtype=dtype) for s in ((T, C), (C, K), (C, K - 1)))
    y, final = gdn.causal_conv1d(x, state, w)
    monkeypatch.setattr(gdn, "CONV_SPLIT_ROWS", T + 1)       # the concatenated form
    y_cat, final_cat = gdn.causal_conv1d(x, state, w)
    assert torch.equal(y, y_cat) and torch.equal(final, final_cat)
