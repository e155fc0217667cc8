"""The batched forward path against the per-sequence reference beside it.

Op level: ``decode_attention`` vs ``decode_attention_naive`` over ragged lengths that cross
page boundaries, GQA ratios 1/2/4, scattered pages, NaN in every slot a row must not read.
Model level: one call of 1–8 decode rows (with and without a prefill chunk over a cached
prefix) through ``paths.BATCHED`` and ``paths.PER_SEQUENCE`` on identical caches — logits,
the written KV and the GDN conv/SSM states.

Bounds are relative to the largest magnitude of the reference: float64 must agree to rounding
(``REL[float64]``); float32/bfloat16 differ only by summation order inside the ops, which
the layers after them amplify a little.
"""

from __future__ import annotations

import pytest
import torch

from ninfer.native.model import paths
from ninfer.native.model.attention import (
    decode_attention,
    decode_attention_naive,
    decode_kv_slots,
    write_kv,
)
from ninfer.native.model.config import PAGE_SIZE
from ninfer.native.model.forward import ForwardBatch, SeqInput
from ninfer.native.model.model import HybridModel
from tests.factories import random_prompt

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
REL = {"float64": 1e-12, "float32": 1e-5, "bfloat16": 1e-2}   # model level (5 layers deep)
OP_REL = {"float64": 1e-13, "float32": 1e-6, "bfloat16": 1e-2}


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


# ---- op level ----------------------------------------------------------------------------

def _paged_kv(lens: list[int], hkv: int, d: int, dtype: torch.dtype, seed: int):
    """A NaN-filled pool with each row's first ``lens[b]`` positions written, on shuffled
    pages; tables carry one spare page past what the row needs (as a reservation does)."""
    g = torch.Generator().manual_seed(seed)
    need = [(n + PAGE_SIZE - 1) // PAGE_SIZE + 1 for n in lens]
    order = torch.randperm(sum(need), generator=g).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(order[at:at + n])
        at += n
    k_cache = torch.full((sum(need), PAGE_SIZE, hkv, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    for n, t in zip(lens, tables):
        slots = torch.tensor([t[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in range(n)])
        write_kv(k_cache, v_cache, slots, torch.randn(n, hkv, d, generator=g).to(dtype),
                 torch.randn(n, hkv, d, generator=g).to(dtype))
    return k_cache, v_cache, tables


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2)], ids=lambda h: f"H{h[0]}-Hkv{h[1]}")
@pytest.mark.parametrize("lens", [[1], [64, 65], [63, 1, 129, 200], [5, 64, 65, 127, 128, 129, 191, 300]],
                         ids=lambda ls: "len" + "-".join(map(str, ls)))
def test_decode_attention_equals_rows_alone(dtype, heads, lens):
    h, hkv = heads
    d = 32
    dt = DTYPES[dtype]
    k_cache, v_cache, tables = _paged_kv(lens, hkv, d, dt, seed=len(lens) + h)
    width = max((n + PAGE_SIZE - 1) // PAGE_SIZE for n in lens)
    block_table = torch.tensor([t[:width] + t[:1] * (width - len(t[:width])) for t in tables])
    kv_lens = torch.tensor(lens)
    q = torch.randn(len(lens), h, d, generator=torch.Generator().manual_seed(1)).to(dt)
    got = decode_attention(q, k_cache, v_cache, block_table, kv_lens, d ** -0.5)
    ref = decode_attention_naive(q, k_cache, v_cache, block_table, kv_lens, d ** -0.5)
    assert got.dtype == dt and got.shape == q.shape
    assert torch.isfinite(got).all(), "a masked slot (NaN) leaked into the output"
    assert rel_err(got, ref) < OP_REL[dtype]
    # the gather index built once per call (as ForwardBatch does: L = max kv_len, not whole pages)
    slots = decode_kv_slots(block_table, kv_lens, max(lens))
    assert rel_err(decode_attention(q, k_cache, v_cache, block_table, kv_lens, d ** -0.5, slots), ref) < OP_REL[dtype]


# ---- model level -------------------------------------------------------------------------

# decode rows: context length n (positions 0..n-2 cached, the row is position n-1); chosen so
# that kv lengths sit on both sides of the page boundaries 64 and 128
CONTEXTS = [5, 64, 65, 128, 129, 63, 200, 1]
CHUNK_PREFIX, CHUNK_LEN = 70, 60          # the chunk runs positions 70..129 over a cached prefix
ORDER = [6, 0, 3, 7, 1, 4, 2, 5]          # batch order differs from slot and page order


class Prepared:
    """A model and a cache holding every sequence's prefix, each written alone."""

    def __init__(self, model: HybridModel, seed: int):
        self.model = model
        self.prompts = [random_prompt(n, seed=seed + i) for i, n in enumerate(CONTEXTS)]
        self.chunk_tokens = random_prompt(CHUNK_PREFIX + CHUNK_LEN, seed=seed + 99)
        n_seqs = len(CONTEXTS) + 1
        lens = [*CONTEXTS, CHUNK_PREFIX + CHUNK_LEN]
        need = [(n + PAGE_SIZE - 1) // PAGE_SIZE + 1 for n in lens]
        order = torch.randperm(sum(need), generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables, at = [], 0
        for n in need:
            self.tables.append(order[at:at + n])
            at += n
        self.slots = list(reversed(range(n_seqs)))
        cache = model.new_cache(sum(need), n_seqs)
        cache.k.fill_(float("nan"))       # unwritten slots must never be read
        cache.v.fill_(float("nan"))
        prefixes = [p[:-1] for p in self.prompts] + [self.chunk_tokens[:CHUNK_PREFIX]]
        for i, toks in enumerate(prefixes):
            if toks:
                batch = ForwardBatch.build([SeqInput(toks, 0, self.tables[i], self.slots[i], "none")])
                model.forward(batch, cache)
        self.cache = cache

    def step(self, n_decode: int, with_chunk: bool) -> list[SeqInput]:
        rows = [SeqInput([self.prompts[i][-1]], CONTEXTS[i] - 1, self.tables[i], self.slots[i])
                for i in ORDER[:n_decode]]
        if with_chunk:
            c = len(CONTEXTS)
            rows.insert(len(rows) // 2, SeqInput(self.chunk_tokens[CHUNK_PREFIX:], CHUNK_PREFIX,
                                                 self.tables[c], self.slots[c], "all"))
        return rows

    def run(self, path, rows: list[SeqInput]):
        cache = type(self.cache)(*(t.clone() for t in (self.cache.k, self.cache.v, self.cache.conv, self.cache.ssm)))
        before, self.model.path = self.model.path, path
        try:
            out = self.model.forward(ForwardBatch.build(rows), cache)
        finally:
            self.model.path = before
        return out, cache


_PREPARED: dict[tuple[str, str], Prepared] = {}


def prepared(model_dir: str, dtype: str) -> Prepared:
    key = (model_dir, dtype)
    if key not in _PREPARED:
        _PREPARED[key] = Prepared(HybridModel.load(model_dir, dtype), seed=11)
    return _PREPARED[key]


def _written_kv(cache, rows: list[SeqInput]):
    """K and V at every position a row of the call wrote (the rest is NaN or the shared prefix)."""
    slots = [t.page_table[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE
             for t in rows for p in range(t.start, t.start + len(t.token_ids))]
    idx = torch.tensor(slots)
    flat = lambda x: x.view(x.shape[0], -1, *x.shape[3:])[:, idx]
    return flat(cache.k), flat(cache.v)


def _compare(prep: Prepared, rows: list[SeqInput], dtype: str, path=paths.BATCHED) -> None:
    got, got_cache = prep.run(path, rows)
    ref, ref_cache = prep.run(paths.PER_SEQUENCE, rows)
    bound = REL[dtype]
    assert rel_err(got.logits, ref.logits) < bound
    assert rel_err(got.hidden, ref.hidden) < bound
    for a, b in zip(_written_kv(got_cache, rows), _written_kv(ref_cache, rows)):
        assert torch.isfinite(a).all() and rel_err(a, b) < bound
    state_slots = [r.state_slot for r in rows]
    if got_cache.conv.numel():
        assert rel_err(got_cache.conv[:, state_slots], ref_cache.conv[:, state_slots]) < bound
        assert rel_err(got_cache.ssm[:, state_slots], ref_cache.ssm[:, state_slots]) < bound
    if dtype != "bfloat16":
        assert torch.equal(got.logits.argmax(-1), ref.logits.argmax(-1))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("with_chunk", [False, True], ids=["decode-only", "with-chunk"])
@pytest.mark.parametrize("n_decode", [1, 2, 5, 8], ids=lambda n: f"B{n}")
def test_hybrid_forward_batched_equals_per_sequence(tiny_model, dtype, with_chunk, n_decode):
    prep = prepared(tiny_model, dtype)
    _compare(prep, prep.step(n_decode, with_chunk), dtype)


@pytest.mark.parametrize("with_chunk", [False, True], ids=["decode-only", "with-chunk"])
def test_pure_attention_forward_batched_equals_per_sequence(tiny_qwen3, with_chunk):
    prep = prepared(tiny_qwen3, "float64")
    _compare(prep, prep.step(8, with_chunk), "float64")


def test_chunk_alone_is_the_same_op_on_both_paths(tiny_model):
    """No decode rows: the batched path is the chunk ops, bit for bit."""
    prep = prepared(tiny_model, "float64")
    rows = prep.step(0, True)
    got, got_cache = prep.run(paths.BATCHED, rows)
    ref, ref_cache = prep.run(paths.PER_SEQUENCE, rows)
    assert torch.equal(got.logits, ref.logits)
    assert torch.equal(got_cache.ssm, ref_cache.ssm)


def test_batched_decode_equals_isolated_calls(tiny_model):
    """Each decode row of a batched call equals that row run in a call of its own."""
    prep = prepared(tiny_model, "float64")
    rows = prep.step(8, True)
    got, _ = prep.run(paths.BATCHED, rows)
    logit_rows = []
    for r in rows:
        out, _ = prep.run(paths.BATCHED, [r])
        logit_rows.append(out.logits)
    assert rel_err(got.logits, torch.cat(logit_rows)) < REL["float64"]


def _verify_rows(prep: Prepared, which: list[int], n: int) -> list[SeqInput]:
    """Sequence i of ``which`` as a verify row of ``n`` inputs (its next token and n - 1 drafts)
    from its decode position on; some cross a page boundary."""
    rows = []
    for i in which:
        drafts = [(13 * i + j) % 1000 + 5 for j in range(n - 1)]
        rows.append(SeqInput([prep.prompts[i][-1], *drafts], CONTEXTS[i] - 1, prep.tables[i], prep.slots[i], "all",
                             verify=True))
    return rows


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mix", ["verify-only", "with-decode", "with-decode-and-chunk"])
def test_verify_rows_batched_equal_per_sequence(tiny_model, dtype, mix):
    """Verify rows of one length in one attention op (``verify_attention``) equal each row
    computed alone, beside decode rows and a chunk."""
    prep = prepared(tiny_model, dtype)
    rows = _verify_rows(prep, [1, 6, 2, 3], 4)                # kv lengths 64, 200, 65, 128 (+3)
    if mix != "verify-only":
        rows = prep.step(3, mix == "with-decode-and-chunk")[:3] + rows
        rows = [r for r in rows if r.state_slot not in {prep.slots[i] for i in (1, 6, 2, 3)} or r.verify]
    batch = ForwardBatch.build(rows)
    assert batch.verify_len == 4 and len(batch.verify_seqs) == 4
    assert len(batch.decode_seqs) == (mix != "verify-only") and len(batch.chunk_seqs) == (mix == "with-decode-and-chunk")
    _compare(prep, rows, dtype)


def test_verify_rows_of_mixed_lengths_take_the_grouped_path(tiny_model):
    prep = prepared(tiny_model, "float64")
    rows = _verify_rows(prep, [1, 6], 4) + _verify_rows(prep, [2], 3)
    assert ForwardBatch.build(rows).verify_len == 0
    _compare(prep, rows, "float64")


def test_a_calls_index_tensors_are_one_upload():
    """Every index tensor of a call (ids, positions, slots, tables, rows, decode and verify
    metadata) is a view of one buffer: one pinned, asynchronous host-to-device copy per call on
    CUDA, where there was one blocking copy per tensor and per sequence (~10 + N)."""
    from ninfer.native.model.forward import SeqInput
    rows = [SeqInput([5], 70, [3, 4], 0), SeqInput([6, 7, 8], 10, [1], 1, "all", verify=True),
            SeqInput([9, 10, 11, 12], 0, [2], 2), SeqInput([13], 3, [5], 3)]
    b = ForwardBatch.build(rows)
    tensors = [b.input_ids, b.positions, b.state_slots, b.slot_mapping, b.logits_rows, *b.page_tables,
               b.decode_rows, b.decode_slots, b.decode_kv_lens, b.decode_block_table, b.verify_slots,
               b.verify_starts, b.verify_block_table, b.verify_rows]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    assert b.verify_len == 3 and b.decode_block_table.tolist() == [[3, 4], [5, 5]]
    assert b.positions.tolist() == [70, 10, 11, 12, 0, 1, 2, 3, 3] and b.page_tables[0].tolist() == [3, 4]
